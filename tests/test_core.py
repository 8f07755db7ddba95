"""Core pieces: backoff, argument checks, URLs and the registry; and lock behaviour
that needs a fault only SQLite can make on demand (another connection holding the
database's write lock), on both faces."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import math
import os
import random
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import dlock
import dlock.aio
from dlock import _registry
from dlock._backoff import Backoff
from dlock._fork import ForkFollower
from tests.forking import answer_in_a_child, in_a_fresh_interpreter


def test_backoff_grows_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(initial=0.01, maximum=0.08, rng=random.Random(1))
    for attempt, cap in [(0, 0.01), (1, 0.02), (2, 0.04), (3, 0.08), (10, 0.08), (99, 0.08)]:
        delays = {backoff.delay(attempt, None, notifies=False) for _ in range(50)}
        assert all(cap / 2 <= delay <= cap for delay in delays), (attempt, delays)
        assert len(delays) > 1, "jittered"


# Python 3.12+ warns about fork() in a process with threads; this test forks on purpose.
@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_forked_waiters_do_not_back_off_in_lockstep() -> None:
    """Workers forked from one process share its client's backoff: each drew the same
    jitter (a generator copied by the fork), so waiters started together retried
    together, the very thing jitter is for. A seeded generator stays as given."""
    shared, seeded = Backoff(), Backoff(rng=random.Random(1))

    def in_child(backoff: Backoff) -> list[float]:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                delays = [backoff.delay(attempt, None, notifies=False) for attempt in range(8)]
                os.write(write, json.dumps(delays).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            written = answer.read()
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        return list(json.loads(written))

    assert in_child(shared) != in_child(shared)
    assert in_child(seeded) == in_child(seeded)


def test_backoff_leaves_the_applications_random_numbers_alone() -> None:
    """Two workers that seed the random module alike (reproducible jobs) must still
    draw different jitter, and dlock's draws must not change what they draw next."""
    random.seed(42)
    first = [Backoff().delay(attempt, None, notifies=False) for attempt in range(8)]
    after_first = random.random()
    random.seed(42)
    second = [Backoff().delay(attempt, None, notifies=False) for attempt in range(8)]
    assert first != second
    random.seed(42)
    assert random.random() == after_first
    random.seed()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"initial": 0}, "initial must be a positive"),
        ({"initial": -0.1}, "initial must be a positive"),
        ({"maximum": math.nan}, "maximum must be a positive"),
        ({"maximum": math.inf}, "maximum must be a positive"),
        ({"notify_fallback": 0.0}, "notify_fallback must be a positive"),
        ({"notify_fallback": "2"}, "notify_fallback must be a positive"),
        ({"initial": True}, "initial must be a positive"),
        ({"initial": 0.5, "maximum": 0.1}, "maximum .* is below its initial"),
    ],
)
def test_bad_backoffs_are_refused(settings: dict[str, Any], message: str) -> None:
    """A zero, negative or NaN delay had every waiter retry in a busy loop."""
    with pytest.raises(dlock.InvalidArgument, match=message):
        Backoff(**settings)


@pytest.mark.parametrize("backoff", [5, 0, "fast", {"initial": 0.01}])
def test_a_backoff_that_is_not_a_backoff_is_refused(tmp_path: Path, backoff: object) -> None:
    """connect() took any value: a 0 stood for the defaults, anything else broke the
    first wait with an AttributeError, not the InvalidArgument of a bad Backoff."""
    url = f"sqlite://{tmp_path}/x.db"
    with pytest.raises(dlock.InvalidArgument, match=r"backoff must be a dlock\.Backoff"):
        dlock.connect(url, backoff=backoff)  # type: ignore[arg-type]
    with pytest.raises(dlock.InvalidArgument, match=r"backoff must be a dlock\.Backoff"):
        dlock.aio.connect(url, backoff=backoff)  # type: ignore[arg-type]


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


def test_an_empty_url_no_longer_means_the_default_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An empty URL (``connect(os.environ.get("LOCKS", ""))``, ``DLOCK_URL=$UNSET``)
    meant something else was meant: it gave the per-user SQLite file, so jobs on two
    hosts, or of two users, that should exclude each other both held the lock."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("DLOCK_URL", raising=False)
    with pytest.raises(dlock.ConfigurationError, match="not a dlock URL"):
        dlock.connect("")
    monkeypatch.setenv("DLOCK_URL", "")
    with pytest.raises(dlock.ConfigurationError, match="DLOCK_URL is empty"):
        dlock.connect()
    assert not (tmp_path / "dlock").exists()


def test_a_relative_xdg_state_home_is_ignored(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The XDG spec says a relative $XDG_STATE_HOME is invalid and to be ignored. Read,
    it made the lock file depend on the working directory: jobs started in two
    directories both held the same name."""
    monkeypatch.delenv("DLOCK_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", "state")
    monkeypatch.chdir(tmp_path)
    assert _registry.default_url() == f"sqlite://{tmp_path}/home/.local/state/dlock/locks.sqlite3"


@pytest.mark.parametrize(
    "url",
    [
        "etcd://locker:s3cr/t@etcd1:2379/locks",
        "etcd://locker:s3cr?t@etcd1/locks",
        "etcd://locker:123/45@etcd1/locks",
        "postgresql://dlock:s3cr/t@db1/app",
        "redis://:s3cr?t@cache1:6379/0",
        "zookeeper://locker:s3cr/t@zk1:2181/locks",
    ],
)
def test_a_password_with_an_unencoded_slash_or_question_mark_is_not_quoted(url: str) -> None:
    """The host part ended at the password's '/' or '?': the rest went to the path or
    an option's name, and the errors that followed quoted it ("bad port 's3cr'", "option
    't@etcd1/locks' is empty"), or the URL was taken with another host and port."""
    with pytest.raises(dlock.ConfigurationError, match="an '@' after its host") as refused:
        dlock.connect(url)
    assert "s3cr" not in str(refused.value) and "45" not in str(refused.value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nosuch://host", "unknown URL scheme 'nosuch'"),
        ("no-scheme-here", "not a dlock URL"),
        ("sqlite://host/file.db", "names a file"),
        ("sqlite:///tmp/x.db?table=bad;name", "plain SQL identifier"),
        ("sqlite:///tmp/x.db?tabel=typo", "unknown sqlite option"),
        ("sqlite:///tmp/x.db?synchronous=sometimes", "synchronous"),
        # Nothing synced: a crash of the host could corrupt the lock file.
        ("sqlite:///tmp/x.db?synchronous=off", "off syncs nothing"),
        ("sqlite:///tmp/x.db?busy_timeout=-1", "busy_timeout"),
        ("sqlite:///tmp/x.db?busy_timeout=nan", "busy_timeout"),
        ("sqlite:///tmp/x.db?busy_timeout=inf", "busy_timeout"),
        ("sqlite:///tmp/x.db?busy_timeout=soon", "busy_timeout"),
        # Each client would get a database of its own: nothing locked against another.
        ("sqlite::memory:", "in-memory"),
        # SQLAlchemy's spelling of it (as sqlite:////path is its absolute path): not a
        # lock file named ":memory:" in the root directory.
        ("sqlite:///:memory:", "in-memory"),
        ("sqlite:////:memory:", "in-memory"),
        ("sqlite:///tmp/a%00.db", "NUL"),
        # Silently the last, or the default, or another file: refused instead.
        ("sqlite:///tmp/x.db?table=a&table=b", "'table' is given twice"),
        ("sqlite:///tmp/x.db?table=", "'table' is empty"),
        ("sqlite:///tmp/x#y.db", "fragment"),
        ("postgresql://u@h/db?mode=lease&mode=session", "'mode' is given twice"),
        ("mysql://u@h/db?table=", "'table' is empty"),
        # Past 32-bit milliseconds PostgreSQL refused every connection, as retryable.
        ("postgresql://u@h/db?timeout=3e6", "timeout is '3e6' seconds; the longest"),
        ("mysql://u@h/db?connect_timeout=1e7", "connect_timeout is '1e7' seconds"),
        # An empty value: the driver's default, or nothing, where something was meant.
        ("postgresql://u@h/db?sslmode=", "'sslmode' is empty"),
        ("postgresql://u@h/db?target_session_attrs=", "'target_session_attrs' is empty"),
        ("postgresql://u@h/db?host=", "'host' is empty"),
        ("mysql://u@h/db?charset=", "'charset' is empty"),
        ("mysql://u@h/db?unix_socket=", "'unix_socket' is empty"),
        ("mysql://u@h/db?ssl_ca=", "'ssl_ca' is empty"),
        ("redis://h?password=", "'password' is empty"),
        ("redis://h?client_name", "'client_name' is empty"),
        ("redis+redlock://a:1,b:2,c:3?password=", "'password' is empty"),
        ("zookeeper://h:2181/p?session_timeout=", "'session_timeout' is empty"),
        # A value the driver does not know would fail every connection, as retryable.
        ("postgresql://u@h/db?sslmode=requir", "sslmode must be one of"),
        ("postgresql://u@h/db?sslmode=REQUIRE", "sslmode must be one of"),
        ("postgresql://u@h/db?target_session_attrs=bogus", "target_session_attrs must be"),
        ("mysql://u@h/db?charset=utf9", "charset 'utf9'"),
        ("mysql://u@h/db?charset=binary", "charset 'binary' has no Python codec"),
        ("redis://h?socket_timeout=1&socket_timeout=2", "given twice"),
        ("redis+redlock://a:1,b:2,c:3?socket_timeout=1&socket_timeout=2", "given twice"),
        ("zookeeper://h:2181/p?session_timeout=5&session_timeout=6", "given twice"),
        # An unclosed IPv6 bracket: urlsplit's own ValueError, before any backend reads it.
        ("redis://[::1:6379", "cannot be parsed"),
        ("postgresql://u@[::1/db", "cannot be parsed"),
        ("zookeeper://[::1:2181/p", "cannot be parsed"),
        ("sqlite://[x/y.db", "cannot be parsed"),
        # Kept by some parsers, stripped by others: with a blank at its end, a SQLite
        # file, an etcd prefix or a ZooKeeper root was a lock space of its own.
        ("sqlite:///tmp/x.db ", "blank at its end"),
        (" sqlite:///tmp/x.db", "blank at its start"),
        ("etcd://h:2379/p\n", "control character"),
        ("sqlite:///tmp/a\tb.db", "a control character \\('\\\\t'\\)"),
        ("zookeeper://h:2181/p\u00a0", "control character"),
        ("redis://h:6379/0\u200b", "control character"),
        # A byte not in UTF-8, as Python decodes a command line or the environment: an
        # internal error (quote() cannot encode it), where percent-encoding it works.
        ("sqlite:///tmp/caf\udce9.db", r"a byte that is not UTF-8 \('\\udce9'\).*\(%E9\)"),
        ("redis://h:6379/0\ud800", "a lone surrogate .* not valid Unicode"),
        # Past what a socket or a thread's wait holds: an OverflowError at first use.
        ("redis://h?socket_timeout=1e10", "socket_timeout is '1e10' seconds; the longest"),
        ("redis://h?socket_connect_timeout=1e10", "socket_connect_timeout is '1e10'"),
        ("redis://h?queue_ttl=1e300", "queue_ttl is '1e300' seconds"),
        ("etcd://h:2379/p?timeout=1e10", "timeout is '1e10' seconds"),
        ("etcd://h:2379/p?connect_timeout=1e10", "connect_timeout is '1e10' seconds"),
        ("etcd://h:2379/p?queue_ttl=1e300", "queue_ttl is '1e300' seconds"),
        ("zookeeper://h:2181/p?operation_timeout=1e10", "operation_timeout is '1e10'"),
        # A ValueError or httpx's InvalidURL at first use, not a dlock error (the second
        # member's: only when a failover reached it).
        ("etcd://127.0.0.1:\u00b3/x", "bad port"),
        ("etcd://::1/x", "in brackets"),
        ("etcd://fe80::1/x", "in brackets"),
        ("etcd://127.0.0.1:2379,::1/x", "in brackets"),
    ],
)
def test_bad_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(dlock.ConfigurationError, match=message):
        dlock.connect(url)


@pytest.mark.parametrize(
    "options",
    [{"busy_timeout": [1]}, {"busy_timeout": True}, {"busy_timeout": 10**400}, {"table": None}],
)
def test_sqlite_keyword_options_are_checked(options: dict[str, Any]) -> None:
    with pytest.raises(dlock.ConfigurationError, match=next(iter(options))):
        dlock.connect("sqlite:///tmp/x.db", **options)


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("postgresql://u@h/db", {"sslmode": ""}),
        ("postgresql://u@h/db", {"host": ""}),
        ("postgresql://u@h/db", {"target_session_attrs": "bogus"}),
        ("mysql://u@h/db", {"charset": ""}),
        ("mysql://u@h/db", {"unix_socket": ""}),
    ],
)
def test_sql_driver_keywords_are_checked(url: str, options: dict[str, Any]) -> None:
    """As in the URL: an empty or unknown value is refused now, not by every acquire."""
    with pytest.raises(dlock.ConfigurationError, match=next(iter(options))):
        dlock.connect(url, **options)


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("sqlite:///tmp/x.db?table=a", {"table": "b"}),
        ("postgresql://u@h/db?table=a", {"table": "b"}),
        ("mysql://u@h/db?mode=session", {"mode": "lease"}),
        ("redis://h?prefix=a", {"prefix": "b"}),
        ("redis+redlock://a:1,b:2,c:3?prefix=a", {"prefix": "b"}),
        ("zookeeper://h:2181/p?session_timeout=5", {"session_timeout": 5}),
        ("etcd://h:2379/p?queue_ttl=6", {"queue_ttl": 6}),
    ],
)
def test_an_option_in_both_the_url_and_a_keyword_is_refused(
    url: str, options: dict[str, Any]
) -> None:
    """As one given twice in the query: the keyword silently won, and a table, mode or
    key prefix apart from the URL's was a lock space apart from its other clients."""
    for connect in (dlock.connect, dlock.aio.connect):
        with pytest.raises(dlock.ConfigurationError, match=f"{next(iter(options))}.* both"):
            connect(url, **options)


def test_default_database_path_is_quoted_into_its_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A state directory whose name has URL syntax in it (``#``, ``%``, ``?``) is still
    the file used, not a fragment, an escape or a query."""
    state = tmp_path / "odd #1 %41 ?q"
    monkeypatch.delenv("DLOCK_URL", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    with dlock.connect() as client, client.lock("default", ttl=5):
        assert (state / "dlock" / "locks.sqlite3").exists()


def test_a_state_directory_that_is_not_utf8_no_longer_fails_every_client(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """File names are bytes: a home or state directory named in another encoding
    (``\\xff``, Latin-1) failed every ``connect()`` with a UnicodeEncodeError, and so
    every ``dlock`` command. A ``%FF`` in a sqlite URL named the file by U+FFFD, another
    file, rather than by the byte it escapes."""
    state = Path(os.fsdecode(bytes(tmp_path) + b"/\xe9t\xe9"))
    monkeypatch.delenv("DLOCK_URL", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    with dlock.connect() as client, client.lock("default", ttl=5):
        assert (state / "dlock" / "locks.sqlite3").exists()
    with dlock.connect(f"sqlite://{tmp_path}/%FF.db") as client, client.lock("x", ttl=5):
        assert os.listdir(bytes(tmp_path)).count(b"\xff.db") == 1


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


@pytest.mark.parametrize(
    "label",
    [42, "x" * 513, "é" * 86, "\U0001f512" * 43, "lone \udc80 surrogate"],
    ids=["int", "513 ASCII", "86 accented", "43 emoji", "lone surrogate"],
)
def test_bad_label_is_refused(tmp_path: Path, label: object) -> None:
    """Every backend stores the holder's record (host, pid, label as JSON, where a
    non-ASCII character takes 6 or 12 characters) in 1024 characters: a longer label
    failed every acquire on the SQL servers with the driver's "data too long"."""
    with pytest.raises(dlock.InvalidArgument, match="label"):
        dlock.connect(f"sqlite://{tmp_path}/x.db", label=label)  # type: ignore[arg-type]


def test_a_list_prefix_with_a_lone_surrogate_is_refused(tmp_path: Path) -> None:
    """Names with one are refused as InvalidName; a prefix with one reached the backend's
    encoder and came out as a bare UnicodeEncodeError."""
    url = f"sqlite://{tmp_path}/x.db"
    with dlock.connect(url) as client:
        with pytest.raises(dlock.InvalidArgument, match=r"prefix.*surrogate"):
            client.list("job-\ud800")
        assert client.list("") == []

    async def main() -> None:
        async with dlock.aio.connect(url) as client:
            with pytest.raises(dlock.InvalidArgument, match=r"prefix.*surrogate"):
                await client.list("\udfff")

    asyncio.run(main())


#: Labels just within the limit (SQL servers: ``test_the_longest_labels_fit``).
LONGEST_LABELS = ("x" * 512, "é" * 85, "\U0001f512" * 42)


def test_label_at_the_limit_is_kept(tmp_path: Path) -> None:
    for label in LONGEST_LABELS:
        with (
            dlock.connect(f"sqlite://{tmp_path}/x.db", label=label) as client,
            client.lock("x", ttl=5),
        ):
            info = client.inspect("x")
            assert info is not None and info.holder.label == label


def test_numbers_beyond_any_float_are_argument_errors(tmp_path: Path) -> None:
    """An int too large for a float is refused like any out-of-range number, not with
    Python's OverflowError; as a timeout it means "wait forever", as infinity does."""
    huge = 10**400
    with dlock.connect(f"sqlite://{tmp_path}/x.db") as client:
        with pytest.raises(dlock.InvalidTTL):
            client.lock("x", ttl=huge)
        with pytest.raises(dlock.InvalidTTL):
            client.lock("x", ttl=-huge)
        with pytest.raises(dlock.InvalidTimeout):
            client.lock("x", ttl=5).acquire(timeout=-huge)
        lock = client.lock("x", ttl=5)
        assert lock.acquire(timeout=huge)
        lock.release()
        with pytest.raises(dlock.InvalidArgument, match="older_than"):
            client.prune(older_than=huge)
        for batch in (10**20, 100_001, 0):
            with pytest.raises(dlock.InvalidArgument, match="batch"):
                client.prune(batch=batch)
        assert client.prune(batch=100_000) == 0


