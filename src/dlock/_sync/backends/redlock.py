# DO NOT EDIT: generated from src/dlock/_async/backends/redlock.py by scripts/unasync.py.
"""Redlock: a lease granted by a majority of independent Redis masters.

Each master runs the single-server scripts unchanged (see ``redis.py``); this module
only counts votes. A grant needs a majority within the lease's validity time (the TTL
less the time the votes took and an allowance for clock drift). Fencing counters are
per master, so the token handed out is the largest counter among the majority, and
every master of the majority is then lifted to it: any later majority overlaps this one
in at least one master, whose counter is already that high, so tokens keep increasing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from operator import methodcaller
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ..._errors import BackendError, BackendUnavailable, ConfigurationError, InvalidTTL
from ..._types import Acquired, Busy, Holder, Lease, LockInfo
from .._primitives import (
    Cancelled,
    WakeupEvent,
    cancel_requests,
    join,
    lost_cancel,
    run_detached,
    serving,
    shielded,
    sleep,
)
from ..backend import Backend, Waiter
from .redis import RedisBackend

#: Clock drift allowance, as a share of the TTL (plus 2 ms), per the Redlock description.
DRIFT_FACTOR = 0.01


def _drift(ttl: float) -> float:
    return ttl * DRIFT_FACTOR + 0.002


#: Per-master timeouts are short: a slow master must not eat the lease's validity.
MASTER_TIMEOUT = 0.5
#: Seconds a master that did not answer is left out of the calls that the others can
#: decide alone; doubled each time it is asked again and still fails, up to the longest.
LEFT_OUT_FIRST = 2.0
LEFT_OUT_LONGEST = 10.0
#: How long a wake-up that the master waiters listen to did not answer is sent again
#: (see _wake_there), and the least time between two sends (a refused connection fails
#: at once).
WAKE_AGAIN_FOR = LEFT_OUT_LONGEST
WAKE_AGAIN_EVERY = 0.2


def _released(answer: Any) -> bool:
    """A master's release_waking answer: released there (held, entries counted)."""
    return isinstance(answer, tuple) and answer[0] is not None


#: How the master waiters listen to took part in a release or leave: it answered, it
#: was left out (silent lately: not asked), or it failed.
Listened = Literal["answered", "left out", "failed"]


class _LeftOut(BackendUnavailable):
    """A master not asked: it did not answer lately, and the others decided without it."""


def _listened(answer: Any) -> Listened:
    """How the master waiters listen to took part in a release, from its answer."""
    if isinstance(answer, _LeftOut):
        return "left out"
    return "answered" if isinstance(answer, tuple) else "failed"


class _Silence:
    """When one master is worth asking. One that failed unavailable (a timeout, a
    refused or lost connection) would make every call wait out its timeout again while
    it stays down; left out for a while instead, it is asked only when the others
    cannot decide a call alone, and again once the while is over."""

    def __init__(self) -> None:
        self.until = 0.0
        self._next = LEFT_OUT_FIRST

    def left_out(self) -> bool:
        return time.monotonic() < self.until

    def answered(self) -> None:
        self.until, self._next = 0.0, LEFT_OUT_FIRST

    def failed(self) -> None:
        self.until = time.monotonic() + self._next
        self._next = min(self._next * 2, LEFT_OUT_LONGEST)


