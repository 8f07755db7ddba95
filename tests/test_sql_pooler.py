"""PostgreSQL behind PgBouncer in transaction pooling, the way many deployments run it:
consecutive statements of one client connection may run in different server sessions.

Lease mode must work through it, waits included (no session state left on a server
session that other clients then use: a turnstile lock, a LISTEN, a prepared statement);
session mode, which needs one server session for the lock's lifetime, is refused
before it takes anything.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import dlock
import dlock.aio
from tests.servers.sql import SQLServer, start_pgbouncer


@pytest.fixture(scope="module")
def pooler(postgresql_server: SQLServer) -> Iterator[SQLServer]:
    server = start_pgbouncer(postgresql_server)
    yield server
    server.stop()


@pytest.fixture
def name() -> str:
    return f"pooled-{uuid.uuid4().hex}"


def _advisory_locks(server: SQLServer) -> list[tuple[object, ...]]:
    """Advisory locks held or awaited on the database itself, past the pooler."""
    with server.connect() as conn:
        return list(conn.execute("SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory'"))


def test_lease_mode_through_a_transaction_pooler(
    pooler: SQLServer, postgresql_server: SQLServer, name: str
) -> None:
    """Four clients, each on its own connection through the pooler's two server
    sessions, take one name in turn (waiting for it) and their own names past
    psycopg's automatic PREPARE (after five runs of a statement). Before, the waiters'
    turnstile locks and LISTENs stayed on the shared server sessions (deadlocks, lost
    leases, the name blocked after the test), and the fifth statement failed with
    'prepared statement "_pg3_0" already exists'. Critical sections must not overlap
    and their fencing tokens must increase."""
    sections: list[tuple[float, float, int]] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def worker(index: int) -> None:
        try:
            with dlock.connect(pooler.url()) as client:
                for _ in range(8):
                    with client.lock(f"{name}-{index}", ttl=10):
                        pass
                for _ in range(15):
                    with client.lock(name, ttl=10, timeout=20) as lock:
                        entered = time.monotonic()
                        time.sleep(0.002)
                        assert lock.fencing_token is not None
                        with guard:
                            sections.append((entered, time.monotonic(), lock.fencing_token))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(sections) == 60
    sections.sort()
    for (_, left, token), (entered, _, next_token) in itertools.pairwise(sections):
        assert left <= entered, "two holders at once"
        assert token < next_token, "fencing tokens must increase"
    assert _advisory_locks(postgresql_server) == [], "a lock was left on a server session"


def test_lease_mode_through_a_transaction_pooler_asyncio(
    pooler: SQLServer, postgresql_server: SQLServer, name: str
) -> None:
    async def worker(index: int) -> list[int]:
        tokens = []
        async with dlock.aio.connect(pooler.url()) as client:
            for _ in range(8):
                async with client.lock(f"{name}-{index}", ttl=10):
                    pass
            for _ in range(10):
                async with client.lock(name, ttl=10, timeout=20) as lock:
                    assert lock.fencing_token is not None
                    tokens.append(lock.fencing_token)
                    await asyncio.sleep(0.002)
        return tokens

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(worker(i) for i in range(3))))

    results = asyncio.run(main())
    tokens = sorted(token for result in results for token in result)
    assert len(set(tokens)) == 30, "each acquisition its own fencing token"
    assert _advisory_locks(postgresql_server) == []


def test_session_mode_is_refused_through_a_pooler(
    pooler: SQLServer, postgresql_server: SQLServer, name: str
) -> None:
    """Refused before anything is taken, in both faces: a lock taken in a pooled server
    session would stay there, for other clients to run into."""
    url = pooler.url("mode=session")
    with dlock.connect(url) as client, pytest.raises(dlock.ConfigurationError, match="pooler"):
        client.lock(name, ttl=10).acquire(timeout=0)

    async def in_asyncio() -> None:
        async with dlock.aio.connect(url) as client:
            await client.lock(name, ttl=10).acquire(timeout=1)

    with pytest.raises(dlock.ConfigurationError, match="pooler"):
        asyncio.run(in_asyncio())
    assert _advisory_locks(postgresql_server) == []
    # Lease mode on the same pooler, and session mode directly, are fine.
    with dlock.connect(pooler.url()) as client:
        assert client.lock(name, ttl=10).acquire(timeout=0)
    with dlock.connect(postgresql_server.url("mode=session")) as client:
        assert client.lock(f"{name}-direct", ttl=10).acquire(timeout=0)


def test_the_applications_pool_through_the_pooler(
    pooler: SQLServer, postgresql_server: SQLServer, name: str
) -> None:
    """``client=`` with the application's psycopg_pool in front of the pooler (its
    automatic prepares off, as the pooler needs for the application's own statements).
    A borrowed connection is asked once whether a pooler stands between: session mode
    is refused before it takes anything, and lease waiters back off instead of queueing
    in pooled server sessions."""
    import psycopg_pool

    with psycopg_pool.ConnectionPool(
        pooler.url(), min_size=2, max_size=4, kwargs={"prepare_threshold": None}
    ) as pool:
        with (
            dlock.connect("postgresql://?mode=session", client=pool.connection) as client,
            pytest.raises(dlock.ConfigurationError, match="pooler"),
        ):
            client.lock(name, ttl=10).acquire(timeout=0)
        assert _advisory_locks(postgresql_server) == []
        tokens: list[int] = []
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                with dlock.connect("postgresql://", client=pool.connection) as client:
                    for _ in range(10):
                        with client.lock(name, ttl=10, timeout=20) as lock:
                            assert lock.fencing_token is not None
                            tokens.append(lock.fencing_token)
                            time.sleep(0.002)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(set(tokens)) == 20
        assert _advisory_locks(postgresql_server) == [], "a lock was left on a server session"


def test_a_waiter_through_the_pooler_opens_no_connection_of_its_own(
    pooler: SQLServer, name: str
) -> None:
    """A lease waiter that finds a pooler in front backs off on an ordinary pooled
    connection. Before, each wait opened a new connection (a login through the pooler
    and a setup round trip), found that it could not queue on it, and pooled or closed
    it: 20 waits, 20 more connections."""
    with dlock.connect(pooler.url()) as holders, dlock.connect(pooler.url()) as waiters:
        backend: Any = waiters._backend
        connects = 0
        connect = backend._connect

        def counting_connect() -> object:
            nonlocal connects
            connects += 1
            return connect()

        backend._connect = counting_connect
        for _ in range(20):
            held = holders.lock(name, ttl=10)
            assert held.acquire(timeout=0)
            release = threading.Timer(0.02, held.release)
            release.start()
            with waiters.lock(name, ttl=10, timeout=5):
                pass
            release.join()
        assert connects <= 2
