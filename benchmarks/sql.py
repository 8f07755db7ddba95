"""MariaDB and PostgreSQL: dlock's two modes against the raw operations and tooz.

    python -m benchmarks.sql [--db mariadb|postgresql|both] [--iterations N]
                             [--processes P] [--sections S] [--rounds R] [--pin CPU]
                             [--durable]

Per database, in one run with private servers (tests/servers/sql.py):

* lease mode against the bare INSERT + DELETE of a hand-written lock table;
* session mode against the bare lock + unlock functions (pg_try_advisory_lock /
  pg_advisory_unlock, GET_LOCK / RELEASE_LOCK), same driver as dlock; and the same
  with a SEQUENCE drawn in the lock's statement, the least that a fencing counter in
  the database can cost;
* each asyncio face also against the same bare operations through dlock's asyncio
  driver (psycopg's AsyncConnection, aiomysql), driven by the same event loop;
* tooz's driver for the same database, the peer a user would otherwise pick;
* 8 processes on one name: dlock in each mode, tooz, and the database's blocking lock
  (pg_advisory_lock, GET_LOCK with a timeout) as the hand-off baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiomysql
import psycopg
import pymysql

import dlock
import dlock.aio
from benchmarks.common import (
    Contention,
    Latency,
    combine_rounds,
    measure_contention_rounds,
    measure_latencies,
    open_dlock,
)
from benchmarks.common import print_table as print_table
from dlock._sql import (
    advisory_key,
    encode_name,
    mysql_statements,
    named_lock_key,
    notify_channel,
    postgresql_statements,
)
from dlock._types import Holder
from tests.servers.sql import SQLServer, start_mariadb, start_postgresql

RAW_LEASE = "raw INSERT + DELETE"
RAW_SESSION = "raw lock + unlock"
#: The bare lock functions with the cheapest counter the database keeps drawn in the
#: same statement: the floor of any session mode whose fencing tokens come from it.
RAW_COUNTER = "raw lock + sequence, unlock"
RAW_LEASE_ASYNC = "raw INSERT + DELETE asyncio"
RAW_SESSION_ASYNC = "raw lock + unlock asyncio"
RAW_BLOCKING = "raw blocking lock"
TOOZ = "tooz"
LEASE_SQL = "dlock's lease SQL, direct"
SESSION_SQL = "dlock's session SQL, direct"
#: The bare minimal operations, the same through every driver (sync and asyncio).
RAW_INSERT = "INSERT INTO raw_locks (name, owner, expires) VALUES (%s, %s, %s)"
RAW_DELETE = "DELETE FROM raw_locks WHERE name = %s AND owner = %s"
PG_TRY_LOCK, PG_UNLOCK = "SELECT pg_try_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)"
MY_TRY_LOCK, MY_UNLOCK = "SELECT GET_LOCK(%s, 0)", "SELECT RELEASE_LOCK(%s)"
PG_TRY_LOCK_COUNTER = "SELECT pg_try_advisory_lock(%s), nextval('raw_fence')"
MY_TRY_LOCK_COUNTER = "SELECT GET_LOCK(%s, 0), NEXTVAL(raw_fence)"
#: Operations of one kind in a row when measuring latency.
BLOCK = 20


# -- lock handles for the contending processes (module level: they run after spawn) --


class ToozHandle:
    def __init__(self, url: str) -> None:
        from tooz import coordination

        self.coordinator = coordination.get_coordinator(url, uuid.uuid4().hex.encode())
        self.coordinator.start()
        self.lock = self.coordinator.get_lock(b"bench")

    def acquire(self) -> None:
        self.lock.acquire(blocking=True)

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.coordinator.stop()


def open_tooz(url: str) -> ToozHandle:
    return ToozHandle(url)


class PgBlockingHandle:
    """The database's own blocking lock: the best hand-off PostgreSQL can do."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.key = advisory_key("raw", "bench")

    def acquire(self) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s)", (self.key,))

    def release(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))

    def close(self) -> None:
        self.conn.close()


def open_pg_blocking(url: str) -> PgBlockingHandle:
    return PgBlockingHandle(url)


def _mysql_connect(port: int) -> Any:
    return pymysql.connect(
        host="127.0.0.1",
        port=port,
        user="dlock",
        password="secret",
        database="dlock",
        autocommit=True,
        ssl_disabled=True,
    )


