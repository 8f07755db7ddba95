"""One client of MariaDB or PostgreSQL used by two ``asyncio.run`` calls (asyncio), or
in both processes of an ``os.fork()`` (either face).

What the first event loop made (pooled connections, those kept for waiting, a
turnstile's, a session lock's) can be neither used nor closed in the second: the
backend drops it and makes new connections. So does a forked child with what its
parent made. These run against the private servers of tests/servers/sql.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import os
import select
import signal
import threading
import time
import traceback
import uuid
from typing import Any

import pytest

import dlock
import dlock.aio
from tests.servers.sql import SQLServer
from tests.test_sql_faults import _own_sessions, admin


def _waits_in_the_server(server: SQLServer, backend: Any, session: bool, name: str) -> bool:
    """Whether a waiter for ``name`` is inside the server: in session mode blocked on
    the lock itself, in lease mode in front of the turnstile (the holder took the lease
    without it)."""
    key = backend._session_key(name) if session else backend._turnstile_key(name)
    run = admin(server)
    if server.scheme == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = %s"
            " AND objsubid = 1 AND classid::bigint = (%s >> 32) & 4294967295"
            " AND objid::bigint = %s & 4294967295"
        )
        # Session mode: the holder has it granted, the waiter waits; lease mode: the
        # waiter holds the turnstile.
        return int(run(sql, (not session, key, key))[0][0]) > 0
    if session:
        sql = (
            "SELECT count(*) FROM information_schema.processlist"
            " WHERE state = 'User lock' AND info LIKE %s"
        )
        return int(run(sql, (f"%{key}%",))[0][0]) > 0
    return run("SELECT IS_USED_LOCK(%s)", (key,))[0][0] is not None


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_an_async_client_works_in_a_second_event_loop(server: SQLServer, mode: str) -> None:
    """The first acquire of the second run raised BackendError ("bound to a different
    event loop", "attached to a different loop") on a connection of the first. Each run
    takes a lock while another of the client's waits for it inside the server; a lock
    held across the two runs stays held, and is released in the second."""
    session = mode == "session"
    url = server.url("mode=session" if session else "")
    name = f"loops-{uuid.uuid4().hex}"
    client = dlock.aio.connect(url)
    made, still_open = _own_sessions(server, client)
    backend: Any = client._backend
    across = client.lock(f"{name}-across", ttl=30)

    async def contended() -> None:
        holder, waiter = client.lock(name, ttl=10), client.lock(name, ttl=10)
        for _ in range(2):
            assert await holder.acquire(timeout=1)
            waiting = asyncio.ensure_future(waiter.acquire(timeout=5))
            deadline = time.monotonic() + 5
            while not _waits_in_the_server(server, backend, session, name):
                assert time.monotonic() < deadline, "the waiter never waited in the server"
                assert not waiting.done(), waiting
                await asyncio.sleep(0.01)
            await holder.release()
            assert await waiting
            await waiter.release()

    async def first() -> None:
        assert await across.acquire(timeout=0)
        await contended()

    async def second() -> None:
        await contended()
        assert across.owned() and not across.lost
        with dlock.connect(url) as other:
            assert not other.lock(across.name, ttl=5).acquire(timeout=0), "across was freed"
            await across.release()
            assert other.lock(across.name, ttl=5).acquire(timeout=0), "across is still held"
        await client.aclose()

    asyncio.run(first())
    assert made, "the first loop made no connection"
    asyncio.run(second())
    # The first loop's connections were closed, not left to the garbage collector.
    deadline = time.monotonic() + 5
    while still_open():  # a closed PostgreSQL session leaves a moment later
        assert time.monotonic() < deadline, "sessions of the first loop are still open"
        time.sleep(0.01)
    gc.collect()  # and were closed without warnings


async def _done(result: Any) -> Any:
    """A call's result in either face: awaited if it is the asyncio face's."""
    return await result if inspect.isawaitable(result) else result


def _connections(backend: Any) -> list[Any]:
    """The driver connections a backend keeps: pooled, for waiting, holding a lock."""
    kept = [*backend._idle, *backend._queueing, *(gate.conn for gate in backend._gates.values())]
    kept += [held.conn for held in (*backend._held.values(), *backend._parked.values())]
    return [conn.raw for conn in kept]


#: What the forked child's exit status says went wrong.
CHILD_FAILED = {
    1: "the child failed (its traceback is in the captured output)",
    2: "the child was granted the lock its parent holds",
    3: "the child could not take a free name",
    4: "the child used its parent's connections",
}


async def _in_child(client: Any, name: str, parents: list[Any]) -> int:
    """The forked child's part, in either face; its exit status."""
    if await _done(client.lock(name, ttl=30).acquire(timeout=0)):
        return 2
    own = client.lock(f"{name}-child", ttl=30)
    if not await _done(own.acquire(timeout=0)):
        return 3
    used = _connections(client._backend)
    await _done(own.release())
    used += _connections(client._backend)
    if any(conn is parents_conn for conn in used for parents_conn in parents):
        return 4
    await _done(client.aclose() if isinstance(client, dlock.aio.AsyncClient) else client.close())
    return 0


async def _fork_while_holding(url: str, name: str, face: str) -> None:
    client: Any = dlock.connect(url) if face == "sync" else dlock.aio.connect(url)
    held = client.lock(name, ttl=30)
    try:
        assert await _done(held.acquire(timeout=0))
        backend = client._backend
        parents = _connections(backend)
        assert parents
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = asyncio.run(_in_child(client, name, parents))
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        _, wait_status = await asyncio.to_thread(os.waitpid, pid, 0)
        status = os.waitstatus_to_exitcode(wait_status)
        assert status == 0, CHILD_FAILED.get(status, f"the child ended with {status}")
        # The child's close ended neither the parent's sessions nor its lock.
        assert not any(backend._driver_idle_dead(raw) for raw in parents)
        await _done(held.extend())
        assert held.owned()
        with dlock.connect(url) as other:
            assert not other.lock(name, ttl=5).acquire(timeout=0), "the parent's lock was freed"
            await _done(held.release())
            assert other.lock(name, ttl=5).acquire(timeout=0)
    finally:
        await _done(client.aclose() if face == "asyncio" else client.close())


# From Python 3.12, forking while the renewer's thread runs warns (it is what is tested).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("face", ["sync", "asyncio"])
@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_forked_child_makes_connections_of_its_own(
    server: SQLServer, mode: str, face: str
) -> None:
    """A child after ``os.fork()`` sent its statements on its parent's pooled
    connections: replies crossed, and the child was once granted a lock its parent
    held; its close would have ended the parent's sessions, session locks with them.
    The child must find its parent's lock busy, take and free one of its own on
    connections of its own, and close without touching its parent's."""
    url = server.url("mode=session" if mode == "session" else "")
    asyncio.run(_fork_while_holding(url, f"fork-{uuid.uuid4().hex}", face))


def test_a_waiter_cut_off_as_the_event_loop_ends_gives_back(mariadb_server: SQLServer) -> None:
    """A lease waiter queued in MariaDB's turnstile and cut off just before
    ``asyncio.run`` ended was cleaned up by a task that the run cancelled before it gave
    back: the dead GET_LOCK wait took the lease when the turnstile was handed over, for
    nobody, and another client waited its whole TTL."""
    url = mariadb_server.url()
    name = f"loops-{uuid.uuid4().hex}"
    ttl = 30
    client = dlock.aio.connect(url)
    with dlock.connect(url) as holding, dlock.connect(url) as queued:
        holder = holding.lock(name, ttl=ttl)
        assert holder.acquire(timeout=0)
        front = queued.lock(name, ttl=ttl)
        in_front = threading.Thread(target=front.acquire, kwargs={"timeout": 60})
        in_front.start()
        try:
            deadline = time.monotonic() + 5
            while not _waits_in_the_server(mariadb_server, client._backend, False, name):
                assert time.monotonic() < deadline, "no waiter in front of the turnstile"
                time.sleep(0.01)

            async def cut_off() -> None:
                with pytest.raises(asyncio.TimeoutError):
                    # Queued behind the waiter in front, in flight.
                    await asyncio.wait_for(client.lock(name, ttl=ttl).acquire(timeout=30), 0.3)

            asyncio.run(cut_off())
            holder.release()
        finally:
            in_front.join()
        assert front.owned()
        front.release()  # hands the turnstile over
        with dlock.connect(url) as other:
            another = other.lock(name, ttl=ttl)
            assert another.acquire(timeout=ttl / 3), "the dead wait took the lease"
            another.release()
    asyncio.run(client.aclose())


#: What the forked parent's exit status says went wrong (``_parent_in_use_at_fork``).
PARENT_FAILED = {
    1: "the parent failed (its traceback is in the captured output)",
    2: "the long statement never showed in the server",
    3: "the parent's lock is not on the connection in use at the fork",
    4: "the child hung in its first use of the client",
}


def _in_flight(server: SQLServer, tag: str) -> bool:
    """Whether the statement tagged ``tag`` runs in the server."""
    if server.scheme == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
            " AND pid <> pg_backend_pid() AND query LIKE %s"
        )
    else:
        sql = (
            "SELECT count(*) FROM information_schema.processlist"
            " WHERE id <> CONNECTION_ID() AND info LIKE %s"
        )
    return int(admin(server)(sql, (f"%{tag}%",))[0][0]) > 0


