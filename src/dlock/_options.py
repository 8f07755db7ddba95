"""Option parsing shared by the backends: URL query values arrive as strings."""

from __future__ import annotations

import math
from urllib.parse import parse_qsl

from ._errors import ConfigurationError


def query_options(query: str) -> dict[str, str]:
    """A URL's query as options. A key given twice is refused (which one was meant?),
    and so is an empty value: the drivers read ``?sslmode=`` or ``?password=`` as
    their default, or as nothing at all, where whoever wrote it meant something."""
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in options:
            raise ConfigurationError(f"option {key!r} is given twice in the URL")
        if not value:
            raise ConfigurationError(f"option {key!r} is empty in the URL")
        options[key] = value
    return options


def flag(value: object, what: str) -> bool:
    """A boolean option; anything unrecognised is refused, as a typo must not switch
    off a safety setting (TLS, certificate checks)."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{what} must be true or false, not {value!r}")


def seconds(value: object, what: str) -> float:
    """A positive, finite duration option (an infinite one would disable a bound)."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be a number of seconds, not {value!r}")
    try:
        duration = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"{what} must be a number of seconds, not {value!r}") from None
    if not math.isfinite(duration) or duration <= 0:
        raise ConfigurationError(f"{what} must be a positive number of seconds, not {value!r}")
    return duration


#: Longest connect or operation timeout, in seconds (about 11.6 days). PostgreSQL takes
#: its timeouts (``tcp_user_timeout``, ``lock_timeout``) as 32-bit milliseconds, and
#: PyMySQL refuses a connect timeout over a year: past this, every connection failed.
#: SQLite's busy timeout is an int of milliseconds too: past it, it wrapped to none.
#: Sockets and thread waits overflow past about 9.2e9 s (Redis, etcd: a crash), and
#: Redis refused a waiter's place of 1e300 s only once a lock was busy.
MAX_TIMEOUT = 1e6


def bounded_seconds(value: object, what: str) -> float:
    """``seconds``, for a duration that a server or its client library must hold (see
    MAX_TIMEOUT): every backend's timeouts and waiting places."""
    duration = seconds(value, what)
    if duration > MAX_TIMEOUT:
        raise ConfigurationError(
            f"{what} is {value!r} seconds; the longest is {MAX_TIMEOUT:g} (about 11.6 days)"
        )
    return duration
