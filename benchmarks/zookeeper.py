"""ZooKeeper: dlock against the raw recipe operations and kazoo's Lock, in one run.

    python -m benchmarks.zookeeper [--iterations N] [--processes P] [--sections S]
                                   [--rounds R] [--ensemble]

The raw baseline is the least any ZooKeeper lock does, with the same kazoo client as
dlock's (kazoo with dlock's handler): create an ephemeral sequential node and list the
children (pipelined in one round trip, as dlock does), then delete the node. The peer is
kazoo's own ``Lock`` recipe, as users run it (kazoo's default handler) and on dlock's
handler, which tells the recipe's share of the difference from the transport's. Servers
are private ones started by the test harness: one standalone server by default (a
three-node ensemble on a 2-core machine mostly measures the JVMs competing for CPU), or
``--ensemble``.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient

from benchmarks.common import (
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
from dlock._zookeeper_common import KazooHandler
from tests.servers.zookeeper import ZooKeeperEnsemble

RAW = "raw create|children, delete"
RAW_STOCK = "raw, kazoo's handler"
KAZOO = "kazoo Lock"
KAZOO_FAST = "kazoo Lock, dlock's handler"


def kazoo_client(hosts: str, fast: bool) -> KazooClient:
    """A started client: kazoo's default handler, or the one dlock uses (``fast``)."""
    client = KazooClient(hosts=hosts, timeout=10, handler=KazooHandler() if fast else None)
    client.start()
    return client


class KazooHandle:
    def __init__(self, hosts: str, fast: bool = False) -> None:
        self.client = kazoo_client(hosts, fast)
        self.lock = self.client.Lock("/kazoo-bench/contended", uuid.uuid4().hex)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.client.stop()
        self.client.close()


def open_kazoo(hosts: str) -> KazooHandle:
    return KazooHandle(hosts)


def open_kazoo_fast(hosts: str) -> KazooHandle:
    return KazooHandle(hosts, fast=True)


def raw_ops(zk: KazooClient) -> Callable[[], None]:
    zk.ensure_path("/raw-bench/lock")
    prefix = f"/raw-bench/lock/{uuid.uuid4().hex}-"

    def ops() -> None:
        # A session's requests are served in order: the listing sees the new node.
        created = zk.create_async(prefix, b"", ephemeral=True, sequence=True)
        listing = zk.get_children_async("/raw-bench/lock")
        path = created.get()
        listing.get()
        zk.delete(path)

    return ops


def kazoo_ops(zk: KazooClient, name: str) -> Callable[[], None]:
    lock = zk.Lock(f"/kazoo-bench/{name}", "bench")

    def ops() -> None:
        lock.acquire()
        lock.release()

    return ops


def uncontended(hosts: str, url: str, iterations: int) -> dict[str, Latency]:
    fast, stock = kazoo_client(hosts, fast=True), kazoo_client(hosts, fast=False)
    try:
        with dlock_ops(url) as ops:
            return measure_latencies(
                {
                    RAW: raw_ops(fast),
                    RAW_STOCK: raw_ops(stock),
                    **ops,
                    KAZOO: kazoo_ops(stock, "uncontended"),
                    KAZOO_FAST: kazoo_ops(fast, "uncontended-fast"),
                },
                iterations,
            )
    finally:
        for zk in (fast, stock):
            zk.stop()
            zk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--sections", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5, help="contention rounds per contender")
    parser.add_argument("--ensemble", action="store_true", help="three nodes, not one")
    args = parser.parse_args()
    servers = ZooKeeperEnsemble(3 if args.ensemble else 1)
    servers.start()
    try:
        url = servers.url("/dlock-bench")
        latencies = uncontended(servers.hosts, url, args.iterations)
        rows: list[tuple[str, Latency | None, Any]] = [
            (label, latency, None) for label, latency in latencies.items()
        ]
        setups: dict[str, tuple[Callable[[str], LockHandle], str]] = {
            "dlock": (open_dlock, url),
            KAZOO: (open_kazoo, servers.hosts),
            KAZOO_FAST: (open_kazoo_fast, servers.hosts),
        }
        # Contention is noisy on a shared 2-core machine: alternate the contenders over
        # several rounds and report each one's median.
        runs = measure_contention_rounds(setups, args.rounds, args.processes, args.sections)
        rows += contention_rows(runs, args.processes)
        kind = "3-node ensemble" if args.ensemble else "standalone server"
        print_table(
            f"ZooKeeper ({kind}): uncontended acquire+release; contention on one name",
            rows,
            RAW,
        )
        print_round_rates(runs, [KAZOO, KAZOO_FAST])
    finally:
        servers.stop()


if __name__ == "__main__":
    main()