def test_error_hierarchy() -> None:
    assert issubclass(dlock.LockTimeout, TimeoutError)
    assert issubclass(dlock.LockLost, dlock.NotOwner)
    assert issubclass(dlock.BackendUnavailable, dlock.BackendError)
    for error in (dlock.InvalidName, dlock.InvalidTTL, dlock.InvalidTimeout):
        assert issubclass(error, ValueError) and issubclass(error, dlock.LockError)
    for base in (dlock.LockTimeout, dlock.NotOwner, dlock.BackendError, dlock.ConfigurationError):
        assert issubclass(base, dlock.LockError)


def test_failed_release_stops_renewing_the_lease(tmp_path: Path) -> None:
    """The holder tried to leave: its lease must end by its TTL at the latest, not be
    renewed until the client closes because the release did not get through."""
    db = tmp_path / "locks.sqlite3"
    url = f"sqlite://{db}?busy_timeout=0.3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=2)
        assert lock.acquire(timeout=0)
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(dlock.BackendError):
                lock.release()
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        assert not lock.owned()
        assert other.lock("job", ttl=5).acquire(timeout=2 + 5)


@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_a_grant_that_comes_after_its_lease_ended_is_no_lock(tmp_path: Path, face: str) -> None:
    """An acquire answered only after its ttl (the backend stalled: here the file is
    write-locked by another connection for 1.2 s, the ttl 0.4 s) was granted a lease
    that, counted from when the acquire was sent, had ended before the answer came. It
    raises BackendUnavailable and the lock is not held; it returned True before, with
    the lock lost at once (``lost`` true, ``on_lost`` called), so that a ``with`` body
    ran on a dead lease."""
    db = tmp_path / "locks.sqlite3"
    url = f"sqlite://{db}?busy_timeout=5"
    with dlock.connect(url) as client:
        client.inspect("job")  # the table exists before the file is write-locked
    blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    losses: list[object] = []
    commit = threading.Timer(1.2, blocker.execute, ["COMMIT"])

    def stall() -> None:
        blocker.execute("BEGIN IMMEDIATE")
        commit.start()

    async def asyncio_face() -> None:
        async with dlock.aio.connect(url) as client:
            lock = client.lock("job", ttl=0.4, on_lost=losses.append)
            stall()
            with pytest.raises(dlock.BackendUnavailable, match="after the acquire was sent"):
                await lock.acquire(timeout=0)
            assert not lock.owned() and lock.fencing_token is None
            assert await client.lock("job", ttl=5).acquire(timeout=0)

    try:
        if face == "asyncio":
            asyncio.run(asyncio_face())
        else:
            with dlock.connect(url) as client:
                lock = client.lock("job", ttl=0.4, on_lost=losses.append)
                stall()
                with pytest.raises(dlock.BackendUnavailable, match="after the acquire was sent"):
                    lock.acquire(timeout=0)
                assert not lock.owned() and lock.fencing_token is None
                assert client.lock("job", ttl=5).acquire(timeout=0)
    finally:
        if commit.is_alive():
            commit.join()
        blocker.close()
    assert losses == []


def test_cancelled_release_gives_the_lease_back(tmp_path: Path) -> None:
    """A release cancelled while it waits (asyncio.timeout, a TaskGroup shutting down)
    leaves the hold too: the lease is given back, not renewed for its 30 s TTL."""
    db = tmp_path / "locks.sqlite3"
    url = f"sqlite://{db}?busy_timeout=5"

    async def main() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            lock = client.lock("job", ttl=30)
            assert await lock.acquire(timeout=0)
            blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
            blocker.execute("BEGIN IMMEDIATE")
            try:
                release = asyncio.create_task(lock.release())
                await asyncio.sleep(0.3)
                release.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await release
            finally:
                blocker.execute("COMMIT")
                blocker.close()
            assert not lock.owned()
            started = time.monotonic()
            assert await other.lock("job", ttl=5).acquire(timeout=10)
            assert time.monotonic() - started < 10

    asyncio.run(main())


def test_the_longest_lease_does_not_stop_renewal(tmp_path: Path) -> None:
    """A lease as long as any backend keeps beside a short one: the renewer, which once
    slept until the long lease was due and died of a thread's wait overflowing (past
    about 9.2e9 s), leaving every other lock of its client unrenewed, renews both (it
    now sleeps at most RESUME_CHECK while it holds leases)."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        forever = client.lock("forever", ttl=dlock.MAX_TTL)
        assert forever.acquire(timeout=0)
        time.sleep(0.5)  # the renewer goes to sleep
        short = client.lock("short", ttl=1)
        assert short.acquire(timeout=0)
        time.sleep(2.5)
        assert short.owned() and forever.owned()
        short.release()
        forever.release()


def _suspend_host(client: dlock.Client | dlock.aio.AsyncClient, seconds: float) -> None:
    """What a suspended host does to the clocks: the boot clock, which leases are counted
    on, moves on by ``seconds``; CLOCK_MONOTONIC, which sleeps and timers run on, does
    not."""
    real = client._clock
    client._clock = client._renewer._clock = lambda: real() + seconds


def test_a_lease_that_ran_out_while_the_host_was_suspended_is_told_soon(
    tmp_path: Path,
) -> None:
    """The renewer sleeps until a lease is due (a third of a 30 s TTL), on timers that
    stop while the host is suspended. A resume past the lease's end was told when that
    sleep ended, 10 s on; the renewer now looks again every second while it holds any."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        told = threading.Event()
        lock = client.lock("job", ttl=30, on_lost=lambda _: told.set())
        assert lock.acquire(timeout=0)
        time.sleep(0.3)  # the renewer goes to sleep until the lease is due
        _suspend_host(client, 60)
        resumed = time.monotonic()
        assert told.wait(5), "not told within 5 s of the resume"
        assert time.monotonic() - resumed < 2
        assert not lock.owned()

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client:
            told = asyncio.Event()
            lock = client.lock("job", ttl=30, on_lost=lambda _: told.set())
            assert await lock.acquire(timeout=0)
            await asyncio.sleep(0.3)
            _suspend_host(client, 60)
            resumed = time.monotonic()
            await asyncio.wait_for(told.wait(), 5)
            assert time.monotonic() - resumed < 2
            assert not lock.owned()

    asyncio.run(async_face())


# Python 3.12+ warns about fork() in a process with threads; this test forks on purpose.
@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_renews_its_own_locks(tmp_path: Path) -> None:
    """The renewer thread stays in the parent; the child's client starts its own, and
    shows the child as the holder."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        with client.lock("in-parent", ttl=30):
            pass  # the parent's renewer thread runs from now on
        child = os.fork()
        if child == 0:
            code = 1
            try:
                lock = client.lock("in-child", ttl=1)
                lock.acquire()
                time.sleep(2.5)
                info = client.inspect("in-child")
                pid = info.holder.pid if info is not None else None
                code = 2 if not lock.owned() else 3 if pid != os.getpid() else 0
                lock.release()
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "2: not renewed, 3: wrong pid"


@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_closing_the_client_leaves_the_parents_locks(tmp_path: Path) -> None:
    """close() gives back the locks its client holds; in a forked child, the copies of
    its parent's are not the child's to give back: they share the parent's owner token,
    and the parent still holds them."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        renewed = client.lock("renewed", ttl=30)
        unrenewed = client.lock("unrenewed", ttl=30, auto_renew=False)
        assert renewed.acquire(timeout=0) and unrenewed.acquire(timeout=0)
        child = os.fork()
        if child == 0:
            code = 1
            try:
                client.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for lock in (renewed, unrenewed):
            info = client.inspect(lock.name)
            assert info is not None and info.fencing_token == lock.fencing_token, lock
            lock.release()


@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_forked_child_neither_releases_nor_enters_its_parents_hold(
    tmp_path: Path, reentrant: bool
) -> None:
    """A lock object copied into a forked child carries the parent's hold and owner
    token: its release freed the parent's lease (a third process then took the lock
    while the parent worked on), and a reentrant one's acquire re-entered it (parent
    and child both held it). The hold stays the parent's; the child's release says
    why it cannot, its acquire is a fresh one (busy here), and a ``with`` block entered
    before the fork ends in the child without releasing."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as rival:
        lock = client.lock("job", ttl=30, reentrant=reentrant)

        def release() -> str:
            lock.release()
            return "released"

        def enter() -> str:
            return f"owned={lock.owned()} acquired={lock.acquire(timeout=0)}"

        def leave_the_block() -> str:
            # What a block's end runs: __exit__ (here without the body's frame).
            lock.__exit__(None, None, None)
            return "left"

        with lock:
            token = lock.fencing_token
            assert "forked from" in answer_in_a_child(release)
            assert answer_in_a_child(enter) == "owned=False acquired=False"
            assert answer_in_a_child(leave_the_block) == "left"
            info = client.inspect("job")
            assert info is not None and info.fencing_token == token and info.count == 1
            assert lock.owned()
            assert not rival.lock("job", ttl=5).acquire(timeout=0)
        assert client.inspect("job") is None


@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_child_forked_during_a_renewal_renews_its_own_hold_of_the_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process forked while its renewer's call for a lock object was in flight: the
    child got that renewal's write, never to end there, among the object's writes in
    flight. Every renewal of the child's own hold of the object overlapped it, so was
    counted to end no later than it (see _write_done), and the hold was told lost a
    TTL after the parent's renewal was sent, renewed all along."""
    parent = os.getpid()
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        real_extend_many = client._backend.extend_many
        in_flight, go_on = threading.Event(), threading.Event()

        def held_up_in_the_parent(leases: list[Any]) -> Any:
            if os.getpid() == parent:
                in_flight.set()
                go_on.wait(10)
            return real_extend_many(leases)

        monkeypatch.setattr(client._backend, "extend_many", held_up_in_the_parent)
        lock = client.lock("job", ttl=1.0)
        assert lock.acquire(timeout=0)
        try:
            assert in_flight.wait(5)
            # The parent lets go once the child waits for the lock.
            threading.Timer(0.2, lock.release).start()

            def hold_for_two_ttls() -> str:
                if not lock.acquire(timeout=5):
                    return "not acquired"
                time.sleep(2.0)
                return f"owned={lock.owned()}"

            assert answer_in_a_child(hold_for_two_ttls) == "owned=True"
        finally:
            go_on.set()


def test_owned_is_false_first_thing_in_a_child_forked_without_hooks(tmp_path: Path) -> None:
    """uWSGI forks its workers from C without Python's at-fork hooks: the child notices
    the fork as a call of the public API starts. ``owned()`` did not look, so a worker
    asking it first was told that it held its parent's lock, True until some other call
    noticed the fork."""
    in_a_fresh_interpreter(owned_is_false_first_thing, tmp_path)


def owned_is_false_first_thing(tmp_path: Path) -> None:
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=30)
        with lock:

            def asked_first() -> str:
                return f"owned={lock.owned()}"

            answer = answer_in_a_child(asked_first, fork=ctypes.PyDLL(None).fork)
            assert answer == "owned=False", answer
            assert lock.owned()


@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_tells_a_loss_while_a_parents_thread_was_telling_one(
    tmp_path: Path,
) -> None:
    """A thread of the parent (its renewer) was telling a loss of the lock object, its
    on_lost running, when the process forked: the child got the object's loss lock
    held by a thread it does not have, and the loss of its own hold of the object
    later hung there."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=0.2, auto_renew=False)
        telling, told = threading.Event(), threading.Event()

        def tell_a_loss() -> None:
            with lock._loss_lock:  # as _declare_lost holds it while on_lost runs
                telling.set()
                told.wait()

        def lose_its_own_hold() -> str:
            assert lock.acquire(timeout=0)
            time.sleep(0.3)
            with pytest.raises(dlock.LockLost):
                lock.extend()
            return "told"

        thread = threading.Thread(target=tell_a_loss)
        thread.start()
        telling.wait()
        try:
            assert answer_in_a_child(lose_its_own_hold) == "told"
        finally:
            told.set()
            thread.join()


@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_gives_back_with_a_parents_attempt_in_flight(tmp_path: Path) -> None:
    """A thread of the parent has an attempt in flight on a lock object when the
    process forks: in the child, that attempt never ends, and must not hold up the
    give-back of the child's own attempt, granted but cut off."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        shared = client.lock("job", ttl=30)
        real_acquire = client._backend.acquire
        parent = os.getpid()
        in_flight, forked = threading.Event(), threading.Event()

        def acquire(*args: Any) -> Any:
            if os.getpid() == parent:
                in_flight.set()
                forked.wait(10)
                return real_acquire(*args)
            real_acquire(*args)
            raise dlock.BackendUnavailable("no answer in time")

        client._backend.acquire = acquire  # type: ignore[method-assign,assignment]
        thread = threading.Thread(target=shared.acquire, kwargs={"timeout": 0})
        thread.start()
        assert in_flight.wait(10)
        child = os.fork()
        if child == 0:
            code = 1
            try:
                with pytest.raises(dlock.BackendUnavailable):
                    shared.acquire(timeout=0)
                for give_back in client._give_backs:
                    give_back.join(10)
                code = 0 if other.inspect("job") is None else 2
            finally:
                os._exit(code)
        # The parent's attempt goes on once the child is done: it would take the lock.
        _, status = os.waitpid(child, 0)
        forked.set()
        thread.join()
        assert os.waitstatus_to_exitcode(status) == 0, "2: the child's lease not given back"
        client._backend.acquire = real_acquire  # type: ignore[method-assign]


@pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_starts_over_once_before_its_threads_go_on() -> None:
    """What a process keeps (connections, renewer, held locks) starts over once in a
    forked child, whichever of its threads comes first; the others wait for it. Even if
    a thread that stayed in the parent was starting over at the fork (in a child's
    child): its lock is not left taken for ever."""
    starts: list[int] = []

    def start_over() -> None:
        time.sleep(0.05)  # long enough for the child's other threads to come in
        starts.append(os.getpid())

    follower = ForkFollower(start_over)
    follower()
    assert starts == []
    holding, forked = threading.Event(), threading.Event()

    def hold() -> None:
        with follower._lock:
            holding.set()
            forked.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            users = [threading.Thread(target=follower) for _ in range(4)]
            for user in users:
                user.start()
            for user in users:
                user.join(5)
            stuck = any(user.is_alive() for user in users)
            code = 2 if stuck else 0 if starts == [os.getpid()] else 3
        finally:
            os._exit(code)
    forked.set()
    thread.join()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "2: deadlocked, 3: not started over once"
    assert starts == []


def test_an_async_client_renews_in_a_second_event_loop(tmp_path: Path) -> None:
    """A client made once (at module level, say) and used by two asyncio.run calls: the
    first loop's renewer task ended with that loop, so the second needs its own."""
    client = dlock.aio.connect(f"sqlite://{tmp_path}/locks.sqlite3")

    async def hold() -> bool:
        lock = client.lock("job", ttl=1)
        async with lock:
            await asyncio.sleep(2.5)
            return lock.owned()

    assert asyncio.run(hold())
    assert asyncio.run(hold())
    asyncio.run(client.aclose())


