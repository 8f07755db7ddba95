"""``client=`` with the application's own connection pool: psycopg_pool, SQLAlchemy's
engine, aiomysql's pool.

dlock borrows a connection for each operation and gives it back at once, as it came
(the application's autocommit setting); a session lock keeps its connection, out of the
pool, for as long as it is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiomysql
import psycopg_pool
import pytest
import sqlalchemy
import sqlalchemy.exc
from pymysql.constants import CLIENT

import dlock
import dlock.aio
from tests.servers.sql import SQLServer

#: A borrow that waits this long for a pool that has nothing left fails.
EMPTY = 0.3


class Pool:
    """An application's pool of two connections, and how the test borrows from it."""

    def __init__(self, server: SQLServer, kind: str) -> None:
        self.server = server
        self.kind = kind
        if kind == "psycopg_pool":
            self.pool = psycopg_pool.ConnectionPool(server.url(), min_size=2, max_size=2, open=True)
            self.client: Callable[[], Any] = self.pool.connection
            self.exhausted: type[Exception] = psycopg_pool.PoolTimeout
        else:
            driver = "psycopg" if server.scheme == "postgresql" else "pymysql"
            url = server.url().replace(f"{server.scheme}://", f"{server.scheme}+{driver}://")
            # SQLAlchemy opens MySQL connections without multi-statements, with which
            # dlock's waiters queue in the server; "sqlalchemy-multi" brings them.
            flags = CLIENT.FOUND_ROWS | CLIENT.MULTI_STATEMENTS
            connect_args = {"client_flag": flags} if kind == "sqlalchemy-multi" else {}
            self.engine = sqlalchemy.create_engine(
                url, pool_size=2, max_overflow=0, pool_timeout=EMPTY, connect_args=connect_args
            )
            self.client = self.engine.raw_connection
            self.exhausted = sqlalchemy.exc.TimeoutError

    @contextlib.contextmanager
    def borrow(self, timeout: float = 5) -> Iterator[Any]:
        """One of the pool's connections, as the application gets it (driver level)."""
        if self.kind == "psycopg_pool":
            with self.pool.connection(timeout=timeout) as conn:
                yield conn
        else:
            with contextlib.closing(self.engine.raw_connection()) as proxy:
                yield proxy.driver_connection

    def close(self) -> None:
        if self.kind == "psycopg_pool":
            self.pool.close()
        else:
            self.engine.dispose()


def autocommit(conn: Any) -> bool:
    value = conn.get_autocommit() if hasattr(conn, "get_autocommit") else conn.autocommit
    return bool(value)


@pytest.fixture(
    params=[
        ("postgresql", "psycopg_pool"),
        ("postgresql", "sqlalchemy"),
        ("mariadb", "sqlalchemy"),
        ("mariadb", "sqlalchemy-multi"),
    ],
    ids=lambda p: "-".join(p),
)
def pool(request: pytest.FixtureRequest) -> Iterator[Pool]:
    database, kind = request.param
    server: SQLServer = request.getfixturevalue(f"{database}_server")
    pool = Pool(server, kind)
    yield pool
    pool.close()


@pytest.fixture
def name() -> str:
    return f"pool-{uuid.uuid4().hex}"


def url(pool: Pool, query: str = "") -> str:
    return f"{pool.server.scheme}://" + (f"?{query}" if query else "")


def test_lease_borrows_and_gives_back_as_it_came(pool: Pool, name: str) -> None:
    with pool.borrow() as conn:
        assert not autocommit(conn)
    with dlock.connect(url(pool), client=pool.client) as client:
        lock = client.lock(name, ttl=5)
        assert lock.acquire(timeout=0)
        # Both connections are back in the pool while the lease is held, and as the
        # application left them: not switched to autocommit.
        with pool.borrow(timeout=EMPTY) as first, pool.borrow(timeout=EMPTY) as second:
            assert not autocommit(first) and not autocommit(second)
            # dlock's statement was committed (it ran in autocommit): seen from the
            # application's own connection.
            cursor = first.cursor()
            cursor.execute("SELECT fence FROM dlock_locks WHERE name = %s", (name.encode(),))
            assert list(cursor.fetchall()) == [(lock.fencing_token,)]
            first.rollback()
        lock.release()
        assert client.inspect(name) is None
    with pool.borrow(timeout=EMPTY) as first, pool.borrow(timeout=EMPTY) as second:
        assert not autocommit(first) and not autocommit(second)


