"""A private etcd from the Debian ``etcd-server`` package: one member on loopback.

Started with a 10 ms heartbeat and a 100 ms election timeout: etcd's shortest lease is
1.5 election timeouts, rounded up to whole seconds, so this makes it 1 s (with the
defaults it is 2 s), and the suite's 1 s crash tests can run against it. The data lives
in a private temporary directory, removed at the end. Given certificates, it serves its
clients over TLS only (``etcds://``), and with ``client_cert_auth`` asks each of them for
a certificate signed by the same CA.
"""

from __future__ import annotations

import json
import shutil
import ssl
import urllib.request
from collections.abc import Iterator

import pytest

from tests.servers import ServerProcess, free_port, private_dir, require_binary
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


class EtcdServer:
    def __init__(
        self, certificates: Certificates | None = None, *, client_cert_auth: bool = False
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

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        try:
            self.process.kill()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer()
    server.start()
    yield server
    server.stop()
