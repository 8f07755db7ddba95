"""SQLite connections across ``os.fork()``, for the backends of both faces at once.

SQLite keeps its record of a file's locks per process, shared by every connection to
the file, whichever face opened it: the fork hooks here close the connections of all
SQLite backends of the process, and one refusal stops them all. Hand-written, and
registered once (the sync face is generated from the asyncio one, whose own hooks
would be registered twice, each face's seeing only its own backends).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from . import _fork
from ._errors import BackendError


class SQLiteUser(Protocol):
    """A SQLite backend, as the fork hooks see it."""

    #: Open, or None until first use (and after a fork).
    _connection: sqlite3.Connection | None
    #: Held while the connection is in use.
    _mutex: threading.Lock
    #: The thread that holds ``_mutex``.
    _user: int | None


@dataclass
class _Fork:
    """What one fork's before-fork hook took, for its after-fork hooks to let go of."""

    #: Backends whose mutex it holds, their connections closed.
    closed: list[SQLiteUser] = field(default_factory=list)
    #: The forking thread was running a statement, its connection left open.
    mid_statement: bool = False


#: Every SQLite backend of this process, of both faces: closed before a fork.
_backends: weakref.WeakSet[SQLiteUser] = weakref.WeakSet()
#: Guards ``_backends``; held across a fork, with every backend's mutex. Reentrant: a
#: signal handler may fork while its thread holds it (in the before-fork hook itself).
_backends_guard = threading.RLock()
#: Per fork under way (innermost last: a signal handler may fork within a fork).
_forks_under_way: list[_Fork] = []
#: Why this process must not use SQLite at all (see _after_fork_in_child, check_process).
refusal: str | None = None
#: The process generation (dlock._fork) whose fork hooks ran, or this process's own.
_hooked_generation = _fork.generation

MID_STATEMENT = (
    "SQLite: this process was forked by a signal handler that had interrupted a SQLite"
    " statement of the forking thread, whose connection could not be closed before the"
    " fork; SQLite's file locks are not inherited, so this process would hold none, on"
    " that connection or any other it opens, and write where other processes do not look."
    " It refuses SQLite; end it with os._exit(), or use the file from a process it execs"
)
FORKED_WITHOUT_HOOKS = (
    "SQLite: this process was forked without Python's at-fork hooks (uWSGI forks its"
    " workers so by default: run it with --py-call-osafterfork or --lazy-apps) while its"
    " parent had a SQLite connection open (or being opened); SQLite's file locks are not"
    " inherited, so this process would hold none, and write where other processes do not"
    " look. It refuses SQLite"
)


def register(backend: SQLiteUser) -> None:
    """Have ``backend``'s connection closed before every fork of this process."""
    with _backends_guard:
        _backends.add(backend)


def _before_fork() -> None:
    """Close every connection of this process's backends before it forks, and let none
    open or run a statement until the fork is done; each side opens anew on first use.

    A child cannot go on with, nor drop, a connection it inherits: fcntl locks are not
    inherited, but SQLite's record of them is (kept per process for each file, shared
    by its connections). On the parent's connection, or on one of the child's own
    opened while the inherited record says the file is locked already, the child holds
    no lock at all, so the parent's close, holding the only ones, checkpoints and
    deletes the WAL the child goes on writing to, where no other process looks: two
    holders of one lock, with one fencing token. Closed before the fork, the record is
    gone. A statement in flight on another thread ends first (within about
    ``busy_timeout``): the child would get its mutex held by a thread that is not there.

    One that the forking thread itself is running (a signal handler forks in its middle)
    cannot end first: waiting would be for ever. Its connection stays open, and the
    child refuses SQLite. A fork within this hook (a signal handler again) skips what
    the outer one holds, closed already. A process that refuses SQLite (one forked
    without hooks from a parent using it) touches nothing: the connections are the
    parent's, whose WAL their close could delete, and a mutex may be held by a thread
    that is not here; its children refuse too.
    """
    me = threading.get_ident()
    _backends_guard.acquire()
    taken = _Fork()
    _forks_under_way.append(taken)
    _fork.current()  # no public call may have noticed a fork made without hooks yet
    if refusal_now() is not None:
        return
    for backend in list(_backends):
        if backend._user == me:
            if backend._connection is not None:
                taken.mid_statement = True
            continue
        backend._mutex.acquire()
        backend._user = me
        taken.closed.append(backend)
        connection, backend._connection = backend._connection, None
        if connection is not None:
            with contextlib.suppress(sqlite3.Error):
                connection.close()


def _after_fork() -> None:
    """In the parent (and in the child: the thread that forked is there)."""
    taken = _forks_under_way.pop()
    for backend in reversed(taken.closed):
        backend._user = None
        backend._mutex.release()
    _backends_guard.release()


def _after_fork_in_child() -> None:
    global refusal, _hooked_generation
    if _forks_under_way[-1].mid_statement:
        refusal = MID_STATEMENT
    _hooked_generation = _fork.generation
    _after_fork()


def check_process() -> None:
    """Refuse SQLite in a process that must not use it. A fork that ran no Python hooks
    closed nothing first: if the parent had a connection open, or a thread of the parent
    was using a backend (opening its connection, say: its mutex came along held by a
    thread the child does not have, and the child's first statement would wait for it
    for ever), the child refuses.

    Runs per transaction, so it reads the generation rather than the pid (a system
    call): the public call that led here has brought it up to date (dlock._fork.current),
    a hookless fork included, and such a fork shows as a generation whose hooks did not
    run, as only _after_fork_in_child moves ``_hooked_generation`` on to a new one."""
    reason = refusal_now()
    if reason is not None:
        raise BackendError(reason)


def refusal_now() -> str | None:
    """Why this process must not use SQLite, if it must not (see check_process)."""
    global refusal, _hooked_generation
    if _fork.generation != _hooked_generation:
        with _backends_guard:
            if _fork.generation != _hooked_generation:
                if any(_in_use(backend) for backend in list(_backends)):
                    refusal = FORKED_WITHOUT_HOOKS
                _hooked_generation = _fork.generation
    return refusal


def _in_use(backend: SQLiteUser) -> bool:
    """Whether the parent had left ``backend`` in use: checked once, in a child forked
    without hooks, before any of its own threads can take the mutex."""
    return backend._connection is not None or backend._mutex.locked()


if hasattr(os, "register_at_fork"):  # Windows cannot fork
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork_in_child
    )