def test_session_lock_keeps_its_connection_out_of_the_pool(pool: Pool, name: str) -> None:
    with dlock.connect(url(pool, "mode=session"), client=pool.client) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        # One connection is free; the other holds the database's lock.
        free = pool.borrow(timeout=EMPTY)
        with free, pytest.raises(pool.exhausted), pool.borrow(timeout=EMPTY):
            pass
        lock.release()
        # Unlocked, it went back usable: both can be borrowed at once.
        with pool.borrow(timeout=EMPTY) as first, pool.borrow(timeout=EMPTY) as second:
            assert not autocommit(first) and not autocommit(second)
        # And dlock borrows it again.
        assert lock.acquire(timeout=0)
        lock.release()


def test_a_pooled_connection_ended_while_idle_no_longer_fails_the_operation(
    pool: Pool, name: str
) -> None:
    """The application's pool may lend connections whose sessions the server ended
    while they sat idle (a restart, a KILL): dlock weeds them out before it sends
    anything. PyMySQL's switch to autocommit, a round trip, came first, and failed
    on the dead connection: the operation was BackendUnavailable, with the server up."""
    mysql = pool.server.scheme != "postgresql"
    with pool.borrow() as first, pool.borrow() as second:
        sessions = [c.thread_id() if mysql else c.info.backend_pid for c in (first, second)]
    admin = pool.server.connect()
    try:
        cursor = admin.cursor()
        kill = "KILL CONNECTION %s" if mysql else "SELECT pg_terminate_backend(%s)"
        for session in sessions:
            cursor.execute(kill, (session,))
        # Both only signal the session, which ends moments later.
        alive = (
            "SELECT count(*) FROM information_schema.processlist WHERE id IN (%s, %s)"
            if mysql
            else "SELECT count(*) FROM pg_stat_activity WHERE pid IN (%s, %s)"
        )
        deadline = time.monotonic() + 5
        while True:
            cursor.execute(alive, tuple(sessions))
            if not cursor.fetchone()[0]:
                break
            assert time.monotonic() < deadline, "the killed sessions did not end"
            time.sleep(0.01)
    finally:
        admin.close()
    time.sleep(0.1)  # the server's goodbye reaches the idle connections' sockets
    with dlock.connect(url(pool), client=pool.client) as client:
        lock = client.lock(name, ttl=5)
        assert lock.acquire(timeout=0)
        lock.release()


def _idle_timeout(pool: Pool, conn: Any) -> str:
    """The session's own idle timeout, as the server reports it."""
    pg = pool.server.scheme == "postgresql"
    cursor = conn.cursor()
    cursor.execute("SHOW idle_session_timeout" if pg else "SELECT @@SESSION.wait_timeout")
    value = str(cursor.fetchall()[0][0])
    if not autocommit(conn):
        conn.rollback()
    return value


def test_session_lock_gives_back_the_connections_own_idle_timeout(pool: Pool, name: str) -> None:
    """A session lock turns the server's idle timeout off on the connection that holds
    it (so the server does not end it under a live holder), then gives the connection
    back with the application's own setting."""
    pg = pool.server.scheme == "postgresql"
    own = "1234s" if pg else "1234"
    with pool.borrow() as first, pool.borrow() as second:
        for conn in (first, second):
            conn.cursor().execute(
                f"SET idle_session_timeout = '{own}'" if pg else f"SET SESSION wait_timeout = {own}"
            )
            if not autocommit(conn):
                conn.commit()
    with dlock.connect(url(pool, "mode=session"), client=pool.client) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        backend: Any = client._backend
        (held,) = backend._held.values()
        # Through the backend's own statement runner: the renewer, which looks at a held
        # connection's socket each second, must know the answer there is not a loss.
        sql = "SHOW idle_session_timeout" if pg else "SELECT @@SESSION.wait_timeout"
        value = str(backend._run(held.conn, sql, {}).rows[0][0])
        assert value == ("0" if pg else "31536000")
        assert lock.owned()
        lock.release()
    with pool.borrow(timeout=EMPTY) as first, pool.borrow(timeout=EMPTY) as second:
        assert _idle_timeout(pool, first) == _idle_timeout(pool, second) == own


