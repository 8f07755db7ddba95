"""A lock: the acquire loop, ownership, leases and loss, written once for both faces."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import math
import secrets
import threading
from collections.abc import Callable, Iterator
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .. import _fork
from .._errors import (
    LEASE_RAN_OUT,
    UNRENEWED_LEASE_RAN_OUT,
    AlreadyAcquired,
    BackendError,
    BackendUnavailable,
    LockError,
    LockLost,
    LockTimeout,
    NotOwner,
    gives_way_to_a_cancel,
)
from .._types import Acquired, Busy, Lease
from .._validation import check_timeout, check_ttl
from ._primitives import (
    WakeupEvent,
    cancel_requests,
    cancel_task,
    cancels_of,
    current_task,
    lost_cancel,
    notices_fork,
    serving,
    sleep,
    spawn,
    uncancel,
    wait_done,
)

if TYPE_CHECKING:
    from .backend import AsyncWaiter
    from .client import AsyncClient

logger = logging.getLogger("dlock")
#: The warning logged when a hold is lost (a program that tells its user itself, as
#: ``dlock run`` does, filters it out).
LOST_MESSAGE = "dlock: lost lock %r: %s"

#: Share of the TTL after which a held lease is renewed.
RENEW_AFTER = 1 / 3


class AsyncLock:
    """A named distributed lock with a lease, an owner token and a fencing token.

    Ownership belongs to this object's random owner token, not to a thread or task: any
    code holding this object may release it, and two objects for one name exclude each
    other exactly as two processes would.
    """

    def __init__(
        self,
        client: AsyncClient,
        name: str,
        *,
        ttl: float,
        timeout: float | None,
        reentrant: bool,
        auto_renew: bool,
        on_lost: Callable[[AsyncLock], Any] | None,
        cancel_on_lost: bool,
    ) -> None:
        self.name = name
        self.ttl = ttl
        self.timeout = timeout
        self.reentrant = reentrant
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.cancel_on_lost = cancel_on_lost
        self._client = client
        self._token = secrets.token_hex(16)
        #: In a forked child: entries of the parent's hold (see _check_forked) whose
        #: ``with`` blocks have yet to end here.
        self._parents_entries = 0
        self._fencing_token: int | None = None
        self._count = 0
        self._lost = False
        self._lost_reason = ""
        #: Entries of a lost hold, given up, that its holder has yet to leave: each
        #: release or block's end raises LockLost, as the first did (see
        #: _leave_lost_entry), and only then NotOwner.
        self._lost_entries = 0
        #: The hold (see _generation) that a re-entry cut off in flight may have entered
        #: on the backend, an entry no caller counts: its last release gives such
        #: entries back (see release).
        self._uncounted_in: int | None = None
        #: How many such re-entries there were.
        self._uncounted = 0
        #: The user (task, thread) whose re-entry or release is changing the count of
        #: entries now, how many of its calls are (one may run inside another: an
        #: on_lost it tells), and what the others wait on (see _take_count_turn).
        #: Under _sharing.
        self._counting: tuple[Any, int] | None = None
        self._counting_depth = 0
        self._counted: WakeupEvent | None = None
        #: Held while a loss is declared (see _declare_lost). Reentrant, so that on_lost
        #: may itself release the lock or leave its block.
        self._loss_lock = threading.RLock()
        #: Bumped on every fresh acquisition, so a renewal answer for an earlier one is
        #: ignored. Changed with _lost under _sharing (see _declare_lost).
        self._generation = 0
        #: Local upper bound of the lease: measured from *before* the request was sent.
        self._deadline = 0.0
        self._renew_at = 0.0
        #: The current lease's length: the TTL, or less for a lease handed over.
        self._lease_ttl = ttl
        #: Lease writes in flight (extend, renewal): key -> [its own bound (sent + ttl),
        #: the lowest bound among itself and the writes that overlapped it].
        self._writes: dict[int, list[float]] = {}
        self._writes_guard = threading.Lock()
        self._write_key = 0
        #: The shortest TTL among this owner token's writes that got no answer (an
        #: attempt, extend or renewal cut off; ``inf`` for a release), None if none: see
        #: _unanswered. Under _writes_guard.
        self._unanswered_ttl: float | None = None
        #: True when one of them was a release (which no cap counts against: see
        #: _take_new_token). Under _writes_guard.
        self._unanswered_release = False
        #: The owner token of a lost hold being given up (see _give_up_lost), until its
        #: give-back ends: a fresh hold taken meanwhile (by the on_lost it tells, or by
        #: another user of this object) takes a new token, out of that give-back's reach.
        self._token_given_up: str | None = None
        #: When the latest acquire attempt was sent.
        self._attempt_sent = 0.0
        #: The tasks running a ``with`` body of this lock, one entry per block entered
        #: (a reentrant lock's nested blocks too); all are cancelled on loss.
        self._body_tasks: list[Any] = []
        #: The body tasks that a loss cancelled, each to be uncancelled once on exit.
        self._cancelled: set[Any] = set()
        #: One per ``with`` block inside: its task and thread, and the hold it entered
        #: (see _generation). Its end leaves that hold only, not a fresh one that
        #: another user of this object took after a loss (see __aexit__).
        self._blocks: list[tuple[Any, int, int | None]] = []
        #: The give-back of a lease this object may have on the backend but does not
        #: hold (an attempt cut off in flight, a failed release), while it runs.
        self._give_back: Any = None
        #: Entries to give back once no attempt is in flight, and the attempts in flight
        #: (see _give_back_later); under _sharing, as threads may share this object.
        self._to_give_back = 0
        self._attempts = 0
        self._sharing = threading.Lock()
        #: The acquire call that is this object's seeker (see _take_turn); under _sharing.
        self._seeker: _Call | None = None
        #: Set (and dropped) when the turn or this object's hold ends: what the users of
        #: this object that another user keeps out wait on (see _wait_for_sharer); also
        #: when the last attempt in flight ends after a release that got no answer (see
        #: _take_new_token). Under _sharing.
        self._changed: WakeupEvent | None = None
        #: The process generation (see dlock._fork) that the sharing state is from.
        self._fork_generation = _fork.generation

    def __repr__(self) -> str:
        state = "lost" if self.lost else "held" if self._count else "free"
        return f"<{type(self).__name__} {self.name!r} {state} fencing_token={self._fencing_token}>"

    @property
    def fencing_token(self) -> int | None:
        """The fencing token of the latest acquisition (kept after release), or None."""
        return self._fencing_token

    @property
    def lost(self) -> bool:
        """True once the lease ended while held: the backend said so or it ran out."""
        return self._lost or (self._count > 0 and self._client._clock() >= self._deadline)

    def owned(self) -> bool:
        """True while this object holds a lease that has not been lost or run out.

        Answered from what this process knows, without a round trip; a paused process can
        only be sure of fencing tokens, which is why they exist. In a forked child, a
        hold taken in the parent is the parent's, not this object's (see _check_forked).
        """
        _fork.current()  # notices a fork made without Python's hooks, as every public call
        self._check_forked()
        return self._count > 0 and not self.lost

    async def acquire(self, timeout: float | None = None) -> bool:
        """Acquire the lock; True on success, False when ``timeout`` passes first.

        ``None`` waits forever, ``0`` tries once. A reentrant lock that this object holds
        is entered again; a non-reentrant one raises :class:`AlreadyAcquired`.
        """
        return await self._enter(timeout, _Call())

    @notices_fork
    async def _enter(self, timeout: float | None, call: _Call) -> bool:
        """acquire() and ``with``, the grant recorded in ``call`` (see _undo_entry)."""
        self._check_forked()  # once for all this call does (see there)
        wait = check_timeout(timeout)
        self._check_open()
        # Looked up once for all this call does (each lookup costs ~0.1 us).
        task = current_task()
        call.user = (task, threading.get_ident())
        if cancels_of(task):
            # Perhaps one is pending (requested while this task was ready to run): let
            # it stop us here. Sent on, a client library may turn it into a timeout of
            # its own and drop it (redis-py checks an idle connection under a zero
            # timeout), and the count taken below would already include it.
            await sleep(0)
        # Before anything else awaits: a cancellation from here on is caught even if
        # a client library loses it, our own for a loss declared just below too.
        call.cancels = cancels_of(task)
        if self._count and self.lost:
            if self.reentrant:
                # A re-entry of a hold that ran out is told as a loss, as one that the
                # backend answers with busy or a fresh grant is; and as there, the hold
                # stays counted, lost, until its holder leaves it (release() and the
                # block's end raise LockLost and give it up).
                raise self._lost_error(self._ran_out(), self._generation)
            # A lock that is not reentrant is acquired afresh: the hold it had is gone.
            await self._give_up_lost(told=False)
        if self._count and not self.reentrant:
            raise AlreadyAcquired(f"lock {self.name!r} is already held by this object")
        clock = self._client._clock
        deadline = None if wait is None else clock() + wait
        # Decided once: while this call waits, another thread or task sharing the object
        # may take the lock, and that is not a re-entry of ours (see _attempt).
        entries = self._count
        call.outer = _ACQUIRE_CALL.get()
        context = _ACQUIRE_CALL.set(call)
        self._client._acquiring[call] = _fork.pid
        try:
            # Again, now that close() waits for this call: either it sees the call and
            # lets it end first, or the call sees the client closed.
            self._check_open()
            while True:
                try:
                    acquired = await self._acquire(call, wait, deadline, entries > 0)
                    break
                except _HoldEnded:
                    # A re-entry whose hold another user of this object ended while
                    # it waited for its turn (its last release): nothing of this call's
                    # was lost. It goes on as a call made now would, a fresh acquire,
                    # within what is left of its timeout.
                    await self._still_wanted(call)
                    entries = self._count
            await self._still_wanted(call)
        except BaseException as exc:
            # Granted, then cut off before returning (cancelled or failed while leaving
            # the wait, or the client closed meanwhile): the caller is told it did not
            # get the lock, so it must not stay held and renewed.
            await self._undo_entry(call)
            if gives_way_to_a_cancel(exc) and cancels_of(task) > call.cancels:
                # A cancellation that a client library lost before the call failed
                # (redis-py's send under ``wait_for`` before Python 3.12, its read then
                # timing out on a server held up): the caller is cancelled, not told
                # the backend's error, which would reach its ``asyncio.timeout`` or
                # TaskGroup in place of the cancellation they wait for.
                await lost_cancel(exc)
            raise
        finally:
            del self._client._acquiring[call]
            self._client._acquire_settled()
            _ACQUIRE_CALL.reset(context)
        return acquired

    def _check_open(self) -> None:
        """Nothing renews a lease taken once the client is closed: refuse to take it."""
        if self._client._closed:
            raise BackendError(f"lock {self.name!r} cannot be acquired: its client is closed")

    async def _still_wanted(self, call: _Call) -> None:
        """Stop if the caller no longer wants the lock: its client closed, or its task was
        cancelled (more pending cancellations than ``call.cancels``) during a backend call
        that returned all the same, the cancellation lost by a client library."""
        self._check_open()
        if cancels_of(call.user[0]) > call.cancels:
            await lost_cancel()

    async def _undo_entry(self, call: _Call) -> None:
        """Give back the entry that ``call`` was granted but does not return, if it
        still counts: other users of this object may have entered it as well (a
        reentrant lock), or ended that hold, meanwhile. One entry among others leaves
        alone, and the hold stays theirs, unless the client closed meanwhile; the only
        one ends the hold, given back as a failed release's lease is (in the background).

        A release that fails ends the whole hold (see :meth:`release`), the outer one
        too, which its holder still believes in: that is a loss, and told as one."""
        if call.generation != self._generation or not self._count:
            return
        call.generation = None
        if self._count > 1 and not self._client._closed:
            try:
                await self.release()
            except LockLost:
                pass  # declared by release; the outer block is told as it leaves
            except BaseException as exc:
                # The running task is stopped by this acquire's own error already:
                # it is told, not cancelled as well.
                self._declare_lost("a re-entry cut off after its grant could not be undone", True)
                if not isinstance(exc, LockError):
                    raise
        else:
            self._abandon()

    async def _acquire(
        self, call: _Call, wait: float | None, deadline: float | None, reentry: bool
    ) -> bool:
        """A fresh acquire seeks the lock in its turn (see _take_turn). A re-entry makes
        no wait (busy means lost): it needs no turn, and never waits for one."""
        if reentry:
            return await self._seek(call, wait, deadline, reentry)
        # Taken at once unless another user keeps it: no coroutine on that path.
        if self._turn(call) is not call and not await self._take_turn(call, deadline):
            return False
        try:
            if self._client._backend.may_write_late(self._token):
                self._unanswered(math.inf)
            if (
                self._unanswered_ttl is not None or self._token_given_up == self._token
            ) and not await self._take_new_token(deadline):
                return False
            return await self._seek(call, wait, deadline, reentry)
        finally:
            self._end_turn(call)

    async def _take_turn(self, call: _Call, deadline: float | None) -> bool:
        """Make ``call`` this object's seeker: the one user of it in the backend to take
        a fresh hold (its attempts, and its stay in the backend's wait). False if that
        cannot be before ``deadline``; else the caller ends the turn with _end_turn.

        Why: the users of this object share its owner token, so the backend cannot tell
        them apart. Two of them in it at once are one waiter to it: they share a place
        and a wake-up, and both may be told they hold the lock (Redis), or one waits
        for the other's wait to time out (MariaDB's lease mode). So the others wait
        here, with no round trip: for the seeker's call to end, then for the end of the
        hold it may have taken; not reentrant, they are told AlreadyAcquired instead,
        as a call made while the object is held is. A call made inside the seeker's
        own (its thread or task: an on_lost it told) takes the turn over until it ends.
        """
        while (seeker := self._turn(call)) is not call:
            if seeker is None and not self.reentrant:
                raise self._acquired_meanwhile()
            remaining = None if deadline is None else deadline - self._client._clock()
            if remaining is not None and remaining <= 0:
                return False
            with self._parked():
                # No seeker: the object is held, and it is the hold's end to wait for.
                await self._wait_for_sharer(remaining, seeker)
            await self._still_wanted(call)
        return True

    async def _take_new_token(self, deadline: float | None) -> bool:
        """Start a fresh hold under an owner token of its own, out of reach of the old
        token's writes that got no answer (see _unanswered), or of the give-back of a
        lost hold (see _give_up_lost): a release among them would free the new hold
        whenever it reached the backend. Once the give-back of the old
        token's lease (if any) has ended, and only when nothing else of this object uses
        that token (a hold, an attempt); else the new hold keeps it, its lease counted
        as _lease_renewed caps it.

        A lease left under the old token (a give-back that failed too) is then not taken
        back by this object's next acquire: it waits for that lease's TTL like anyone.

        A release that got no answer is one that no cap counts against: kept, the old
        token would let it free the new hold whenever it reached the backend. So while
        another user's attempt keeps that token (a re-entry in flight), wait for its
        end; from this object's on_lost too: no attempt waits for an on_lost to end (a
        re-entry tells its loss once its attempt has ended, see _attempt).
        False if ``deadline`` passes first: the acquire is not granted in time. The
        give-back is waited for whatever the deadline, as every attempt does (see
        _attempt_starts): it is this object's own round trip, and a try made while it
        runs is answered by the backend, not "busy" by default."""
        while True:
            with self._sharing:
                give_back = self._give_back
                if give_back is None or not serving(give_back):
                    if not (self._count or self._attempts or self._to_give_back):
                        with self._writes_guard:
                            self._token = secrets.token_hex(16)
                            self._unanswered_ttl = None
                            self._unanswered_release = False
                        return True
                    if self._count or not self._unanswered_release:
                        return True
                    # Set as the last of those attempts ends (_attempt_ends).
                    ended = self._changed = self._changed or WakeupEvent()
                    give_back = None
            if give_back is not None:
                await wait_done(give_back)
                continue
            remaining = None if deadline is None else deadline - self._client._clock()
            if remaining is not None and remaining <= 0:
                return False
            await ended.wait(remaining)

    def _turn(self, call: _Call) -> _Call | None:
        """Make ``call`` the seeker if nothing keeps it out now (see _take_turn); return
        the seeker then: ``call``, the other user's call, or None if the object is held.
        One lock, so that two users never both become the seeker (threads, with or
        without the GIL)."""
        with self._sharing:
            seeker = self._seeker
            if (seeker is None and not self._count) or (
                seeker is not None and seeker.user == call.user
            ):
                call.within, self._seeker = seeker, call
                return call
            return seeker

    def _end_turn(self, call: _Call) -> None:
        """``call``'s acquire ended (granted, timed out, failed or cancelled): hand the
        turn back to the seeker it took it over from, else to the users waiting."""
        with self._sharing:
            if self._seeker is not call:
                return  # a turn of the parent process, ending in a forked child
            self._seeker = call.within
            changed = None
            if self._seeker is None:
                changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _not_owner(self) -> NotOwner:
        if self._parents_entries:
            return NotOwner(
                f"lock {self.name!r} is held by the process this one was forked from, which"
                " renews and releases it"
            )
        return NotOwner(f"lock {self.name!r} is not held by this object")

    def _acquired_meanwhile(self) -> AlreadyAcquired:
        return AlreadyAcquired(
            f"lock {self.name!r} was acquired by another user of this object meanwhile"
        )

    async def _seek(
        self, call: _Call, wait: float | None, deadline: float | None, reentry: bool
    ) -> bool:
        """The attempts of one acquire, and its wait between them."""
        backend = self._client._backend
        # A re-entry never waits (busy means lost), so it never takes a place in a queue.
        if wait == 0 or not backend.queues_waiters or reentry:
            busy = await self._attempt(reentry)
            if busy is None:
                return True
            if wait == 0:
                return False
        clock = self._client._clock
        async with backend.waiter(self.name, self._token) as waiter:
            attempt = 0
            while True:
                # Closed or cancelled while we waited: stop.
                await self._still_wanted(call)
                busy = await self._attempt(reentry)
                if busy is None:
                    return True
                # Again before the wait: a cancellation that a client library lost
                # during the attempt (redis-py's ``wait_for`` before Python 3.12) is not
                # seen by the wait, which counts the cancellations pending as it begins.
                # It went on to its timer or a wake-up, holding its place at the head of
                # the queue, and everyone behind it out (a Redlock head of the line
                # cancelled in a CI run: the next waiter's 20 s timed out first).
                await self._still_wanted(call)
                remaining = None if deadline is None else deadline - clock()
                if remaining is not None and remaining <= 0:
                    return False
                delay = self._delay(attempt, busy.retry_after, waiter.notifies, remaining)
                if waiter.notifies and delay < waiter.shortest_wait:
                    delay = self._delay(attempt, busy.retry_after, False, remaining)
                if busy is _SHARER_HOLDS:
                    with self._parked():
                        await self._wait_for_sharer(delay, None)
                elif await self._wait_for_release(waiter, delay):
                    return True
                attempt += 1

    @contextlib.contextmanager
    def _parked(self) -> Iterator[None]:
        """Waiting for a release: meanwhile close() does not wait for this call (a
        notifying wait may last seconds); it stops at its next wake, seeing it closed."""
        acquiring, call = self._client._acquiring, _ACQUIRE_CALL.get()
        acquiring[call] = 0
        self._client._acquire_settled()
        try:
            yield
        finally:
            acquiring[call] = _fork.pid

    async def _wait_for_release(self, waiter: AsyncWaiter, delay: float) -> bool:
        """Wait for the holder's release; True if the backend handed us the lease then.

        Counted as an attempt in flight, until the lease handed over is held: it is
        granted to this object's owner token with no attempt of ours, and a give-back
        of another user's attempt cut off meanwhile would release it."""
        while (give_back := self._attempt_starts()) is not None:
            await wait_done(give_back)
        try:
            with self._parked():
                handed = await waiter.wait(delay)
            return handed is not None and await self._take_handed(handed)
        finally:
            self._attempt_ends()

    async def _wait_for_sharer(self, delay: float | None, seeker: _Call | None) -> None:
        """Wait (up to ``delay``) for another user of this object to let this call go
        on: for the end of ``seeker``'s turn, or, given None, of the hold that another
        user has; or for any other change of the turn or hold, after which the caller
        looks again. Not the backend's waiter: our attempt made no round trip, so took
        no place that its release would wake (Redis), and a SQL session waiter would
        find the lock held by this very owner token and return at once (a busy loop)."""
        with self._sharing:
            changed = self._changed = self._changed or WakeupEvent()
            # Looked at once the event exists: a release ends the hold without _sharing,
            # and wakes only an event that it sees (see _wake_sharers).
            kept_out = self._seeker is seeker if seeker is not None else self._count > 0
        if kept_out:
            await changed.wait(delay)

    def _wake_sharers(self) -> None:
        """This object's hold ended: wake the users of it that wait (_wait_for_sharer)."""
        self._check_forked()
        with self._sharing:
            changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _delay(
        self, attempt: int, retry_after: float | None, notifies: bool, remaining: float | None
    ) -> float:
        delay = self._client._backoff.delay(attempt, retry_after, notifies)
        return delay if remaining is None else min(delay, remaining)

    async def _take_handed(self, handed: Acquired) -> bool:
        """Hold a lease granted to us while we waited (handed over by its last holder).

        It was granted after our latest attempt was sent, so it lasts at least its TTL
        from then. If little of that is left (a long wait since), confirm it with an
        owner-checked renewal first; if it has lapsed meanwhile, keep waiting. So too
        when it is shorter than ours (Redis: a place's length) and nothing renews it.
        A confirmation answered no sooner than the lease it set ended is BackendUnavailable.
        """
        ttl = self.ttl if handed.ttl is None else handed.ttl
        renewed = self.auto_renew or ttl >= self.ttl
        if renewed and self._client._clock() < self._attempt_sent + ttl * RENEW_AFTER:
            self._granted(handed, self._attempt_sent)
            return True
        started = self._client._clock()
        try:
            confirmed = await self._client._backend.extend(self.name, self._token, self.ttl)
        except BaseException:
            # The lease handed over is ours on the backend: give it back as an attempt
            # cut off in flight does (see _attempt), in the background once this wait,
            # counted as an attempt, ends: a server that did not answer the renewal may
            # not answer the release either, and the caller's error is due now.
            self._unanswered(self.ttl)
            self._give_back_later(1)
            raise
        if confirmed:
            answered = self._client._clock()
            if answered >= self._lease_end(started, self.ttl):
                # Confirmed no sooner than the lease it confirmed ended, counted from
                # when the renewal was sent (a backend stalled that long): no lock to
                # hold, as for a fresh grant answered so late (see _answered).
                self._give_back_later(1)
                raise BackendUnavailable(
                    f"lock {self.name!r} was handed over and confirmed "
                    f"{answered - started:.3f} s after the confirmation was sent, no "
                    f"sooner than its lease of {self.ttl:g} s ended: given back, not held"
                )
            self._granted(Acquired(handed.fencing_token, handed.count), started)
        return confirmed

    async def _attempt(self, reentry: bool) -> Busy | None:
        """One round trip to the backend; None means this object now holds the lock.

        ``reentry``: the object was held when this acquire began. If it was not, and it
        is now, another thread or task sharing it took the lock meanwhile: that hold is
        theirs, not one to re-enter (nor to declare lost on a busy answer).

        A re-entry is made in the count's turn (see _take_count_turn). If the hold
        ended meanwhile (the last release of another user of this object came first),
        it is no re-entry any more: the call goes on as one made now would."""
        if not reentry:
            return await self._send_attempt(reentry, self._generation)
        await self._take_count_turn()
        try:
            if not self._count:
                raise _HoldEnded
            generation = self._generation
            answer = await self._send_attempt(reentry, generation)
        finally:
            self._end_count_turn()
        if answer is _RAN_OUT:
            reason = "the re-entry was answered after the lease it set ran out"
        elif answer is _HOLD_GONE:
            reason = "the lease was gone when re-entering"
        else:
            return answer
        # Told only once the attempt and its turn have ended: an on_lost that acquires
        # afresh may wait for a fresh hold's turn, and that hold for this object's
        # attempts to end (see _take_new_token), each for the other; one that waits for
        # another user's release would wait for this turn. Only if the hold is still
        # the one that was re-entered: another user may have ended it and taken a fresh
        # one since, which is not lost. The caller is told all the same: its hold is.
        raise self._lost_error(reason, generation)

    async def _send_attempt(self, reentry: bool, generation: int) -> Busy | None:
        """_attempt's round trip; _HOLD_GONE if a re-entry found its hold gone, _RAN_OUT
        if it was answered after the lease it set ran out (see _answered_late)."""
        while (give_back := self._attempt_starts()) is not None:
            await wait_done(give_back)
        result: Acquired | Busy | None = None
        gone = late = False
        write: int | None = None
        cap = math.inf
        try:
            if not reentry and self._count:
                if not self.reentrant:
                    raise self._acquired_meanwhile()
                # Theirs: not ours to re-enter, and a fresh attempt under the owner token
                # we share could be granted the very lease they hold (Redis takes over a
                # lease of its token as an orphan). Wait for their release instead.
                return _SHARER_HOLDS
            started = self._attempt_sent = self._client._clock()
            if reentry:
                # A write of the held lease, as extend and renewal are: overlapping them,
                # it may be applied before or after them (see _write_done).
                write = self._write_started(started, self.ttl)
            # A fresh acquire never re-enters: a lease under our token that we do not
            # hold is an orphan of an attempt cut off mid-flight, not ours to count.
            result = await self._client._backend.acquire(
                self.name, self._token, self.ttl, self._client._holder, self.reentrant and reentry
            )
            if write is not None:
                cap, write = self._write_done(write), None
            gone = reentry and (
                self._reentry_gone(result)
                or self._lost_meanwhile(result, generation)
                or self._left_meanwhile(result, generation)
                or (late := self._answered_late(result, started, cap, generation))
            )
            if not gone:
                return self._answered(result, started, cap, reentry)
        except BaseException as exc:
            if write is not None:
                cap = self._write_done(write)
            if result is None:
                # Cancelled, interrupted or cut off mid-flight: the server may have granted
                # the lease anyway. Give it back (owner-checked, so harmless) rather than
                # leave an orphan until its TTL. Never after a re-entry: that would free the
                # outer hold, whose lease the re-entry may have shortened instead (an
                # extend(60) made before it). In the background: a server that did not
                # answer the attempt (hung, gone) may not answer the release either, and
                # the caller's error is due now.
                if isinstance(exc, BackendUnavailable) or not isinstance(exc, LockError):
                    self._unanswered(self.ttl)
                    # Sent, it may also reach the backend after its give-back, or after
                    # the last release of the hold it re-entered.
                    self._client._retrier.look_again(self, self._token)
                    if not reentry:
                        self._give_back_later(1)
                    else:
                        if self._uncounted_in != generation:
                            self._uncounted_in, self._uncounted = generation, 0
                        self._uncounted += 1
                        with self._sharing:
                            if not self._count and self._to_give_back:
                                # Its hold was left meanwhile (a release cut off ended
                                # it), its give-back waiting for this attempt: one entry
                                # more to give back, or it outlived every holder.
                                self._to_give_back += 1
                        if cap != math.inf and generation == self._generation:
                            # A fresh hold taken since (by another user of this object)
                            # was sent later with the same TTL: applied after it, this
                            # re-entry ends its lease no earlier than counted.
                            self._lease_unsure(started, self.ttl, cap)
            elif isinstance(result, Acquired) and not reentry and self._count == 0:
                # Interrupted (a signal's KeyboardInterrupt) after the backend granted but
                # before the grant was counted: acquire() cannot see an entry to undo, and
                # the lease would stay on the backend, unknown here, until its TTL.
                self._abandon(result.count)
            elif (
                isinstance(result, Acquired)
                and reentry
                and result.fencing_token == self._fencing_token
                and result.count > self._count
            ):
                # The same, for a re-entry: counted now, and recorded as this call's
                # entry, so that acquire() undoes just this entry.
                self._count = self._reentered(result.count)
                self._note_entry()
                self._lease_unsure(started, self.ttl, cap)
            raise
        finally:
            self._attempt_ends(gone and not late and generation == self._generation)
        return _RAN_OUT if late else _HOLD_GONE

    def _attempt_starts(self) -> Any:
        """Count an attempt in flight, unless a give-back runs: that releases under this
        object's owner token, and must not release what the attempt is granted. Returns
        the give-back to wait for before trying again, or None once counted. Not a
        coroutine: this is on every acquire's path, and rarely has anything to wait for."""
        with self._sharing:
            give_back = self._give_back
            if give_back is not None and serving(give_back):
                return give_back
            self._attempts += 1
            return None

    def _check_forked(self) -> None:
        """In a forked child, the sharing state copied is the parent's: attempts that its
        other threads had in flight (never to end here, so the child's give-backs would wait
        for them for ever), its give-back, its renewer's write in flight, and a lock one of
        them may hold or seek (a seeker that never ends here). Checked once as each call
        that reads the hold starts (acquire, release, extend, owned, a ``with`` block's
        exit), which covers all it does, and by the helpers that close() reaches
        (_wake_sharers, _give_back_later).

        Once per call is enough: the calls of the parent's other threads do not go on
        in the child. One of the thread that forked (from a signal handler) does, with
        the state as it was, until the child's next call starts over.

        The hold and the owner token are the parent's too: the parent renews and
        releases that lease. The child must neither release it nor re-enter it (a
        re-entry under the shared token is granted: two processes would hold the lock),
        so it acquires under a token of its own, and ``with`` blocks entered before the
        fork end in the child without releasing (_parents_entries).

        Being on every call's way in, it also has the client's renewer and give-back
        retrier run again where their tasks ended with an event loop (see resume)."""
        if self._fork_generation != _fork.generation:
            with _fork.guard:
                if self._fork_generation != _fork.generation:
                    # Taken, perhaps, by a thread that stayed in the parent (its
                    # renewer telling a loss): it would never be let go here.
                    self._sharing, self._loss_lock = threading.Lock(), threading.RLock()
                    # The writes in flight are the parent's renewer's and its threads'
                    # (never to end here): left, each of the child's own writes of the
                    # object overlapped them, and was counted to end no later than they
                    # (see _write_done), its hold told lost a TTL after the fork.
                    self._writes, self._writes_guard = {}, threading.Lock()
                    self._attempts = self._to_give_back = 0
                    self._give_back = self._seeker = self._changed = None
                    self._counting, self._counting_depth, self._counted = None, 0, None
                    self._parents_entries, self._count = self._count, 0
                    self._blocks = []
                    self._lost_entries = 0
                    self._token = secrets.token_hex(16)
                    self._unanswered_ttl = None
                    self._unanswered_release = False
                    # Last: another thread of the child goes on only with all of the above.
                    self._fork_generation = _fork.generation
        # Where their tasks ended with an event loop, the renewer and the asking of
        # give-backs run again in this one.
        self._client._renewer.resume()
        self._client._retrier.resume()

    def _attempt_ends(self, hold_gone: bool = False) -> None:
        """``hold_gone``: a re-entry found the hold it re-entered gone (_settle_give_back)."""
        with self._sharing:
            self._attempts -= 1
            if self._to_give_back:
                self._settle_give_back(hold_gone)
            changed = None
            if not self._attempts and self._unanswered_release:
                # A fresh hold may wait for it to take a new token (_take_new_token).
                changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _give_back_later(self, entries: int) -> None:
        """Give back up to ``entries`` entries of a lease that this object may have on
        the backend but does not hold: owner-checked, in the background.

        Not while another user of this object has an attempt in flight: under the same
        owner token, the release would free what that attempt is granted. The last
        attempt to end gives it back, or drops it if this object then holds the lock:
        a fresh attempt never re-enters, so the backend keeps one lease per owner token
        and that lease is the holder's. A hold declared lost is not: its lease is gone.
        """
        self._check_forked()
        with self._sharing:
            self._to_give_back = max(self._to_give_back, entries)
            self._settle_give_back()

    def _settle_give_back(self, hold_gone: bool = False) -> None:
        """``hold_gone``: the hold counted is gone from the backend, though not yet
        declared lost: the lease under our token is not its holder's, and is given back."""
        if self._attempts or not self._to_give_back:
            return
        entries, self._to_give_back = self._to_give_back, 0
        if self._count and not (self._lost or hold_gone):
            return
        # The token now (under _sharing): while a give-back is to be done, no other user
        # of this object takes a new one (_take_new_token).
        self._give_back = spawn(
            partial(self._give_back_now, entries, self._token), name="dlock-give-back"
        )
        self._client._keep_give_back(self._give_back)

    async def _give_back_now(self, entries: int, token: str) -> None:
        """Run by _settle_give_back; what gets no answer is asked again later, and so
        is all of it when this is cut off (asyncio.run ends, cancelling its loop's
        tasks): kept for the next loop or close() (see AsyncGiveBackRetrier.keep)."""
        started = self._client._clock()
        try:
            unanswered = await self._release_quietly(entries, token)
        except BaseException:
            self._client._retrier.keep(self, token, entries)
            raise
        if unanswered:
            waited = self._client._clock() - started
            self._client._retrier.add(self, token, unanswered, waited)

    def _retire_token(self, token: str) -> bool | None:
        """Whether a give-back asked again under ``token`` may be sent now: True if this
        object no longer uses that token, or did not while idle and now has a new one
        (as _take_new_token gives); False if a hold of this object has it (the lease
        under it is that hold's, which its own release ends); None while an attempt or
        give-back of this object is in flight under it (ask again later)."""
        with self._sharing:
            if self._token != token:
                return True
            if self._count:
                return False
            if self._attempts or self._to_give_back or serving(self._give_back):
                return None
            with self._writes_guard:
                self._token = secrets.token_hex(16)
                self._unanswered_ttl = None
                self._unanswered_release = False
            return True

    def _reentry_gone(self, result: Acquired | Busy) -> bool:
        """True if a re-entry's answer says the hold it re-entered is gone: busy, or a
        fresh grant, not a re-entry (our lease had ended on the backend, force-released
        or expired by its clock, and the name was free again, perhaps after another
        holder). That new lease is nobody's: it is to be given back."""
        if isinstance(result, Busy):
            return True
        if result.count > 1 and result.fencing_token == self._fencing_token:
            return False
        self._give_back_later(1)
        return True

    def _lost_meanwhile(self, result: Acquired | Busy, generation: int) -> bool:
        """True if a re-entry the backend granted re-entered hold ``generation`` after
        the watchdog had declared it lost (ZooKeeper: the session given up while the
        re-entry waited for it to come back): its answer cannot revive the hold, whose
        lease another client may hold by now. Its entry is counted, so that the
        holder's release gives back every entry the backend keeps."""
        with self._sharing:
            if not self._lost or generation != self._generation or not self._count:
                return False
            if isinstance(result, Acquired) and result.count > self._count:
                self._count = result.count
            return True

    def _answered_late(
        self, result: Acquired | Busy, started: float, cap: float, generation: int
    ) -> bool:
        """True if a re-entry of hold ``generation`` that the backend granted was answered
        no sooner than the lease it set ended, counted from when it was sent (a backend
        stalled that long): the hold is lost on arrival, as a fresh grant answered so
        late holds nothing. The renewer tells that loss first, at the deadline that the
        re-entry in flight caps; nothing does for a lock it does not renew. Its entry is
        counted, as in _lost_meanwhile, for the holder's release to give back."""
        if not isinstance(result, Acquired):
            return False
        ttl = self.ttl if result.ttl is None else result.ttl
        if self._client._clock() < self._lease_end(started, ttl, cap):
            return False
        with self._sharing:
            if generation != self._generation or not self._count:
                return False
            self._count = self._reentered(result.count)
            return True

    def _left_meanwhile(self, result: Acquired | Busy, generation: int) -> bool:
        """True if hold ``generation`` was left, uncleanly, while a re-entry of it was in
        flight (another user gave it up, lost), and no fresh hold has been taken since.
        The re-entry's grant is the old lease, one entry up: nobody holds it, and it is
        given back whole. Counted, it made a fresh hold of more entries than its holders
        had, which outlived them (a helper's chaos run)."""
        with self._sharing:
            if self._count or generation != self._generation:
                return False
        if isinstance(result, Acquired):
            self._give_back_later(result.count)
        return True

    async def _take_count_turn(self) -> None:
        """Wait until no other user of this object is re-entering or releasing its hold,
        then be the one (end with _end_count_turn); reentrant per task and thread.

        Why: a backend whose re-entry is more than one step (MariaDB's session mode
        extends, then counts) answers a release that arrives in between from the count
        before it, and lets the database's lock go while the re-entry is counted held;
        and where each is one step, the answers of the two, applied in one order and
        handled in another, leave this object's count out of step with the backend's.
        One at a time, each answer is about the count that the other left."""
        user = (current_task(), threading.get_ident())
        while True:
            with self._sharing:
                if self._counting is None or self._counting == user:
                    self._counting = user
                    self._counting_depth += 1
                    return
                counted = self._counted = self._counted or WakeupEvent()
            await counted.wait(None)

    def _end_count_turn(self) -> None:
        with self._sharing:
            if not self._counting_depth:
                return  # a turn of the parent process, ending in a forked child
            self._counting_depth -= 1
            if self._counting_depth:
                return
            self._counting, counted, self._counted = None, self._counted, None
        if counted is not None:
            counted.set()

    def _answered(
        self, result: Acquired | Busy, started: float, cap: float, reentry: bool
    ) -> Busy | None:
        if isinstance(result, Busy):
            return result
        ttl = self.ttl if result.ttl is None else result.ttl
        answered = self._client._clock()
        if not reentry and answered >= self._lease_end(started, ttl, cap):
            # Counted from when the attempt was sent, as every lease is, this one ended
            # before its grant came back (a backend paused or stalled that long): no
            # lock to hold. Raised before it is counted: the attempt gives it back.
            raise BackendUnavailable(
                f"lock {self.name!r} was granted {answered - started:.3f} s after the "
                f"acquire was sent, no sooner than its lease of {ttl:g} s ended: given "
                "back, not held"
            )
        self._granted(result, started, cap)
        return None

    def _granted(self, result: Acquired, started: float, cap: float = math.inf) -> None:
        """``cap``: a re-entry's, from _write_done (the writes it overlapped)."""
        # The deadline first: a watchdog that sees the new generation sees its deadline,
        # not the ended hold's (which may have passed).
        self._lease_renewed(started, self.ttl if result.ttl is None else result.ttl, cap)
        if self._count == 0:
            with self._sharing:
                self._generation += 1
                self._lost = False
                self._lost_reason = ""
                self._lost_entries = 0
            self._client._hold(self)
            entries = result.count
        else:
            entries = self._reentered(result.count)
        self._note_entry()
        self._fencing_token = result.fencing_token
        self._count = entries
        if self.auto_renew:
            self._client._renewer.add(self)
        else:
            self._client._renewer.watch()
        self._client._renewer.granted(started)

    def _reentered(self, count: int) -> int:
        """The entries held once a re-entry is granted: one more. The backend may count
        more (see _uncounted_entries), or fewer (its count is then the one to follow)."""
        entered = self._count + 1
        if count > entered:
            self._uncounted_entries(count - entered)
        return min(count, entered)

    def _uncounted_entries(self, surplus: int) -> None:
        """The backend has ``surplus`` entries of the hold beyond this object's count:
        re-entries cut off in flight that it applied all the same, which nobody holds
        (counted, they outlived every holder's release). Given back with the hold."""
        if self._uncounted_in != self._generation:
            self._uncounted_in, self._uncounted = self._generation, 0
        self._uncounted = max(self._uncounted, surplus)

    def _note_entry(self) -> None:
        """Record in the running acquire call that it entered the current hold."""
        call = _ACQUIRE_CALL.get()
        if call is not None:
            call.generation = self._generation

    def _write_started(self, started: float, ttl: float) -> int:
        """Note a lease write (extend, renewal) about to be sent; see _write_done."""
        bound = started + ttl
        with self._writes_guard:
            self._write_key += 1
            cap = bound
            for write in self._writes.values():
                write[1] = min(write[1], bound)
                cap = min(cap, write[0])
            self._writes[self._write_key] = [bound, cap]
            return self._write_key

    def _write_done(self, key: int) -> float:
        """The latest deadline that write ``key`` may set. Writes that overlap may be
        applied by the backend in either order, whatever order their answers come in:
        the lease is only sure to last until the earliest of their ``sent + ttl``."""
        with self._writes_guard:
            return self._writes.pop(key)[1]

    def _lease_end(self, started: float, ttl: float, cap: float = math.inf) -> float:
        """Until when a lease written at ``started`` for ``ttl`` surely lasts."""
        unanswered = self._unanswered_ttl
        if unanswered is not None:
            # Such a write may still be applied after this one: the lease then ends
            # its TTL after that, at least as long after ``started``.
            ttl = min(ttl, unanswered)
        return min(started + ttl, cap)

    def _lease_renewed(self, started: float, ttl: float, cap: float = math.inf) -> None:
        self._deadline = self._lease_end(started, ttl, cap)
        self._lease_ttl = self._deadline - started
        self._renew_at = started + self._lease_ttl * RENEW_AFTER

    def _unanswered(self, ttl: float) -> None:
        """A write under our owner token (TTL ``ttl``) got no answer: failed, cut off or
        timed out in flight. The backend may still apply it at any later time (a request
        held up in the network, a paused server), to whatever lease the token has then,
        so every lease this token holds later is counted to last at most ``ttl`` (see
        _lease_renewed), until a fresh hold takes a new token (_take_new_token)."""
        with self._writes_guard:
            known = self._unanswered_ttl
            self._unanswered_ttl = ttl if known is None else min(known, ttl)
            if ttl == math.inf:
                self._unanswered_release = True

    def _lease_unsure(self, started: float, ttl: float, cap: float) -> None:
        """A lease write (extend, renewal) whose outcome is unknown (failed, cancelled or
        timed out in flight) may have been applied all the same, and shortened the lease:
        it may now end as early as that write set it (``cap`` from _write_done)."""
        if self._count and min(started + ttl, cap) < self._deadline:
            self._lease_renewed(started, ttl, cap)
            if self.auto_renew:
                # Due sooner now, perhaps: confirm it before it runs out.
                self._client._renewer.reschedule(self)

    @notices_fork
    async def release(self) -> None:
        """Leave the lock once (a reentrant lock is freed by its last release).

        Raises :class:`NotOwner` if this object does not hold it, and :class:`LockLost`
        if its lease ended before the release reached the backend. A release that fails
        or is cancelled raises too, and this object no longer holds nor renews the lease
        (it is given back in the background, else ends by its TTL); if it was not the
        last entry, the hold is declared lost, as its other entries' holders believe in it.
        """
        self._check_forked()
        if not self._count and not self._lost_entries:
            raise self._not_owner()
        if self.lost:
            raise await self._give_up_lost(told=True)
        if cancel_requests():
            await self._cancel_pending_before_release()
        cancels = cancel_requests()
        if self.reentrant:
            generation = self._generation
            try:
                await self._take_count_turn()
            except BaseException:
                # Cut off (cancelled) while another user re-entered or released: as a
                # release cut off in flight, it ends the hold.
                if generation == self._generation and self._count:
                    self._release_failed(generation, self._count == 1)
                raise
        try:
            outcome, generation, last = await self._release_counted()
        finally:
            if self.reentrant:
                self._end_count_turn()
        # A loss is told once out of the turn: on_lost may re-enter or release the lock
        # itself (in another thread, while the telling holds _loss_lock).
        if outcome is _LOST:
            raise await self._give_up_lost(told=True)
        if outcome is _CLOSED:
            raise self._lost_error("its client was closed", generation)
        if isinstance(outcome, BaseException):
            self._release_failed(generation, last)
            if gives_way_to_a_cancel(outcome) and cancel_requests() > cancels:
                await lost_cancel(outcome)  # lost before it failed: see _enter
            raise outcome
        if outcome is _GONE:
            reason = "the lease had ended (expired, taken over, or with its session) before release"
            error = self._lost_error(reason, generation)
            # Forgotten here, unless another user's release has forgotten it already.
            if generation == self._generation:
                self._leave_lost_entry()
                self._forget()
            raise error
        if cancel_requests() > cancels:
            # Released, and the caller's cancellation lost by a client library meanwhile.
            await lost_cancel()

    async def _cancel_pending_before_release(self) -> None:
        """A cancellation requested while the task was ready to run (``cancel()`` then
        ``release()`` in one step, or in a body that ends its ``async with``): let it
        stop the release here. Sent on, a client library may drop it (redis-py's
        ``wait_for`` before Python 3.12), and the task ran on as if never cancelled (a
        helper's audit). Stopped here, the release is cut off before it is sent, and as
        any release cut off it ends the hold, given back in the background. (Nothing
        happens for one that was delivered already: a cleanup in ``except
        CancelledError`` releases as usual.)"""
        generation = self._generation
        try:
            await sleep(0)
        except BaseException:
            if generation == self._generation and self._count:
                self._release_failed(generation, self._count == 1)
            raise

    async def _release_counted(self) -> tuple[Any, int, bool]:
        """release()'s round trip and count, in the count's turn for a reentrant lock:
        what is held is looked at again, as another user may have left it meanwhile.
        Returns what came of it, for release() to tell once out of the turn (_LOST,
        _CLOSED, _GONE, the exception the backend raised, or None: released), the
        hold's generation, and whether this was its last entry."""
        if not self._count and not self._lost_entries:
            raise self._not_owner()
        generation, last = self._generation, self._count == 1
        if self.lost:
            return _LOST, generation, last
        if last:
            # Renewal stops before the last release is sent: a renewal applied after it
            # would find the lease gone and tell a loss of a lock released cleanly.
            self._client._renewer.discard(self)
        # Either close() sees this call and lets it end first (a clean end), or this call
        # sees the close giving back the holds: this one is the close's to give back
        # and to declare lost (which it may have done already), not sent from here.
        # Told once out of the close's sight: an on_lost that closes the client too must
        # not wait for this call.
        call = self._client._call_starts()
        try:
            if self._client._closing_holds:
                return _CLOSED, generation, last
            # Counted as an attempt in flight (under the same owner token): a give-back
            # of this hold, ended meanwhile by another user's cut-off release, waits for
            # this one to end. Sent alongside, it was a second release of the same hold
            # at once, which a backend whose release takes two steps (SQL session mode:
            # count, then unlock) answered from the same count: neither unlocked.
            while (give_back := self._attempt_starts()) is not None:
                await wait_done(give_back)
            try:
                try:
                    remaining = await self._client._backend.release(self.name, self._token)
                    # Counted in the same guard: a Ctrl-C between the answer and its
                    # count left the object holding the lock it had released.
                    if remaining is not None and generation == self._generation and self._count:
                        self._count_released(remaining, last)
                except BaseException as exc:
                    self._unanswered(math.inf)
                    return exc, generation, last
                if remaining is None:
                    return _GONE, generation, last
                return None, generation, last
            finally:
                # A give-back left meanwhile goes now, once the count is this answer's.
                self._attempt_ends()
        finally:
            self._client._call_ends(call)

    def _count_released(self, remaining: int, last: bool) -> None:
        """Count a release's answer (``remaining`` entries on the backend), unless
        another user of this object ended the hold while it was in flight (a loss given
        up): that answer is older than the end, and must not revive the hold, nor count
        a fresh one taken since (the caller checks).

        In the count's turn no re-entry of this object is in flight: entries that the
        backend has beyond this object's count were entered by re-entries cut off in
        flight, applied after their callers were told they failed. Nobody holds them
        (kept, the hold was renewed for good after its holders left it): the last
        release gives them back, counted to give back as the hold ends (see _abandon)."""
        left = min(self._count - 1, remaining)
        if remaining > left:
            self._uncounted_entries(remaining - left)
            if not left:
                with self._sharing:
                    self._to_give_back = max(self._to_give_back, remaining)
                    self._count = 0
        self._count = left
        if not left:
            if not last:
                self._client._renewer.discard(self)
            self._client._let_go(self)
            if self._changed is not None:
                self._wake_sharers()

    def _release_failed(self, generation: int, last: bool) -> None:
        """A release of hold ``generation`` failed or was cut off: that ends the whole
        hold. If its other entries' holders (an outer block, another task) still believe
        in it, that is a loss, told as one, and their own releases raise LockLost (see
        _undo_entry). Not a fresh hold that another user took meanwhile."""
        if generation != self._generation:
            return
        told = not last
        if told:
            self._leave_lost_entry()
        try:
            if told:
                self._declare_lost("a release of one of its entries failed", True)
        finally:
            # With the entries that re-entries cut off may have added: given back until
            # the backend says none is left.
            uncounted = self._uncounted if self._uncounted_in == generation else 0
            self._abandon(self._count + uncounted)

    @notices_fork
    async def extend(self, ttl: float | None = None) -> None:
        """Make the lease end ``ttl`` seconds from now (default: the lock's own TTL)."""
        seconds = self.ttl if ttl is None else check_ttl(ttl)
        self._check_forked()
        if not self._count:
            raise self._not_owner()
        generation = self._generation
        if self.lost:
            raise self._lost_error("the lease ran out before it could be extended", generation)
        if cancel_requests():
            await sleep(0)  # one pending stops us here: see _cancel_pending_before_release
        started = self._client._clock()
        write = self._write_started(started, seconds)
        cancels = cancel_requests()
        try:
            extended = await self._client._backend.extend(self.name, self._token, seconds)
        except BaseException as exc:
            self._unanswered(seconds)
            self._lease_unsure(started, seconds, self._write_done(write))
            if gives_way_to_a_cancel(exc) and cancel_requests() > cancels:
                await lost_cancel(exc)  # lost before it failed: see _enter
            raise
        cap = self._write_done(write)
        if not self._count or self._generation != generation:
            # Released meanwhile by another user of this object (and perhaps acquired
            # again): the answer is not about the hold there is now, if any. The write
            # may have reached that one all the same, under the same owner token.
            self._lease_unsure(started, seconds, cap)
            if not extended:
                raise NotOwner(f"lock {self.name!r} was released while it was being extended")
        elif not extended:
            reason = "the lease had ended (expired, taken over, or with its session) before extend"
            raise self._lost_error(reason, generation)
        else:
            self._lease_renewed(started, seconds, cap)
            if self._lost:
                # Told lost while the extend was on its way (at its deadline): its answer
                # came too late to keep the hold, which the holder was told is gone. Not
                # renewed either: it would be kept for good by a holder told it had lost it.
                raise self._lost_error("the lease ran out before it could be extended", generation)
            if self._client._clock() >= self._deadline:
                # Answered no sooner than the lease it set ended, counted from when it
                # was sent (a backend stalled that long): lost on arrival, as a fresh
                # grant answered so late holds nothing (see _answered).
                reason = f"the extend was answered after the {seconds:g} s lease it set ran out"
                raise self._lost_error(reason, generation)
            if self.auto_renew:
                # A shorter lease is due sooner than the renewer's sleep ends: wake it.
                self._client._renewer.add(self)
        if cancel_requests() > cancels:
            await lost_cancel()  # extended, and the cancellation lost meanwhile

    def _lease(self, ttl: float) -> Lease:
        return Lease(self.name, self._token, ttl)

    def _declare_lost(
        self,
        reason: str,
        told: bool = False,
        watchdog: bool = False,
        generation: int | None = None,
        forget: bool = False,
        closing: bool = False,
    ) -> bool:
        """Record the loss once and tell the holder: flag, callback, and task cancel.
        True if this call declared it, False if it was declared already.

        ``generation``: the hold that the caller found lost. Another thread may have
        ended it and taken a fresh hold since the caller looked: that one is not lost.
        Checked under _sharing, under which _granted starts a hold, so no fresh hold can
        slip in between the check and the flag.

        ``forget``: the caller gives the hold up (see _give_up_lost): it is forgotten
        once the flag is up, declared or not, and before the holder is told. Flagged
        first: a fresh hold that another user of this object takes as soon as the hold
        is forgotten must not turn this declaration into one about an ended hold, which
        would tell nobody of the loss.

        ``closing``: the client's close() declares it (see AsyncClient.aclose), the
        program's own doing: logged as information, not as a warning.

        ``told``: the caller raises :class:`LockLost` into the running task, which is
        then not cancelled as well (a body re-entering, releasing or extending its own
        lock): the cancellation would stop it again once it handled the loss, or, lost
        by a client library, stay counted against it.

        The flag goes up first, so that ``owned()`` turns false as early as possible.
        Every path that raises :class:`LockLost` comes through here, and a declaration
        holds ``_loss_lock`` until ``on_lost`` has run: with threads, the renewer may be
        declaring while the holder leaves its block, and the holder must not see
        LockLost before its callback was told.
        """
        with self._loss_lock:
            bodies: list[Any] = []
            with self._sharing:
                declared = not self._lost and generation in (None, self._generation)
                if declared:
                    self._lost = True
                    self._lost_reason = reason
                    # The bodies of this hold's blocks: not one whose own hold was
                    # lost before and that goes on (it caught that cancellation),
                    # while another user of this object took this one afresh.
                    bodies = [
                        task for task, _, held in self._blocks if held in (None, self._generation)
                    ]
            if forget:
                self._leave_lost_entry()
                self._forget()
            if not declared:
                return False
            self._client._renewer.discard(self)
            log = logger.info if closing else logger.warning
            log(LOST_MESSAGE, self.name, reason)
            if self.on_lost is not None:
                telling = _WATCHDOG_TELLING.set(watchdog)
                try:
                    returned = self.on_lost(self)
                    if inspect.iscoroutine(returned):
                        # A plain function that made a coroutine (``lambda lock:
                        # notify(lock)``): not awaited, its body would never run.
                        returned.close()
                        logger.error(
                            "dlock: on_lost callback for %r returned a coroutine, which is"
                            " not awaited: the loss was told to nobody",
                            self.name,
                        )
                except Exception:
                    logger.exception("dlock: on_lost callback for %r failed", self.name)
                except BaseException:
                    # sys.exit() in a callback run by the renewer would end it, and every
                    # other lease of the client would lapse untold.
                    if not watchdog:
                        raise
                    logger.exception("dlock: on_lost callback for %r raised", self.name)
                finally:
                    _WATCHDOG_TELLING.reset(telling)
            if self.cancel_on_lost:
                running = current_task() if told else None
                for task in dict.fromkeys(self._body_tasks):
                    if task is not None and task is not running and task in bodies:
                        self._cancelled.add(task)
                        cancel_task(task, f"dlock: lost lock {self.name!r}")
            return True

    def _lost_error(
        self, reason: str, generation: int, told: bool = True, forget: bool = False
    ) -> LockLost:
        """Declare hold ``generation`` lost (see _declare_lost) and return the error that
        tells its holder why: for the reason it was declared lost first, if it was."""
        declared = self._declare_lost(reason, told, generation=generation, forget=forget)
        if not declared and generation == self._generation and self._lost_reason:
            reason = self._lost_reason
        return LockLost(f"lock {self.name!r} was lost: {reason}")

    def _ran_out(self) -> str:
        """Why a lease that ran out on this holder's clock is lost."""
        return LEASE_RAN_OUT if self.auto_renew else UNRENEWED_LEASE_RAN_OUT

    def _leave_lost_entry(self) -> None:
        """One entry of a lost hold is left (released, its block ended), the hold given
        up: the holder's other entries are still to be left, each told as a loss too.
        Nested blocks and paired acquire/release calls then each see LockLost, not a
        NotOwner that code catching LockLost misses."""
        if self._count:
            self._lost_entries = self._count - 1
        elif self._lost_entries:
            self._lost_entries -= 1

    def _forget(self) -> None:
        self._count = 0
        self._client._renewer.discard(self)
        self._client._let_go(self)
        if self._changed is not None:
            self._wake_sharers()

    def _abandon(self, entries: int | None = None) -> None:
        """A release that did not complete (failed, cancelled, interrupted) still ends
        this object's hold: renewing a lease that its holder tried to leave would keep
        it until the client closes. Forget it, and give it back in the background
        (owner-checked); if that fails too, the lease ends by its TTL. ``entries``: a
        grant not yet counted (see _attempt)."""
        entries = self._count if entries is None else entries
        self._check_forked()
        with self._sharing:
            # Counted to give back as the hold is forgotten, not after: in between,
            # another user of this object took a new owner token (_take_new_token), and
            # the give-back went out under it (a helper's chaos run, threads).
            self._to_give_back = max(self._to_give_back, entries)
            self._count = 0
            self._settle_give_back()
        self._forget()

    async def _give_up_lost(self, told: bool) -> LockLost:
        """Forget a lost lease and return the error to raise. A lease that ran out on our
        clock before the backend or renewer said so is declared lost now.

        The lease is given back even when the loss was declared already: a loss declared
        by our clock alone never reached the backend, which may still keep state for it
        (SQL session mode: the connection holding the database's lock) and would answer
        this object's next acquire, and everyone else's, with busy."""
        client, token, generation = self._client, self._token, self._generation
        mine = client._give_up(self, self._count, token)
        if mine:
            self._token_given_up = token
        try:
            # Its on_lost may close the client: close() then gives the lease back while
            # the backend is still open, and nothing is left for this give-up to send.
            # Forgotten there, once the loss is flagged and before it is told.
            error = self._lost_error(self._ran_out(), generation, told, forget=True)
            if _WATCHDOG_TELLING.get():
                # An on_lost run by the watchdog releases: the watchdog must not wait for
                # the backend (it may be stuck behind the very renewal the watchdog gave
                # up on), or the losses of the client's other leases would be told late.
                self._abandon(client._still_to_give_up(self) if mine else 0)
            elif mine:
                await self._give_back_lost(token)
        finally:
            if mine:
                self._token_given_up = None
                client._given_up(self)
        return error

    async def _give_back_lost(self, token: str) -> None:
        """Give back the lost hold that _give_up_lost forgot (under its owner ``token``),
        as _release_quietly does, unless and until close() takes it over: a closed
        backend must not be reopened by a round trip after the close (SQLite would open
        its file again, for good).

        Not while another user of this object has an attempt in flight under that same
        token (a re-entry of the lost hold): the fresh hold that the object may take
        meanwhile cannot take a token of its own (see _take_new_token), and the release
        would free it. Left to that attempt's end then, as _give_back_later does: given
        back in the background, or dropped if the object holds the lock again."""
        given = 0
        while left := self._client._still_to_give_up(self, given):
            with self._sharing:
                if self._attempts and self._token == token:
                    self._to_give_back = max(self._to_give_back, left)
                    return
            started = self._client._clock()
            answered = await self._release_once(token)
            if answered is None:
                waited = self._client._clock() - started
                self._client._retrier.add(self, token, left, waited)
            if not answered:
                return
            given = 1

    async def _release_quietly(self, entries: int, token: str) -> int:
        """Give back up to ``entries`` entries of a reentrant lease under ``token``,
        owner-checked, so harmless if it is gone; stop at the first answer that nothing
        is left. Returns how many entries got no answer (a call failed): the caller may
        have them asked again (see AsyncGiveBackRetrier)."""
        for given in range(entries):
            left = await self._release_once(token)
            if left is None:
                return entries - given
            if not left:
                return 0
        return 0

    async def _release_once(self, token: str) -> bool | None:
        """One best-effort release under ``token``: True if entries are left to give back,
        None if it failed. One that fails may still be applied later, to whatever lease
        the token has then (see _unanswered); a token this object no longer uses has
        none that matters."""
        try:
            return bool(await self._client._backend.release(self.name, token))
        except BaseException as exc:
            # Cut off (Ctrl-C, a cancellation) as much as failed: sent, it may be applied.
            if token == self._token:
                self._unanswered(math.inf)
            if not isinstance(exc, Exception):
                raise
            logger.debug("dlock: best-effort release of %r failed", self.name, exc_info=True)
            return None

    async def __aenter__(self) -> AsyncLock:
        call = _Call()
        task: Any = None
        try:
            if not await self._enter(self.timeout, call):
                raise LockTimeout(f"lock {self.name!r} not acquired within {self.timeout} s")
            task = current_task()
            self._body_tasks.append(task)
        except BaseException:
            # Interrupted after the acquire returned (Ctrl-C): the block raises before its
            # body, so __exit__ never runs and nobody would release what was taken. Only
            # what this block took: an AlreadyAcquired or a timeout took nothing, and the
            # hold is another user's of this object.
            if task is not None and task in self._body_tasks:
                self._body_tasks.remove(task)
            await self._undo_entry(call)
            raise
        with self._sharing:
            self._blocks.append((task, threading.get_ident(), call.generation))
        return self

    def _leave_block(self, task: Any) -> int | None:
        """Forget the innermost ``with`` block of ``task`` in this thread; the hold it
        entered (None if not known)."""
        me = threading.get_ident()
        with self._sharing:  # other threads' blocks come and go meanwhile
            for index in range(len(self._blocks) - 1, -1, -1):
                if self._blocks[index][:2] == (task, me):
                    return self._blocks.pop(index)[2]
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _fork.current()
        self._check_forked()
        if self._parents_entries:
            # Entered before a fork, ending in the child: the hold is the parent's.
            self._parents_entries -= 1
            return
        # Only this block's entry goes: an outer block of a reentrant lock is still
        # to be cancelled on loss.
        task = current_task()
        if task in self._body_tasks:
            self._body_tasks.remove(task)
        entered = self._leave_block(task)
        cancelled_by_us = task in self._cancelled
        self._cancelled.discard(task)
        # Our cancellation of the body is undone whether the body let it end the block
        # or caught it: left counted, an enclosing asyncio.timeout() took a timeout of
        # its own for a cancellation from outside. A cancellation of the program's own
        # goes on as it came (the loss is told by on_lost and ``lost``): turned into
        # LockLost, the task ended with an error instead of cancelled, and a TaskGroup
        # or timeout() around it could not tell. So do Ctrl-C, sys.exit() and a
        # generator's close (on either face): turned into LockLost, an `except LockLost`
        # retry loop would swallow them.
        raise_loss = cancelled_by_us or exc is None or isinstance(exc, Exception)
        if entered is not None and entered != self._generation:
            # The block's hold was lost and given up, and another user of this object
            # has taken a fresh one since: that hold is theirs to leave.
            if cancelled_by_us:
                uncancel(task)
            if not raise_loss:
                return
            raise LockLost(
                f"lock {self.name!r} was lost: its hold ended while the block ran"
            ) from exc
        if self.lost:
            lost = await self._give_up_lost(told=True)
            if cancelled_by_us:
                uncancel(task)
            if not raise_loss:
                return
            raise lost from exc
        await self.release()