def _parent_in_use_at_fork(server: SQLServer, url: str, name: str, child_pid: int) -> int:
    """A process that forks while another of its threads has a statement in flight,
    then holds a session lock on that very connection; its exit status. Its child's pid
    goes to ``child_pid`` (a pipe's write end), for the test to end it."""
    client = dlock.connect(url)
    backend: Any = client._backend
    tag = uuid.uuid4().hex
    sleep = "pg_sleep(2)" if server.scheme == "postgresql" else "SLEEP(2)"
    statement = threading.Thread(target=backend._call, args=("x", {}, f"SELECT '{tag}', {sleep}"))
    statement.start()
    deadline = time.monotonic() + 5
    while not _in_flight(server, tag):
        if time.monotonic() > deadline:
            return 2
        time.sleep(0.01)
    used, ready = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            own = client.lock(f"{name}-child", ttl=30)
            assert own.acquire(timeout=5)
            own.release()
            os.write(ready, b"-")
            time.sleep(30)  # alive until the test ends it
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    os.write(child_pid, str(pid).encode())
    if not select.select([used], [], [], 10)[0]:
        return 4
    statement.join()
    # The connection of the statement is the client's only one: the lock goes on it.
    (conn,) = _connections(backend)
    held = client.lock(name, ttl=30)
    assert held.acquire(timeout=0)
    if _connections(backend) != [conn]:
        return 3
    return 0  # and dies holding the lock, without a word (a crash)