def test_session_waiter_through_the_pool(pool: Pool, name: str) -> None:
    """A session-mode wait on a connection of the application's pool, which on MariaDB
    was opened without multi-statements: the lock obtained is recorded by the next
    statement instead of in the wait's own round trip; the connection goes back after."""
    with dlock.connect(pool.server.url("mode=session")) as other:
        held = other.lock(name, ttl=30)
        assert held.acquire(timeout=0)
        threading.Timer(0.5, held.release).start()
        with dlock.connect(url(pool, "mode=session"), client=pool.client) as client:
            lock = client.lock(name, ttl=30)
            assert lock.acquire(timeout=10)
            assert held.fencing_token is not None and lock.fencing_token is not None
            assert lock.fencing_token > held.fencing_token
            info = client.inspect(name)
            assert info is not None and info.fencing_token == lock.fencing_token
            lock.release()
            assert client.inspect(name) is None
            with pool.borrow(timeout=EMPTY) as first, pool.borrow(timeout=EMPTY) as second:
                assert not autocommit(first) and not autocommit(second)


@pytest.mark.parametrize(
    "pool", [("mariadb", "sqlalchemy")], indirect=True, ids=["mariadb-sqlalchemy"]
)
def test_a_parked_session_lock_cut_off_twice_is_freed(pool: Pool, name: str) -> None:
    """A MySQL connection without multi-statements parks the lock its wait obtained for
    the core's next attempt. An interrupt before that attempt leaves the wait, which
    unlocks the parked lock; a second interrupt during that unlock left the connection
    neither closed nor given back, the lock held on it: nobody could take the name.
    The connection is closed now, which frees the lock."""
    with dlock.connect(pool.server.url("mode=session")) as other:
        held = other.lock(name, ttl=30)
        assert held.acquire(timeout=0)
        with dlock.connect(url(pool, "mode=session"), client=pool.client) as client:
            backend: Any = client._backend
            real_wait, real_run = backend._session_wait, backend._run

            def interrupted_after_the_wait(waiter: Any, timeout: float) -> Any:
                real_wait(waiter, timeout)
                if backend._parked:
                    raise KeyboardInterrupt  # Ctrl-C before the next attempt
                return None

            def interrupted_unlock(conn: Any, sql: str, params: Any, wait: float = 0) -> Any:
                if sql == backend._sql["session_unlock"]:
                    raise KeyboardInterrupt  # and again as the wait is left
                return real_run(conn, sql, params, wait)

            backend._session_wait = interrupted_after_the_wait
            backend._run = interrupted_unlock
            threading.Timer(0.3, held.release).start()
            with pytest.raises(KeyboardInterrupt):
                client.lock(name, ttl=30).acquire(timeout=10)
            assert not backend._parked
            assert other.lock(name, ttl=30).acquire(timeout=5), "the parked lock was kept"


