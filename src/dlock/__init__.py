"""dlock: distributed locks with leases and fencing tokens.

The sync face lives here; the asyncio face, with the same names prefixed ``Async``,
lives in :mod:`dlock.aio`.
"""

from ._backoff import Backoff
from ._errors import (
    AlreadyAcquired,
    BackendError,
    BackendNotInstalled,
    BackendUnavailable,
    ConfigurationError,
    InvalidArgument,
    InvalidName,
    InvalidTimeout,
    InvalidTTL,
    LockError,
    LockLost,
    LockTimeout,
    NotOwner,
)
from ._sync.client import DEFAULT_TTL, Client, connect
from ._sync.lock import Lock
from ._types import Holder, LockInfo
from ._validation import MAX_NAME_LENGTH, MAX_TTL, MIN_TTL

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TTL",
    "MAX_NAME_LENGTH",
    "MAX_TTL",
    "MIN_TTL",
    "AlreadyAcquired",
    "Backoff",
    "BackendError",
    "BackendNotInstalled",
    "BackendUnavailable",
    "Client",
    "ConfigurationError",
    "Holder",
    "InvalidArgument",
    "InvalidName",
    "InvalidTTL",
    "InvalidTimeout",
    "Lock",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockTimeout",
    "NotOwner",
    "connect",
]
