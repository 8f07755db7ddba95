"""Every error dlock raises on purpose derives from :class:`LockError`."""

from __future__ import annotations


class LockError(Exception):
    """Base class of dlock's errors."""


class LockTimeout(LockError, TimeoutError):
    """The lock was not acquired within the timeout."""


class NotOwner(LockError):
    """Release or extend by a lock object that does not hold the lock."""


class LockLost(NotOwner):
    """The lease ended while this lock object believed it held it.

    Raised when leaving a ``with`` block whose lease was lost, and by ``release`` or
    ``extend`` once the backend has expired the lease or handed it to someone else.
    """


#: The loss told for a lease that ran out on the holder's clock (the watchdog's, a
#: re-entry's or a release's finding alike).
LEASE_RAN_OUT = "the lease ran out before it could be renewed"
#: The same for a lock that is not renewed: "before it could be renewed" misled.
UNRENEWED_LEASE_RAN_OUT = "the lease ran out: its TTL ended (auto_renew=False: not renewed)"


class AlreadyAcquired(LockError, RuntimeError):
    """A non-reentrant lock object was asked to acquire a lock it already holds.

    Waiting would deadlock, so this fails at once (as :class:`trio.Lock` does).
    """


class BackendError(LockError):
    """The backend failed, is unreachable, or refused the operation.

    Never means "acquired": an acquire that raises this did not get the lock.
    """


class BackendUnavailable(BackendError, ConnectionError):
    """The backend could not be reached in time: worth retrying.

    A server that answers and refuses (credentials, database, certificate) is a plain
    :class:`BackendError` instead: retrying would not mend it.
    """


class ConfigurationError(LockError, ValueError):
    """A URL or option is wrong: unknown scheme, bad option value, missing extra."""


class BackendNotInstalled(ConfigurationError):
    """The client library a backend needs is not installed; the message names the extra."""


class InvalidArgument(LockError, ValueError):
    """An argument is out of range or of the wrong type."""


class InvalidName(InvalidArgument):
    """A lock name is empty, too long, not a string, or not valid Unicode."""


class InvalidTTL(InvalidArgument):
    """A TTL is not a positive, finite number of seconds."""


class InvalidTimeout(InvalidArgument):
    """A timeout is negative or not a number."""


def in_words(exc: BaseException) -> str:
    """What a call ran into, said as the backends' errors say it, for a log line. A repr
    read as a crash: the asyncio face's bound on a renewal, reached while a ZooKeeper
    leader was paused, showed ``TimeoutError('no answer within 1.989 s')``."""
    if isinstance(exc, BackendError):
        return str(exc)
    said = f" ({exc})" if str(exc) else ""
    if isinstance(exc, TimeoutError):
        return f"the backend did not answer in time{said}"
    return f"{type(exc).__name__}{said}"


def gives_way_to_a_cancel(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a call whose caller's cancellation a client library
    lost meanwhile, gives way to that cancellation: a failure of what was asked (the
    backend's error, among others), which the caller no longer wants. Not a loss
    (LockLost): that tells of a hold the caller believed in, which nothing else may tell
    (a release's), nor a BaseException (a cancellation, or KeyboardInterrupt), which
    goes on as it is."""
    return isinstance(exc, Exception) and not isinstance(exc, LockLost)
