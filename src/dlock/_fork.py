"""Which process this is, kept current across ``os.fork()``.

What one process keeps (pooled connections, a renewer thread, acquires in flight, the
locks a client holds) is copied into a child by ``os.fork()`` but is not the child's.
Whatever keeps such state notes the ``generation`` it was made in and starts over where
the generation differs: a process's generation changes only as it is born, so a child's
always differs from what it inherited. One counter serves every piece.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

#: Forks in this process's line so far: a child's is its parent's plus one.
generation = 0
#: This process's id.
pid = os.getpid()
#: Taken to start a lock object's state over in a child (see AsyncLock._check_forked),
#: and to notice a fork in ``current``; replaced in a child, like ForkFollower's.
guard = threading.Lock()


def current() -> int:
    """This process's generation. Most forks run the at-fork hook below; one that does
    not (uWSGI forks its workers from C without Python's hooks, by default) is noticed
    here, by the pid: a system call, made once per call of the public API (acquire,
    release, inspect, ...), after which the state below it compares ``generation``."""
    if os.getpid() != pid:
        with guard:
            if os.getpid() != pid:
                _forked()
    return generation


class ForkFollower:
    """Calls ``start_over`` once in a forked child, as the first thread there to use the
    state calls this; the child's other threads wait until it is done."""

    def __init__(self, start_over: Callable[[], None]) -> None:
        self._start_over = start_over
        self._generation = generation
        self._lock = threading.Lock()
        _followers.add(self)

    def __call__(self) -> None:
        if self._generation != generation:
            with self._lock:
                if self._generation != generation:
                    self._start_over()
                    # Last: another thread of the child must not go on before this.
                    self._generation = generation


_followers: weakref.WeakSet[ForkFollower] = weakref.WeakSet()


def _forked() -> None:
    global generation, pid, guard
    generation += 1
    pid = os.getpid()
    guard = threading.Lock()
    for follower in _followers:
        # Taken by a thread of the parent that is not here to let it go.
        follower._lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # Windows cannot fork
    os.register_at_fork(after_in_child=_forked)
