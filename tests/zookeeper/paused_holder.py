"""A holder in its own process, to be paused (SIGSTOP) while it holds: once resumed, it
asks for its lease to be renewed and reports the answer."""

from __future__ import annotations

import signal
import sys
import time

import dlock

url, name = sys.argv[1], sys.argv[2]
resumed: list[int] = []
signal.signal(signal.SIGCONT, lambda signum, frame: resumed.append(signum))
with dlock.connect(url) as client:
    lock = client.lock(name, ttl=60, auto_renew=False)
    assert lock.acquire(timeout=5)
    print("held", flush=True)
    # Told by the SIGCONT that ends the pause, however short the pause was.
    while not resumed:
        time.sleep(0.01)
    try:
        lock.extend()
        print("renewed", flush=True)
    except dlock.LockLost:
        print("lost", flush=True)
    except dlock.LockError as exc:
        print(f"failed: {exc!r}", flush=True)
