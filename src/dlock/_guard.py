"""Run by ``dlock run`` beside its command: if dlock dies (SIGKILL, a crash) before it
has ended the command, end the command's process group, which nothing would stop
otherwise, and which the lock stops covering once its lease runs out.

A script, not a module of the package: ``python -I -S _guard.py PGID GRACE`` imports
nothing of dlock's and starts in milliseconds. Its standard input is a pipe that only
dlock writes: ``done`` once the job is over, and end of file alone if dlock died.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> None:
    pgid, grace = int(sys.argv[1]), float(sys.argv[2])
    told = b""
    while chunk := os.read(0, 64):
        told += chunk
    if told == b"done":
        return
    # As dlock itself stops the group when its lease is lost: TERM (and CONT, for a
    # stopped process to act on it), then KILL after the grace period.
    for signum in (signal.SIGTERM, signal.SIGCONT):
        if not _signal(pgid, signum):
            return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _signal(pgid, 0):
            return
        time.sleep(0.05)
    _signal(pgid, signal.SIGKILL)


def _signal(pgid: int, signum: int) -> bool:
    """False once the group is gone."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a setuid member: not ours to signal
    return True


if __name__ == "__main__":
    main()