class MySQLBlockingHandle:
    def __init__(self, port: int) -> None:
        self.conn = _mysql_connect(port)
        self.cursor = self.conn.cursor()
        self.key = named_lock_key("raw", "bench")

    def acquire(self) -> None:
        self.cursor.execute("SELECT GET_LOCK(%s, 60)", (self.key,))

    def release(self) -> None:
        self.cursor.execute("SELECT RELEASE_LOCK(%s)", (self.key,))

    def close(self) -> None:
        self.conn.close()


def open_mysql_blocking(port: int) -> MySQLBlockingHandle:
    return MySQLBlockingHandle(port)


# -- uncontended ------------------------------------------------------------------------


def dlock_ops(url: str, loop: asyncio.AbstractEventLoop, cleanup: list[Callable[[], None]]):  # type: ignore[no-untyped-def]
    client = dlock.connect(url)
    lock = client.lock(f"uncontended-{uuid.uuid4().hex}", ttl=30)

    def sync_op() -> None:
        lock.acquire(timeout=0)
        lock.release()

    aclient = dlock.aio.connect(url)
    alock = aclient.lock(f"uncontended-{uuid.uuid4().hex}", ttl=30)

    async def async_op() -> None:
        await alock.acquire(timeout=0)
        await alock.release()

    cleanup.append(client.close)
    cleanup.append(lambda: loop.run_until_complete(aclient.aclose()))
    return sync_op, lambda: loop.run_until_complete(async_op())


def tooz_op(url: str, cleanup: list[Callable[[], None]]) -> Callable[[], None]:
    handle = ToozHandle(url)
    cleanup.append(handle.close)

    def op() -> None:
        handle.lock.acquire(blocking=False)
        handle.lock.release()

    return op


def _bare_operations(
    execute: Callable[[str, tuple[Any, ...]], object],
    key: Any,
    try_lock: str,
    try_lock_counter: str,
    unlock: str,
) -> dict[str, Callable[[], None]]:
    """The raw minimal operations through one sync driver's ``execute``: the same calls
    on either database, only the lock functions' SQL differs."""
    owner = secrets.token_hex(16)

    def insert_delete() -> None:
        execute(RAW_INSERT, (b"bench", owner, 1.0))
        execute(RAW_DELETE, (b"bench", owner))

    def lock_unlock() -> None:
        execute(try_lock, (key,))
        execute(unlock, (key,))

    def lock_counter_unlock() -> None:
        execute(try_lock_counter, (key,))
        execute(unlock, (key,))

    return {RAW_LEASE: insert_delete, RAW_SESSION: lock_unlock, RAW_COUNTER: lock_counter_unlock}


def postgresql_raw(server: SQLServer, cleanup: list[Callable[[], None]]) -> dict[str, Any]:
    conn = psycopg.connect(server.url(), autocommit=True)
    cleanup.append(conn.close)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS raw_locks (name bytea PRIMARY KEY, owner text, "
        "expires double precision)"
    )
    conn.execute("CREATE SEQUENCE IF NOT EXISTS raw_fence")
    key = advisory_key("raw", "uncontended")
    bare = _bare_operations(conn.execute, key, PG_TRY_LOCK, PG_TRY_LOCK_COUNTER, PG_UNLOCK)

    # dlock's statements name the tables in full, as its backend does.
    lease_table, session_table = "public.dlock_locks", "public.dlock_session_locks"
    lease, session = postgresql_statements(lease_table), postgresql_statements(session_table)
    lease_params, session_params = _direct_params(lease_table), _direct_params(session_table)
    release_params = {**lease_params, "channel": notify_channel(lease_table, "direct")}

    def lease_sql() -> None:
        assert conn.execute(lease["acquire_once"], lease_params).fetchall()
        conn.execute(lease["release"], release_params).fetchall()

    def session_sql() -> None:
        assert conn.execute(session["session_acquire"], session_params).fetchall()[0][0]
        conn.execute(session["session_unlock"], session_params).fetchall()

    return {
        **bare,
        LEASE_SQL: lease_sql,
        SESSION_SQL: session_sql,
    }


