"""What only the SQLite backend has: a database file that its first users create."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from tests.conformance.helpers import ROOT

# Imports first, then waits for the start signal, so that every process opens the file
# within the same few milliseconds.
OPEN_AND_LOCK = """
import os, sys, time
import dlock
client = dlock.connect("sqlite:///" + sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.0005)
lock = client.lock("first", ttl=5)
assert lock.acquire(timeout=10)
lock.release()
"""


def test_processes_that_create_the_file_at_once_all_get_the_lock(tmp_path: Path) -> None:
    # Switching a new file to WAL is refused at once ("database is locked") to a process
    # racing another one doing it; before the retry, about one trial in three lost one.
    for trial in range(5):
        database, start = tmp_path / f"{trial}.sqlite3", tmp_path / f"start-{trial}"
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN_AND_LOCK, str(database), str(start)],
                cwd=ROOT,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(8)
        ]
        time.sleep(0.5)
        start.touch()
        # Every process is waited for before judging, so none is left running.
        outcomes = [(process.communicate(timeout=60)[1], process) for process in processes]
        for errors, process in outcomes:
            assert process.returncode == 0, errors[-500:]
        with sqlite3.connect(database) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
