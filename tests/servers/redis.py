"""Private redis-server processes: one server, three Redlock masters, a three-master cluster.

Each runs from the Debian package on free loopback ports in its own temporary directory,
without persistence (a restart loses every lease, the harsher case for a holder).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.servers import (
    Partition,
    ServerProcess,
    free_port,
    private_dir,
    require_binary,
    start_all,
    stop_every,
)
from tests.servers.tls import make_certificates


def _cli(port: int, *args: str) -> str:
    result = subprocess.run(
        [require_binary("redis-cli", "redis-tools"), "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return result.stdout.strip()


class RedisServer(ServerProcess):
    def __init__(
        self,
        name: str,
        *extra: str,
        port: int | None = None,
        workdir: Path | None = None,
        cli: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        workdir = workdir or private_dir(name)
        super().__init__(
            name,
            [
                require_binary("redis-server", "redis-server"),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                *extra,
            ],
            ready=lambda: _cli(self.port, *cli, "ping") == "PONG",
            workdir=workdir,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class RedisCluster:
    nodes: list[RedisServer]
    #: With ``start_cluster(relayed=True)``: each node's relay, in the order of ``nodes``.
    relays: list[Partition] = field(default_factory=list)

    @property
    def url(self) -> str:
        if self.relays:
            return f"redis+cluster://127.0.0.1:{self.relays[0].port}"
        return f"redis+cluster://{self.nodes[0].address}"

    def remove(self) -> None:
        stop_every(self.nodes, RedisServer.remove)
        for relay in self.relays:
            relay.close()


def start_single(name: str = "redis") -> RedisServer:
    server = RedisServer(name)
    server.start()
    return server


def start_masters(count: int = 3) -> list[RedisServer]:
    masters = [RedisServer(f"redlock{i}") for i in range(count)]
    start_all(masters)
    return masters


def cluster_node(name: str, port: int, bus: int, *extra: str) -> RedisServer:
    """A cluster-enabled server (not started) on ``port``, its cluster bus on ``bus``."""
    return RedisServer(
        name,
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        "2000",
        "--cluster-port",
        str(bus),
        *extra,
        port=port,
    )


def start_cluster(masters: int = 3, relayed: bool = False) -> RedisCluster:
    """``relayed``: each node announces a relay (a ``Partition``) as its address, so
    that clients reach every node, redirects and slot maps included, through relays a
    test may cut; the nodes' own bus between them is not relayed."""
    nodes, relays = [], []
    for i in range(masters):
        # A bus port of its own: the default, port + 10000, may be anyone's (another
        # test worker's server, or a client connection's local port).
        port, bus = free_port(), free_port()
        announced: tuple[str, ...] = ()
        if relayed:
            relays.append(Partition(port))
            announced = (
                "--cluster-announce-port",
                str(relays[-1].port),
                "--cluster-announce-bus-port",
                str(bus),
            )
        nodes.append(cluster_node(f"cluster{i}", port, bus, *announced))

    def form_cluster() -> None:
        _cli(
            nodes[0].port,
            "--cluster",
            "create",
            *(node.address for node in nodes),
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        )
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in _cli(node.port, "cluster", "info") for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not become ready")
            time.sleep(0.05)

    start_all(nodes, form_cluster)
    return RedisCluster(nodes, relays)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_single()
    yield server
    server.remove()


@pytest.fixture(scope="session")
def redlock_servers() -> Iterator[list[RedisServer]]:
    servers = start_masters()
    yield servers
    stop_every(servers, RedisServer.remove)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    cluster = start_cluster()
    yield cluster
    cluster.remove()


@pytest.fixture(scope="session")
def relayed_cluster() -> Iterator[RedisCluster]:
    """A cluster whose clients reach it through relays only (the outage tests')."""
    cluster = start_cluster(relayed=True)
    yield cluster
    cluster.remove()


def redlock_url(servers: list[RedisServer]) -> str:
    return "redis+redlock://" + ",".join(server.address for server in servers)


@dataclass
class TLSRedis:
    server: RedisServer
    ca: Path

    @property
    def url(self) -> str:
        return f"rediss://{self.server.address}?ssl_ca_certs={self.ca}"


def start_tls() -> TLSRedis:
    """A server that speaks only TLS, with a certificate from a throwaway CA."""
    workdir = private_dir("redis-tls")
    certificates = make_certificates(workdir)
    port = free_port()
    server = RedisServer(
        "redis-tls",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certificates.server_cert),
        "--tls-key-file",
        str(certificates.server_key),
        "--tls-ca-cert-file",
        str(certificates.ca),
        "--tls-auth-clients",
        "no",
        port=free_port(),
        workdir=workdir,
        cli=("--tls", "--cacert", str(certificates.ca)),
    )
    # The plain port is closed ("--port 0" after the defaults); clients reach TLS only.
    server.command += ["--port", "0"]
    server.port = port
    server.start()
    return TLSRedis(server, certificates.ca)
