"""Run by ``dlock run`` beside its command: if dlock dies (SIGKILL, a crash) before it
has ended the command, end the command's process group, which nothing would stop
otherwise, and which the lock stops covering once its lease runs out.

A script, not a module of the package: ``python -I -S _guard.py GRACE RUN_ID SESSION`` imports
nothing of dlock's and starts in milliseconds. Its standard input is a pipe that only
dlock writes, a line at a time (see ``_job.Guard``): the command's group id, ``stopping``
once dlock has sent the group TERM, ``done`` once the group is gone. Its end without
``done`` means dlock died, or left the group running. If dlock died before it could
write the group's id (just after starting the command), the group is found by the
``DLOCK_RUN_ID`` in its processes' environment, among those of dlock's session
(``SESSION``), where the command's group always is.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> None:
    grace, run_id, session = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    pgid: int | None = None
    stopping_at: float | None = None
    with os.fdopen(0, "rb") as told:
        for line in told:
            word = line.strip()
            if word == b"done":
                return
            if word == b"stopping":
                stopping_at = time.monotonic()
            elif word.isdigit():
                pgid = int(word)
    if pgid is None:
        pgid = _group_of(f"DLOCK_RUN_ID={run_id}".encode(), session)
        if pgid is None:
            return
    if stopping_at is None:
        # As dlock stops the group when its lease is lost: TERM (and CONT, for a
        # stopped process to act on it), then KILL after the grace period. If dlock
        # sent TERM itself, no second one (some programs take it for "quit now"), and
        # the grace period runs from dlock's.
        for signum in (signal.SIGTERM, signal.SIGCONT):
            if not _signal(pgid, signum):
                return
        stopping_at = time.monotonic()
    while time.monotonic() < stopping_at + grace:
        if not _signal(pgid, 0):
            return
        time.sleep(0.05)
    _signal(pgid, signal.SIGKILL)


def _group_of(variable: bytes, session: int) -> int | None:
    """The process group of a process of ``session`` whose environment holds
    ``variable``, if any. Processes of other sessions inherit it too: a nested ``dlock
    run``'s own guard (a session of its own, its environment the outer command's), a
    daemon the command started with setsid. /proc lists by pid, and pids wrap around:
    one of those, listed first, had its group ended instead of the command's, which
    ran on unguarded."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != session:
                continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if variable in environ.read().split(b"\0"):
                    return os.getpgid(pid)
        except OSError:
            continue
    return None


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
