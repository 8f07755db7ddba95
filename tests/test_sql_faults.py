"""Faults the SQL backends must survive: killed connections, restarts, bad configuration.

These run against the private servers of tests/servers/sql.py, sync face (the asyncio
face is generated from the same code and covered by the conformance suite).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import psycopg
import pymysql
import pytest
from pymysql.constants import CLIENT

import dlock
import dlock._sync.backends._server_sql
import dlock._sync.lock
import dlock.aio
from dlock._sql import DEFAULT_TABLES, MYSQL, advisory_key, named_lock_key
from dlock._sync.giveback import LOOK_AGAIN_AFTER
from dlock._types import Holder
from tests.servers import Partition
from tests.servers.sql import SQLServer, start_postgresql
from tests.servers.tls import Certificates, make_certificates
from tests.test_core import LONGEST_LABELS


@pytest.fixture
def name() -> str:
    return f"fault-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def admin(server: SQLServer) -> Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Run one statement as the administrator, on a fresh connection."""

    def run(sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        conn = server.connect()
        try:
            cursor = conn.cursor()
            cursor.execute(sql, params or None)
            return list(cursor.fetchall()) if cursor.description else []
        finally:
            conn.close()

    return run


@contextlib.contextmanager
def _login_where(
    server: SQLServer, postgresql: tuple[str, str], mysql: tuple[str, str] | None = None
) -> Iterator[str]:
    """A URL of a login under a setting a DBA might make, as (name, SQL value): on
    PostgreSQL for a role of its own; on MySQL, which has no per-user form, for the
    whole server, put back afterwards."""
    if server.scheme == "postgresql":
        role = f"dba_{uuid.uuid4().hex[:8]}"
        setting, value = postgresql
        with server.connect() as conn:
            conn.execute(f"CREATE ROLE {role} SUPERUSER LOGIN")
            conn.execute(f"ALTER ROLE {role} SET {setting} = {value}")
        yield f"postgresql://{role}@127.0.0.1:{server.port}/{server.database}"
        return
    assert mysql is not None, "a PostgreSQL setting only"
    run = admin(server)
    setting, value = mysql
    (before,) = run(f"SELECT @@GLOBAL.{setting}", ())[0]
    run(f"SET GLOBAL {setting} = {value}", ())
    try:
        yield server.url()
    finally:
        run(f"SET GLOBAL {setting} = %s", (before,))


def kill_other_sessions(server: SQLServer) -> None:
    """Cut every client connection but the administrator's, from the server side, and
    wait until they have ended."""
    run = admin(server)
    if server.scheme == "postgresql":
        query = (
            "SELECT pid FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        kill = "SELECT pg_terminate_backend({})"
    else:
        query = (
            "SELECT id FROM information_schema.processlist "
            "WHERE id <> CONNECTION_ID() AND command <> 'Daemon' AND user = 'dlock'"
        )
        kill = "KILL CONNECTION {}"
    killed = {int(session) for (session,) in run(query, ())}
    for session in killed:
        run(kill.format(session), ())
    # Both only signal the session: it ends (tells its client, frees its locks) moments
    # later. A statement sent meanwhile fails in flight, and dlock never sends one twice.
    deadline = time.monotonic() + 5
    while killed & {int(session) for (session,) in run(query, ())}:
        assert time.monotonic() < deadline, "killed sessions did not end"
        time.sleep(0.01)


def test_a_session_waiter_whose_session_is_killed_waits_on(
    server: SQLServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session-mode waiter whose wait's session the server ends (an administrator's
    kill): nothing is held, and the acquire waits on, on a new session, as it did when
    its connection had been pooled. On a connection opened for the wait (none idle in
    the pool: a burst), it raised BackendUnavailable instead (PostgreSQL's
    "terminating connection due to administrator command", a chaos helper's run)."""
    monkeypatch.setattr(dlock._sync.backends._server_sql, "POOL_SIZE", 0)
    # Only the blocking wait: the waiter's first, non-blocking try runs on a connection
    # of its own, closed as it ends (no pool), and a kill that found it gone failed
    # (MariaDB: "Unknown thread id"; its try names GET_LOCK inside an INSERT).
    if server.scheme == "postgresql":
        waits = (
            "SELECT pid FROM pg_stat_activity WHERE state = 'active'"
            " AND query LIKE '%%pg_advisory_lock(%%' AND pid <> pg_backend_pid()"
        )
        waits_params: tuple[Any, ...] = ()
    else:
        waits = (
            "SELECT id FROM information_schema.processlist"
            " WHERE info LIKE %s AND id <> CONNECTION_ID()"
        )
        table = f"{server.database}.{DEFAULT_TABLES['session']}"
        key = named_lock_key(table, name)
        waits_params = (f"%SELECT GET_LOCK('{key}'%",)
    kill = "SELECT pg_terminate_backend(%s)" if server.scheme == "postgresql" else "KILL %s"
    run = admin(server)
    url = server.url("mode=session")
    with dlock.connect(url) as holding, dlock.connect(url) as waiting:
        holder = holding.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        got: list[bool | BaseException] = []

        def wait() -> None:
            try:
                got.append(waiting.lock(name, ttl=30).acquire(timeout=20))
            except BaseException as exc:
                got.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 5
        while not (sessions := run(waits, waits_params)):
            assert time.monotonic() < deadline, "the waiter never waited in the server"
            time.sleep(0.01)
        for (session,) in sessions:
            run(kill, (int(session),))
        time.sleep(0.5)  # the waiter learns its session ended
        holder.release()
        waiter.join(25)
        assert got == [True]


def test_session_lock_freed_at_once_when_its_connection_is_killed(
    server: SQLServer, name: str
) -> None:
    lost: list[object] = []
    with dlock.connect(server.url("mode=session")) as first:
        lock = first.lock(name, ttl=30, on_lost=lost.append)
        lock.acquire()
        kill_other_sessions(server)
        with dlock.connect(server.url("mode=session")) as second:
            start = time.monotonic()
            successor = second.lock(name, ttl=30)
            assert successor.acquire(timeout=5)
            assert time.monotonic() - start < 1.0, "freed at once, not after the TTL"
            with pytest.raises(dlock.LockLost):
                lock.extend()
            assert lost == [lock]
            info = second.inspect(name)
            assert info is not None and info.fencing_token == successor.fencing_token
            successor.release()


@pytest.mark.parametrize("auto_renew", [True, False])
@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_a_session_holder_is_told_within_a_second_that_its_connection_was_killed(
    server: SQLServer, name: str, face: str, auto_renew: bool
) -> None:
    """The server ended the holder's session (an administrator's kill; a restart is the
    same): the lock is free for the next client at once, so the holder must hear of it
    soon, not at its next renewal, a third of its 30 s ttl later (a chaos run saw the
    next holder in within 5-125 ms and the old one told 0.1-0.7 s later with 2-4 s
    ttls). The renewer looks at the held connections each second: also with only an
    ``auto_renew=False`` lock held, which did not start it (told at its next call)."""
    lost: list[float] = []

    def killed_and_told() -> float:
        killed = time.monotonic()
        kill_other_sessions(server)
        deadline = killed + 5
        while not lost:
            assert time.monotonic() < deadline, "not told within 5 s"
            time.sleep(0.01)
        return lost[0] - killed

    async def asyncio_face() -> float:
        async with dlock.aio.connect(server.url("mode=session")) as client:
            lock = client.lock(
                name, ttl=30, auto_renew=auto_renew, on_lost=lambda _: lost.append(time.monotonic())
            )
            assert await lock.acquire(timeout=0)
            took = await asyncio.to_thread(killed_and_told)
            assert lock.lost and not lock.owned()
            return took

    if face == "asyncio":
        took = asyncio.run(asyncio_face())
    else:
        with dlock.connect(server.url("mode=session")) as client:
            lock = client.lock(
                name, ttl=30, auto_renew=auto_renew, on_lost=lambda _: lost.append(time.monotonic())
            )
            assert lock.acquire(timeout=0)
            took = killed_and_told()
            assert lock.lost and not lock.owned()
    assert took < 1.5, f"told {took:.2f} s after the kill"


def test_an_unrenewed_session_hold_carried_into_another_event_loop_is_still_watched(
    server: SQLServer, name: str
) -> None:
    """As above, for a client used by two ``asyncio.run`` calls: the renewer's task
    ends with the first loop, and a lock's first call in the next started it again only
    for leases it renews, so an ``auto_renew=False`` holder was not told there."""
    lost: list[float] = []
    client = dlock.aio.connect(server.url("mode=session"))
    lock = client.lock(
        name, ttl=30, auto_renew=False, on_lost=lambda _: lost.append(time.monotonic())
    )

    async def take() -> None:
        assert await lock.acquire(timeout=0)

    async def killed_in_the_next_loop() -> float:
        assert lock.owned()  # the lock's first call in this loop
        killed = time.monotonic()
        await asyncio.to_thread(kill_other_sessions, server)
        while not lost:
            assert time.monotonic() < killed + 5, "not told within 5 s"
            await asyncio.sleep(0.01)
        return lost[0] - killed

    asyncio.run(take())
    try:
        took = asyncio.run(killed_in_the_next_loop())
    finally:
        asyncio.run(client.aclose())
    assert took < 1.5, f"told {took:.2f} s after the kill"


def test_an_answer_on_a_held_connection_is_not_taken_for_its_close(
    server: SQLServer, name: str
) -> None:
    """The renewer looks at a held connection's socket, from its own thread, to learn
    that the server closed it; the answer to a statement running on that connection
    makes the socket readable too, for a moment, and is not a loss. Looked at as often
    as a thread can while statements run one after another for a second."""
    with dlock.connect(server.url("mode=session")) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        backend: Any = client._backend
        (held,) = backend._held.values()
        done = threading.Event()
        looks: list[bool] = []

        def look() -> None:
            while not done.is_set():
                looks.append(backend.lease_lost(name, lock._token))

        looker = threading.Thread(target=look)
        looker.start()
        try:
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline:
                backend._run(held.conn, "SELECT 1", {})
        finally:
            done.set()
            looker.join()
        assert len(looks) > 100
        assert not any(looks), f"{sum(looks)} of {len(looks)} looks took an answer for a close"
        assert lock.owned()
        lock.release()


@pytest.mark.parametrize("step", ["re-entry", "partial release"])
def test_a_session_lock_whose_connection_was_killed_is_neither_re_entered_nor_kept(
    server: SQLServer, name: str, step: str
) -> None:
    """A re-entry or a partial release only counted the level in the row, on another
    connection: after the holder's session was killed (the lock freed at once, and
    another client's to take), a re-entry was granted, and a partial release left
    ``owned()`` true, until the next renewal."""
    lost: list[object] = []
    with dlock.connect(server.url("mode=session")) as first:
        lock = first.lock(name, ttl=30, reentrant=True, on_lost=lost.append, auto_renew=False)
        assert lock.acquire(timeout=0)
        if step == "partial release":
            assert lock.acquire(timeout=0)
        kill_other_sessions(server)
        with pytest.raises(dlock.LockLost):
            if step == "re-entry":
                lock.acquire(timeout=0)
            else:
                lock.release()
        assert not lock.owned() and lost == [lock]
        with dlock.connect(server.url("mode=session")) as second:
            assert second.lock(name, ttl=30).acquire(timeout=0)


def test_a_grant_answered_as_the_client_closes_is_given_back(server: SQLServer, name: str) -> None:
    """close() while an acquire's attempt is in flight: the grant comes back after close
    began. The acquire must give it back before close shuts the backend, which would
    refuse the give-back and leave the lease held for its TTL."""

    async def main() -> None:
        async with dlock.aio.connect(server.url()) as other:
            client = dlock.aio.connect(server.url())
            backend = client._backend
            real_acquire = backend.acquire
            granted, closing = asyncio.Event(), asyncio.Event()

            async def answered_late(*args: Any) -> Any:
                result = await real_acquire(*args)
                granted.set()
                await closing.wait()
                return result

            backend.acquire = answered_late  # type: ignore[method-assign,assignment]
            task = asyncio.create_task(client.lock(name, ttl=60).acquire())
            await asyncio.wait_for(granted.wait(), 10)
            closing.set()
            await client.aclose()
            with pytest.raises(dlock.BackendError, match="closed"):
                await task
            assert await other.inspect(name) is None

    asyncio.run(main())


def test_lease_survives_its_connection_being_killed(server: SQLServer, name: str) -> None:
    with dlock.connect(server.url()) as first, dlock.connect(server.url()) as second:
        lock = first.lock(name, ttl=1.5, auto_renew=False)
        lock.acquire()
        kill_other_sessions(server)
        assert second.lock(name, ttl=5).acquire(timeout=0) is False, "the lease is still live"
        lock.extend()  # the holder reconnects and still owns it
        lock.release()
        assert second.lock(name, ttl=5).acquire(timeout=0)


def test_database_restart_while_a_lease_is_held(server: SQLServer, name: str) -> None:
    with dlock.connect(server.url()) as first, dlock.connect(server.url()) as second:
        lock = first.lock(name, ttl=4)
        lock.acquire()
        acquired_at = time.monotonic()
        token = lock.fencing_token
        # The waiter's pooled connections (statements, LISTEN) are about to die too.
        assert second.lock(name, ttl=5).acquire(timeout=0.2) is False
        server.restart()
        # Past the first lease's end: only a renewal after the restart keeps it held
        # (owned() reads local state, so the server is asked).
        time.sleep(max(2.0, acquired_at + 4.5 - time.monotonic()))
        info = second.inspect(name)
        assert info is not None and info.fencing_token == token, "renewal survived the restart"
        assert lock.owned()
        assert second.lock(name, ttl=5).acquire(timeout=0.3) is False
        lock.release()
        successor = second.lock(name, ttl=5)
        assert successor.acquire(timeout=2)
        assert token is not None and successor.fencing_token is not None
        assert successor.fencing_token > token, "fencing survives the restart"
        successor.release()


def _tokens_of_turns(url: str, name: str, turns: int) -> list[int | None]:
    """The fencing tokens of ``turns`` acquisitions of ``name`` in a row, by one client."""
    tokens: list[int | None] = []
    with dlock.connect(url) as client:
        for _ in range(turns):
            lock = client.lock(name, ttl=5)
            assert lock.acquire(timeout=0)
            tokens.append(lock.fencing_token)
            lock.release()
    return tokens


def _assert_increasing(tokens: list[int | None]) -> None:
    known = [token for token in tokens if token is not None]
    assert len(known) == len(tokens), f"acquired without a token: {tokens}"
    assert known == sorted(set(known)), f"fencing tokens went back: {tokens}"


def test_session_fencing_survives_a_crash_that_empties_the_table(
    server: SQLServer, name: str
) -> None:
    """Session mode keeps its counters in a table that a crash empties (UNLOGGED,
    MEMORY); tokens must still increase, from the server's clock."""
    url = server.url("mode=session")
    tokens = _tokens_of_turns(url, name, 3)
    if server.scheme == "postgresql":
        # The test server commits asynchronously: make the table itself durable first.
        admin(server)("CHECKPOINT", ())
    server.crash_restart()
    rows = admin(server)("SELECT fence FROM dlock_session_locks WHERE name = %s", (name.encode(),))
    assert rows == [], "the crash emptied the table (else this test proves nothing)"
    _assert_increasing(tokens + _tokens_of_turns(url, name, 1))


@pytest.mark.parametrize("loss", ["grants rolled back", "row lost"])
def test_lease_fencing_survives_a_table_behind_its_tokens(
    server: SQLServer, name: str, loss: str
) -> None:
    """A failover to an asynchronous replica that had not seen the latest grants, or a
    restore from a backup, leaves the lease table behind tokens already handed out. A
    holder cut off by it may still write with its token: the next holder's must be
    larger, or the fencing check downstream lets the old holder's writes in."""
    tokens = _tokens_of_turns(server.url(), name, 3)
    run = admin(server)
    if loss == "row lost":
        run("DELETE FROM dlock_locks WHERE name = %s", (name.encode(),))
    else:
        run("UPDATE dlock_locks SET fence = %s WHERE name = %s", (tokens[0], name.encode()))
    # A new client, as the application's after the failover.
    _assert_increasing(tokens + _tokens_of_turns(server.url(), name, 1))


def test_a_name_whose_row_a_failover_lost_can_be_taken_again(server: SQLServer, name: str) -> None:
    """A failover to a replica that never saw a name's row (or a restore from an older
    backup) ends every connection. A client that knew the name to have a row must not
    go on answering "busy" for it with no row there: a try-lock would never run again."""
    with dlock.connect(server.url()) as client:
        lock = client.lock(name, ttl=5)
        assert lock.acquire(timeout=0)
        lock.release()
        admin(server)("DELETE FROM dlock_locks WHERE name = %s", (name.encode(),))
        kill_other_sessions(server)
        assert lock.acquire(timeout=0), "busy, for a name with no row"
        lock.release()


def test_session_force_release_ends_the_holder_not_the_next_one(
    server: SQLServer, name: str
) -> None:
    """A force release ends the holder's session, and the waiter queued in the server
    takes the lock at that moment. The release must not end the waiter's session too,
    nor miss the holder it ended (PostgreSQL re-checked its condition, ending sessions,
    on the row the waiter had just written). Raced a few times over."""
    url = server.url("mode=session")
    with dlock.connect(url) as holders, dlock.connect(url) as waiters:
        for turn in range(8):
            lock_name = f"{name}-{turn}"
            holder = holders.lock(lock_name, ttl=30, auto_renew=False)
            assert holder.acquire(timeout=0)
            waiter = waiters.lock(lock_name, ttl=30, auto_renew=False)
            thread = threading.Thread(target=waiter.acquire, kwargs={"timeout": 10})
            thread.start()
            time.sleep(0.2)  # queued in the server
            with dlock.connect(url) as operator:
                assert operator.force_release(lock_name), f"turn {turn}: holder not ended"
            thread.join()
            assert waiter.owned()
            waiter.extend()  # its session and its row are intact
            info = waiters.inspect(lock_name)
            assert info is not None and info.fencing_token == waiter.fencing_token
            waiter.release()


def test_a_session_force_release_returns_once_the_lock_is_free(
    postgresql_server: SQLServer, name: str
) -> None:
    """Ending a session from outside (pg_terminate_backend; MariaDB's KILL) returns
    before the session has freed its locks, which go only as it exits: a force release
    that said True left the lock held a moment longer, and an acquire right after it
    found the lock busy. The holder's server process is paused here (SIGSTOP), so that
    moment lasts until it resumes."""
    url = postgresql_server.url("mode=session")
    with dlock.connect(url) as holder_client, dlock.connect(url) as other:
        holder = holder_client.lock(name, ttl=30, auto_renew=False)
        assert holder.acquire(timeout=0)
        rows = admin(postgresql_server)(
            "SELECT session FROM dlock_session_locks WHERE name = %s", (name.encode(),)
        )
        pid = int(rows[0][0])
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            assert other.force_release(name)
            taken = other.lock(name, ttl=30).acquire(timeout=0)
        finally:
            resume.join()
        assert taken, "force_release said True while the ended session still held the lock"


def test_mysql_clock_ignores_daylight_saving(mariadb_server: SQLServer) -> None:
    """The server clock that leases expire by is the epoch whatever the time zone: with
    UNIX_TIMESTAMP(NOW(6)), 02:30 CEST on the autumn change day read as 02:30 CET, an
    hour ahead, so a lease taken at 01:59:50 would have expired at 02:00:00."""
    # The zone is loaded once per server: its rows stay, and loading them again (this
    # test repeated on the worker's server) fails on their primary keys.
    loaded = "SELECT count(*) FROM mysql.time_zone_name WHERE Name = 'Europe/Berlin'"
    if not admin(mariadb_server)(loaded, ())[0][0]:
        subprocess.run(
            f"mariadb-tzinfo-to-sql /usr/share/zoneinfo/Europe/Berlin Europe/Berlin"
            f" | mariadb --protocol=tcp -h127.0.0.1 -P{mariadb_server.port} -udlock -psecret"
            " mysql",
            shell=True,
            check=True,
            capture_output=True,
        )
    conn = mariadb_server.connect()
    try:
        cursor = conn.cursor()
        cursor.execute("SET time_zone = 'Europe/Berlin'")
        # 2025-10-26 00:30 and 01:30 UTC: 02:30 CEST, then 02:30 CET.
        for epoch in (1761438600.25, 1761442200.25):
            cursor.execute(f"SET timestamp = {epoch}")
            cursor.execute(f"SELECT {MYSQL.now}, {MYSQL.clock_us}")
            now, clock_us = cursor.fetchone()
            assert float(now) == epoch and int(clock_us) == int(epoch * 1_000_000)
    finally:
        conn.close()


@pytest.mark.parametrize("face", ["sync", "asyncio"])
@pytest.mark.parametrize("first", ["lease", "session"])
def test_a_table_made_for_one_mode_is_refused_to_the_other(
    server: SQLServer, name: str, first: str, face: str
) -> None:
    """A lease-mode and a session-mode client given one ``table=`` did not exclude
    each other: session mode takes the database's own lock whatever lease the row
    holds, so both held the name at once. The table's kind (durable for leases;
    UNLOGGED or MEMORY for session locks, which die with their connections anyway)
    tells which mode made it, and the other mode's client is refused."""
    table = f"one_{uuid.uuid4().hex[:8]}"
    modes = {"lease": server.url(), "session": server.url("mode=session")}
    second = "session" if first == "lease" else "lease"

    async def hold_then_try_other() -> None:
        async with dlock.aio.connect(modes[first], table=table) as holding:
            held = holding.lock(name, ttl=30)
            assert await held.acquire(timeout=0)
            async with dlock.aio.connect(modes[second], table=table) as other:
                with pytest.raises(dlock.ConfigurationError, match=f"{table}.* {first} mode"):
                    await other.lock(name, ttl=30).acquire(timeout=0)
                assert held.owned()
            await held.release()

    if face == "asyncio":
        asyncio.run(hold_then_try_other())
    else:
        with dlock.connect(modes[first], table=table) as holding:
            held = holding.lock(name, ttl=30)
            assert held.acquire(timeout=0)
            with dlock.connect(modes[second], table=table) as other:
                with pytest.raises(dlock.ConfigurationError, match=f"{table}.* {first} mode"):
                    other.lock(name, ttl=30).acquire(timeout=0)
                assert held.owned()
            held.release()
    admin(server)(f"DROP TABLE {table}", ())


def test_full_session_table_prunes_free_names(mariadb_server: SQLServer, name: str) -> None:
    """MariaDB's MEMORY session table has a fixed size; rows of free names make room,
    while a held lock's row (and its token) stays."""
    table = f"tiny_{uuid.uuid4().hex[:8]}"
    conn = mariadb_server.connect()
    try:
        cursor = conn.cursor()
        cursor.execute("SET SESSION max_heap_table_size = 16384")  # the smallest allowed
        cursor.execute(MYSQL.schema(table, session=True))
    finally:
        conn.close()
    with dlock.connect(mariadb_server.url("mode=session"), table=table) as client:
        held = client.lock(f"{name}-held", ttl=30)
        assert held.acquire(timeout=0)
        last: dict[str, int] = {}
        for round_ in range(2):
            for i in range(40):
                lock = client.lock(f"{name}-{i}", ttl=30)
                assert lock.acquire(timeout=0)
                token = lock.fencing_token
                assert token is not None and token > last.get(lock.name, 0), (round_, i)
                last[lock.name] = token
                lock.release()
        info = client.inspect(held.name)
        assert info is not None and info.fencing_token == held.fencing_token
        held.release()
    rows = admin(mariadb_server)(f"SELECT count(*) FROM {table}", ())
    assert rows[0][0] < 40, "the table really was too small for every name"
    admin(mariadb_server)(f"DROP TABLE {table}", ())


@contextlib.contextmanager
def global_sql_mode(server: SQLServer, value: str) -> Iterator[None]:
    """The server's global ``sql_mode`` set to the SQL expression ``value`` (for the
    connections opened meanwhile), and put back afterwards."""
    run = admin(server)
    (before,) = run("SELECT @@GLOBAL.sql_mode", ())[0]
    run(f"SET GLOBAL sql_mode = {value}", ())
    try:
        yield
    finally:
        run("SET GLOBAL sql_mode = %s", (before,))


@pytest.fixture
def no_backslash_escapes(mariadb_server: SQLServer) -> Iterator[SQLServer]:
    """MariaDB with ``NO_BACKSLASH_ESCAPES`` (and ANSI quoting) in its global
    ``sql_mode``, put back afterwards: a backslash in a string literal is then an
    ordinary character."""
    with global_sql_mode(mariadb_server, "'ANSI,NO_BACKSLASH_ESCAPES,STRICT_ALL_TABLES'"):
        yield mariadb_server


#: Names whose quoting a server's sql_mode changes, and two that try to escape their
#: literal: one's OR would match every row, the other runs a statement of its own.
AWKWARD = ["it's", "a\\'b", "ends\\", "semi;colon -- x", "100%", "nul\x00byte", "ünï ☃", '"dq"']
ESCAPE_ATTEMPTS = ["x\\' OR TRUE -- ", "x\\'; CREATE TABLE injected (x INT); -- "]


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_names_match_exactly_in_every_sql_mode(
    no_backslash_escapes: SQLServer, name: str, mode: str
) -> None:
    """Lock names are stored and matched exactly, in both faces, whatever the server's
    ``sql_mode``; a name written to break out of its literal is only a name, and the
    lock it would have matched along with it stays its holder's. (The asyncio face
    quoted names with backslashes, which ``NO_BACKSLASH_ESCAPES`` reads as plain
    characters: a syntax error at best, SQL run from a lock name at worst.)"""
    url = no_backslash_escapes.url(f"mode={mode}")
    names = [f"{name}{suffix}" for suffix in [*AWKWARD, *ESCAPE_ATTEMPTS]]

    def check(info: dlock.LockInfo | None, lock_name: str, token: int | None) -> None:
        assert info is not None and info.name == lock_name and info.fencing_token == token

    async def in_asyncio(victim: dlock.Lock) -> None:
        async with dlock.aio.connect(url) as client:
            for lock_name in names:
                lock = client.lock(lock_name, ttl=30)
                assert await lock.acquire(timeout=0), lock_name
                check(await client.inspect(lock_name), lock_name, lock.fencing_token)
                assert lock_name in {info.name for info in await client.list(name)}
                await lock.release()
                assert await client.inspect(lock_name) is None
            check(await client.inspect(victim.name), victim.name, victim.fencing_token)

    with dlock.connect(url) as holder, dlock.connect(url) as client:
        victim = holder.lock(f"{name}-victim", ttl=30)
        assert victim.acquire(timeout=0)
        for lock_name in names:
            lock = client.lock(lock_name, ttl=30)
            assert lock.acquire(timeout=0), lock_name
            check(client.inspect(lock_name), lock_name, lock.fencing_token)
            assert lock_name in {info.name for info in client.list(name)}
            lock.release()
            assert client.inspect(lock_name) is None
        check(client.inspect(victim.name), victim.name, victim.fencing_token)
        asyncio.run(in_asyncio(victim))
        victim.extend()
        victim.release()
    assert admin(no_backslash_escapes)("SHOW TABLES LIKE 'injected'", ()) == []


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_the_longest_labels_fit(server: SQLServer, name: str, mode: str) -> None:
    """A label ``connect()`` accepts is stored whole by both databases in both modes
    (the holder column: 1024 characters, or bytes in MySQL's session table)."""
    for label in LONGEST_LABELS:
        with (
            dlock.connect(server.url(f"mode={mode}"), label=label) as client,
            client.lock(name, ttl=30),
        ):
            info = client.inspect(name)
            assert info is not None and info.holder.label == label


@pytest.fixture
def simultaneous_assignment(mariadb_server: SQLServer) -> Iterator[SQLServer]:
    """MariaDB with ``SIMULTANEOUS_ASSIGNMENT`` in its global ``sql_mode`` (a DBA's
    choice; MySQL has no such mode), put back afterwards: every assignment of an
    ``UPDATE`` then reads the row as it was, where MySQL's default reads the columns
    already assigned to its left."""
    with global_sql_mode(mariadb_server, "CONCAT(@@GLOBAL.sql_mode, ',SIMULTANEOUS_ASSIGNMENT')"):
        yield mariadb_server


def test_releases_free_the_lease_in_either_assignment_order(
    simultaneous_assignment: SQLServer, name: str
) -> None:
    """The last release ends the lease and the one before it does not, on a server that
    assigns all columns at once too: a release that read the count it had just
    lowered left the lease live until its TTL. Both ways of releasing: the plain one,
    and that of a lease a waiter took in front of the queue (which also leaves the
    queue's turnstile for the next waiter)."""
    url = simultaneous_assignment.url()
    with dlock.connect(url) as a, dlock.connect(url) as b, dlock.connect(url) as c:
        (mode,) = admin(simultaneous_assignment)("SELECT @@GLOBAL.sql_mode", ())[0]
        assert "SIMULTANEOUS_ASSIGNMENT" in mode
        held = a.lock(name, ttl=60, reentrant=True)
        assert held.acquire(timeout=0) and held.acquire(timeout=0)
        held.release()
        assert not c.lock(name, ttl=60).acquire(timeout=0), "freed with one level left"
        held.release()
        assert c.inspect(name) is None

        assert held.acquire(timeout=0)
        waiter = b.lock(name, ttl=60)
        granted: list[bool] = []
        thread = threading.Thread(target=lambda: granted.append(waiter.acquire(timeout=30)))
        thread.start()
        time.sleep(0.5)  # the waiter queues in the server
        held.release()
        thread.join()
        assert granted == [True]
        waiter.release()
        assert c.inspect(name) is None
        third = c.lock(name, ttl=60)
        assert third.acquire(timeout=0), "the waiter's release left the lease live"
        third.release()


@pytest.mark.parametrize(
    "table",
    ["x; DROP TABLE y", "a b", "1abc", "t" * 64, "naïve", "", "a.b.c", "a.", ".b", "a.b;c", "a .b"],
)
def test_malicious_table_names_are_refused(server: SQLServer, table: str) -> None:
    with pytest.raises(dlock.ConfigurationError, match="table"):
        dlock.connect(server.url(), table=table)


@pytest.mark.parametrize("mode", ["lease", "session"])
@pytest.mark.parametrize("table", ["pg_temp.locks", "PG_TEMP.locks", "pg_catalog.locks"])
def test_a_table_in_a_system_schema_is_refused(
    postgresql_server: SQLServer, name: str, mode: str, table: str
) -> None:
    """``table=pg_temp.locks`` made a temporary table, each connection's own: two
    clients held one name at once (a helper's `dlock run` twice, 4 of 4)."""
    url = postgresql_server.url(f"mode={mode}")
    with (
        dlock.connect(url, table=table) as client,
        pytest.raises(dlock.ConfigurationError, match="system schema"),
    ):
        client.lock(name, ttl=5).acquire(timeout=0)


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_lock_table_in_a_schema_of_its_own(server: SQLServer, name: str, mode: str) -> None:
    """``table=schema.table`` (MySQL: ``database.table``) puts the table there."""
    run = admin(server)
    schema = f"locks_{uuid.uuid4().hex[:8]}"
    kind = "SCHEMA" if server.scheme == "postgresql" else "DATABASE"
    run(f"CREATE {kind} {schema}", ())
    try:
        url = server.url(f"mode={mode}&table={schema}.my_locks")
        with dlock.connect(url) as client, dlock.connect(url) as other:
            lock = client.lock(name, ttl=5)
            assert lock.acquire(timeout=0)
            info = client.inspect(name)
            assert info is not None and info.fencing_token == lock.fencing_token
            assert [x.name for x in client.list(name)] == [name]
            waiter = other.lock(name, ttl=5)
            threading.Timer(0.2, lock.release).start()
            assert waiter.acquire(timeout=5), "a waiter did not get it on release"
            assert waiter.fencing_token is not None and lock.fencing_token is not None
            assert waiter.fencing_token > lock.fencing_token
            waiter.release()
        query = (
            "SELECT count(*) FROM information_schema.tables"
            " WHERE table_schema = %s AND table_name = 'my_locks'"
        )
        assert run(query, (schema,))[0][0] == 1
    finally:
        run(f"DROP {kind} {schema}" + (" CASCADE" if kind == "SCHEMA" else ""), ())


@contextlib.contextmanager
def _namespaces(server: SQLServer, count: int) -> Iterator[list[str]]:
    """New PostgreSQL schemas (MySQL: databases), dropped afterwards."""
    run = admin(server)
    kind = "SCHEMA" if server.scheme == "postgresql" else "DATABASE"
    names = [f"ns_{uuid.uuid4().hex[:8]}" for _ in range(count)]
    for namespace in names:
        run(f"CREATE {kind} {namespace}", ())
    try:
        yield names
    finally:
        for namespace in names:
            run(f"DROP {kind} {namespace}" + (" CASCADE" if kind == "SCHEMA" else ""), ())


def _connection_in(server: SQLServer, namespace: str) -> Any:
    """The application's connection, looking up unqualified tables in ``namespace``
    first: a search_path of a tenant's schema (PostgreSQL), a current database (MySQL)."""
    if server.scheme == "postgresql":
        conn = server.connect()
        conn.execute(f"SET search_path = {namespace}, public")
        return conn
    return server.connect(
        database=namespace, client_flag=CLIENT.FOUND_ROWS | CLIENT.MULTI_STATEMENTS
    )


def _tables_named(server: SQLServer, table: str) -> list[str]:
    """The schemas (MySQL: databases) that hold a table of this name."""
    rows = admin(server)(
        "SELECT table_schema FROM information_schema.tables WHERE table_name = %s", (table,)
    )
    return sorted(str(row[0]) for row in rows)


def _one_lock_through_both(one: dlock.Client, other: dlock.Client, name: str) -> None:
    """Held through ``one``, ``name`` is busy through ``other``; released, ``other``
    takes it with a larger fencing token: the two clients share one lock table."""
    held = one.lock(name, ttl=10)
    assert held.acquire(timeout=0)
    assert not other.lock(name, ttl=10).acquire(timeout=0), "two holders at once"
    held.release()
    later = other.lock(name, ttl=10)
    assert later.acquire(timeout=0)
    assert later.fencing_token is not None and held.fencing_token is not None
    assert later.fencing_token > held.fencing_token
    later.release()


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_one_client_keeps_one_table_whatever_its_connections_look_in(
    server: SQLServer, name: str, mode: str
) -> None:
    """An application's connections may look up tables in different places (a tenant's
    search_path, a ``USE`` of another database). An unqualified table is the one the
    client's first connection finds, for every later connection too: a lock held
    through one connection is busy through the next, and its fencing tokens go on."""
    table = f"locks_{uuid.uuid4().hex[:8]}"
    with _namespaces(server, 2) as namespaces:
        lent = iter(namespaces * 10)

        def factory() -> Any:
            return _connection_in(server, next(lent))

        with dlock.connect(f"{server.scheme}://", client=factory, mode=mode, table=table) as client:
            first = client.lock(name, ttl=10)
            assert first.acquire(timeout=0)
            # A session lock keeps its connection, a lease waiter queues on one of its
            # own: either way the second lock works through the next namespace.
            second = client.lock(name, ttl=10)
            released_at: list[float] = []

            def release_first() -> None:
                released_at.append(time.monotonic())
                first.release()

            timer = threading.Timer(0.5, release_first)
            timer.start()
            try:
                assert second.acquire(timeout=10)
            finally:
                timer.cancel()
            acquired_at = time.monotonic()
            assert released_at and acquired_at >= released_at[0], "two holders at once"
            assert first.fencing_token is not None and second.fencing_token is not None
            assert second.fencing_token > first.fencing_token
            second.release()
        assert _tables_named(server, table) == [namespaces[0]]


@pytest.mark.parametrize("table", [None, "shared_locks"])
def test_a_new_table_does_not_hide_one_further_along_the_search_path(
    postgresql_server: SQLServer, name: str, table: str | None
) -> None:
    """PostgreSQL creates an unqualified table in the first schema of the search_path,
    even when one of that name is further along it. A role whose search_path starts
    with a schema of its own (PostgreSQL 15 suggests one per user, ``"$user", public``)
    must use the table that `dlock init` made in public, not make a private one and
    hold the same lock as everybody else."""
    server = postgresql_server
    options: dict[str, Any] = {} if table is None else {"table": table}
    lookup = "dlock_locks" if table is None else table
    with _namespaces(server, 1) as (tenant,), contextlib.ExitStack() as stack:
        shared = stack.enter_context(dlock.connect(server.url(), **options))
        url = stack.enter_context(_login_where(server, ("search_path", f"{tenant}, public")))
        tenants = stack.enter_context(dlock.connect(url, **options))
        _one_lock_through_both(shared, tenants, name)
        assert _tables_named(server, lookup) == ["public"]


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_one_table_named_two_ways_is_one_set_of_locks(
    server: SQLServer, name: str, mode: str
) -> None:
    """``table=t`` and ``table=<schema>.t`` are the same table, so the same locks: in
    session mode too, where the database's own lock is keyed by the table's name."""
    table = f"locks_{uuid.uuid4().hex[:8]}"
    home = "public" if server.scheme == "postgresql" else server.database
    plain = server.url(f"mode={mode}&table={table}")
    qualified = server.url(f"mode={mode}&table={home}.{table}")
    with dlock.connect(plain) as one, dlock.connect(qualified) as other:
        _one_lock_through_both(one, other, name)


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_table_named_with_a_reserved_word_is_one_set_of_locks(
    server: SQLServer, name: str, mode: str
) -> None:
    """A reserved word must be quoted where it stands alone: PostgreSQL found
    ``table=order`` as ``"order"`` and kept ``table=<schema>.order`` as given, and made
    the lock keys from the two spellings. Session mode then had two holders at once;
    a lease waiter queued on a turnstile and listened on a channel that the holder's
    release never touched, and slept on."""
    with _namespaces(server, 1) as (home,), contextlib.ExitStack() as stack:
        if server.scheme == "postgresql":
            url = stack.enter_context(_login_where(server, ("search_path", home)))
        else:
            url = server.url().rsplit("/", 1)[0] + f"/{home}"
        plain = stack.enter_context(dlock.connect(url, mode=mode, table="order"))
        qualified = stack.enter_context(
            dlock.connect(server.url(), mode=mode, table=f"{home}.order")
        )
        _one_lock_through_both(plain, qualified, name)
        holder = plain.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        waiter = qualified.lock(name, ttl=30)
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=10))
        thread.start()
        time.sleep(0.3)  # queued (a late waiter finds the lock free: no false failure)
        released = time.monotonic()
        holder.release()
        thread.join(15)
        assert waiter.owned(), "the waiter never got the lock"
        # Unheard, a lease waiter tries again only after its 2 s fallback.
        assert time.monotonic() - released < 1, "the waiter did not hear the release"
        waiter.release()


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_database_whose_name_needs_quoting_holds_the_table(
    mariadb_server: SQLServer, name: str, mode: str
) -> None:
    """The database dlock names the table in comes from the URL or the server, not from
    ``table=``'s checked identifiers: one named ``locks-<hex>`` is quoted, whether
    named without asking (the URL) or asked for (``client=``)."""
    server = mariadb_server
    database = f"locks-{uuid.uuid4().hex[:8]}"
    run = admin(server)
    run(f"CREATE DATABASE `{database}`", ())
    try:
        from_url = server.url(f"mode={mode}").replace(f"/{server.database}?", f"/{database}?")
        with (
            dlock.connect(from_url) as own,
            dlock.connect(
                f"mysql://?mode={mode}",
                client=lambda: server.connect(database=database, client_flag=CLIENT.FOUND_ROWS),
            ) as lent,
        ):
            _one_lock_through_both(own, lent, name)
        assert _tables_named(server, DEFAULT_TABLES[mode]).count(database) == 1
    finally:
        run(f"DROP DATABASE `{database}`", ())


def test_an_unqualified_table_with_nowhere_to_be_is_a_clear_error(
    server: SQLServer, name: str
) -> None:
    """No schema of the search_path exists (PostgreSQL), no database in the URL (MySQL):
    the error says to name the table in full, before any lock is tried."""
    table = f"locks_{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        if server.scheme == "postgresql":
            url = stack.enter_context(_login_where(server, ("search_path", "nowhere")))
        else:
            url = server.url().rsplit("/", 1)[0] + "/"
        client = stack.enter_context(dlock.connect(url, table=table))
        with pytest.raises(dlock.ConfigurationError, match=rf"table=<\w+>\.{table}"):
            client.lock(name, ttl=5).acquire(timeout=0)


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_table_in_a_schema_that_does_not_exist_says_to_create_the_schema(
    server: SQLServer, name: str, mode: str
) -> None:
    """The advice was to grant CREATE or run `dlock init`, neither of which makes a
    schema (PostgreSQL) or database (MySQL): the error, on first use or from `dlock
    init` (which ``create_table=false`` points to), says to create that first."""
    missing = f"nowhere_{uuid.uuid4().hex[:8]}"
    kind = "schema" if server.scheme == "postgresql" else "database"
    for setup in ("true", "false"):
        url = server.url(f"mode={mode}&table={missing}.locks&create_table={setup}")
        with dlock.connect(url) as client, pytest.raises(dlock.BackendError) as refused:
            if setup == "true":
                client.lock(name, ttl=5).acquire(timeout=0)
            else:
                backend: Any = client._backend
                backend.init()  # what `dlock init` runs
        message = str(refused.value)
        assert missing in message and f"create the {kind} first" in message, message
        assert "grant CREATE" not in message and "dlock init" not in message, message
        assert not isinstance(refused.value, dlock.BackendUnavailable)


def test_a_new_clients_force_release_wakes_waiters_on_an_unqualified_table(
    server: SQLServer, name: str
) -> None:
    """A force release is often a new client's first operation (``dlock release``): it
    wakes the waiters on the channel made from the table's full name, as found by that
    first connection, not from the name as configured."""
    url = server.url(f"table=locks_{uuid.uuid4().hex[:8]}")
    with dlock.connect(url) as client:
        holder = client.lock(name, ttl=30, auto_renew=False)
        assert holder.acquire(timeout=0)
        waiter = client.lock(name, ttl=30)
        woken: list[float] = []

        def wait() -> None:
            if waiter.acquire(timeout=10):
                woken.append(time.monotonic())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)
        released = time.monotonic()
        with dlock.connect(url) as operator:
            assert operator.force_release(name)
        thread.join()
        assert woken and woken[0] - released < 1.0, "the waiter was not woken"
        waiter.release()


