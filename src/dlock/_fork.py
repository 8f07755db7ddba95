"""Which process this is, kept current across ``os.fork()`` without a system call.

What one process keeps (pooled connections, a renewer thread, acquires in flight, the
locks a client holds) is copied into a child by ``os.fork()`` but is not the child's.
Whatever keeps such state notes the ``generation`` it was made in and starts over where
the generation differs: a process's generation changes only as it is born, so a child's
always differs from what it inherited. One counter serves every piece, and comparing it
is cheaper than ``os.getpid()`` (a system call) on every acquire and release.
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
    global generation, pid
    generation += 1
    pid = os.getpid()
    for follower in _followers:
        # Taken by a thread of the parent that is not here to let it go.
        follower._lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # Windows cannot fork
    os.register_at_fork(after_in_child=_forked)
