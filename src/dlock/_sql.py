"""What the SQL backends share that has no I/O: identifier checks."""

from __future__ import annotations

import re

from ._errors import ConfigurationError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_identifier(value: object, what: str) -> str:
    """Allow only plain identifiers: they are interpolated into SQL, values never are."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"{what} must be a plain SQL identifier (letters, digits, _; at most 63), not {value!r}"
        )
    return value