# From Python 3.12, forking while another thread runs warns (it is what is tested).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_lets_go_of_connections_in_use_at_the_fork(server: SQLServer) -> None:
    """A connection that another thread of the parent had in use at the fork (a
    statement in flight) was in none of the lists a child disowns: the child kept its
    copy of the socket, so when the parent died, the server kept the parent's session
    for as long as the child lived, and a session lock taken on that connection stayed
    held instead of being freed at once. Here the parent dies holding such a lock while
    its child, which has used the client, lives on: the lock must be free at once."""
    url = server.url("mode=session")
    name = f"fork-{uuid.uuid4().hex}"
    child_pid, reported = os.pipe()
    parent = os.fork()
    if parent == 0:
        status = 1
        try:
            os.close(child_pid)
            status = _parent_in_use_at_fork(server, url, name, reported)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(reported)
    child = 0
    try:
        _, wait_status = os.waitpid(parent, 0)
        child = int(os.read(child_pid, 20) or 0)
        status = os.waitstatus_to_exitcode(wait_status)
        assert status == 0, PARENT_FAILED.get(status, f"the parent ended with {status}")
        with dlock.connect(url) as other:
            taken = other.lock(name, ttl=5)
            deadline = time.monotonic() + 5
            while not taken.acquire(timeout=0):
                os.kill(child, 0)  # the child lives on
                assert time.monotonic() < deadline, "the dead parent's lock is still held"
                time.sleep(0.05)
            taken.release()
    finally:
        os.close(child_pid)
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
