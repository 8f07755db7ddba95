"""What a PostgreSQL wait inside the server leaves on its connection.

A wait holds session state that a rollback does not undo (advisory locks, a LISTEN):
a connection pooled or kept after a wait must carry none of it. These run against the
private server of tests/servers/sql.py, sync face.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

import dlock
from dlock._sql import advisory_key
from tests.servers.sql import SQLServer
from tests.test_sql_faults import (
    _advisory_lock_sessions,
    _take_through_the_turnstile,
    _turnstile_held,
    admin,
)


@contextmanager
def _row_locked(
    server: SQLServer,
    table: str,
    name: str,
    seconds: float,
    first: Callable[[], object] | None = None,
) -> Iterator[None]:
    """Another transaction locks the name's row right after ``first()`` (the connection
    is open by then), and commits ``seconds`` after the block starts."""
    conn = server.connect(autocommit=False)
    if first is not None:
        first()
    conn.execute(f"SELECT 1 FROM {table} WHERE name = %s FOR UPDATE", (name.encode(),))
    timer = threading.Timer(seconds, conn.commit)
    timer.start()
    try:
        yield
    finally:
        timer.join()
        conn.close()


def _acquire_in_thread(lock: dlock.Lock, timeout: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: lock.acquire(timeout=timeout))
    thread.start()
    return thread


def test_a_session_waiter_whose_record_waits_for_its_row_keeps_no_lock(
    postgresql_server: SQLServer, name: str
) -> None:
    """The waiter's record runs the moment the advisory lock is granted, in the same
    query as the wait. Held up on its row for longer than the wait's bound, it must not
    read as "the wait timed out": that connection still holds the lock, and pooled, it
    kept it after the waiter's release."""
    url = postgresql_server.url("mode=session")
    table = "public.dlock_session_locks"
    with dlock.connect(url) as holder_client, dlock.connect(url) as waiter_client:
        holder = holder_client.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        # Each wait in the server is bounded by a third of the TTL: 0.5 s.
        waiter = waiter_client.lock(name, ttl=1.5)
        thread = _acquire_in_thread(waiter, timeout=8)
        time.sleep(0.3)
        with _row_locked(postgresql_server, table, name, 1.3):
            holder.release()  # granted to the waiter, whose record waits for the row
        thread.join()
        assert waiter.owned()
        waiter.release()
        key = advisory_key(table, name)
        assert _advisory_lock_sessions(postgresql_server, key, granted=True) == 0
        assert holder_client.lock(name, ttl=5).acquire(timeout=0)


def test_a_lease_waiter_whose_take_waits_for_its_row_leaves_the_turnstile(
    postgresql_server: SQLServer, name: str
) -> None:
    """The waiter that gets the turnstile takes the lease in the same query. Held up on
    its row for longer than the wait's bound, the take must not read as "the turnstile
    wait timed out": the connection still holds the turnstile, and kept for waiting,
    it held the queue up after the lease was released."""
    url = postgresql_server.url()
    table = "public.dlock_locks"
    turnstile = advisory_key(table + ":turnstile", name)
    with (
        dlock.connect(url) as holder_client,
        dlock.connect(url) as waiter_client,
        postgresql_server.connect() as ahead,
    ):
        holder = holder_client.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        ahead.execute("SELECT pg_advisory_lock(%s)", (turnstile,))  # queued before the waiter
        waiter = waiter_client.lock(name, ttl=1.5)
        thread = _acquire_in_thread(waiter, timeout=8)
        time.sleep(0.3)
        # The lease released, its row then locked until 1.3 s from now: the waiter gets
        # the turnstile at once, and its take waits for the row.
        with _row_locked(postgresql_server, table, name, 1.3, first=holder.release):
            ahead.execute("SELECT pg_advisory_unlock(%s)", (turnstile,))
        thread.join()
        assert waiter.owned()
        waiter.release()
        assert not _turnstile_held(postgresql_server, name)
        backend: Any = waiter_client._backend
        assert not backend._gates


def test_a_connection_kept_for_waiting_listens_to_nothing(
    postgresql_server: SQLServer, name: str
) -> None:
    """A lease taken in front of the turnstile was waited for with LISTEN on its
    connection; after its release that connection is kept for the next wait, and
    nothing reads it meanwhile. Still subscribed, the name's notifications piled up on
    it until its backend stopped reading the server-wide notification queue, which
    then filled (every NOTIFY, and so every release, fails)."""
    url = postgresql_server.url()
    with dlock.connect(url) as client:
        lock = client.lock(name, ttl=30)
        _take_through_the_turnstile(url, name, lock)
        lock.release()
        backend: Any = client._backend
        assert backend._queueing, "the waiting connection is kept"
        for conn in backend._queueing:
            assert conn.raw.execute("SELECT pg_listening_channels()").fetchall() == []
        # Kept connections queue again as before.
        _take_through_the_turnstile(url, name, lock)
        lock.release()
        assert not _turnstile_held(postgresql_server, name)