def test_a_hold_carried_into_a_later_event_loop_is_renewed_from_its_first_call(
    tmp_path: Path,
) -> None:
    """A lock taken in one asyncio.run and still held in the next: its renewer task
    ended with the first loop, and only a new lease started one again, so the hold was
    neither renewed nor its loss told (on_lost) in the second loop: another client took
    the lock while its holder's block ran on (a helper's run, every backend). The first
    call of the lock's in the new loop (owned() here) starts the renewer again."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    client = dlock.aio.connect(url)
    lock = client.lock("job", ttl=1.5)

    async def take() -> None:
        assert await lock.acquire(timeout=0)

    async def hold_on() -> bool:
        assert lock.owned()
        await asyncio.sleep(3)
        async with dlock.aio.connect(url) as other:
            taken = await other.lock("job", ttl=5).acquire(timeout=0)
        return lock.owned() and not taken

    asyncio.run(take())
    try:
        assert asyncio.run(hold_on()), "the hold was not renewed in the second loop"
    finally:
        asyncio.run(client.aclose())


def test_give_backs_left_by_an_ended_event_loop_are_not_waited_for(tmp_path: Path) -> None:
    """An acquire cut off in flight leaves a give-back task behind; once its loop has
    ended, neither the next acquire nor close may wait for it (asyncio asks the closed
    loop to call back: RuntimeError "Event loop is closed")."""
    client = dlock.aio.connect(f"sqlite://{tmp_path}/locks.sqlite3")
    lock = client.lock("job", ttl=5)

    async def cut_off() -> None:
        attempt = asyncio.create_task(lock.acquire())
        await asyncio.sleep(0)  # the attempt is now in the backend's call
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert client._give_backs and lock._give_back is not None
        await asyncio.wait(client._give_backs)

    async def use_again() -> None:
        assert await lock.acquire(timeout=0)
        await lock.release()
        await client.aclose()

    asyncio.run(cut_off())
    asyncio.run(use_again())


def test_give_backs_are_asked_again_in_a_second_event_loop(tmp_path: Path) -> None:
    """A client used by two asyncio.run calls: in each, a release fails while another
    connection keeps the SQLite file write-locked, and its give-back is asked again once
    the file is free. The first loop's asking task ended with it, and so must its
    wake-up event, which asyncio binds to the loop that first waited on it."""
    path = tmp_path / "locks.sqlite3"
    client = dlock.aio.connect(f"sqlite://{path}?busy_timeout=0.2")

    async def release_in_a_fault() -> None:
        lock = client.lock("job", ttl=30)
        assert await lock.acquire(timeout=0)
        blocker = sqlite3.connect(path)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            with pytest.raises(dlock.BackendUnavailable):
                await lock.release()
            await asyncio.sleep(1)  # the give-back in the background fails too
        finally:
            blocker.close()
        freed = time.monotonic() + 3
        while await client.inspect("job") is not None:
            assert time.monotonic() < freed, "the give-back was not asked again"
            await asyncio.sleep(0.05)

    asyncio.run(release_in_a_fault())
    asyncio.run(release_in_a_fault())
    asyncio.run(client.aclose())


def test_a_give_back_cut_off_by_the_end_of_its_event_loop_is_asked_in_the_next(
    tmp_path: Path,
) -> None:
    """A release fails (the SQLite file write-locked) and asyncio.run ends at once:
    the give-back task, cancelled with its loop before it failed into the retrier, was
    never asked again, neither in the next loop nor by close(): the lock stayed taken
    until its TTL (a helper's run, every server backend). It is kept to ask again, from
    the next loop's first call of a lock (here owned()), and by close()."""
    path = tmp_path / "locks.sqlite3"
    url = f"sqlite://{path}?busy_timeout=0.2"
    client = dlock.aio.connect(url)
    lock = client.lock("job", ttl=30)
    blocker = sqlite3.connect(path, isolation_level=None)

    async def release_in_a_fault() -> None:
        assert await lock.acquire(timeout=0)
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(dlock.BackendUnavailable):
            await lock.release()

    async def next_loop() -> None:
        assert not lock.owned()
        freed = time.monotonic() + 3
        while await client.inspect("job") is not None:
            assert time.monotonic() < freed, "the give-back was not asked again"
            await asyncio.sleep(0.05)

    try:
        asyncio.run(release_in_a_fault())
    finally:
        blocker.close()
    try:
        asyncio.run(next_loop())
    finally:
        asyncio.run(client.aclose())


def test_a_block_whose_hold_was_lost_leaves_another_users_fresh_hold(tmp_path: Path) -> None:
    """A non-reentrant lock object shared by two threads: one is in a ``with`` block
    when its lease runs out; the other then acquires the object afresh, as a call made
    after a loss does. The block's end released that fresh hold, saying nothing: its
    holder believed it held the lock while another client took it (a helper's run, 3
    of 3). A block ends only the hold it entered: its end raises LockLost."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=0.3, auto_renew=False)
        entered, leave = threading.Event(), threading.Event()
        ended: list[BaseException | None] = []

        def block() -> None:
            try:
                with lock:
                    entered.set()
                    leave.wait(10)
                ended.append(None)
            except BaseException as exc:
                ended.append(exc)

        thread = threading.Thread(target=block)
        thread.start()
        assert entered.wait(5)
        time.sleep(0.5)  # the block's lease runs out
        assert lock.acquire(timeout=1), "the lost hold was not acquired afresh"
        leave.set()
        thread.join(10)
        assert len(ended) == 1 and isinstance(ended[0], dlock.LockLost), ended
        assert lock.owned(), "the block's end ended the fresh hold"
        assert not other.lock("job", ttl=5).acquire(timeout=0)
        lock.release()


def test_a_give_back_that_keeps_failing_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """Each round of asking give-backs again asks one first, and the rest only if that
    one is answered. One whose server stays down (a Redis Cluster node; played here by
    failing every release of its name) went first every round, and the others were
    never asked again; another goes first in the next round now."""
    client = dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3")
    backend: Any = client._backend
    release, down = backend.release, {"stays-down", "comes-back"}

    def release_unless_down(name: str, token: str) -> int | None:
        if name in down:
            raise dlock.BackendUnavailable(f"{name}: down")
        result: int | None = release(name, token)
        return result

    try:
        locks = [client.lock(name, ttl=30) for name in ("stays-down", "comes-back")]
        for lock in locks:
            assert lock.acquire(timeout=0)
        backend.release = release_unless_down
        for lock in locks:
            with pytest.raises(dlock.BackendUnavailable):
                lock.release()
            time.sleep(0.3)  # its give-back fails too: asked again, in this order
        down.discard("comes-back")
        freed = time.monotonic() + 4
        while client.inspect("comes-back") is not None:
            assert time.monotonic() < freed, "held up by the give-back still failing"
            time.sleep(0.05)
        assert client.inspect("stays-down") is not None
    finally:
        down.clear()
        client.close()


def losing_cancellations(
    backend_call: Callable[..., Awaitable[Any]], expire_at_answer: list[Any]
) -> Callable[..., Awaitable[Any]]:
    """``backend_call`` sent as redis-py sends every command, under ``asyncio.wait_for``:
    before Python 3.12 that returns its inner task's result when a cancellation races
    that task's end, and the cancellation is lost. The caller's deadline (an
    ``asyncio.Timeout`` put in ``expire_at_answer``) passes just as the answer comes in."""

    async def answer_then_expire(*args: Any) -> Any:
        answer = await backend_call(*args)
        if expire_at_answer:
            # The caller's task is cancelled before the task waiting for this one resumes.
            expire_at_answer.pop().reschedule(asyncio.get_running_loop().time())
        return answer

    async def sent_as_wait_for_did(*args: Any) -> Any:
        call = asyncio.ensure_future(answer_then_expire(*args))
        try:
            await asyncio.wait([call])
        except asyncio.CancelledError:
            if not call.done():
                call.cancel()
                raise
        return call.result()  # the cancellation is lost (Python < 3.12)

    return sent_as_wait_for_did


def then(
    backend_call: Callable[..., Awaitable[Any]], meanwhile: Callable[[], Awaitable[None]]
) -> Callable[..., Awaitable[Any]]:
    """``backend_call``, followed by ``meanwhile`` before it answers."""

    async def call(*args: Any) -> Any:
        answer = await backend_call(*args)
        await meanwhile()
        return answer

    return call


#: What clients_losing_cancellations yields: a client whose backend loses cancellations,
#: another client of the same file, and a call that checks one operation timed out.
LossyClients = tuple[
    dlock.aio.AsyncClient, dlock.aio.AsyncClient, Callable[[Awaitable[Any]], Awaitable[None]]
]


@contextlib.asynccontextmanager
async def clients_losing_cancellations(
    tmp_path: Path, *calls: str, meanwhile: Callable[[], Awaitable[None]] | None = None
) -> AsyncIterator[LossyClients]:
    """Two clients of one SQLite file; the first's backend sends ``calls`` (method names)
    as redis-py sends every command (see losing_cancellations), running ``meanwhile``
    once each has been carried out, before its answer comes in. The third value,
    ``timed_out(operation)``, awaits ``operation`` under an ``asyncio.timeout`` that
    expires just as the backend answers, and checks that it raised TimeoutError, with
    the task's cancellation count back where it was."""
    if sys.version_info < (3, 11):  # for mypy, which checks against 3.10
        raise NotImplementedError("asyncio counts cancellations from 3.11")
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
        expire_at_answer: list[Any] = []  # asyncio.Timeout, unknown to 3.10
        for call in calls:
            carried_out = getattr(client._backend, call)
            if meanwhile is not None:
                carried_out = then(carried_out, meanwhile)
            lossy = losing_cancellations(carried_out, expire_at_answer)
            setattr(client._backend, call, lossy)
        task = asyncio.current_task()
        assert task is not None

        async def timed_out(operation: Awaitable[Any]) -> None:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as deadline:
                    expire_at_answer.append(deadline)
                    await operation
            assert task.cancelling() == 0

        yield client, other, timed_out


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio counts cancellations from 3.11")
def test_a_cancellation_lost_by_a_client_library_still_stops_acquire(tmp_path: Path) -> None:
    """Before Python 3.12, ``asyncio.wait_for`` returns its inner task's result when a
    cancellation races that task's end, and the cancellation is lost; redis-py sends
    every command under one. Here a real backend's acquire is called that way, and the
    caller's ``asyncio.timeout`` expires just as the answer comes in: it must still
    raise TimeoutError at once (not let the wait go on until the holder left), with the
    task's cancellation count back where it was, and a lease granted by that call must
    be given back."""

    async def main() -> None:
        async with clients_losing_cancellations(tmp_path, "acquire") as (client, other, timed_out):
            lock = client.lock("job", ttl=30)
            holder = other.lock("job", ttl=30)
            assert await holder.acquire(timeout=0)
            started = time.monotonic()
            await timed_out(lock.acquire(timeout=3))
            assert time.monotonic() - started < 1, "the wait went on"
            await holder.release()

            await timed_out(lock.acquire(timeout=3))
            assert lock.fencing_token is not None, "granted before the timeout"
            assert not lock.owned()
            assert await other.lock("job", ttl=30).acquire(timeout=5), "given back"

            # A re-entry leaves its own entry; the outer hold stays.
            outer = client.lock("again", ttl=30, reentrant=True)
            assert await outer.acquire(timeout=0)
            await timed_out(outer.acquire(timeout=0))
            info = await other.inspect("again")
            assert info is not None and info.count == 1
            assert outer.owned()
            await outer.release()
            assert await other.inspect("again") is None

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio counts cancellations from 3.11")
def test_a_cancellation_lost_by_a_client_library_still_stops_release_and_extend(
    tmp_path: Path,
) -> None:
    """As for acquire above: a release or extend that the backend carried out while the
    caller's ``asyncio.timeout`` expired, the cancellation lost on the way, still raises
    TimeoutError (the caller would otherwise go on past its deadline), with the work done:
    the lock released, the lease extended."""

    async def main() -> None:
        lossy = clients_losing_cancellations(tmp_path, "extend", "release")
        async with lossy as (client, other, timed_out):
            lock = client.lock("job", ttl=2, auto_renew=False)
            assert await lock.acquire(timeout=0)

            await timed_out(lock.extend(60))
            info = await other.inspect("job")
            assert info is not None and info.expires_in is not None and info.expires_in > 30
            assert lock.owned() and lock._deadline - client._clock() > 30

            await timed_out(lock.release())
            assert not lock.owned()
            assert await other.inspect("job") is None

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio counts cancellations from 3.11")
def test_a_cancellation_lost_by_an_extend_that_another_user_outran_still_stops_it(
    tmp_path: Path,
) -> None:
    """The same for an extend carried out just before another user of the lock object
    released it: it answers for a hold that is over, and must still raise the
    caller's TimeoutError rather than return as if nothing had been asked of it."""

    async def main() -> None:
        async def released_by_another_user() -> None:
            await lock.release()

        lossy = clients_losing_cancellations(tmp_path, "extend", meanwhile=released_by_another_user)
        async with lossy as (client, other, timed_out):
            lock = client.lock("job", ttl=30, auto_renew=False)
            assert await lock.acquire(timeout=0)
            await timed_out(lock.extend(60))
            assert not lock.owned()
            assert await other.inspect("job") is None

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio counts cancellations from 3.11")
def test_a_cancellation_pending_when_acquire_starts_still_stops_it(tmp_path: Path) -> None:
    """A task that asked for its own cancellation (directly, or through code it ran,
    as dlock's cancel_on_lost does) starts acquire with it pending. redis-py checks an
    idle connection under ``asyncio.timeout(0)``, which turns a pending cancellation
    into its own TimeoutError and drops it, the count unchanged: acquire must not go on
    to take the lock for a cancelled task."""
    if sys.version_info < (3, 11):  # for mypy, which checks against 3.10
        return
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    async def main() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            backend = client._backend
            real_acquire = backend.acquire

            async def checked_as_redis_py_does(*args: Any) -> Any:
                try:
                    async with asyncio.timeout(0):
                        await asyncio.sleep(1)
                except TimeoutError:
                    pass
                return await real_acquire(*args)

            backend.acquire = checked_as_redis_py_does  # type: ignore[method-assign,unused-ignore]
            lock = client.lock("job", ttl=30)

            async def cancelled_before_acquire() -> bool:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                return await lock.acquire(timeout=0)

            with pytest.raises(asyncio.CancelledError):
                await asyncio.create_task(cancelled_before_acquire())
            assert not lock.owned()
            assert await other.lock("job", ttl=30).acquire(timeout=0), "not taken"

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio counts cancellations from 3.11")
def test_a_reentry_that_cannot_be_undone_tells_the_outer_hold_it_is_lost(
    tmp_path: Path,
) -> None:
    """A re-entry granted and then cut off is undone by one release. If that release
    fails, the whole hold is abandoned (given back in the background, no longer
    renewed), the outer one too: the outer block must be told it lost the lock, not
    run on believing it holds it (and get NotOwner on leaving)."""
    if sys.version_info < (3, 11):  # for mypy, which checks against 3.10
        return
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    async def main() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            backend = client._backend
            real_acquire, real_release = backend.acquire, backend.release
            task = asyncio.current_task()
            assert task is not None

            async def answer_then_cancelled(*args: Any) -> Any:
                answer = await real_acquire(*args)
                task.cancel()  # cut off once answered: the grant is to be undone
                return answer

            async def failing_once(*args: Any) -> Any:
                backend.release = real_release  # type: ignore[method-assign,unused-ignore]
                raise dlock.BackendUnavailable("no answer")

            lost: list[object] = []
            lock = client.lock("job", ttl=30, reentrant=True, on_lost=lost.append)
            with pytest.raises(dlock.LockLost):
                async with lock:
                    backend.acquire = answer_then_cancelled  # type: ignore[method-assign,unused-ignore]
                    backend.release = failing_once  # type: ignore[method-assign,unused-ignore]
                    with pytest.raises(asyncio.CancelledError):
                        await lock.acquire(timeout=0)
                    task.uncancel()
                    backend.acquire = real_acquire  # type: ignore[method-assign,unused-ignore]
                    assert lock.lost and not lock.owned()
                    assert lost == [lock]
            assert task.cancelling() == 0
            assert await other.lock("job", ttl=30).acquire(timeout=5), "given back"

    asyncio.run(main())


def test_loss_is_told_at_the_deadline_while_a_renewal_is_stuck(tmp_path: Path) -> None:
    """A sync renewal blocked on a write-locked file waits up to busy_timeout (10 s);
    on_lost must come at the lease's deadline all the same, as on the asyncio face."""
    db = tmp_path / "locks.sqlite3"
    with dlock.connect(f"sqlite://{db}?busy_timeout=10") as client:
        told = threading.Event()
        lock = client.lock("job", ttl=1.5, on_lost=lambda _: told.set())
        assert lock.acquire(timeout=0)
        acquired = time.monotonic()
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            assert told.wait(5), "told when the renewal gave up, not at the deadline"
            elapsed = time.monotonic() - acquired
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        assert elapsed > 1.0
        assert lock.lost and not lock.owned()
        with pytest.raises(dlock.LockLost):
            lock.release()


@pytest.mark.parametrize(
    "bad",
    [
        {"on_lost": 5},
        {"on_lost": "log"},
        {"reentrant": "no"},
        {"reentrant": 1},
        {"auto_renew": None},
        {"cancel_on_lost": "false"},
    ],
)
def test_bad_lock_options_are_refused(tmp_path: Path, bad: dict[str, object]) -> None:
    """Refused when the lock is made, not found out when the lease is lost (a callback
    that cannot be called) or never (``bool("no")`` is True)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    (option,) = bad
    with dlock.connect(url) as client, pytest.raises(dlock.InvalidArgument, match=option):
        client.lock("job", **bad)  # type: ignore[arg-type]
    aclient = dlock.aio.connect(url)
    with pytest.raises(dlock.InvalidArgument, match=option):
        aclient.lock("job", **bad)  # type: ignore[arg-type]


def test_a_coroutine_function_as_on_lost_is_refused(tmp_path: Path) -> None:
    """on_lost is called, not awaited: an ``async def`` one made a coroutine that never
    ran, and a loss was told to nobody but a RuntimeWarning."""

    async def told(lock: object) -> None:
        raise AssertionError("never run")

    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, pytest.raises(dlock.InvalidArgument, match="awaited"):
        client.lock("job", on_lost=told)
    aclient = dlock.aio.connect(url)
    with pytest.raises(dlock.InvalidArgument, match="awaited"):
        aclient.lock("job", on_lost=told)


async def test_an_on_lost_that_returns_a_coroutine_is_told_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain function that makes a coroutine (``lambda lock: notify(lock)``) is called
    and its coroutine closed, unrun: the log says so, as for a callback that raised."""
    ran: list[str] = []

    async def notify(lock: dlock.aio.AsyncLock) -> None:
        ran.append(lock.name)

    async with dlock.aio.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=0.3, on_lost=lambda lock: notify(lock))
        with caplog.at_level("ERROR", logger="dlock"), pytest.raises(dlock.LockLost):
            async with lock:
                await client.force_release("job")
                await asyncio.sleep(1)
    assert "returned a coroutine" in caplog.text
    assert ran == []


def test_an_interrupt_just_after_the_grant_gives_the_lease_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt between the backend's grant and its counting (here: from the
    client's bookkeeping, which runs in that window) must not leave an orphan lease."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:

        def interrupted(lock: object) -> None:
            raise KeyboardInterrupt

        lock = client.lock("job", ttl=30)
        with monkeypatch.context() as patch:
            patch.setattr(client, "_hold", interrupted)
            with pytest.raises(KeyboardInterrupt):
                lock.acquire(timeout=0)
        assert not lock.owned()
        assert other.lock("job", ttl=30).acquire(timeout=5), "given back, not held for 30 s"
        assert lock not in client._still_held()


def test_an_interrupt_between_a_releases_answer_and_its_count_ends_the_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt after the backend released the lock but before the release
    was counted (here: as the count starts, where a signal handler may run): the object
    went on holding the lock it had released, owned() true until its TTL, while another
    client took it. It ends the hold, as an interrupt during the call does."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:

        def interrupted(remaining: int, last: bool) -> None:
            raise KeyboardInterrupt

        lock = client.lock("job", ttl=30)
        assert lock.acquire(timeout=0)
        with monkeypatch.context() as patch:
            patch.setattr(lock, "_count_released", interrupted)
            with pytest.raises(KeyboardInterrupt):
                lock.release()
        assert other.lock("job", ttl=30).acquire(timeout=0), "released"
        assert not lock.owned(), "still holding the lock it released"
        assert lock not in client._still_held()


def test_an_interrupt_as_a_with_block_enters_gives_the_lock_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after acquire() returned but before the body: __exit__ never runs, so
    __enter__ must give back what it took (a held, renewed lock nobody would release)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=30)
        real_enter = lock._enter

        def acquire_then_interrupted(timeout: float | None, call: Any) -> bool:
            assert real_enter(timeout, call)
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(lock, "_enter", acquire_then_interrupted)
            with pytest.raises(KeyboardInterrupt), lock:
                pytest.fail("the body ran")
        assert not lock.owned()
        assert other.lock("job", ttl=30).acquire(timeout=5), "given back, not held and renewed"


