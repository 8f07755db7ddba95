"""A waiter in its own process: queue for the lock, report when queued and when it got in."""

from __future__ import annotations

import sys
import time

import dlock

url, name = sys.argv[1], sys.argv[2]
with dlock.connect(url) as client:
    lock = client.lock(name, ttl=10)
    with lock:
        print(f"acquired {time.monotonic()} {lock.fencing_token}", flush=True)
        time.sleep(0.05)