def postgresql_raw_async(
    server: SQLServer, loop: asyncio.AbstractEventLoop, cleanup: list[Callable[[], None]]
) -> dict[str, Any]:
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(server.url(), autocommit=True))
    cleanup.append(lambda: loop.run_until_complete(conn.close()))
    owner = secrets.token_hex(16)
    key = advisory_key("raw", "uncontended-asyncio")

    async def insert_delete() -> None:
        await conn.execute(
            RAW_INSERT,
            (b"bench-asyncio", owner, 1.0),
        )
        await conn.execute(RAW_DELETE, (b"bench-asyncio", owner))

    async def lock_unlock() -> None:
        await conn.execute(PG_TRY_LOCK, (key,))
        await conn.execute(PG_UNLOCK, (key,))

    return {
        RAW_LEASE_ASYNC: lambda: loop.run_until_complete(insert_delete()),
        RAW_SESSION_ASYNC: lambda: loop.run_until_complete(lock_unlock()),
    }


def mariadb_raw_async(
    server: SQLServer, loop: asyncio.AbstractEventLoop, cleanup: list[Callable[[], None]]
) -> dict[str, Any]:
    conn = loop.run_until_complete(
        aiomysql.connect(
            host="127.0.0.1",
            port=server.port,
            user=server.user,
            password=server.password,
            db=server.database,
            autocommit=True,
        )
    )
    cleanup.append(conn.close)
    owner = secrets.token_hex(16)
    key = named_lock_key("raw", "uncontended-asyncio")

    async def insert_delete() -> None:
        async with conn.cursor() as cursor:
            await cursor.execute(
                RAW_INSERT,
                (b"bench-asyncio", owner, 1.0),
            )
            await cursor.execute(RAW_DELETE, (b"bench-asyncio", owner))

    async def lock_unlock() -> None:
        async with conn.cursor() as cursor:
            # aiomysql's default cursor reads the whole result in execute, as PyMySQL's.
            await cursor.execute(MY_TRY_LOCK, (key,))
            await cursor.execute(MY_UNLOCK, (key,))

    return {
        RAW_LEASE_ASYNC: lambda: loop.run_until_complete(insert_delete()),
        RAW_SESSION_ASYNC: lambda: loop.run_until_complete(lock_unlock()),
    }


def _direct_params(table: str) -> dict[str, Any]:
    """Parameters for dlock's statements run directly (its tables hold the row by then)."""
    return {
        "name": encode_name("direct"),
        "owner": secrets.token_hex(16),
        "ttl": 30.0,
        "holder": Holder.current().to_json(),
        "reentrant": False,
        "key": advisory_key(table, "direct"),
    }


def mariadb_raw(server: SQLServer, cleanup: list[Callable[[], None]]) -> dict[str, Any]:
    conn = _mysql_connect(server.port)
    cleanup.append(conn.close)
    cursor = conn.cursor()
    cursor.execute(
        "CREATE TABLE IF NOT EXISTS raw_locks (name varbinary(1020) PRIMARY KEY, "
        "owner varbinary(64), expires double)"
    )
    cursor.execute("CREATE SEQUENCE IF NOT EXISTS raw_fence")
    key = named_lock_key("raw", "uncontended")
    bare = _bare_operations(cursor.execute, key, MY_TRY_LOCK, MY_TRY_LOCK_COUNTER, MY_UNLOCK)

    # dlock's statements name the tables in full, as its backend does.
    lease_table, session_table = "dlock.dlock_locks", "dlock.dlock_session_locks"
    lease, session = mysql_statements(lease_table), mysql_statements(session_table)
    lease_params = {
        **_direct_params(lease_table),
        "turnstile": named_lock_key(lease_table + ":turnstile", "direct"),
    }
    session_params = {
        **_direct_params(session_table),
        "key": named_lock_key(session_table, "direct"),
    }

    def lease_sql() -> None:
        assert cursor.execute(lease["acquire_once"], lease_params) == 1
        cursor.execute(lease["release"], lease_params)

    def session_sql() -> None:
        assert cursor.execute(session["session_acquire"], session_params) > 0
        cursor.execute(session["session_unlock"], session_params)
        cursor.fetchall()

    return {
        **bare,
        LEASE_SQL: lease_sql,
        SESSION_SQL: session_sql,
    }