def test_a_cancellation_as_a_nested_block_enters_leaves_the_outer_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the asyncio face, for a re-entry: only the inner entry goes."""

    async def main() -> None:
        async with dlock.aio.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
            lock = client.lock("job", ttl=30, reentrant=True)
            real_enter = lock._enter

            async def acquire_then_cancelled(timeout: float | None, call: Any) -> bool:
                assert await real_enter(timeout, call)
                raise asyncio.CancelledError

            async with lock:
                with monkeypatch.context() as patch:
                    patch.setattr(lock, "_enter", acquire_then_cancelled)
                    with pytest.raises(asyncio.CancelledError):
                        async with lock:
                            pytest.fail("the body ran")
                assert lock.owned() and lock._count == 1
                assert (await client.inspect("job")) is not None
            assert not lock.owned()
            assert (await client.inspect("job")) is None

    asyncio.run(main())


def test_an_extend_answered_after_an_overlapping_renewal_keeps_the_shorter_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(60) is applied, then the renewer's renewal (3 s), but extend's answer is
    handled last: the backend lease ends 3 s after the renewal, so the local deadline
    must not be 60 s away (another client would acquire while owned() stays True)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        lock = client.lock("job", ttl=3)
        assert lock.acquire(timeout=0)
        backend = client._backend
        real_extend = backend.extend

        def answered_late(name: str, token: str, ttl: float) -> bool:
            applied = real_extend(name, token, ttl)
            before = lock._deadline
            _renew_now_until(client, lambda: lock._deadline != before)
            return applied

        monkeypatch.setattr(backend, "extend", answered_late)
        lock.extend(60)
        assert lock._deadline - time.monotonic() <= 3.0
        assert lock.owned()


def test_an_on_lost_calling_sys_exit_does_not_stop_the_renewer(tmp_path: Path) -> None:
    """sys.exit() in one lock's on_lost, run by the renewer, must not end it: the
    client's other leases would lapse untold."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        doomed = client.lock("doomed", ttl=1, on_lost=lambda _: sys.exit(1))
        keeper = client.lock("keeper", ttl=1)
        assert doomed.acquire(timeout=0) and keeper.acquire(timeout=0)
        assert other.force_release("doomed")
        _renew_now_until(client, lambda: doomed.lost, "the loss was not declared")
        time.sleep(2)
        assert client._renewer._runner.is_alive()
        assert keeper.owned()
        info = other.inspect("keeper")
        assert info is not None and info.fencing_token == keeper.fencing_token


@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_a_renewal_answered_with_the_wrong_number_of_results_still_tells_the_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, face: str
) -> None:
    """A broken backend answers extend_many with one result too few. The renewer died
    of the error, and the lease ran out told to nobody (no on_lost, no renewer left).
    Now the round counts as a renewal with no answer: logged with its traceback,
    retried, and its lease told lost at its deadline."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    told: list[object] = []

    async def asyncio_face() -> bool:
        async with dlock.aio.connect(url) as client:
            lock = client.lock("job", ttl=1, on_lost=told.append)
            assert await lock.acquire(timeout=0)
            real = client._backend.extend_many

            async def one_short(leases: Sequence[Any]) -> Any:
                return (await real(leases))[1:]

            monkeypatch.setattr(client._backend, "extend_many", one_short)
            await asyncio.sleep(2)
            assert len(told) == 1, "the loss was told to nobody"
            return not client._renewer._runner.done()

    with caplog.at_level("ERROR", logger="dlock"):
        if face == "asyncio":
            renewing = asyncio.run(asyncio_face())
        else:
            with dlock.connect(url) as client:
                lock = client.lock("job", ttl=1, on_lost=told.append)
                assert lock.acquire(timeout=0)
                real = client._backend.extend_many
                monkeypatch.setattr(client._backend, "extend_many", lambda ls: real(ls)[1:])
                time.sleep(2)
                assert len(told) == 1, "the loss was told to nobody"
                renewing = client._renewer._runner.is_alive()
    assert renewing, "the renewer died"
    assert any(record.exc_info for record in caplog.records), "no traceback logged"


@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_a_renewal_round_that_breaks_unexpectedly_does_not_stop_the_renewer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    """A round breaks off outside the renewal call: the backend's lease_lost raises as
    the renewer asks about an unrenewed lock after renew_now(). The renewer died, and
    the client's other lease was no longer renewed, nor its loss told. Now the next
    round renews it as before."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    told: list[object] = []

    def broken(name: str, token: str) -> bool:
        raise RuntimeError("a bug")

    async def asyncio_face() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            unrenewed = client.lock("unrenewed", ttl=30, auto_renew=False)
            renewed = client.lock("renewed", ttl=1, on_lost=told.append)
            assert await unrenewed.acquire(timeout=0) and await renewed.acquire(timeout=0)
            monkeypatch.setattr(client._backend, "lease_lost", broken)
            client._renewer.renew_now()
            await asyncio.sleep(2.5)
            assert not client._renewer._runner.done(), "the renewer died"
            info = await other.inspect("renewed")
            assert info is not None and info.fencing_token == renewed.fencing_token
            assert not told

    if face == "asyncio":
        asyncio.run(asyncio_face())
    else:
        with dlock.connect(url) as client, dlock.connect(url) as other:
            unrenewed = client.lock("unrenewed", ttl=30, auto_renew=False)
            renewed = client.lock("renewed", ttl=1, on_lost=told.append)
            assert unrenewed.acquire(timeout=0) and renewed.acquire(timeout=0)
            monkeypatch.setattr(client._backend, "lease_lost", broken)
            client._renewer.renew_now()
            time.sleep(2.5)
            assert client._renewer._runner.is_alive(), "the renewer died"
            info = other.inspect("renewed")
            assert info is not None and info.fencing_token == renewed.fencing_token
            assert not told


def test_first_grants_made_at_once_by_many_threads_start_one_renewer(tmp_path: Path) -> None:
    """Threads making a fresh client's first grants at once each saw no renewer running
    (the first one still being started) and each started one: two or more renewed the
    same leases side by side. Threads switch every microsecond here, so that the
    interleaving comes within a few rounds."""

    def renewers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "dlock-renewer"}

    url = f"sqlite://{tmp_path}/locks.sqlite3"
    switch_interval = sys.getswitchinterval()
    for round_ in range(20):
        before = renewers()
        with dlock.connect(url) as client:
            client.inspect("job")  # the file and table exist before the race
            locks = [client.lock(f"job-{round_}-{i}", ttl=30) for i in range(16)]
            start = threading.Barrier(len(locks))

            def take(lock: dlock.Lock, start: threading.Barrier) -> None:
                start.wait()
                assert lock.acquire(timeout=0)

            threads = [threading.Thread(target=take, args=(lock, start)) for lock in locks]
            sys.setswitchinterval(1e-6)
            try:
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:
                sys.setswitchinterval(switch_interval)
            assert all(lock.owned() for lock in locks)
            assert len(renewers() - before) == 1, f"round {round_}: more than one renewer"


@contextlib.contextmanager
def _held(
    url: str, name: str, **options: Any
) -> Iterator[tuple[dlock.Client, dlock.Client, dlock.Lock]]:
    """A client holding ``name`` (acquired with ``options``), and a second client of the
    same file that will try to take the name after a fault."""
    with dlock.connect(url) as client, dlock.connect(url) as rival:
        lock = client.lock(name, **options)
        assert lock.acquire(timeout=0)
        yield client, rival, lock


@contextlib.asynccontextmanager
async def _async_held(
    url: str, name: str, **options: Any
) -> AsyncIterator[tuple[dlock.aio.AsyncClient, dlock.aio.AsyncClient, dlock.aio.AsyncLock]]:
    """``_held`` on the asyncio face."""
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as rival:
        lock = client.lock(name, **options)
        assert await lock.acquire(timeout=0)
        yield client, rival, lock


def _renew_now_until(
    client: dlock.Client, happened: Callable[[], object], what: str = "the renewal did not happen"
) -> None:
    """Have the client's renewer renew at once, and wait (up to 5 s) until ``happened()``."""
    client._renewer.renew_now()
    give_up = time.monotonic() + 5
    while not happened():
        assert time.monotonic() < give_up, what
        time.sleep(0.005)


async def _async_renew_now_until(
    client: dlock.aio.AsyncClient,
    happened: Callable[[], object],
    what: str = "the renewal did not happen",
) -> None:
    """``_renew_now_until`` on the asyncio face."""
    client._renewer.renew_now()
    give_up = time.monotonic() + 5
    while not happened():
        assert time.monotonic() < give_up, what
        await asyncio.sleep(0.005)


def _assert_taken_over(rival: dlock.Client, lock: dlock.Lock) -> None:
    """The holder's lease has run out: the rival takes the name, and the holder does not
    still claim it."""
    assert rival.lock(lock.name, ttl=30).acquire(timeout=10)
    assert not lock.owned()


async def _async_assert_taken_over(rival: dlock.aio.AsyncClient, lock: dlock.aio.AsyncLock) -> None:
    """``_assert_taken_over`` on the asyncio face."""
    assert await rival.lock(lock.name, ttl=30).acquire(timeout=10)
    assert not lock.owned()


def test_an_extend_cut_off_after_it_was_applied_shortens_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(1) on a 30 s lease reaches the backend, but its answer does not come back
    (it fails, or is cancelled): the lease may now end in 1 s, and owned() must not stay
    true once another client can take the lock."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=30, auto_renew=False) as (client, other, lock):
        real_extend = client._backend.extend

        def applied_then_failed(name: str, token: str, ttl: float) -> bool:
            real_extend(name, token, ttl)
            raise dlock.BackendUnavailable("no answer")

        monkeypatch.setattr(client._backend, "extend", applied_then_failed)
        with pytest.raises(dlock.BackendUnavailable):
            lock.extend(1)
        _assert_taken_over(other, lock)

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=30, auto_renew=False) as (client, other, lock):
            real_extend = client._backend.extend
            applied = asyncio.Event()

            async def applied_then_stuck(name: str, token: str, ttl: float) -> bool:
                await real_extend(name, token, ttl)
                applied.set()
                await asyncio.sleep(60)
                return True

            monkeypatch.setattr(client._backend, "extend", applied_then_stuck)
            extend = asyncio.create_task(lock.extend(1))
            await applied.wait()
            extend.cancel()
            with pytest.raises(asyncio.CancelledError):
                await extend
            await _async_assert_taken_over(other, lock)

    asyncio.run(main())


def test_a_renewal_applied_but_unanswered_keeps_the_extended_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After extend(3) on a 1 s lock, a renewal reaches the backend but its answer is
    lost, and the backend stays unreachable. The renewal asked for the lease's time left
    (a renewal never shortens a lease), so the lease ends when the extend said: the
    rival is kept out until then (with the lock's own 1 s, it got in after 1 s), and the
    holder is told then."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    told = threading.Event()
    with _held(url, "job", ttl=1, on_lost=lambda _: told.set()) as (client, other, lock):
        lock.extend(3)
        extended = client._clock()
        real_extend_many = client._backend.extend_many
        calls: list[object] = []

        def unanswered(leases: list[Any]) -> list[bool]:
            if not calls:
                real_extend_many(leases)
            calls.append(leases)
            raise dlock.BackendUnavailable("no answer")

        monkeypatch.setattr(client._backend, "extend_many", unanswered)
        _renew_now_until(client, lambda: calls)
        time.sleep(max(0.0, extended + 1.5 - client._clock()))
        assert not other.lock("job", ttl=30).acquire(timeout=0), "the renewal cut the lease"
        assert not told.is_set()
        _assert_taken_over(other, lock)
        assert told.wait(5), "not told when the renewed lease ran out"

    async def main() -> None:
        told = asyncio.Event()
        async with _async_held(url, "async-job", ttl=1, on_lost=lambda _: told.set()) as (
            client,
            other,
            lock,
        ):
            await lock.extend(3)
            extended = client._clock()
            real_extend_many = client._backend.extend_many
            calls: list[object] = []

            async def unanswered(leases: list[Any]) -> list[bool]:
                if not calls:
                    await real_extend_many(leases)
                calls.append(leases)
                raise dlock.BackendUnavailable("no answer")

            monkeypatch.setattr(client._backend, "extend_many", unanswered)
            await _async_renew_now_until(client, lambda: calls)
            await asyncio.sleep(max(0.0, extended + 1.5 - client._clock()))
            rival = other.lock("async-job", ttl=30)
            assert not await rival.acquire(timeout=0), "the renewal cut the lease"
            assert not told.is_set()
            await _async_assert_taken_over(other, lock)
            await asyncio.wait_for(told.wait(), 5)

    asyncio.run(main())


def test_an_unanswered_renewal_applied_after_a_longer_extend_ends_the_lease_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal (1 s) gets no answer, the holder then extends to 60 s, and only then
    does the renewal reach the backend (held up in the network, a paused server): the
    lease ends 1 s after that, so owned() must not stay true for 60 s."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=1) as (client, other, lock):
        real_extend_many = client._backend.extend_many
        held_up: list[Any] = []

        def unanswered(leases: list[Any]) -> list[bool]:
            held_up.append(leases)
            raise dlock.BackendUnavailable("no answer")

        monkeypatch.setattr(client._backend, "extend_many", unanswered)
        _renew_now_until(client, lambda: held_up)
        monkeypatch.setattr(client._backend, "extend_many", real_extend_many)
        lock.extend(60)
        client._renewer.discard(lock)  # nothing renews it from here: what does it count on?
        assert real_extend_many(held_up[0]) == [True]  # arrives now: the lease ends in 1 s
        _assert_taken_over(other, lock)

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=1) as (client, other, lock):
            real_extend_many = client._backend.extend_many
            held_up: list[Any] = []

            async def unanswered(leases: list[Any]) -> list[bool]:
                held_up.append(leases)
                raise dlock.BackendUnavailable("no answer")

            monkeypatch.setattr(client._backend, "extend_many", unanswered)
            await _async_renew_now_until(client, lambda: held_up)
            monkeypatch.setattr(client._backend, "extend_many", real_extend_many)
            await lock.extend(60)
            client._renewer.discard(lock)
            assert await real_extend_many(held_up[0]) == [True]
            await _async_assert_taken_over(other, lock)

    asyncio.run(main())


def test_an_unanswered_release_applied_late_leaves_the_next_hold_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release gets no answer (its give-back frees the lock), the object takes the lock
    again, and only then does the first release reach the backend: it must not free the
    new hold, which the object still believes in (another client would take it)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=30) as (client, other, lock):
        real_release = client._backend.release
        held_up: list[tuple[str, str]] = []

        def first_unanswered(name: str, token: str) -> int | None:
            if not held_up:
                held_up.append((name, token))
                raise dlock.BackendUnavailable("no answer")
            return real_release(name, token)

        monkeypatch.setattr(client._backend, "release", first_unanswered)
        with pytest.raises(dlock.BackendUnavailable):
            lock.release()
        assert lock.acquire(timeout=5)
        assert real_release(*held_up[0]) is None  # arrives now: not the new hold's
        assert other.inspect("job") is not None
        assert not other.lock("job").acquire(timeout=0)
        assert lock.owned()
        lock.release()

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=30) as (client, other, lock):
            real_release = client._backend.release
            held_up: list[tuple[str, str]] = []

            async def first_unanswered(name: str, token: str) -> int | None:
                if not held_up:
                    held_up.append((name, token))
                    raise dlock.BackendUnavailable("no answer")
                return await real_release(name, token)

            monkeypatch.setattr(client._backend, "release", first_unanswered)
            with pytest.raises(dlock.BackendUnavailable):
                await lock.release()
            assert await lock.acquire(timeout=5)
            assert await real_release(*held_up[0]) is None
            assert await other.inspect("async-job") is not None
            assert not await other.lock("async-job").acquire(timeout=0)
            assert lock.owned()
            await lock.release()

    asyncio.run(main())


def test_an_extend_answered_after_a_release_leaves_the_next_hold_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(60) is applied, then another user of the lock object releases it and takes
    it again (ttl 1) before extend's answer is handled: that answer is not about the new
    hold, whose lease ends in 1 s, so owned() must not stay true for 60 s."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=1, auto_renew=False) as (client, other, lock):
        real_extend = client._backend.extend

        def answered_late(name: str, token: str, ttl: float) -> bool:
            applied = real_extend(name, token, ttl)
            lock.release()
            assert lock.acquire(timeout=0)
            return applied

        monkeypatch.setattr(client._backend, "extend", answered_late)
        lock.extend(60)
        _assert_taken_over(other, lock)

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=1, auto_renew=False) as (client, other, lock):
            real_extend = client._backend.extend

            async def answered_late(name: str, token: str, ttl: float) -> bool:
                applied = await real_extend(name, token, ttl)
                await lock.release()
                assert await lock.acquire(timeout=0)
                return applied

            monkeypatch.setattr(client._backend, "extend", answered_late)
            await lock.extend(60)
            await _async_assert_taken_over(other, lock)

    asyncio.run(main())


def test_an_extend_answered_after_a_release_does_not_renew_the_lock_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend() is applied, then another user of the lock object releases it before
    extend's answer is handled: the released lock must not go back to the renewer, which
    would find the lease gone and tell a loss of a lock released cleanly."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        told: list[object] = []
        lock = client.lock("job", ttl=1, on_lost=told.append)
        assert lock.acquire(timeout=0)
        real_extend = client._backend.extend

        def answered_late(name: str, token: str, ttl: float) -> bool:
            applied = real_extend(name, token, ttl)
            lock.release()
            return applied

        monkeypatch.setattr(client._backend, "extend", answered_late)
        lock.extend()
        assert lock not in client._renewer._locks
        client._renewer.renew_now()
        time.sleep(0.3)
        assert not told and not lock.lost

    async def main() -> None:
        async with dlock.aio.connect(url) as client:
            told: list[object] = []
            lock = client.lock("async-job", ttl=1, on_lost=told.append)
            assert await lock.acquire(timeout=0)
            real_extend = client._backend.extend

            async def answered_late(name: str, token: str, ttl: float) -> bool:
                applied = await real_extend(name, token, ttl)
                await lock.release()
                return applied

            monkeypatch.setattr(client._backend, "extend", answered_late)
            await lock.extend()
            assert lock not in client._renewer._locks
            client._renewer.renew_now()
            await asyncio.sleep(0.3)
            assert not told and not lock.lost

    asyncio.run(main())