def test_lease_waiter_gives_its_connection_back(pool: Pool, name: str) -> None:
    """A lease waiter's connection (its place in the queue; PostgreSQL: LISTEN) is out of
    the pool while it waits and, taken in front of the queue, while the lease is held;
    after the release dlock keeps none of the pool's connections for later waits. (Plain
    SQLAlchemy MySQL connections cannot queue: their waiters back off.)"""
    with dlock.connect(pool.server.url()) as other:
        held = other.lock(name, ttl=30)
        assert held.acquire(timeout=0)
        threading.Timer(0.5, held.release).start()
        with dlock.connect(url(pool), client=pool.client) as client:
            lock = client.lock(name, ttl=30)
            assert lock.acquire(timeout=10)
            lock.release()
            assert client.inspect(name) is None
            with pool.borrow(timeout=EMPTY) as first, pool.borrow(timeout=EMPTY) as second:
                assert not autocommit(first) and not autocommit(second)
            # And it waits again as well, on a connection borrowed afresh.
            assert held.acquire(timeout=0)
            threading.Timer(0.5, held.release).start()
            assert lock.acquire(timeout=10)
            lock.release()
            with pool.borrow(timeout=EMPTY), pool.borrow(timeout=EMPTY):
                pass


def test_a_killed_session_lock_connection_goes_back_closed(pool: Pool, name: str) -> None:
    """A lock given up by closing its connection (force release) must not hand the
    application a dead connection: it goes back closed and the pool replaces it."""
    with dlock.connect(url(pool, "mode=session"), client=pool.client) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        assert client.force_release(name)
        with pytest.raises(dlock.LockLost):
            lock.extend()
    for _ in range(3):
        with pool.borrow(timeout=5) as first, pool.borrow(timeout=5) as second:
            for conn in (first, second):
                cursor = conn.cursor()
                cursor.execute("SELECT 1")
                assert list(cursor.fetchall()) == [(1,)]
                conn.rollback()


async def _aiomysql_pool(
    server: SQLServer, *, minsize: int, maxsize: int, client_flag: int = CLIENT.FOUND_ROWS
) -> Any:
    """An aiomysql pool of ``server``'s test database, as an application makes one for
    dlock (which needs FOUND_ROWS of a lent MySQL connection)."""
    return await aiomysql.create_pool(
        host="127.0.0.1",
        port=server.port,
        user=server.user,
        password=server.password,
        db=server.database,
        minsize=minsize,
        maxsize=maxsize,
        client_flag=client_flag,
    )


async def _async_pool(
    server: SQLServer,
) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]:
    """An asyncio pool of two connections: the function that lends one, a function
    returning both connections' autocommit settings (borrowed at once), and its close."""
    if server.scheme == "postgresql":
        apool: Any = psycopg_pool.AsyncConnectionPool(
            server.url(), min_size=2, max_size=2, open=False
        )
        await apool.open()
        lend: Callable[[], Any] = apool.connection
        close = apool.close
    else:
        apool = await _aiomysql_pool(server, minsize=2, maxsize=2)
        lend = apool.acquire

        async def close() -> None:
            apool.close()
            await apool.wait_closed()

    async def autocommit_of_both() -> list[bool]:
        async with lend() as first, lend() as second:
            return [autocommit(first), autocommit(second)]

    return lend, autocommit_of_both, close


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
async def test_asyncio_face_borrows_from_an_async_pool(
    database: str, request: pytest.FixtureRequest, name: str
) -> None:
    server: SQLServer = request.getfixturevalue(f"{database}_server")
    client_factory, autocommit_of_both, close = await _async_pool(server)
    try:
        async with dlock.aio.connect(f"{server.scheme}://", client=client_factory) as client:
            lock = client.lock(name, ttl=5)
            assert await lock.acquire(timeout=0)
            assert await asyncio.wait_for(autocommit_of_both(), 5) == [False, False]
            await lock.release()
        query = f"{server.scheme}://?mode=session"
        async with dlock.aio.connect(query, client=client_factory) as client:
            lock = client.lock(name, ttl=30)
            assert await lock.acquire(timeout=0)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(autocommit_of_both(), EMPTY)
            await lock.release()
            assert await asyncio.wait_for(autocommit_of_both(), 5) == [False, False]
    finally:
        await close()