@contextmanager
def pinned(server: SQLServer, cpu: int | None) -> Iterator[None]:
    """With ``cpu``: the server and this process run on that one CPU meanwhile.

    A loopback round trip here costs ~25 µs when client and server share a CPU and
    ~90 µs when the scheduler wakes the other one on a second CPU, and which one
    happens flips every few hundred operations. Pinned, every operation pays the first:
    the ratios then show what each side's work costs, not where the scheduler put it.
    PostgreSQL's sessions are forked afterwards from the pinned postmaster.
    """
    if cpu is None:
        yield
        return
    everywhere = os.sched_getaffinity(0)
    assert server.process.process is not None
    for pid in (server.process.process.pid, os.getpid()):
        _set_affinity(pid, {cpu})
    try:
        yield
    finally:
        for pid in (server.process.process.pid, os.getpid()):
            _set_affinity(pid, everywhere)


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid``: threads it starts later inherit it."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def _create_rows(*urls: str) -> None:
    """The rows that "dlock's SQL, direct" updates (dlock keeps a row per name)."""
    for url in urls:
        with dlock.connect(url) as client, client.lock("direct", ttl=30):
            pass


def run(
    db: str,
    iterations: int,
    processes: int,
    sections: int,
    rounds: int,
    pin: int | None,
    durable: bool,
) -> None:
    start = start_postgresql if db == "postgresql" else start_mariadb
    server = start(durable=durable)
    try:
        lease_url, session_url = server.url(), server.url("mode=session")
        tooz_url = (
            f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
            if db == "postgresql"
            else f"mysql://dlock:secret@127.0.0.1:{server.port}/dlock"
        )
        cleanup: list[Callable[[], None]] = []
        loop = asyncio.new_event_loop()
        with pinned(server, pin):
            try:
                _create_rows(lease_url, session_url)
                raw = (
                    postgresql_raw(server, cleanup)
                    if db == "postgresql"
                    else mariadb_raw(server, cleanup)
                )
                raw_async = (
                    postgresql_raw_async(server, loop, cleanup)
                    if db == "postgresql"
                    else mariadb_raw_async(server, loop, cleanup)
                )
                lease_sync, lease_async = dlock_ops(lease_url, loop, cleanup)
                session_sync, session_async = dlock_ops(session_url, loop, cleanup)
                latencies = measure_latencies(
                    {
                        RAW_LEASE: raw[RAW_LEASE],
                        LEASE_SQL: raw[LEASE_SQL],
                        "dlock lease sync": lease_sync,
                        RAW_LEASE_ASYNC: raw_async[RAW_LEASE_ASYNC],
                        "dlock lease asyncio": lease_async,
                        RAW_SESSION: raw[RAW_SESSION],
                        RAW_COUNTER: raw[RAW_COUNTER],
                        SESSION_SQL: raw[SESSION_SQL],
                        "dlock session sync": session_sync,
                        RAW_SESSION_ASYNC: raw_async[RAW_SESSION_ASYNC],
                        "dlock session asyncio": session_async,
                        TOOZ: tooz_op(tooz_url, cleanup),
                    },
                    iterations,
                    # Short blocks: the time of a loopback round trip flips between two
                    # levels here (client and server on one CPU or two) every few hundred
                    # operations, and every operation should see both alike. Not one by one:
                    # each switch to another connection costs its first operation a cold
                    # server session (after tooz's, the most), which would blur the ratios.
                    rounds=max(1, iterations // BLOCK),
                )
            finally:
                for close in reversed(cleanup):
                    close()
                loop.close()
        blocking: tuple[Callable[[Any], Any], Any] = (
            (open_pg_blocking, server.url())
            if db == "postgresql"
            else (open_mysql_blocking, server.port)
        )
        runs = measure_contention_rounds(
            {
                "dlock lease": (open_dlock, lease_url),
                "dlock session": (open_dlock, session_url),
                TOOZ: (open_tooz, tooz_url),
                RAW_BLOCKING: blocking,
            },
            rounds=rounds,
            processes=processes,
            sections=sections,
        )
        contention = {label: combine_rounds(results) for label, results in runs.items()}
    finally:
        server.stop()
    title = "PostgreSQL 15" if db == "postgresql" else "MariaDB 10.11"
    rows: list[tuple[str, Latency | None, Contention | None]] = [
        (RAW_LEASE, latencies[RAW_LEASE], None),
        (LEASE_SQL, latencies[LEASE_SQL], None),
        ("dlock lease sync", latencies["dlock lease sync"], contention["dlock lease"]),
        (RAW_LEASE_ASYNC, latencies[RAW_LEASE_ASYNC], None),
        ("dlock lease asyncio", latencies["dlock lease asyncio"], None),
        (RAW_SESSION, latencies[RAW_SESSION], None),
        (RAW_COUNTER, latencies[RAW_COUNTER], None),
        (SESSION_SQL, latencies[SESSION_SQL], None),
        ("dlock session sync", latencies["dlock session sync"], contention["dlock session"]),
        (RAW_SESSION_ASYNC, latencies[RAW_SESSION_ASYNC], None),
        ("dlock session asyncio", latencies["dlock session asyncio"], None),
        (TOOZ, latencies[TOOZ], contention[TOOZ]),
        (RAW_BLOCKING, None, contention[RAW_BLOCKING]),
    ]
    where = "; flushing every commit to disk" if durable else ""
    where += "" if pin is None else f"; uncontended pinned to CPU {pin} with the server"
    print_table(
        f"{title}{where}: uncontended acquire+release ({iterations} of each, interleaved in "
        f"blocks of {BLOCK}); {processes} processes x {sections} sections on one name, {rounds} "
        "interleaved rounds (median rate and hand-off, longest wait of all rounds, "
        "counters added up)",
        rows,
        RAW_LEASE,
    )
    print_targets(latencies, contention)


def print_targets(latencies: dict[str, Latency], contention: dict[str, Contention]) -> None:
    """The issue's targets, as ratios within this run."""

    def lat(label: str, base: str) -> str:
        return f"{latencies[label].median_us / latencies[base].median_us:.2f}x"

    def thr(label: str) -> str:
        return f"{contention[label].sections_per_s / contention[TOOZ].sections_per_s:.2f}x"

    blocking = contention[RAW_BLOCKING].median_handoff_ms
    print("targets:")
    print(f"  lease sync vs {RAW_LEASE}: {lat('dlock lease sync', RAW_LEASE)} (<= 1.15x)")
    print(
        f"  lease asyncio vs {RAW_LEASE_ASYNC}: "
        f"{lat('dlock lease asyncio', RAW_LEASE_ASYNC)} (<= 1.15x)"
    )
    print(f"  session sync vs {RAW_SESSION}: {lat('dlock session sync', RAW_SESSION)} (<= 1.15x)")
    print(
        f"  session asyncio vs {RAW_SESSION_ASYNC}: "
        f"{lat('dlock session asyncio', RAW_SESSION_ASYNC)} (<= 1.15x)"
    )
    print(
        f"  the asyncio driver itself: {RAW_LEASE_ASYNC} vs {RAW_LEASE}: "
        f"{lat(RAW_LEASE_ASYNC, RAW_LEASE)}"
    )
    print("  where it goes: the statements dlock sends, run directly, and dlock around them:")
    print(f"    {LEASE_SQL} vs {RAW_LEASE}: {lat(LEASE_SQL, RAW_LEASE)}")
    print(f"    dlock lease sync vs {LEASE_SQL}: {lat('dlock lease sync', LEASE_SQL)}")
    print(f"    {SESSION_SQL} vs {RAW_SESSION}: {lat(SESSION_SQL, RAW_SESSION)}")
    print(
        f"    the floor of a fencing counter in the database, {RAW_COUNTER} vs "
        f"{RAW_SESSION}: {lat(RAW_COUNTER, RAW_SESSION)}"
    )
    print(f"    dlock session sync vs {SESSION_SQL}: {lat('dlock session sync', SESSION_SQL)}")
    print(f"  lease throughput vs tooz: {thr('dlock lease')} (>= 3x)")
    print(f"  session throughput vs tooz: {thr('dlock session')} (>= 3x)")
    for mode in ("dlock lease", "dlock session"):
        handoff = contention[mode].median_handoff_ms
        ratio = handoff / blocking if blocking else float("inf")
        print(f"  {mode} hand-off vs {RAW_BLOCKING}: {ratio:.2f}x (lease on PostgreSQL <= 3x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=["mariadb", "postgresql", "both"], default="both")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--sections", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--pin",
        type=int,
        metavar="CPU",
        help="run the uncontended part with the server and this process on one CPU",
    )
    parser.add_argument(
        "--durable",
        action="store_true",
        help="servers that flush every commit to disk (the databases' default; the tests' "
        "servers do not)",
    )
    args = parser.parse_args()
    for db in ("mariadb", "postgresql") if args.db == "both" else (args.db,):
        run(
            db,
            args.iterations,
            args.processes,
            args.sections,
            args.rounds,
            args.pin,
            args.durable,
        )


if __name__ == "__main__":
    main()