def test_a_renewal_overlapping_the_last_release_tells_no_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal of the lease is in flight as the last release starts; the backend
    applies the release, then the renewal, which finds the lease gone, and the release's
    answer comes back last: the lock was released cleanly, not lost. The renewer's
    round goes on (another lease, ``keeper``, so that every round calls out) only once
    the renewal's answer for ``job`` was handled."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        told: list[object] = []
        lock = client.lock("job", ttl=30, on_lost=told.append)
        keeper = client.lock("keeper", ttl=30)
        assert keeper.acquire(timeout=0) and lock.acquire(timeout=0)
        real_release, real_extend_many = client._backend.release, client._backend.extend_many
        in_flight, go_on = threading.Event(), threading.Event()
        renewals: list[list[str]] = []

        def held_up(leases: list[Any]) -> Sequence[bool | None]:
            names = [lease.name for lease in leases]
            if "job" in names and not in_flight.is_set():
                in_flight.set()
                assert go_on.wait(10)
            renewed = real_extend_many(leases)
            renewals.append(names)
            return renewed

        def answered_after_the_renewal(name: str, token: str) -> int | None:
            remaining = real_release(name, token)
            go_on.set()  # the renewal reaches the backend after the release
            # Its answer is handled before the renewer's next round calls out.
            _renew_now_until(client, lambda: len(renewals) > 1)
            return remaining

        monkeypatch.setattr(client._backend, "extend_many", held_up)
        monkeypatch.setattr(client._backend, "release", answered_after_the_renewal)
        _renew_now_until(client, in_flight.is_set)
        lock.release()
        assert "job" in renewals[0] and "job" not in renewals[1]
        assert not told and not lock.lost

    async def main() -> None:
        async with dlock.aio.connect(url) as client:
            told: list[object] = []
            lock = client.lock("async-job", ttl=30, on_lost=told.append)
            keeper = client.lock("async-keeper", ttl=30)
            assert await keeper.acquire(timeout=0) and await lock.acquire(timeout=0)
            real_release, real_extend_many = client._backend.release, client._backend.extend_many
            in_flight, go_on = asyncio.Event(), asyncio.Event()
            renewals: list[list[str]] = []

            async def held_up(leases: list[Any]) -> Sequence[bool | None]:
                names = [lease.name for lease in leases]
                if "async-job" in names and not in_flight.is_set():
                    in_flight.set()
                    await asyncio.wait_for(go_on.wait(), 10)
                renewed = await real_extend_many(leases)
                renewals.append(names)
                return renewed

            async def answered_after_the_renewal(name: str, token: str) -> int | None:
                remaining = await real_release(name, token)
                go_on.set()
                await _async_renew_now_until(client, lambda: len(renewals) > 1)
                return remaining

            monkeypatch.setattr(client._backend, "extend_many", held_up)
            monkeypatch.setattr(client._backend, "release", answered_after_the_renewal)
            await _async_renew_now_until(client, in_flight.is_set)
            await lock.release()
            assert "async-job" in renewals[0] and "async-job" not in renewals[1]
            assert not told and not lock.lost

    asyncio.run(main())


def test_a_reentry_cut_off_after_another_users_is_undone(tmp_path: Path) -> None:
    """A reentrant lock object shared by two users who both re-enter it: the one cut
    off after its grant undoes its own entry, although the other's came later; the
    other's stays."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    def sync_face() -> None:
        with dlock.connect(url) as client:
            lock = client.lock("job", ttl=30, reentrant=True)

            def another_user_enters_then_interrupted(call: object) -> None:
                del lock._still_wanted
                assert lock.acquire(timeout=0)
                raise KeyboardInterrupt

            with lock:
                lock._still_wanted = another_user_enters_then_interrupted  # type: ignore[method-assign]
                with pytest.raises(KeyboardInterrupt):
                    lock.acquire(timeout=0)
                assert lock._count == 2
                lock.release()
            assert client.inspect("job") is None

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client:
            lock = client.lock("job", ttl=30, reentrant=True)

            async def another_user_enters_then_cancelled(call: object) -> None:
                del lock._still_wanted
                assert await lock.acquire(timeout=0)
                raise asyncio.CancelledError

            async with lock:
                lock._still_wanted = another_user_enters_then_cancelled  # type: ignore[method-assign]
                with pytest.raises(asyncio.CancelledError):
                    await lock.acquire(timeout=0)
                assert lock._count == 2
                await lock.release()
            assert await client.inspect("job") is None

    sync_face()
    asyncio.run(async_face())


def test_an_interrupt_just_after_a_reentrys_grant_undoes_that_entry(tmp_path: Path) -> None:
    """A KeyboardInterrupt between the backend's grant of a re-entry and its counting
    (here: raised where the grant is counted): the entry is counted and then undone,
    so the holder's own release frees the lock (not held and renewed until close)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    with dlock.connect(url) as client:
        lock = client.lock("job", ttl=30, reentrant=True)
        assert lock.acquire(timeout=0)
        lock._granted = interrupted  # type: ignore[method-assign,assignment]
        with pytest.raises(KeyboardInterrupt):
            lock.acquire(timeout=0)
        del lock._granted
        assert lock._count == 1
        lock.release()
        assert client.inspect("job") is None

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client:
            lock = client.lock("job", ttl=30, reentrant=True)
            assert await lock.acquire(timeout=0)
            lock._granted = interrupted  # type: ignore[method-assign,assignment]
            with pytest.raises(KeyboardInterrupt):
                await lock.acquire(timeout=0)
            del lock._granted
            assert lock._count == 1
            await lock.release()
            assert await client.inspect("job") is None

    asyncio.run(async_face())


def test_a_sharers_attempt_cut_off_in_flight_leaves_the_others_grant(tmp_path: Path) -> None:
    """Two users share one lock object: while one user's attempt is in flight, the
    other acquires it; the first attempt is then cut off (times out, or its task is
    cancelled). Its give-back, owner-checked under the same owner token, must not
    release the other user's lease: that lease is the only one under the token."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    with dlock.connect(url) as client, dlock.connect(url) as other:
        shared = client.lock("job", ttl=30)
        real_acquire = client._backend.acquire

        def other_user_acquires_then_no_answer(*args: Any) -> Any:
            client._backend.acquire = real_acquire  # type: ignore[method-assign]
            assert shared.acquire(timeout=0)
            raise dlock.BackendUnavailable("no answer in time")

        client._backend.acquire = other_user_acquires_then_no_answer  # type: ignore[method-assign,assignment]
        with pytest.raises(dlock.BackendUnavailable):
            shared.acquire(timeout=0)
        for give_back in client._give_backs:
            give_back.join()
        info = other.inspect("job")
        assert shared.owned() and info is not None
        assert info.fencing_token == shared.fencing_token
        shared.release()

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            shared = client.lock("job", ttl=30)
            real_acquire = client._backend.acquire

            async def other_user_acquires_then_cancelled(*args: Any) -> Any:
                client._backend.acquire = real_acquire  # type: ignore[method-assign]
                assert await shared.acquire(timeout=0)
                raise asyncio.CancelledError

            client._backend.acquire = other_user_acquires_then_cancelled  # type: ignore[method-assign,assignment]
            with pytest.raises(asyncio.CancelledError):
                await shared.acquire(timeout=0)
            if client._give_backs:
                await asyncio.wait(client._give_backs)
            info = await other.inspect("job")
            assert shared.owned() and info is not None
            assert info.fencing_token == shared.fencing_token
            await shared.release()

    asyncio.run(async_face())


def test_a_hold_counts_one_entry_per_reentry_whatever_the_backend_applied(
    tmp_path: Path,
) -> None:
    """A re-entry that the backend applied but whose answer was cut off leaves the
    backend counting one entry more than the object. Another user's re-entry is then
    in flight as the object's release is made: the release waits for its answer (see
    the conformance suite). That answer counts the cut-off entry too, which the object
    counted as held: three entries for two holders, and once both had left, the lock
    stayed held, renewed for good. A re-entry now counts one entry: the hold goes on,
    renewed, while its entries are held, and its last release gives back the rest."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        told: list[object] = []
        lock = client.lock("job", ttl=1, reentrant=True, on_lost=told.append)
        assert lock.acquire(timeout=0)
        backend: Any = client._backend
        real = backend.acquire
        sent, go = threading.Event(), threading.Event()

        def cut_off(*args: Any) -> Any:
            real(*args)
            raise KeyboardInterrupt

        def held_up(*args: Any) -> Any:
            sent.set()
            go.wait(10)
            return real(*args)

        backend.acquire = cut_off
        with pytest.raises(KeyboardInterrupt):
            lock.acquire(timeout=0)
        backend.acquire = held_up
        other_user = threading.Thread(target=lock.acquire, kwargs={"timeout": 0})
        other_user.start()
        assert sent.wait(5)
        releasing = threading.Thread(target=lock.release)
        releasing.start()
        time.sleep(0.2)
        assert releasing.is_alive(), "the release did not wait for the re-entry"
        go.set()
        other_user.join(5)
        releasing.join(5)
        backend.acquire = real
        assert lock._count == 1
        time.sleep(2)
        assert lock.owned() and not told
        info = other.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        lock.release()
        assert not lock.owned()
        rival = other.lock("job", ttl=5)
        assert rival.acquire(timeout=3), "an entry nobody holds was left"
        rival.release()


@contextlib.asynccontextmanager
async def _held_twice(
    tmp_path: Path, on_lost: Callable[[Any], object] | None = None
) -> AsyncIterator[tuple[dlock.aio.AsyncClient, dlock.aio.AsyncLock]]:
    """A reentrant lock object (SQLite, asyncio) holding "job" with two entries, as two
    users of it would. As the block ends, another client must get the lock within 5 s:
    nothing of the object's is left on the backend."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
        lock = client.lock("job", ttl=30, reentrant=True, on_lost=on_lost)
        assert await lock.acquire(timeout=0)
        assert await lock.acquire(timeout=0)
        yield client, lock
        rival = other.lock("job", ttl=5)
        assert await rival.acquire(timeout=5), "an entry was left on the backend"
        await rival.release()


def test_a_release_cancelled_while_a_sharers_reentry_has_the_turn_ends_the_hold(
    tmp_path: Path,
) -> None:
    """Tasks share a reentrant lock object's hold (two entries), and a third re-enters it,
    its attempt in flight; a release waiting for that re-entry's turn to end is
    cancelled there. It raised CancelledError and left its entry counted: after the
    other users' releases the object still held the lock, renewed for good (a helper's
    chaos run, Redis 4 of 4). As any release cut off, it now ends the whole hold: told
    lost, given back, every other entry's release raising LockLost."""

    async def main() -> None:
        told: list[object] = []
        async with _held_twice(tmp_path, on_lost=told.append) as (client, lock):
            real_acquire = client._backend.acquire
            in_flight, go_on = asyncio.Event(), asyncio.Event()

            async def held_up(
                name: str, token: str, ttl: float, holder: Any, reentrant: bool
            ) -> Any:
                in_flight.set()
                await asyncio.wait_for(go_on.wait(), 10)
                return await real_acquire(name, token, ttl, holder, reentrant)

            client._backend.acquire = held_up  # type: ignore[method-assign]
            reentry = asyncio.ensure_future(lock.acquire(timeout=0))
            await asyncio.wait_for(in_flight.wait(), 5)
            releasing = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.1)
            assert not releasing.done(), "the release did not wait for the re-entry"
            releasing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await releasing
            assert told == [lock] and not lock.owned()
            go_on.set()
            with pytest.raises(dlock.LockLost):
                await reentry
            with pytest.raises(dlock.LockLost):
                await lock.release()
            assert await lock.acquire(timeout=0), "the lock object is stuck"
            await lock.release()

    asyncio.run(main())


def test_a_reentry_cut_off_after_its_hold_was_ended_is_given_back_with_it(
    tmp_path: Path,
) -> None:
    """A release cancelled while another task's re-entry has the count's turn ends the
    hold (see above), its entries given back once that re-entry's attempt ends. The
    re-entry, applied by the backend, is then cut off too (its body cancelled by the
    loss, as here): its entry was counted only for a later release of the hold, which
    never comes, and the give-back left it: the lease stayed, held by nobody, until
    its TTL (a helper's chaos run, 7 of 7 backends). It is given back too."""

    async def main() -> None:
        async with _held_twice(tmp_path) as (client, lock):
            real_acquire = client._backend.acquire
            applied = asyncio.Event()

            async def answered_late(
                name: str, token: str, ttl: float, holder: Any, reentrant: bool
            ) -> Any:
                result = await real_acquire(name, token, ttl, holder, reentrant)
                applied.set()
                await asyncio.sleep(30)  # cut off before its answer comes
                return result

            client._backend.acquire = answered_late  # type: ignore[method-assign]
            reentry = asyncio.ensure_future(lock.acquire(timeout=0))
            await asyncio.wait_for(applied.wait(), 5)  # the backend counts 3 entries
            releasing = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.05)
            releasing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await releasing
            reentry.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reentry
            client._backend.acquire = real_acquire  # type: ignore[method-assign]

    asyncio.run(main())


def test_a_give_back_waits_for_another_users_release_in_flight(tmp_path: Path) -> None:
    """A release cancelled while another task's release has the count's turn ends the
    hold, and its give-back went out at once, alongside that release: two releases of
    one hold at once, which SQL session mode (count, then unlock) answered from the same
    count, so neither unlocked, and the lock stayed held by nobody until its TTL (a
    helper's chaos run, MariaDB and PostgreSQL). The give-back waits for the release
    in flight, as it does for an attempt."""

    async def main() -> None:
        async with _held_twice(tmp_path) as (client, lock):
            real_release = client._backend.release
            in_flight, go_on = asyncio.Event(), asyncio.Event()
            order: list[str] = []

            async def held_up(name: str, token: str) -> int | None:
                first = not order
                order.append("sent")
                if first:
                    in_flight.set()
                    await asyncio.wait_for(go_on.wait(), 10)
                remaining = await real_release(name, token)
                order.append(f"answered {remaining}")
                return remaining

            client._backend.release = held_up  # type: ignore[method-assign]
            releasing = asyncio.ensure_future(lock.release())
            await asyncio.wait_for(in_flight.wait(), 5)
            cut_off = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.05)
            cut_off.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cut_off
            await asyncio.sleep(0.2)
            assert order == ["sent"], "the give-back went out alongside the release"
            go_on.set()
            await releasing
        # The give-back freed the lock (checked as the block ended), after the release.
        assert order[:3] == ["sent", "answered 1", "sent"]

    asyncio.run(main())


