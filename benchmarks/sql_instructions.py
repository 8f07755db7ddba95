"""PostgreSQL: what dlock's statements cost the server, in instructions.

    python -m benchmarks.sql_instructions [--pairs N]

Timings of a ~100 µs statement on a shared machine move by more than the differences
worth knowing; instruction counts do not. This runs PostgreSQL single-user
(``postgres --single``, no client, no network) under ``valgrind --tool=callgrind``,
feeds it prepared statements, and reports server instructions per acquire + release
pair: the raw INSERT + DELETE of ``benchmarks.sql``, two bare UPDATEs of a row (the
floor for a lock table whose rows stay), and dlock's own lease statements; then the
bare advisory lock + unlock, the same with a sequence drawn (the floor for a fencing
counter kept in the database) or a transaction id taken (what any write to a table
adds: an xid and a commit record) and dlock's session statements. dlock's are taken from
``dlock._sql`` as the backend sends them. Each figure is the difference between a run
of ``N + 100`` pairs and one of 100, so start-up and the first executions cancel out.

Needs valgrind and PostgreSQL 15 (``./scripts/test`` installs PostgreSQL; valgrind is
Debian's ``valgrind``). Runs as the ``postgres`` user when started as root.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from dlock._sql import (
    DEFAULT_TABLES,
    POSTGRESQL,
    advisory_key,
    encode_name,
    notify_channel,
    postgresql_statements,
)
from dlock._types import Holder
from tests.servers.sql import PG_BIN

# Named as dlock's PostgreSQL backend names its default tables.
TABLE = "public." + DEFAULT_TABLES["lease"]
SESSION_TABLE = "public." + DEFAULT_TABLES["session"]
NAME = "bench"
TYPES = {
    "name": "bytea",
    "owner": "text",
    "ttl": "float8",
    "holder": "text",
    "channel": "text",
    "reentrant": "boolean",
    "key": "int8",
}
SETTINGS = ("fsync=off", "synchronous_commit=off", "full_page_writes=off", "autovacuum=off")
#: Pairs run in every measurement before the counted ones.
BASE_PAIRS = 100


def prepare(label: str, sql: str) -> tuple[str, list[str]]:
    """A PREPARE of ``sql`` with its ``%(name)s`` made positional, and their order."""
    order: list[str] = []

    def position(match: re.Match[str]) -> str:
        if match[1] not in order:
            order.append(match[1])
        return f"${order.index(match[1]) + 1}"

    body = re.sub(r"%\((\w+)\)s", position, " ".join(sql.split()))
    kinds = ", ".join(TYPES[p] for p in order)
    return f"PREPARE {label} ({kinds}) AS {body}", order


def literal(value: object) -> str:
    if isinstance(value, bytes):
        return "'\\x" + value.hex() + "'"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def variants() -> dict[str, tuple[str, str]]:
    """Acquire and release statements per variant, ``%(name)s`` style; the first of
    each mode is its baseline."""
    dlock_sql = postgresql_statements(TABLE)
    session_sql = postgresql_statements(SESSION_TABLE)
    unlock = session_sql["session_unlock"]
    return {
        "raw INSERT + DELETE": (
            "INSERT INTO raw_locks (name, owner, expires) VALUES (%(name)s, %(owner)s, %(ttl)s)",
            "DELETE FROM raw_locks WHERE name = %(name)s AND owner = %(owner)s",
        ),
        "two bare UPDATEs": (
            f"UPDATE {TABLE} SET owner = %(owner)s WHERE name = %(name)s",
            f"UPDATE {TABLE} SET owner = NULL WHERE name = %(name)s AND owner = %(owner)s",
        ),
        "dlock lease (acquire_once + release)": (dlock_sql["acquire_once"], dlock_sql["release"]),
        "dlock reentrant lease (acquire + release)": (dlock_sql["acquire"], dlock_sql["release"]),
        "raw advisory lock + unlock": ("SELECT pg_try_advisory_lock(%(key)s)", unlock),
        "raw advisory lock + nextval, unlock": (
            "SELECT pg_try_advisory_lock(%(key)s), nextval('raw_fence')",
            unlock,
        ),
        "raw advisory lock + a transaction id, unlock": (
            "SELECT pg_try_advisory_lock(%(key)s), pg_current_xact_id()",
            unlock,
        ),
        "dlock session (session_acquire + unlock)": (session_sql["session_acquire"], unlock),
    }


#: Where each mode's baseline starts.
BASELINES = ("raw INSERT + DELETE", "raw advisory lock + unlock")


def script(acquire: str, release: str, pairs: int) -> str:
    params: dict[str, object] = {
        "name": encode_name(NAME),
        "ttl": 30.0,
        "holder": Holder.current().to_json(),
        "channel": notify_channel(TABLE, NAME),
        "reentrant": True,
        "key": advisory_key(SESSION_TABLE, NAME),
    }
    lines = [
        "CREATE TABLE raw_locks (name bytea PRIMARY KEY, owner text, expires double precision)",
        "CREATE SEQUENCE raw_fence",
        POSTGRESQL.schema(TABLE),
        POSTGRESQL.schema(SESSION_TABLE, session=True),
    ]
    for table in (TABLE, SESSION_TABLE):
        lines.append(f"INSERT INTO {table} (name, fence) VALUES ({literal(params['name'])}, 0)")
    calls = []
    for label, sql in (("a", acquire), ("r", release)):
        statement, order = prepare(label, sql)
        lines.append(statement)
        calls.append((label, order))
    for i in range(pairs):
        params["owner"] = f"owner-{i:026d}"
        for label, order in calls:
            lines.append(f"EXECUTE {label}({', '.join(literal(params[p]) for p in order)})")
    return "\n".join(lines) + "\n"


#: PostgreSQL refuses to run as root.
AS_USER = "postgres" if os.geteuid() == 0 else None


def instructions(acquire: str, release: str, pairs: int, workdir: Path) -> int:
    """Server instructions for ``pairs`` pairs, in a fresh cluster."""
    data = workdir / f"data-{pairs}"
    subprocess.run(
        [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--no-sync"],
        capture_output=True,
        check=True,
        user=AS_USER,
        cwd=workdir,
    )
    out = workdir / f"callgrind-{pairs}.out"
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        str(PG_BIN / "postgres"),
        "--single",
        "-D",
        str(data),
    ]
    # As the test servers run (no disk flushes), and no autovacuum to count.
    for setting in SETTINGS:
        command += ["-c", setting]
    command.append("postgres")
    result = subprocess.run(
        command,
        input=script(acquire, release, pairs),
        capture_output=True,
        text=True,
        user=AS_USER,
        check=True,
    )
    if "ERROR" in result.stdout + result.stderr:
        raise RuntimeError(f"the statements failed:\n{result.stdout}{result.stderr}")
    totals = re.search(r"^summary: (\d+)", out.read_text(), re.MULTILINE)
    assert totals is not None
    shutil.rmtree(data)
    return int(totals[1])


def measure(pairs: int, report: Callable[[str, float, float], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="dlock-instructions-") as tmp:
        workdir = Path(tmp)
        if AS_USER is not None:
            shutil.chown(workdir, AS_USER)
        baseline = 0.0
        for label, (acquire, release) in variants().items():
            counted = instructions(acquire, release, BASE_PAIRS + pairs, workdir)
            base = instructions(acquire, release, BASE_PAIRS, workdir)
            per_pair = (counted - base) / pairs
            if label in BASELINES:
                baseline = per_pair
            report(label, per_pair, per_pair / baseline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    print("| PostgreSQL server, per acquire + release | instructions | vs its mode's raw |")
    print("|---|---|---|")
    measure(
        args.pairs,
        lambda label, n, ratio: print(f"| {label} | {n / 1000:.1f} k | {ratio:.2f}x |", flush=True),
    )


if __name__ == "__main__":
    main()
