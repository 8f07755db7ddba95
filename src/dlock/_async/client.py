"""The client: one backend connection, one renewer, and the locks made from them."""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any

from .. import _fork
from .._backoff import Backoff
from .._errors import BackendError, InvalidArgument
from .._fork import ForkFollower
from .._registry import default_url, load_backend
from .._types import Holder, LockInfo
from .._validation import (
    DEFAULT_PRUNE_AGE,
    check_batch,
    check_label,
    check_name,
    check_prefix,
    check_prune_age,
    check_timeout,
    check_ttl,
)
from ._primitives import WakeupEvent, notices_fork, serving, wait_done
from .backend import AsyncBackend
from .giveback import AsyncGiveBackRetrier, give_back_all
from .lock import _ACQUIRE_CALL, AsyncLock
from .renewal import AsyncRenewer

DEFAULT_TTL = 30.0
#: Longest that close() waits for acquires in flight to end (see aclose).
CLOSE_WAIT = 5.0

#: The clock a holder measures its lease by. On Linux, the boot clock: like
#: ``time.monotonic`` it never steps, and unlike it, it keeps counting while the host is
#: suspended, as the backend's clock does; so a holder that wakes from a suspend sees at
#: once that its lease ran out, not at its next renewal.
lease_clock: Callable[[], float] = (
    partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME")
    else time.monotonic
)


def connect(
    url: str | None = None,
    *,
    label: str | None = None,
    backoff: Backoff | None = None,
    **options: Any,
) -> AsyncClient:
    """Make a client for ``url`` (default: ``$DLOCK_URL``, else the embedded SQLite file).

    No I/O happens here; the backend connects on first use, and an unreachable one
    raises :class:`dlock.BackendError` from that first operation.
    """
    backend = load_backend("dlock._async", default_url() if url is None else url, options)
    return AsyncClient(backend, label=label, backoff=backoff)


