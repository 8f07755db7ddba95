# DO NOT EDIT: generated from src/dlock/_async/backend.py by scripts/unasync.py.
"""The seam between the lock semantics (``lock.py``) and one storage (``backends/*.py``).

A backend stores leases and nothing else: it does not wait, renew, count time on the
client, or validate arguments; the core does all of that once for every backend.

Rules every backend keeps (the conformance suite checks them):

* ``acquire`` is atomic: it grants the lease when the name is free or its lease has
  expired *by the backend's clock*, or re-enters when ``reentrant`` and ``token`` is the
  live holder. A grant returns a fencing token larger than any earlier grant of that name.
* ``release``, ``extend`` and ``extend_many`` act only on a live lease held by ``token``.
* Failures to reach or use the backend raise :class:`dlock.BackendError`, never return a
  grant. Client-library exceptions do not escape.
* The sync twin is called from two threads: the caller's and the client's renewer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._types import Acquired, Busy, Holder, Lease, LockInfo
from ._primitives import sleep


class Waiter:
    """Waits for "the lock may be free now". This default only sleeps."""

    #: True when ``wait`` returns early because the backend signalled a release; read
    #: before every wait, so a waiter may change it (MySQL's, once in front of its queue).
    notifies: bool = False
    #: The shortest wait in which a notifying waiter hears a release (MySQL 8 waits in
    #: the server only whole seconds): shorter waits back off as if it could not.
    shortest_wait: float = 0.0

    def wait(self, timeout: float) -> Acquired | None:
        """Return when the lock may be free, or after ``timeout`` seconds.

        A backend that grants the lease to a waiter on its behalf (Redis: the release
        hands it over; PostgreSQL: the waiter's turnstile takes it inside the server)
        returns the grant here. It must have been made after the waiter's latest attempt
        was sent: the core counts the lease from that moment.
        """
        sleep(timeout)
        return None


class Backend(ABC):
    #: True when a waiter holds a place in a queue on the server (ZooKeeper), or its
    #: waits cannot miss a release (SQL session mode: the wait is the database's lock).
    #: The core then makes even the first attempt of a wait inside :meth:`waiter`, so
    #: the place taken by that attempt is kept rather than given up and taken again at
    #: the back, and no attempt is made twice before the first wait.
    queues_waiters: bool = False

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> Backend:
        """Build a backend from a URL and the keyword options given to ``connect``.

        Must not do network I/O: connecting happens on first use.
        """

    @abstractmethod
    def acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy: ...

    @abstractmethod
    def release(self, name: str, token: str) -> int | None:
        """Leave the lease once; return how many entries remain, or None if not held."""

    @abstractmethod
    def extend(self, name: str, token: str, ttl: float) -> bool:
        """Make the lease end ``ttl`` seconds from now; False if ``token`` does not hold it."""

    def extend_many(self, leases: Sequence[Lease]) -> Sequence[bool | None]:
        """Renew many leases at once. Backends override this to batch round trips.

        None for a lease whose server could not be asked while others' were (a cluster's
        node that is down): it is as unsure as if the whole call had failed, and the
        leases renewed elsewhere are not lost with it."""
        return [self.extend(lease.name, lease.token, lease.ttl) for lease in leases]

    @contextmanager
    def waiter(self, name: str, token: str) -> Iterator[Waiter]:
        """Subscribe to releases of ``name`` while ``token`` keeps waiting for it.

        The core makes one more attempt after entering, so a release that happens between
        the first attempt and the subscription is not missed. A backend that queues
        waiters (for fairness) knows the queued one by ``token`` and must drop it from the
        queue on exit, which also happens on timeout and cancellation.
        """
        yield Waiter()

    def watch_leases(self, renew_now: Callable[[], None]) -> bool:
        """Called once by the client with a hook that is safe to call from any thread;
        True if this backend ever calls it.

        A backend that learns by itself that leases may be gone (a ZooKeeper session
        suspended or expired, a connection dropped) calls ``renew_now()``; the client's
        renewer then re-checks every held lease at once: the renewed ones with
        ``extend_many``, the others (``auto_renew=False``) with :meth:`lease_lost`.
        """
        return False

    #: Why a renewal the backend refused means a lost lease, as its holder is told.
    refused_renewal = (
        "renewing it, the backend no longer had the lease (taken after it ran out,"
        " released by force, or lost by the server)"
    )

    #: Why a lease that :meth:`lease_lost` reports is lost, as its holder is told.
    reported_lost = "the backend reported the lease's session gone"

    #: :meth:`lease_lost` may turn true while nobody calls ``renew_now`` (a session
    #: lock's connection found closed by the server): the renewer then asks it about
    #: every held lease each time it wakes, at least once a second while it holds any.
    knows_losses = False

    def lease_lost(self, name: str, token: str) -> bool:
        """True if this backend knows, without a round trip, that the lease ``token``
        holds on ``name`` has ended (its session is gone); it then gives it up, as
        ``extend_many`` does a lease it finds gone. Asked from the client's renewer
        after ``renew_now()``, from any thread, about held leases that it does not renew:
        their holder must be told too, before another client can take the lock."""
        return False

    def may_write_late(self, token: str) -> bool:
        """True if a write under ``token`` that this backend sent by itself, in the
        background, got no answer and may still reach the server at any later time (a
        SQL turnstile wait's clean-up giving back what the wait may have taken), or
        is being sent now. Asked, with no round trip, as each fresh hold starts: the
        core then takes a new owner token, which such a release cannot free. Each
        cause is told once: the core remembers it until it has a new token."""
        return False

    @abstractmethod
    def inspect(self, name: str) -> LockInfo | None:
        """The live holder of ``name``, or None when it is free."""

    @abstractmethod
    def list(self, prefix: str) -> list[LockInfo]:
        """Every live lock whose name starts with ``prefix``, sorted by name."""

    @abstractmethod
    def force_release(self, name: str) -> bool:
        """Free ``name`` whoever holds it; True if it was held."""

    def prune(self, older_than: float, limit: int) -> int:
        """Delete what at most ``limit`` names nobody has held for ``older_than`` seconds
        left behind (a SQL table's rows), in one short transaction; return how many. The
        core calls it until fewer come back. Later grants of such a name must still get
        larger fencing tokens. Only backends that keep such state implement it; the
        others leave nothing behind (their keys expire, their nodes are containers)."""
        return 0

    def close(self) -> None:
        """Release connections. Held leases are left to expire."""
        return None
