# DO NOT EDIT: generated from src/dlock/_async/giveback.py by scripts/unasync.py.
"""Give-backs asked again: a lease whose give-back failed is freed once the backend answers.

A release, or the give-back of an acquire cut off in flight, that fails in an outage
would otherwise leave its lease to end by its TTL, and keep the lock from everyone
until then: 30 s by default, and on etcd a TTL that starts afresh whenever a member
becomes leader, so a restart made it longer still.

So too, once, a give-back that answered: an acquire cut off in flight may reach the
backend after its give-back (held up in the network, or run on by MariaDB after its
connection was closed), and take a lease that nobody holds.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from .._fork import ForkFollower
from ._primitives import WakeupEvent, can_spawn, concurrently, join, serving, spawn

if TYPE_CHECKING:
    from .lock import Lock

#: Holds given back at once, by close() and by a round of the retrier.
GIVE_BACKS_AT_ONCE = 64
#: A failed give-back is asked again after about this many seconds; the delay doubles
#: after every round that is not answered, up to RETRY_MAX.
RETRY_FIRST = 0.2
RETRY_MAX = 2.0
#: How long a give-back is asked again; past that, its lease ends by its TTL.
RETRY_FOR = 300.0
#: How long close() waits for a round in flight (the sync face's thread cannot be
#: cancelled; what it had not been answered for is given back by close() itself).
CLOSE_JOIN = 1.0
#: A give-back that went unanswered for this long waited out a timeout: its backend
#: hangs, rather than refused or cut the connection (see close).
HUNG = 0.25
#: An acquire cut off in flight is given back once more this long after it was cut off
#: (see look_again): a request later than that is left to its lease's TTL.
LOOK_AGAIN_AFTER = 1.0

#: The jitter's source: the operating system's, as dlock.Backoff's and for the same
#: reasons: the random module's generator is the application's (a draw here would change
#: what a seeded, reproducible job draws next, and workers seeded alike would ask again
#: in lockstep).
_JITTER = random.SystemRandom()

#: A lease to give back: the lock object, how many entries, its owner token.
GiveBack = tuple["Lock", int, str]


def give_back_all(holds: Sequence[GiveBack]) -> list[int]:
    """Give back ``holds`` at once, a few dozen at a time, and return for each how many
    entries got no answer. Against a server that stopped answering each waits out its
    timeout; one after another they would take that once per hold. After a batch that
    got no answer at all, the rest are not sent: each batch would wait out the timeout
    again (a close with hundreds of holds, one timeout per batch)."""
    if len(holds) == 1:
        lock, entries, token = holds[0]
        return [lock._release_quietly(entries, token)]
    unanswered: list[int] = []
    for first in range(0, len(holds), GIVE_BACKS_AT_ONCE):
        batch = holds[first : first + GIVE_BACKS_AT_ONCE]
        results = concurrently(
            [partial(lock._release_quietly, entries, token) for lock, entries, token in batch],
            math.inf,
        )
        left = [
            result if isinstance(result, int) else entries
            for result, (_, entries, _) in zip(results, batch, strict=True)
        ]
        unanswered += left
        if left == [entries for _, entries, _ in batch]:
            return unanswered + [entries for _, entries, _ in holds[len(unanswered) :]]
    return unanswered


@dataclass
class _Left:
    entries: int
    #: When to stop asking (the client's clock).
    until: float
    #: When it last went unanswered (the client's clock).
    failed_at: float
    #: How long that took: a hung backend's timeout, or a prompt failure (see HUNG).
    waited: float


@dataclass
class _Look:
    """A give-back to ask once more later (see look_again)."""

    entries: int
    #: When to ask (the client's clock).
    due: float


class GiveBackRetrier:
    """Asks again, in the background, the give-backs that got no answer, until one does.

    One task (a thread in the sync face) per client, running only while some are left.
    Each round first asks one of them, a different one each round: only if the backend
    answers it are the others asked, so an outage costs one request per round, not one
    per lease. The delay between rounds doubles while any goes unanswered, with jitter,
    so that the clients of a backend that comes back do not all ask at once.

    Owner-checked releases under a token its lock object no longer uses (see
    :meth:`Lock._retire_token`): they free nothing but the lease left behind.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._left: dict[tuple[Lock, str], _Left] = {}
        self._looks: dict[tuple[Lock, str], _Look] = {}
        self._delay = RETRY_FIRST
        self._wakeup = WakeupEvent()
        self._runner: Any = None
        self._closed = False
        #: Threads add give-backs while the runner (a thread of its own) asks them.
        self._guard = threading.Lock()
        self._follow_fork = ForkFollower(self._forget_parent)

    def _forget_parent(self) -> None:
        """In a forked child: what is left is the parent's to give back."""
        self._left, self._looks, self._runner = {}, {}, None
        self._guard = threading.Lock()

    def add(
        self, lock: Lock, token: str, entries: int, waited: float = 0.0, start: bool = True
    ) -> None:
        """Ask again to give back ``entries`` entries of ``lock``'s lease under ``token``,
        which went unanswered after ``waited`` seconds."""
        self._follow_fork()
        with self._guard:
            if self._closed:
                return
            if not self._left:
                self._delay = RETRY_FIRST
            key, now = (lock, token), self._clock()
            known = self._left.get(key)
            if known is None:
                self._left[key] = _Left(entries, now + RETRY_FOR, now, waited)
            else:
                known.entries = max(known.entries, entries)
                known.failed_at, known.waited = now, waited
            if start:
                self._start()

    def look_again(self, lock: Lock, token: str) -> None:
        """An acquire of ``lock`` under ``token`` (a fresh one, or a re-entry) was cut off
        in flight: once ``lock`` no longer uses that token, give back an entry under it
        once more, a little later, whatever its give-back answered meanwhile. The request
        may reach the backend after that give-back, or after the hold's last release,
        and would leave a lease that nobody holds until its TTL.

        Dropped if ``lock`` then holds the lock under the token: that hold's release
        gives back the entries that the backend counts beyond it (its own answer says)."""
        self._follow_fork()
        with self._guard:
            if self._closed:
                return
            key, due = (lock, token), self._clock() + LOOK_AGAIN_AFTER
            known = self._looks.get(key)
            if known is None:
                self._looks[key] = _Look(1, due)
            else:
                known.entries, known.due = known.entries + 1, due
            self._start()

    def keep(self, lock: Lock, token: str, entries: int) -> None:
        """As :meth:`add`, for a give-back cut off as its event loop ends: a task
        started now would never run, so it is asked from the next loop (see
        :meth:`resume`) or by close()."""
        self.add(lock, token, entries, start=False)

    def resume(self) -> None:
        """Start asking again where give-backs are left and nothing asks them here (the
        task that did ended with its event loop). Called as each call of a lock starts."""
        self._follow_fork()
        if (self._left or self._looks) and can_spawn():
            with self._guard:
                if not self._closed:
                    self._start()

    def _start(self) -> None:
        """Under _guard. Not one of an event loop that has ended, or left in a fork's
        parent. Nor the old runner's event: it may belong to an ended loop."""
        if not serving(self._runner):
            self._wakeup = WakeupEvent()
            self._runner = spawn(self._run, name="dlock-give-back-retrier")

    def _run(self) -> None:
        while True:
            with self._guard:
                if self._closed or not (self._left or self._looks):
                    self._runner = None
                    return
                delay = self._delay * _JITTER.uniform(0.5, 1.0) if self._left else math.inf
                if self._looks:
                    first = min(look.due for look in self._looks.values())
                    delay = max(0.0, min(delay, first - self._clock()))
            self._wakeup.wait(delay)
            if self._closed:
                return
            answered = self._ask_again()
            with self._guard:
                self._delay = RETRY_FIRST if answered else min(self._delay * 2, RETRY_MAX)

    def _ask_again(self) -> bool:
        """One round; False if the backend did not answer."""
        now = self._clock()
        holds: list[GiveBack] = []
        deferred = False
        with self._guard:
            for key, left in list(self._left.items()):
                if left.until <= now:
                    del self._left[key]
            for key, look in list(self._looks.items()):
                if look.due <= now:
                    del self._looks[key]
                    self._asked_again(key, look.entries, now)
            keys = list(self._left)
        for lock, token in keys:
            free = lock._retire_token(token)
            with self._guard:
                asked = self._left.get((lock, token))
                if asked is None:
                    continue
                if free is False:
                    # A hold of that lock object has the token: the lease is that hold's.
                    del self._left[(lock, token)]
                elif free:
                    holds.append((lock, asked.entries, token))
                else:
                    deferred = True
        if not holds:
            # Put off while their objects' attempts are in flight: the rounds slow down
            # rather than look again every 0.2 s for as long.
            return not deferred
        if not self._give_back(holds[:1]):
            # Another one goes first next round: this one's server may be the only one
            # down (a Redis Cluster node), and the rest must not wait for it.
            lock, _, token = holds[0]
            with self._guard:
                if (lock, token) in self._left:
                    self._left[(lock, token)] = self._left.pop((lock, token))
            return False
        if self._closed:
            return True
        return self._give_back(holds[1:])

    def _asked_again(self, key: tuple[Lock, str], entries: int, now: float) -> None:
        """Under _guard: a look that is due joins the give-backs to ask."""
        known = self._left.get(key)
        if known is None:
            self._left[key] = _Left(entries, now + RETRY_FOR, now, 0.0)
        else:
            known.entries += entries

    def _give_back(self, holds: Sequence[GiveBack]) -> bool:
        """Kept in the table while asked: a close meanwhile gives them back itself."""
        if not holds:
            return True
        started = self._clock()
        unanswered = give_back_all(holds)
        with self._guard:
            now = self._clock()
            for (lock, _, token), entries in zip(holds, unanswered, strict=True):
                left = self._left.get((lock, token))
                if left is not None:
                    if entries:
                        left.entries, left.failed_at, left.waited = entries, now, now - started
                    else:
                        del self._left[(lock, token)]
        return not any(unanswered)

    def close(self, since: float) -> list[GiveBack]:
        """Stop asking, and return what is left, for close() to ask once more: not what
        waited out a timeout since ``since`` (the close's start, which waited for it):
        asked again, the hung backend would have the close wait out another. What
        failed at once (refused, its connection cut as an outage ended) is asked: the
        backend may be answering again, and left, the lease would last its TTL."""
        self._follow_fork()
        with self._guard:
            self._closed = True
            runner = self._runner
        self._wakeup.set()
        if serving(runner):
            join(runner, timeout=CLOSE_JOIN)
        with self._guard:
            now = self._clock()
            for key, look in self._looks.items():
                self._asked_again(key, look.entries, now)
            left, self._left, self._looks = self._left, {}, {}
        return [
            (lock, item.entries, token)
            for (lock, token), item in left.items()
            if (item.failed_at < since or item.waited < HUNG) and lock._retire_token(token)
        ]
