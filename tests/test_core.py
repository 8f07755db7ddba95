"""Core pieces that need no backend: backoff, argument checks, URLs and the registry."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import dlock
from dlock import _registry
from dlock._backoff import Backoff


def test_backoff_grows_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(initial=0.01, maximum=0.08, rng=random.Random(1))
    for attempt, cap in [(0, 0.01), (1, 0.02), (2, 0.04), (3, 0.08), (10, 0.08), (99, 0.08)]:
        delays = {backoff.delay(attempt, None, notifies=False) for _ in range(50)}
        assert all(cap / 2 <= delay <= cap for delay in delays), (attempt, delays)
        assert len(delays) > 1, "jittered"


def test_backoff_never_sleeps_past_the_current_lease() -> None:
    backoff = Backoff(initial=1.0, maximum=10.0)
    assert backoff.delay(5, retry_after=0.05, notifies=False) == pytest.approx(0.051)
    assert backoff.delay(0, retry_after=0.0, notifies=True) == pytest.approx(0.001)


def test_notifying_backend_waits_for_the_signal_with_a_fallback() -> None:
    backoff = Backoff(notify_fallback=2.0)
    assert backoff.delay(0, None, notifies=True) == 2.0
    assert backoff.delay(0, 0.5, notifies=True) == pytest.approx(0.501)


def test_default_url_uses_env_then_state_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DLOCK_URL", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert _registry.default_url() == f"sqlite://{tmp_path}/dlock/locks.sqlite3"
    with dlock.connect() as client, client.lock("default", ttl=5):
        assert (tmp_path / "dlock" / "locks.sqlite3").exists(), "created on first use"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _registry.default_url().endswith("/home/.local/state/dlock/locks.sqlite3")
    monkeypatch.setenv("DLOCK_URL", "sqlite:///elsewhere.db")
    assert _registry.default_url() == "sqlite:///elsewhere.db"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nosuch://host", "unknown URL scheme 'nosuch'"),
        ("no-scheme-here", "not a dlock URL"),
        ("sqlite://host/file.db", "names a file"),
        ("sqlite:///tmp/x.db?table=bad;name", "plain SQL identifier"),
        ("sqlite:///tmp/x.db?tabel=typo", "unknown sqlite option"),
        ("sqlite:///tmp/x.db?synchronous=sometimes", "synchronous"),
        ("sqlite:///tmp/x.db?busy_timeout=-1", "busy_timeout"),
        ("sqlite:///tmp/x.db?busy_timeout=nan", "busy_timeout"),
        ("sqlite:///tmp/x.db?busy_timeout=inf", "busy_timeout"),
        ("sqlite:///tmp/x.db?busy_timeout=soon", "busy_timeout"),
    ],
)
def test_bad_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(dlock.ConfigurationError, match=message):
        dlock.connect(url)


def test_sqlite_busy_timeout_option_is_checked() -> None:
    with pytest.raises(dlock.ConfigurationError, match="busy_timeout"):
        dlock.connect("sqlite:///tmp/x.db", busy_timeout=[1])


def test_missing_client_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        _registry.BACKENDS,
        "needs-lib",
        _registry.Entry("sqlite", ("needs-lib",), "fancy", ("sqlite3",)),
    )
    monkeypatch.delitem(sys.modules, "dlock._sync.backends.sqlite")
    monkeypatch.setitem(sys.modules, "sqlite3", None)
    with pytest.raises(dlock.BackendNotInstalled, match=r"pip install 'dlock\[fancy\]'"):
        dlock.connect("needs-lib://x")


def test_bad_label_is_refused(tmp_path: Path) -> None:
    with pytest.raises(dlock.InvalidArgument, match="label"):
        dlock.connect(f"sqlite://{tmp_path}/x.db", label=42)  # type: ignore[arg-type]


def test_error_hierarchy() -> None:
    assert issubclass(dlock.LockTimeout, TimeoutError)
    assert issubclass(dlock.LockLost, dlock.NotOwner)
    assert issubclass(dlock.BackendUnavailable, dlock.BackendError)
    for error in (dlock.InvalidName, dlock.InvalidTTL, dlock.InvalidTimeout):
        assert issubclass(error, ValueError) and issubclass(error, dlock.LockError)
    for base in (dlock.LockTimeout, dlock.NotOwner, dlock.BackendError, dlock.ConfigurationError):
        assert issubclass(base, dlock.LockError)
