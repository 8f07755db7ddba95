"""What only the SQLite backend has: a database file that its first users create."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import dlock
import dlock.aio
from dlock._sync.backends.sqlite import SQLiteBackend
from tests.conformance.helpers import ROOT
from tests.forking import answer_in_a_child, in_a_fresh_interpreter

# Imports first, then waits for the start signal, so that every process opens the file
# within the same few milliseconds.
OPEN_AND_LOCK = """
import os, sys, time
import pytest

import dlock
client = dlock.connect("sqlite:///" + sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.0005)
lock = client.lock("first", ttl=5)
assert lock.acquire(timeout=10)
lock.release()
"""


def test_processes_that_create_the_file_at_once_all_get_the_lock(tmp_path: Path) -> None:
    # Switching a new file to WAL is refused at once ("database is locked") to a process
    # racing another one doing it; before the retry, about one trial in three lost one.
    for trial in range(5):
        database, start = tmp_path / f"{trial}.sqlite3", tmp_path / f"start-{trial}"
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN_AND_LOCK, str(database), str(start)],
                cwd=ROOT,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(8)
        ]
        time.sleep(0.5)
        start.touch()
        # Every process is waited for before judging, so none is left running.
        outcomes = [(process.communicate(timeout=60)[1], process) for process in processes]
        for errors, process in outcomes:
            assert process.returncode == 0, errors[-500:]
        with sqlite3.connect(database) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def _set_back(path: Path, name: str, seconds: float) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "UPDATE dlock_locks SET expires = expires - ? WHERE name = ?", (seconds, name.encode())
        )
    conn.close()


def _token(client: dlock.Client, name: str) -> int:
    with client.lock(name, ttl=30) as lock:
        assert lock.fencing_token is not None
        return lock.fencing_token


def test_prune_keeps_tokens_increasing_when_the_clock_steps_back(tmp_path: Path) -> None:
    """Tokens start from the host's wall clock, which an NTP step can set back: a name
    made again after a prune counts on from the largest token of the rows deleted, or a
    holder cut off before the prune would outrank the next one."""
    path = tmp_path / "locks.sqlite3"
    with dlock.connect(f"sqlite:///{path}") as client:
        for name, turns in [("idle", 3), ("other", 5), ("recent", 1)]:
            for _ in range(turns):
                _token(client, name)
        held = client.lock("held", ttl=30)
        assert held.acquire(timeout=0)
        # Tokens handed out while the clock read an hour ahead of where it reads now.
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE dlock_locks SET fence = fence + 3600000000")
        tokens = dict(conn.execute("SELECT CAST(name AS TEXT), fence FROM dlock_locks"))
        conn.close()
        for name in ("idle", "other", "held"):
            _set_back(path, name, 7200)
        # "held" ran out two hours ago: expired, so idle too. Re-take it as held.
        held_again = client.lock("held", ttl=30)
        assert held_again.acquire(timeout=0)
        assert held_again.fencing_token == tokens["held"] + 1
        # One row per transaction: the floor must still rise over both.
        assert client.prune(3600, batch=1) == 2  # "idle" and "other"
        assert {info.name for info in client.list()} == {"held"}
        assert _token(client, "recent") == tokens["recent"] + 1
        # Above "other"'s, the largest token pruned, not just above "idle"'s own.
        assert tokens["other"] > tokens["idle"]
        assert _token(client, "idle") == tokens["other"] + 1
        held_again.release()
        _set_back(path, "idle", 7200)
        last = _token(client, "other")
        assert client.prune(3600) == 1
        assert _token(client, "idle") > last


def test_rows_of_an_earlier_boot_have_been_idle_since_boot(tmp_path: Path) -> None:
    path = tmp_path / "locks.sqlite3"
    with dlock.connect(f"sqlite:///{path}") as client:
        before = _token(client, "old")
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE dlock_locks SET boot = 'an earlier boot'")
        conn.close()
        uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert client.prune(600) == (1 if uptime > 600 else 0)
        assert _token(client, "old") > before


def test_a_missing_directory_in_a_named_path_is_refused_not_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every missing directory of a path was made: a typo in it (or ``sqlite:~/x.db``,
    which is relative: a directory named ``~``) gave a lock file of its own, excluding
    nobody, and without a word. Only dlock's default file gets its directory made."""
    monkeypatch.chdir(tmp_path)
    for url in (f"sqlite://{tmp_path}/typo/locks.db", "sqlite:~/locks.db"):
        with dlock.connect(url) as client:
            said = r"does not exist .*`dlock init` any file's"
            with pytest.raises(dlock.BackendError, match=said) as refused:
                client.lock("x", ttl=5).acquire(timeout=0)
            assert not isinstance(refused.value, dlock.BackendUnavailable), refused.value
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("DLOCK_URL", raising=False)
    with dlock.connect() as client, client.lock("x", ttl=5):
        assert (tmp_path / "state" / "dlock" / "locks.sqlite3").is_file()


MAKE_FILES_WITH_UMASK_0 = """
import os, sys
import dlock
os.umask(0)
with dlock.connect() as client, client.lock("x", ttl=5):
    pass
from dlock._cli import main
sys.exit(main(["init", "--url", "sqlite://" + sys.argv[1]]))
"""


