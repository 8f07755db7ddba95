"""Small immutable values passed across the backend seam and returned to users."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: shown by inspection, never used to decide ownership."""

    host: str
    pid: int
    label: str | None = None

    @classmethod
    def current(cls, label: str | None = None) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(), label=label)

    def to_json(self) -> str:
        return self._json

    @cached_property
    def _json(self) -> str:
        # Serialized once: it is sent with every acquire.
        return json.dumps({"host": self.host, "pid": self.pid, "label": self.label})

    @classmethod
    def from_json(cls, text: str | bytes | None) -> Holder:
        """Parse what :meth:`to_json` wrote; anything unreadable becomes an unknown holder."""
        try:
            data = json.loads(text) if text else {}
            if not isinstance(data, dict):
                raise TypeError(f"a holder is a JSON object, not {type(data).__name__}")
            label = data.get("label")
            if not isinstance(label, (str, type(None))):
                raise TypeError(f"a label is text, not {label!r}")
            return cls(host=str(data["host"]), pid=int(data["pid"]), label=label)
        except (ValueError, KeyError, TypeError, OverflowError):  # a pid of 1e999
            return cls(host="?", pid=0, label=None)


@dataclass(frozen=True)
class LockInfo:
    """What inspection tells about a held lock."""

    name: str
    fencing_token: int
    holder: Holder
    #: Seconds left on the lease as the backend sees it (None where the backend has no TTL).
    expires_in: float | None
    #: How many times the holder has entered a reentrant lock.
    count: int = 1
    #: Holders waiting in line, in order, where the backend keeps a queue it can list
    #: (Redis, Redlock, ZooKeeper, etcd; the SQL backends' waiters queue in the server).
    waiters: tuple[Holder, ...] = ()


@dataclass(frozen=True)
class Acquired:
    """A backend granted the lease (or re-entered it)."""

    fencing_token: int
    count: int = 1
    #: The lease's length when it differs from the TTL asked for (a lease handed to a
    #: waiter by the previous holder's release lasts at most as long as its queue place;
    #: Redlock's, the TTL less the clock drift it allows for; ZooKeeper's handed over,
    #: no longer than its session surely lives).
    ttl: float | None = None


@dataclass(frozen=True)
class Busy:
    """Someone else holds the lease."""

    #: Seconds until the current lease expires, if the backend knows; a hint for waiting.
    retry_after: float | None = None


@dataclass(frozen=True)
class Lease:
    """One held lease, as handed to a backend's batched renewal."""

    name: str
    token: str
    ttl: float
