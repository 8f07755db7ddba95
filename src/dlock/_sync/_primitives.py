"""Threaded twin of ``dlock._async._primitives``: written by hand, not generated."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

from .. import _fork

T = TypeVar("T")
P = ParamSpec("P")

IS_ASYNC = False


class WakeupEvent:
    """Twin of the asyncio WakeupEvent; a threading.Event already works across threads."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout: float | None) -> bool:
        # A timeout is any number of seconds; a thread's wait overflows past this one.
        if timeout is not None and timeout > threading.TIMEOUT_MAX:
            timeout = threading.TIMEOUT_MAX
        return self._event.wait(timeout)


class Cancelled(BaseException):
    """Never raised: threads cannot be cancelled, so the sync face only reports a loss."""


def notices_fork(method: Callable[P, T]) -> Callable[P, T]:
    """Makes ``method`` a public call, which notices a fork made without Python's hooks
    (see ``_fork.current``) before the state it reaches compares generations."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        _fork.current()
        return method(*args, **kwargs)

    return call


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def run_blocking(func: Callable[..., T], *args: Any) -> T:
    return func(*args)


def run_blocking_in_order(cut_off: set[Any], func: Callable[..., T], *args: Any) -> T:
    """Twin of the asyncio one: a call here ends before the next begins."""
    return func(*args)


#: Mutual exclusion between the operations of one backend (caller, renewer, reaper).
Mutex = threading.Lock


def acquire_within(mutex: threading.Lock, timeout: float) -> bool:
    return mutex.acquire(timeout=timeout)


def wait_result(result: Any, timeout: float) -> Any:
    """Twin of the asyncio wait_result: block on the result's own ``get``."""
    return result.get(timeout=timeout)


def shielded(value: T, abandoned: Callable[[T], object] | None = None) -> T:
    # The call has already run to its end: a thread cannot be cancelled.
    return value


def concurrently(calls: Sequence[Callable[[], T]], timeout: float) -> list[T | Exception | None]:
    """Twin of the asyncio ``concurrently``: each call in a thread of its own, waited for
    at most ``timeout``. A call not over by then gives None, and goes on in its thread
    (a thread cannot be cancelled) until its library's own timeouts end it; its result
    is not read."""
    results: list[T | Exception | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [spawn(functools.partial(run, i), name="dlock-call") for i in range(len(calls))]
    deadline = time.monotonic() + min(timeout, threading.TIMEOUT_MAX)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    # A thread that has ended set its result before; one still running gives None.
    return [None if thread.is_alive() else results[i] for i, thread in enumerate(threads)]


def call_with_timeout(value: T, timeout: float) -> T:
    # The call has already run by the time we get here; its library's timeouts bound it.
    return value


@contextlib.contextmanager
def alarm(delay: float, ring: Callable[[], float | None]) -> Iterator[Callable[[], None]]:
    """Call ``ring`` after ``delay`` seconds, and again after each delay it returns
    (None: once rung again), while the block runs: what a blocking call cannot do while
    it waits. Yields what has ``ring`` called again at once (from any thread). A thread
    per use: the renewer uses it once per renewal round trip. The caller keeps the
    delays short enough for a thread's wait (``renewal.LONGEST_SLEEP``)."""
    done, wake = threading.Event(), threading.Event()

    def watch() -> None:
        wait: float | None = delay
        while True:
            wake.wait(None if wait is None else max(wait, 0.0))
            if done.is_set():
                return
            wake.clear()
            if done.is_set():  # set, and its wake-up cleared, just now
                return
            wait = ring()

    spawn(watch, name="dlock-renewal-alarm")
    try:
        yield wake.set
    finally:
        done.set()
        wake.set()


def spawn(func: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=func, name=name, daemon=True)
    thread.start()
    return thread


def run_detached(func: Callable[[], Any], keep: set[Any], name: str) -> None:
    """Twin of the asyncio one: a thread runs to its end without a reference kept."""
    threading.Thread(target=func, name=name, daemon=True).start()


def join(thread: threading.Thread | None, timeout: float) -> None:
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def wait_done(thread: threading.Thread) -> None:
    thread.join()


def serving(thread: threading.Thread | None) -> bool:
    """True while ``thread`` runs (a thread that died, or was left in the parent of a
    fork, does not)."""
    return thread is not None and thread.is_alive()


def current_task() -> Any:
    return None


def can_spawn() -> bool:
    """True where spawn() can start a thread: anywhere."""
    return True


def cancel_requests() -> int:
    return 0


def cancels_of(task: Any) -> int:
    return 0


def lost_cancel(cause: BaseException | None = None) -> None:
    """Never called: threads are not cancelled, so ``cancel_requests`` stays 0."""
    return None


def cancel_task(task: Any, message: str) -> None:
    return None


def uncancel(task: Any) -> None:
    return None
