"""A private etcd from the Debian ``etcd-server`` package: one member on loopback (or a
cluster of three, :class:`EtcdCluster`, for the tests of a member that dies).

Started with a 10 ms heartbeat and a 100 ms election timeout: etcd's shortest lease is
1.5 election timeouts, rounded up to whole seconds, so this makes it 1 s (with the
defaults it is 2 s), and the suite's 1 s crash tests can run against it. The data lives
in a private temporary directory, removed at the end. Given certificates, it serves its
clients over TLS only (``etcds://``), and with ``client_cert_auth`` asks each of them for
a certificate signed by the same CA. Given ``auth_token_ttl``, its simple tokens last that
many seconds from their last use, and :meth:`EtcdServer.enable_auth` adds users (and the
root) and turns etcd's own authentication on.
"""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest

from tests.servers import (
    ServerProcess,
    free_port,
    private_dir,
    require_binary,
    start_all,
    stop_every,
)
from tests.servers.tls import Certificates


def healthy(port: int, context: ssl.SSLContext | None = None) -> bool:
    """True once the member answers ``/health`` with a leader (a single member elects
    itself within an election timeout); over TLS given a ``context``."""
    scheme = "https" if context is not None else "http"
    try:
        with urllib.request.urlopen(
            f"{scheme}://127.0.0.1:{port}/health", timeout=0.5, context=context
        ) as answer:
            return bool(json.load(answer).get("health") == "true")
    except (OSError, ValueError):
        return False


