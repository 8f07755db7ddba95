"""A private etcd from the Debian ``etcd-server`` package: one member on loopback.

Started with a 10 ms heartbeat and a 100 ms election timeout: etcd's shortest lease is
1.5 election timeouts, rounded up to whole seconds, so this makes it 1 s (with the
defaults it is 2 s), and the suite's 1 s crash tests can run against it. The data lives
in a private temporary directory, removed at the end.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator

import pytest

from tests.servers import ServerProcess, free_port, private_dir, require_binary


def healthy(port: int) -> bool:
    """True once the member answers ``/health`` with a leader (a single member elects
    itself within an election timeout)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as answer:
            return bool(json.load(answer).get("health") == "true")
    except (OSError, ValueError):
        return False


class EtcdServer:
    def __init__(self) -> None:
        binary = require_binary("etcd", "etcd-server")
        self.root = private_dir("etcd")
        self.port = free_port()
        peer, metrics = free_port(), free_port()
        client_url = f"http://127.0.0.1:{self.port}"
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
            ],
            ready=lambda: healthy(self.port),
            workdir=self.root,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, prefix: str = "/dlock", **options: object) -> str:
        query = "&".join(f"{key}={value}" for key, value in options.items())
        return f"etcd://{self.address}{prefix}" + (f"?{query}" if query else "")

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
