"""``prune``: the rows of names nobody has used for long go, and nothing else changes.

Time is made to pass by setting rows back by hand (their lease end and their last
grant's token, which follows the server's clock), and, where a test says so, what a
client remembers of having seen a name held.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import dlock
import dlock.aio
from dlock._sql import MYSQL, POSTGRESQL
from dlock._sync.backends._server_sql import KNOWN_FOR
from tests.servers.redis import RedisServer
from tests.servers.sql import SQLServer
from tests.test_sql_faults import _record_statements, admin

HOURS = 2 * 3600
AN_HOUR = 3600.0
DLOCK = str(Path(sys.executable).with_name("dlock"))


@pytest.fixture
def table() -> str:
    """A table of the test's own: what other tests leave behind is not counted."""
    return f"prune_{uuid.uuid4().hex[:12]}"


def _set_back(server: SQLServer, table: str, name: str, *, lease_too: bool = True) -> None:
    """Make ``name``'s row look as if its last grant, and its lease's end unless not
    ``lease_too``, were two hours ago (a released MySQL lease's end is negative)."""
    lease = (
        f", expires = CASE WHEN expires < 0 THEN expires + {HOURS} ELSE expires - {HOURS} END"
        if lease_too
        else ""
    )
    admin(server)(
        f"UPDATE {table} SET fence = fence - {HOURS * 1_000_000}{lease} WHERE name = %s",
        (name.encode(),),
    )


def _has_row(server: SQLServer, table: str, name: str) -> bool:
    return bool(admin(server)(f"SELECT 1 FROM {table} WHERE name = %s", (name.encode(),)))


def _prune(url: str, older_than: float = AN_HOUR) -> int:
    with dlock.connect(url) as client:
        removed: int = client.prune(older_than)
        return removed


def _use(url: str, name: str) -> int:
    """Take and give back ``name`` once, on a client of its own; its fencing token."""
    with dlock.connect(url) as client, client.lock(name, ttl=30) as lock:
        assert lock.fencing_token is not None
        return lock.fencing_token


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_prune_deletes_only_names_idle_for_longer_than_asked(
    server: SQLServer, table: str, name: str, mode: str
) -> None:
    url = server.url(f"mode={mode}&table={table}")
    idle, recent, held = f"{name}-idle", f"{name}-recent", f"{name}-held"
    idle_token = _use(url, idle)
    _use(url, recent)
    with dlock.connect(url) as holder:
        lock = holder.lock(held, ttl=30, auto_renew=False)
        assert lock.acquire(timeout=0)
        _set_back(server, table, idle)
        _set_back(server, table, recent, lease_too=False)  # released just now
        # Lease mode: held for two hours, still live. Session mode: its lease ran out
        # two hours ago (the holder paused), but its session still holds the lock.
        _set_back(server, table, held, lease_too=mode == "session")
        assert _prune(url) == 1
        assert not _has_row(server, table, idle)
        assert _has_row(server, table, recent) and _has_row(server, table, held)
        if mode == "lease":
            assert lock.owned()
            lock.extend()  # raises if the lease was lost
            assert holder.inspect(held) is not None
    assert _use(url, idle) > idle_token, "a name made again must not reuse its tokens"


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_a_client_that_knew_a_pruned_name_takes_it_again(
    server: SQLServer, table: str, name: str, mode: str
) -> None:
    """A client skips asking whether a busy name has a row when it saw the name held
    lately. Pruned after that knowledge went stale, the name must be free to it, not
    "busy" for as long as the client lives."""
    url = server.url(f"mode={mode}&table={table}")
    with dlock.connect(url) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        before = lock.fencing_token
        lock.release()
        _set_back(server, table, name)
        # The two hours pass for the client too.
        backend: Any = client._backend
        known = backend._known
        for key in known:
            known[key] -= KNOWN_FOR
        assert _prune(url) == 1
        assert lock.acquire(timeout=0), "busy, for a name whose row was pruned"
        assert lock.fencing_token is not None and before is not None
        assert lock.fencing_token > before
        lock.release()


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_prune_goes_in_batches(server: SQLServer, table: str, name: str, mode: str) -> None:
    """Each statement deletes a batch, holding its rows until it commits: a table grown
    large must not be locked up in one long transaction."""
    url = server.url(f"mode={mode}&table={table}")
    names = [f"{name}-{i}" for i in range(5)]
    for each in names:
        _use(url, each)
        _set_back(server, table, each)
    with dlock.connect(url) as client:
        statements = _record_statements(client)
        assert client.prune(AN_HOUR, batch=2) == 5
    assert len([sql for sql in statements if "DELETE" in sql]) == 3, "2 + 2 + 1"
    assert not any(_has_row(server, table, each) for each in names)


def test_a_lease_held_for_long_is_idle_from_its_release(
    server: SQLServer, table: str, name: str
) -> None:
    """A lease released now was in use until now, however long ago it was granted."""
    url = server.url(f"table={table}")
    with dlock.connect(url) as client:
        lock = client.lock(name, ttl=30, auto_renew=False)
        assert lock.acquire(timeout=0)
        _set_back(server, table, name, lease_too=False)
        lock.release()
        assert _prune(url) == 0
        assert _has_row(server, table, name)