def _post(port: int, path: str) -> Any:
    """One call with an empty body to the JSON gateway of the member at ``port``."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=2) as answer:
        return json.load(answer)


#: The root user's password on a server with authentication enabled.
ROOT_PASSWORD = "root-Pa55"


@dataclass(frozen=True)
class EtcdUser:
    """A user to add: granted ``permission`` (READ, WRITE or READWRITE) on every key that
    starts with ``prefix``, or nothing if ``prefix`` is None."""

    name: str
    password: str
    prefix: str | None = None
    permission: str = "READWRITE"


def b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


class EtcdServer:
    def __init__(
        self,
        certificates: Certificates | None = None,
        *,
        client_cert_auth: bool = False,
        auth_token_ttl: int | None = None,
    ) -> None:
        binary = require_binary("etcd", "etcd-server")
        self.root = private_dir("etcd")
        self.port = free_port()
        self.certificates = certificates
        peer, metrics = free_port(), free_port()
        tls: list[str] = []
        context: ssl.SSLContext | None = None
        if certificates is not None:
            tls = [
                f"--cert-file={certificates.server_cert}",
                f"--key-file={certificates.server_key}",
            ]
            context = ssl.create_default_context(cafile=str(certificates.ca))
            if client_cert_auth:
                tls += ["--client-cert-auth", f"--trusted-ca-file={certificates.ca}"]
                context.load_cert_chain(certificates.client_cert, certificates.client_key)
        elif client_cert_auth:
            raise ValueError("client_cert_auth needs certificates")
        client_url = f"{'https' if certificates else 'http'}://127.0.0.1:{self.port}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.process = ServerProcess(
            "etcd",
            [
                binary,
                "--name=dlock",
                f"--data-dir={self.root / 'data'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=dlock={peer_url}",
                f"--listen-metrics-urls=http://127.0.0.1:{metrics}",
                "--heartbeat-interval=10",
                "--election-timeout=100",
                "--log-level=warn",
                *tls,
                *([f"--auth-token-ttl={auth_token_ttl}"] if auth_token_ttl else []),
            ],
            ready=lambda: healthy(self.port, context),
            workdir=self.root,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, prefix: str = "/dlock", **options: object) -> str:
        query = "&".join(f"{key}={value}" for key, value in options.items())
        scheme = "etcd" if self.certificates is None else "etcds"
        return f"{scheme}://{self.address}{prefix}" + (f"?{query}" if query else "")

    def user_url(self, user: EtcdUser, prefix: str = "/dlock", **options: object) -> str:
        """A dlock URL for this server with ``user``'s name and password in it."""
        scheme, _, rest = self.url(prefix, **options).partition("://")
        return f"{scheme}://{quote(user.name, safe='')}:{quote(user.password, safe='')}@{rest}"

    def gateway(self, path: str, body: dict[str, Any], token: str | None = None) -> Any:
        """One call to the JSON gateway (plain HTTP), past dlock; its answer."""
        request = urllib.request.Request(
            f"http://{self.address}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": token} if token else {},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.load(answer)

    def enable_auth(self, users: Sequence[EtcdUser]) -> None:
        """Add the root (user and role) and ``users``, each with a role of its own
        granted its permission on its prefix's range, then enable authentication."""
        if self.certificates is not None:
            raise ValueError("enable_auth speaks plain HTTP")
        self.gateway("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        self.gateway("/v3/auth/role/add", {"name": "root"})
        self.gateway("/v3/auth/user/grant", {"user": "root", "role": "root"})
        for user in users:
            self.gateway("/v3/auth/user/add", {"name": user.name, "password": user.password})
            if user.prefix is None:
                continue
            role = f"role-{user.name}"
            end = user.prefix[:-1] + chr(ord(user.prefix[-1]) + 1)
            self.gateway("/v3/auth/role/add", {"name": role})
            perm = {"key": b64(user.prefix), "range_end": b64(end), "permType": user.permission}
            self.gateway("/v3/auth/role/grant", {"name": role, "perm": perm})
            self.gateway("/v3/auth/user/grant", {"user": user.name, "role": role})
        self.gateway("/v3/auth/enable", {})

    def root_token(self) -> str:
        """A token of the root user (authentication enabled)."""
        answer = self.gateway("/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})
        return str(answer["token"])

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        try:
            self.process.kill()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class EtcdCluster:
    """Three members on loopback, for what one member cannot show: a member that dies
    under a client that names all three."""

    def __init__(self) -> None:
        binary = require_binary("etcd", "etcd-server")
        self.root = private_dir("etcd-cluster")
        self.ports = [free_port() for _ in range(3)]
        peers = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
        cluster = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
        self.members: list[ServerProcess] = []
        for i, (port, peer) in enumerate(zip(self.ports, peers, strict=True)):
            workdir = self.root / f"m{i}"
            workdir.mkdir()
            client_url = f"http://127.0.0.1:{port}"
            self.members.append(
                ServerProcess(
                    f"etcd-m{i}",
                    [
                        binary,
                        f"--name=m{i}",
                        f"--data-dir={workdir / 'data'}",
                        f"--listen-client-urls={client_url}",
                        f"--advertise-client-urls={client_url}",
                        f"--listen-peer-urls={peer}",
                        f"--initial-advertise-peer-urls={peer}",
                        f"--initial-cluster={cluster}",
                        "--initial-cluster-state=new",
                        f"--listen-metrics-urls=http://127.0.0.1:{free_port()}",
                        "--heartbeat-interval=10",
                        "--election-timeout=100",
                        "--log-level=warn",
                    ],
                    # A member alone cannot elect a leader: the others start meanwhile.
                    ready=lambda: True,
                    workdir=workdir,
                )
            )

    def start(self) -> None:
        def quorum() -> None:
            deadline = time.monotonic() + 30
            while not all(healthy(port) for port in self.ports):
                if time.monotonic() > deadline:
                    # Each member's log tells a stall under load from a port taken
                    # between free_port() and the member's bind.
                    logs = "\n".join(
                        f"--- member {i}: {member.log_tail(10)}"
                        for i, member in enumerate(self.members)
                    )
                    raise RuntimeError(f"the etcd cluster elected no leader in time\n{logs}")
                time.sleep(0.05)

        start_all(self.members, then=quorum)

    def leader(self) -> int:
        """The index of the member that leads now, as every live member sees it. Asked
        again for a few seconds while a member knows no leader yet (its status then
        has no "leader" at all: the JSON gateway leaves out a zero) or they disagree, as
        in an election."""
        deadline = time.monotonic() + 10
        while True:
            statuses = {port: _post(port, "/v3/maintenance/status") for port in self.live()}
            leaders = {status.get("leader") for status in statuses.values()}
            if len(leaders) == 1 and None not in leaders:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the members agree on no leader: {leaders}")
            time.sleep(0.05)
        for port, status in statuses.items():
            if status["header"]["member_id"] in leaders:
                return self.ports.index(port)
        raise RuntimeError("the leader is not a live member")

    def live(self) -> list[int]:
        """The client ports of the members running now."""
        return [
            port
            for port, member in zip(self.ports, self.members, strict=True)
            if member.process is not None
        ]

    def url(self, prefix: str, order: Sequence[int] = (0, 1, 2), **options: object) -> str:
        """A dlock URL naming the members in ``order`` (a client talks to the first)."""
        hosts = ",".join(f"127.0.0.1:{self.ports[i]}" for i in order)
        query = "&".join(f"{key}={value}" for key, value in options.items())
        return f"etcd://{hosts}{prefix}" + (f"?{query}" if query else "")

    def stop(self) -> None:
        try:
            stop_every(self.members, ServerProcess.kill)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster()
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer()
    server.start()
    yield server
    server.stop()
