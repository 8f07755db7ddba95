"""A waiter for an etcd lock in its own process, for tests/test_etcd.py to queue behind
a holder, and to kill while it waits.

    python -m tests.etcd_waiter URL NAME LABEL TIMEOUT HOLD

Prints "waiting" once its client exists, then acquires within TIMEOUT seconds, under
the holder label LABEL. Granted, it holds the lock HOLD seconds, releases it, and
prints "held FENCING START END" (START and END on the host's monotonic clock, which
every process shares); else it prints "timeout".
"""

from __future__ import annotations

import sys
import time

import dlock

url, name, label = sys.argv[1], sys.argv[2], sys.argv[3]
timeout, hold = float(sys.argv[4]), float(sys.argv[5])

with dlock.connect(url, label=label) as client:
    lock = client.lock(name, ttl=30)
    print("waiting", flush=True)
    if lock.acquire(timeout=timeout):
        start = time.monotonic()
        fencing = lock.fencing_token
        time.sleep(hold)
        end = time.monotonic()
        lock.release()
        print(f"held {fencing} {start} {end}", flush=True)
    else:
        print("timeout", flush=True)
