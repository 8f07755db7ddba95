"""Face-neutral helpers for the conformance tests: worker processes and their output."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
#: The environment of a worker process: this checkout's ``dlock`` and ``tests``, even
#: where the virtualenv's editable install points at another checkout (a worktree).
WORKER_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def run_main(result: Any) -> None:
    """Run a worker's ``main``: a coroutine under asyncio, already done for the sync face."""
    if inspect.iscoroutine(result):
        asyncio.run(result)


def start_worker(face: str, *args: str) -> subprocess.Popen[str]:
    """Start ``tests/conformance/<face>/worker.py`` as a separate OS process."""
    return subprocess.Popen(
        [sys.executable, "-m", f"tests.conformance.{face}.worker", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=WORKER_ENV,
    )


def read_line(process: subprocess.Popen[str], timeout: float = 30.0) -> str:
    """The worker's next line of output; fails the test rather than hang."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(process.stdout.fileno(), False)
    buffer = ""
    while time.monotonic() < deadline:
        chunk = process.stdout.readline()
        buffer += chunk
        if buffer.endswith("\n"):
            return buffer.strip()
        if process.poll() is not None and not chunk:
            raise AssertionError(f"worker exited with {process.returncode} before answering")
        time.sleep(0.005)
    raise AssertionError(f"worker did not answer within {timeout} s (got {buffer!r})")


def ask(process: subprocess.Popen[str], command: str) -> str:
    assert process.stdin is not None
    process.stdin.write(command + "\n")
    process.stdin.flush()
    return read_line(process)


def finish(process: subprocess.Popen[str]) -> None:
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


def load_records(paths: list[Path]) -> list[tuple[int, float, float]]:
    records: list[tuple[int, float, float]] = []
    for path in paths:
        records.extend(tuple(entry) for entry in json.loads(path.read_text()))
    return sorted(records, key=lambda record: record[1])
