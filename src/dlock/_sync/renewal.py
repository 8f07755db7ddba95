# DO NOT EDIT: generated from src/dlock/_async/renewal.py by scripts/unasync.py.
"""The renewal watchdog: one per client, renewing all of its held leases in batches."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from .._errors import LEASE_RAN_OUT, BackendError, in_words
from .._fork import ForkFollower
from ._primitives import (
    WakeupEvent,
    alarm,
    call_with_timeout,
    can_spawn,
    join,
    serving,
    spawn,
)

if TYPE_CHECKING:
    from .backend import Backend
    from .lock import Lock

logger = logging.getLogger("dlock")

#: A lease due within this share of its TTL is renewed together with one due now.
BATCH_EARLY = 1 / 6
#: After a failed renewal, try again after this share of the TTL (while the lease lasts).
RETRY_AFTER = 1 / 10
#: Seconds an idle renewer sleeps before looking again. Sleeping "until woken" instead
#: would make every acquire from idle wake it; with this, only a lease due sooner does.
IDLE_TICK = 1.0
#: The longest delay of the alarm that watches a renewal call in flight, however far
#: off the first lease's end: an hour's alarm costs nothing, and keeps its delay far
#: from a thread wait's limit (``threading.TIMEOUT_MAX``, about 9.2e9 s) whatever the TTL.
LONGEST_SLEEP = 3600.0
#: The longest sleep while leases are held. Sleeps (asyncio's timers, a thread's wait)
#: run on CLOCK_MONOTONIC, which stops while the host is suspended, but leases are
#: counted on the boot clock, which does not: after a resume, a lease that ran out
#: meanwhile is told lost within this, not when the sleep for its next renewal ends
#: (up to a third of its TTL later). One wake-up a second per client that holds locks.
RESUME_CHECK = 1.0


class Renewer:
    """Renews every auto-renewed lock of one client from a single task or thread.

    A thread (or task) per lock would cost thousands of wake-ups for thousands of locks;
    one loop that sleeps until the earliest due lease, then renews everything due soon
    in one ``extend_many`` call, costs one round trip per batch.
    """

    #: The backend calls :meth:`renew_now` when it learns that leases may be gone: then
    #: the held locks that are not renewed are asked about too (see _tell_known_losses).
    told_of_losses = False

    def __init__(
        self,
        backend: Backend,
        clock: Callable[[], float],
        held: Callable[[], Sequence[Lock]],
    ) -> None:
        self._backend = backend
        self._clock = clock
        #: Every lock of the client holding a lease, renewed here or not.
        self._held = held
        self._locks: set[Lock] = set()
        self._wakeup = WakeupEvent()
        self._runner: Any = None
        #: Held while the loop is started: see _start.
        self._starting = threading.Lock()
        #: Bumped whenever a new runner starts; an older runner that resumes stops.
        self._epoch = 0
        self._follow_fork = ForkFollower(self._forget_parent)
        self._closed = False
        #: The client is closing (see wind_down).
        self._winding_down = False
        self._urgent = False
        #: When the backend last called :meth:`renew_now` (the client's clock).
        self._told_at = -math.inf
        #: When the loop will next wake by itself (inf: it is busy right now).
        #: A lock due no earlier needs no wake-up: waking a thread per acquire costs
        #: about as much as the acquire's own round trip on a small machine.
        self._sleeping_until = math.inf
        #: While a renewal call is in flight: has its alarm look at the leases again
        #: soon, one added meanwhile perhaps ending before it would ring (see add).
        self._ring_soon: Callable[[], None] | None = None

    def _forget_parent(self) -> None:
        """In a forked child: the leases in the set are its parent's to renew (renewing
        them here would keep them alive after the parent died), and the renewer thread
        or task stayed behind in the parent, as may have a thread holding the guard."""
        self._locks, self._runner = set(), None
        self._starting = threading.Lock()

    def add(self, lock: Lock) -> None:
        self._follow_fork()
        self._locks.add(lock)
        if self._closed:
            return
        if not serving(self._runner):
            # None yet, or one that died, stayed in a fork's parent, or belongs to an
            # event loop that has ended (a client used by two asyncio.run calls).
            self._start()
        elif lock._renew_at < self._sleeping_until:
            self._wakeup.set()
            self._alarm_looks_again()

    def _start(self) -> None:
        """Start the loop unless it runs. Checked again under a guard: threads making
        their first grants at once each saw none running, and each started one."""
        with self._starting:
            if serving(self._runner):
                return
            # The old event may belong to an ended loop, or (threads) hold an internal
            # lock taken by a thread that stayed in a fork's parent.
            self._wakeup = WakeupEvent()
            self._sleeping_until = math.inf
            self._epoch += 1
            self._runner = spawn(partial(self._run, self._epoch), name="dlock-renewer")

    def resume(self) -> None:
        """Start the loop again if it is not running while leases are held. Under
        asyncio its task ends with the event loop it ran in (a client used by two
        ``asyncio.run`` calls), and the holds carried into the next loop were neither
        renewed nor told lost there until a new lease started it. Called as each call
        of a lock starts: a loop that makes no call of dlock's cannot be helped."""
        self._follow_fork()
        if self._closed or serving(self._runner) or not can_spawn():
            return
        if self._locks or (self._hears_losses() and self._held()):
            self._start()

    def watch(self) -> None:
        """A lock not renewed here was granted: when the backend says that leases may
        be gone, or knows it without being asked (``knows_losses``), its holder must be
        told too, so this loop must run to hear it."""
        if not self._hears_losses():
            return  # on every grant of such a lock: nothing more where nothing is told
        self._follow_fork()
        if not self._closed and not serving(self._runner):
            self._start()

    def _hears_losses(self) -> bool:
        """Whether this loop learns of losses of leases it does not renew."""
        return self.told_of_losses or self._backend.knows_losses

    def reschedule(self, lock: Lock) -> None:
        """Wake the loop if ``lock``, still renewed here, is now due before it wakes."""
        if lock in self._locks and lock._renew_at < self._sleeping_until:
            self._wakeup.set()
            self._alarm_looks_again()

    def _alarm_looks_again(self) -> None:
        """A lease was added or shortened: if a renewal call is in flight, the renewer
        cannot renew it meanwhile, and the call's alarm must tell its loss at its
        deadline, which may come before the alarm would ring (a 1 s lease taken while
        the call for a 30 s one is stuck)."""
        ring_soon = self._ring_soon
        # Not one left by a runner of an event loop that has ended: its loop is closed.
        if ring_soon is not None and serving(self._runner):
            ring_soon()

    def discard(self, lock: Lock) -> None:
        self._locks.discard(lock)

    def renew_now(self) -> None:
        """Re-check every held lease at once. Safe from any thread (a backend's own)."""
        self._told_at = self._clock()
        self._urgent = True
        self._wakeup.set()

    def granted(self, started: float) -> None:
        """A hold whose attempt was sent at ``started`` now counts as held. If the
        backend told of losses since, the re-check it asked for may have run before
        (a session that ended just after the grant) and missed this hold: ask again."""
        if self._told_at >= started:
            self.renew_now()

    def wind_down(self) -> None:
        """The client is closing: the holds are about to be given back, so none is
        renewed any more (a renewal begun against a server that stopped answering
        would hold the close up, which joins this loop), but a lease that runs out
        meanwhile is still told lost at its end."""
        self._winding_down = True
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        runner, self._runner = self._runner, None
        if serving(runner):
            join(runner, timeout=5.0)

    def _run(self, epoch: int) -> None:
        while not self._closed and epoch == self._epoch:
            self._sleeping_until = math.inf
            self._wakeup.clear()
            try:
                self._renew_due()
            except Exception:
                # A bug (a backend's or ours): this loop is all that renews and tells
                # the client's leases, so it must not end with it.
                logger.exception("dlock: a renewal round failed unexpectedly; will retry")
                self._round_failed()
            delay = self._next_wakeup()
            self._sleeping_until = self._clock() + delay
            self._wakeup.wait(delay)

    def _next_wakeup(self) -> float:
        locks = tuple(self._locks)
        if not locks:
            return IDLE_TICK
        now = self._clock()
        if self._winding_down:
            due = min(lock._deadline for lock in locks)
        else:
            due = min(min(lock._renew_at, lock._deadline) for lock in locks)
        return min(RESUME_CHECK, max(0.0, due - now))

    def _renew_due(self) -> None:
        now = self._clock()
        urgent, self._urgent = self._urgent, False
        if self._backend.knows_losses:
            self._tell_known_losses(tuple(self._held()))
        elif urgent:
            self._tell_known_losses([lock for lock in self._held() if lock not in self._locks])
        due: list[tuple[Lock, int]] = []
        early: list[tuple[Lock, int]] = []
        for lock in tuple(self._locks):
            # The generation first: a fresh hold sets its deadline before its generation.
            generation = lock._generation
            if now >= lock._deadline:
                lock._declare_lost(LEASE_RAN_OUT, watchdog=True, generation=generation)
            elif urgent or lock._renew_at <= now:
                due.append((lock, generation))
            elif lock._renew_at - lock._lease_ttl * BATCH_EARLY <= now:
                early.append((lock, generation))
        if due:
            # Only along with one due now: the wake-up every RESUME_CHECK is no renewal's.
            due += early
        if not due or self._closed or self._winding_down:
            # Closed by an on_lost told just above (threads): its close gave the leases
            # back, and a call now would reopen the backend (SQLite: the file, for good).
            return
        started = self._clock()
        time_left = min(lock._deadline for lock, _ in due) - started
        # A renewal never shortens a lease: one the holder extended past the lock's TTL
        # (extend(600) ahead of a long blocking call) keeps the end it was promised.
        ttls = [max(lock.ttl, lock._deadline - started) for lock, _ in due]
        # The alarm watches every held lease, not just this batch's: while the call is
        # stuck, a short lease that is not yet due runs out too, and must be told then.
        first_end = min((lock._deadline for lock in tuple(self._locks)), default=math.inf)
        writes = [
            lock._write_started(started, ttl) for (lock, _), ttl in zip(due, ttls, strict=True)
        ]
        try:
            alarm_in = min(time_left, first_end - started, LONGEST_SLEEP)
            with alarm(alarm_in, self._declare_overdue) as self._ring_soon:
                try:
                    renewed = call_with_timeout(
                        self._backend.extend_many(
                            [lock._lease(ttl) for (lock, _), ttl in zip(due, ttls, strict=True)]
                        ),
                        time_left,
                    )
                    if len(renewed) != len(due):
                        # Which answer is whose is unknown: as a renewal not answered.
                        raise TypeError(
                            f"extend_many answered {len(renewed)} results for {len(due)} leases"
                        )
                finally:
                    self._ring_soon = None
        except BaseException as exc:
            for (lock, _), ttl, write in zip(due, ttls, writes, strict=True):
                self._retry_later(lock, started, ttl, lock._write_done(write))
            if not isinstance(exc, Exception):
                raise
            # Unreachable or slow backend: keep trying until each lease's own deadline.
            log = (
                logger.warning
                if isinstance(exc, (BackendError, TimeoutError))
                else logger.exception
            )
            # Say how big and how late the round was: a lease lost this way is told
            # from this line whether the backend was slow or the renewer started late.
            left = any(lock._count > 0 and not lock.lost for lock, _ in due)
            log(
                "dlock: renewing %d lease(s) failed after %.3f s, begun %.3f s before "
                "the first of them ends; %s: %s",
                len(due),
                self._clock() - started,
                time_left,
                "will retry while they last" if left else "they ran out meanwhile",
                in_words(exc),
            )
            return
        caps = [lock._write_done(write) for (lock, _), write in zip(due, writes, strict=True)]
        unasked = 0
        for (lock, generation), ttl, ok, cap in zip(due, ttls, renewed, caps, strict=True):
            if lock not in self._locks or lock._generation != generation:
                # Released (and perhaps re-acquired) while we were renewing: the answer
                # is not about the hold there is now, which the write may have reached.
                lock._lease_unsure(started, ttl, cap)
                continue
            if ok is None:
                # Its server could not be asked (see extend_many): as a failed renewal.
                self._retry_later(lock, started, ttl, cap)
                unasked += 1
            elif ok:
                lock._lease_renewed(started, ttl, cap)
            else:
                reason = self._backend.refused_renewal
                lock._declare_lost(reason, watchdog=True, generation=generation)
        if unasked:
            logger.warning(
                "dlock: renewing %d of %d lease(s) failed: their server could not be asked;"
                " will retry while they last",
                unasked,
                len(due),
            )

    def _retry_later(self, lock: Lock, started: float, ttl: float, cap: float) -> None:
        """A renewal with no answer may have been applied all the same (an answer lost,
        a call cut short): the lease may now end as early as it set. Tried again soon,
        until the lease's deadline: after a tenth of the lease's length where it is
        shorter than the TTL (an extend(1) of a 30 s lock, a lease handed over for a
        place's length), else its one retry came at the deadline, when it was lost."""
        lock._unanswered(ttl)
        lock._lease_unsure(started, ttl, cap)
        self._retry_soon(lock)

    def _retry_soon(self, lock: Lock) -> None:
        every = min(lock.ttl, lock._lease_ttl) * RETRY_AFTER
        lock._renew_at = min(lock._deadline, self._clock() + every)

    def _round_failed(self) -> None:
        """A round broke off unexpectedly, perhaps before it told the leases past their
        deadline: tell them now. Those it was to renew are retried as after a failed
        renewal, not at once: a bug that recurs would spin and flood the log."""
        self._declare_overdue()
        now = self._clock()
        for lock in tuple(self._locks):
            if lock._renew_at <= now:
                self._retry_soon(lock)

    def _tell_known_losses(self, locks: Iterable[Lock]) -> None:
        """Tell the loss of the held ``locks`` that the backend knows to be gone. After
        ``renew_now``, those not renewed (``auto_renew=False``): no renewal asks about
        them, and their TTL may end long after the backend let another client take the
        lock (a ZooKeeper session expired or given up). With ``knows_losses``, all of
        them, at each wake: a session lock's connection that the server closed freed the
        lock at once, and the next renewal may be a third of the TTL away. A local
        question: no round trip."""
        for lock in locks:
            if not lock._count or lock.lost:
                continue
            generation = lock._generation
            if self._backend.lease_lost(lock.name, lock._token):
                reason = self._backend.reported_lost
                lock._declare_lost(reason, watchdog=True, generation=generation)

    def _declare_overdue(self) -> float | None:
        """While a renewal call is still blocked, tell the loss of each held lease at its
        own deadline, not when the call gives up (a write-locked SQLite file: busy_timeout):
        those of the batch in flight, and those the blocked renewer cannot get to.
        Returns the time to the next deadline."""
        now = self._clock()
        pending = []
        for lock in tuple(self._locks):
            generation, deadline = lock._generation, lock._deadline
            if now < deadline:
                pending.append(deadline - now)
            elif lock in self._locks:
                lock._declare_lost(LEASE_RAN_OUT, watchdog=True, generation=generation)
        return min(LONGEST_SLEEP, *pending) if pending else None