def test_the_directories_dlock_makes_are_writable_by_their_creator_only(
    tmp_path: Path,
) -> None:
    """The file is 0644 less the umask, even when that is 0 (SQLite's mode), but the
    directories made for it were 0777 less the umask: with a umask of 0, every user
    of the host could delete or replace a lock file in use (a lost lease), in a state
    directory the README calls per user."""
    state = tmp_path / "state"
    named = tmp_path / "made" / "by" / "init" / "locks.db"
    environment = {**os.environ, "XDG_STATE_HOME": str(state)}
    environment.pop("DLOCK_URL", None)
    subprocess.run(
        [sys.executable, "-c", MAKE_FILES_WITH_UMASK_0, str(named)],
        check=True,
        env=environment,
        timeout=60,
    )
    made = [state, state / "dlock", tmp_path / "made", named.parent.parent, named.parent]
    modes = {str(path): oct(path.stat().st_mode & 0o777) for path in made}
    assert modes == {str(path): "0o755" for path in made}
    for file in (state / "dlock" / "locks.sqlite3", named):
        assert oct(file.stat().st_mode & 0o777) == "0o644"


def test_a_file_that_cannot_be_a_lock_table_is_refused_not_unavailable(tmp_path: Path) -> None:
    """Opening a file that is not a database, or a directory, fails the same way every
    time: a refusal (``BackendError``), not "down, worth retrying". A file another
    program keeps locked is the one open failure that is ``BackendUnavailable``."""
    not_a_database = tmp_path / "text.db"
    not_a_database.write_bytes(b"this is not a database, just text" * 100)
    directory = tmp_path / "dir.db"
    directory.mkdir()
    for path in (not_a_database, directory):
        with dlock.connect(f"sqlite://{path}") as client:
            with pytest.raises(dlock.BackendError) as refused:
                client.lock("x", ttl=5).acquire(timeout=0)
            assert not isinstance(refused.value, dlock.BackendUnavailable), refused.value

    locked = tmp_path / "locked.db"
    with dlock.connect(f"sqlite://{locked}") as client:
        client.inspect("x")  # creates the file and its table
    other = sqlite3.connect(locked, isolation_level=None)
    other.execute("PRAGMA locking_mode=EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    try:
        with (
            dlock.connect(f"sqlite://{locked}", busy_timeout=0.2) as client,
            pytest.raises(dlock.BackendUnavailable, match="locked"),
        ):
            client.lock("x", ttl=5).acquire(timeout=0)
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_a_file_write_locked_past_the_busy_timeout_is_unavailable(tmp_path: Path) -> None:
    """Another connection that keeps the file write-locked longer than ``busy_timeout``
    is a backend not answering in time (``BackendUnavailable``, worth retrying), not a
    refusal: it was a plain ``BackendError``, which callers are told not to retry."""
    path = tmp_path / "busy.db"
    with dlock.connect(f"sqlite://{path}", busy_timeout=0.3) as client:
        lock = client.lock("x", ttl=5)
        assert lock.acquire(timeout=0)
        lock.release()
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(dlock.BackendUnavailable, match="locked"):
                lock.acquire(timeout=0)
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert lock.acquire(timeout=0)
        lock.release()


async def test_a_try_after_an_unanswered_attempt_is_answered_by_the_backend(
    tmp_path: Path,
) -> None:
    """An attempt that got no answer is given back in the background, under the old
    owner token; a try made while that runs waits for it, then asks the backend under
    a new token. It used to say "busy" (False) at once, the file free (both faces: the
    sync one is the test above)."""
    path = tmp_path / "busy.db"
    async with dlock.aio.connect(f"sqlite://{path}", busy_timeout=0.3) as client:
        lock = client.lock("x", ttl=5)
        other = sqlite3.connect(path, isolation_level=None)
        assert await lock.acquire(timeout=0)  # the file and its table exist
        await lock.release()
        other.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(dlock.BackendUnavailable, match="locked"):
                await lock.acquire(timeout=0)
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert await lock.acquire(timeout=0)
        await lock.release()


def test_a_lease_outside_a_stuck_renewal_is_told_lost_at_its_own_deadline(
    tmp_path: Path,
) -> None:
    """While one lease's renewal is stuck on a write-locked file, another lease that was
    not due, so not in that call, runs out too: it must be told at its deadline, not
    when the stuck call gives up (sync: busy_timeout; asyncio: the batch's deadline)."""
    db = tmp_path / "locks.sqlite3"
    url = f"sqlite://{db}?busy_timeout=10"
    short = 2.0

    def stuck_on(kept: Any, renewer: Any, clock: Callable[[], float]) -> sqlite3.Connection:
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        # "kept" (ttl 30) is due now; "short" was taken just now, due in 2/3 s.
        kept._renew_at = clock()
        renewer.add(kept)
        return blocker

    def check(told: list[float], taken: float, kept: Any, lost: Any) -> None:
        assert told and told[0] >= taken + short, "told at the deadline, not before"
        assert lost.lost and not lost.owned()
        assert kept.owned(), "the stuck renewal's own lease has 30 s"

    with dlock.connect(url) as client:
        told: list[float] = []
        event = threading.Event()
        kept = client.lock("kept", ttl=30)
        assert kept.acquire(timeout=0)
        taken = client._clock()
        lost = client.lock(
            "short", ttl=short, on_lost=lambda _: (told.append(client._clock()), event.set())
        )
        assert lost.acquire(timeout=0)
        blocker = stuck_on(kept, client._renewer, client._clock)
        try:
            assert event.wait(short + 1.5), "told when the stuck renewal gave up"
            check(told, taken, kept, lost)
        finally:
            blocker.execute("COMMIT")
            blocker.close()

    async def main() -> None:
        async with dlock.aio.connect(url) as client:
            told: list[float] = []
            event = asyncio.Event()
            kept = client.lock("kept", ttl=30)
            assert await kept.acquire(timeout=0)
            taken = client._clock()
            lost = client.lock(
                "short", ttl=short, on_lost=lambda _: (told.append(client._clock()), event.set())
            )
            assert await lost.acquire(timeout=0)
            blocker = stuck_on(kept, client._renewer, client._clock)
            try:
                await asyncio.wait_for(event.wait(), short + 1.5)
                check(told, taken, kept, lost)
            finally:
                blocker.execute("COMMIT")
                blocker.close()

    asyncio.run(main())


def test_an_on_lost_that_releases_does_not_hold_up_other_losses(tmp_path: Path) -> None:
    """While a renewal is stuck on a write-locked file, the watchdog tells the first
    loss; its on_lost releases the lock, which must not make the watchdog wait for the
    file (up to busy_timeout) before telling the next loss at its own deadline."""
    db = tmp_path / "locks.sqlite3"
    other = dlock.connect(f"sqlite://{db}")
    released: list[BaseException] = []
    told = threading.Event()

    def releasing(lock: dlock.Lock) -> None:
        try:
            lock.release()
        except dlock.LockLost as exc:  # its contract holds from on_lost too
            released.append(exc)

    with dlock.connect(f"sqlite://{db}?busy_timeout=20") as client:
        first = client.lock("first", ttl=1.0, on_lost=releasing)
        second = client.lock("second", ttl=2.0, on_lost=lambda _: told.set())
        assert first.acquire(timeout=0) and second.acquire(timeout=0)
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            assert told.wait(8), "the second loss waited for the first one's release"
            assert released and first.lost and not first.owned()
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        # Given back in the background once the file is free again.
        deadline = time.monotonic() + 15
        while other.inspect("first") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.inspect("first") is None
    other.close()


# Python 3.12+ warns about fork() in a process with threads; these tests fork on purpose.
FORKS = pytest.mark.filterwarnings("ignore:.*fork\\(\\) may lead to deadlocks:DeprecationWarning")

# Tries a lock once and leaves at once, as a holder that crashed: a lease taken stays.
TRY_ONCE = """
import os, sys
import dlock
client = dlock.connect(sys.argv[1])
lock = client.lock(sys.argv[2], ttl=float(sys.argv[3]))
try:
    print(lock.acquire(timeout=0), lock.fencing_token, flush=True)
except dlock.BackendError as exc:
    print(type(exc).__name__, exc, flush=True)
os._exit(0)
"""


def _try_once(url: str, name: str, ttl: float = 60, prefix: Sequence[str] = ()) -> str:
    done = subprocess.run(
        [*prefix, sys.executable, "-c", TRY_ONCE, url, name, str(ttl)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-1000:]
    return done.stdout.strip()


@FORKS
def test_a_forked_child_does_not_share_its_parents_sqlite_state(tmp_path: Path) -> None:
    """A forked child of a process that had used the client (a pre-fork server's
    worker) went on with the parent's SQLite connection; and a connection of its own,
    opened while the parent's was open, found SQLite's record of the parent's file
    locks in the memory it inherited, so it took none (fcntl locks are not inherited).
    The parent's close, holding the only locks on the file, then checkpointed and
    deleted the WAL that the child went on writing to: another process got a lock the
    child held, with the same fencing token, and the child was never told."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    client = dlock.connect(url)
    with client.lock("warmup", ttl=30):
        pass
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(go_w)
            os.close(done_r)
            first = client.lock("first", ttl=60)
            code = 0 if first.acquire(timeout=0) else 2
            os.write(done_w, b"x")
            os.read(go_r, 1)  # until the parent has closed its client
            job = client.lock("job", ttl=60)
            code = code or (0 if job.acquire(timeout=0) else 2)
            os.write(done_w, b"x")
            os.read(go_r, 1)  # until the other process has tried
            if not (first.owned() and job.owned()):
                code = code or 3
            first.release()
            job.release()
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(done_w)
    try:
        os.read(done_r, 1)
        client.close()
        os.write(go_w, b"x")
        os.read(done_r, 1)
        other = [_try_once(url, name) for name in ("first", "job")]
        os.write(go_w, b"x")
    finally:
        os.close(go_w)
        os.close(done_r)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "2: not acquired, 3: not owned"
    assert other == ["False None"] * 2, "another process got a lock the child held"


# Holds the file's write lock for argv[2] seconds.
HOLD_WRITE_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


@FORKS
def test_a_child_forked_during_a_statement_does_not_wait_for_it_for_ever(
    tmp_path: Path,
) -> None:
    """Another thread ran a statement on the client's connection as the process
    forked: the child got the mutex that guards the connection held, by a thread that
    is not in the child, and its first acquire (even with timeout=0) hung for ever."""
    path = tmp_path / "locks.sqlite3"
    with dlock.connect(f"sqlite://{path}") as client:
        client.inspect("x")  # creates the file
        blocker = subprocess.Popen(
            [sys.executable, "-c", HOLD_WRITE_LOCK, str(path), "1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert blocker.stdout is not None and blocker.stdout.readline() == "locked\n"
        # A write: it waits for the write lock, its statement in flight, mutex held.
        writer = threading.Thread(target=client.force_release, args=("x",))
        writer.start()
        time.sleep(0.3)
        child = os.fork()
        if child == 0:
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(10)  # a hang ends the child
                code = 0 if client.lock("in-child", ttl=5).acquire(timeout=0) else 2
            finally:
                os._exit(code)
        try:
            _, status = os.waitpid(child, 0)
        finally:
            writer.join()
            blocker.communicate(timeout=10)
        assert not os.WIFSIGNALED(status), "the child hung"
        assert os.waitstatus_to_exitcode(status) == 0


def _runs(command: Sequence[str]) -> None:
    """Skip unless this host lets us run ``command`` (namespaces may need root)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"cannot run {command[0]}: {exc}")
    if done.returncode != 0:
        pytest.skip(f"{' '.join(command)} is refused here: {done.stderr.strip()[-300:]}")


def test_leases_are_timed_by_the_hosts_boot_clock_in_a_time_namespace(tmp_path: Path) -> None:
    """A time namespace (``unshare --time``, as CRIU-restored containers use) offsets
    CLOCK_BOOTTIME. Timed by that clock, a process there saw a live lease as expired
    long ago and took it over, and its own leases looked days long to everyone else."""
    ahead = ["unshare", "--time", "--boottime", "1000000"]
    _runs([*ahead, "true"])
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        held = client.lock("job", ttl=60)
        assert held.acquire(timeout=0)
        assert _try_once(url, "job", prefix=ahead) == "False None", "a live lease taken over"
        granted, token = _try_once(url, "crashed", ttl=5, prefix=ahead).split()
        assert granted == "True" and int(token) > 0, (granted, token)
        info = client.inspect("crashed")
        assert info is not None and info.expires_in is not None, info
        assert 0 < info.expires_in <= 5, info
        assert held.owned()
        held.release()


def test_a_process_that_cannot_read_the_boot_id_is_refused(tmp_path: Path) -> None:
    """Leases are tagged with the host's boot id: one of another boot is dead. A process
    that could not read it (no /proc: a chroot, a sandbox) timed its leases by the wall
    clock with no boot id, so every other process's lease looked dead to it: it took a
    live lease over. It must refuse instead, saying why."""
    empty = tmp_path / "empty"
    empty.touch()
    hidden = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"']
    hidden += [str(empty), "/proc/sys/kernel/random/boot_id"]
    _runs([*hidden, "true"])
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as client:
        held = client.lock("job", ttl=60)
        assert held.acquire(timeout=0)
        answer = _try_once(url, "job", prefix=hidden)
        assert answer.startswith("BackendError") and "boot id" in answer, answer
        assert held.owned()
        held.release()


# A signal handler that forks a worker (as a pre-fork server's SIGCHLD or SIGHUP handler
# may) runs in the main thread at whatever it interrupted; another process holds the
# file's write lock for a second, so that the statement waits for it meanwhile.
FORK_IN_A_SIGNAL_HANDLER = """
import faulthandler, os, signal, subprocess, sys, threading
import dlock

faulthandler.dump_traceback_later(20, exit=True)  # a hang ends, showing where it hung
path, hold_write_lock, scenario = sys.argv[1:]
client = dlock.connect("sqlite://" + path)
client.inspect("x")  # creates the file
children = []


def say(*words):
    os.write(1, " ".join(map(str, words)).encode() + b"\\n")  # a line in one write


def fork_a_worker(signum, frame):
    child = os.fork()
    if child == 0:  # the worker tries the client, then a new one, and never returns
        try:
            outcomes = []
            for user in (client, dlock.connect("sqlite://" + path)):
                try:
                    lock = user.lock(f"worker-{os.getpid()}", ttl=5)
                    outcomes.append("acquired" if lock.acquire(timeout=0) else "busy")
                    lock.release()
                except dlock.BackendError as exc:
                    outcomes.append(f"{type(exc).__name__} {exc}")
            say("worker:", " | ".join(outcomes))
        finally:
            os._exit(0)
    children.append(child)


signal.signal(signal.SIGUSR1, fork_a_worker)
blocker = subprocess.Popen(
    [sys.executable, "-c", hold_write_lock, path, "1"], stdout=subprocess.PIPE, text=True
)
assert blocker.stdout.readline() == "locked\\n"
main = threading.get_ident()
signals = [0.3] if scenario == "in-statement" else [0.2, 0.4]
for delay in signals:
    threading.Timer(delay, signal.pthread_kill, (main, signal.SIGUSR1)).start()
if scenario == "in-statement":
    # The signal is handled as the statement, which waited for the write lock, returns.
    lock = client.lock("job", ttl=30)
    say("acquired", lock.acquire(timeout=10))
    lock.release()
else:
    # Another thread's statement waits for the write lock: the fork waits for it in
    # turn, and the second signal forks again from inside the first fork.
    other = threading.Thread(target=client.force_release, args=("x",))
    other.start()
    other.join()
blocker.wait()
again = client.lock("job", ttl=30)
say("again", again.acquire(timeout=0))
again.release()
client.close()
say("workers", [os.waitstatus_to_exitcode(os.waitpid(c, 0)[1]) for c in children])
"""


def _fork_in_a_signal_handler(tmp_path: Path, scenario: str) -> list[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FORK_IN_A_SIGNAL_HANDLER,
            str(tmp_path / "locks.sqlite3"),
            HOLD_WRITE_LOCK,
            scenario,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout.splitlines()


def test_a_fork_in_a_signal_handler_during_a_statement_does_not_hang(tmp_path: Path) -> None:
    """A signal handler forked while its own thread was inside a SQLite statement, the
    connection's mutex held: the before-fork hook waited for that mutex for ever. The
    connection cannot be closed before such a fork, so the child must refuse it, and the
    file (SQLite's file locks are not inherited, and a new connection of the child's would
    take none either); the parent goes on."""
    lines = _fork_in_a_signal_handler(tmp_path, "in-statement")
    worker = [line for line in lines if line.startswith("worker: ")]
    assert len(worker) == 1, lines
    outcomes = worker[0].removeprefix("worker: ").split(" | ")
    assert [outcome.split()[0] for outcome in outcomes] == ["BackendError"] * 2, lines
    assert "signal handler" in outcomes[0] and "fork" in outcomes[0], lines
    rest = [line for line in lines if line not in worker]
    assert rest == ["acquired True", "again True", "workers [0]"], lines


def test_a_fork_in_a_signal_handler_during_a_fork_does_not_hang(tmp_path: Path) -> None:
    """A second signal forked from inside the before-fork hook of the first one, as it
    waited for another thread's statement: the nested hook waited for ever for the lock
    that the outer one held. Both workers may use the client: nothing was in use on the
    forking thread."""
    lines = _fork_in_a_signal_handler(tmp_path, "nested")
    assert sorted(lines) == ["again True", *["worker: acquired | acquired"] * 2, "workers [0, 0]"]


# Unshares a time namespace for its children, which sets their boot clock a day ahead,
# and tries a lock; its own clock, and namespace, do not change.
UNSHARE_TIME_FOR_CHILDREN = """
import ctypes, os, sys
import dlock

client = dlock.connect(sys.argv[1])
if sys.argv[2] == "used-before":
    client.inspect("job")  # reads the clock, and its offset, before unsharing
libc = ctypes.CDLL(None, use_errno=True)
try:
    if libc.unshare(0x80) != 0:  # CLONE_NEWTIME
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    with open("/proc/self/timens_offsets", "w") as f:
        f.write("boottime 86400 0")
except OSError as exc:
    print("cannot unshare a time namespace:", exc, flush=True)
    os._exit(0)
lock = client.lock("job", ttl=60)
try:
    print(lock.acquire(timeout=0), lock.fencing_token, flush=True)
except dlock.BackendError as exc:
    print(type(exc).__name__, exc, flush=True)
os._exit(0)  # as a holder that crashed: a lease taken stays
"""


def _unshare_time_for_children(url: str, when: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", UNSHARE_TIME_FOR_CHILDREN, url, when],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-1000:]
    answer = done.stdout.strip()
    if answer.startswith("cannot unshare"):
        pytest.skip(answer)
    return answer


def test_a_process_that_unshared_a_time_namespace_for_its_children_is_refused(
    tmp_path: Path,
) -> None:
    """/proc/self/timens_offsets shows the offsets of the namespace the process's
    children get, its own unless it unshared one for them (as ``unshare --time`` does
    before it forks). Such a process subtracted its children's offset from its own,
    unchanged, clock: its 60 s lease was dated a day early, dead to everyone else, who
    took it over. It cannot learn its own offset, so it must refuse. Having read its
    clock before it unshared, it keeps the right one."""
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    answer = _unshare_time_for_children(url, "fresh")
    assert answer.startswith("BackendError") and "time namespace" in answer, answer
    granted, token = _unshare_time_for_children(url, "used-before").split()
    assert granted == "True" and int(token) > 0, (granted, token)
    with dlock.connect(url) as client:
        info = client.inspect("job")
        assert info is not None and info.expires_in is not None, info
        assert 50 < info.expires_in <= 60, info
        assert not client.lock("job", ttl=5).acquire(timeout=0), "a live lease taken over"


def _in_a_child_forked_without_hooks(client: dlock.Client, fork_first: bool = False) -> str:
    """Try ``client`` in a child forked as uWSGI forks its workers, from C without
    Python's at-fork hooks (``ctypes.PyDLL(None).fork()``); what it answered. With
    ``fork_first``, the child first forks (and reaps) a child of its own."""

    def try_the_lock() -> str:
        if fork_first:
            grandchild = os.fork()
            if grandchild == 0:
                os._exit(0)
            os.waitpid(grandchild, 0)
        lock = client.lock("job", ttl=5)
        answer = f"acquired {lock.acquire(timeout=0)}"
        lock.release()
        return answer

    return answer_in_a_child(try_the_lock, fork=ctypes.PyDLL(None).fork)


def test_a_child_forked_without_pythons_hooks_refuses_an_inherited_connection(
    tmp_path: Path,
) -> None:
    """uWSGI forks its workers from C without Python's at-fork hooks (its default), so
    nothing closes the parent's SQLite connection first: a worker using the file would
    hold no lock (SQLite's record of the parent's is copied, the locks are not). It must
    refuse, with a hint; a worker whose parent had no connection open is fine.
    ``ctypes.PyDLL(None).fork()`` forks that way."""
    in_a_fresh_interpreter(refuses_an_inherited_connection, tmp_path)


def refuses_an_inherited_connection(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/locks.sqlite3"
    with dlock.connect(url) as unused:
        answer = _in_a_child_forked_without_hooks(unused)
        assert answer == "acquired True", answer
    with dlock.connect(url) as used:
        assert used.inspect("job") is None  # its connection is open from now on
        answer = _in_a_child_forked_without_hooks(used)
        assert answer.startswith("BackendError") and "--py-call-osafterfork" in answer, answer
        assert used.lock("job", ttl=5).acquire(timeout=0)


@contextlib.contextmanager
def a_thread_opening_the_file(client: dlock.Client) -> Iterator[None]:
    """A thread of this process holds ``client``'s SQLite mutex, as while it opens the
    connection."""
    backend = client._backend
    assert isinstance(backend, SQLiteBackend)
    held, done = threading.Event(), threading.Event()

    def open_the_file() -> None:
        with backend._mutex:
            held.set()
            done.wait()

    thread = threading.Thread(target=open_the_file)
    thread.start()
    held.wait()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_a_child_forked_without_hooks_while_a_thread_opens_the_file_refuses(
    tmp_path: Path,
) -> None:
    """A thread of the parent opening the connection holds the backend's mutex, and a
    child forked without Python's hooks gets it held by a thread it does not have: its
    first statement waited for ever. It refuses, as when the connection was open."""
    in_a_fresh_interpreter(refuses_while_a_thread_opens_the_file, tmp_path)


def refuses_while_a_thread_opens_the_file(tmp_path: Path) -> None:
    with (
        dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as opening,
        a_thread_opening_the_file(opening),
    ):
        answer = _in_a_child_forked_without_hooks(opening)
    assert answer.startswith("BackendError"), f"the child answered {answer!r}"
    assert "--py-call-osafterfork" in answer, answer


def test_a_child_forked_without_hooks_can_fork_before_it_uses_dlock(tmp_path: Path) -> None:
    """Such a child's own ``os.fork()`` ran the hook that closes every connection first,
    taking each backend's mutex: it waited for ever for the one a thread that is not
    there held (and would have closed connections that are the parent's)."""
    in_a_fresh_interpreter(forks_before_it_uses_dlock, tmp_path)


def forks_before_it_uses_dlock(tmp_path: Path) -> None:
    with (
        dlock.connect(f"sqlite://{tmp_path}/locks.sqlite3") as opening,
        a_thread_opening_the_file(opening),
    ):
        answer = _in_a_child_forked_without_hooks(opening, fork_first=True)
    assert answer.startswith("BackendError"), f"the child answered {answer!r}"


def test_a_child_forked_without_hooks_refuses_sqlite_whichever_face_had_it_open(
    tmp_path: Path,
) -> None:
    """SQLite's record of a file's locks is one per process, shared by the connections
    of both faces: a child forked without Python's hooks while its parent's asyncio
    client had a connection open would hold no lock on a new connection of a sync client
    either. Each face kept a set of its own backends, so the sync face saw none open and
    went ahead."""
    in_a_fresh_interpreter(refuses_whichever_face_had_it_open, tmp_path)


def refuses_whichever_face_had_it_open(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/locks.sqlite3"

    async def main() -> None:
        async with dlock.aio.connect(url) as used:
            assert await used.inspect("job") is None  # its connection is open from now on
            with dlock.connect(url) as unused:
                answer = _in_a_child_forked_without_hooks(unused)
                assert answer.startswith("BackendError"), answer
                assert "--py-call-osafterfork" in answer, answer
                assert unused.lock("job", ttl=5).acquire(timeout=0)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_lock_file_deleted_or_replaced_while_held_is_a_loss(tmp_path: Path, how: str) -> None:
    """The file at the path is the one every process that opens it now uses. A holder
    whose connection stayed on the file deleted (a clean-up) or replaced (``mv``) went
    on renewing there, unseen by anyone, while another process took the lock in the
    new file: two holders, each told it held the lock for as long as it liked."""
    path = tmp_path / "locks.db"
    url = f"sqlite://{path}"
    with dlock.connect(url) as first, dlock.connect(url) as second:
        held = first.lock("x", ttl=30, auto_renew=False)
        assert held.acquire(timeout=0)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        if how == "replaced":
            fresh = tmp_path / "fresh.db"
            with dlock.connect(f"sqlite://{fresh}") as maker:
                maker.inspect("x")  # creates the file and its table
            sqlite3.connect(fresh).close()  # the last close folds the WAL into the file
            fresh.replace(path)
        other = second.lock("x", ttl=30)
        assert other.acquire(timeout=0), "the file now at the path is free"
        assert (other.fencing_token or 0) > (held.fencing_token or 0), "a token fell"
        with pytest.raises(dlock.LockLost):
            held.extend()
        assert not held.owned()
        # The first client's acquires go to the new file too, where the lock is taken.
        assert first.lock("x", ttl=30).acquire(timeout=0) is False
        other.release()


def test_a_lock_file_deleted_alone_while_open_elsewhere_is_unavailable_until_closed(
    tmp_path: Path,
) -> None:
    """The file deleted without its -wal and -shm, which another process has open: SQLite
    finds those by path, and a new file at the path cannot be used through them ("disk
    I/O error") until that process closes the old one. That said BackendError, the class
    for what waiting does not mend (`dlock run` exited 76, a chaos helper's run):
    BackendUnavailable now, with the likely cause, and the file is usable once the
    other process has closed it."""
    path = tmp_path / "locks.db"
    url = f"sqlite://{path}"
    script = (
        "import dlock, sys, time\n"
        "client = dlock.connect(sys.argv[1])\n"
        "client.inspect('x')\n"
        "print('open', flush=True)\n"
        "time.sleep(60)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True, cwd=ROOT
    ) as other:
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "open"
            path.unlink()
            with (
                dlock.connect(url) as client,
                pytest.raises(dlock.BackendUnavailable, match="deleted or replaced"),
            ):
                client.lock("x", ttl=5).acquire(timeout=0)
        finally:
            other.kill()
    with dlock.connect(url) as client:
        assert client.lock("x", ttl=5).acquire(timeout=0)


def test_a_token_is_read_from_the_clock_once_the_write_lock_is_had(tmp_path: Path) -> None:
    """A grant's token starts from the clock as the grant is made, not as the call
    began: read before a wait of up to busy_timeout for the file's write lock, it lagged
    by that wait, and a grant made in a lock file swapped in meanwhile could get a
    smaller token than one made in the old file during the wait."""
    path = tmp_path / "locks.db"
    with dlock.connect(f"sqlite://{path}") as client:
        _token(client, "warm-up")  # the file and its table exist
        blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")  # the write lock, for a second
        freed_at: list[int] = []

        def free_later() -> None:
            time.sleep(1.0)
            freed_at.append(time.time_ns() // 1000)
            blocker.execute("COMMIT")

        thread = threading.Thread(target=free_later)
        thread.start()
        token = _token(client, "x")
        thread.join()
        blocker.close()
    # SQLite's clock counts whole milliseconds.
    assert token >= freed_at[0] - 2000, (token, freed_at)


def test_tokens_keep_increasing_in_a_lock_file_restored_from_a_copy(tmp_path: Path) -> None:
    """A lock file put back from a backup holds older counters than the tokens handed
    out since; a holder cut off by the restore still writes with its token, so the next
    grant must carry a larger one (each name's counter started at 1 in a new file, and
    counted on from the copy's)."""
    path, copy = tmp_path / "locks.db", tmp_path / "backup.db"
    url = f"sqlite://{path}"
    with dlock.connect(url) as client:
        _token(client, "x")
        source, target = sqlite3.connect(path), sqlite3.connect(copy)
        source.backup(target)
        target.close()
        source.close()
        tokens = [_token(client, "x") for _ in range(3)]
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    copy.replace(path)
    with dlock.connect(url) as client:
        assert _token(client, "x") > max(tokens)


@FORKS
@contextlib.contextmanager
def _immutable(directory: Path) -> Iterator[None]:
    """``directory`` that nobody may create files in, root included (tests run as root,
    whom permission bits do not stop)."""
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not allowed here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_a_directory_that_is_not_writable_is_named_in_the_refusal(tmp_path: Path) -> None:
    """A writable lock file in a directory nobody may write to: SQLite says only "unable
    to open database file", and a user checks the file's permissions in vain. The -wal
    and -shm files are made beside it, so the refusal names the directory."""
    directory = tmp_path / "locks"
    directory.mkdir()
    # Four slashes, as SQLAlchemy spells an absolute path: the same file, said plainly.
    url = f"sqlite:///{directory}/locks.db"
    with dlock.connect(url) as client, client.lock("x", ttl=5):
        pass
    assert sorted(os.listdir(directory)) == ["locks.db"]
    with (
        _immutable(directory),
        dlock.connect(url) as client,
        pytest.raises(dlock.BackendError) as refused,
    ):
        client.lock("x", ttl=5).acquire(timeout=0)
    assert not isinstance(refused.value, dlock.BackendUnavailable), refused.value
    message = str(refused.value)
    assert f"'{directory}/locks.db'" in message
    assert f"the directory '{directory}' is not writable" in message


def test_a_relative_path_names_the_file_of_the_directory_the_client_was_made_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite:locks.db`` was opened against the working directory of each open: a
    process that changed directory (a daemon's ``chdir("/")``) and then forked reopened,
    parent and child, another file than the one its holds were in. The child took a
    lock the parent held, and the parent's renewal found its lease gone."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(first)
    with dlock.connect("sqlite:locks.db") as client:
        held = client.lock("x", ttl=30, auto_renew=False)
        assert held.acquire(timeout=0)
        monkeypatch.chdir(elsewhere)
        answer = answer_in_a_child(lambda: str(client.lock("x", ttl=30).acquire(timeout=0)))
        assert answer == "False", "the child took the lock its parent holds"
        held.extend()
        held.release()
    assert not (elsewhere / "locks.db").exists()


def test_a_table_named_by_a_keyword_is_no_longer_a_syntax_error(tmp_path: Path) -> None:
    """``?table=`` takes any plain identifier, as on the server backends (which quote
    it): ``order`` failed every statement with a syntax error, a ``BackendError``. A
    name SQLite keeps for itself (``sqlite_...``) is refused as configuration."""
    path = tmp_path / "keywords.db"
    for table in ("order", "group", "Select"):
        with dlock.connect(f"sqlite://{path}?table={table}") as client:
            with client.lock("x", ttl=5) as lock:
                info = client.inspect("x")
                assert info is not None and info.fencing_token == lock.fencing_token
            assert client.prune(600) == 0
    with pytest.raises(dlock.ConfigurationError, match="sqlite_"):
        dlock.connect(f"sqlite://{path}?table=SQLite_locks")


def test_a_busy_timeout_past_32_bit_milliseconds_is_refused_not_zero(tmp_path: Path) -> None:
    """SQLite takes the busy timeout as an int of milliseconds: past about 24.8 days it
    wrapped round to none at all, and every write that met another fails at once as
    "database is locked for busy_timeout=1e+09 s". Refused past the longest of the other
    SQL backends; the longest accepted still waits."""
    path = tmp_path / "busy.db"
    with pytest.raises(dlock.ConfigurationError, match="busy_timeout is '1e9' seconds"):
        dlock.connect(f"sqlite://{path}?busy_timeout=1e9")
    with pytest.raises(dlock.ConfigurationError, match="busy_timeout is 3000000 seconds"):
        dlock.connect(f"sqlite://{path}", busy_timeout=3_000_000)
    with dlock.connect(f"sqlite://{path}", busy_timeout=1e6) as client:
        client.inspect("x")  # creates the file and its table
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        timer = threading.Timer(0.3, other.execute, ["ROLLBACK"])
        timer.start()
        try:
            assert client.lock("x", ttl=5).acquire(timeout=0), "waited for the write lock"
        finally:
            timer.join()
            other.close()


def test_a_relative_path_from_a_deleted_directory_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A relative path is resolved against the working directory as the client is made:
    one that was deleted has no path, and the FileNotFoundError escaped, a traceback
    out of ``dlock`` with status 1, which ``dlock run`` uses for "lock busy"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(dlock.ConfigurationError, match="working directory"):
        dlock.connect("sqlite:locks.db")


def test_a_give_back_waits_for_the_acquire_it_gives_back(tmp_path: Path) -> None:
    """An asyncio acquire cancelled while its SQLite statement runs in a worker thread:
    the thread goes on, and the give-back of what it may take ran at once, before the
    thread's grant was committed: it released nothing, and the grant then held the lock
    for its whole TTL (1 of 3 runs of a helper's script; every run here, the thread held
    up). The give-back now comes after the call it gives back."""
    client = dlock.aio.connect(f"sqlite://{tmp_path}/locks.sqlite3")
    backend: Any = client._backend
    blocking_acquire = backend._acquire

    def slow_acquire(*args: Any) -> Any:
        time.sleep(0.3)
        return blocking_acquire(*args)

    async def main() -> None:
        try:
            assert await client.inspect("job") is None  # connected
            backend._acquire = slow_acquire
            lock = client.lock("job", ttl=30)
            attempt = asyncio.create_task(lock.acquire(timeout=0))
            await asyncio.sleep(0.05)  # the statement runs in its thread
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
            await asyncio.wait(client._give_backs)
            await asyncio.sleep(0.5)  # the cut-off statement's thread has ended
            assert await client.inspect("job") is None, "the cut-off grant was not given back"
        finally:
            await client.aclose()

    asyncio.run(main())


def test_the_give_back_retrier_leaves_the_random_module_alone(tmp_path: Path) -> None:
    """A give-back asked again drew its jitter from the random module, the
    application's generator: seeded for a reproducible job, that job drew other numbers
    after an outage, and workers seeded alike asked again in lockstep. The jitter is
    the operating system's, as Backoff's is."""
    path = tmp_path / "locks.sqlite3"
    with dlock.connect(f"sqlite://{path}?busy_timeout=0.1") as client:
        lock = client.lock("job", ttl=30)
        lock.acquire()
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")  # the file write-locked: the release fails
            random.seed(7)
            before = random.getstate()
            with pytest.raises(dlock.BackendUnavailable):
                lock.release()
            time.sleep(0.5)  # the retrier has drawn its first delays
            assert random.getstate() == before
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        deadline = time.monotonic() + 10
        while client.inspect("job") is not None:  # given back once the file is free
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.parametrize("holder", ["[]", '"host"', '{"host": "h", "pid": 1e999}'])
def test_a_holder_that_is_no_object_or_has_no_integer_pid_names_an_unknown_holder(
    tmp_path: Path, holder: str
) -> None:
    """The holder column is text any program with the file can write: JSON that is no
    object (``[]``), or a pid past any integer (``1e999``), failed ``inspect`` and
    ``list`` with an AttributeError or OverflowError, where other unreadable holders
    name an unknown one."""
    path = tmp_path / "locks.sqlite3"
    with dlock.connect(f"sqlite://{path}") as client, client.lock("job", ttl=30):
        with contextlib.closing(sqlite3.connect(path)) as other, other:
            other.execute("UPDATE dlock_locks SET holder = ?", (holder,))
        info = client.inspect("job")
        assert info is not None and info.holder == dlock.Holder(host="?", pid=0)
        assert [listed.holder for listed in client.list()] == [info.holder]