def test_unknown_option_is_refused(server: SQLServer) -> None:
    with pytest.raises(dlock.ConfigurationError, match="unknown"):
        dlock.connect(server.url("colour=blue"))
    with pytest.raises(dlock.ConfigurationError, match="mode"):
        dlock.connect(server.url("mode=advisory"))


@pytest.fixture
def limited_url(server: SQLServer) -> Iterator[str]:
    """A role that may use but not create tables."""
    run = admin(server)
    user = f"limited_{uuid.uuid4().hex[:8]}"
    if server.scheme == "postgresql":
        run(f"CREATE ROLE {user} LOGIN", ())
        run(f"REVOKE CREATE ON SCHEMA public FROM {user}", ())
        url = server.url().replace("postgres:@", f"{user}:@")
    else:
        run(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'", ())
        run(f"GRANT SELECT, INSERT, UPDATE ON dlock.* TO '{user}'@'%'", ())
        url = server.url().replace("dlock:secret@", f"{user}:pw@")
    yield url
    run(f"DROP {'ROLE' if server.scheme == 'postgresql' else 'USER'} {user}", ())


def test_missing_privilege_to_create_the_table_is_a_clear_error(limited_url: str) -> None:
    table = f"noperm_{uuid.uuid4().hex[:8]}"
    with (
        dlock.connect(limited_url, table=table) as client,
        pytest.raises(dlock.BackendError, match="dlock init"),
    ):
        client.lock("x", ttl=5).acquire(timeout=0)


def test_read_only_server_is_a_clear_error(server: SQLServer, name: str) -> None:
    run = admin(server)
    if server.scheme == "postgresql":
        run("ALTER DATABASE postgres SET default_transaction_read_only = on", ())
        try:
            with (
                dlock.connect(server.url()) as client,
                # Not only "a replica": the database's own default says so here.
                pytest.raises(
                    dlock.BackendError, match=r"read-only.*default_transaction_read_only"
                ),
            ):
                client.lock(name, ttl=5).acquire(timeout=0)
        finally:
            with psycopg.connect(server.url(), autocommit=True) as conn:
                conn.execute("SET default_transaction_read_only = off")
                conn.execute("ALTER DATABASE postgres SET default_transaction_read_only = off")
        return
    user = f"ro_{uuid.uuid4().hex[:8]}"
    run(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'", ())
    run(f"GRANT SELECT, INSERT, UPDATE, CREATE ON dlock.* TO '{user}'@'%'", ())
    run("SET GLOBAL read_only = 1", ())
    try:
        url = server.url().replace("dlock:secret@", f"{user}:pw@")
        with (
            dlock.connect(url) as client,
            pytest.raises(dlock.BackendError, match="read-only"),
        ):
            client.lock(name, ttl=5).acquire(timeout=0)
    finally:
        run("SET GLOBAL read_only = 0", ())
        run(f"DROP USER '{user}'", ())


def _password_role(server: SQLServer) -> str:
    """A PostgreSQL role that must give its password (``right``): the test server
    trusts everyone else, so a wrong password is otherwise never refused."""
    role = f"pw_{uuid.uuid4().hex[:8]}"
    hba = server.process.workdir / "data" / "pg_hba.conf"
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    with server.connect() as conn:
        conn.execute(f"CREATE ROLE {role} SUPERUSER LOGIN PASSWORD 'right'")
        conn.execute("SELECT pg_reload_conf()")
    return role


def _unprivileged_login(server: SQLServer) -> tuple[str, str, str]:
    """A user, password and database such that the user may log in to the server but
    not to that database: PostgreSQL's CONNECT revoked, MySQL's grants missing."""
    user = f"np_{uuid.uuid4().hex[:8]}"
    if server.scheme == "postgresql":
        database = f"noconnect_{uuid.uuid4().hex[:8]}"
        with server.connect() as conn:
            conn.execute(f"CREATE DATABASE {database}")
            conn.execute(f"REVOKE CONNECT ON DATABASE {database} FROM PUBLIC")
            conn.execute(f"CREATE ROLE {user} LOGIN")
        return user, "", database
    admin(server)(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'", ())
    return user, "pw", server.database


@pytest.mark.parametrize("wrong", ["database", "user", "password", "privilege", "locked"])
def test_wrong_credentials_are_a_clear_error(server: SQLServer, wrong: str) -> None:
    """A server that answers and refuses is misconfigured, not unavailable: a
    ``BackendError`` that names the reason, never a ``BackendUnavailable`` that a caller
    may retry forever."""
    pg = server.scheme == "postgresql"
    user, password, database = server.user, server.password, server.database
    if wrong == "database":
        database = match = "no_such_database"
    elif wrong == "user":
        user, match = "no_such_user", "no_such_user"
    elif wrong == "privilege":
        user, password, database = _unprivileged_login(server)
        match = "permission denied" if pg else "access denied"
    elif wrong == "locked":
        user, password, database = _unprivileged_login(server)
        if pg:
            admin(server)(f"ALTER ROLE {user} NOLOGIN", ())
            database, match = server.database, "not permitted to log in"
        else:
            admin(server)(f"GRANT ALL ON {database}.* TO '{user}'@'%'", ())
            admin(server)(f"ALTER USER '{user}'@'%' ACCOUNT LOCK", ())
            match = "locked"
    elif pg:
        user, password, match = _password_role(server), "wrong", "password authentication failed"
    else:
        password, match = "wrong", "access denied"
    url = f"{server.scheme}://{user}:{password}@127.0.0.1:{server.port}/{database}"
    with dlock.connect(url) as client:
        start = time.monotonic()
        with pytest.raises(dlock.BackendError, match=match) as raised:
            client.lock("x", ttl=5).acquire(timeout=5)
        assert time.monotonic() - start < 5
    assert not isinstance(raised.value, dlock.BackendUnavailable), raised.value
    if pg and wrong == "password":  # and the right one is let in: the refusal was real
        with dlock.connect(url.replace(":wrong@", ":right@")) as client:
            assert client.lock("x", ttl=5).acquire(timeout=0)


def test_a_login_at_its_connection_limit_is_unavailable_not_refused(server: SQLServer) -> None:
    """A login whose connections are all in use (a role's CONNECTION LIMIT, MySQL's
    MAX_USER_CONNECTIONS) is turned away for now, as a server at max_connections is:
    BackendUnavailable, which a caller may retry. On MariaDB/MySQL it was a plain
    BackendError, a refusal that trying again would not mend."""
    run = admin(server)
    user = f"cap_{uuid.uuid4().hex[:8]}"
    with dlock.connect(server.url()) as client:
        client.inspect("cap")  # the lock table exists, to be granted
    if server.scheme == "postgresql":
        run(f"CREATE ROLE {user} LOGIN CONNECTION LIMIT 1", ())
        run(f"GRANT ALL ON public.dlock_locks TO {user}", ())
        url = f"postgresql://{user}@127.0.0.1:{server.port}/{server.database}"
        match = "too many connections"
    else:
        run(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw' WITH MAX_USER_CONNECTIONS 1", ())
        run(f"GRANT ALL ON {server.database}.* TO '{user}'@'%'", ())
        url = f"mysql://{user}:pw@127.0.0.1:{server.port}/{server.database}"
        match = "max_user_connections"
    try:
        with dlock.connect(url) as first, dlock.connect(url) as second:
            assert first.lock("cap", ttl=5).acquire(timeout=0)  # keeps its connection
            with pytest.raises(dlock.BackendUnavailable, match=match):
                second.lock("cap", ttl=5).acquire(timeout=0)
    finally:
        if server.scheme == "postgresql":
            run(f"DROP OWNED BY {user}", ())
        run(f"DROP {'ROLE' if server.scheme == 'postgresql' else 'USER'} {user}", ())


def test_a_row_lock_wait_ended_by_the_server_is_unavailable_not_refused(
    server: SQLServer, name: str
) -> None:
    """A transaction of someone else's (a DBA's, a migration's) holds the lock row past
    the server's own limit on row lock waits (MySQL's ``innodb_lock_wait_timeout``,
    PostgreSQL's ``lock_timeout``), and a deadlock likewise rolls back: the statement is
    undone, nothing is held, and trying again can succeed. On MariaDB/MySQL it was a
    plain BackendError (1205), a refusal that a retry would not mend. (PostgreSQL's
    connections turn ``lock_timeout`` off: the wait ends at dlock's own timeout.)

    On PostgreSQL the cut-off UPDATE still waits inside the server, and is granted as
    the blocker rolls back. Its give-back, an owner-checked UPDATE, does not wait for a
    row whose committed version it does not match: it may answer "not held" before that
    grant commits, and the grant is then given back once more ``LOOK_AGAIN_AFTER`` later
    (under load, a retry right after the blocker found it held). The retry waits for
    that, well within the lease's 30 s; MySQL undid the statement itself."""
    limits = (("lock_timeout", "'1s'"), ("innodb_lock_wait_timeout", "1"))
    with _login_where(server, *limits) as url, dlock.connect(f"{url}?timeout=2") as client:
        lock = client.lock(name, ttl=30, auto_renew=False)
        assert lock.acquire(timeout=0)  # creates the row
        lock.release()
        blocker = server.connect(autocommit=False)
        try:
            blocker.cursor().execute(
                "SELECT fence FROM dlock_locks WHERE name = %s FOR UPDATE", (name.encode(),)
            )
            with pytest.raises(dlock.BackendUnavailable):
                lock.acquire(timeout=0)
        finally:
            blocker.rollback()
            blocker.close()
        retry = 0 if server.scheme == "mysql" else LOOK_AGAIN_AFTER + 5
        assert lock.acquire(timeout=retry), "nothing was held: a retry takes the lock"
        lock.release()


def test_tls_asked_of_a_server_without_it_is_refused(
    server: SQLServer, name: str, certificates: Certificates
) -> None:
    """TLS asked for and not offered is a refusal, never a lock over plain text: libpq's
    ``sslmode=require`` refuses by itself; PyMySQL and aiomysql would go on unencrypted
    (as they would if someone in between stripped the server's offer). Both faces."""
    pg = server.scheme == "postgresql"
    why = "SSL was required" if pg else "TLS was asked for"
    for url in (
        server.url("sslmode=require" if pg else "ssl=true"),
        # A CA named, TLS not asked for in so many words (libpq: sslmode=prefer).
        server.url(f"sslrootcert={certificates.ca}" if pg else f"ssl_ca={certificates.ca}"),
    ):
        _refused_in_both_faces(url, name, why)
    with dlock.connect(server.url()) as client:
        assert client.inspect(name) is None


@contextlib.contextmanager
def _relay(port: int) -> Iterator[tuple[int, list[bytes]]]:
    """A TCP relay to ``port`` on loopback, as someone in between would run one: its
    port, and what clients sent through it."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent: list[bytes] = []
    opened: list[socket.socket] = []

    def pump(source: socket.socket, sink: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if record:
                    sent.append(data)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", port))
                opened.extend((client, upstream))
                for args in ((client, upstream, True), (upstream, client, False)):
                    threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1], sent
    finally:
        listener.close()
        for sock in opened:
            sock.close()


def test_a_mysql_login_is_not_sent_before_tls(mariadb_server: SQLServer, name: str) -> None:
    """TLS asked for and not offered (a server without it, or someone in between who
    strips the offer from the greeting): PyMySQL and aiomysql sent the login (user name,
    password hash; the password itself if the server asks for the cleartext plugin)
    in plain text before dlock found the connection unencrypted. Now they send
    nothing."""
    server = mariadb_server
    with _relay(server.port) as (port, sent):
        url = server.url("ssl=true").replace(f":{server.port}/", f":{port}/")
        _refused_in_both_faces(url, name, "TLS was asked for")
        assert server.user.encode() not in b"".join(sent)


def _refused_in_both_faces(url: str, name: str, why: str) -> None:

    def refused(error: BaseException) -> None:
        assert isinstance(error, dlock.BackendError), error
        assert not isinstance(error, dlock.BackendUnavailable), error
        assert why in str(error), error

    with dlock.connect(url) as client, pytest.raises(dlock.BackendError) as caught:
        client.lock(name, ttl=5).acquire(timeout=0)
    refused(caught.value)

    async def in_asyncio() -> None:
        async with dlock.aio.connect(url) as client:
            await client.lock(name, ttl=5).acquire(timeout=0)

    with pytest.raises(dlock.BackendError) as caught:
        asyncio.run(in_asyncio())
    refused(caught.value)


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_missing_lock_table_is_a_clear_error(server: SQLServer, name: str, mode: str) -> None:
    """``create_table=false`` and no table: every operation says which table is missing
    and how to make it, instead of a bare SQL error; and the same client works once
    ``dlock init`` has made it."""
    table = f"missing_{uuid.uuid4().hex[:8]}"
    url = server.url(f"mode={mode}&table={table}&create_table=false")
    with dlock.connect(url) as client:
        lock = client.lock(name, ttl=5)
        for operation in (lambda: lock.acquire(timeout=0), lambda: client.inspect(name)):
            # Named in full: in the schema (MySQL: database) the connection looked in.
            with pytest.raises(dlock.BackendError, match=rf"lock table '\w+\.{table}'.*dlock init"):
                operation()
        with dlock.connect(url) as admin:
            backend: Any = admin._backend
            backend.init()  # what `dlock init` runs
        assert lock.acquire(timeout=0)
        lock.release()


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_connects_through_a_unix_socket(server: SQLServer, name: str, mode: str) -> None:
    """A server on the same machine, through its socket: libpq's ``host=`` (the
    socket's directory), PyMySQL's ``unix_socket=`` (its path). The URL's host is one
    nobody serves, so only the socket can answer; in both faces."""
    root = server.process.workdir
    if server.scheme == "postgresql":
        socket, option = str(root), "host"
    else:
        socket, option = str(root / "sock"), "unix_socket"
    url = server.url(f"mode={mode}&connect_timeout=2&{option}={socket}")
    url = url.replace("@127.0.0.1:", "@192.0.2.1:")  # TEST-NET-1: never answers
    with dlock.connect(url) as client, client.lock(name, ttl=5) as lock:
        assert lock.fencing_token is not None

    async def in_asyncio() -> int | None:
        async with dlock.aio.connect(url) as client, client.lock(name, ttl=5) as lock:
            return lock.fencing_token

    assert asyncio.run(in_asyncio()) is not None
    # A socket nobody serves is named in the error. (Tried in the asyncio face: the
    # threaded PyMySQL leaves the socket of a failed connect to the garbage collector.)
    nobody = f"{root}/nobody" if server.scheme == "postgresql" else f"{root}/nobody.sock"

    async def refused() -> None:
        async with dlock.aio.connect(url.replace(socket, nobody)) as client:
            await client.lock(name, ttl=5).acquire(timeout=0)

    with pytest.raises(dlock.BackendUnavailable, match=f"^{nobody}: "):
        asyncio.run(refused())


def test_client_option_takes_a_connection_factory(server: SQLServer, name: str) -> None:
    """``client=`` brings the application's own connections (TLS, auth, proxies)."""
    made: list[object] = []

    def factory() -> object:
        if server.scheme == "postgresql":
            conn: object = psycopg.connect(server.url())
        else:
            conn = pymysql.connect(
                host="127.0.0.1",
                port=server.port,
                user="dlock",
                password="secret",
                database="dlock",
                ssl_disabled=True,
                client_flag=CLIENT.FOUND_ROWS,
            )
        made.append(conn)
        return conn

    with dlock.connect(f"{server.scheme}://", client=factory) as client:
        lock = client.lock(name, ttl=5)
        assert lock.acquire(timeout=0)
        # Seen from an independent connection: committed, so dlock set autocommit.
        rows = admin(server)("SELECT fence FROM dlock_locks WHERE name = %s", (name.encode(),))
        assert rows == [(lock.fencing_token,)]
        lock.release()
    assert made


async def test_client_option_in_the_asyncio_face(server: SQLServer, name: str) -> None:
    import aiomysql

    import dlock.aio

    async def factory() -> object:
        if server.scheme == "postgresql":
            return await psycopg.AsyncConnection.connect(server.url())
        return await aiomysql.connect(
            host="127.0.0.1",
            port=server.port,
            user="dlock",
            password="secret",
            db="dlock",
            client_flag=CLIENT.FOUND_ROWS,
        )

    async with dlock.aio.connect(f"{server.scheme}://", client=factory) as client:
        lock = client.lock(name, ttl=5)
        assert await lock.acquire(timeout=0)
        await lock.release()


def test_statement_cut_off_by_the_timeout_is_not_run_again(
    mariadb_server: SQLServer, name: str
) -> None:
    """A read timeout says nothing about the statement: it may commit later. Sent again,
    a reentrant acquire counted itself twice and one release left the lock held."""
    server = mariadb_server
    with dlock.connect(server.url("timeout=1")) as client:
        lock = client.lock(name, ttl=30, reentrant=True, auto_renew=False)
        assert lock.acquire(timeout=0)  # creates the row and pools a connection
        lock.release()
        started = threading.Event()

        def hold_row_lock() -> None:
            conn = server.connect()
            try:
                with conn.cursor() as cursor:
                    cursor.execute("BEGIN")
                    cursor.execute(
                        "SELECT fence FROM dlock_locks WHERE name = %s FOR UPDATE",
                        (name.encode(),),
                    )
                    started.set()
                    time.sleep(1.4)
                    cursor.execute("COMMIT")
            finally:
                conn.close()

        holder = threading.Thread(target=hold_row_lock)
        holder.start()
        assert started.wait(5)
        try:
            got = lock.acquire(timeout=0)
        except dlock.BackendError:
            got = False
        holder.join()
        time.sleep(0.3)
        if not got:
            assert lock.acquire(timeout=5)
        lock.release()
        assert client.inspect(name) is None, "one acquire, one release: the lock is free"


def _sessions(server: SQLServer) -> int:
    run = admin(server)
    if server.scheme == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
    else:
        sql = (
            "SELECT count(*) FROM information_schema.processlist "
            "WHERE id <> CONNECTION_ID() AND user = 'dlock'"
        )
    return int(run(sql, ())[0][0])


def _own_sessions(
    server: SQLServer, client: dlock.aio.AsyncClient
) -> tuple[list[int], Callable[[], int]]:
    """The server's ids of the sessions ``client`` opens from now on (recorded as each
    connection is made), and a function counting how many of them the server still has.

    Counting every session instead counts others' too: a connection just closed (such
    as the one that counted the moment before) stays listed for a while."""
    backend: Any = client._backend
    connect = backend._driver_connect
    made: list[int] = []

    async def recorded() -> Any:
        raw = await connect()
        made.append(raw.info.backend_pid if server.scheme == "postgresql" else raw.thread_id())
        return raw

    backend._driver_connect = recorded
    sql = (
        "SELECT pid FROM pg_stat_activity"
        if server.scheme == "postgresql"
        else "SELECT id FROM information_schema.processlist"
    )

    def still_open() -> int:
        listed = {row[0] for row in admin(server)(sql, ())}
        return len(listed.intersection(made))

    return made, still_open


async def test_a_session_ended_unseen_by_the_event_loop_no_longer_fails_the_next_call(
    server: SQLServer, name: str
) -> None:
    """A pooled connection whose session the server ended (a restart, a KILL) while the
    event loop did not run (blocked, or not yet woken) is weeded out before sending, as
    the threaded face's is. aiomysql's was judged by what the loop had read, which did
    not have the server's goodbye yet: the next call went out on the dead connection
    and was BackendUnavailable, with the server up."""
    async with dlock.aio.connect(server.url()) as client:
        lock = client.lock(name, ttl=5)
        assert await lock.acquire(timeout=0)
        await lock.release()
        kill_other_sessions(server)  # blocks the event loop meanwhile
        time.sleep(0.1)  # noqa: ASYNC251 (the goodbye reaches the socket, unread)
        assert await lock.acquire(timeout=0)
        await lock.release()


async def test_connections_beyond_the_pool_are_closed(server: SQLServer, name: str) -> None:
    """A burst opens more connections than the pool keeps: the surplus is closed."""
    import asyncio

    import dlock.aio
    from dlock._async.backends._server_sql import POOL_SIZE

    for mode in ("lease", "session"):
        async with dlock.aio.connect(server.url(f"mode={mode}")) as client:
            # Before any operation: connect() opens no connection, the first one does.
            made, still_open = _own_sessions(server, client)
            for _ in range(2):
                await asyncio.gather(*(client.inspect(name) for _ in range(40)))
            assert len(made) > POOL_SIZE, "the burst opened no more than the pool keeps"
            # A closed PostgreSQL backend leaves pg_stat_activity a moment later.
            for _ in range(40):
                if still_open() <= POOL_SIZE:
                    break
                await asyncio.sleep(0.05)
            assert still_open() <= POOL_SIZE


async def test_connections_kept_for_waiting_are_capped(server: SQLServer, name: str) -> None:
    """A burst of lease waiters opens a connection each to queue on: those kept for the
    next wait are capped like the statement pool, the rest closed (their idle timeout is
    off: kept, they stayed open for the client's life)."""
    from dlock._async.backends._server_sql import POOL_SIZE

    async with dlock.aio.connect(server.url()) as client:
        made, still_open = _own_sessions(server, client)

        async def take_in_turn() -> None:
            async with client.lock(name, ttl=10):
                await asyncio.sleep(0.005)

        await asyncio.gather(*(take_in_turn() for _ in range(40)))
        backend: Any = client._backend
        assert len(backend._queueing) <= POOL_SIZE
        # The pool and the waiters' connections: 2 * POOL_SIZE kept at most.
        assert len(made) > 2 * POOL_SIZE, "the burst opened no more than the client keeps"
        # A closed PostgreSQL backend leaves pg_stat_activity a moment later.
        for _ in range(40):
            if still_open() <= 2 * POOL_SIZE:
                break
            await asyncio.sleep(0.05)
        assert still_open() <= 2 * POOL_SIZE


async def test_a_cancelled_session_release_closes_its_connection(
    server: SQLServer, name: str
) -> None:
    """A session lock's release cancelled in flight (the unlock sent or not): its
    connection was neither pooled nor closed, not even by the client's close, and kept
    the lock if the unlock had not run. Closed, it frees the lock either way."""
    url = server.url("mode=session")
    async with dlock.aio.connect(url) as client:
        made, still_open = _own_sessions(server, client)
        lock = client.lock(name, ttl=10)
        assert await lock.acquire(timeout=0)
        assert made, "the lock was taken on no connection of the client's"
        release = asyncio.create_task(lock.release())
        await asyncio.sleep(0)  # sent, or about to be
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            await release
    # A closed PostgreSQL backend leaves pg_stat_activity a moment later.
    for _ in range(40):
        if not still_open():
            break
        await asyncio.sleep(0.05)
    assert not still_open(), "the client's close left a session open"
    async with dlock.aio.connect(url) as other:
        assert await other.lock(name, ttl=10).acquire(timeout=2)


def _turnstile_waiters(server: SQLServer, name: str) -> int:
    """How many sessions wait for the turnstile of ``name`` (default lease table)."""
    turnstile = _default_table(server) + ":turnstile"
    if server.scheme == "postgresql":
        return _advisory_lock_sessions(server, advisory_key(turnstile, name), granted=False)
    rows = admin(server)(
        "SELECT count(*) FROM information_schema.processlist"
        " WHERE state = 'User lock' AND info LIKE %s",
        (f"%{named_lock_key(turnstile, name)}%",),
    )
    return int(rows[0][0])


@dataclasses.dataclass
class _Queue:
    """A lease held, one waiter in front of its turnstile, one queued behind it."""

    holder: dlock.aio.AsyncLock
    first: dlock.aio.AsyncLock
    in_front: asyncio.Task[bool]
    second: dlock.aio.AsyncLock
    queued: asyncio.Task[bool]


async def _queue_up(
    server: SQLServer,
    name: str,
    holding: dlock.aio.AsyncClient,
    front: dlock.aio.AsyncClient,
    behind: dlock.aio.AsyncClient,
) -> _Queue:
    """``holding`` takes ``name``; a lock of ``front`` then waits in front of the
    turnstile, and one of ``behind`` in the server's queue behind it."""
    holder = holding.lock(name, ttl=30)
    assert await holder.acquire(timeout=0)
    first = front.lock(name, ttl=30)
    in_front = asyncio.create_task(first.acquire(timeout=30))
    deadline = time.monotonic() + 5
    while not _turnstile_held(server, name):
        assert time.monotonic() < deadline, "the first waiter never got in front"
        await asyncio.sleep(0.01)
    second = behind.lock(name, ttl=30)
    queued = asyncio.create_task(second.acquire(timeout=30))
    while not _turnstile_waiters(server, name):
        assert time.monotonic() < deadline, "the second waiter never queued"
        await asyncio.sleep(0.01)
    return _Queue(holder, first, in_front, second, queued)


async def test_a_waiter_cancelled_in_the_turnstile_takes_nothing_later(
    server: SQLServer, name: str
) -> None:
    """A lease waiter cancelled while it waits for the turnstile inside the server: on
    MariaDB closing the connection did not end the wait, so the server, once the
    turnstile came to the dead session, took the lease under the cancelled lock's
    token after its give-back had run, and nobody held the name for a whole TTL."""
    url = server.url()
    async with (
        dlock.aio.connect(url) as holding,
        dlock.aio.connect(url) as front,
        dlock.aio.connect(url) as behind,
        dlock.aio.connect(url) as later,
    ):
        queue = await _queue_up(server, name, holding, front, behind)
        queue.queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queue.queued
        await queue.holder.release()
        assert await queue.in_front
        await queue.first.release()
        # A wait left in the server would now get the turnstile, take the lease, and
        # only then find its connection gone and leave the turnstile.
        deadline = time.monotonic() + 5
        while _turnstile_held(server, name) or _turnstile_waiters(server, name):
            assert time.monotonic() < deadline, "the turnstile was never left"
            await asyncio.sleep(0.01)
        # The cancelled wait's clean-up runs in the background, and may be giving back a
        # take that came just before the server ended the wait: close() waits for it.
        await behind.aclose()
        assert await later.inspect(name) is None, "a cancelled waiter holds the lease"
        assert await later.lock(name, ttl=30).acquire(timeout=0)


async def test_a_turnstile_waiter_whose_session_died_leaves_that_session_id_alone(
    mariadb_server: SQLServer, name: str
) -> None:
    """A turnstile waiter whose connection died (a restart, here a KILL) and could not
    connect again: its clean-up asked the server about, and would KILL QUERY, the dead
    session's id, which after a restart may be another client's waiter on the same
    turnstile; and it gave the dead connection back a second time."""
    server = mariadb_server
    url = server.url("timeout=5&connect_timeout=2")
    async with (
        dlock.aio.connect(url) as holding,
        dlock.aio.connect(url) as front,
        dlock.aio.connect(url) as behind,
    ):
        holder = holding.lock(name, ttl=30)
        assert await holder.acquire(timeout=0)
        in_front = asyncio.create_task(front.lock(name, ttl=30).acquire(timeout=20))
        deadline = time.monotonic() + 5
        while not _turnstile_held(server, name):
            assert time.monotonic() < deadline, "the first waiter never got in front"
            await asyncio.sleep(0.01)
        backend: Any = behind._backend
        waiting = asyncio.create_task(behind.lock(name, ttl=30).acquire(timeout=20))
        turnstile = named_lock_key(_default_table(server) + ":turnstile", name)
        sessions: list[tuple[Any, ...]] = []
        while not sessions:
            assert time.monotonic() < deadline, "the second waiter never queued"
            await asyncio.sleep(0.01)
            sessions = admin(server)(
                "SELECT id FROM information_schema.processlist"
                " WHERE state = 'User lock' AND info LIKE %s",
                (f"%{turnstile}%",),
            )
        dead = int(sessions[0][0])
        asked: list[Any] = []
        real_call, real_give_back = backend._call, backend._give_back

        async def recording_call(key: str, params: dict[str, Any], sql: str | None = None) -> Any:
            asked.append(params.get("id"))
            return await real_call(key, params, sql)

        async def no_server() -> Any:
            raise dlock.BackendUnavailable("no server, for the test")

        given_back: list[Any] = []

        async def counting_give_back(raw: Any, loan: Any, keep: bool) -> None:
            given_back.append(raw)
            await real_give_back(raw, loan, keep)

        backend._call, backend._connect = recording_call, no_server
        backend._give_back = counting_give_back
        admin(server)(f"KILL CONNECTION {dead}", ())
        with pytest.raises(dlock.BackendUnavailable):
            await waiting
        for clean_up in list(backend._clean_ups.values()):
            await clean_up
        assert dead not in asked, "the clean-up asked about the dead session's id"
        assert len(given_back) == len(set(map(id, given_back))), "given back twice"
        await holder.release()
        assert await in_front


async def test_a_waiter_cancelled_in_the_turnstile_of_a_paused_server_stops_at_once(
    mariadb_server: SQLServer, name: str
) -> None:
    """Cancelling a lease waiter queued in the turnstile ended its wait in the server
    (KILL QUERY) and gave its take back in the cancelled task: with the server paused,
    the cancellation waited for both to time out (timeout, then connect_timeout + 1).
    That clean-up runs in the background now, and close() waits for it."""
    server = mariadb_server
    url = server.url("timeout=2&connect_timeout=2")
    try:
        async with (
            dlock.aio.connect(url) as holding,
            dlock.aio.connect(url) as front,
            dlock.aio.connect(url) as behind,
        ):
            queue = await _queue_up(server, name, holding, front, behind)
            server.process.pause()
            started = time.monotonic()
            queue.queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queue.queued
            assert time.monotonic() - started < 1.5, "the cancellation waited for the server"
            server.process.resume()
            queue.in_front.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queue.in_front
            await queue.holder.release()
    finally:
        server.process.resume()


def _relayed(server: SQLServer) -> tuple[Partition, str]:
    """A relay to ``server``, and a URL through it with timeouts of 1 s."""
    relay = Partition(server.port)
    url = server.url("timeout=1&connect_timeout=1")
    return relay, url.replace(f":{server.port}/", f":{relay.port}/")


async def _cancel_held_up(relay: Partition, waiting: asyncio.Task[bool], what: str) -> None:
    """Once the relay holds up ``waiting``'s request (see ``Partition.hold_on``), cancel
    it, cut off in flight."""
    deadline = time.monotonic() + 5
    while not relay.marked.is_set():
        assert time.monotonic() < deadline, f"the waiter never sent its {what}"
        await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def _late_request_takes_nothing(
    relay: Partition, other: dlock.aio.AsyncClient, name: str, what: str
) -> None:
    """Deliver what the relay held up: ``name`` must stay free."""
    relay.deliver()
    await asyncio.sleep(0.5)  # for the late request to run, if it still can
    assert await other.inspect(name) is None, f"the late {what} took the lease"


async def test_a_turnstile_wait_the_server_has_not_read_yet_takes_nothing_later(
    mariadb_server: SQLServer, name: str
) -> None:
    """A lease waiter cancelled after it sent its turnstile wait, which the server had
    not read yet (held up in the network; under load, not yet run, or between its
    statements): the clean-up saw no wait running, took it as ended, and gave back
    once. Then the wait ran in the dead session and took the lease under the cancelled
    lock's token, held by nobody until its TTL (a chaos run, 2 of 2 within 150 s). The
    clean-up now kills the session itself, and waits for its end."""
    server = mariadb_server
    relay, url = _relayed(server)
    try:
        async with (
            dlock.aio.connect(server.url()) as holding,
            dlock.aio.connect(url) as behind,
            dlock.aio.connect(server.url()) as other,
        ):
            holder = holding.lock(name, ttl=30)
            assert await holder.acquire(timeout=0)
            relay.hold_on(b"GET_LOCK")
            waiting = asyncio.create_task(behind.lock(name, ttl=30).acquire(timeout=30))
            await _cancel_held_up(relay, waiting, "turnstile wait")
            clean_ups = list(cast(Any, behind._backend)._clean_ups.values())
            await asyncio.wait_for(asyncio.gather(*clean_ups), 10)
            await holder.release()
            await _late_request_takes_nothing(relay, other, name, "turnstile wait")
    finally:
        relay.close()


async def test_a_poll_in_front_of_the_turnstile_cut_off_takes_nothing_later(
    mariadb_server: SQLServer, name: str
) -> None:
    """The waiter in front of the turnstile polls for the lease on its own session. A
    poll cut off in flight (cancelled, the client closed at once) ran later in that
    session and took the lease under the cancelled lock's token after every give-back:
    held by nobody until its TTL (a chaos helper: 5 of 228 such pairs). Its session is
    now killed, and waited for, as a cut-off turnstile wait's is."""
    server = mariadb_server
    relay, url = _relayed(server)
    try:
        async with (
            dlock.aio.connect(server.url()) as holding,
            dlock.aio.connect(server.url()) as other,
        ):
            holder = holding.lock(name, ttl=30)
            assert await holder.acquire(timeout=0)
            behind = dlock.aio.connect(url)
            waiting = asyncio.create_task(behind.lock(name, ttl=30).acquire(timeout=30))
            deadline = time.monotonic() + 5
            while not _turnstile_held(server, name):
                assert time.monotonic() < deadline, "the waiter never got in front"
                await asyncio.sleep(0.01)
            relay.hold_on(b"= CONNECTION_ID()")  # its next poll
            await _cancel_held_up(relay, waiting, "poll")
            await holder.release()
            await behind.aclose()
            await _late_request_takes_nothing(relay, other, name, "poll")
    finally:
        relay.close()


@contextlib.asynccontextmanager
async def _queued_through_a_relay(
    server: SQLServer, name: str
) -> AsyncIterator[tuple[_Queue, Partition, dlock.aio.AsyncClient]]:
    """As _queue_up, the second waiter reaching the server through a relay (timeouts
    of 1 s); with the relay, and another client that reaches the server directly."""
    relay, url = _relayed(server)
    try:
        async with (
            dlock.aio.connect(server.url()) as holding,
            dlock.aio.connect(server.url()) as front,
            dlock.aio.connect(url) as behind,
            dlock.aio.connect(server.url()) as other,
        ):
            yield await _queue_up(server, name, holding, front, behind), relay, other
    finally:
        relay.close()


async def _held_after_late_give_backs(
    relay: Partition, other: dlock.aio.AsyncClient, lock: dlock.aio.AsyncLock
) -> None:
    """Deliver what the relay held up; ``lock``, held, must still be."""
    relay.deliver()
    await asyncio.sleep(1)  # for the late give-backs to land
    assert await other.inspect(lock.name) is not None, "a late give-back freed the hold"
    assert not await other.lock(lock.name, ttl=30).acquire(timeout=0)
    await lock.release()


async def test_a_late_give_back_of_a_wait_cut_off_frees_no_later_hold(
    server: SQLServer, name: str
) -> None:
    """A lease waiter cancelled in the turnstile gives back, in the background, what
    its wait may have taken. Those give-backs got no answer (the network held them up)
    and reached the server only after the same lock object had acquired again: under
    the same owner token, they freed that hold (a chaos run's relay, 3 of 3), and
    another client took the lock from its holder."""
    async with _queued_through_a_relay(server, name) as (queue, relay, other):
        relay.cut.set()
        queue.queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queue.queued
        clean_ups = list(cast(Any, queue.second._client._backend)._clean_ups.values())
        assert clean_ups, "the wait cut off left nothing to give back"
        # Its give-backs time out in the cut, and are held up, not lost.
        await asyncio.wait_for(asyncio.gather(*clean_ups), 20)
        relay.hold()
        relay.cut.clear()
        await queue.holder.release()
        assert await queue.in_front
        await queue.first.release()
        assert await queue.second.acquire(timeout=10)
        await _held_after_late_give_backs(relay, other, queue.second)


async def test_a_late_give_back_of_a_wait_whose_connection_failed_frees_no_later_hold(
    server: SQLServer, name: str
) -> None:
    """A queued lease waiter whose wait got no answer (its connection held up in the
    network) connects again and gives back what that wait may have taken. That
    give-back got no answer either, and the waiter went on under the same owner token,
    took the lease, and the give-back, reaching the server late, freed it."""
    async with _queued_through_a_relay(server, name) as (queue, relay, other):
        relay.hold()  # the wait and the pooled connections; new ones pass
        await asyncio.sleep(4)  # the wait, then the give-back, time out
        await queue.holder.release()
        assert await queue.in_front
        await queue.first.release()
        try:
            assert await queue.queued
        except dlock.BackendUnavailable:
            # It gives up rather than hold under that token; its next hold does not.
            assert await queue.second.acquire(timeout=10)
        await _held_after_late_give_backs(relay, other, queue.second)


@pytest.mark.parametrize("mode", ["lease", "session"])
async def test_a_statement_cancelled_on_a_paused_server_ends_within_a_second(
    server: SQLServer, name: str, mode: str
) -> None:
    """Cancelling a task whose statement waits for a server that does not answer: on
    PostgreSQL psycopg first asked the server to cancel the query, then waited for its
    end, 5 s each, so the cancellation took 10 s. What the statement may have done is
    given back once the server answers again."""
    url = server.url(f"mode={mode}")
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
        lock = client.lock(name, ttl=30)
        assert await lock.acquire(timeout=0)
        await lock.release()  # connected, the table made
        try:
            server.process.pause()
            attempt = asyncio.create_task(lock.acquire(timeout=0))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
            assert time.monotonic() - started < 1.5, "the cancellation waited for the server"
        finally:
            server.process.resume()
        assert await other.lock(name, ttl=30).acquire(timeout=10)


@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_a_server_that_accepts_but_does_not_answer_is_unavailable_within_connect_timeout(
    server: SQLServer, name: str, face: str
) -> None:
    """A paused server's kernel still accepts connections, and the login then gets no
    answer: connect_timeout bounds that, not the statements' timeout (PyMySQL read the
    handshake under its read timeout: 6 s here, for a 1 s connect_timeout)."""
    url = server.url("connect_timeout=1&timeout=6")

    async def inspect_async() -> None:
        async with dlock.aio.connect(url) as client:
            await client.inspect(name)

    def inspect() -> None:
        if face == "asyncio":
            asyncio.run(inspect_async())
            return
        with dlock.connect(url) as client:
            client.inspect(name)

    server.process.pause()
    try:
        started = time.monotonic()
        with pytest.raises(dlock.BackendUnavailable):
            inspect()
        assert time.monotonic() - started < 3, "the login waited out the statements' timeout"
    finally:
        server.process.resume()


@pytest.mark.parametrize("table", ["order", "public.order", "Public.Dlock_Locks"])
def test_printed_schema_of_a_reserved_word_table_runs(
    postgresql_server: SQLServer, table: str
) -> None:
    """`dlock init --print` printed the table as given, unquoted: for a reserved word
    that dlock itself accepts (table=order) the DDL was a syntax error."""
    with dlock.connect(postgresql_server.url(f"table={table}")) as client:
        statements = client._backend.schema_sql()  # type: ignore[attr-defined]
        admin(postgresql_server)(statements[0], ())
        lock = client.lock("printed", ttl=5)
        assert lock.acquire(timeout=0)
        lock.release()


def test_session_wait_timeout_does_not_stay_on_pooled_connections(
    postgresql_server: SQLServer, name: str
) -> None:
    """lock_timeout bounds one wait; left on the session it would cut later statements.
    (A wait that times out rolls its setting back; one that gets the lock kept it.)"""
    url = postgresql_server.url("mode=session")
    with dlock.connect(url) as first, dlock.connect(url) as second:
        lock = first.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        threading.Timer(0.3, lock.release).start()
        waiter = second.lock(name, ttl=30)
        assert waiter.acquire(timeout=5)
        waiter.release()
        backend: Any = second._backend
        assert backend._idle
        for conn in backend._idle:
            assert conn.raw.execute("SHOW lock_timeout").fetchone()[0] == "0"


def _count_connects(client: Any) -> list[object]:
    """From now on, one entry per connection the client's backend makes."""
    backend = client._backend
    connects: list[object] = []
    connect = backend._connect

    def counting_connect() -> object:
        connects.append(None)
        return connect()

    backend._connect = counting_connect
    return connects


def _record_statements(client: Any) -> list[str]:
    """From now on, every statement the client's backend runs."""
    backend = client._backend
    statements: list[str] = []
    run = backend._run

    def recording_run(conn: Any, sql: str, params: Any, wait: float = 0) -> object:
        statements.append(sql)
        return run(conn, sql, params, wait)

    backend._run = recording_run
    return statements


def test_turnstile_timeouts_keep_the_waiters_connection(server: SQLServer, name: str) -> None:
    """A waiter behind the one in front times out in the server again and again: each
    is an ordinary end of a wait, not a dead connection to replace."""
    url = server.url()
    with (
        dlock.connect(url) as holder,
        dlock.connect(url) as front,
        dlock.connect(url) as behind,
    ):
        lock = holder.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        in_front = threading.Thread(target=lambda: front.lock(name, ttl=30).acquire(timeout=4))
        in_front.start()
        time.sleep(0.3)
        assert behind.inspect(name) is not None  # pools a statement connection
        connects = _count_connects(behind)
        assert behind.lock(name, ttl=30).acquire(timeout=3) is False
        assert len(connects) <= 1, "only the listening connection is new"
        in_front.join()
        lock.release()


@pytest.fixture
def statement_timeout_url(server: SQLServer) -> Iterator[str]:
    """A login whose statements the server ends after 300 ms."""
    with _login_where(
        server, ("statement_timeout", "'300ms'"), ("max_statement_time", "0.3")
    ) as url:
        yield url


def _statement_timeout(conn: Any) -> str:
    cursor = conn.cursor()
    if isinstance(conn, psycopg.Connection):
        cursor.execute("SHOW statement_timeout")
    else:
        cursor.execute("SELECT @@SESSION.max_statement_time")
    return str(cursor.fetchall()[0][0])


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_waits_outlast_the_servers_statement_timeout(
    statement_timeout_url: str, name: str, mode: str
) -> None:
    """A server's statement timeout (a common guard against runaway queries) shorter
    than a wait must not cut the wait short: PostgreSQL's cancels it (each cut cost a
    new connection), MariaDB's ends ``GET_LOCK`` as if it had timed out; either way the
    waiter asked again and again and lost its place in the queue. Two waiters (in lease
    mode, the one in front waits for a notification, the other in the server): the
    second waits it out in one wait on one connection, takes the lock after the first,
    and leaves the login's setting as it was."""
    url = statement_timeout_url + ("&" if "?" in statement_timeout_url else "?") + f"mode={mode}"
    with (
        dlock.connect(url) as holder,
        dlock.connect(url) as first,
        dlock.connect(url) as waiter,
    ):
        lock = holder.lock(name, ttl=30)
        assert lock.acquire(timeout=0)

        def wait_first() -> None:
            ahead = first.lock(name, ttl=30)
            if ahead.acquire(timeout=5):
                ahead.release()

        ahead = threading.Thread(target=wait_first)
        ahead.start()
        time.sleep(0.3)
        assert waiter.inspect(name) is not None  # pools a statement connection
        backend: Any = waiter._backend
        connects = _count_connects(waiter)
        statements = _record_statements(waiter)
        start = time.monotonic()  # before the timer's: its release may come 1.5 s after
        threading.Timer(1.5, lock.release).start()
        successor = waiter.lock(name, ttl=30)
        assert successor.acquire(timeout=5)
        assert 1.5 <= time.monotonic() - start < 2.5
        assert len(connects) <= 1, "only a lease waiter's listening connection is new"
        waits = [sql for sql in statements if "%(wait)s" in sql or "pg_advisory_lock(" in sql]
        assert len(waits) == 1, f"{len(waits)} waits in the server"
        successor.release()
        ahead.join()
        # A lease waiter's connection is kept for waiting, the others pooled.
        kept = [*backend._idle, *backend._queueing]
        expected = "300ms" if isinstance(kept[0].raw, psycopg.Connection) else "0.3"
        for conn in kept:
            assert _statement_timeout(conn.raw) == expected


def _strict_role(server: SQLServer) -> contextlib.AbstractContextManager[str]:
    """A PostgreSQL login whose transactions default to REPEATABLE READ."""
    return _login_where(server, ("default_transaction_isolation", "'repeatable read'"))


def _row_locked_then_freed(
    server: SQLServer, table: str, name: str, acquire: Callable[[], Any]
) -> Any:
    """Run ``acquire`` while another transaction holds the name's (free) row locked
    after changing it, committed half a second in: the acquire's UPDATE waits for it."""
    with server.connect(autocommit=False) as conn:
        conn.execute(f"UPDATE {table} SET count = 0 WHERE name = %s", (name.encode(),))
        threading.Timer(0.5, conn.commit).start()
        return acquire()


@pytest.mark.parametrize("mode", ["lease", "session"])
@pytest.mark.parametrize(
    "setting",
    [("default_transaction_isolation", "'repeatable read'"), ("lock_timeout", "'20ms'")],
    ids=["repeatable-read", "lock-timeout"],
)
def test_a_roles_defaults_do_not_fail_contended_acquires(
    postgresql_server: SQLServer, name: str, mode: str, setting: tuple[str, str]
) -> None:
    """A database's or role's defaults that an acquire waiting for a row must survive:

    - under REPEATABLE READ an UPDATE that waited for a concurrent one fails with a
      serialization error instead of re-checking the row; dlock's connections run its
      statements in READ COMMITTED whatever the default;
    - a short ``lock_timeout`` (a guard against lock queues) cancels the wait; dlock's
      statements hold a row for microseconds, and their waits are bounded by dlock's
      own ``timeout``, so its connections turn it off.

    Either way contended acquires failed as ``BackendUnavailable``."""
    table = "dlock_locks" if mode == "lease" else "dlock_session_locks"
    with (
        _login_where(postgresql_server, setting) as url,
        dlock.connect(f"{url}?mode={mode}") as client,
    ):
        first = client.lock(name, ttl=5)
        assert first.acquire(timeout=0)
        before = first.fencing_token
        first.release()  # the row is there, free
        lock = client.lock(name, ttl=5)
        assert _row_locked_then_freed(
            postgresql_server, table, name, lambda: lock.acquire(timeout=0)
        )
        assert before is not None and lock.fencing_token is not None
        assert lock.fencing_token > before
        lock.release()


def test_a_borrowed_connection_too_strict_for_dlock_is_a_clear_error(
    postgresql_server: SQLServer, name: str
) -> None:
    """A connection from the application's pool keeps the application's settings: under
    REPEATABLE READ the same wait is a ``BackendError`` that says what to change, not a
    ``BackendUnavailable`` to retry."""
    import psycopg_pool

    with (
        _strict_role(postgresql_server) as url,
        psycopg_pool.ConnectionPool(url, min_size=1, max_size=2) as pool,
        dlock.connect("postgresql://", client=pool.connection) as client,
    ):
        first = client.lock(name, ttl=5)
        assert first.acquire(timeout=0)
        first.release()
        lock = client.lock(name, ttl=5)
        with pytest.raises(dlock.BackendError, match="READ COMMITTED") as raised:
            _row_locked_then_freed(
                postgresql_server, "dlock_locks", name, lambda: lock.acquire(timeout=0)
            )
        assert not isinstance(raised.value, dlock.BackendUnavailable)


def _advisory_lock_sessions(server: SQLServer, key: int, granted: bool) -> int:
    """How many sessions hold (``granted``) or wait for the advisory lock ``key``."""
    rows = admin(server)(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = %s"
        " AND objsubid = 1 AND classid::bigint = (%s >> 32) & 4294967295"
        " AND objid::bigint = %s & 4294967295",
        (granted, key, key),
    )
    return int(rows[0][0])


def _default_table(server: SQLServer) -> str:
    """The default lease table as dlock names it, and makes its lock keys from."""
    home = "public" if server.scheme == "postgresql" else server.database
    return f"{home}.dlock_locks"


def _turnstile_held(server: SQLServer, name: str) -> bool:
    """Whether a lease waiter (or a lease taken in front of the queue) holds the turnstile."""
    turnstile = _default_table(server) + ":turnstile"
    if server.scheme == "postgresql":
        key = advisory_key(turnstile, name)
        return _advisory_lock_sessions(server, key, granted=True) > 0
    rows = admin(server)("SELECT IS_USED_LOCK(%s)", (named_lock_key(turnstile, name),))
    return rows[0][0] is not None


def _take_through_the_turnstile(url: str, name: str, waiter: dlock.Lock) -> None:
    """``waiter`` gets ``name`` by queueing behind a holder that releases it."""
    with dlock.connect(url) as other:
        holder = other.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=10))
        thread.start()
        time.sleep(0.3)
        holder.release()
        thread.join()
    assert waiter.owned()


def test_queued_waiters_take_the_lease_in_turn(server: SQLServer, name: str) -> None:
    """A lease taken in front of the turnstile keeps it; its release hands the lease to
    the next waiter inside the server, and the turnstile is left when the queue ends."""
    url = server.url()
    with dlock.connect(url) as first, dlock.connect(url) as second:
        lock = first.lock(name, ttl=30)
        _take_through_the_turnstile(url, name, lock)
        assert _turnstile_held(server, name), "the lease keeps the turnstile"
        token = lock.fencing_token
        successor = second.lock(name, ttl=30)
        thread = threading.Thread(target=lambda: successor.acquire(timeout=10))
        thread.start()
        time.sleep(0.3)
        assert not successor.owned()
        lock.release()
        thread.join()
        assert successor.owned() and token is not None
        assert successor.fencing_token is not None and successor.fencing_token > token
        info = second.inspect(name)
        assert info is not None and info.fencing_token == successor.fencing_token
        assert info.holder == Holder.current() and info.count == 1
        successor.release()
        assert not _turnstile_held(server, name)


class _UpdateTrap:
    """Holds UPDATEs of a PostgreSQL table whose query matches a LIKE pattern inside the
    server, in a trigger, until ``release()``: a race held open at a chosen point."""

    def __init__(self, server: SQLServer, table: str, matching: str, when: str, each: str):
        self._server = server
        self.key = advisory_key("test", table)
        run = admin(server)
        run(
            f"""CREATE FUNCTION {table}_trap() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF current_query() LIKE '{matching}' THEN
                    PERFORM pg_advisory_lock({self.key});
                    PERFORM pg_advisory_unlock({self.key});
                END IF;
                RETURN NEW;
            END $$""",
            (),
        )
        run(
            f"CREATE TRIGGER trap {when} ON {table} "
            f"FOR EACH {each} EXECUTE FUNCTION {table}_trap()",
            (),
        )
        self._jailer = server.connect()
        self._jailer.execute("SELECT pg_advisory_lock(%s)", (self.key,))

    def wait_for_a_statement(self, never: str) -> None:
        """Until an UPDATE is held in the trap (``never``: the failure's message)."""
        deadline = time.monotonic() + 10
        while not _advisory_lock_sessions(self._server, self.key, granted=False):
            assert time.monotonic() < deadline, never
            time.sleep(0.01)

    def release(self) -> None:
        self._jailer.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
        self._jailer.close()


def test_a_release_unheard_while_queueing_is_found_at_once(
    postgresql_server: SQLServer, name: str
) -> None:
    """The waiter in front LISTENs in the same transaction as its take, and LISTEN takes
    effect at commit: a release committed after the take found the lease busy, but
    before that commit, notifies nobody. The waiter's next attempt, on its connection
    now listening, must find the lease free at once, not wait for a notification.

    A statement trigger holds the waiter's transaction open right after its take (the
    only UPDATE sent in the same query as a LISTEN) until the release has committed.
    """
    url = postgresql_server.url()
    table = f"unheard_{uuid.uuid4().hex[:12]}"
    with dlock.connect(url, table=table) as holder_client:
        holder = holder_client.lock(name, ttl=30)
        # The plain path: no turnstile kept, so the release notifies the name's channel
        # instead of handing the lease over inside the server.
        assert holder.acquire(timeout=0)
        token = holder.fencing_token
        assert token is not None
        trap = _UpdateTrap(postgresql_server, table, "%LISTEN%", "AFTER UPDATE", "STATEMENT")
        # Without the next attempt the waiter would sleep until this fallback, then its
        # timeout: far beyond the bound below.
        patient = dlock.Backoff(notify_fallback=60)
        with dlock.connect(url, table=table, backoff=patient) as waiter_client:
            waiter = waiter_client.lock(name, ttl=30)
            outcome: list[tuple[bool, float]] = []

            def wait_for_it() -> None:
                acquired = waiter.acquire(timeout=30)
                outcome.append((acquired, time.monotonic()))

            thread = threading.Thread(target=wait_for_it)
            thread.start()
            try:
                trap.wait_for_a_statement("the waiter's take never ran")
                holder.release()  # commits and notifies while the waiter cannot hear it
            finally:
                trap.release()
                freed = time.monotonic()
                thread.join(timeout=40)
            assert outcome, "the waiter never returned"
            acquired, at = outcome[0]
            assert acquired, "the waiter gave up on a free lease"
            assert at - freed < 5, f"the waiter took {at - freed:.1f} s to find the lease free"
            assert waiter.fencing_token is not None and waiter.fencing_token > token
            waiter.release()


def test_lease_lost_through_the_turnstile_leaves_it(server: SQLServer, name: str) -> None:
    """A lease that ends without a release (here force-released) must not keep the
    turnstile: the renewal that finds it gone leaves it, or waiters would only poll."""
    url = server.url()
    with dlock.connect(url) as client, dlock.connect(url) as operator:
        lock = client.lock(name, ttl=1.5)
        _take_through_the_turnstile(url, name, lock)
        assert _turnstile_held(server, name)
        assert operator.force_release(name)
        deadline = time.monotonic() + 3
        while not lock.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost
        assert not _turnstile_held(server, name)


def test_lease_taken_through_the_turnstile_survives_a_restart(server: SQLServer, name: str) -> None:
    """The connection keeping the turnstile dies with the server; the lease does not, and
    its release goes through a new connection."""
    url = server.url()
    with dlock.connect(url) as client:
        lock = client.lock(name, ttl=30)
        _take_through_the_turnstile(url, name, lock)
        server.restart()
        lock.extend()
        lock.release()
        assert client.lock(name, ttl=5).acquire(timeout=0)


def test_fresh_acquire_leaves_a_turnstile_kept_by_a_lost_lease(
    server: SQLServer, name: str
) -> None:
    """Without renewal nobody notices the lease running out; the next acquisition by the
    same lock object (which never released it) must not leave the turnstile held."""
    url = server.url()
    with dlock.connect(url) as client:
        lock = client.lock(name, ttl=1, auto_renew=False)
        _take_through_the_turnstile(url, name, lock)
        time.sleep(1.2)
        assert lock.acquire(timeout=1)  # the lease ran out: taken again at once
        assert not _turnstile_held(server, name)
        lock.release()


def test_a_lease_run_out_while_keeping_the_turnstile_is_passed_on(
    server: SQLServer, name: str
) -> None:
    """A holder that took the lease in front of the queue keeps the turnstile until its
    release. If it goes quiet instead (paused; here, no renewal) and its lease runs out,
    others must still take the lease, one after another, at once: not be kept out (on
    MariaDB/MySQL a turnstile held means "someone is queued") behind a quiet holder."""
    url = server.url()
    with dlock.connect(url) as quiet_client, dlock.connect(url) as others:
        quiet = quiet_client.lock(name, ttl=1, auto_renew=False)
        _take_through_the_turnstile(url, name, quiet)
        token = quiet.fencing_token
        assert token is not None
        time.sleep(1.2)
        for turn in (1, 2):
            lock = others.lock(name, ttl=30)
            assert lock.acquire(timeout=0), f"turn {turn}: kept out by a quiet holder"
            assert lock.fencing_token is not None and lock.fencing_token > token
            token = lock.fencing_token
            lock.release()
        assert _turnstile_held(server, name), "the quiet holder never noticed"


@pytest.mark.parametrize(
    "before", ["first-wait", "kept-before", "lost-before", "unconfirmed-before"]
)
def test_newcomers_do_not_pass_the_waiter_in_front(
    mariadb_server: SQLServer, name: str, before: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MySQL cannot notify a release, so the lease waiter in front of the queue polls a
    lease whose holder did not queue, backing off. A release between its polls is still
    its to take: a newcomer that finds the lease free while someone is queued is refused
    (without that, the newcomer would win nearly every time, and a waiter could starve).

    ``kept-before``: the waiter's connection once kept the turnstile for a lease of its
    own; its release must have cleared it as the name's keeper (whose turnstile lets
    anyone in), or the same connection, queueing again, would let newcomers pass it.

    ``lost-before``: the waiter's client once kept the turnstile for a lease that ran out
    before its release. The row goes on naming that connection as its keeper (a lease
    run out is anyone's to take, and no statement of ours may write the row then), so
    the connection must not queue again.

    ``unconfirmed-before``: the waiter's connection was once handed a lease inside the
    server that was gone (force-released, taken by another) when the core confirmed it,
    and that wait timed out. The row names the connection as its keeper all the same, so
    it must not queue again either.
    """
    url = mariadb_server.url()
    with (
        dlock.connect(url) as holder_client,
        dlock.connect(url) as waiter_client,
        dlock.connect(url) as newcomer_client,
    ):
        waiter = waiter_client.lock(name, ttl=30)
        if before == "kept-before":
            _take_through_the_turnstile(url, name, waiter)
            waiter.release()
        elif before == "lost-before":
            lost = waiter_client.lock(name, ttl=1, auto_renew=False)
            _take_through_the_turnstile(url, name, lost)
            time.sleep(1.2)
            with pytest.raises(dlock.LockLost):
                lost.release()
        elif before == "unconfirmed-before":
            _hand_over_unconfirmed(url, name, waiter_client, newcomer_client, monkeypatch)
        holder = holder_client.lock(name, ttl=30)
        assert holder.acquire(timeout=0)  # the plain path: no turnstile kept
        token = holder.fencing_token
        assert token is not None
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=10))
        thread.start()
        deadline = time.monotonic() + 5
        while not _turnstile_held(mariadb_server, name):
            assert time.monotonic() < deadline, "the waiter never got in front"
            time.sleep(0.01)
        time.sleep(0.5)  # its polls back off to their longest
        holder.release()
        newcomer = newcomer_client.lock(name, ttl=30)
        assert not newcomer.acquire(timeout=0), "a newcomer passed the waiter in front"
        thread.join()
        assert waiter.owned() and waiter.fencing_token is not None
        assert waiter.fencing_token > token
        waiter.release()


def _hand_over_unconfirmed(
    url: str,
    name: str,
    waiter_client: dlock.Client,
    other_client: dlock.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease is handed to a waiter of ``waiter_client`` inside the server, but is taken
    by another before the waiter confirms it; the wait then times out."""
    backend: Any = waiter_client._backend
    real_extend = backend.extend
    thief = other_client.lock(name, ttl=30)

    def taken_before_confirmed(*args: Any) -> bool:
        assert other_client.force_release(name)
        assert thief.acquire(timeout=0)
        return bool(real_extend(*args))

    keeper = other_client.lock(name, ttl=30, auto_renew=False)
    _take_through_the_turnstile(url, name, keeper)
    with monkeypatch.context() as patch:
        # Every hand-over is confirmed (an owner-checked extend), not only a late one.
        patch.setattr(dlock._sync.lock, "RENEW_AFTER", 0.0)
        patch.setattr(backend, "extend", taken_before_confirmed)
        waiter = waiter_client.lock(name, ttl=30)
        threading.Timer(0.3, keeper.release).start()
        assert not waiter.acquire(timeout=1.5), "the lease was taken before confirmed"
    assert thief.owned()
    thief.release()


def _questions(server: SQLServer) -> int:
    """Statements the server has been sent so far, by every session."""
    return int(admin(server)("SHOW GLOBAL STATUS LIKE 'Questions'", ())[0][1])


@pytest.mark.parametrize("mode", ["lease", "session"])
@pytest.mark.parametrize("ttl", [1.2, 6.0], ids=["ttl-too-short-to-wait", "waits-in-server"])
def test_whole_second_lock_waits_neither_spin_nor_overrun(
    mariadb_server: SQLServer, name: str, mode: str, ttl: float
) -> None:
    """MySQL 8 reads ``GET_LOCK``'s timeout as whole seconds; MariaDB takes fractions.
    Here the waiters' backend is told what it detects on MySQL 8, so it sends MariaDB
    only whole-second waits, which MariaDB makes as MySQL 8 would. A waiter must not
    outlast its own timeout; where the server cannot wait for it (a TTL too short for a
    one-second wait, or under a second left) it backs off rather than asking again at
    once; and it still takes the lock soon after a release. Two waiters, so that in
    lease mode one waits in front of the queue and one in it."""
    url = mariadb_server.url(f"mode={mode}")
    with dlock.connect(url) as holder_client, dlock.connect(url) as waiter_client:
        backend: Any = waiter_client._backend
        backend._wait_grain = 1.0
        holder = holder_client.lock(name, ttl=ttl)
        assert holder.acquire(timeout=0)
        start = time.monotonic()
        assert not waiter_client.lock(name, ttl=ttl).acquire(timeout=0.5)
        assert 0.5 <= time.monotonic() - start < 0.95, "a wait outlasted its timeout"
        # Under a second to go: not one sleep to the deadline, but backing off.
        threading.Timer(0.3, holder.release).start()
        start = time.monotonic()
        early = waiter_client.lock(name, ttl=ttl)
        assert early.acquire(timeout=0.9)
        assert time.monotonic() - start < 0.8, "a release went unnoticed until the deadline"
        early.release()
        assert holder.acquire(timeout=0)
        taken: list[float] = []

        def wait_and_release() -> None:
            lock = waiter_client.lock(name, ttl=ttl)
            if lock.acquire(timeout=10):
                taken.append(time.monotonic())
                lock.release()

        before = _questions(mariadb_server)
        threads = [threading.Thread(target=wait_and_release) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        released = time.monotonic()
        holder.release()
        for thread in threads:
            thread.join()
        asked = _questions(mariadb_server) - before
        assert len(taken) == 2
        assert max(taken) - released < 0.5, "the waiters were slow to take the lock"
        assert asked < 300, f"{asked} statements sent in 1.5 s of waiting"


@pytest.fixture
def idle_timeout_url(server: SQLServer) -> Iterator[str]:
    """A login whose idle connections the server ends after one second."""
    with _login_where(server, ("idle_session_timeout", "'1s'"), ("wait_timeout", "1")) as url:
        yield url


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_the_servers_idle_timeout_ends_neither_a_lock_nor_a_wait(
    idle_timeout_url: str, name: str, mode: str
) -> None:
    """A session lock lives as long as its holder (and its lease), not as long as its
    connection may sit idle: the server's idle timeout (set by a DBA to reap leaked
    connections) must not end the holding session and free the lock under a live
    holder, who would only learn at its next renewal. Nor may it end a wait: the lease
    waiter in front of the queue sits idle until the release's notification."""
    url = idle_timeout_url + ("&" if "?" in idle_timeout_url else "?") + f"mode={mode}"
    with dlock.connect(url) as first, dlock.connect(url) as second:
        lock = first.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        if mode == "session":
            time.sleep(2.5)
        assert second.lock(name, ttl=30).acquire(timeout=0) is False, "the lock was freed"
        lock.extend()
        release = threading.Timer(2.5, lock.release)
        start = time.monotonic()  # before the timer's: its release may come 2.5 s after
        release.start()
        try:
            successor = second.lock(name, ttl=30)
            assert successor.acquire(timeout=5)
            assert 2.5 <= time.monotonic() - start < 4
            successor.release()
        finally:
            release.cancel()  # a failed wait leaves the holder's release to the exit
            release.join()


def test_batched_session_renewal_notices_a_killed_session(server: SQLServer, name: str) -> None:
    """The server ended the holders' sessions (their locks with them) while their rows
    still look live: a batched renewal must report them lost, as a single one does."""
    from dlock._types import Lease

    with dlock.connect(server.url("mode=session")) as client:
        locks = [client.lock(f"{name}-{i}", ttl=30, auto_renew=False) for i in range(2)]
        for lock in locks:
            assert lock.acquire(timeout=0)
        kill_other_sessions(server)
        backend: Any = client._backend
        leases = [Lease(lock.name, lock._token, 30) for lock in locks]
        assert backend.extend_many(leases) == [False, False]


def test_client_option_refuses_a_mysql_connection_without_found_rows(
    mariadb_server: SQLServer, name: str
) -> None:
    """Without FOUND_ROWS an UPDATE that changes nothing reports 0 rows: a renewal within
    the same microsecond would look lost. Refused up front instead of misbehaving."""
    made: list[Any] = []

    def factory() -> object:
        made.append(mariadb_server.connect(autocommit=False))
        return made[-1]

    with (
        dlock.connect("mysql://", client=factory) as client,
        pytest.raises(dlock.ConfigurationError, match="FOUND_ROWS"),
    ):
        client.lock(name, ttl=5).acquire(timeout=0)
    assert made and not made[0].open, "the refused connection is closed"


def test_a_connection_lent_inside_a_transaction_is_refused(server: SQLServer, name: str) -> None:
    """dlock's statements commit on their own. A connection in the middle of the
    application's transaction is refused before dlock sends or sets anything: on MySQL
    turning autocommit on would commit the application's unfinished work."""
    table = f"work_{uuid.uuid4().hex[:8]}"
    run = admin(server)
    run(f"CREATE TABLE {table} (x INTEGER)", ())
    flags = {} if server.scheme == "postgresql" else {"client_flag": CLIENT.FOUND_ROWS}
    conn = server.connect(autocommit=False, **flags)
    try:
        conn.cursor().execute(f"INSERT INTO {table} VALUES (1)")  # not committed
        with (
            dlock.connect(f"{server.scheme}://", client=lambda: conn) as client,
            pytest.raises(dlock.ConfigurationError, match="transaction"),
        ):
            client.lock(name, ttl=5).acquire(timeout=0)
        assert run(f"SELECT count(*) FROM {table}", ())[0][0] == 0, "committed by dlock"
    finally:
        with contextlib.suppress(pymysql.err.Error):  # the refused one is closed already
            conn.close()
        run(f"DROP TABLE {table}", ())


def test_session_mode_refuses_a_transaction_pooling_proxy(
    postgresql_server: SQLServer, name: str
) -> None:
    """Statements of one connection answered by different database sessions (PgBouncer
    transaction mode) would hold the lock in the wrong session: refused with advice.
    (PostgreSQL only: MySQL's session acquire reports no session id to compare.)"""
    with dlock.connect(postgresql_server.url("mode=session")) as client:
        lock = client.lock(name, ttl=5)
        assert lock.acquire(timeout=0)
        lock.release()
        backend: Any = client._backend
        for conn in backend._idle:
            conn.session_id = -1  # as if an earlier statement ran in another session
        with pytest.raises(dlock.ConfigurationError, match="PgBouncer"):
            client.lock(name, ttl=5).acquire(timeout=0)


def test_session_wait_times_out_on_time_and_keeps_its_connection(
    server: SQLServer, name: str
) -> None:
    url = server.url("mode=session")
    with dlock.connect(url) as first, dlock.connect(url) as second:
        held = first.lock(name, ttl=30)
        assert held.acquire(timeout=0)
        assert second.inspect(name) is not None  # pools a connection
        connects = _count_connects(second)
        start = time.monotonic()
        assert second.lock(name, ttl=30).acquire(timeout=1.0) is False
        assert 0.9 <= time.monotonic() - start < 2.0
        assert connects == [], "a wait that timed out is not a dead connection"
        held.release()


def _wal_flushes(server: SQLServer) -> int:
    """The server's WAL flushes so far, once dlock's sessions have ended and reported
    them (a session reports its statistics when it ends, the others every second)."""
    run = admin(server)
    deadline = time.monotonic() + 10
    while _sessions(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    flushes = -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        latest = int(run("SELECT wal_sync FROM pg_stat_wal", ())[0][0])
        if latest == flushes:
            break
        flushes = latest
    return flushes


@pytest.mark.parametrize("reentries", [0, 1])
def test_only_the_last_release_skips_the_disk_flush(name: str, reentries: int) -> None:
    """On a server that flushes on commit, grants and re-entries wait for the flush, and
    so does a partial release (its holder goes on by the count it returned); the last
    release does not: lost in a crash, it only leaves the lease to run out."""
    server = start_postgresql(durable=True)
    rounds = 20
    try:
        with dlock.connect(server.url()) as client:
            lock = client.lock(name, ttl=30, reentrant=True)
            lock.acquire()
            lock.release()
        before = _wal_flushes(server)
        with dlock.connect(server.url()) as client:
            lock = client.lock(name, ttl=30, reentrant=True)
            for _ in range(rounds):
                for _ in range(1 + reentries):
                    lock.acquire()
                for _ in range(1 + reentries):
                    lock.release()
        flushes = _wal_flushes(server) - before
    finally:
        server.stop()
    # Each round: 1 + reentries grants and re-entries, reentries partial releases, all
    # flushed; the WAL writer may flush an unflushed last release now and then.
    expected = rounds * (1 + 2 * reentries)
    assert expected <= flushes <= expected + rounds // 2


#: Client options for the hung-server tests, and how long a failing call may take with
#: them: the call (timeout), then the best-effort release of an acquire cut off in
#: flight (it may have committed) on a new connection (connect_timeout; libpq waits at
#: least 2 s), plus the slack of a loaded machine. A wait without a bound runs into the
#: test's own limit instead.
HUNG_OPTIONS: dict[str, Any] = {"timeout": 1.0, "connect_timeout": 1.0}
HUNG_LIMIT = 6.0
#: An acquire on a hung server fails after its call alone (timeout; the asyncio face's
#: backstop is 0.5 s more), plus slack: the release of the attempt cut off in flight
#: runs in the background, so the new connection it makes, which waits up to
#: connect_timeout on a hung server, is not the caller's to wait for.
HUNG_ACQUIRE_OPTIONS: dict[str, Any] = {"timeout": 1.0, "connect_timeout": 3.0}
HUNG_ACQUIRE_LIMIT = 3.0


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_hung_server_is_a_timely_error(server: SQLServer, name: str, mode: str) -> None:
    """A server that stops answering while its host still acknowledges the packets
    (here: every server process paused) never trips TCP's timeouts; each call must fail
    within the operation timeout, not wait for ever."""
    url = server.url("mode=session" if mode == "session" else "")
    with dlock.connect(url, **HUNG_ACQUIRE_OPTIONS) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        lock.release()
        outcome: list[BaseException | bool] = []

        def acquire() -> None:
            try:
                outcome.append(lock.acquire(timeout=0))
            except BaseException as exc:
                outcome.append(exc)

        server.process.pause()
        try:
            started = time.monotonic()
            thread = threading.Thread(target=acquire, daemon=True)
            thread.start()
            thread.join(HUNG_ACQUIRE_LIMIT)
            elapsed, answered = time.monotonic() - started, list(outcome)
        finally:
            server.process.resume()
        thread.join(30)
    assert answered, f"acquire still waiting after {elapsed:.1f} s"
    assert isinstance(answered[0], dlock.BackendUnavailable), answered[0]


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_release_on_a_hung_server_is_unavailable_not_lost(
    server: SQLServer, name: str, mode: str
) -> None:
    """A release that gets no answer says nothing of whether the lock was still held:
    session mode called it lost (``LockLost``, ``on_lost``) where lease mode said
    ``BackendUnavailable``. Dropped, the connection frees the database's lock once the
    server runs again."""
    url = server.url("mode=session" if mode == "session" else "")
    lost: list[object] = []
    with dlock.connect(url, **HUNG_OPTIONS) as client:
        lock = client.lock(name, ttl=30, on_lost=lost.append)
        assert lock.acquire(timeout=0)
        server.process.pause()
        try:
            with pytest.raises(dlock.BackendError) as raised:
                lock.release()
        finally:
            server.process.resume()
        assert isinstance(raised.value, dlock.BackendUnavailable), raised.value
        assert not lost and not lock.lost and not lock.owned()
        if mode == "session":
            with dlock.connect(url) as other:
                assert other.lock(name, ttl=30).acquire(timeout=5), "the lock stayed held"


def test_a_release_after_a_force_release_is_lost_every_time(server: SQLServer, name: str) -> None:
    """PostgreSQL ends a force-released holder's session after pg_terminate_backend has
    returned: an unlock sent meanwhile is answered "terminating connection due to
    administrator command" (57P01), the server's word that the session, and its lock,
    are gone. That is a loss (``LockLost``, ``on_lost``), not ``BackendUnavailable``,
    which only a release that gets no answer raises. Many rounds, as it is a race."""
    url = server.url("mode=session")
    with dlock.connect(url) as client, dlock.connect(url) as operator:
        for turn in range(30):
            lost: list[object] = []
            lock = client.lock(f"{name}-{turn}", ttl=30, on_lost=lost.append)
            assert lock.acquire(timeout=0)
            assert operator.force_release(lock.name)
            try:
                lock.release()
            except dlock.LockLost:
                pass
            except dlock.LockError as exc:
                pytest.fail(f"turn {turn}: {exc!r}, not LockLost")
            else:
                pytest.fail(f"turn {turn}: released a force-released lock")
            assert lost and lock.lost, f"turn {turn}: on_lost not called"


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_holder_is_told_its_lease_ran_out_while_the_server_hangs(
    server: SQLServer, name: str, mode: str
) -> None:
    """Renewals that cannot get an answer must not block the renewal watchdog: by the
    end of the TTL it tells the holder (``on_lost``) that its lease is gone."""
    url = server.url("mode=session" if mode == "session" else "")
    told = threading.Event()
    with dlock.connect(url, **HUNG_OPTIONS) as client:
        lock = client.lock(name, ttl=2, on_lost=lambda _: told.set())
        assert lock.acquire(timeout=0)
        # A pooled connection for the renewal (session mode's lock keeps its own): one
        # made after the pause would fail to connect, in time, whatever the bound.
        assert client.inspect(name) is not None
        server.process.pause()
        try:
            assert told.wait(2 + HUNG_LIMIT), "the holder was never told its lease ran out"
        finally:
            server.process.resume()


@pytest.mark.parametrize("mode", ["lease", "session"])
async def test_a_hung_server_is_a_timely_error_in_the_asyncio_face(
    server: SQLServer, name: str, mode: str
) -> None:
    """The asyncio face bounds its calls itself; a cancelled query must not then wait
    on the hung server once more (psycopg cancels it there first)."""
    url = server.url("mode=session" if mode == "session" else "")
    async with dlock.aio.connect(url, **HUNG_ACQUIRE_OPTIONS) as client:
        lock = client.lock(name, ttl=30)
        assert await lock.acquire(timeout=0)
        await lock.release()
        server.process.pause()
        try:
            started = time.monotonic()
            with pytest.raises(dlock.BackendUnavailable):
                await asyncio.wait_for(lock.acquire(timeout=0), HUNG_LIMIT * 3)
            elapsed = time.monotonic() - started
        finally:
            server.process.resume()
    assert elapsed < HUNG_ACQUIRE_LIMIT


def test_the_next_acquire_waits_for_the_give_back_of_a_cut_off_one(
    mariadb_server: SQLServer, name: str
) -> None:
    """An attempt cut off in flight is given back in the background, under the lock
    object's owner token. The same object's next acquisition must wait for that give-back:
    landing later, it would release the new lease, which the object goes on holding."""
    server = mariadb_server
    with dlock.connect(server.url("timeout=1")) as client, dlock.connect(server.url()) as other:
        lock = client.lock(name, ttl=30, auto_renew=False)
        assert lock.acquire(timeout=0)  # creates the row
        lock.release()
        backend: Any = client._backend
        connect = backend._connect
        opened = threading.Event()

        def held_up_connect() -> object:
            assert opened.wait(10)
            return connect()

        blocker = server.connect(autocommit=False)
        try:
            blocker.cursor().execute(
                "SELECT fence FROM dlock_locks WHERE name = %s FOR UPDATE", (name.encode(),)
            )
            # The give-back's new connection waits until `opened`.
            backend._connect = held_up_connect
            with pytest.raises(dlock.BackendUnavailable):
                lock.acquire(timeout=0)  # waits for the row lock: cut off after 1 s
            backend._connect = connect
            # The cut-off UPDATE still waits in the server: stop it, so it never commits.
            run = admin(server)
            waiting = run(
                "SELECT id FROM information_schema.processlist "
                "WHERE info LIKE %s AND id <> CONNECTION_ID()",
                (f"%UPDATE {_default_table(server)}%",),
            )
            assert waiting, "the cut-off statement should still wait for the row"
            for (thread_id,) in waiting:
                run(f"KILL QUERY {int(thread_id)}", ())
        finally:
            blocker.rollback()
            blocker.close()
        outcome: list[bool] = []
        thread = threading.Thread(target=lambda: outcome.append(lock.acquire(timeout=5)))
        thread.start()
        time.sleep(0.5)
        waited = not outcome
        opened.set()
        thread.join(10)
        assert outcome == [True]
        info = other.inspect(name)
        assert info is not None, "the late give-back released the new lease"
        assert info.fencing_token == lock.fencing_token
        assert waited, "the acquire did not wait for the give-back"
        lock.release()


def test_a_try_lock_takes_a_session_lock_whose_lease_ran_out(server: SQLServer, name: str) -> None:
    """A holder that stops renewing keeps the database's lock until an acquirer finds
    its lease run out and ends its session, "so it behaves like an expired lease". A
    try-lock ended the holder and answered busy: the lock went to whoever asked next,
    and `dlock status` said "free" while `dlock run -n` said "busy"."""
    url = server.url("mode=session")
    with dlock.connect(url) as holders, dlock.connect(url) as other:
        paused = holders.lock(name, ttl=0.5, auto_renew=False)
        assert paused.acquire(timeout=0)
        time.sleep(0.8)  # its lease has run out; its session still holds the lock
        taker = other.lock(name, ttl=30)
        assert taker.acquire(timeout=0), "a lock whose lease ran out is free to take"
        info = other.inspect(name)
        assert info is not None and info.fencing_token == taker.fencing_token
        taker.release()
        with pytest.raises(dlock.LockLost):
            paused.release()


def test_an_eviction_spares_a_holder_whose_renewal_commits_meanwhile(
    postgresql_server: SQLServer, name: str
) -> None:
    """A session-mode waiter that finds the holder's lease run out ends the holder's
    session. A renewal that found the lease live, but commits only after the eviction
    began, must either keep the holder's session or fail: told "renewed" with its
    session ended, the holder goes on while the waiter takes the lock.

    A row trigger holds the renewal's transaction open after its condition held (the
    only statement that sets ``expires`` alone), until the lease has run out by the
    server's clock and the eviction has started."""
    server = postgresql_server
    table = f"evict_{uuid.uuid4().hex[:12]}"
    url = server.url(f"mode=session&table={table}")
    run = admin(server)
    with dlock.connect(url) as holder_client, dlock.connect(url) as waiter_client:
        holder = holder_client.lock(name, ttl=2, auto_renew=False)
        assert holder.acquire(timeout=0)
        trap = _UpdateTrap(server, table, "%SET expires =%", "BEFORE UPDATE", "ROW")
        renewed: list[object] = []

        def renew() -> None:
            try:
                holder.extend(ttl=30)  # the lease is live as this starts
                renewed.append(True)
            except dlock.LockError as exc:
                renewed.append(exc)

        waiter = waiter_client.lock(name, ttl=30, auto_renew=False)
        first: list[bool] = []
        renewal = threading.Thread(target=renew)
        eviction = threading.Thread(target=lambda: first.append(waiter.acquire(timeout=0)))
        try:
            renewal.start()
            deadline = time.monotonic() + 10
            trap.wait_for_a_statement("the renewal never ran")
            # The holder's lease runs out by the server's clock, its renewal still open.
            while run(f"SELECT 1 FROM {table} WHERE expires > date_part('epoch', now())", ()):
                assert time.monotonic() < deadline, "the lease never ran out"
                time.sleep(0.05)
            eviction.start()
            time.sleep(0.5)  # the eviction has begun (or is over)
        finally:
            trap.release()
            renewal.join(10)
            eviction.join(10)
        assert first == [False], "the waiter took a lock whose holder was renewing"
        run(f"DROP TRIGGER trap ON {table}", ())
        if renewed == [True]:
            # Renewed: the holder's session and its lock must be intact.
            assert not waiter.acquire(timeout=0), "two holders: the renewed one was evicted"
            holder.extend()
            holder.release()
        else:
            assert len(renewed) == 1 and isinstance(renewed[0], dlock.LockLost)


def test_a_force_release_without_the_right_to_end_the_session_changes_nothing(
    server: SQLServer, name: str
) -> None:
    """Ending another user's session needs a privilege (PostgreSQL: pg_signal_backend,
    a superuser's: superuser; MariaDB: CONNECTION ADMIN). A force release refused for
    it is an error that says so, and leaves the holder's lock as it was: MariaDB's
    cleared the holder's row before its KILL was refused, so `dlock status` said "free"
    while the lock was held, and the holder's next renewal declared it lost."""
    pg = server.scheme == "postgresql"
    table = f"fr_{uuid.uuid4().hex[:8]}"
    user = f"nokill_{uuid.uuid4().hex[:8]}"
    url = server.url("mode=session")
    run = admin(server)
    with dlock.connect(url, table=table) as holders:
        holder = holders.lock(name, ttl=30, auto_renew=False)
        assert holder.acquire(timeout=0)
        if pg:
            run(f"CREATE ROLE {user} LOGIN", ())
            run(f"GRANT ALL ON {table} TO {user}", ())
        else:
            run(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'", ())
            run(f"GRANT SELECT, INSERT, UPDATE, DELETE ON dlock.* TO '{user}'@'%'", ())
        other_url = f"{server.scheme}://{user}:pw@127.0.0.1:{server.port}/{server.database}"
        try:
            with dlock.connect(other_url, mode="session", table=table) as other:
                with pytest.raises(dlock.BackendError, match="privilege") as raised:
                    other.force_release(name)
                assert not isinstance(raised.value, dlock.BackendUnavailable)
                assert not other.lock(name, ttl=5).acquire(timeout=0)
            info = holders.inspect(name)
            assert info is not None and info.fencing_token == holder.fencing_token
            holder.extend()  # still its own
            holder.release()
        finally:
            if pg:
                run(f"DROP OWNED BY {user}", ())
            run(f"DROP {'ROLE' if pg else 'USER'} {user}", ())