def test_an_on_lost_reentering_while_another_thread_releases_a_lost_hold_does_not_deadlock(
    tmp_path: Path,
) -> None:
    """An on_lost runs while its loss is told, holding the object's loss lock, and
    re-enters the lock (a fresh hold that another thread took meanwhile). That other
    thread's release, in the count's turn, found its lease gone and waited for the loss
    lock to tell it, while the re-entry waited for the turn: each for the other, for
    good (a helper's chaos run, 9 of 9; from the renewer, every other lease of the
    client then went unrenewed). A release now tells its loss once out of its turn."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    # Not closed by a with block: the close would wait for a deadlocked release for good.
    client, other = dlock.connect(url), dlock.connect(url)
    first_told, released = threading.Event(), threading.Event()
    outcomes: list[tuple[str, object]] = []

    def on_lost(lock: dlock.Lock) -> None:
        if first_told.is_set():
            return  # the re-entry below finds the fresh hold lost too
        with contextlib.suppress(dlock.LockLost):
            lock.release()  # gives the lost hold up
        first_told.set()
        assert released.wait(5)  # the other thread's release found the lease gone
        time.sleep(0.2)  # ... and waits to tell it
        try:
            outcomes.append(("re-entry", lock.acquire(timeout=0)))
        except dlock.LockError as exc:
            outcomes.append(("re-entry", type(exc)))

    lock = client.lock("job", ttl=30, reentrant=True, auto_renew=False, on_lost=on_lost)
    real_release = client._backend.release

    def noted(name: str, token: str) -> int | None:
        remaining = real_release(name, token)
        if first_told.is_set():
            released.set()
        return remaining

    client._backend.release = noted  # type: ignore[method-assign]

    def first_holder() -> None:
        assert lock.acquire(timeout=0)
        assert other.force_release("job")
        with pytest.raises(dlock.LockLost):
            lock.extend()  # told here: on_lost runs in this thread

    def second_holder() -> None:
        assert first_told.wait(5)
        assert lock.acquire(timeout=0)  # afresh: the lost hold was forgotten
        assert other.force_release("job")
        try:
            lock.release()
        except dlock.LockError as exc:
            outcomes.append(("release", type(exc)))

    users = [threading.Thread(target=f, daemon=True) for f in (first_holder, second_holder)]
    for user in users:
        user.start()
    for user in users:
        user.join(10)
    assert not any(user.is_alive() for user in users), "deadlocked"
    with client, other:
        assert sorted(outcomes) == [("re-entry", dlock.LockLost), ("release", dlock.LockLost)]
        assert not lock.owned()
        assert lock.acquire(timeout=0)
        lock.release()


def test_a_failed_release_is_given_back_under_its_own_token_while_a_sharer_acquires(
    tmp_path: Path,
) -> None:
    """A release fails, and its hold is forgotten and given back in the background.
    Another thread sharing the lock object, acquiring as the hold was forgotten but
    before its give-back was counted, took a new owner token, and the give-back went
    out under that one: the old lease stayed for its TTL, and a give-back landing late
    could free the new hold (a helper's chaos run, with a thread switch forced there).
    The give-back is counted as the hold is forgotten, under its own token."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=30)
        assert lock.acquire(timeout=0)
        old = lock._token
        backend: Any = client._backend
        release, released = backend.release, []

        def release_failing_first(name: str, token: str) -> Any:
            released.append(token)
            if len(released) == 1:
                raise dlock.BackendUnavailable("no answer")
            return release(name, token)

        backend.release = release_failing_first
        forget = lock._forget
        sharer: list[threading.Thread] = []
        got: list[bool] = []

        def forget_then_a_sharer_acquires() -> None:
            forget()
            if not sharer:
                sharer.append(threading.Thread(target=lambda: got.append(lock.acquire(5))))
                sharer[0].start()
                time.sleep(0.3)

        lock._forget = forget_then_a_sharer_acquires  # type: ignore[method-assign]
        with pytest.raises(dlock.BackendUnavailable):
            lock.release()
        sharer[0].join(10)
        assert released[:2] == [old, old], "given back under another token"
        assert got == [True], "the old lease was not given back"
        lock.release()


def test_a_close_asks_again_a_give_back_refused_as_it_began(tmp_path: Path) -> None:
    """close() leaves to its TTL a give-back that waited out a timeout while the close
    waited for it (asked again, the hung backend would cost the close another). One
    refused at once (its connection cut as an outage ended, say) is asked again: the
    backend may be answering, and left, the lease lasted its TTL (a helper's finding)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as other:
        client = dlock.connect(url)
        lock = client.lock("job", ttl=30)
        assert lock.acquire(timeout=0)
        backend: Any = client._backend
        release, calls = backend.release, []

        def refused_twice(name: str, token: str) -> Any:
            calls.append(token)
            if len(calls) == 2:
                time.sleep(0.1)  # the close has begun, and waits for this give-back
            if len(calls) <= 2:
                raise dlock.BackendUnavailable("connection refused")
            return release(name, token)

        backend.release = refused_twice
        with pytest.raises(dlock.BackendUnavailable):
            lock.release()
        client.close()
        assert len(calls) == 3
        assert other.inspect("job") is None


def test_two_closes_both_end_when_the_acquire_in_flight_does(tmp_path: Path) -> None:
    """close() lets an acquire in flight end first; two threads closing at once must
    both go on when it ends, not one of them after the 5 s bound."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        real_acquire = client._backend.acquire
        sent, answer = threading.Event(), threading.Event()

        def answered_late(*args: Any) -> Any:
            sent.set()
            answer.wait(10)
            return real_acquire(*args)

        client._backend.acquire = answered_late  # type: ignore[method-assign,assignment]
        refused: list[Exception] = []

        def acquire() -> None:
            try:
                client.lock("job").acquire(timeout=0)
            except dlock.BackendError as exc:  # granted as the client closed: given back
                refused.append(exc)

        acquiring = threading.Thread(target=acquire)
        acquiring.start()
        assert sent.wait(10)
        closed: list[float] = []

        def close() -> None:
            client.close()
            closed.append(time.monotonic())

        closes = [threading.Thread(target=close) for _ in range(2)]
        for closer in closes:
            closer.start()
            time.sleep(0.2)
        answered = time.monotonic()
        answer.set()
        for closer in closes:
            closer.join(10)
        acquiring.join(10)
        assert len(closed) == 2 and len(refused) == 1
        assert max(closed) - answered < 2, "a close waited for the bound"


def test_an_acquire_answered_past_the_close_gives_back_without_reopening_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits for an acquire in flight only so long (5 s: here 0.3): a grant
    answered after the close had closed the backend is given back all the same, but
    the give-back opened the SQLite file again, and nothing closed it any more."""
    import dlock._sync.client as client_module

    monkeypatch.setattr(client_module, "CLOSE_WAIT", 0.3)
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    client = dlock.connect(url)
    backend: Any = client._backend
    real_acquire = backend.acquire
    granted, answer = threading.Event(), threading.Event()

    def answered_late(*args: Any) -> Any:
        answered = real_acquire(*args)
        granted.set()
        answer.wait(10)  # until the close has ended
        return answered

    backend.acquire = answered_late
    refused: list[Exception] = []

    def acquire() -> None:
        try:
            client.lock("job").acquire(timeout=0)
        except dlock.BackendError as exc:  # granted as the client closed: given back
            refused.append(exc)

    acquiring = threading.Thread(target=acquire)
    acquiring.start()
    assert granted.wait(10)
    client.close()
    answer.set()
    acquiring.join(10)
    assert len(refused) == 1
    for give_back in client._give_backs:
        give_back.join(10)
    with dlock.connect(url) as other:
        assert other.inspect("job") is None, "the late grant was not given back"
    assert backend._connection is None, "the give-back left the file open for good"


def test_a_close_waiting_for_an_acquire_renews_nothing_and_still_tells_losses(
    tmp_path: Path,
) -> None:
    """While close() waits for an acquire in flight (up to 5 s), the renewer went on
    renewing the holds it was about to give back: against a server that stopped
    answering, a renewal begun then held the close up by another 5 s, the renewer's
    join (a helper saw a sync MariaDB close take 20 s, its bound 15). Nothing is renewed
    once the close begins; a lease that runs out meanwhile is still told at its end."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lost_at: list[float] = []
        short = client.lock("short", ttl=0.6, on_lost=lambda lock: lost_at.append(time.monotonic()))
        assert short.acquire(timeout=0)
        backend: Any = client._backend
        real_acquire, real_extend_many = backend.acquire, backend.extend_many
        sent, answer = threading.Event(), threading.Event()
        renewals: list[float] = []

        def answered_late(*args: Any) -> Any:
            sent.set()
            answer.wait(10)
            return real_acquire(*args)

        def counted_extend_many(leases: Any) -> Any:
            renewals.append(time.monotonic())
            return real_extend_many(leases)

        backend.acquire, backend.extend_many = answered_late, counted_extend_many
        renewer: Any = client._renewer
        wind_down = renewer.wind_down
        wound_down: list[float] = []

        def timed_wind_down() -> None:
            wind_down()
            wound_down.append(time.monotonic())

        renewer.wind_down = timed_wind_down

        def acquire() -> None:
            with contextlib.suppress(dlock.BackendError):
                client.lock("job").acquire(timeout=0)

        acquiring = threading.Thread(target=acquire)
        acquiring.start()
        assert sent.wait(10)
        closing = threading.Thread(target=client.close)
        began = time.monotonic()
        closing.start()
        time.sleep(1.5)
        answer.set()
        closing.join(10)
        acquiring.join(10)
        # The close begins as it stops the renewer, which the test's clock read before
        # the thread ran (under load, a renewal fell between the two). A renewal that
        # had looked at the flag just before it went up may still be sent: one at most.
        assert len([at for at in renewals if at >= wound_down[0]]) <= 1, "renewed while closing"
        assert len(lost_at) == 1 and lost_at[0] - began < 1.0, "its loss was told late"


def test_closing_the_client_from_an_on_lost_told_by_an_acquire(tmp_path: Path) -> None:
    """An on_lost that closes the client, told by a re-entry that finds the lease gone
    (granted afresh): close() does not wait for the acquire that it runs inside, and
    gives the fresh lease back before the backend closes (not later, reopening it)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    took: list[float] = []

    with dlock.connect(url) as admin:
        client = dlock.connect(url)

        def close_on_loss(lock: object) -> None:
            start = time.monotonic()
            client.close()
            took.append(time.monotonic() - start)

        lock = client.lock("job", ttl=30, reentrant=True, on_lost=close_on_loss)
        assert lock.acquire(timeout=0)
        assert admin.force_release("job")
        with pytest.raises(dlock.LockLost):
            lock.acquire(timeout=0)
        for give_back in client._give_backs:
            give_back.join()
        assert took[0] < 2.5
        assert admin.inspect("job") is None
        assert client._backend._connection is None  # type: ignore[attr-defined]

    async def async_face() -> None:
        async with dlock.aio.connect(url) as admin:
            client = dlock.aio.connect(url)
            closes: list[asyncio.Task[None]] = []

            def close_on_loss(lock: object) -> None:
                closes.append(asyncio.ensure_future(client.aclose()))

            lock = client.lock("job", ttl=30, reentrant=True, on_lost=close_on_loss)
            assert await lock.acquire(timeout=0)
            assert await admin.force_release("job")
            with pytest.raises(dlock.LockLost):
                await lock.acquire(timeout=0)
            await asyncio.wait(closes)
            if client._give_backs:
                await asyncio.wait(client._give_backs)
            assert await admin.inspect("job") is None
            assert client._backend._connection is None  # type: ignore[attr-defined]

    asyncio.run(async_face())


def test_closing_the_client_from_an_on_lost_told_as_a_lost_hold_is_given_up(
    tmp_path: Path,
) -> None:
    """A hold that ran out on our clock is given up by the call that finds it so (a
    re-entry, a release, the end of its block): forgotten, its loss told, then its lease
    given back. An on_lost that closes the client came before that give-back, which then
    reopened the closed backend (SQLite: its file, never closed again). close() now gives
    the lease back itself while the backend is open, and the give-up leaves it alone.
    The backend still keeps the lease (our clock jumps past it), with two entries: the
    asyncio face's close (a task the callback starts) runs between their round trips."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    def run_out(client: dlock.Client | dlock.aio.AsyncClient) -> None:
        real = client._clock
        client._clock = lambda: real() + 60

    def closing_on_loss() -> tuple[dlock.Client, dlock.Lock]:
        client = dlock.connect(url)
        lock = client.lock(
            "job", ttl=30, reentrant=True, auto_renew=False, on_lost=lambda _: client.close()
        )
        return client, lock

    with dlock.connect(url) as admin:
        for how in ("re-entry", "release", "block"):
            client, lock = closing_on_loss()
            assert lock.acquire(timeout=0)
            with pytest.raises(dlock.LockLost):
                if how == "block":
                    with lock:
                        run_out(client)
                assert lock.acquire(timeout=0)
                run_out(client)
                if how == "re-entry":
                    lock.acquire(timeout=0)
                lock.release()
            assert client._closed, how
            assert admin.inspect("job") is None, how
            assert client._backend._connection is None, how  # type: ignore[attr-defined]

    def async_closing_on_loss() -> tuple[
        dlock.aio.AsyncClient, dlock.aio.AsyncLock, list[asyncio.Task[None]]
    ]:
        """The callback cannot await: it starts the close as a task."""
        client = dlock.aio.connect(url)
        closes: list[asyncio.Task[None]] = []
        lock = client.lock(
            "job",
            ttl=30,
            reentrant=True,
            auto_renew=False,
            on_lost=lambda _: closes.append(asyncio.ensure_future(client.aclose())),
        )
        return client, lock, closes

    async def async_face() -> None:
        async with dlock.aio.connect(url) as admin:
            for how in ("re-entry", "release", "block"):
                client, lock, closes = async_closing_on_loss()
                assert await lock.acquire(timeout=0)
                with pytest.raises(dlock.LockLost):
                    if how == "block":
                        async with lock:
                            run_out(client)
                    assert await lock.acquire(timeout=0)
                    run_out(client)
                    if how == "re-entry":
                        await lock.acquire(timeout=0)
                    await lock.release()
                await asyncio.wait(closes)
                assert await admin.inspect("job") is None, how
                assert client._backend._connection is None, how  # type: ignore[attr-defined]

    asyncio.run(async_face())


def test_a_fresh_hold_taken_while_a_lost_one_is_given_back_is_kept(tmp_path: Path) -> None:
    """A release that finds the hold ran out on our clock gives it up: forgets it, tells
    the loss, then gives the lease back, owner-checked. A fresh hold of the same object
    taken before that give-back (by the on_lost it tells, or by another user of the
    object while the give-back is in flight, as here) was under the same owner token,
    and the give-back freed it: the object owned a lock that the backend had free for
    anyone (every lease-mode backend did so). The fresh hold now takes a token of its own."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=0.5, auto_renew=False)
        assert lock.acquire(timeout=0)
        give_up = time.monotonic() + 5
        while other.inspect("job") is not None:
            assert time.monotonic() < give_up, "the lease did not end"
            time.sleep(0.05)
        real_release = client._backend.release
        taken: list[bool] = []

        def taken_meanwhile(name: str, token: str) -> int | None:
            if not taken:
                lock.ttl = 30  # the fresh hold outlasts the checks below
                taken.append(lock.acquire(timeout=0))
            return real_release(name, token)

        client._backend.release = taken_meanwhile  # type: ignore[method-assign]
        with pytest.raises(dlock.LockLost):
            lock.release()
        assert taken == [True] and lock.owned()
        info = other.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        assert not other.lock("job", ttl=5).acquire(timeout=0)

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            lock = client.lock("async-job", ttl=0.5, auto_renew=False)
            assert await lock.acquire(timeout=0)
            give_up = time.monotonic() + 5
            while await other.inspect("async-job") is not None:
                assert time.monotonic() < give_up, "the lease did not end"
                await asyncio.sleep(0.05)
            real_release = client._backend.release
            taken: list[bool] = []

            async def taken_meanwhile(name: str, token: str) -> int | None:
                if not taken:
                    lock.ttl = 30  # the fresh hold outlasts the checks below
                    taken.append(await lock.acquire(timeout=0))
                return await real_release(name, token)

            client._backend.release = taken_meanwhile  # type: ignore[method-assign]
            with pytest.raises(dlock.LockLost):
                await lock.release()
            assert taken == [True] and lock.owned()
            info = await other.inspect("async-job")
            assert info is not None and info.fencing_token == lock.fencing_token
            assert not await other.lock("async-job", ttl=5).acquire(timeout=0)

    asyncio.run(async_face())


class _HeldUpReentry:
    """What _held_up_reentry (or its asyncio face) sets up: the user re-entering (a
    thread or task) and the events that hold its attempt up."""

    def __init__(self, backend: Any, in_flight: Any, go_on: Any) -> None:
        self.real_acquire, self.real_release = backend.acquire, backend.release
        self.in_flight, self.go_on = in_flight, go_on
        self.errors: list[BaseException] = []
        self.sharer: Any = None


@contextlib.contextmanager
def _held_up_reentry(client: dlock.Client, lock: dlock.Lock) -> Iterator[_HeldUpReentry]:
    """Another thread re-enters ``lock`` (held): its attempt is held up on its way to the
    backend until ``go_on`` is set (as the block ends, at the latest), then fails with
    no answer. The block begins once the attempt is in flight and ends with the thread
    joined; ``errors`` has what its acquire raised."""
    held = _HeldUpReentry(client._backend, threading.Event(), threading.Event())

    def reentry_held_up(name: str, token: str, ttl: float, holder: Any, reentrant: bool) -> Any:
        if reentrant:
            held.in_flight.set()
            held.go_on.wait(10)
            raise dlock.BackendUnavailable("no answer")
        return held.real_acquire(name, token, ttl, holder, reentrant)

    def reenter() -> None:
        try:
            lock.acquire(timeout=0)
        except BaseException as exc:
            held.errors.append(exc)

    client._backend.acquire = reentry_held_up  # type: ignore[method-assign]
    held.sharer = threading.Thread(target=reenter, daemon=True)
    held.sharer.start()
    try:
        assert held.in_flight.wait(5)
        yield held
    finally:
        held.go_on.set()
        held.sharer.join(10)
    assert not held.sharer.is_alive()


@contextlib.asynccontextmanager
async def _async_held_up_reentry(
    client: dlock.aio.AsyncClient, lock: dlock.aio.AsyncLock
) -> AsyncIterator[_HeldUpReentry]:
    """_held_up_reentry on the asyncio face: the re-entering user is a task (``sharer``),
    whose outcome the caller reads from it."""
    held = _HeldUpReentry(client._backend, asyncio.Event(), asyncio.Event())

    async def reentry_held_up(
        name: str, token: str, ttl: float, holder: Any, reentrant: bool
    ) -> Any:
        if reentrant:
            held.in_flight.set()
            await asyncio.wait_for(held.go_on.wait(), 10)
            raise dlock.BackendUnavailable("no answer")
        return await held.real_acquire(name, token, ttl, holder, reentrant)

    client._backend.acquire = reentry_held_up  # type: ignore[method-assign]
    held.sharer = asyncio.ensure_future(lock.acquire(timeout=0))
    try:
        await asyncio.wait_for(held.in_flight.wait(), 5)
        yield held
    finally:
        held.go_on.set()
        await asyncio.wait([held.sharer], timeout=10)


def test_a_fresh_hold_taken_while_a_lost_one_is_given_back_is_kept_with_an_attempt_in_flight(
    tmp_path: Path,
) -> None:
    """As above, but another user of the object has a re-entry attempt in flight under
    the old owner token (held up on its way to the backend) as the fresh hold is taken:
    the fresh hold cannot take a token of its own then (that attempt's outcome is the
    old token's), and the give-back of the lost hold, under that same token, freed it.
    The give-back now waits for that attempt's end, and is dropped as the object holds
    the lock again. The fresh hold is taken during the give-back's release if it is
    sent (before the fix), else once the give-up returns; the attempt ends after it."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=0.5, auto_renew=False, reentrant=True)
        assert lock.acquire(timeout=0)
        with _held_up_reentry(client, lock) as held:
            give_up = time.monotonic() + 5
            while other.inspect("job") is not None:
                assert time.monotonic() < give_up, "the lease did not end"
                time.sleep(0.05)
            taken: list[bool] = []

            def taken_meanwhile(name: str, token: str) -> int | None:
                if not taken:
                    lock.ttl = 30  # the fresh hold outlasts the checks below
                    taken.append(lock.acquire(timeout=0))
                return held.real_release(name, token)  # type: ignore[no-any-return]

            client._backend.release = taken_meanwhile  # type: ignore[method-assign]
            with pytest.raises(dlock.LockLost):
                lock.release()
            if not taken:
                lock.ttl = 30
                taken.append(lock.acquire(timeout=0))
            assert taken == [True] and lock.owned()
            info = other.inspect("job")
            assert info is not None and info.fencing_token == lock.fencing_token
            assert not other.lock("job", ttl=5).acquire(timeout=0)
        assert [type(exc) for exc in held.errors] == [dlock.BackendUnavailable]
        assert lock.owned()
        info = other.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        client._backend.release = held.real_release  # type: ignore[method-assign]
        lock.release()

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            lock = client.lock("async-job", ttl=0.5, auto_renew=False, reentrant=True)
            assert await lock.acquire(timeout=0)
            async with _async_held_up_reentry(client, lock) as held:
                give_up = time.monotonic() + 5
                while await other.inspect("async-job") is not None:
                    assert time.monotonic() < give_up, "the lease did not end"
                    await asyncio.sleep(0.05)
                taken: list[bool] = []

                async def taken_meanwhile(name: str, token: str) -> int | None:
                    if not taken:
                        lock.ttl = 30  # the fresh hold outlasts the checks below
                        taken.append(await lock.acquire(timeout=0))
                    return await held.real_release(name, token)  # type: ignore[no-any-return]

                client._backend.release = taken_meanwhile  # type: ignore[method-assign]
                with pytest.raises(dlock.LockLost):
                    await lock.release()
                if not taken:
                    lock.ttl = 30
                    taken.append(await lock.acquire(timeout=0))
                assert taken == [True] and lock.owned()
                info = await other.inspect("async-job")
                assert info is not None and info.fencing_token == lock.fencing_token
                assert not await other.lock("async-job", ttl=5).acquire(timeout=0)
            with pytest.raises(dlock.BackendUnavailable):
                held.sharer.result()
            assert lock.owned()
            info = await other.inspect("async-job")
            assert info is not None and info.fencing_token == lock.fencing_token
            client._backend.release = held.real_release  # type: ignore[method-assign]
            await lock.release()

    asyncio.run(async_face())


def test_a_reentry_answered_after_its_hold_was_given_up_makes_no_hold(tmp_path: Path) -> None:
    """A thread re-enters a reentrant lock object's hold, and while the re-entry is in
    flight (applied by the backend, its answer on its way) another thread gives the
    hold up: its lease ran out on this process's clock, which its release finds. The
    re-entry, answered with the old lease one entry up, was counted as a fresh hold of
    two entries, its caller holding one: after that caller's release the object still
    held the lock, renewed for good, and once that hold was lost every acquire raised
    LockLost (a helper's chaos run: 8 threads, outages, 7 of 9 runs; there a failed
    release gave the hold up, which now waits for the re-entry's answer). The re-entry
    is told the loss, and the whole lease is given back."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=1, reentrant=True, auto_renew=False)
        backend: Any = client._backend
        real_acquire = backend.acquire
        sent, go_on = threading.Event(), threading.Event()

        def answered_late(name: str, token: str, ttl: float, holder: Any, reentrant: bool) -> Any:
            result = real_acquire(name, token, ttl, holder, reentrant)
            if reentrant:
                sent.set()
                go_on.wait(10)
            return result

        backend.acquire = answered_late
        assert lock.acquire(timeout=0)
        lock.ttl = 30  # the re-entry keeps the lease on the backend past the checks below
        errors: list[BaseException] = []

        def reenter() -> None:
            try:
                if lock.acquire(timeout=0):
                    lock.release()
            except BaseException as exc:
                errors.append(exc)

        sharer = threading.Thread(target=reenter, daemon=True)
        sharer.start()
        try:
            assert sent.wait(5)  # applied by the backend, not yet answered
            give_up = time.monotonic() + 5
            while not lock.lost:
                assert time.monotonic() < give_up, "the lease did not run out"
                time.sleep(0.02)
            with pytest.raises(dlock.LockLost):
                lock.release()
        finally:
            go_on.set()
            sharer.join(10)
        assert [type(exc) for exc in errors] == [dlock.LockLost]
        assert not lock.owned(), "the re-entry made a hold nobody holds"
        rival = other.lock("job", ttl=5)
        assert rival.acquire(timeout=5), "the lease was not given back"
        rival.release()
        assert lock.acquire(timeout=0), "the lock object is stuck"
        lock.release()


def test_a_reentry_finding_its_hold_gone_leaves_a_fresh_hold_taken_meanwhile(
    tmp_path: Path,
) -> None:
    """A re-entry answered busy (the name was taken over) tells the loss of the hold it
    re-entered. Another user of the object ended that hold (its extend found it lost,
    and told so; its release gave it up) and took a fresh one before that answer was
    handled: the fresh hold was declared lost too (on_lost told again, renewal
    stopped, owned() false), though the backend had granted it. It is left alone now;
    the re-entry's caller still gets LockLost, for the hold that it re-entered."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        told: list[object] = []
        lock = client.lock("job", ttl=30, reentrant=True, on_lost=told.append)
        real_acquire = client._backend.acquire
        answered, go_on = threading.Event(), threading.Event()

        def answered_late(name: str, token: str, ttl: float, holder: Any, reentrant: bool) -> Any:
            result = real_acquire(name, token, ttl, holder, reentrant)
            if reentrant:
                answered.set()
                go_on.wait(10)
            return result

        client._backend.acquire = answered_late  # type: ignore[method-assign]
        assert lock.acquire(timeout=0)
        assert other.force_release("job")
        rival = other.lock("job", ttl=30)
        assert rival.acquire(timeout=0)
        errors: list[BaseException] = []

        def reenter() -> None:
            try:
                lock.acquire(timeout=0)
            except BaseException as exc:
                errors.append(exc)

        sharer = threading.Thread(target=reenter, daemon=True)
        sharer.start()
        try:
            assert answered.wait(5)  # busy, not yet handled
            with pytest.raises(dlock.LockLost):
                lock.extend()
            with pytest.raises(dlock.LockLost):
                lock.release()
            assert told == [lock]
            rival.release()
            assert lock.acquire(timeout=0)
        finally:
            go_on.set()
            sharer.join(10)
        assert [type(exc) for exc in errors] == [dlock.LockLost]
        assert told == [lock], "the fresh hold was declared lost"
        assert lock.owned() and not lock.lost
        assert lock in client._renewer._locks
        info = other.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        lock.release()

    async def async_face() -> None:
        async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
            told: list[object] = []
            lock = client.lock("async-job", ttl=30, reentrant=True, on_lost=told.append)
            real_acquire = client._backend.acquire
            answered, go_on = asyncio.Event(), asyncio.Event()

            async def answered_late(
                name: str, token: str, ttl: float, holder: Any, reentrant: bool
            ) -> Any:
                result = await real_acquire(name, token, ttl, holder, reentrant)
                if reentrant:
                    answered.set()
                    await asyncio.wait_for(go_on.wait(), 10)
                return result

            client._backend.acquire = answered_late  # type: ignore[method-assign]
            assert await lock.acquire(timeout=0)
            assert await other.force_release("async-job")
            rival = other.lock("async-job", ttl=30)
            assert await rival.acquire(timeout=0)
            sharer = asyncio.ensure_future(lock.acquire(timeout=0))
            try:
                await asyncio.wait_for(answered.wait(), 5)
                with pytest.raises(dlock.LockLost):
                    await lock.extend()
                with pytest.raises(dlock.LockLost):
                    await lock.release()
                assert told == [lock]
                await rival.release()
                assert await lock.acquire(timeout=0)
            finally:
                go_on.set()
                await asyncio.wait([sharer], timeout=10)
            with pytest.raises(dlock.LockLost):
                sharer.result()
            assert told == [lock], "the fresh hold was declared lost"
            assert lock.owned() and not lock.lost
            assert lock in client._renewer._locks
            info = await other.inspect("async-job")
            assert info is not None and info.fencing_token == lock.fencing_token
            await lock.release()

    asyncio.run(async_face())


def test_a_loss_the_renewer_found_leaves_a_fresh_hold_taken_before_it_was_declared(
    tmp_path: Path,
) -> None:
    """The renewer finds the lease gone (force-released) and, before it declares the
    loss, the holder's thread finds it too (its release says so, and tells it) and takes
    a fresh hold. The renewer's declaration is about the hold that ended: the fresh one
    was declared lost too (on_lost told again, renewal stopped, owned() false), though
    the backend had granted it. Threads only: on the asyncio face nothing runs between
    the renewer's look and its declaration."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    told: list[object] = []
    with _held(url, "job", ttl=30, on_lost=told.append) as (client, rival, lock):
        real_declare = lock._declare_lost
        reached, go_on, declared = threading.Event(), threading.Event(), threading.Event()

        def held_up(*args: Any, **kwargs: Any) -> bool:
            if threading.current_thread() is threading.main_thread():
                return real_declare(*args, **kwargs)
            reached.set()
            assert go_on.wait(10)
            try:
                return real_declare(*args, **kwargs)
            finally:
                declared.set()

        lock._declare_lost = held_up  # type: ignore[method-assign]
        assert rival.force_release("job")
        client._renewer.renew_now()
        try:
            assert reached.wait(5), "the renewer did not find the lease gone"
            with pytest.raises(dlock.LockLost):
                lock.release()
            assert told == [lock]
            assert lock.acquire(timeout=0)
        finally:
            go_on.set()
        assert declared.wait(5)
        assert told == [lock], "the fresh hold was declared lost"
        assert lock.owned() and not lock.lost
        assert lock in client._renewer._locks
        info = rival.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        lock.release()


def test_a_release_answered_after_another_users_last_release_no_longer_revives_the_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two users of a reentrant lock object each release their entry: the backend
    applies one ("one left"), then the other ("none left"), whose answer is handled
    first. The earlier answer is stale: set as the count, it made the object hold the
    lock again (owned() true, renewed) while the backend had it free for anyone."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=30, reentrant=True) as (client, rival, lock):
        assert lock.acquire(timeout=0)
        real_release = client._backend.release

        def answered_after_the_other(name: str, token: str) -> int | None:
            monkeypatch.setattr(client._backend, "release", real_release)
            remaining = real_release(name, token)
            lock.release()  # the other user's, applied and answered meanwhile
            return remaining

        monkeypatch.setattr(client._backend, "release", answered_after_the_other)
        lock.release()
        assert rival.inspect("job") is None
        assert not lock.owned() and lock not in client._renewer._locks
        assert rival.lock("job", ttl=30).acquire(timeout=0)

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=30, reentrant=True) as (client, rival, lock):
            assert await lock.acquire(timeout=0)
            real_release = client._backend.release

            async def answered_after_the_other(name: str, token: str) -> int | None:
                monkeypatch.setattr(client._backend, "release", real_release)
                remaining = await real_release(name, token)
                await lock.release()
                return remaining

            monkeypatch.setattr(client._backend, "release", answered_after_the_other)
            await lock.release()
            assert await rival.inspect("async-job") is None
            assert not lock.owned() and lock not in client._renewer._locks
            assert await rival.lock("async-job", ttl=30).acquire(timeout=0)

    asyncio.run(main())


def test_a_reentry_applied_but_unanswered_no_longer_leaves_a_longer_extend_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(30) on a 0.3 s lease, then a re-entry (TTL 0.3 s) reaches the backend but
    gets no answer: applied, it made the lease end 0.3 s after it was sent, and owned()
    must not stay true for 30 s once another client can take the lock."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=0.3, reentrant=True, auto_renew=False) as (client, other, lock):
        lock.extend(30)
        real_acquire = client._backend.acquire

        def applied_then_failed(*args: Any) -> Any:
            real_acquire(*args)
            raise dlock.BackendUnavailable("no answer")

        monkeypatch.setattr(client._backend, "acquire", applied_then_failed)
        with pytest.raises(dlock.BackendUnavailable):
            lock.acquire(timeout=0)
        _assert_taken_over(other, lock)

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=0.3, reentrant=True, auto_renew=False) as (
            client,
            other,
            lock,
        ):
            await lock.extend(30)
            real_acquire = client._backend.acquire

            async def applied_then_failed(*args: Any) -> Any:
                await real_acquire(*args)
                raise dlock.BackendUnavailable("no answer")

            monkeypatch.setattr(client._backend, "acquire", applied_then_failed)
            with pytest.raises(dlock.BackendUnavailable):
                await lock.acquire(timeout=0)
            await _async_assert_taken_over(other, lock)

    asyncio.run(main())


def test_a_reentry_answered_after_an_overlapping_shorter_extend_keeps_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-entry (TTL 30 s) reaches the backend; another user's extend(0.3) is applied
    after it and answered before it. The two overlap, so the lease is only sure to last
    until the earlier of their ``sent + ttl``: the re-entry's answer must not count it
    for 30 s."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=30, reentrant=True, auto_renew=False) as (client, other, lock):
        real_acquire = client._backend.acquire

        def answered_after_an_extend(*args: Any) -> Any:
            monkeypatch.setattr(client._backend, "acquire", real_acquire)
            granted = real_acquire(*args)
            lock.extend(0.3)
            return granted

        monkeypatch.setattr(client._backend, "acquire", answered_after_an_extend)
        assert lock.acquire(timeout=0)
        _assert_taken_over(other, lock)

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=30, reentrant=True, auto_renew=False) as (
            client,
            other,
            lock,
        ):
            real_acquire = client._backend.acquire

            async def answered_after_an_extend(*args: Any) -> Any:
                monkeypatch.setattr(client._backend, "acquire", real_acquire)
                granted = await real_acquire(*args)
                await lock.extend(0.3)
                return granted

            monkeypatch.setattr(client._backend, "acquire", answered_after_an_extend)
            assert await lock.acquire(timeout=0)
            await _async_assert_taken_over(other, lock)

    asyncio.run(main())


def test_a_give_back_of_a_lost_hold_cut_off_in_flight_no_longer_frees_the_next_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """release() of a lost hold gives its lease back, and that release is cut off in
    flight (Ctrl-C, a cancellation): the backend may still apply it later. Unrecorded,
    the object's next hold kept the owner token, and the late release freed it while
    the object still held it."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with _held(url, "job", ttl=30) as (client, rival, lock):
        assert rival.force_release("job")
        with pytest.raises(dlock.LockLost):
            lock.extend()
        real_release = client._backend.release
        late: list[tuple[str, str]] = []

        def cut_off(name: str, token: str) -> int | None:
            late.append((name, token))
            raise KeyboardInterrupt

        monkeypatch.setattr(client._backend, "release", cut_off)
        with pytest.raises(KeyboardInterrupt):
            lock.release()
        monkeypatch.setattr(client._backend, "release", real_release)
        assert lock.acquire(timeout=0)
        real_release(*late[0])  # arrives now
        info = rival.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        lock.release()

    async def main() -> None:
        async with _async_held(url, "async-job", ttl=30) as (client, rival, lock):
            assert await rival.force_release("async-job")
            with pytest.raises(dlock.LockLost):
                await lock.extend()
            real_release = client._backend.release
            late: list[tuple[str, str]] = []

            async def cut_off(name: str, token: str) -> int | None:
                late.append((name, token))
                raise asyncio.CancelledError

            monkeypatch.setattr(client._backend, "release", cut_off)
            with pytest.raises(asyncio.CancelledError):
                await lock.release()
            monkeypatch.setattr(client._backend, "release", real_release)
            assert await lock.acquire(timeout=0)
            await real_release(*late[0])
            info = await rival.inspect("async-job")
            assert info is not None and info.fencing_token == lock.fencing_token
            await lock.release()

    asyncio.run(main())


def test_a_timeout_longer_than_a_thread_can_wait_no_longer_overflows(tmp_path: Path) -> None:
    """A timeout is any number of seconds, but a thread waits at most
    threading.TIMEOUT_MAX (about 292 years): waiting for another user of the lock
    object to end its acquire raised OverflowError with a longer one (the threaded
    face), rather than going on as a call made at that moment would."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as rival:
        holder = rival.lock("job", ttl=30)
        assert holder.acquire(timeout=0)
        lock = client.lock("job", ttl=30)
        results: list[bool] = []
        seeker = threading.Thread(target=lambda: results.append(lock.acquire(timeout=10)))
        seeker.start()
        give_up = time.monotonic() + 5
        while lock._seeker is None:
            assert time.monotonic() < give_up, "the other user did not start seeking"
            time.sleep(0.005)
        release = threading.Timer(0.1, holder.release)
        release.start()
        with pytest.raises(dlock.AlreadyAcquired):
            lock.acquire(timeout=threading.TIMEOUT_MAX * 2)
        seeker.join(5)
        release.join(5)
        assert results == [True]
        lock.release()


def test_an_on_lost_closing_the_client_stops_the_renewal_round_it_ran_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewer tells one lease's loss in the round that renews another; its
    on_lost closes the client (on the renewer's thread). The round went on to renew
    the other lease on the closed backend, which reopened the SQLite file, for good."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        closed_when_renewing: list[bool] = []
        real_extend_many = client._backend.extend_many

        def extend_many(leases: list[Any]) -> Sequence[bool | None]:
            closed_when_renewing.append(client._closed)
            return real_extend_many(leases)

        monkeypatch.setattr(client._backend, "extend_many", extend_many)
        doomed = client.lock("doomed", ttl=30, on_lost=lambda lock: client.close())
        other = client.lock("other", ttl=30)
        assert other.acquire(timeout=0) and doomed.acquire(timeout=0)
        renewer = client._renewer._runner
        doomed._deadline = client._clock() - 1  # ran out: the process was paused
        client._renewer.renew_now()
        renewer.join(5)
        assert not renewer.is_alive() and client._closed
        assert True not in closed_when_renewing
        assert client._backend._connection is None  # type: ignore[attr-defined]


def test_an_extend_answered_after_the_loss_was_told_no_longer_renews_the_lost_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renewals fail, and extend(30) is applied but answered only after the renewer
    told the loss at the lease's deadline (on_lost called, owned() false). The answer
    put the lock back into the renewer, which kept renewing for good the lease of a
    lock its holder was told it had lost, unless that holder released it. And the
    extend returned normally, a hold extended after its holder was told it was gone:
    it raises LockLost (a chaos helper saw it on etcd, its quorum back)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    async def main() -> None:
        told: list[object] = []
        async with _async_held(url, "job", ttl=0.3, on_lost=told.append) as (client, _, lock):
            real_extend = client._backend.extend

            async def unanswered(leases: list[Any]) -> list[bool]:
                raise dlock.BackendUnavailable("no answer")

            async def answered_after_the_loss(name: str, token: str, ttl: float) -> bool:
                applied = await real_extend(name, token, ttl)
                give_up = time.monotonic() + 5
                while not told:
                    assert time.monotonic() < give_up, "the loss was not told"
                    await asyncio.sleep(0.005)
                return applied

            monkeypatch.setattr(client._backend, "extend_many", unanswered)
            monkeypatch.setattr(client._backend, "extend", answered_after_the_loss)
            with pytest.raises(dlock.LockLost):
                await lock.extend(30)
            assert lock.lost and lock not in client._renewer._locks

    asyncio.run(main())


def test_an_extend_answered_no_sooner_than_the_lease_it_set_ended_raises_lock_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(0.2) applied, but answered only after 0.2 s from when it was sent (a
    backend stalled that long): counted as every lease is, the lease it set ended
    before the answer came, and the hold is lost on arrival, as a fresh grant answered
    so late holds nothing. The extend returned normally, the lock already lost."""
    told: list[object] = []
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=30, on_lost=told.append)
        assert lock.acquire(timeout=0)
        real_extend = client._backend.extend

        def answered_late(name: str, token: str, ttl: float) -> bool:
            applied = real_extend(name, token, ttl)
            time.sleep(0.3)
            return applied

        monkeypatch.setattr(client._backend, "extend", answered_late)
        with pytest.raises(dlock.LockLost):
            lock.extend(0.2)
        assert lock.lost and told == [lock]
        with pytest.raises(dlock.LockLost):
            lock.release()


@pytest.mark.parametrize("auto_renew", [True, False], ids=["renewed", "not-renewed"])
def test_a_reentry_answered_no_sooner_than_the_lease_it_set_ended_is_a_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, auto_renew: bool
) -> None:
    """A re-entry applied, but answered only after the lock's TTL from when it was sent
    (a backend stalled that long): the lease it set ended before the answer came. A
    renewed lock was told lost by the renewer at that deadline, and the re-entry raised
    LockLost; one not renewed returned True, its hold already run out. Both are a loss,
    its entries left one by one, each release told so."""
    told: list[object] = []
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        lock = client.lock(
            "job", ttl=0.3, reentrant=True, auto_renew=auto_renew, on_lost=told.append
        )
        assert lock.acquire(timeout=0)
        real_acquire = client._backend.acquire

        def answered_late(*args: Any) -> Any:
            answer = real_acquire(*args)
            time.sleep(0.4)
            return answer

        monkeypatch.setattr(client._backend, "acquire", answered_late)
        with pytest.raises(dlock.LockLost):
            lock.acquire(timeout=0)
        assert lock.lost and told == [lock]
        with pytest.raises(dlock.LockLost):
            lock.release()
        with pytest.raises(dlock.LockLost):
            lock.release()
        with dlock.connect(url) as other:
            assert other.inspect("job") is None


