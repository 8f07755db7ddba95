"""etcd: what a client's idle waiters cost the cluster and the client, in one run.

    python -m benchmarks.etcd_waiters [--waiters N] [--seconds S] [--face sync|asyncio]

Starts one private etcd (the test harness's). A holder client takes N names; one other
client waits for all of them (N threads, or N tasks under asyncio), with the default
fallback (the core ends a notifying wait every 2 s). Once every waiter has queued and
its first fallback has passed, it counts for S seconds the requests etcd began (its
own metrics, by gRPC method) and the CPU this process used, then lets go and times the
hand-over of all N names. The baseline is the waiters' own number: requests per waiter
per second, where one watch per fallback (0.5 a second) is the least a waiter that
does not keep its watch open across the core's waits sends.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import threading
import time
import uuid
from collections import Counter

import httpx

import dlock
import dlock.aio
from tests.servers.etcd import EtcdServer

METHODS = ("LeaseKeepAlive", "Watch", "Range", "Txn", "LeaseGrant", "LeaseRevoke")


def started(server: EtcdServer) -> Counter[str]:
    """gRPC calls etcd has begun, by method (every client's, counted by the server)."""
    text = httpx.get(f"http://{server.address}/metrics", timeout=5, trust_env=False).text
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("grpc_server_started_total{"):
            for method in METHODS:
                if f'grpc_method="{method}"' in line:
                    counts[method] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def queued(server: EtcdServer, prefix: str) -> int:
    """How many queue keys there are under ``prefix`` (the byte 0xFF marks them)."""
    start = f"{prefix}/".encode() + b"\xff"
    answer = httpx.post(
        f"http://{server.address}/v3/kv/range",
        json={
            "key": base64.b64encode(start).decode(),
            "range_end": base64.b64encode(f"{prefix}0".encode()).decode(),
            "count_only": True,
        },
        timeout=5,
        trust_env=False,
    )
    return int(answer.json().get("count", 0))


def settle(server: EtcdServer, prefix: str, waiters: int) -> None:
    deadline = time.monotonic() + 60
    while queued(server, prefix) < waiters:
        if time.monotonic() > deadline:
            raise RuntimeError("the waiters did not all queue within 60 s")
        time.sleep(0.05)
    time.sleep(2.5)  # past every waiter's first fallback


def report(counts: Counter[str], cpu: float, seconds: float, waiters: int, handover: float) -> None:
    total = sum(counts.values())
    print(f"{waiters} idle waiters of one client, {seconds:.0f} s:")
    for method in METHODS:
        print(f"  {method:<15} {counts[method] / seconds:8.1f} a second")
    per = total / seconds / waiters
    print(f"  all requests    {total / seconds:8.1f} a second: {per:.2f} per waiter")
    print(f"  vs a watch per 2 s fallback (0.50 per waiter): {per / 0.5:.2f}x")
    print(f"  CPU of this process: {cpu / seconds * 100:.1f}% of one CPU")
    print(f"hand-over of all {waiters} names: {handover:.2f} s")


def run_sync(server: EtcdServer, prefix: str, waiters: int, seconds: float) -> None:
    url = server.url(prefix)
    with dlock.connect(url) as holder, dlock.connect(url) as client:
        names = [uuid.uuid4().hex for _ in range(waiters)]
        held = [holder.lock(name, ttl=60) for name in names]
        for lock in held:
            assert lock.acquire(timeout=0)
        got: list[bool] = []
        locks = [client.lock(name, ttl=60) for name in names]
        threads = [
            threading.Thread(target=lambda lock=lock: got.append(lock.acquire(timeout=120)))
            for lock in locks
        ]
        for thread in threads:
            thread.start()
        settle(server, prefix, waiters)
        before, cpu = started(server), time.process_time()
        time.sleep(seconds)
        counts, cpu = started(server) - before, time.process_time() - cpu
        began = time.monotonic()
        for lock in held:
            lock.release()
        for thread in threads:
            thread.join()
        handover = time.monotonic() - began
        assert got == [True] * waiters
        for lock in locks:
            lock.release()
    report(counts, cpu, seconds, waiters, handover)


async def run_asyncio(server: EtcdServer, prefix: str, waiters: int, seconds: float) -> None:
    url = server.url(prefix)
    async with dlock.aio.connect(url) as holder, dlock.aio.connect(url) as client:
        names = [uuid.uuid4().hex for _ in range(waiters)]
        held = [holder.lock(name, ttl=60) for name in names]
        for lock in held:
            assert await lock.acquire(timeout=0)
        locks = [client.lock(name, ttl=60) for name in names]
        tasks = [asyncio.create_task(lock.acquire(timeout=120)) for lock in locks]
        await asyncio.to_thread(settle, server, prefix, waiters)
        before, cpu = started(server), time.process_time()
        await asyncio.sleep(seconds)
        counts, cpu = started(server) - before, time.process_time() - cpu
        began = time.monotonic()
        for lock in held:
            await lock.release()
        got = await asyncio.gather(*tasks)
        handover = time.monotonic() - began
        assert list(got) == [True] * waiters
        for lock in locks:
            await lock.release()
    report(counts, cpu, seconds, waiters, handover)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=120)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--face", choices=("sync", "asyncio"), default="asyncio")
    args = parser.parse_args()
    server = EtcdServer()
    server.start()
    try:
        prefix = f"/dlock-waiters-{uuid.uuid4().hex[:8]}"
        if args.face == "sync":
            run_sync(server, prefix, args.waiters, args.seconds)
        else:
            asyncio.run(run_asyncio(server, prefix, args.waiters, args.seconds))
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