@pytest.mark.parametrize("step", ["_restore_idle_timeout", "_driver_restore"])
@pytest.mark.parametrize("mode", ["lease", "session"])
@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
async def test_a_give_back_cut_off_still_returns_the_connection(
    database: str, mode: str, step: str, request: pytest.FixtureRequest, name: str
) -> None:
    """A release cancelled while dlock puts the borrowed connection back as it came
    (its idle timeout, its autocommit setting: round trips) skipped the return to the
    pool: the connection stayed checked out for good, and the application's pool
    drained until its acquires hung. Cut off there, it goes back closed."""
    server: SQLServer = request.getfixturevalue(f"{database}_server")
    lend, autocommit_of_both, close = await _async_pool(server)
    try:
        query = f"{server.scheme}://?mode={mode}"
        async with dlock.aio.connect(query, client=lend) as client:
            lock = client.lock(name, ttl=30)
            assert await lock.acquire(timeout=0)
            backend: Any = client._backend
            cut_off_at = asyncio.Event()

            async def hang(*args: Any) -> Any:
                cut_off_at.set()
                await asyncio.Event().wait()

            setattr(backend, step, hang)
            release = asyncio.create_task(lock.release())
            await asyncio.wait_for(cut_off_at.wait(), 5)
            release.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await release
            delattr(backend, step)
            assert await asyncio.wait_for(autocommit_of_both(), 5) == [False, False]
            again = client.lock(name, ttl=30)
            assert await again.acquire(timeout=0)
            await again.release()
    finally:
        # aiomysql's close waits for every connection lent, a lost one for ever.
        await asyncio.wait_for(close(), 10)


async def test_a_waiter_cancelled_with_the_pool_exhausted_keeps_nothing(
    mariadb_server: SQLServer, name: str
) -> None:
    """A lease waiter borrowed the last connection of the application's pool, queued in
    the turnstile and was cancelled: its clean-up ran in the cancelled task and waited
    for the pool (connect_timeout + 1) to KILL the wait, with its own connection, which
    would have made room, not yet given back. The cancellation waited that long, and
    when the turnstile was handed over meanwhile, the dead session took the lease,
    held by nobody until then. Now the connection goes back first, in the background."""
    server = mariadb_server
    pool = await _aiomysql_pool(
        server, minsize=0, maxsize=2, client_flag=CLIENT.FOUND_ROWS | CLIENT.MULTI_STATEMENTS
    )
    try:
        async with (
            dlock.aio.connect(server.url()) as holding,
            dlock.aio.connect(server.url()) as front,
            dlock.aio.connect("mysql://", client=pool.acquire) as pooled,
        ):
            turnstile = holding._backend._turnstile_key(name)  # type: ignore[attr-defined]

            def queued() -> tuple[bool, int]:
                conn = server.connect()
                try:
                    cursor = conn.cursor()
                    cursor.execute("SELECT IS_USED_LOCK(%s)", (turnstile,))
                    held = cursor.fetchone()[0] is not None
                    cursor.execute(
                        "SELECT count(*) FROM information_schema.processlist"
                        " WHERE state = 'User lock' AND info LIKE %s",
                        (f"%{turnstile}%",),
                    )
                    return held, int(cursor.fetchone()[0])
                finally:
                    conn.close()

            holder = holding.lock(name, ttl=30)
            assert await holder.acquire(timeout=0)
            first = front.lock(name, ttl=30)
            in_front = asyncio.create_task(first.acquire(timeout=20))
            deadline = time.monotonic() + 5
            while not queued()[0]:
                assert time.monotonic() < deadline, "the first waiter never got in front"
                await asyncio.sleep(0.01)
            await holder.release()
            assert await in_front  # it keeps the turnstile while it holds the lease
            cancelled = asyncio.create_task(pooled.lock(name, ttl=30).acquire(timeout=20))
            while not queued()[1]:
                assert time.monotonic() < deadline, "the pooled waiter never queued"
                await asyncio.sleep(0.01)
            app = await pool.acquire()  # the pool's last connection
            started = time.monotonic()
            cancelled.cancel()
            await first.release()  # hands the turnstile over inside the server
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert time.monotonic() - started < 3, "the cancellation waited for the pool"
            # A take by the dead session is given back well before its TTL.
            later = holding.lock(name, ttl=30)
            assert await later.acquire(timeout=3)
            await later.release()
            pool.release(app)
        assert not pool._used, "the pool's connection was kept"
    finally:
        pool.close()
        await asyncio.wait_for(pool.wait_closed(), 5)