class AsyncClient:
    def __init__(
        self,
        backend: AsyncBackend,
        *,
        label: str | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        if backoff is not None and not isinstance(backoff, Backoff):
            raise InvalidArgument(
                f"backoff must be a dlock.Backoff or None, not {type(backoff).__name__}"
            )
        self._backend = backend
        self._label = check_label(label)
        self._holder_now = Holder.current(self._label)
        self._closed = False
        #: Set by close() once it no longer lets releases in flight end first: a release
        #: begun since leaves its hold to the close (see AsyncLock.release).
        self._closing_holds = False
        self._backoff = Backoff() if backoff is None else backoff
        self._clock = lease_clock
        self._renewer = AsyncRenewer(backend, lease_clock, self._still_held)
        self._renewer.told_of_losses = backend.watch_leases(self._renewer.renew_now)
        #: Acquire and release calls in flight, each with its pid (after a fork, the
        #: parent's are not the child's to wait for), or 0 while it waits for a release.
        self._acquiring: dict[object, int] = {}
        #: What close() calls (more than one, from threads or tasks) wait on: each is set
        #: when one of those acquires ends or parks.
        self._acquires_settling: set[WakeupEvent] = set()
        #: Give-backs of acquire attempts cut off in flight, running in the background.
        self._give_backs: list[Any] = []
        #: Give-backs that got no answer, asked again until one does.
        self._retrier = AsyncGiveBackRetrier(lease_clock)
        #: Every lock of this client holding a lease, renewed or not: close() gives them
        #: back. Weakly: an unrenewed lock dropped while held ends by its TTL, and the
        #: client must not keep it alive until it closes. After a fork, those held so
        #: far are the parent's: a child's close must not free them.
        self._held: weakref.WeakSet[AsyncLock] = weakref.WeakSet()
        self._held_guard = threading.Lock()
        #: Lost holds being given up (see AsyncLock._give_up_lost), each with the entries
        #: yet to give back and its owner token; under _held_guard. close() gives them
        #: back itself before the backend closes (its on_lost may be what closes the
        #: client), and the give-up then leaves the backend alone: afterwards it could
        #: only reopen it. None once close() has taken them.
        self._giving_up: dict[AsyncLock, tuple[int, str]] | None = {}
        self._follow_fork = ForkFollower(self._forget_parent)

    @property
    def _holder(self) -> Holder:
        """Who acquires: after a fork, the child, not the parent that made the client."""
        if self._holder_now.pid != _fork.pid:
            self._holder_now = Holder.current(self._label)
        return self._holder_now

    def lock(
        self,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        reentrant: bool = False,
        auto_renew: bool = True,
        on_lost: Callable[[AsyncLock], Any] | None = None,
        cancel_on_lost: bool = True,
    ) -> AsyncLock:
        """Make a lock object for ``name``; nothing is acquired yet.

        ``ttl`` is the lease in seconds; ``timeout`` is what ``with`` waits (None: forever).
        ``on_lost`` is called once if the lease is lost while held. ``cancel_on_lost``
        (asyncio only) cancels the task running the ``async with`` body at that moment.
        """
        if on_lost is not None and not callable(on_lost):
            raise InvalidArgument(f"on_lost must be callable, not {type(on_lost).__name__}")
        if inspect.iscoroutinefunction(on_lost):
            # It is called, not awaited: the coroutine it made never ran, and the loss
            # was told to nobody (a RuntimeWarning at most).
            raise InvalidArgument(
                "on_lost is called, not awaited: give a plain function, not a coroutine"
                " function (it may start a task of its own)"
            )
        flags = {"reentrant": reentrant, "auto_renew": auto_renew, "cancel_on_lost": cancel_on_lost}
        for flag, value in flags.items():
            # bool("no") is True: a string or number here is a mistake, not a choice.
            if not isinstance(value, bool):
                raise InvalidArgument(f"{flag} must be True or False, not {value!r}")
        return AsyncLock(
            self,
            check_name(name),
            ttl=check_ttl(ttl),
            timeout=check_timeout(timeout),
            reentrant=reentrant,
            auto_renew=auto_renew,
            on_lost=on_lost,
            cancel_on_lost=cancel_on_lost,
        )

    @notices_fork
    async def inspect(self, name: str) -> LockInfo | None:
        """Who holds ``name`` now, or None if nobody does."""
        self._refuse_if_closed()
        return await self._backend.inspect(check_name(name))

    def _refuse_if_closed(self) -> None:
        """A closed client answers nothing, on every backend: a backend would otherwise
        open its connection again (SQLite: the file), to be left open for good."""
        if self._closed:
            raise BackendError("the client is closed")

    @notices_fork
    async def list(self, prefix: str = "") -> list[LockInfo]:
        """Every held lock whose name starts with ``prefix``, sorted by name."""
        self._refuse_if_closed()
        return await self._backend.list(check_prefix(prefix))

    @notices_fork
    async def force_release(self, name: str) -> bool:
        """Free ``name`` whoever holds it (an operator's tool); True if it was held.

        The evicted holder finds out at its next renewal, release or extend.
        """
        self._refuse_if_closed()
        return await self._backend.force_release(check_name(name))

    @notices_fork
    async def prune(self, older_than: float = DEFAULT_PRUNE_AGE, *, batch: int = 1000) -> int:
        """Forget names nobody has held for ``older_than`` seconds (default a day, at
        least ten minutes); return how many. A maintenance job for SQL lock tables,
        where every name used keeps a row: per-entity names would grow it without end.
        Held locks are never touched, and a name used again gets larger fencing tokens.
        The other backends clean up by themselves (0).

        ``batch`` names go per transaction: a transaction holds what it deletes until
        it commits (SQLite: the whole database), and acquires of those names wait for
        it, so a table grown large is pruned in short steps.
        """
        older_than, batch = check_prune_age(older_than), check_batch(batch)
        self._refuse_if_closed()
        removed = 0
        while True:
            deleted = await self._backend.prune(older_than, batch)
            removed += deleted
            if deleted < batch:
                return removed

    def _forget_parent(self) -> None:
        """In a forked child: the locks held so far are its parent's to give back, and
        the guard may have been taken by a thread that stayed in the parent."""
        self._held, self._held_guard = weakref.WeakSet(), threading.Lock()
        self._giving_up = {}

    def _hold(self, lock: AsyncLock) -> None:
        self._follow_fork()
        with self._held_guard:
            self._held.add(lock)

    def _let_go(self, lock: AsyncLock) -> None:
        self._follow_fork()
        with self._held_guard:
            self._held.discard(lock)

    def _still_held(self) -> tuple[AsyncLock, ...]:
        self._follow_fork()
        with self._held_guard:
            return tuple(self._held)

    def _give_up(self, lock: AsyncLock, entries: int, token: str) -> bool:
        """``lock``'s lost hold of ``entries`` entries, under owner ``token``, is to be
        given back (_giving_up).
        False if there is nothing to, or another give-up of it (a user of the lock object
        in another thread or task) has it already: that one ends it (_given_up)."""
        self._follow_fork()
        with self._held_guard:
            if self._giving_up is None or not entries or lock in self._giving_up:
                return False
            self._giving_up[lock] = (entries, token)
            return True

    def _still_to_give_up(self, lock: AsyncLock, given: int = 0) -> int:
        """How many entries of ``lock``'s lost hold are still for its give-up to give
        back, ``given`` more having been: none once close() has taken them over."""
        self._follow_fork()
        with self._held_guard:
            giving_up = self._giving_up
            if giving_up is None or lock not in giving_up:
                return 0
            entries, token = giving_up[lock]
            left = entries - given
            if left > 0:
                giving_up[lock] = (left, token)
                return left
            del giving_up[lock]
            return 0

    def _given_up(self, lock: AsyncLock) -> None:
        """``lock``'s give-up ended: nothing of it is left for close() to give back."""
        self._follow_fork()
        with self._held_guard:
            if self._giving_up is not None:
                self._giving_up.pop(lock, None)

    def _call_starts(self) -> object:
        """A release call begins: close() lets it end first (see aclose)."""
        call = object()
        self._acquiring[call] = _fork.pid
        return call

    def _call_ends(self, call: object) -> None:
        del self._acquiring[call]
        self._acquire_settled()

    def _acquire_settled(self) -> None:
        """An acquire call ended or parked: wake close(), if it waits for them."""
        if self._acquires_settling:
            for settling in list(self._acquires_settling):
                settling.set()

    def _keep_give_back(self, give_back: Any) -> None:
        """Closing the client waits for the give-backs still running (the sync face's
        run in daemon threads, which the end of the process would cut short). Those of
        an event loop that has ended are dropped: they will not run again. Under
        _held_guard: two threads keeping one each at once would each write a list
        without the other's."""
        with self._held_guard:
            self._give_backs = [x for x in self._give_backs if serving(x)] + [give_back]

    @notices_fork
    async def aclose(self) -> None:
        """Stop renewing, give back every lock still held, and close the backend.
        Its locks cannot be acquired afterwards: nothing would renew them.

        A lock still held is lost to its holder, told as the renewal watchdog tells a
        loss (``on_lost``, ``lost``, the ``async with`` body cancelled, ``LockLost`` from
        its block's end, ``release`` and ``extend``) before its lease is given back. A
        release in flight as the close begins ends first: that hold ended cleanly."""
        self._closed = True
        self._renewer.wind_down()
        # An attempt in flight may yet be granted: its acquire sees the client closed and
        # gives the lease back, which needs the backend open, so let it end first;
        # bounded, as a server that stopped answering would hold it up. A release in
        # flight too: its hold is not lost, and the backend must not close under it.
        # Not for the calls that this close runs inside (an on_lost told by an acquire):
        # they go on only once it returns.
        began = self._clock()
        until = began + CLOSE_WAIT
        pid = _fork.pid
        mine = set()
        call = _ACQUIRE_CALL.get()
        while call is not None:
            mine.add(call)
            call = call.outer
        settling = WakeupEvent()
        self._acquires_settling.add(settling)
        try:
            for closing_holds in (False, True):
                # Twice: a release that began before the flag went up ends first too.
                # (Never put down: a close made by an on_lost that this one tells.)
                self._closing_holds = self._closing_holds or closing_holds
                while True:
                    settling.clear()
                    left = until - self._clock()
                    if left <= 0 or not any(
                        owner == pid and call not in mine
                        for call, owner in list(self._acquiring.items())
                    ):
                        break
                    await settling.wait(left)
        finally:
            self._acquires_settling.discard(settling)
        for give_back in self._give_backs:
            await wait_done(give_back)
        # Given back below with the holds, once more, not each waiting its turn.
        retried = await self._retrier.aclose(since=began)
        await self._renewer.aclose()
        holds = []
        # What another close (another thread's) took the holds being given up before
        # this one saw: given back here, as before.
        own: list[tuple[AsyncLock, int, str]] = []
        for lock in self._still_held():
            # A reentrant lock is freed by its last release. A lock declared lost is
            # given back too: the backend may still keep state for it (SQL sessions).
            # With its pending give-back (a fresh grant found by a re-entry that this
            # close runs inside): once the backend is closed it could only reopen it.
            # Given back below with the holds being given up, this close's from now on:
            # the holder's own give-up, as it learns of the loss, leaves the backend
            # alone (see _give_up). The hold stays counted, lost, as a hold the watchdog
            # found lost does until its holder leaves it.
            lock._check_forked()
            with lock._sharing:
                entries = max(lock._count, lock._to_give_back)
                lock._to_give_back = 0
                generation, held = lock._generation, lock._count > 0
            with self._held_guard:
                if self._giving_up is None:
                    own.append((lock, entries, lock._token))
                elif entries and lock not in self._giving_up:
                    self._giving_up[lock] = (entries, lock._token)
                self._held.discard(lock)
            self._renewer.discard(lock)
            lock._wake_sharers()  # its other users' waits stop, seeing the client closed
            if held:
                holds.append((lock, generation))
        # Each holder is told before any lease is given back, so that it may stop
        # before another client can take the lock. Its on_lost runs here, and may close
        # the client too (that close gives the leases back), or release its lock
        # (LockLost at once).
        error: BaseException | None = None
        for lock, generation in holds:
            try:
                lock._declare_lost(
                    "its client was closed", told=True, generation=generation, closing=True
                )
            except BaseException as exc:  # an on_lost's sys.exit(): the close ends first
                error = error or exc
        # Lost holds whose give-up has not finished: the on_lost it tells may be this
        # close (the give-back would come after it), or a round trip of the give-back
        # may be in flight (the next one would come after it). Given back here, while
        # the backend is open; their give-ups stop.
        with self._held_guard:
            giving_up, self._giving_up = self._giving_up or {}, None
        await give_back_all(
            [(lock, entries, token) for lock, (entries, token) in giving_up.items()] + own + retried
        )
        await self._backend.aclose()
        if error is not None:
            raise error

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