def test_a_lease_taken_while_a_renewal_is_stuck_is_told_lost_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewer's call for a 30 s lease is stuck (the asyncio face bounds it by that
    lease's deadline, the threaded one by the client library's timeouts), and a 0.3 s
    lease is taken meanwhile: the blocked renewer cannot renew it, so its loss must be
    told at its deadline. The alarm that tells such losses slept until the deadlines it
    knew of as the call began, and told this one only once the call ended."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        real_extend_many = client._backend.extend_many
        stuck, go_on = threading.Event(), threading.Event()

        def held_up(leases: list[Any]) -> Sequence[bool | None]:
            stuck.set()
            go_on.wait(10)
            return real_extend_many(leases)

        monkeypatch.setattr(client._backend, "extend_many", held_up)
        assert client.lock("long", ttl=30).acquire(timeout=0)
        try:
            _renew_now_until(client, stuck.is_set)
            told: list[object] = []
            short = client.lock("short", ttl=0.3, on_lost=told.append)
            assert short.acquire(timeout=0)
            give_up = time.monotonic() + 3
            while not told:
                assert time.monotonic() < give_up, "not told at the deadline"
                time.sleep(0.005)
        finally:
            go_on.set()

    async def main() -> None:
        async with dlock.aio.connect(url) as client:
            real_extend_many = client._backend.extend_many
            stuck, go_on = asyncio.Event(), asyncio.Event()

            async def held_up(leases: list[Any]) -> Sequence[bool | None]:
                stuck.set()
                await asyncio.wait_for(go_on.wait(), 10)
                return await real_extend_many(leases)

            monkeypatch.setattr(client._backend, "extend_many", held_up)
            assert await client.lock("async-long", ttl=30).acquire(timeout=0)
            try:
                await _async_renew_now_until(client, stuck.is_set)
                told: list[object] = []
                short = client.lock("async-short", ttl=0.3, on_lost=told.append)
                assert await short.acquire(timeout=0)
                give_up = time.monotonic() + 3
                while not told:
                    assert time.monotonic() < give_up, "not told at the deadline"
                    await asyncio.sleep(0.005)
            finally:
                go_on.set()

    asyncio.run(main())


