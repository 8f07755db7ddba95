"""The few operations whose asyncio and threaded forms differ in shape.

Everything else under ``_async/`` is turned into ``_sync/`` by ``scripts/unasync.py``;
this module is written by hand, once per face, and the generated code calls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

from .. import _fork

T = TypeVar("T")
P = ParamSpec("P")

IS_ASYNC = True
Cancelled = asyncio.CancelledError


class WakeupEvent:
    """An event that a waiting task awaits and that any thread may set."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        # Known from the start when made in the loop, so a set() from another thread
        # before the first wait() is handed to the loop too (asyncio.Event is not
        # thread-safe).
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    def set(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is None or running is self._loop or self._loop.is_closed():
            self._event.set()
        else:
            self._loop.call_soon_threadsafe(self._event.set)

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, timeout: float | None) -> bool:
        """Wait until set or the timeout passes; True if it was set."""
        self._loop = asyncio.get_running_loop()
        return await _wait_event(self._event, timeout)


def notices_fork(method: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Makes ``method`` a public call, which notices a fork made without Python's hooks
    (see ``_fork.current``) before the state it reaches compares generations."""

    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        _fork.current()
        return await method(*args, **kwargs)

    return call


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def _wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until the event is set or the timeout passes; True if it was set."""
    if event.is_set():
        return True
    try:
        await _bounded(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def _bounded(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``wait_for`` without its helper task where asyncio.timeout exists (3.11+).

    A task per bounded call costs time on every backend round trip, and makes the
    tasks alive at any moment depend on whether a renewal happens to be in flight.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)


async def run_blocking(func: Callable[..., T], *args: Any) -> T:
    """Run a blocking call (SQLite, a synchronous client library) off the event loop."""
    return await asyncio.to_thread(func, *args)


async def run_blocking_in_order(cut_off: set[Any], func: Callable[..., T], *args: Any) -> T:
    """As run_blocking, once the calls in ``cut_off`` have ended: calls whose caller
    was cancelled while their thread ran on. One made after them must not overtake
    them (a give-back of what an acquire cut off may take, run before that acquire's
    thread commits, releases nothing). Cancelled, this call joins ``cut_off``."""
    loop = asyncio.get_running_loop()
    earlier = [call for call in cut_off if call.get_loop() is loop and not call.done()]
    if earlier:
        await asyncio.wait(earlier)
    call = loop.run_in_executor(
        None, functools.partial(contextvars.copy_context().run, func, *args)
    )
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        if not call.done():
            cut_off.add(call)
            call.add_done_callback(cut_off.discard)
            call.add_done_callback(_retrieve)
        raise


#: Mutual exclusion between the operations of one backend (they all run in the loop).
Mutex = asyncio.Lock


async def acquire_within(mutex: asyncio.Lock, timeout: float) -> bool:
    """Take ``mutex`` if it comes free within ``timeout``; False (not taken) if not."""
    try:
        await _bounded(mutex.acquire(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def wait_result(result: Any, timeout: float) -> Any:
    """The value of a result that another thread sets (kazoo's: ``ready``, ``rawlink``,
    ``unlink``, ``get``), waiting at most ``timeout``, then as its own ``get`` would:
    its value, its error, or its library's timeout error.

    The loop is woken by the result's callback: one cross-thread wake-up per result,
    where a worker thread blocked on ``get`` costs two more (to the worker and back).
    """
    if not result.ready():
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake(_: Any) -> None:
            loop.call_soon_threadsafe(_settle, done)

        result.rawlink(wake)
        try:
            await _bounded(done, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            result.unlink(wake)
    return result.get(block=False)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def shielded(
    awaitable: Awaitable[T], abandoned: Callable[[T], Awaitable[object]] | None = None
) -> T:
    """Run ``awaitable`` to its end even if the caller is cancelled meanwhile (the
    caller still sees the cancellation), as a call in a worker thread would run on:
    for clean-up that must not be cut short by a second cancellation, and for requests
    that a client library cannot have cut off (httpx's pool kept a connection whose
    request was cancelled while it was being made). ``abandoned`` is given the result
    that the cancelled caller will not use (a response to close)."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        done = _retrieve if abandoned is None else functools.partial(_dispose, abandoned)
        task.add_done_callback(done)
        raise


def run_detached(func: Callable[[], Awaitable[Any]], keep: set[Any], name: str) -> None:
    """Run ``func()`` to its end in the background: a clean-up that a cancelled caller
    must not wait for (its whole timeout, on a server that does not answer), kept in
    ``keep`` until then, as asyncio keeps only weak references to its tasks."""

    async def run() -> None:
        try:
            await func()
        finally:
            keep.discard(task)

    task = asyncio.get_running_loop().create_task(run(), name=name)
    keep.add(task)


#: Disposals of abandoned results under way (asyncio keeps only weak references).
_disposals: set[asyncio.Task[Any]] = set()


def _dispose(abandoned: Callable[[T], Awaitable[object]], task: asyncio.Future[T]) -> None:
    if task.cancelled() or task.exception() is not None:
        return

    async def dispose() -> None:
        await abandoned(task.result())

    disposal = task.get_loop().create_task(dispose(), name="dlock-dispose")
    _disposals.add(disposal)
    disposal.add_done_callback(_disposals.discard)
    disposal.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark the outcome of an abandoned operation as seen (no warning at exit)."""
    if not task.cancelled():
        task.exception()


async def concurrently(
    calls: Sequence[Callable[[], Awaitable[T]]], timeout: float
) -> list[T | Exception | None]:
    """Run ``calls`` at once, each in a task, and wait for them at most ``timeout``: in
    order, the result of each, the Exception it raised, or None if it had not ended by
    then (it is cancelled). Cancelling the caller cancels them all."""

    async def one(call: Callable[[], Awaitable[T]]) -> T | Exception | None:
        try:
            return await _bounded(call(), timeout)
        except asyncio.TimeoutError:  # a distinct class before Python 3.11
            return None
        except Exception as exc:
            return exc

    return list(await asyncio.gather(*(one(call) for call in calls)))


async def call_with_timeout(awaitable: Awaitable[T], timeout: float) -> T:
    """Bound a backend call; the sync twin relies on the client library's own timeouts."""
    try:
        return await _bounded(awaitable, timeout)
    except asyncio.TimeoutError:  # a distinct class before Python 3.11
        raise TimeoutError(f"no answer within {timeout:.3f} s") from None


@contextlib.contextmanager
def alarm(delay: float, ring: Callable[[], float | None]) -> Iterator[Callable[[], None]]:
    """Twin of the threaded alarm, on the loop's timers (no task): ``call_with_timeout``
    bounds the call only by its own leases, and the alarm also watches the others.
    Yields what has ``ring`` called again soon (from the loop's thread)."""
    loop = asyncio.get_running_loop()
    timer: asyncio.Handle | None = None

    def fire() -> None:
        nonlocal timer
        wait = ring()
        timer = None if wait is None else loop.call_later(max(wait, 0.0), fire)

    def ring_soon() -> None:
        nonlocal timer
        if timer is not None:
            timer.cancel()
        timer = loop.call_soon(fire)

    timer = loop.call_later(max(delay, 0.0), fire)
    try:
        yield ring_soon
    finally:
        if timer is not None:
            timer.cancel()


def spawn(func: Callable[[], Awaitable[None]], name: str) -> asyncio.Task[None]:
    async def run() -> None:
        await func()

    return asyncio.get_running_loop().create_task(run(), name=name)


async def join(task: asyncio.Task[None] | None, timeout: float) -> None:
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait([task], timeout=timeout)


async def wait_done(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` to end, without cancelling it (nor it with the caller). A task
    of another event loop (a client used by two ``asyncio.run`` calls) will not run
    again: waiting on it would ask its closed loop to call back, which raises."""
    if serving(task):
        await asyncio.wait([task])


def serving(task: asyncio.Task[None] | None) -> bool:
    """True while ``task`` runs in the running loop: a task of a loop that has been
    closed or left (a client used by two ``asyncio.run`` calls) will not run again."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return task is not None and not task.done() and task.get_loop() is loop


def current_task() -> asyncio.Task[Any] | None:
    return asyncio.current_task()


def can_spawn() -> bool:
    """True where spawn() can start a task: inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def cancel_requests() -> int:
    """How many cancellations of the running task are pending: what ``lost_cancel``
    compares against (0 before Python 3.11, which does not count them)."""
    return cancels_of(asyncio.current_task())


def cancels_of(task: asyncio.Task[Any] | None) -> int:
    """``cancel_requests()`` of a task looked up once (``current_task()``)."""
    if task is None or sys.version_info < (3, 11):
        return 0
    return task.cancelling()


async def lost_cancel(cause: BaseException | None = None) -> None:
    """Raise the cancellation requested during a call that returned normally, or that
    failed: ``cause``, its error, chained to the cancellation raised in its place.

    If it is still on its way, the checkpoint delivers it. Else a client library lost
    it: before Python 3.12, ``asyncio.wait_for`` (redis-py sends every command under
    one) returns its inner task's result when a cancellation races that task's end, and
    ``asyncio.timeout`` or a TaskGroup would then never stop the caller.
    """
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError as delivered:
        if cause is None:
            raise
        raise delivered from cause
    if cause is None:
        raise asyncio.CancelledError
    raise asyncio.CancelledError from cause


def cancel_task(task: asyncio.Task[Any], message: str) -> None:
    task.cancel(message)


def uncancel(task: asyncio.Task[Any] | None) -> None:
    """Undo our own cancel() so asyncio.timeout() and TaskGroup see a normal exception."""
    if task is not None and sys.version_info >= (3, 11):
        task.uncancel()