def test_a_hand_over_the_core_did_not_confirm_keeps_no_turnstile(
    postgresql_server: SQLServer, name: str
) -> None:
    """A lease handed over while waiting, but gone by the time the core confirms it
    (late, with a renewal), is not ours: a wait that then times out leaves the
    turnstile, rather than keeping it for a lease it never held.

    A trigger makes the hand-over so: the take's grant is slow (past a third of the
    TTL since the attempt, so the core confirms it) and leaves the lease with another
    owner, whose lease the waiter then finds busy until its timeout."""
    suffix = uuid.uuid4().hex[:12]
    table, marker, rewrite = f"public.t_{suffix}", f"public.m_{suffix}", f"public.f_{suffix}"
    run = admin(postgresql_server)
    url = postgresql_server.url(f"table={table}")
    turnstile = advisory_key(table + ":turnstile", name)
    with (
        dlock.connect(url) as holder_client,
        dlock.connect(url) as waiter_client,
        postgresql_server.connect(autocommit=False) as ahead,
    ):
        holder = holder_client.lock(name, ttl=30, auto_renew=False)
        assert holder.acquire(timeout=0)
        run(f"CREATE TABLE {marker} ()", ())
        run(f"INSERT INTO {marker} DEFAULT VALUES", ())
        run(
            f"""CREATE FUNCTION {rewrite}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.owner IS NOT NULL AND NEW.owner IS DISTINCT FROM OLD.owner
                   AND EXISTS (SELECT FROM {marker}) THEN
                    DELETE FROM {marker};
                    PERFORM pg_sleep(0.6);
                    NEW.owner := 'someone else';
                    NEW.expires := date_part('epoch', clock_timestamp()) + 30;
                END IF;
                RETURN NEW;
            END $$""",
            (),
        )
        run(
            f"CREATE TRIGGER t BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {rewrite}()",
            (),
        )
        try:
            ahead.execute("SELECT pg_advisory_lock(%s)", (turnstile,))  # queued first
            ahead.commit()
            # Each wait in the server is bounded by a third of the TTL: 0.5 s.
            waiter = waiter_client.lock(name, ttl=1.5)
            got: list[bool] = []
            thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=2.5)))
            thread.start()
            time.sleep(0.3)
            # The lease freed, its row locked at once (one round trip: no attempt of the
            # waiter's can come between) until the waiter is surely in the turnstile's
            # queue: handed over, its take waits for the row, then runs the trigger.
            where = f"name = decode('{name.encode().hex()}', 'hex')"
            ahead.execute(
                f"UPDATE {table} SET owner = NULL, count = 0, holder = NULL WHERE {where};"
                f" COMMIT; BEGIN; SELECT 1 FROM {table} WHERE {where} FOR UPDATE"
            )
            ahead.execute("SELECT pg_advisory_unlock(%s)", (turnstile,))
            time.sleep(0.1)
            ahead.commit()
            thread.join()
            assert got == [False]
            assert _advisory_lock_sessions(postgresql_server, turnstile, granted=True) == 0
            backend: Any = waiter_client._backend
            assert not backend._gates
        finally:
            run(f"DROP TABLE {table}, {marker}", ())
            run(f"DROP FUNCTION {rewrite}()", ())


def test_a_session_wait_granted_as_its_timeout_ends_leaves_no_lock_on_its_connection(
    postgresql_server: SQLServer, name: str
) -> None:
    """PostgreSQL may grant an advisory lock just as lock_timeout ends the wait: the
    statement fails (LockNotAvailable), and the lock, a session's, stays on the
    connection. Read as "not granted", the connection went back to the pool holding it:
    the waiter's next acquire on it stacked a second level, its release left one, and
    the lock stayed held by nobody (a chaos helper's run, 9 of 16, no fault injected).
    Played here: the wait's statement is answered with that error once the lock was
    taken on its connection. The wait now lets go of the lock before pooling it."""
    url = postgresql_server.url("mode=session")
    table = "public.dlock_session_locks"
    key = advisory_key(table, name)
    with dlock.connect(url) as holder_client, dlock.connect(url) as waiter_client:
        holder = holder_client.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        backend: Any = waiter_client._backend
        real_run = backend._run
        played: list[bool] = []

        def granted_as_it_timed_out(conn: Any, sql: str, params: Any, wait: float = 0) -> Any:
            if not wait or played:
                return real_run(conn, sql, params, wait=wait)
            played.append(True)
            holder.release()
            real_run(conn, "SELECT pg_advisory_lock(%(key)s)", {"key": key})
            error = dlock.BackendError("lock timeout")
            error.__cause__ = psycopg.errors.LockNotAvailable("lock timeout")
            raise error

        backend._run = granted_as_it_timed_out
        waiter = waiter_client.lock(name, ttl=30)
        assert waiter.acquire(timeout=10)
        assert played
        backend._run = real_run
        waiter.release()
        assert _advisory_lock_sessions(postgresql_server, key, granted=True) == 0
        assert holder_client.lock(name, ttl=5).acquire(timeout=0), "the lock stayed held"
