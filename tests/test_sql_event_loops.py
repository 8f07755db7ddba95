"""One asyncio client of MariaDB or PostgreSQL used by two ``asyncio.run`` calls.

What the first event loop made (pooled connections, those kept for waiting, a
turnstile's, a session lock's) can be neither used nor closed in the second: the
backend drops it and makes new connections. These run against the private servers of
tests/servers/sql.py.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from typing import Any

import pytest

import dlock
import dlock.aio
from tests.servers.sql import SQLServer
from tests.test_sql_faults import _sessions, admin


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
    before = _sessions(server)
    client = dlock.aio.connect(url)
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
    asyncio.run(second())
    # The first loop's connections were closed, not left to the garbage collector.
    deadline = time.monotonic() + 5
    while _sessions(server) > before:  # a closed PostgreSQL session leaves a moment later
        assert time.monotonic() < deadline, "sessions of the first loop are still open"
        time.sleep(0.01)
    gc.collect()  # and were closed without warnings
