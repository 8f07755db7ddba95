"""The conformance suite tested: a deliberately broken backend must fail it.

Each case breaks one promise of the seam by wrapping the real backend's methods, then runs
the conformance test that guards that promise and expects it to fail. A test that passes
against a broken lock could not catch the bug it exists for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

import dlock
from dlock._types import Acquired, Busy, Holder, Lease
from tests.conformance._sync import test_conformance as suite


def backend_class(url: str) -> type[Any]:
    client = dlock.connect(url)
    cls = type(client._backend)
    client.close()
    return cls


def grants_while_held(original: Callable[..., Acquired | Busy]) -> Callable[..., Any]:
    def acquire(
        self: Any, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        self.force_release(name)
        return original(self, name, token, ttl, holder, reentrant)

    return acquire


def constant_fencing_token(original: Callable[..., Acquired | Busy]) -> Callable[..., Any]:
    def acquire(self: Any, *args: Any) -> Acquired | Busy:
        result = original(self, *args)
        return (
            Acquired(fencing_token=1, count=result.count)
            if isinstance(result, Acquired)
            else result
        )

    return acquire


def extends_without_owner_check(original: Callable[..., bool]) -> Callable[..., Any]:
    def extend(self: Any, name: str, token: str, ttl: float) -> bool:
        original(self, name, token, ttl)
        return True

    return extend


def renews_without_owner_check(original: Callable[..., list[bool]]) -> Callable[..., Any]:
    def extend_many(self: Any, leases: Sequence[Lease]) -> list[bool]:
        original(self, leases)
        return [True] * len(leases)

    return extend_many


def releases_without_owner_check(original: Callable[..., int | None]) -> Callable[..., Any]:
    def release(self: Any, name: str, token: str) -> int | None:
        original(self, name, token)
        return 0

    return release


def renews_nothing(original: Callable[..., list[bool]]) -> Callable[..., Any]:
    def extend_many(self: Any, leases: Sequence[Lease]) -> list[bool]:
        return [True] * len(leases)

    return extend_many


def knows_no_loss(original: Callable[..., bool]) -> Callable[..., Any]:
    def lease_lost(self: Any, name: str, token: str) -> bool:
        return False

    return lease_lost


Breakage = dict[str, Callable[[Any], Any]]


@pytest.mark.parametrize(
    ("breakage", "guard"),
    [
        ({"acquire": grants_while_held}, suite.test_second_lock_excluded_until_release),
        ({"acquire": constant_fencing_token}, suite.test_fencing_tokens_strictly_increase),
        (
            {"extend": extends_without_owner_check},
            suite.test_evicted_holder_cannot_extend_or_release,
        ),
        (
            {"release": releases_without_owner_check},
            suite.test_evicted_holder_cannot_extend_or_release,
        ),
        # A backend may also know of a loss by itself, with no round trip (a session
        # lock's connection closed by the server, looked at each second): blind to that
        # too, only the renewal's owner check is left to tell the loss.
        (
            {"extend_many": renews_without_owner_check, "lease_lost": knows_no_loss},
            suite.test_loss_is_reported,
        ),
        ({"extend_many": renews_nothing}, suite.test_renewal_keeps_lock_alive),
    ],
    ids=[
        "no-exclusion",
        "constant-fencing",
        "extend-without-owner-check",
        "release-without-owner-check",
        "renew-without-owner-check",
        "no-renewal",
    ],
)
def test_broken_backend_fails_the_suite(
    url: str,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    breakage: Breakage,
    guard: Callable[[str, str], None],
) -> None:
    cls = backend_class(url)
    for method, break_it in breakage.items():
        monkeypatch.setattr(cls, method, break_it(getattr(cls, method)))
    # Failing by an assertion, pytest.raises' "did not raise", or a lock error all count.
    with pytest.raises((AssertionError, pytest.fail.Exception, dlock.LockError)):
        guard(url, name)
