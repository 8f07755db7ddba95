"""A waiter in its own process, to be paused (SIGSTOP) while it waits in the queue:
it reports the answer of its acquire, made once it is resumed. Woken by the watch on
the node ahead only: its fallback wake would race the event as it resumes."""

from __future__ import annotations

import sys

import dlock

url, name = sys.argv[1], sys.argv[2]
with dlock.connect(url, backoff=dlock.Backoff(notify_fallback=60)) as client:
    assert client.inspect(name) is not None, "the test holds the lock first"
    lock = client.lock(name, ttl=60)
    print("waiting", flush=True)
    try:
        acquired = lock.acquire(timeout=10)
        print(f"acquired {lock.fencing_token}" if acquired else "timed out", flush=True)
    except dlock.LockError as exc:
        print(f"failed: {exc!r}", flush=True)