def _client_address(client: Any) -> tuple[str, int, str]:
    """Where a given client connects: (host, port, unix socket path)."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) or {}
    return (
        str(kwargs.get("host", "")).lower(),
        int(kwargs.get("port", 0)),
        str(kwargs.get("path", "")),
    )


class RedlockBackend(Backend):
    #: As for one server: a blocking acquire's first attempt joins every master's queue.
    queues_waiters = True

    def __init__(self, masters: Sequence[RedisBackend]) -> None:
        """``masters[0]`` is the one waiters listen to, and releases free it last: every
        client must take the same one (``from_url`` sorts them by address), or a waiter
        listening elsewhere is woken while the lease is still held on the others."""
        if len(masters) < 3 or len(masters) % 2 == 0:
            raise ConfigurationError("Redlock needs an odd number (3 or more) of masters")
        self._masters = list(masters)
        for master in self._masters:
            # One master's release cannot grant a Redlock lease: it only wakes the next.
            master.hand_over = False
        self._quorum = len(masters) // 2 + 1
        self._silences = [_Silence() for _ in self._masters]
        #: The leaves of cancelled waiters, going on by themselves (see waiter).
        self._leaves: set[Any] = set()
        #: Wake-ups on the listened-to master left out of a release (see
        #: _wake_where_it_listens), name -> waiter, sent by one run of _wake_there going
        #: on by itself (kept in _wakes), under _wake_guard (the sync face's threads).
        self._to_wake: dict[str, str] = {}
        self._wakes: set[Any] = set()
        self._waking = False
        self._wake_guard = threading.Lock()
        self._closing = False
        #: The entries of each lease held here, (name, token) -> count, as the caller
        #: made them. Masters that missed a call (failed there) disagree with each other
        #: in either direction, and no count among theirs need be the caller's.
        self._entries: dict[tuple[str, str], int] = {}
        #: Each master's server identity (its run_id) once it told it (see _acquire_on).
        self._identities: list[str | None] = [None] * len(self._masters)

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> RedlockBackend:
        """``redis+redlock://[user:password@]host1:port1,host2:port2,host3:port3[/db][?opts]``

        or ``client=[client1, client2, client3]`` with redis-py clients of this face.
        """
        options = dict(options)
        clients = options.pop("client", None)
        parts = urlsplit(url)
        scheme = "rediss" if parts.scheme.lower().startswith("rediss") else "redis"
        if "cluster" in {key for key, _ in parse_qsl(parts.query)}:
            raise ConfigurationError("Redlock's masters are independent servers: no cluster=")
        if clients is not None:
            if not isinstance(clients, (list, tuple)):
                raise ConfigurationError("client= for Redlock is a list of redis-py clients")
            if len({id(client) for client in clients}) < len(clients):
                raise ConfigurationError("client= for Redlock names the same client twice")
            # Two clients of one server would count it twice, as the URL's check refuses:
            # that server alone would then be a majority.
            servers = [_client_address(client) for client in clients]
            for address in servers:
                if address != ("", 0, "") and servers.count(address) > 1:
                    where = address[2] or f"{address[0]}:{address[1]}"
                    raise ConfigurationError(
                        f"client= for Redlock names master {where} more than once"
                    )
            if parts.netloc or parts.path not in ("", "/"):
                raise ConfigurationError(
                    "with client=, the clients' own servers apply; the URL's would be "
                    f"ignored (use {parts.scheme}:// with only prefix or queue_ttl)"
                )
            # Each master checks that the query holds nothing its client would ignore.
            bare = urlunsplit((scheme, "", "", parts.query, ""))
            masters = [
                RedisBackend.from_url(bare, {**options, "client": c})
                for c in sorted(clients, key=_client_address)
            ]
            for master in masters:
                # A client without a read timeout of its own gets a master's default
                # from dlock: one paused master held every call up until it answered.
                master.bound_given(MASTER_TIMEOUT)
            return cls(masters)
        # A short default per master, unless the URL's query or a keyword sets one.
        given = {key for key, _ in parse_qsl(parts.query)} | set(options)
        for key in ("socket_timeout", "socket_connect_timeout"):
            if key not in given:
                options[key] = MASTER_TIMEOUT
        auth, _, hosts = parts.netloc.rpartition("@")
        addresses = [host.strip() for host in hosts.split(",")]
        if not hosts.strip():
            raise ConfigurationError(f"{url!r} names no Redis masters")
        if not all(addresses):
            # Dropped, an h1,,h2 typo left one master fewer than the user counted.
            raise ConfigurationError(f"an empty host in the Redlock masters {hosts!r}")
        prefix = f"{auth}@" if auth else ""
        masters = [
            RedisBackend.from_url(
                urlunsplit((scheme, prefix + address, parts.path, parts.query, "")), options
            )
            for address in addresses
        ]
        seen: set[Any] = set()
        for master in masters:
            if master.server() in seen:
                # One server counted twice would let fewer servers than a majority grant.
                host, port = master.server() or ("?", 0)
                raise ConfigurationError(f"Redlock names master {host}:{port} more than once")
            seen.add(master.server())
        return cls(sorted(masters, key=lambda master: master.server() or ("", 0)))

    def _each(
        self,
        call: Any,
        waking_last: bool = False,
        decided: Callable[[list[Any]], bool] | None = None,
    ) -> list[Any]:
        """Run ``call(master)`` on every master; a failure becomes the exception itself.

        ``waking_last``: for a release, the master whose wake-ups waiters listen to goes
        last. A waiter woken there then finds the name free on the others too; woken
        first, it would find a minority free, give that back, and (not woken by its
        own give-back) wait for the fallback timer.

        ``decided``: whether the answers so far (None: not asked; given only for calls
        that never answer None) settle the call. Then a master that lately did not
        answer is asked only if the others do not, and is otherwise answered by a
        ``_LeftOut`` error: nothing was sent to it. Asked, it comes after the waking
        master: putting that one last again would make every release whose quorum
        needs it wait out the silent master's timeout first. Such a late release on a
        silent master costs a woken waiter at most the fallback timer."""
        order = list(range(len(self._masters)))
        if waking_last:
            order = order[1:] + order[:1]
        results: list[Any] = [None] * len(order)
        later = [i for i in order if decided is not None and self._silences[i].left_out()]
        for i in order:
            if i not in later:
                results[i] = self._ask(i, call)
        if later and decided is not None and decided(results):
            for i in later:
                results[i] = _LeftOut(f"{self._masters[i]._where}: left out, silent lately")
        else:
            for i in later:
                results[i] = self._ask(i, call)
        return results

    def _ask(self, i: int, call: Any) -> Any:
        try:
            result = call(self._masters[i])
        except BackendUnavailable as exc:
            self._silences[i].failed()
            return exc
        except BackendError as exc:
            return exc
        self._silences[i].answered()
        return result

    def _pending(self, results: list[Any]) -> int:
        return sum(result is None for result in results)

    def _no_quorum(self, results: list[Any], what: str) -> BackendError:
        """Unavailable (worth retrying) while the masters that did not answer could make
        the quorum once they do; refused (wrong credentials, a replica) when too many
        refused for any quorum, as a single server's refusal is."""
        errors = [r for r in results if isinstance(r, BackendError)]
        refused = [e for e in errors if not isinstance(e, BackendUnavailable)]
        kind = BackendError if len(results) - len(refused) < self._quorum else BackendUnavailable
        first = (refused or errors)[0]
        return kind(
            f"Redlock {what}: only {len(results) - len(errors)} of {len(results)} masters "
            f"answered, {self._quorum} needed; {'refused' if refused else 'first error'}: {first}"
        )

    def acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        if ttl <= _drift(ttl):
            # No grant could be valid: refused, not answered "busy" for ever.
            raise InvalidTTL(
                f"ttl is {ttl!r} seconds; Redlock subtracts a clock drift allowance of "
                f"{_drift(ttl) * 1000:g} ms from it, so no lease could ever be valid"
            )
        started = time.monotonic()
        results = self._each(
            lambda m: self._acquire_on(m, name, token, ttl, holder, reentrant),
            decided=self._acquire_decided,
        )
        one_server = self._one_server_twice()
        if one_server is not None:
            self._give_back(name, token, results, reentrant)
            raise ConfigurationError(one_server)
        granted = [
            (master, result)
            for master, result in zip(self._masters, results, strict=True)
            if isinstance(result, Acquired)
        ]
        reentered = [(master, result) for master, result in granted if result.count > 1]
        if len(reentered) >= self._quorum:
            return self._reentered(name, token, ttl, started, granted, reentered)
        too_late: float | None = None
        if len(granted) >= self._quorum:
            fence = max(result.fencing_token for _, result in granted)
            lifted = self._lift(name, token, fence, granted)
            # Validity counts every round trip made before the caller is told, lift included.
            validity = ttl - (time.monotonic() - started) - _drift(ttl)
            if lifted and validity > 0:
                # A fresh grant. Also when a minority re-entered: the lease was not held
                # by a majority all along, and count 1 tells the core so. The core counts
                # the lease from when it sent the attempt: less the drift, not the votes'
                # time, so that the holder's clock does not outlast masters' fast clocks.
                self._entries[(name, token)] = 1
                return Acquired(fencing_token=fence, count=1, ttl=ttl - _drift(ttl))
            if lifted or validity <= 0:
                # A lift that found the lease gone is too late as well: the lease ran out
                # during the round trips (answered busy, it was asked again for ever).
                too_late = time.monotonic() - started
        self._give_back(name, token, results, reentrant)
        if too_late is not None:
            # Granted by a majority only after its validity ran out: as any backend's
            # grant that comes back after its lease ended, unavailable (answered busy, a
            # TTL too short for the masters' round trips was asked again for ever).
            raise BackendUnavailable(
                f"Redlock: a majority granted {name!r} only after its validity ran out "
                f"({too_late * 1000:.1f} ms for a ttl of {ttl * 1000:g} ms, less "
                f"{_drift(ttl) * 1000:g} ms of drift allowance); given back"
            )
        failed = sum(isinstance(r, BackendError) for r in results)
        if len(results) - failed < self._quorum:
            raise self._no_quorum(results, "acquire")
        waits = [r.retry_after for r in results if isinstance(r, Busy)]
        known = [w for w in waits if w is not None]
        return Busy(retry_after=min(known) if known and len(known) == len(waits) else None)

    def _give_back(self, name: str, token: str, results: list[Any], reentrant: bool) -> None:
        """An acquire that does not grant (no majority in time, or masters found to be
        one server) gives back what it got, so others are not blocked; on a master that
        failed too, as the call may have reached it and been granted. Not on a re-entry,
        though (whatever the masters that answered said): there a release where nothing
        was granted would take an entry of the outer hold."""
        for master, result in zip(self._masters, results, strict=True):
            if isinstance(result, _LeftOut):
                continue  # nothing was sent
            if isinstance(result, Acquired) or (isinstance(result, BackendError) and not reentrant):
                with suppress(BackendError):
                    master.release(name, token)

    def _acquire_on(
        self,
        master: RedisBackend,
        name: str,
        token: str,
        ttl: float,
        holder: Holder,
        reentrant: bool,
    ) -> Acquired | Busy:
        """One master's vote, its server's identity asked first the first time: masters
        that turn out to be one server are refused (``_one_server_twice``) before their
        votes count. Addresses as written cannot tell (a host name and its address).

        A cancellation that redis-py lost meanwhile (its ``wait_for`` before Python
        3.12) is raised here, in place of the vote or the error, before the next master
        is asked: the attempt went on to the others, each a timeout if it did not
        answer, and the caller cancelled got an error seconds later instead (10 s in a
        loaded test run, two masters held up). Granted or not, the core then gives the
        attempt back on every master, as any attempt cut off. (The core raises a
        cancellation lost before a call failed as well, but only once the attempt has
        ended: here it spares the next masters' timeouts.)"""
        cancels = cancel_requests()
        try:
            i = self._masters.index(master)
            if self._identities[i] is None:
                try:
                    identity = master.server_identity()
                except BackendUnavailable:
                    raise  # as an acquire there would be: no vote
                except BackendError:  # INFO refused (an ACL): addresses alone tell then
                    identity = ""
                self._identities[i] = identity or f"(not told: {master._where})"
            vote = master.acquire(name, token, ttl, holder, reentrant, keep_place=True)
        except BackendError as exc:
            if cancel_requests() > cancels:
                lost_cancel(exc)
            raise
        if cancel_requests() > cancels:
            lost_cancel()
        return vote

    def _one_server_twice(self) -> str | None:
        """What to say if two masters turned out to be one server, which would count
        twice toward a majority (with a third master down, it alone would grant)."""
        first: dict[str, RedisBackend] = {}
        for master, known in zip(self._masters, self._identities, strict=True):
            if known is None:
                continue
            if known in first:
                return (
                    f"Redlock masters {first[known]._where} and {master._where} are one"
                    f" server (run_id {known}): it would count twice toward a majority"
                )
            first[known] = master
        return None

    def _acquire_decided(self, results: list[Any]) -> bool:
        """Granted by a quorum; or no quorum can grant it, and a quorum answered (busy),
        so the answer is busy. With fewer answers (another master down too), a master
        left out is asked: its answer may make busy of what would be an error."""
        granted = sum(isinstance(result, Acquired) for result in results)
        answered = sum(isinstance(result, (Acquired, Busy)) for result in results)
        if granted >= self._quorum:
            return True
        return granted + self._pending(results) < self._quorum and answered >= self._quorum

    def _reentered(
        self,
        name: str,
        token: str,
        ttl: float,
        started: float,
        granted: list[tuple[RedisBackend, Acquired]],
        reentered: list[tuple[RedisBackend, Acquired]],
    ) -> Acquired | Busy:
        """A re-entry that a majority held all along keeps its fencing token (theirs,
        lifted onto a majority when first granted). A master that had forgotten the
        lease (restarted) granted it afresh under a new token: that grant is given
        back, so every master that holds the lease counts the same entries."""
        for master, result in granted:
            if result.count == 1:
                with suppress(BackendError):
                    master.release(name, token)
        validity = ttl - (time.monotonic() - started) - _drift(ttl)
        if validity > 0:
            # Made on a majority, so one entry more than the caller had.
            made = self._entries.get((name, token))
            count = (
                made + 1
                if made is not None
                else self._majority_count([result.count for _, result in reentered])
            )
            self._entries[(name, token)] = count
            return Acquired(
                fencing_token=max(result.fencing_token for _, result in reentered),
                count=count,
                ttl=ttl - _drift(ttl),
            )
        for master, _ in reentered:  # too late: take this entry back
            with suppress(BackendError):
                master.release(name, token)
        return Busy(retry_after=None)

    def _lift(
        self, name: str, token: str, fence: int, granted: list[tuple[RedisBackend, Acquired]]
    ) -> bool:
        """Make a majority of masters hold ``fence`` before anyone is told it."""
        lifted = 0
        for master, result in granted:
            if result.fencing_token == fence:
                lifted += 1
                continue
            with suppress(BackendError):
                lifted += master.raise_fence(name, token, fence)
        return lifted >= self._quorum

    def _majority_count(self, counts: list[int]) -> int:
        """The entries a majority of masters hold at least. Counts differ where a call
        failed on some master (a release it missed, a re-entry it ran unanswered); the
        largest would keep the lock object holding what a majority has freed."""
        return sorted(counts, reverse=True)[self._quorum - 1]

    def release(self, name: str, token: str) -> int | None:
        answers = self._each(
            lambda m: m.release_waking(name, token),
            waking_last=True,
            decided=lambda answers: sum(_released(a) for a in answers) >= self._quorum,
        )
        results = [a[0] if isinstance(a, tuple) else a for a in answers]
        woken = [a[1] if isinstance(a, tuple) else None for a in answers]
        counts = [r for r in results if isinstance(r, int)]
        if len(counts) >= self._quorum:
            on_majority = self._majority_count(counts)
            made = self._entries.pop((name, token), None)
            left = on_majority if made is None else made - 1
            if left > 0 and on_majority > 0:
                self._entries[(name, token)] = left
                return left
            # Free on a majority, so free: a master that kept entries from a missed
            # release must not keep the lease (and one vote for it) until its TTL.
            for master, count in zip(self._masters, results, strict=True):
                if isinstance(count, int):
                    self._release_all(master, name, token, count)
            if left <= 0:
                self._wake_where_it_listens(name, _listened(answers[0]), woken)
            # Freed on a majority while the caller still had entries (entries missed on
            # different masters): another client may take it now, so it is lost.
            return 0 if left <= 0 else None
        self._entries.pop((name, token), None)
        if len(results) - sum(isinstance(r, BackendError) for r in results) < self._quorum:
            raise self._no_quorum(results, "release")
        if self._may_hold(len(counts), results):
            raise self._unsure(results, "release", len(counts))
        return None

    def _wake_where_it_listens(
        self, name: str, listened: Listened, woken: list[str | None]
    ) -> None:
        """A release that freed the name on a majority (or a leave of the head of the
        queues, see _dequeue_everywhere) must wake, on the master waiters listen to
        (``masters[0]``), the waiter that the others woke: the head of their queues,
        which a majority grants. It did not, and that waiter sat until its
        fallback timer (2 s), when that master woke nobody (a split vote gave it the
        master alone, free with nobody queued, and it gave it back; or the master lost
        its queue in a restart), woke another (its queue differs from theirs: a restart
        kept only the waiters that came since, 14 of 18 restarts in a chaos helper's
        run), or was left out of the release (silent lately: paused, restarted, for
        2-10 s after it answers again). Woken there too now: one round trip, only then;
        in the background and one at a time where the master was left out, as it may
        still be down and the caller must not wait out its timeout."""
        heads = [head for head in woken[1:] if head is not None]
        if not heads:
            return
        head = Counter(heads).most_common(1)[0][0]
        if woken[0] == head:
            return
        if listened == "left out":
            with self._wake_guard:
                self._to_wake[name] = head
                if self._waking or self._closing:
                    return
                self._waking = True
            run_detached(self._wake_there, self._wakes, "dlock-wake")
        elif listened == "answered":
            with suppress(BackendError):
                self._masters[0].wake(name, head)

    def _wake_there(self) -> None:
        """Send the wake-ups in ``_to_wake`` to the master waiters listen to, left out,
        one at a time; its answer ends the leaving out. While it does not answer (still
        paused, restarting), each is sent again, for WAKE_AGAIN_FOR seconds at most:
        one sent once and timed out was lost, and its waiter sat until its own timer
        though the master came back meanwhile (a chaos helper's repro: 28 s with a 30 s
        timer, 3 of 3; up to 1.5 s with the default 2 s)."""
        until = time.monotonic() + WAKE_AGAIN_FOR
        while True:
            with self._wake_guard:
                if self._closing or not self._to_wake or time.monotonic() >= until:
                    self._to_wake.clear()
                    self._waking = False
                    return
                name, head = next(iter(self._to_wake.items()))
            sent = time.monotonic()
            answer = self._ask(0, methodcaller("wake", name, head))
            unanswered = isinstance(answer, BackendUnavailable)
            with self._wake_guard:
                if not unanswered and self._to_wake.get(name) == head:
                    del self._to_wake[name]
            if unanswered:
                sleep(max(0.0, sent + WAKE_AGAIN_EVERY - time.monotonic()))

    @staticmethod
    def _release_all(master: RedisBackend, name: str, token: str, count: int) -> None:
        """Release ``token``'s ``count`` entries left on ``master``, owner-checked."""
        with suppress(BackendError):
            for _ in range(count):
                if not master.release(name, token):
                    return

    def extend(self, name: str, token: str, ttl: float) -> bool:
        return (self.extend_many([Lease(name, token, ttl)]))[0]

    def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Each master keeps a renewed lease the drift allowance longer than asked: the
        holder counts the full TTL from before the call (the seam's promise), and a
        master whose clock runs fast would otherwise end it before the holder stops."""
        started = time.monotonic()
        padded = [Lease(x.name, x.token, x.ttl + _drift(x.ttl)) for x in leases]
        results = self._each(lambda m: m.extend_many(padded), decided=self._renewal_decided)
        answered = [r for r in results if not isinstance(r, BackendError)]
        if len(answered) < self._quorum:
            raise self._no_quorum(results, "extend")
        tally = [sum(votes) for votes in zip(*answered, strict=True)]
        unsure = [
            votes for votes in tally if votes < self._quorum and self._may_hold(votes, results)
        ]
        if unsure:
            raise self._unsure(results, "extend", min(unsure))
        # A lease the round outlasted may have ended on the first masters before the
        # last voted; the others were renewed for longer than the round took.
        elapsed = time.monotonic() - started
        return [
            votes >= self._quorum and elapsed < lease.ttl
            for lease, votes in zip(leases, tally, strict=True)
        ]

    def _may_hold(self, holding: int, results: list[Any]) -> bool:
        """Whether the masters that did not answer could make a majority with the
        ``holding`` ones that hold a lease: then whether it is held is theirs to say."""
        return holding + sum(isinstance(r, BackendError) for r in results) >= self._quorum

    def _unsure(self, results: list[Any], what: str, holding: int) -> BackendUnavailable:
        error = next(r for r in results if isinstance(r, BackendError))
        return BackendUnavailable(
            f"Redlock {what}: {holding} of {len(results)} masters hold the lease, "
            f"{self._quorum} needed, and those that did not answer may; first error: {error}"
        )

    def _renewal_decided(self, results: list[Any]) -> bool:
        """Every lease renewed by a majority, or out of reach of one."""
        answered = [r for r in results if r is not None and not isinstance(r, BackendError)]
        pending = self._pending(results)
        if len(answered) + pending < self._quorum:
            return True
        return len(answered) >= self._quorum and all(
            sum(votes) >= self._quorum or sum(votes) + pending < self._quorum
            for votes in zip(*answered, strict=True)
        )

    @contextmanager
    def waiter(self, name: str, token: str) -> Iterator[Waiter]:
        # One arrival time for every master, so each queue has the same order and no
        # two waiters can each be first on a different minority.
        arrival = str(int(time.time() * 1000))
        for master in self._masters:
            master.enqueue(name, token, arrival)
        try:
            # Every master publishes each release; listening to one is enough, and the
            # core's timer covers a dead one.
            with self._masters[0].subscription(name, token) as waiter:
                yield waiter
        except Cancelled:
            # The caller sees its cancellation at once, the leaves going on by
            # themselves (as RedisBackend.waiter's): awaited, they held it up for a
            # master's timeout per master that does not answer.
            leaves = [(master, master._start_leaving(token)) for master in self._masters]
            leave = partial(self._dequeue_everywhere, name, token, leaves)
            run_detached(leave, self._leaves, "dlock-leave")
            raise
        finally:
            # Every master's leave, to its end even if the waiter is cancelled again
            # meanwhile (see RedisBackend.dequeue): cut off after the first, the
            # others' places would keep the line waiting until they lapsed. All of them
            # start here, at once: a leave that a master's record of this wait showed
            # only once the caller had gone on would take the place (and the record) of
            # the token's next wait, begun meanwhile, instead of waiting for it. (None
            # left to start once a cancellation has started them.)
            leaves = [(master, master._start_leaving(token)) for master in self._masters]
            shielded(self._dequeue_everywhere(name, token, leaves))

    def _dequeue_everywhere(
        self,
        name: str,
        token: str,
        leaves: list[tuple[RedisBackend, tuple[WakeupEvent, int, bool] | None]],
    ) -> int:
        """Leave the queue on every master (each leave started, see waiter); the number
        of masters. A leave never sent (this run itself cut off, its event loop ending)
        still ends, or the token's next attempt on that master would wait for it. A
        master left out (silent lately) is not asked: its place lapses by itself.

        A waiter that leaves at the head of the queues of a free lock (woken, then
        cancelled or timed out) wakes the next on each master, as a release does, and as
        for a release the master waiters listen to goes last and must wake the waiter
        the others woke: its leave first, the next waiter could try while this one still
        headed the others' queues, be refused, and hear their wake-ups nowhere; not free
        there (the holder's release not there yet), it woke nobody where the next one
        listens. Either way the next waiter sat until its fallback timer (2 s; chaos
        helpers saw ~1.8 s stalls with cancellations)."""
        woken: list[str | None] = [None] * len(leaves)
        listened: Listened = "failed"
        try:
            for i in [*range(1, len(leaves)), 0]:
                master, leaving = leaves[i]
                if leaving is None:
                    continue
                if self._silences[i].left_out():
                    listened = "left out" if i == 0 else listened
                    continue
                answered, woken[i] = master._leave(name, token, *leaving)
                if i == 0 and answered:
                    listened = "answered"
        finally:
            for master, leaving in leaves:
                if leaving is not None:
                    master._end_leaving(token, leaving[0])
        self._wake_where_it_listens(name, listened, woken)
        return len(leaves)

    def _agreed(self, infos: list[LockInfo]) -> LockInfo | None:
        """The holder a majority of masters agree on (same fencing token), if any."""
        for info in infos:
            same = [other for other in infos if other.fencing_token == info.fencing_token]
            if len(same) >= self._quorum:
                lefts = [x.expires_in for x in same if x.expires_in is not None]
                return LockInfo(
                    name=info.name,
                    fencing_token=info.fencing_token,
                    holder=info.holder,
                    expires_in=min(lefts) if lefts else None,
                    count=info.count,
                    # A waiter joins each master's queue in turn: the longest names all.
                    waiters=max((x.waiters for x in same), key=len),
                )
        return None

    def _decided(self, infos: list[LockInfo], results: list[Any], what: str) -> LockInfo | None:
        """The holder a majority agrees on, or None: free. Unless the masters that did
        not answer could still make a majority with those that hold one lease: then
        whether the name is held is theirs to say, and not knowing is an error."""
        agreed = self._agreed(infos)
        if agreed is None and infos:
            silent = sum(isinstance(r, BackendError) for r in results)
            tokens = [info.fencing_token for info in infos]
            if max(tokens.count(token) for token in tokens) + silent >= self._quorum:
                error = next(r for r in results if isinstance(r, BackendError))
                raise BackendUnavailable(
                    f"Redlock {what}: the masters that answered do not agree on "
                    f"{infos[0].name!r}, and the {silent} that did not would decide; "
                    f"first error: {error}"
                )
        return agreed

    def inspect(self, name: str) -> LockInfo | None:
        results = self._each(lambda m: m.inspect(name))
        if len(results) - sum(isinstance(r, BackendError) for r in results) < self._quorum:
            raise self._no_quorum(results, "inspect")
        return self._decided([r for r in results if isinstance(r, LockInfo)], results, "inspect")

    def list(self, prefix: str) -> list[LockInfo]:
        results = self._each(lambda m: m.list(prefix))
        answered = [r for r in results if not isinstance(r, BackendError)]
        if len(answered) < self._quorum:
            raise self._no_quorum(results, "list")
        by_name: dict[str, list[LockInfo]] = {}
        for infos in answered:
            for info in infos:
                by_name.setdefault(info.name, []).append(info)
        decided = (self._decided(infos, results, "list") for _, infos in sorted(by_name.items()))
        return [info for info in decided if info is not None]

    def force_release(self, name: str) -> bool:
        """Free ``name`` on every master that answers. Fewer than a majority is an
        error, as for the other calls: the silent masters may still hold the lease,
        and its holder the lock once they answer again."""
        results = self._each(lambda m: m.force_release(name), waking_last=True)
        if len(results) - sum(isinstance(r, BackendError) for r in results) < self._quorum:
            raise self._no_quorum(results, "force release")
        return any(r is True for r in results)

    def close(self) -> None:
        # A wake-up still going on is cut off: it would use a master closed under it,
        # and leave that connection open.
        with self._wake_guard:
            self._closing = True
        for wake in list(self._wakes):
            if serving(wake):
                join(wake, MASTER_TIMEOUT)
        for master in self._masters:
            master.close()


BACKEND = RedlockBackend
