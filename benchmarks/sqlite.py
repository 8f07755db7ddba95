"""SQLite: dlock's acquire+release against the bare insert and delete, and contention.

    python -m benchmarks.sqlite [--iterations N] [--processes P] [--sections S]

The raw baseline is what a hand-written lock table does at the least: an INSERT to take
the lock and a DELETE to give it back, each its own transaction, on a database opened
with the same settings as dlock's (WAL, synchronous=FULL).
"""

from __future__ import annotations

import argparse
import secrets
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Latency,
    dlock_ops,
    measure_contention,
    measure_latencies,
    open_dlock,
    print_table,
)

RAW = "raw INSERT + DELETE"


def uncontended(tmp: str, url: str, iterations: int) -> dict[str, Latency]:
    conn = sqlite3.connect(Path(tmp, "raw.sqlite3"), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE raw_locks (name TEXT PRIMARY KEY, owner TEXT, expires REAL)")
    owner = secrets.token_hex(16)

    def raw_insert_delete() -> None:
        conn.execute(
            "INSERT INTO raw_locks (name, owner, expires) VALUES (?, ?, ?)", ("bench", owner, 1.0)
        )
        conn.execute("DELETE FROM raw_locks WHERE name = ? AND owner = ?", ("bench", owner))

    try:
        with dlock_ops(url) as ops:
            return measure_latencies({RAW: raw_insert_delete, **ops}, iterations)
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--sections", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlock-bench-") as tmp:
        url = f"sqlite://{tmp}/dlock.sqlite3"
        latencies = uncontended(tmp, url, args.iterations)
        rows: list[tuple[str, Latency | None, Any]] = [
            (label, latency, None) for label, latency in latencies.items()
        ]
        contention = measure_contention(open_dlock, url, args.processes, args.sections)
        rows.append((f"dlock, {args.processes} processes", None, contention))
        print_table("SQLite: uncontended acquire+release; contention on one name", rows, RAW)


if __name__ == "__main__":
    main()
