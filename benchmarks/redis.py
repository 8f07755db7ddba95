"""Redis: dlock against the raw minimal operations and the locks users pick instead.

    .venv/bin/python -m benchmarks.redis [--quick]

Starts its own redis-server processes (one server, plus three masters for the Redlock
rows), then measures, in one run and with the same redis-py client library:
uncontended acquire+release, and 8 processes contending on one name.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import redis
import redis_lock  # type: ignore[import-untyped]
from pottery import Redlock

from benchmarks.common import (
    Contention,
    DlockHandle,
    Latency,
    combine_rounds,
    dlock_ops,
    measure_contention_rounds,
    measure_latencies,
    print_table,
)
from tests.servers.redis import RedisServer, start_masters, start_single

ASYNC = "dlock asyncio"
TTL = 30.0
#: Contention runs per setup, interleaved: one run lasts well under a second.
CONTENTION_ROUNDS = 3
#: The usual minimal recipe: compare-and-delete, so a late release cannot free another's lease.
CAD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Raw:
    """SET NX PX to acquire (polling every millisecond while taken), CAD script to release."""

    def __init__(self, port: int) -> None:
        self.client = redis.Redis(port=port)
        self.cad = self.client.register_script(CAD)
        self.key = "raw:bench"
        self.token = uuid.uuid4().hex

    def acquire(self) -> None:
        while not self.client.set(self.key, self.token, nx=True, px=int(TTL * 1000)):
            time.sleep(0.001)

    def release(self) -> None:
        self.cad(keys=[self.key], args=[self.token])

    def close(self) -> None:
        self.client.close()


class RedisPyHandle:
    """redis-py's Lock with its defaults: polls every 0.1 s while the lock is taken."""

    def __init__(self, port: int, name: str) -> None:
        self.client = redis.Redis(port=port)
        self.lock = self.client.lock(name, timeout=TTL)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.client.close()


class PythonRedisLockHandle:
    def __init__(self, port: int, name: str) -> None:
        self.client = redis.Redis(port=port)
        self.lock = redis_lock.Lock(self.client, name, expire=int(TTL))

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.client.close()


class PotteryHandle:
    def __init__(self, ports: list[int], name: str) -> None:
        self.clients = [redis.Redis(port=port) for port in ports]
        self.lock = Redlock(key=name, masters=set(self.clients), auto_release_time=TTL)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        for client in self.clients:
            client.close()


def open_lock(config: tuple[str, Any, str]) -> Any:
    """Module-level, so spawned contender processes can build their own handle."""
    kind, where, name = config
    logging.getLogger("pottery").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    if kind == "raw":
        raw = Raw(where)
        raw.key = name
        return raw
    if kind == "dlock":
        return DlockHandle(where, name, ttl=TTL)
    if kind == "redis-py":
        return RedisPyHandle(where, name)
    if kind == "python-redis-lock":
        return PythonRedisLockHandle(where, name)
    if kind == "pottery":
        return PotteryHandle(where, name)
    raise ValueError(kind)


def latencies(
    setups: list[tuple[str, tuple[str, Any, str]]], url: str, iterations: int, rounds: int
) -> dict[str, Latency]:
    """Uncontended acquire+release of every setup, plus dlock's asyncio face, measured in
    interleaved rounds (the machine's noise drifts over seconds)."""
    handles = {label: open_lock(config) for label, config in setups}
    ops: dict[str, Callable[[], object]] = {}
    for label, handle in handles.items():

        def op(handle: Any = handle) -> None:
            handle.acquire()
            handle.release()

        ops[label] = op
    try:
        with dlock_ops(url) as faces:
            ops[ASYNC] = faces["dlock asyncio"]
            return measure_latencies(ops, iterations, warmup=iterations // 10, rounds=rounds)
    finally:
        for handle in handles.values():
            handle.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = parser.parse_args()
    iterations, rounds, sections = (400, 2, 20) if args.quick else (5000, 25, 200)
    single: RedisServer = start_single("bench-redis")
    masters = start_masters()
    try:
        port = single.port
        url = f"redis://{single.address}/0"
        redlock_url = "redis+redlock://" + ",".join(m.address for m in masters)
        ports = [m.port for m in masters]
        setups: list[tuple[str, tuple[str, Any, str]]] = [
            ("raw SET NX PX + CAD", ("raw", port, "raw")),
            ("dlock", ("dlock", url, "dlock")),
            ("redis-py Lock", ("redis-py", port, "redispy")),
            ("python-redis-lock", ("python-redis-lock", port, "prl")),
            ("pottery Redlock (1 master)", ("pottery", [port], "pottery1")),
            ("dlock Redlock (3 masters)", ("dlock", redlock_url, "dlock3")),
            ("pottery Redlock (3 masters)", ("pottery", ports, "pottery3")),
        ]
        lats = latencies(setups, url, iterations, rounds)
        print("  measured uncontended latency", file=sys.stderr, flush=True)
        runs = measure_contention_rounds(
            {label: (open_lock, config) for label, config in setups},
            rounds=CONTENTION_ROUNDS,
            processes=8,
            sections=sections,
        )
        cons = {label: combine_rounds(results) for label, results in runs.items()}
        rows: list[tuple[str, Latency | None, Contention | None]] = []
        for label, _ in setups:
            rows.append((label, lats[label], cons[label]))
            if label == "dlock":
                rows.append((ASYNC, lats[ASYNC], None))
        print_table(
            "Redis 7, one server (Redlock rows: three masters); latency: "
            f"{rounds} interleaved rounds of {iterations // rounds}; contention: 8 processes x "
            f"{sections} sections, {CONTENTION_ROUNDS} interleaved rounds (median rate and "
            "hand-off, longest wait of all rounds, counters added up)",
            rows,
            "raw SET NX PX + CAD",
        )
        return 0 if all(con is None or con.counter == con.expected for _, _, con in rows) else 1
    finally:
        single.remove()
        for master in masters:
            master.remove()


if __name__ == "__main__":
    sys.exit(main())
