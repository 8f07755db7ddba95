"""A holder of an etcd lock in its own process, for tests/test_etcd.py to pause (SIGSTOP)
or kill (SIGKILL) while it holds, its lease renewed automatically.

    python -m tests.etcd_holder URL NAME TTL

Acquires, prints "held TOKEN", and waits. Once resumed by SIGCONT, it prints what it
then finds, one line of JSON: whether it still owns the lock, whether it was told of a
loss (``lost``, ``on_lost``), what ``extend`` and ``release`` raise, and what its
backend answers to a release and an extend sent straight to it under the hold's owner
token, as a holder whose core missed the loss would send them.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import dlock

url, name, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
resumed: list[int] = []
signal.signal(signal.SIGCONT, lambda signum, frame: resumed.append(signum))
told: list[float] = []


def outcome(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except dlock.LockError as exc:
        return type(exc).__name__
    return "ok"


with dlock.connect(url) as client:
    lock = client.lock(name, ttl=ttl, on_lost=lambda lock: told.append(time.monotonic()))
    assert lock.acquire(timeout=5)
    token = lock._token
    print(f"held {lock.fencing_token}", flush=True)
    while not resumed:
        time.sleep(0.01)
    report = {
        "owned": lock.owned(),
        "lost": lock.lost,
        "extend": outcome(lock.extend),
        "on_lost": len(told),
        "release": outcome(lock.release),
        "backend_release": client._backend.release(name, token),
        "backend_extend": client._backend.extend(name, token, ttl),
    }
    print(json.dumps(report), flush=True)
