"""Argument checks shared by both faces and every backend."""

from __future__ import annotations

import math
from typing import Final

from ._errors import InvalidArgument, InvalidName, InvalidTimeout, InvalidTTL

#: Longest lock name, in Unicode code points. Every backend stores names of this length.
MAX_NAME_LENGTH: Final = 255
#: ``prune``'s shortest idle time, and its default, in seconds. Backends may skip asking
#: whether a name they saw held less than this long ago still has its state.
SHORTEST_PRUNE_AGE: Final = 600.0
DEFAULT_PRUNE_AGE: Final = 86_400.0


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


def _number(value: object) -> float | None:
    # bool is an int subclass; ttl=True is a bug, not one second.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_ttl(ttl: object) -> float:
    seconds = _number(ttl)
    if seconds is None:
        raise InvalidTTL(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidTTL(f"ttl must be a positive, finite number of seconds, not {ttl!r}")
    return seconds


def check_timeout(timeout: object) -> float | None:
    """Return the timeout in seconds, or None for "wait forever" (None or +inf)."""
    if timeout is None:
        return None
    seconds = _number(timeout)
    if seconds is None:
        raise InvalidTimeout(
            f"timeout must be None or a number of seconds, not {type(timeout).__name__}"
        )
    if math.isnan(seconds) or seconds < 0:
        raise InvalidTimeout(f"timeout must be None or >= 0 seconds, not {timeout!r}")
    return None if math.isinf(seconds) else seconds


def check_batch(batch: object) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidArgument(f"batch must be a positive int, not {batch!r}")
    return batch


def check_prune_age(older_than: object) -> float:
    seconds = _number(older_than)
    if seconds is None:
        raise InvalidArgument(
            f"older_than must be a number of seconds, not {type(older_than).__name__}"
        )
    if not math.isfinite(seconds) or seconds < SHORTEST_PRUNE_AGE:
        raise InvalidArgument(
            f"older_than must be a finite number of seconds >= {SHORTEST_PRUNE_AGE:g},"
            f" not {older_than!r}"
        )
    return seconds
