"""Argument checks shared by both faces and every backend."""

from __future__ import annotations

import json
import math
from typing import Final

from ._errors import InvalidArgument, InvalidName, InvalidTimeout, InvalidTTL

#: Longest lock name, in Unicode code points. Every backend stores names of this length.
MAX_NAME_LENGTH: Final = 255
#: ``prune``'s shortest idle time, and its default, in seconds. Backends may skip asking
#: whether a name they saw held less than this long ago still has its state.
SHORTEST_PRUNE_AGE: Final = 600.0
DEFAULT_PRUNE_AGE: Final = 86_400.0
#: ``prune``'s largest batch: rows per transaction, which holds them all until it commits.
MAX_BATCH: Final = 100_000
#: Longest label once JSON-escaped (as the holder's record stores it; a non-ASCII
#: character takes 6 or 12): with the host name and pid it fits every backend's
#: 1024-character holder column.
MAX_LABEL_LENGTH: Final = 512
#: Longest TTL, in seconds (about 31 years). Every backend stores it: Redis refuses an
#: expiry past 2**63 ms from now, and a thread's wait (the ZooKeeper reaper's, sleeping
#: until an unrenewed lease ends) overflows past about 9.2e9 s.
MAX_TTL: Final = 1e9
#: Shortest TTL, in seconds: the finest grain every backend keeps (Redis counts leases
#: in whole milliseconds). A shorter lease would be over before its first renewal.
MIN_TTL: Final = 0.001


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidName(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidName("lock name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(
            f"lock name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidName("lock name is not valid Unicode (it contains a lone surrogate)") from None
    return name


def name_bytes(name: str) -> bytes:
    """A name as backends store it: its UTF-8 bytes (see :func:`name_from_bytes`)."""
    return name.encode("utf-8", "surrogateescape")


def name_from_bytes(stored: bytes) -> str:
    """A stored name. One that another program wrote, not in UTF-8, keeps its bytes as
    lone surrogates (as ``os.fsdecode`` does): listed and shown escaped, not a crash of
    ``list`` and ``dlock list``. :func:`check_name` refuses such a name for a lock."""
    return stored.decode("utf-8", "surrogateescape")


def check_prefix(prefix: object) -> str:
    """A ``list`` prefix: any text a name may start with, the empty string included."""
    if not isinstance(prefix, str):
        raise InvalidArgument(f"prefix must be a str, not {type(prefix).__name__}")
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(
            "prefix is not valid Unicode (it contains a lone surrogate)"
        ) from None
    return prefix


def check_label(label: object, what: str = "label") -> str | None:
    """The holder's free-form label: text that every backend can store whole."""
    if label is None:
        return None
    if not isinstance(label, str):
        raise InvalidArgument(f"{what} must be a str, not {type(label).__name__}")
    try:
        label.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(
            f"{what} is not valid Unicode (it contains a lone surrogate)"
        ) from None
    escaped = len(json.dumps(label)) - 2
    if escaped > MAX_LABEL_LENGTH:
        raise InvalidArgument(
            f"{what} is {escaped} characters long once JSON-escaped (a non-ASCII character"
            f" counts 6 or 12); the limit is {MAX_LABEL_LENGTH}"
        )
    return label


def _number(value: object) -> float | None:
    # bool is an int subclass; ttl=True is a bug, not one second.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond any float: as good as infinite
        return math.inf if value > 0 else -math.inf


def check_ttl(ttl: object, what: str = "ttl") -> float:
    """``what``: the argument's name as the caller wrote it (the command line's option)."""
    seconds = _number(ttl)
    if seconds is None:
        raise InvalidTTL(f"{what} must be a number of seconds, not {type(ttl).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidTTL(f"{what} must be a positive, finite number of seconds, not {ttl!r}")
    if seconds < MIN_TTL:
        raise InvalidTTL(f"{what} is {ttl!r} seconds; the shortest is {MIN_TTL:g} (a millisecond)")
    if seconds > MAX_TTL:
        raise InvalidTTL(f"{what} is {ttl!r} seconds; the limit is {MAX_TTL:g} (about 31 years)")
    return seconds


def check_timeout(timeout: object, what: str = "timeout") -> float | None:
    """Return the timeout in seconds, or None for "wait forever" (None or +inf)."""
    if timeout is None:
        return None
    # A command line's option has no None: it is left out instead.
    none = "" if what.startswith("-") else "None or "
    seconds = _number(timeout)
    if seconds is None:
        raise InvalidTimeout(
            f"{what} must be {none}a number of seconds, not {type(timeout).__name__}"
        )
    if math.isnan(seconds) or seconds < 0:
        raise InvalidTimeout(f"{what} must be {none}>= 0 seconds, not {timeout!r}")
    return None if math.isinf(seconds) else seconds


def check_batch(batch: object, what: str = "batch") -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise InvalidArgument(f"{what} must be an int from 1 to {MAX_BATCH}, not {batch!r}")
    return batch


def check_prune_age(older_than: object, what: str = "older_than") -> float:
    seconds = _number(older_than)
    if seconds is None:
        raise InvalidArgument(
            f"{what} must be a number of seconds, not {type(older_than).__name__}"
        )
    if not math.isfinite(seconds) or seconds < SHORTEST_PRUNE_AGE:
        raise InvalidArgument(
            f"{what} must be a finite number of seconds >= {SHORTEST_PRUNE_AGE:g},"
            f" not {older_than!r}"
        )
    return seconds
