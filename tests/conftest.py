"""The conformance fixture: one table of backends, each given as a URL factory.

Adding a backend adds one entry to ``BACKENDS`` (and, for a server, a harness module in
``tests/servers/``). Every test that takes ``url`` runs once per entry.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import free_port
from tests.servers.zookeeper import zookeeper_ensemble, zookeeper_server  # noqa: F401


@dataclass(frozen=True)
class BackendUnderTest:
    #: Makes a URL for a fresh, working backend.
    url: Callable[[pytest.FixtureRequest, Path], str]
    #: Makes a URL of the same backend that cannot be reached (down, or misconfigured).
    unreachable_url: Callable[[pytest.FixtureRequest, Path], str]


BACKENDS: dict[str, BackendUnderTest] = {
    "sqlite": BackendUnderTest(
        url=lambda request, tmp: f"sqlite://{tmp}/locks.sqlite3",
        unreachable_url=lambda request, tmp: "sqlite:///proc/dlock-no-such-dir/locks.sqlite3",
    ),
    # The issue asks for the suite on a three-node ensemble. A lock's TTL maps onto the
    # session timeout, so sessions here are as short as the suite's shortest crash test.
    "zookeeper": BackendUnderTest(
        url=lambda request, tmp: request.getfixturevalue("zookeeper_ensemble").url(
            f"/dlock-{uuid.uuid4().hex[:8]}", session_timeout=1.5
        ),
        unreachable_url=lambda request, tmp: (
            f"zookeeper://127.0.0.1:{free_port()}/dlock?connect_timeout=1"
        ),
    ),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> BackendUnderTest:
    return BACKENDS[request.param]


@pytest.fixture
def url(backend: BackendUnderTest, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return backend.url(request, tmp_path)


@pytest.fixture
def unreachable_url(
    backend: BackendUnderTest, request: pytest.FixtureRequest, tmp_path: Path
) -> str:
    return backend.unreachable_url(request, tmp_path)


@pytest.fixture
def name() -> str:
    """A lock name no other test uses, so servers need no cleanup between tests."""
    return f"test-{uuid.uuid4().hex}"
