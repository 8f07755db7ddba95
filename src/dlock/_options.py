"""Option parsing shared by the backends: URL query values arrive as strings."""

from __future__ import annotations

import math

from ._errors import ConfigurationError


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
    try:
        duration = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{what} must be a number of seconds, not {value!r}") from None
    if not math.isfinite(duration) or duration <= 0:
        raise ConfigurationError(f"{what} must be a positive number of seconds, not {value!r}")
    return duration