def test_give_backs_kept_by_two_threads_at_once_are_both_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits for the give-backs still running (daemon threads: the end of the
    process would cut one short, leaving its lease to its TTL). Two threads keeping one
    each at once each wrote a list without the other's: one was dropped. Here the
    second thread keeps its give-back while the first is writing its list."""
    import dlock._sync.client as client_module
    from dlock._sync._primitives import serving as real_serving

    stop = threading.Event()
    running = [threading.Thread(target=stop.wait, args=(10,), daemon=True) for _ in range(3)]
    for thread in running:
        thread.start()
    try:
        with dlock.connect(f"sqlite://{tmp_path}/locks.db") as client:
            client._keep_give_back(running[0])
            other = threading.Thread(target=client._keep_give_back, args=(running[2],))

            def serving_meanwhile(thread: threading.Thread | None) -> bool:
                if other.ident is None:
                    other.start()
                    other.join(0.2)  # guarded, it waits for this keep to end
                return real_serving(thread)

            monkeypatch.setattr(client_module, "serving", serving_meanwhile)
            client._keep_give_back(running[1])
            other.join(5)
            monkeypatch.undo()
            kept = set(client._give_backs)
            stop.set()  # before the close, which waits for them
    finally:
        stop.set()
    assert set(running) <= kept, "a give-back was dropped"


def test_a_lease_is_renewed_a_third_of_its_ttl_in_not_a_sixth(tmp_path: Path) -> None:
    """The renewer wakes every second while it holds locks, and each wake renewed every
    lease due within a sixth of its TTL, as if to batch it with one due now, although
    none was: a lone 6 s lease was renewed every second, a 30 s one every 5 s (twice
    the writes the README's "after a third of its TTL" promises)."""
    url = f"sqlite://{tmp_path}/locks.db"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=12)
        assert lock.acquire(timeout=0)
        first = other.inspect("job")
        assert first is not None and first.expires_in is not None
        # The renewer woke every second meanwhile; a sixth is 2 s in, a third 4 s.
        time.sleep(3)
        info = other.inspect("job")
        assert info is not None and info.expires_in is not None
        assert info.expires_in < first.expires_in - 2.5, "renewed before a third of its TTL"
        lock.release()


def test_a_failed_renewal_of_a_lease_shorter_than_the_ttl_is_retried_before_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed renewal is tried again while the lease lasts. After extend(0.6) of a
    30 s lock, the retry was set a tenth of the TTL later (3 s), past the lease's end:
    its one retry came at the deadline, and one refused renewal lost the lock with
    0.4 s left to try again."""
    told: list[object] = []
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=30, on_lost=told.append)
        assert lock.acquire(timeout=0)
        real_extend_many = client._backend.extend_many
        calls: list[float] = []

        def refused_once(leases: list[Any]) -> Any:
            calls.append(time.monotonic())
            if len(calls) == 1:
                raise dlock.BackendUnavailable("connection refused")
            return real_extend_many(leases)

        monkeypatch.setattr(client._backend, "extend_many", refused_once)
        lock.extend(0.6)
        time.sleep(1.0)
        assert len(calls) >= 2, "never retried"
        assert lock.owned() and not told
        lock.release()


def test_a_renewal_never_shortens_a_lease_the_holder_extended(tmp_path: Path) -> None:
    """``extend(600)`` on a lock with a 30 s TTL promises the lease for 600 s (a holder
    about to block where it cannot renew). The watchdog renewed it with the lock's own
    TTL (a third of the way in, or at once when the backend asked for a re-check), and
    the lease then ended 30 s later: a holder paused meanwhile lost it early."""
    url = f"sqlite://{tmp_path}/locks.db"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        lock = client.lock("job", ttl=30)
        assert lock.acquire(timeout=0)
        lock.extend(600)
        before = lock._renew_at
        _renew_now_until(client, lambda: lock._renew_at != before)
        info = other.inspect("job")
        assert info is not None and info.expires_in is not None
        assert info.expires_in > 590, f"the renewal cut the lease to {info.expires_in:.0f} s"
        assert lock._deadline - client._clock() > 590
        lock.release()


def test_a_fresh_hold_taken_as_a_lost_one_is_given_up_still_has_its_loss_told(
    tmp_path: Path,
) -> None:
    """The end of a block that finds its hold ran out gives the hold up: it forgot the
    hold, then declared the loss, about the hold it had looked at. Another user of the
    object that took a fresh hold in between (the hold forgotten, the object free) made
    that declaration about an ended hold: on_lost was never called for the lost one.
    The loss is now flagged before the hold is forgotten, and told all the same. Threads
    only: on the asyncio face nothing else runs between the two steps."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client, dlock.connect(url) as other:
        told: list[object] = []
        lock = client.lock("job", ttl=0.5, auto_renew=False, on_lost=told.append)
        real_forget = lock._forget
        taken: list[bool] = []

        def fresh_hold_meanwhile() -> None:
            real_forget()
            if not taken and threading.current_thread() is threading.main_thread():
                lock.ttl = 30  # the fresh hold outlasts the checks below
                sharer = threading.Thread(target=lambda: taken.append(lock.acquire(timeout=0)))
                sharer.start()
                sharer.join(10)

        lock._forget = fresh_hold_meanwhile  # type: ignore[method-assign]
        with pytest.raises(dlock.LockLost), lock:
            give_up = time.monotonic() + 5
            while other.inspect("job") is not None:
                assert time.monotonic() < give_up, "the lease did not end"
                time.sleep(0.05)
        assert taken == [True]
        assert told == [lock], "the loss of the hold given up was not told"
        assert lock.owned() and not lock.lost
        info = other.inspect("job")
        assert info is not None and info.fencing_token == lock.fencing_token
        lock.release()


def test_a_close_from_an_on_lost_that_close_told_gives_everything_back(tmp_path: Path) -> None:
    """close() tells each holder its lock is lost before it gives the leases back. An
    on_lost told so may close the client again and release its lock (LockLost at once,
    no round trip): every holder is still told once, every lease given back while the
    backend is open, and the backend left closed. A hold told lost by the close raises
    LockLost saying so from release()."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as admin:
        client = dlock.connect(url)
        told: list[object] = []
        released: list[BaseException] = []

        def close_and_release(lock: dlock.Lock) -> None:
            told.append(lock)
            client.close()
            try:
                lock.release()
            except BaseException as exc:
                released.append(exc)

        first = client.lock("first", ttl=30, on_lost=close_and_release)
        second = client.lock("second", ttl=30, reentrant=True, on_lost=told.append)
        assert first.acquire(timeout=0)
        assert second.acquire(timeout=0) and second.acquire(timeout=0)
        client.close()
        assert sorted(told, key=id) == sorted([first, second], key=id)
        assert [type(exc) for exc in released] == [dlock.LockLost]
        assert not first.owned() and not second.owned() and second.lost
        with pytest.raises(dlock.LockLost, match="client was closed"):
            second.release()
        assert admin.inspect("first") is None and admin.inspect("second") is None
        assert client._backend._connection is None  # type: ignore[attr-defined]
        assert len(told) == 2

    async def async_face() -> None:
        async with dlock.aio.connect(url) as admin:
            client = dlock.aio.connect(url)
            told: list[object] = []
            closes: list[asyncio.Task[None]] = []

            def close_again(lock: dlock.aio.AsyncLock) -> None:
                told.append(lock)
                closes.append(asyncio.ensure_future(client.aclose()))

            first = client.lock("first", ttl=30, on_lost=close_again)
            second = client.lock("second", ttl=30, reentrant=True, on_lost=told.append)
            assert await first.acquire(timeout=0)
            assert await second.acquire(timeout=0) and await second.acquire(timeout=0)
            await client.aclose()
            await asyncio.wait(closes)
            assert sorted(told, key=id) == sorted([first, second], key=id)
            for lock in (first, second):
                assert not lock.owned() and lock.lost
                with pytest.raises(dlock.LockLost, match="client was closed"):
                    await lock.release()
            assert await admin.inspect("first") is None
            assert await admin.inspect("second") is None
            assert client._backend._connection is None  # type: ignore[attr-defined]
            assert len(told) == 2

    asyncio.run(async_face())


def test_a_close_from_the_holders_own_thread(tmp_path: Path) -> None:
    """close() from the thread (task) that holds a lock: after its block ended, nothing
    is told (the hold was released); inside its block, the hold is lost as from any
    other thread: on_lost once, LockLost from the block's end. Under asyncio the task
    closing is not cancelled (it would stop its own close halfway): it is told by the
    block's LockLost, as a body that finds a loss itself is."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as admin:
        told: list[object] = []
        client = dlock.connect(url)
        lock = client.lock("job", ttl=30, on_lost=told.append)
        with lock:
            pass
        client.close()
        assert not told
        client = dlock.connect(url)
        lock = client.lock("job", ttl=30, on_lost=told.append)
        with pytest.raises(dlock.LockLost, match="client was closed"), lock:
            client.close()
            assert told == [lock] and lock.lost
            assert admin.inspect("job") is None
        assert told == [lock]

    async def async_face() -> None:
        async with dlock.aio.connect(url) as admin:
            told: list[object] = []
            client = dlock.aio.connect(url)
            lock = client.lock("job", ttl=30, on_lost=told.append)
            async with lock:
                pass
            await client.aclose()
            assert not told
            client = dlock.aio.connect(url)
            lock = client.lock("job", ttl=30, on_lost=told.append)
            after: list[bool] = []
            with pytest.raises(dlock.LockLost, match="client was closed"):
                async with lock:
                    await client.aclose()
                    await asyncio.sleep(0)  # not cancelled: goes on
                    after.append(lock.lost)
            assert after == [True] and told == [lock]
            assert await admin.inspect("job") is None

    asyncio.run(async_face())


def test_a_release_in_flight_as_the_client_closes_ends_cleanly(tmp_path: Path) -> None:
    """A block's release on its way to the backend as another thread closes the client:
    the close released the lease under it, the release found it gone, and the holder
    was told a loss ("expired or taken over"), though it had left its block first. The
    close now lets a release in flight end before it gives back the holds: a clean end,
    no loss told. One begun after that (the close giving the holds back) is the close's
    hold, told lost by it (see test_closing_the_client_tells_each_holder_its_lock_is_lost)."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as admin:
        told: list[object] = []
        client = dlock.connect(url)
        lock = client.lock("job", ttl=30, on_lost=told.append)
        real_release, real_held = client._backend.release, client._still_held
        in_flight, giving_back = threading.Event(), threading.Event()

        def held() -> tuple[dlock.Lock, ...]:
            giving_back.set()
            return real_held()

        def held_up(name: str, token: str) -> int | None:
            in_flight.set()
            # Until the close gives back the holds (before the fix), or waits for the
            # calls in flight with this one among them (after it).
            give_up = time.monotonic() + 5
            while not giving_back.is_set() and not (
                client._acquires_settling and client._acquiring
            ):
                assert time.monotonic() < give_up, "the close neither waited nor went on"
                time.sleep(0.005)
            return real_release(name, token)

        client._backend.release = held_up  # type: ignore[method-assign]
        client._still_held = held  # type: ignore[method-assign]
        assert lock.acquire(timeout=0)
        closing = threading.Thread(target=client.close)
        errors: list[BaseException] = []

        def release() -> None:
            try:
                lock.release()
            except BaseException as exc:
                errors.append(exc)

        try:
            lock_released = threading.Thread(target=release)
            lock_released.start()
            assert in_flight.wait(5)
            closing.start()
            lock_released.join(10)
        finally:
            closing.join(10)
        assert not told, "a loss was told for a hold released cleanly"
        assert not errors
        assert not lock.owned() and not lock.lost
        assert admin.inspect("job") is None


def test_an_unrenewed_lease_that_ran_out_is_told_as_its_ttl_ending(tmp_path: Path) -> None:
    """A lock with ``auto_renew=False`` whose block outlived its TTL was told that "the
    lease ran out before it could be renewed", as if a renewal had failed: nothing was
    ever to renew it."""
    with dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as client:
        lock = client.lock("job", ttl=0.3, auto_renew=False)
        ended = r"its TTL ended \(auto_renew=False"
        with pytest.raises(dlock.LockLost, match=ended) as lost, lock:
            time.sleep(0.5)
        assert "could be renewed" not in str(lost.value)


@pytest.mark.parametrize("auto_renew", [True, False])
def test_a_lock_object_dropped_while_held(tmp_path: Path, auto_renew: bool) -> None:
    """Dropping a held lock object does not release it. Renewed, it stays held until
    its client closes, which gives it back: a program that runs a job after
    ``client.lock(name).acquire()`` keeps the lock though it kept no reference (the
    README once said its lease ended by its TTL: a chaos helper found it renewed).
    Not renewed, nothing keeps it, and its lease ends by its TTL."""
    url = f"sqlite://{tmp_path}/locks.db"
    with dlock.connect(url) as holding, dlock.connect(url) as other:
        assert holding.lock("job", ttl=1, auto_renew=auto_renew).acquire(timeout=0)
        gc.collect()
        time.sleep(2)  # twice the TTL
        if not auto_renew:
            assert other.inspect("job") is None
            return
        info = other.inspect("job")
        assert info is not None and info.expires_in is not None and info.expires_in > 0
        assert not other.lock("job", ttl=1).acquire(timeout=0)
        holding.close()
        assert other.inspect("job") is None