async def test_a_lease_waiter_whose_pooler_check_fails_gives_its_connection_back(
    postgresql_server: SQLServer, name: str
) -> None:
    """A lease waiter asks a connection borrowed from the application's pool whether a
    pooler stands in front (a round trip) before it queues; when that failed (a server
    that stopped answering, a cancellation), the connection was never given back."""
    server = postgresql_server
    apool = psycopg_pool.AsyncConnectionPool(server.url(), min_size=1, max_size=1, open=False)
    await apool.open()
    try:
        async with (
            dlock.aio.connect(server.url()) as holding,
            dlock.aio.connect("postgresql://", client=apool.connection) as pooled,
        ):
            holder = holding.lock(name, ttl=30)
            assert await holder.acquire(timeout=0)
            backend: Any = pooled._backend
            ask = backend._behind_proxy
            # Kept alive: a lost connection would otherwise go back when the garbage
            # collector finalizes the pool's context manager, by chance.
            asked: list[Any] = []

            async def failing(conn: Any) -> bool:
                if conn.loan is not None and conn.behind_proxy is None:
                    asked.append(conn)
                    raise dlock.BackendUnavailable("no answer (injected)")
                return bool(await ask(conn))

            backend._behind_proxy = failing
            with pytest.raises(dlock.BackendUnavailable, match="injected"):
                await pooled.lock(name, ttl=30).acquire(timeout=5)
            async with apool.connection(timeout=2):
                pass
            await holder.release()
    finally:
        await apool.close()


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
def test_an_exhausted_sqlalchemy_pool_is_unavailable(
    database: str, request: pytest.FixtureRequest, name: str
) -> None:
    """SQLAlchemy's pool timeout is not a driver error: it was a plain BackendError,
    where the other pools' are BackendUnavailable (worth retrying)."""
    server: SQLServer = request.getfixturevalue(f"{database}_server")
    driver = "psycopg" if server.scheme == "postgresql" else "pymysql"
    engine = sqlalchemy.create_engine(
        server.url().replace("://", f"+{driver}://", 1),
        pool_size=1,
        max_overflow=0,
        pool_timeout=0.2,
    )
    busy = engine.raw_connection()
    try:
        with (
            dlock.connect(f"{server.scheme}://", client=engine.raw_connection) as client,
            pytest.raises(dlock.BackendUnavailable, match="pool lent no connection"),
        ):
            client.lock(name, ttl=5).acquire(timeout=0)
    finally:
        busy.close()
        engine.dispose()


def test_a_closed_psycopg_pool_is_a_refusal_not_unavailable(
    postgresql_server: SQLServer, name: str
) -> None:
    """A psycopg_pool closed by the application lends nothing ever again: its
    PoolClosed (a psycopg OperationalError) was BackendUnavailable, which a caller may
    retry for ever. It is a plain BackendError that says so, as aiomysql's closed pool
    already was."""
    pool = psycopg_pool.ConnectionPool(postgresql_server.url(), min_size=1, open=True)
    pool.close()
    with (
        dlock.connect("postgresql://", client=pool.connection) as client,
        pytest.raises(dlock.BackendError, match="closed") as raised,
    ):
        client.lock(name, ttl=5).acquire(timeout=0)
    assert not isinstance(raised.value, dlock.BackendUnavailable), raised.value


