"""etcd: dlock against the raw minimal lock operations and tooz's etcd3gw lock, in one run.

    python -m benchmarks.etcd [--iterations N] [--processes P] [--sections S]
                              [--rounds R] [--quick]

Starts one private etcd (the test harness's: one member on loopback, data on disk, or in
/dev/shm with ``--tmpfs``, which leaves out the disk flush of every write) and
measures, in one run, uncontended acquire+release and then P processes taking one name
S times each, over R alternating rounds.

The raw baseline is the least a correct etcd lock does, with the same client as dlock's
sync face (httpx against the v3 JSON gateway): grant a lease, put the key if it was never
created (``create_revision == 0``) bound to that lease, then delete the key and revoke
the lease — four requests, three of them writes through raft. Shown as well: the floor
without a lease (the transaction and the delete: a lock that a crashed holder keeps
forever), the grant and transaction released by the revoke alone (revoking a lease
deletes the keys bound to it), and the baseline on httpx's ``AsyncClient``, the client of
dlock's asyncio face. The peer is tooz's etcd3gw driver, the etcd lock of
OpenStack's coordination library (requests against the same gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from tooz import coordination

from benchmarks.common import (
    Contention,
    Latency,
    LockHandle,
    contention_rows,
    dlock_ops,
    measure_contention_rounds,
    measure_latencies,
    open_dlock,
    print_round_rates,
    print_table,
)
from dlock._sync.backends.etcd import b64
from tests.servers.etcd import EtcdServer

RAW = "raw grant+txn, delete+revoke"
RAW_ASYNC = "raw, httpx AsyncClient"
RAW_REVOKE = "raw grant+txn, revoke only"
FLOOR = "raw txn, delete (no lease)"
TOOZ = "tooz etcd3gw Lock"
#: Seconds: the lease of every lock here (dlock's ttl, tooz's lock_timeout, the raw
#: grant), long enough that nothing is renewed in a timed call.
TTL = 30


class Raw:
    """The raw operations on one httpx client; each checks its answer."""

    def __init__(self, port: int) -> None:
        self.http = httpx.Client(trust_env=False, timeout=10)
        self.base = f"http://127.0.0.1:{port}/v3"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(self.base + path, json=body)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def grant(self) -> str:
        return str(self.post("/lease/grant", {"TTL": str(TTL)})["ID"])

    def put_if_absent(self, key: str, lease: str | None) -> None:
        put: dict[str, Any] = {"key": key, "value": b64(b"holder")}
        if lease is not None:
            put["lease"] = lease
        answer = self.post(
            "/kv/txn",
            {
                "compare": [{"target": "CREATE", "key": key, "create_revision": "0"}],
                "success": [{"request_put": put}],
            },
        )
        if not answer.get("succeeded"):
            raise RuntimeError("the raw lock's key was taken")

    def delete(self, key: str) -> None:
        self.post("/kv/deleterange", {"key": key})

    def revoke(self, lease: str) -> None:
        self.post("/lease/revoke", {"ID": lease})

    def ops(self) -> dict[str, Callable[[], object]]:
        def lock() -> None:
            key = b64(b"/raw-bench/lease")
            lease = self.grant()
            self.put_if_absent(key, lease)
            self.delete(key)
            self.revoke(lease)

        def revoke_only() -> None:
            key = b64(b"/raw-bench/revoke")
            lease = self.grant()
            self.put_if_absent(key, lease)
            self.revoke(lease)

        def floor() -> None:
            key = b64(b"/raw-bench/floor")
            self.put_if_absent(key, None)
            self.delete(key)

        return {RAW: lock, RAW_REVOKE: revoke_only, FLOOR: floor}

    def close(self) -> None:
        self.http.close()


class AsyncRaw:
    """The baseline's four requests on httpx's ``AsyncClient`` (dlock's asyncio face's
    client), each call run in an event loop of its own as ``dlock_ops`` runs dlock's."""

    def __init__(self, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(trust_env=False, timeout=10)
        self.base = f"http://127.0.0.1:{port}/v3"
        self.key = b64(b"/raw-bench/async")

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.post(self.base + path, json=body)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    async def lock(self) -> None:
        lease = str((await self.post("/lease/grant", {"TTL": str(TTL)}))["ID"])
        put = {"key": self.key, "value": b64(b"holder"), "lease": lease}
        answer = await self.post(
            "/kv/txn",
            {
                "compare": [{"target": "CREATE", "key": self.key, "create_revision": "0"}],
                "success": [{"request_put": put}],
            },
        )
        if not answer.get("succeeded"):
            raise RuntimeError("the raw lock's key was taken")
        await self.post("/kv/deleterange", {"key": self.key})
        await self.post("/lease/revoke", {"ID": lease})

    def op(self) -> None:
        self.loop.run_until_complete(self.lock())

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


def tooz_coordinator(port: int) -> Any:
    logging.getLogger("tooz").setLevel(logging.ERROR)
    coordinator = coordination.get_coordinator(
        f"etcd3+http://127.0.0.1:{port}?lock_timeout={TTL}", uuid.uuid4().hex.encode()
    )
    coordinator.start()
    return coordinator


class ToozHandle:
    """tooz's lock as users take it: ``acquire()`` blocks, retrying while the key is
    taken (tenacity's exponential wait, at most 1 s)."""

    def __init__(self, port: int, name: bytes = b"/contended") -> None:
        self.coordinator = tooz_coordinator(port)
        self.lock = self.coordinator.get_lock(name)

    def acquire(self) -> None:
        if not self.lock.acquire():
            raise RuntimeError("tooz did not acquire")

    def release(self) -> None:
        if not self.lock.release():
            raise RuntimeError("tooz did not release")

    def close(self) -> None:
        self.coordinator.stop()


def open_tooz(port: int) -> ToozHandle:
    return ToozHandle(port)


def uncontended(server: EtcdServer, url: str, iterations: int, rounds: int) -> dict[str, Latency]:
    raw = Raw(server.port)
    araw = AsyncRaw(server.port)
    tooz = ToozHandle(server.port, b"/uncontended")

    def tooz_op() -> None:
        tooz.acquire()
        tooz.release()

    ops = raw.ops()
    ops = {RAW: ops[RAW], RAW_ASYNC: araw.op, **ops}
    try:
        with dlock_ops(url) as faces:
            return measure_latencies(
                {**ops, **faces, TOOZ: tooz_op},
                iterations,
                warmup=max(1, iterations // 10),
                rounds=rounds,
            )
    finally:
        raw.close()
        araw.close()
        tooz.close()


def load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--sections", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3, help="contention rounds per contender")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 100 x, 10 sections")
    parser.add_argument(
        "--tmpfs",
        action="store_true",
        help="etcd's data in /dev/shm: no disk flush, what is left is CPU (not a production setup)",
    )
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.sections, args.rounds = 100, 10, 1
    latency_rounds = 10
    if args.tmpfs:
        # The harness makes its data directory with tempfile.mkdtemp.
        tempfile.tempdir = "/dev/shm"
    server = EtcdServer()
    tempfile.tempdir = None
    server.start()
    try:
        url = server.url("/dlock-bench")
        print(f"  load average at start: {load()}", file=sys.stderr, flush=True)
        latencies = uncontended(server, url, args.iterations, latency_rounds)
        print(f"  measured uncontended latency; load {load()}", file=sys.stderr, flush=True)
        where = "in /dev/shm" if args.tmpfs else "on disk"
        rows: list[tuple[str, Latency | None, Contention | None]] = [
            (label, latency, None) for label, latency in latencies.items()
        ]
        setups: dict[str, tuple[Callable[[Any], LockHandle], Any]] = {
            "dlock": (open_dlock, url),
            TOOZ: (open_tooz, server.port),
        }
        runs = measure_contention_rounds(setups, args.rounds, args.processes, args.sections)
        rows += contention_rows(runs, args.processes)
        print_table(
            f"etcd {server_version(server)} (one member, data {where}): uncontended "
            f"acquire+release, {latency_rounds} interleaved rounds of "
            f"{args.iterations // latency_rounds}; {args.processes} processes x "
            f"{args.sections} sections on one name, {args.rounds} alternating rounds "
            "(median rate and hand-off, longest wait of all rounds, counters added up)",
            rows,
            RAW,
        )
        print_round_rates(runs, [TOOZ])
        print(f"load average at the end: {load()}")
        return 0 if all(con is None or con.counter == con.expected for _, _, con in rows) else 1
    finally:
        server.stop()


def server_version(server: EtcdServer) -> str:
    try:
        answer = httpx.get(f"http://127.0.0.1:{server.port}/version", trust_env=False)
        return str(answer.json()["etcdserver"])
    except (httpx.HTTPError, ValueError, KeyError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