BAD_AGES = [0, 599.9, math.nan, math.inf, -1.0, "3600", True]
BAD_BATCHES = [0, -5, 2.5, True]


@pytest.mark.parametrize(
    ("older_than", "batch"),
    [(age, 1000) for age in BAD_AGES] + [(3600, batch) for batch in BAD_BATCHES],
)
def test_prune_refuses_bad_ages_and_batches(server: SQLServer, older_than: Any, batch: Any) -> None:
    """An age under ten minutes would remove rows that clients skip asking about."""
    with dlock.connect(server.url()) as client, pytest.raises(dlock.InvalidArgument):
        client.prune(older_than, batch=batch)


async def test_prune_in_the_asyncio_face(server: SQLServer, table: str, name: str) -> None:
    url = server.url(f"table={table}")
    _use(url, name)
    _set_back(server, table, name)
    async with dlock.aio.connect(url) as client:
        assert await client.prune(AN_HOUR) == 1
    assert not _has_row(server, table, name)


def test_the_prune_command(
    server: SQLServer, table: str, name: str, redis_server: RedisServer
) -> None:
    _use(server.url(f"table={table}"), name)
    _set_back(server, table, name)
    for url, status, output in [
        (server.url(f"table={table}"), 0, "1 idle names removed"),
        (f"redis://{redis_server.address}/0", 0, "keeps no row per name; nothing to do"),
    ]:
        result = subprocess.run(
            [DLOCK, "prune", "--older-than", "3600", "--batch", "10", "--url", url],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == status, result.stderr
        assert output in result.stdout + result.stderr
    assert not _has_row(server, table, name)


def _until_a_delete_waits_for_a_row(server: SQLServer, table: str, within: float) -> None:
    """Return once a DELETE from ``table`` waits for a row lock; fail after ``within`` s.

    MariaDB fills ``information_schema.innodb_trx`` from a cache that it refreshes
    only when nobody has read it for 100 ms: polled more often, it kept showing the
    moment before the DELETE waited, for ever (CI: "prune never waited for the row"
    while the DELETE waited until its client timed out). So it is polled more slowly."""
    if server.scheme == "postgresql":
        sql = f"""SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE '%DELETE FROM%{table}%'"""
    else:
        sql = f"""SELECT count(*) FROM information_schema.innodb_trx
                  WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE '%DELETE FROM%{table}%'"""
    deadline = time.monotonic() + within
    while not admin(server)(sql, ())[0][0]:
        assert time.monotonic() < deadline, "prune never waited for the row"
        time.sleep(0.25)


def test_a_name_taken_while_prune_waits_for_its_row_stays(
    server: SQLServer, table: str, name: str
) -> None:
    """An acquire that has updated an idle row but not yet committed holds it; a prune
    that chose the row meanwhile waits for it, and must then see it taken and leave
    it, not delete a live lease (PostgreSQL checks its condition again on the row as
    the acquire left it; InnoDB reads the row's latest version once locked)."""
    url = server.url(f"table={table}")
    _use(url, name)
    _set_back(server, table, name)
    # The prune's statement waits for as long as the test may take to see it wait.
    with dlock.connect(f"{url}&timeout=60") as client:
        # Connected, and the table checked, before the transaction below holds it open.
        assert client.inspect(name) is None
        conn = server.connect(autocommit=False)
        try:
            now = (POSTGRESQL if server.scheme == "postgresql" else MYSQL).now
            # What a grant writes: an owner and a lease ending 30 s from now.
            conn.cursor().execute(
                f"UPDATE {table} SET owner = %s, count = 1, expires = {now} + 30 WHERE name = %s",
                ("someone", name.encode()),
            )
            pruned: list[int] = []
            pruning = threading.Thread(target=lambda: pruned.append(client.prune(AN_HOUR)))
            pruning.start()
            _until_a_delete_waits_for_a_row(server, table, within=30)
            conn.commit()
            pruning.join(30)
        finally:
            conn.close()
    assert pruned == [0]
    assert _has_row(server, table, name)


def test_a_busy_answer_for_a_name_seen_held_needs_one_statement(
    server: SQLServer, table: str, name: str
) -> None:
    """Asked whether a name it has not seen is free, a client learns with its first
    busy answer that the name is held (PostgreSQL: how long for; MySQL: from the
    insert that found the row): its next busy answer is one statement, not the two or
    three that ask whether the row exists."""
    url = server.url(f"table={table}")
    with dlock.connect(url) as holder, dlock.connect(url) as other:
        lock = holder.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        statements = _record_statements(other)
        assert other.lock(name, ttl=30).acquire(timeout=0) is False
        first = len(statements)
        assert other.lock(name, ttl=30).acquire(timeout=0) is False
        assert len(statements) - first == 1, statements
        assert first > 1, "the first busy answer asked about the row (else this proves nothing)"
        lock.release()