async def test_an_exhausted_aiomysql_pool_names_the_bound_that_applied(
    mariadb_server: SQLServer, name: str
) -> None:
    """aiomysql's pool waits for ever; dlock's bound (connect_timeout + 1) ends the
    wait, and was reported as the operation timeout's: "no answer within 10.0 s"."""
    pool = await _aiomysql_pool(mariadb_server, minsize=1, maxsize=1)
    busy = await pool.acquire()
    try:
        url = "mysql://?connect_timeout=0.5"
        async with dlock.aio.connect(url, client=pool.acquire) as client:
            with pytest.raises(dlock.BackendUnavailable, match=r"no connection within 1\.5 s"):
                await client.lock(name, ttl=5).acquire(timeout=0)
    finally:
        pool.release(busy)
        pool.close()
        await asyncio.wait_for(pool.wait_closed(), 5)


async def test_a_connection_given_back_closed_no_longer_strands_the_pools_waiters(
    mariadb_server: SQLServer, name: str
) -> None:
    """A lease waiter's borrowed connection goes back to the pool closed (it carries the
    turnstile). aiomysql's pool wakes the acquires waiting for a connection only when
    one comes back open: the application's tasks waiting on a full pool slept on,
    though it had room again, until some other connection came back open."""
    server = mariadb_server
    pool = await _aiomysql_pool(
        server, minsize=0, maxsize=1, client_flag=CLIENT.FOUND_ROWS | CLIENT.MULTI_STATEMENTS
    )
    try:
        async with (
            dlock.aio.connect(server.url()) as holding,
            dlock.aio.connect("mysql://", client=pool.acquire) as pooled,
        ):
            holder = holding.lock(name, ttl=30)
            assert await holder.acquire(timeout=0)
            backend: Any = pooled._backend
            waiting = asyncio.create_task(pooled.lock(name, ttl=30).acquire(timeout=1))
            deadline = time.monotonic() + 5
            while not any(waiter.in_front for waiter in backend._front.values()):
                assert time.monotonic() < deadline, "the waiter never got in front"
                await asyncio.sleep(0.01)

            async def borrow() -> None:
                async with pool.acquire() as conn, conn.cursor() as cursor:
                    await cursor.execute("SELECT 1")

            app = asyncio.create_task(borrow())
            assert not await waiting
            await asyncio.wait_for(app, 3)
            await holder.release()
    finally:
        pool.close()
        await asyncio.wait_for(pool.wait_closed(), 5)


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
def test_client_that_is_no_connection_is_refused_by_name(
    database: str, request: pytest.FixtureRequest, name: str
) -> None:
    server: SQLServer = request.getfixturevalue(f"{database}_server")
    # A pool itself, not its function that lends a connection.
    unopened = psycopg_pool.ConnectionPool(server.url(), open=False)
    with pytest.raises(dlock.ConfigurationError, match="client= must be a function"):
        dlock.connect(f"{server.scheme}://", client=unopened)
    # A function returning something else: named, never used as a connection.
    client = dlock.connect(f"{server.scheme}://", client=lambda: object())
    with client, pytest.raises(dlock.ConfigurationError, match=r"builtins\.object"):
        client.lock(name, ttl=5).acquire(timeout=0)


@pytest.mark.parametrize(
    ("url", "ignored"),
    [
        ("postgresql://app:secret@db.example:5433/", "host, port or credentials"),
        ("postgresql:///appdb", "database"),
        ("postgresql://?sslmode=verify-full", "sslmode"),
        ("mysql://root@localhost/", "host, port or credentials"),
        ("mysql://?ssl_ca=/etc/ca.pem&mode=session", "ssl_ca"),
        ("mysql://?unix_socket=/run/mysqld/mysqld.sock", "unix_socket"),
    ],
)
def test_a_url_setting_client_would_ignore_is_refused(url: str, ignored: str) -> None:
    """With ``client=`` the connections bring their own server, database, credentials
    and TLS: a URL that names others is refused, not silently ignored."""
    with pytest.raises(dlock.ConfigurationError, match=f"would be ignored: {ignored}"):
        dlock.connect(url, client=lambda: None)
    scheme = url.split("//")[0]
    dlock.connect(f"{scheme}//?mode=session&table=app_locks", client=print).close()