class _HoldEnded(Exception):
    """A re-entry's hold ended before its turn came (see _attempt)."""


#: An attempt's answer when another user of the lock object holds it (no round trip).
_SHARER_HOLDS = Busy()
#: A re-entry's answer when the backend no longer has the hold it re-entered.
_HOLD_GONE = Busy()
#: A re-entry's answer when it came after the lease it set ran out (see _answered_late).
_RAN_OUT = Busy()
#: What a release came to, to be told out of the count's turn (see release): the hold
#: was lost before it was sent; the client was closing; the backend had no lease.
_LOST, _CLOSED, _GONE = object(), object(), object()

#: True while the watchdog (renewer, alarm) runs an on_lost callback in this thread or
#: task: a release from there gives back in the background (see _give_up_lost).
_WATCHDOG_TELLING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dlock_watchdog_telling", default=False
)


class _Call:
    """One acquire call (or ``with`` entry) of a lock object that threads or tasks may
    share: what it took is its own to undo, never another user's entry."""

    __slots__ = ("cancels", "generation", "outer", "user", "within")

    def __init__(self) -> None:
        #: The hold (see AsyncLock._generation) that this call entered, if it did and
        #: has not undone the entry.
        self.generation: int | None = None
        #: The acquire call that this one runs inside (from an on_lost it told), if any.
        self.outer: _Call | None = None
        #: The task and thread that run this call, and the seeker whose turn it took
        #: over (see AsyncLock._take_turn), if it is a fresh acquire.
        self.user: tuple[Any, int] = (None, 0)
        self.within: _Call | None = None
        #: The running task's pending cancellations as the call began (_still_wanted).
        self.cancels = 0


#: The acquire call running in this thread or task, which a grant is recorded for.
_ACQUIRE_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "dlock_acquire_call", default=None
)
