"""How long a waiter waits between attempts. Pure arithmetic, no I/O, no clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ._errors import InvalidArgument


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter, bounded by what the backend tells us.

    A backend that can notify wakes the waiter itself, so the delay there is only a
    fallback for a lost notification or a lease that expires without being released.
    """

    initial: float = 0.002
    maximum: float = 0.1
    #: Longest wait on a notifying backend before trying again regardless.
    notify_fallback: float = 2.0
    #: The jitter's source; by default the operating system's. A generator of our own
    #: would be copied by a fork (workers forked from one process, started together,
    #: would retry in lockstep), and the random module's is the application's: seeded
    #: alike in two workers (reproducible jobs), they would retry in lockstep too, and
    #: every draw would change what the application draws next.
    rng: random.Random = field(default_factory=random.SystemRandom, compare=False)

    def __post_init__(self) -> None:
        """A delay of zero, below or NaN makes every waiter retry in a busy loop; an
        infinite one, never again."""
        for what in ("initial", "maximum", "notify_fallback"):
            value = getattr(self, what)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0 < value < math.inf:
                raise InvalidArgument(
                    f"Backoff {what} must be a positive, finite number of seconds, not {value!r}"
                )
        if self.maximum < self.initial:
            raise InvalidArgument(
                f"Backoff maximum ({self.maximum!r}) is below its initial delay ({self.initial!r})"
            )

    def delay(self, attempt: int, retry_after: float | None, notifies: bool) -> float:
        if notifies:
            cap = self.notify_fallback
        else:
            cap = min(self.maximum, self.initial * 2.0 ** min(attempt, 30))
            # Full jitter keeps many waiters from retrying in lockstep.
            cap = self.rng.uniform(cap / 2, cap)
        if retry_after is not None:
            # Never sleep past the moment the current lease runs out.
            cap = min(cap, retry_after + 0.001)
        return max(cap, 0.0)
