"""The real ``dlock`` command, run in subprocesses against the embedded SQLite backend
(status, list and force release: against every backend)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pty
import pwd
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
import redis

import dlock
from dlock._job import FORWARDED_SIGNALS
from dlock._redis_scripts import INSPECT, RELEASE, Script
from tests.servers import free_port
from tests.servers.redis import RedisServer

DLOCK = str(Path(sys.executable).with_name("dlock"))


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/cli.sqlite3"


Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``subprocess.Popen(argv, text=True, **options)``, each process left running when
    the test ends (as when it fails) killed with what it started: every process group
    among them other than pytest's (dlock's own, if it has one, and its command's),
    and the processes in pytest's one by one. Left behind, a dlock and its command slept
    on, and the Popen's ResourceWarning failed a later test."""
    processes: list[subprocess.Popen[str]] = []

    def start(argv: list[str], **options: Any) -> subprocess.Popen[str]:
        process = subprocess.Popen(argv, text=True, **options)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            kill_tree(process.pid)
            process.wait(10)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and its descendants, a whole process group at a time, except
    pytest's own. The tree is read first: once ``root`` is gone its children are
    another parent's."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree, index = [root], 0
    while index < len(tree):
        tree += [pid for pid, parent in parents.items() if parent == tree[index]]
        index += 1
    ours = os.getpgrp()
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(pid)
            if group == ours:
                os.kill(pid, signal.SIGKILL)
            else:
                os.killpg(group, signal.SIGKILL)


def dlock_cmd(
    db: str,
    *args: str,
    timeout: float = 30,
    env: dict[str, str] | None = None,
    stdout_to: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``dlock ARGS``, its output captured (or its stdout sent to ``stdout_to``)."""
    with contextlib.ExitStack() as stack:
        stdout = subprocess.PIPE if stdout_to is None else stack.enter_context(open(stdout_to, "w"))
        return subprocess.run(
            [DLOCK, *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            env={**(os.environ if env is None else env), "DLOCK_URL": db},
        )


def test_run_passes_name_token_and_exit_status(db: str, name: str) -> None:
    """DLOCK_TTL is written as given: a whole number of seconds without ".0", which
    shell arithmetic (``$((DLOCK_TTL - 5))``) refused."""
    script = 'echo "$DLOCK_NAME $DLOCK_FENCING_TOKEN $DLOCK_TTL"; exit 3'
    first = dlock_cmd(db, "run", "--ttl", "7", name, "--", "sh", "-c", script)
    assert first.returncode == 3, first.stderr
    shown_name, token, ttl = first.stdout.split()
    assert (shown_name, ttl) == (name, "7") and int(token) > 0, first.stdout
    second = dlock_cmd(db, "run", name, "--", "sh", "-c", script)
    assert int(second.stdout.split()[1]) > int(token), "each run is a new acquisition"
    assert second.stdout.split()[2] == "30", "the default TTL"
    third = dlock_cmd(db, "run", "--ttl", "2.5", name, "--", "sh", "-c", script)
    assert third.stdout.split()[2] == "2.5"
    with dlock.connect(db) as client:
        assert client.inspect(name) is None, "the lock is released when the command ends"


def test_everything_after_the_separator_is_the_command(db: str, name: str, tmp_path: Path) -> None:
    """argparse drops the ``--`` after NAME, so ``NAME -- -tool`` was refused as an
    option after NAME, and ``NAME -- -- cmd`` ran ``cmd``: the command is everything
    after the separator, as with env(1) and flock(1)."""
    tool = tmp_path / "-tool"
    tool.write_text('#!/bin/sh\necho "ran $*"\n')
    tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    dashed = dlock_cmd(db, "run", name, "--", "-tool", "--", "-x", env=env)
    assert (dashed.returncode, dashed.stdout) == (0, "ran -- -x\n"), dashed.stderr
    doubled = dlock_cmd(db, "run", name, "--", "--", "true")
    assert doubled.returncode == 127 and "cannot run '--'" in doubled.stderr, doubled.stderr


def test_conflict_exit_code_and_wait(db: str, name: str) -> None:
    with dlock.connect(db, label="blocker") as client, client.lock(name, ttl=30):
        result = dlock_cmd(db, "run", "-n", name, "--", "true")
        assert result.returncode == 1
        assert "held by someone else" in result.stderr and "blocker" in result.stderr
        assert dlock_cmd(db, "run", "-n", "-E", "42", name, "--", "true").returncode == 42
        for wait in ("-w", "--timeout"):  # --timeout: flock's name, which users type
            start = time.monotonic()
            assert dlock_cmd(db, "run", wait, "0.5", name, "--", "true").returncode == 1
            assert 0.5 <= time.monotonic() - start < 5


def announced_wait(process: subprocess.Popen[str]) -> str:
    """The line ``dlock run -v`` writes to stderr once its first try has found the lock
    held, as it starts to wait. (Read blocking: a dlock that does not write it ends, by
    its -w at the latest, and the read with it.)"""
    assert process.stderr is not None
    return process.stderr.readline()


def test_run_waits_for_the_lock(db: str, name: str, spawn: Spawn) -> None:
    """``dlock run`` waits while the lock is held and runs the command once it is free;
    with -v it says on stderr that it waits, and for whom, then how long it took."""
    with dlock.connect(db) as client:
        lock = client.lock(name, ttl=30)
        lock.acquire()
        process = spawn(
            [DLOCK, "run", "-v", "-w", "10", name, "--", "sh", "-c", "echo ran"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "DLOCK_URL": db},
        )
        holder = rf"\S+ pid {os.getpid()}, fencing token {lock.fencing_token}"
        waiting = rf"dlock: {re.escape(repr(name))} is held by someone else: {holder}; waiting"
        line = announced_wait(process)
        assert re.fullmatch(rf"{waiting} \(at most 10 s\)\n", line), line
        assert process.poll() is None, "must wait while the lock is held"
        lock.release()
        stdout, stderr = process.communicate(timeout=10)
        assert process.returncode == 0 and stdout.strip() == "ran", stderr
        acquired = rf"dlock: acquired {re.escape(repr(name))} after \d+\.\d{{3}} s of waiting\n"
        assert re.fullmatch(acquired, stderr), stderr


def test_verbose_repeats_the_wait_as_typed(db: str, name: str) -> None:
    """``-v`` names the bound of the wait as ``-w`` had it, as the error messages do:
    it said "at most 0.123457 s" for 0.1234567 (and "1.23457e+06 s" for 1234567)."""
    with dlock.connect(db) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        busy = dlock_cmd(db, "run", "-v", "-w", "0.1234567", name, "--", "true")
        assert busy.returncode == 1, busy.stderr
        assert "; waiting (at most 0.1234567 s)\n" in busy.stderr, busy.stderr


def test_verbose_names_the_holder_once_when_the_wait_runs_out(
    db: str, name: str, spawn: Spawn
) -> None:
    """``-v -w`` that did not get the lock named its holder twice, as it began to wait
    and again as it gave up. The last line says what is new: how long the wait took,
    and the holder only if another has the lock by then."""
    with dlock.connect(db, label="blocker") as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        info = client.inspect(name)
        assert info is not None
        holder = (
            f"{info.holder.host} pid {os.getpid()} (blocker), fencing token {info.fencing_token}"
        )
        waiting = f"dlock: {name!r} is held by someone else: {holder}; waiting (at most %s s)\n"
        gave_up = rf"dlock: did not acquire {re.escape(repr(name))} after \d+\.\d{{3}} s of waiting"
        same = dlock_cmd(db, "run", "-v", "-w", "0.5", name, "--", "true")
        assert same.returncode == 1, same.stderr
        assert re.fullmatch(re.escape(waiting % "0.5") + gave_up + "\n", same.stderr), same.stderr
        # Another holder has it as the wait ends: its row rewritten once the wait began,
        # as one that took the lock in between would have left it.
        process = spawn(
            [DLOCK, "run", "-v", "-w", "5", name, "--", "true"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "DLOCK_URL": db},
        )
        assert announced_wait(process) == waiting % "5"
        other = {"host": "elsewhere", "pid": 4321, "label": "second"}
        with sqlite3.connect(db.removeprefix("sqlite://")) as conn:
            conn.execute(
                "UPDATE dlock_locks SET holder = ?, fence = fence + 1 WHERE name = ?",
                (json.dumps(other), name.encode()),
            )
        conn.close()
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 1, stderr
        now = f"elsewhere pid 4321 (second), fencing token {info.fencing_token + 1}"
        assert re.fullmatch(
            gave_up + re.escape(f"; now held by someone else: {now}") + "\n", stderr
        ), stderr
        with contextlib.suppress(dlock.LockLost):  # its token is no longer the row's
            lock.release()


def resp_command(buffer: bytes) -> tuple[list[bytes], int] | None:
    """The first command of a client's RESP stream (an array of bulk strings): its
    arguments and its length in bytes, or None if it has not all come yet."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None
    assert buffer[:1] == b"*", buffer[:80]
    position, arguments = end + 2, []
    for _ in range(int(buffer[1:end])):
        end = buffer.find(b"\r\n", position)
        if end < 0:
            return None
        start = end + 2
        stop = start + int(buffer[position + 1 : end])
        if len(buffer) < stop + 2:
            return None
        arguments.append(buffer[start:stop])
        position = stop + 2
    return arguments, position


@contextlib.contextmanager
def refusing_script(server: RedisServer, script: Script) -> Iterator[str]:
    """A Redis URL through a proxy that answers ``script`` (EVALSHA or EVAL) with an
    error reply and passes everything else on: a server that fails that query alone."""
    with script_proxy(server, script, lambda: b"-ERR refused by the test's proxy\r\n") as url:
        yield url


@contextlib.contextmanager
def script_proxy(
    server: RedisServer, script: Script, on_script: Callable[[], bytes | None]
) -> Iterator[str]:
    """A Redis URL through a proxy that calls ``on_script`` when a client sends
    ``script`` (EVALSHA or EVAL): its reply goes back instead of the server's, or, if
    None, the call goes on to the server once ``on_script`` has returned."""
    scripted = {script.sha.encode(), script.source.encode()}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()
    sockets: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def start(target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        threads.append(thread)
        thread.start()

    def answer(upstream: socket.socket, client: socket.socket, sending: threading.Lock) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                with sending:
                    client.sendall(data)

    def serve(client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", server.port))
        sockets.append(upstream)
        sending = threading.Lock()
        start(answer, upstream, client, sending)
        buffer = b""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                buffer += data
                while (command := resp_command(buffer)) is not None:
                    arguments, size = command
                    reply = None
                    if arguments[0].upper() in (b"EVAL", b"EVALSHA") and arguments[1] in scripted:
                        reply = on_script()
                    if reply is not None:
                        with sending:
                            client.sendall(reply)
                    else:
                        upstream.sendall(buffer[:size])
                    buffer = buffer[size:]

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                client, _ = listener.accept()
                client.settimeout(None)
                sockets.append(client)
                start(serve, client)

    start(accept)
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        done.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(10)
        for sock in [listener, *sockets]:
            sock.close()


def test_a_backend_that_cannot_name_the_holder_changes_no_run(
    redis_server: RedisServer, name: str, spawn: Spawn
) -> None:
    """``-v`` adds output alone: when the backend fails to say who holds the lock (here
    a proxy refuses Redis's inspect script, and nothing else), dlock says that it waits,
    naming nobody, and goes on; a run that does not get the lock exits with the
    conflict code. That failure ended either run with status 76."""
    direct = f"redis://{redis_server.address}/0"
    with refusing_script(redis_server, INSPECT) as proxied, dlock.connect(direct) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        assert dlock_cmd(proxied, "status", name).returncode == 76, "the proxy let inspect by"
        process = spawn(
            [DLOCK, "run", "-v", "-w", "10", name, "--", "sh", "-c", "echo ran"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "DLOCK_URL": proxied},
        )
        line = announced_wait(process)
        assert line == f"dlock: {name!r} is held by someone else; waiting (at most 10 s)\n", line
        assert process.poll() is None, "must wait while the lock is held"
        lock.release()
        stdout, stderr = process.communicate(timeout=10)
        assert process.returncode == 0 and stdout.strip() == "ran", stderr
        assert stderr.startswith(f"dlock: acquired {name!r} after "), stderr
        # Nor a lock not acquired: the conflict code, not the backend's 76.
        lock.acquire(timeout=0)
        result = dlock_cmd(proxied, "run", "-n", "-E", "3", name, "--", "true")
        assert result.returncode == 3, result.stderr
        assert result.stderr == f"dlock: {name!r} is held by someone else\n", result.stderr


def test_a_holder_gone_between_the_try_and_its_naming_changes_no_run(
    redis_server: RedisServer, name: str, spawn: Spawn
) -> None:
    """The lock is released after ``-v``'s try found it held and before the inspect
    that names the holder: dlock says that it waits, naming nobody, and its wait takes
    the free lock at once (here a proxy releases it just before passing inspect on)."""
    with dlock.connect(f"redis://{redis_server.address}/0") as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        inspected = threading.Event()

        def release_first() -> None:
            if not inspected.is_set():
                inspected.set()
                lock.release()

        with script_proxy(redis_server, INSPECT, release_first) as proxied:
            started = time.monotonic()
            process = spawn(
                [DLOCK, "run", "-v", "-w", "10", name, "--", "sh", "-c", "echo ran"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, "DLOCK_URL": proxied},
            )
            stdout, stderr = process.communicate(timeout=10)
        assert inspected.is_set() and not lock.owned()
        assert process.returncode == 0 and stdout.strip() == "ran", stderr
        waiting = f"dlock: {name!r} is held by someone else; waiting (at most 10 s)\n"
        acquired = rf"dlock: acquired {re.escape(repr(name))} after 0\.\d{{3}} s of waiting\n"
        assert re.fullmatch(re.escape(waiting) + acquired, stderr), stderr
        assert time.monotonic() - started < 5, "the wait took the free lock at once"


def test_lost_lease_stops_the_command(db: str, name: str, tmp_path: Path, spawn: Spawn) -> None:
    pidfile = tmp_path / "child.pid"
    stubborn = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    process = spawn(
        [DLOCK, "run", "--ttl", "1", "--grace", "0.5", name, "--", sys.executable, "-c", stubborn],
        stderr=subprocess.PIPE,
        env={**os.environ, "DLOCK_URL": db},
    )
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child_pid = int(pidfile.read_text())
    with dlock.connect(db) as client:
        assert client.force_release(name)
    start = time.monotonic()
    _, stderr = process.communicate(timeout=15)
    assert process.returncode == 75
    assert "lost the lock" in stderr
    assert len([line for line in stderr.splitlines() if "lost" in line]) == 1, stderr
    assert time.monotonic() - start < 3, "noticed at the next renewal, killed after the grace"
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


#: A worker that a shell-wrapped command starts: it writes its pid once it handles TERM;
#: on TERM it waits a moment (time enough for a dlock that did not wait for it to give
#: the lock back), records whether its lock is still held, and ends.
WORKER = """
import os, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
deadline = time.monotonic() + 60
while not stop and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
import dlock
with dlock.connect(os.environ["DLOCK_URL"]) as client:
    info = client.inspect(os.environ["DLOCK_NAME"])
held = info is not None and info.fencing_token == int(os.environ["DLOCK_FENCING_TOKEN"])
with open(sys.argv[2], "w") as f:
    f.write("held" if held else "free")
"""


def wait_for_pid(pidfile: Path, process: subprocess.Popen[str], timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while not pidfile.exists():
        assert process.poll() is None, "dlock ended before the worker started"
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    return int(pidfile.read_text())


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def ended(pid: int) -> bool:
    """Gone, or dead and not yet reaped: an orphan whose parent died is reaped by PID 1,
    which on some machines takes seconds."""
    try:
        return gone(pid) or process_state(pid) == "Z"
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def killing(pidfile: Path) -> Iterator[None]:
    """Leave no worker behind when a test fails."""
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def stubborn_worker(db: str, pidfile: Path, after: Path) -> tuple[str, dict[str, str]]:
    """A shell script, and its environment, that starts a worker ignoring TERM (its pid
    written to ``pidfile``, its output to a file: one holding dlock's pipes open would
    hide when dlock ends), then touches ``after``, the shell's next step."""
    stubborn = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
        "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
        "time.sleep(60)\n"
    )
    script = f'"$PYTHON" -c "$STUBBORN" {pidfile} >{pidfile}.out 2>&1; touch {after}'
    return script, {**os.environ, "DLOCK_URL": db, "PYTHON": sys.executable, "STUBBORN": stubborn}


def test_lost_lease_stops_what_the_command_started(
    db: str, name: str, tmp_path: Path, spawn: Spawn
) -> None:
    """On a lost lease dlock stops the command's whole process group, not only its own
    child: a worker that a shell started (and that ignores TERM) ran on without the lock
    while another holder had it, and the shell's next step ran too."""
    pidfile, after = tmp_path / "worker.pid", tmp_path / "after"
    script, env = stubborn_worker(db, pidfile, after)
    with killing(pidfile):
        process = spawn(
            [DLOCK, "run", "--ttl", "1", "--grace", "0.5", name, "--", "sh", "-c", script],
            stderr=subprocess.PIPE,
            env=env,
        )
        worker = wait_for_pid(pidfile, process)
        with dlock.connect(db) as client:
            assert client.force_release(name)
        _, stderr = process.communicate(timeout=15)
        assert process.returncode == 75, stderr
        assert gone(worker), "the worker outlived dlock, without the lock"
        assert not after.exists(), "the shell went on to its next step"


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGALRM])
def test_a_dlock_killed_by_a_signal_it_cannot_pass_on_stops_the_command(
    db: str, name: str, tmp_path: Path, spawn: Spawn, signum: int
) -> None:
    """dlock dies of a signal it does not forward (SIGKILL, or one whose default ends a
    process): its command, and what that started (a worker that ignores TERM), ran on,
    and another holder took the lock once the lease ran out (a helper's finding, 8 of
    8). Its guard stops the group as dlock does on a lost lease: TERM, KILL after the
    grace period."""
    pidfile, after = tmp_path / "worker.pid", tmp_path / "after"
    script, env = stubborn_worker(db, pidfile, after)
    with killing(pidfile):
        process = spawn(
            [DLOCK, "run", "--ttl", "30", "--grace", "0.5", name, "--", "sh", "-c", script],
            env=env,
        )
        worker = wait_for_pid(pidfile, process)
        os.kill(process.pid, signum)
        process.wait(10)
        deadline = time.monotonic() + 5
        while not ended(worker):
            assert time.monotonic() < deadline, "the worker outlived dlock, unguarded"
            time.sleep(0.05)
        time.sleep(0.2)
        assert not after.exists(), "the shell went on to its next step"


def test_a_command_that_kills_dlock_as_it_starts_is_stopped(
    db: str, name: str, tmp_path: Path, spawn: Spawn
) -> None:
    """dlock killed just after starting its command, before it could tell the guard the
    command's group (here by the command itself, its first step): the guard finds the
    group by the run's id in its environment (it ran on in about half the runs)."""
    pidfile = tmp_path / "command.pid"
    script = (
        f'kill -9 $PPID; trap "" TERM; echo $$ >{pidfile}.tmp; mv {pidfile}.tmp {pidfile}; sleep 30'
    )
    env = {**os.environ, "DLOCK_URL": db}
    with killing(pidfile):
        process = spawn([DLOCK, "run", "--grace", "0.5", name, "--", "sh", "-c", script], env=env)
        process.wait(10)
        deadline = time.monotonic() + 5
        while not pidfile.exists():
            assert time.monotonic() < deadline, "the command never wrote its pid"
            time.sleep(0.05)
        command = int(pidfile.read_text())
        while not ended(command):
            assert time.monotonic() < deadline, "the command outlived dlock, unguarded"
            time.sleep(0.05)


def test_the_guard_ends_the_commands_group_not_another_sessions_with_its_run_id(
    spawn: Spawn,
) -> None:
    """dlock killed before it told its guard the command's group: the guard finds the
    group by the run's id in processes' environments. A nested ``dlock run``'s own
    guard has that id too (its environment is the outer command's), in a session of
    its own; listed first (/proc lists by pid, and pids wrap around), its group was
    ended, and the command ran on unguarded. A process of another session, started
    first, stands for it here; the guard is told dlock's session (this one's)."""
    from dlock import _job

    run_id = secrets.token_hex(8)
    env = {**os.environ, "DLOCK_RUN_ID": run_id}
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    elsewhere = spawn(sleeper, env=env, start_new_session=True)
    command = spawn(sleeper, env=env, preexec_fn=os.setpgrp)
    guard = Path(_job.__file__).with_name("_guard.py")
    subprocess.run(
        [sys.executable, "-I", "-S", str(guard), "0.5", run_id, str(os.getsid(0))],
        stdin=subprocess.DEVNULL,  # dlock gone before it wrote the group's id
        timeout=30,
    )
    try:
        status = command.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail("the command ran on, unguarded")
    assert status == -signal.SIGTERM
    assert elsewhere.poll() is None, "another session's process was ended"


def test_a_guard_that_cannot_start_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no interpreter to start it with (an embedded Python), or no _guard.py beside
    the package (imported from an archive), the command would run unguarded: the guard
    says why, for dlock to tell on stderr, and nothing waits on a pipe."""
    from dlock import _job

    python = sys.executable
    monkeypatch.setattr(sys, "executable", "")
    guard = _job.Guard(1.0, "run")
    assert guard.pipe is None and "sys.executable" in guard.missing
    monkeypatch.setattr(sys, "executable", python)
    monkeypatch.setattr(os.path, "isfile", lambda path: False)
    guard = _job.Guard(1.0, "run")
    assert guard.pipe is None and "_guard.py is not a file" in guard.missing
    guard.done()  # told nothing, closes nothing


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("lease lost", "dlock killed"),
        ("TERM passed on", "dlock killed"),
        ("TERM passed on", "lease lost"),
    ],
)
def test_a_command_stopped_twice_gets_one_term_and_one_grace_period(
    db: str, name: str, tmp_path: Path, spawn: Spawn, first: str, then: str
) -> None:
    """The group's first TERM, dlock's own (its lease lost) or one it passed on
    (``timeout -k 5 60 dlock run ...``, a supervisor's KILL after its TERM), counts for
    what stops the command next: dlock killed, which leaves it to the guard, or the
    lease lost. Each sent TERM again and started the grace period over, so a program
    that takes a second TERM for "quit now" skipped its clean-up. KILL comes at the end
    of the grace period run from the first TERM instead."""
    pidfile, terms = tmp_path / "command.pid", tmp_path / "terms"
    script = (
        f"trap 'echo TERM >>{terms}' TERM; echo $$ >{pidfile}.tmp; mv {pidfile}.tmp {pidfile};"
        " while :; do sleep 0.05; done"
    )
    env = {**os.environ, "DLOCK_URL": db}
    with killing(pidfile):
        process = spawn(
            [DLOCK, "run", "--ttl", "3", "--grace", "2", name, "--", "sh", "-c", script],
            stderr=subprocess.DEVNULL,
            env=env,
        )

        def lose_the_lease() -> None:
            with dlock.connect(db) as client:
                assert client.force_release(name)

        def kill_dlock() -> None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)

        steps = {
            "lease lost": lose_the_lease,
            "TERM passed on": lambda: process.send_signal(signal.SIGTERM),
            "dlock killed": kill_dlock,
        }
        command = wait_for_pid(pidfile, process)
        steps[first]()
        deadline = time.monotonic() + 10
        while not terms.exists():
            assert time.monotonic() < deadline, "the command was never sent TERM"
            time.sleep(0.02)
        termed = time.monotonic()
        time.sleep(0.3)
        steps[then]()
        while not ended(command):
            assert time.monotonic() < termed + 4, "the command outlived the grace period"
            time.sleep(0.05)
        took = time.monotonic() - termed
        assert 1.5 < took < 3, f"killed {took:.2f} s after its TERM, with a grace of 2 s"
        assert terms.read_text().split() == ["TERM"]


def test_terminate_stops_what_the_command_started_before_the_release(
    db: str, name: str, tmp_path: Path, spawn: Spawn
) -> None:
    """A TERM to dlock reaches every process of the command's group, and the lock is
    released only once they have all ended: it went to the shell alone, dlock released
    the lock as the shell died, and the shell's worker ran on."""
    pidfile, marker = tmp_path / "worker.pid", tmp_path / "marker"
    script = f'"$PYTHON" -c "$WORKER" {pidfile} {marker} >{tmp_path}/out 2>&1; echo step2'
    env = {**os.environ, "DLOCK_URL": db, "PYTHON": sys.executable, "WORKER": WORKER}
    with killing(pidfile):
        process = spawn(
            [DLOCK, "run", name, "--", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        worker = wait_for_pid(pidfile, process)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
        assert process.returncode == 128 + signal.SIGTERM, stderr
        assert marker.exists(), "the worker never got the TERM"
        assert marker.read_text() == "held", "the lock was released before the worker ended"
        assert gone(worker)
        assert "step2" not in stdout
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


def test_what_the_command_leaves_running_is_stopped_before_the_release(
    db: str, name: str, tmp_path: Path
) -> None:
    """A command that ends leaving a process of its group running (``worker &``): that
    process is stopped (TERM, then KILL after --grace) while the lock is still held, and
    the command's status is passed on. It ran on after the release, without the lock."""
    pidfile, marker = tmp_path / "worker.pid", tmp_path / "marker"
    script = (
        f'"$PYTHON" -c "$WORKER" {pidfile} {marker} >{tmp_path}/out 2>&1 & '
        f"until [ -s {pidfile} ]; do sleep 0.05; done; exit 3"
    )
    env = {**os.environ, "DLOCK_URL": db, "PYTHON": sys.executable, "WORKER": WORKER}
    with killing(pidfile):
        result = dlock_cmd(db, "run", name, "--", "sh", "-c", script, env=env)
        assert result.returncode == 3, result.stderr
        assert pidfile.exists() and marker.exists(), "the worker never got the TERM"
        assert marker.read_text() == "held", "the lock was released before the worker ended"
        assert gone(int(pidfile.read_text()))
        assert "left running" in result.stderr
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


def test_terminate_is_forwarded_to_the_command(db: str, name: str, spawn: Spawn) -> None:
    process = spawn(
        [DLOCK, "run", name, "--", "sh", "-c", "echo started; exec sleep 60"],
        stdout=subprocess.PIPE,
        env={**os.environ, "DLOCK_URL": db},
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "started"
    process.send_signal(signal.SIGTERM)
    assert process.wait(10) == 128 + signal.SIGTERM
    process.stdout.close()
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


@pytest.mark.parametrize(
    "signum", [signal.SIGHUP, signal.SIGINT, signal.SIGQUIT], ids=["HUP", "INT", "QUIT"]
)
def test_a_signal_ignored_as_dlock_starts_stays_ignored(
    db: str, name: str, signum: int, spawn: Spawn
) -> None:
    """``nohup dlock run ...`` (HUP), or dlock as a background job of a script (INT and
    QUIT): the signal was ignored as dlock started, and must stay ignored by dlock and by
    the command, as a shell keeps it. (dlock's own handler made the command take it by
    default: ``nohup`` protected nothing.)"""
    report = "grep SigIgn /proc/$$/status; echo started; exec sleep 60"
    # The shell ignores the signal, then becomes dlock, which starts ignoring it.
    ignoring = ["sh", "-c", f'trap "" {int(signum)}; exec "$@"', "sh"]
    process = spawn(
        [*ignoring, DLOCK, "run", name, "--", "sh", "-c", report],
        stdout=subprocess.PIPE,
        env={**os.environ, "DLOCK_URL": db},
    )
    assert process.stdout is not None
    ignored = int(process.stdout.readline().split()[1], 16)
    assert ignored & (1 << (signum - 1)), f"the command does not ignore {signum}"
    assert process.stdout.readline().strip() == "started"
    process.send_signal(signum)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.5)  # neither dlock nor the command ended
    process.send_signal(signal.SIGTERM)
    assert process.wait(10) == 128 + signal.SIGTERM
    process.stdout.close()
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


def test_interrupt_is_forwarded_outside_a_terminal(
    db: str, name: str, tmp_path: Path, spawn: Spawn
) -> None:
    """``kill -INT`` from a supervisor (systemd's KillSignal, ``timeout -s INT``)
    reaches the command: dlock ignored it, and the command ran on. dlock runs in a
    session of its own here, with no terminal whose Ctrl-C would reach the command."""
    marker = tmp_path / "interrupted"
    script = f"trap 'echo int > {marker}; exit 42' INT; echo started; sleep 30 & wait"
    process = spawn(
        [DLOCK, "run", name, "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        env={**os.environ, "DLOCK_URL": db},
        start_new_session=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "started"
    process.send_signal(signal.SIGINT)
    assert process.wait(10) == 42
    assert marker.read_text().strip() == "int"
    process.stdout.close()
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


def wait_for_text(path: Path, text: str, failure: str, timeout: float = 10) -> None:
    """Wait until the file ``path`` exists and holds ``text``."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


def process_state(pid: int) -> str:
    """One letter from /proc: R running, S sleeping (in a read, say), T stopped..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


class Terminal:
    """A process that leads a session of its own, whose controlling terminal is a
    pseudo-terminal, and that terminal's output, read as it comes, each expected text
    consumed."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self.fd = fd
        self.seen = b""
        self.reaped = False

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def expect(self, text: bytes, timeout: float = 20) -> None:
        self.expect_match(re.escape(text), timeout)

    def expect_match(self, pattern: bytes, timeout: float = 20) -> re.Match[bytes]:
        deadline = time.monotonic() + timeout
        while (match := re.search(pattern, self.seen)) is None:
            assert time.monotonic() < deadline, (pattern, self.seen)
            if select.select([self.fd], [], [], 0.1)[0]:
                self.seen += os.read(self.fd, 1024)
        self.seen = self.seen[match.end() :]
        return match

    def wait_until_reading(self, pid: int, timeout: float = 20) -> None:
        """Wait until process ``pid``, which leads its process group, has the terminal's
        foreground and sleeps in a read of it. (Reading from the background, it stops
        instead, until dlock hands it the terminal and continues it.)"""
        deadline = time.monotonic() + timeout
        while not (os.tcgetpgrp(self.fd) == pid and process_state(pid) == "S"):
            assert time.monotonic() < deadline, (os.tcgetpgrp(self.fd), process_state(pid))
            time.sleep(0.01)

    def wait(self) -> int:
        """Wait for the process to end; its exit status (-N: killed by signal N)."""
        _, status = os.waitpid(self.pid, 0)
        self.reaped = True
        return os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def in_a_pty(argv: list[str], env: dict[str, str]) -> Iterator[Terminal]:
    """Run ``argv`` (its first item a path) under a pseudo-terminal of its own; kill it
    on the way out if it is still there, as when a test fails."""
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.execve(argv[0], argv, env)
        finally:  # reached only if execve failed: never back into pytest
            os._exit(127)
    terminal = Terminal(pid, fd)
    try:
        yield terminal
    finally:
        if not terminal.reaped:  # else the pid may be another process's by now
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        os.close(fd)


#: A command that records each SIGINT and SIGUSR1 it gets in the file argv[1], a line
#: each, as the kernel delivers them (a byte each through the wakeup fd): Python's own
#: handlers run once for two signals that come before the first handler has run.
SIGNAL_RECORDER = """
import os, signal, sys
names = {signal.SIGINT: "int", signal.SIGUSR1: "usr1"}
for signum in names:
    signal.signal(signum, lambda *_: None)
read_end, write_end = os.pipe()
os.set_blocking(write_end, False)
signal.set_wakeup_fd(write_end)
print("started", flush=True)
while True:
    for signum in os.read(read_end, 64):
        with open(sys.argv[1], "a") as record:
            record.write(names[signum] + "\\n")
"""


def test_ctrl_c_in_a_terminal_reaches_the_command_once(db: str, name: str, tmp_path: Path) -> None:
    """The terminal's Ctrl-C reaches the command once: a second SIGINT would make a
    program that handles the first one gracefully give up. (The command has a process
    group of its own; a Ctrl-C reaches either dlock's group, which passes it on, or,
    once the command has taken the terminal, the command's group alone.)"""
    marker = tmp_path / "interrupts"
    argv = [DLOCK, "run", name, "--", sys.executable, "-c", SIGNAL_RECORDER, str(marker)]
    with in_a_pty(argv, {**os.environ, "DLOCK_URL": db}) as terminal:
        terminal.expect(b"started")
        terminal.type(b"\x03")  # Ctrl-C: SIGINT to the terminal's foreground group
        wait_for_text(marker, "int\n", "the command never got the Ctrl-C")
        # A barrier rather than a pause: the Ctrl-C's SIGINT reached dlock before the
        # command showed it got one, and dlock passes signals on from its handlers in
        # turn, so a second SIGINT from dlock goes out before this USR1 does (and the
        # kernel delivers them in that order).
        os.kill(terminal.pid, signal.SIGUSR1)
        wait_for_text(marker, "usr1\n", "the command never got the forwarded USR1")
        assert marker.read_text() == "int\nusr1\n"
        os.kill(terminal.pid, signal.SIGTERM)  # passed on: the command ends, dlock with it
        assert terminal.wait() == 128 + signal.SIGTERM
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


def test_a_command_reads_the_terminal(db: str, name: str) -> None:
    """The command runs in a process group of its own, in the background; when it reads
    the terminal dlock, in the terminal's foreground, hands the terminal to it (a read
    from the background would stop it for good)."""
    child = "print('ready', flush=True)\nprint('got', input())\n"
    argv = [DLOCK, "run", name, "--", sys.executable, "-c", child]
    with in_a_pty(argv, {**os.environ, "DLOCK_URL": db}) as terminal:
        terminal.expect(b"ready")
        terminal.type(b"hello\n")
        terminal.expect(b"got hello")
        assert terminal.wait() == 0


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_job_control_in_an_interactive_shell(db: str, name: str) -> None:
    """Under an interactive shell: Ctrl-Z while the command has the terminal stops the
    command and dlock (the shell gets its prompt back, the lock stays held), ``fg``
    continues both and gives the command the terminal again."""
    child = "import os\nprint('ready', os.getpid(), flush=True)\nprint('got', input())\n"
    env = {
        **os.environ,
        "DLOCK_URL": db,
        "PS1": "prompt$ ",
        "HISTFILE": "/dev/null",
        "CHILD": child,
        "CHILD_PYTHON": sys.executable,
        "PATH": f"{Path(DLOCK).parent}:{os.environ['PATH']}",
    }
    with in_a_pty(["/bin/sh", "-c", "exec bash --norc --noprofile -i"], env) as terminal:
        terminal.expect(b"prompt$ ")
        terminal.type(f'dlock run {name} -- "$CHILD_PYTHON" -c "$CHILD"\n'.encode())
        command = int(terminal.expect_match(rb"ready (\d+)\r?\n")[1])
        terminal.wait_until_reading(command)
        terminal.type(b"\x1a")  # Ctrl-Z, to the command's group
        terminal.expect(b"Stopped")
        terminal.expect(b"prompt$ ")
        with dlock.connect(db) as client:
            assert client.inspect(name) is not None, "a stopped job keeps its lock"
        terminal.type(b"fg\n")
        terminal.wait_until_reading(command)
        terminal.type(b"hello\n")
        terminal.expect(b"got hello")
        terminal.expect(b"prompt$ ")
        terminal.type(b"echo status=$?.\n")
        terminal.expect(b"status=0.")
        terminal.type(b"exit\n")
        terminal.wait()
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_the_wait_for_the_lock(db: str, name: str, signum: int, spawn: Spawn) -> None:
    """A signal while dlock waits for the lock ends it at once with 128+N, quietly
    (SIGINT printed a traceback), runs nothing, and leaves the holder's lock alone."""
    with dlock.connect(db) as client:
        holder = client.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        process = spawn(
            [DLOCK, "run", "-v", "-w", "60", name, "--", "sh", "-c", "echo ran"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "DLOCK_URL": db},
            start_new_session=True,
        )
        # Its first try has found the lock held: the handlers are in, and dlock waits.
        line = announced_wait(process)
        assert line.endswith("; waiting (at most 60 s)\n"), line
        assert process.poll() is None
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=10)
        assert process.returncode == 128 + signum, stderr
        assert stdout == "" and "Traceback" not in stderr, stderr
        assert holder.owned()
        info = client.inspect(name)
        assert info is not None and info.fencing_token == holder.fencing_token
        holder.release()


#: Runs ``dlock ARGS`` (argv[3:]) in this process, with the signal argv[2] sent to itself
#: at the point argv[1] of its start: "installed", right after dlock installs its handler
#: for that signal (the others of the set may not be in yet); "described", as it asks who
#: holds the lock it did not get; "parsing", before it parses its arguments; "acquired",
#: as it reads the fencing token of the lock it got for the command's environment (and
#: "dlock started the command" on stderr if it then starts it); "failed", as an error
#: other than a signal's leaves the wait. Windows of microseconds, opened on purpose.
SIGNAL_AT = """
import os, signal, sys
from dlock import _cli
point, signum = sys.argv[1], int(sys.argv[2])
sent = []
def send():
    if not sent:
        sent.append(signum)
        os.kill(os.getpid(), signum)
if point == "installed":
    install = signal.signal
    def installing(number, handler):
        previous = install(number, handler)
        if number == signum and callable(handler):
            send()
        return previous
    signal.signal = installing
elif point == "described":
    describe = _cli.holder_if_told
    def describing(client, name):
        send()
        return describe(client, name)
    _cli.holder_if_told = describing
elif point == "parsing":
    build = _cli.build_parser
    def building():
        parser = build()
        send()
        return parser
    _cli.build_parser = building
elif point == "acquired":
    from dlock._sync.lock import Lock
    token = Lock.fencing_token
    def fencing_token(lock):
        send()
        return token.fget(lock)
    Lock.fencing_token = property(fencing_token)
    # Told on stderr: a command that starts may or may not get as far as its first step.
    from dlock import _job
    spawn = _job.spawn_in_new_group
    def spawning(command, env):
        print("dlock started the command", file=sys.stderr, flush=True)
        return spawn(command, env)
    _job.spawn_in_new_group = spawning
elif point == "failed":
    from dlock import _job
    leave = _job.forwarding_signals.__exit__
    def leaving(self, kind, error, trace):
        if kind is not None and kind is not _job.Interrupted:
            send()
        return leave(self, kind, error, trace)
    _job.forwarding_signals.__exit__ = leaving
sys.exit(_cli.main(sys.argv[3:]))
"""


def signalled_at(db: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``SIGNAL_AT`` with ``argv`` (the point to signal at, the signal, dlock's own
    arguments), in a session of its own so that the signal reaches nothing else."""
    return subprocess.run(
        [sys.executable, "-c", SIGNAL_AT, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DLOCK_URL": db},
        start_new_session=True,
    )


@pytest.mark.parametrize("signum", FORWARDED_SIGNALS, ids=lambda signum: signum.name)
def test_a_signal_as_the_handlers_go_in_ends_dlock_quietly(db: str, name: str, signum: int) -> None:
    """A signal whose handler is in while the others are still being installed (or
    before the wait has begun): 128+N, quietly, nothing run. Its handler raised inside
    the installation, where nothing caught it: a traceback and status 1."""
    with dlock.connect(db) as client:
        holder = client.lock(name, ttl=30)
        assert holder.acquire(timeout=0)
        argv = ["installed", str(signum), "run", "-w", "10", name, "--", "sh", "-c", "echo ran"]
        result = signalled_at(db, argv)
        assert result.returncode == 128 + signum, result.stderr
        assert result.stdout == "" and result.stderr == "", result.stderr
        info = client.inspect(name)
        assert info is not None and info.fencing_token == holder.fencing_token
        holder.release()


def test_a_signal_as_dlock_names_the_holder_ends_it_at_once(db: str, name: str) -> None:
    """A signal while ``dlock run -n`` asks who holds the lock it did not get (a round
    trip to the backend, as long as the backend takes): 128+N. It was kept for a
    command that would never run, and dlock went on to exit 1."""
    with dlock.connect(db) as client, client.lock(name, ttl=30):
        argv = ["described", str(int(signal.SIGTERM)), "run", "-n", name, "--", "true"]
        result = signalled_at(db, argv)
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        assert result.stderr == "", result.stderr


def test_ctrl_c_before_dlock_parses_its_arguments_ends_it_quietly(db: str, name: str) -> None:
    """SIGINT as dlock starts, before it parses its arguments: 130, quietly. Only the
    rest of main() caught the KeyboardInterrupt: a traceback."""
    argv = ["parsing", str(int(signal.SIGINT)), "run", name, "--", "sh", "-c", "echo ran"]
    result = signalled_at(db, argv)
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stdout == "" and result.stderr == "", result.stderr


@pytest.mark.parametrize("signum", FORWARDED_SIGNALS, ids=lambda signum: signum.name)
def test_a_signal_after_the_wait_before_the_command_starts_ends_dlock(
    db: str, name: str, tmp_path: Path, signum: int
) -> None:
    """A signal once dlock has the lock, before it starts the command: 128+N, nothing
    run, the lock given back. It was kept for the command, which started only to get
    it: often killed before its first step, sometimes after (so the marker alone tells
    it only sometimes; the driver's word that dlock started the command, every time)."""
    marker = tmp_path / "ran"
    command = ["sh", "-c", f"touch {marker}; exit 3"]
    argv = ["acquired", str(int(signum)), "run", name, "--", *command]
    result = signalled_at(db, argv)
    assert result.returncode == 128 + signum, result.stderr
    assert result.stderr == "", result.stderr
    assert not marker.exists(), "the command ran"
    with dlock.connect(db) as client:
        assert client.inspect(name) is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_as_the_wait_fails_ends_dlock_quietly(db: str, name: str, signum: int) -> None:
    """A signal as a backend error leaves the wait for the lock, before the handlers
    are taken out: 128+N, quietly. The handler still raised, and that escaped: a
    traceback and status 1."""
    unusable = "sqlite:///proc/dlock-no-such-dir/locks.sqlite3"
    argv = ["failed", str(int(signum)), "--url", unusable, "run", "-w", "10", name, "--", "true"]
    result = signalled_at(db, argv)
    assert result.returncode == 128 + signum, result.stderr
    assert result.stderr == "", result.stderr


def test_status_list_and_force_release(url: str, name: str) -> None:
    """On every backend (``url``: the conformance fixture's), and in both SQL modes:
    force release in session mode ends the holder's database session."""
    db = url
    assert dlock_cmd(db, "status", name).returncode == 1
    with dlock.connect(db, label="cli-test") as client:
        lock = client.lock(name, ttl=30)
        lock.acquire()
        status = dlock_cmd(db, "status", name)
        assert status.returncode == 0
        assert name in status.stdout and "cli-test" in status.stdout
        info = json.loads(dlock_cmd(db, "status", "--json", name).stdout)
        assert info["fencing_token"] == lock.fencing_token
        assert info["holder"]["pid"] == os.getpid()
        listed = json.loads(dlock_cmd(db, "list", "--json", name[:10]).stdout)
        assert [entry["name"] for entry in listed] == [name]
        assert name in dlock_cmd(db, "list").stdout
        assert dlock_cmd(db, "release", name).returncode == 2, "--force is required"
        assert dlock_cmd(db, "release", "--force", name).returncode == 0
        assert dlock_cmd(db, "release", "--force", name).returncode == 1
        assert client.inspect(name) is None
        with pytest.raises(dlock.LockLost):
            lock.release()


def test_status_names_the_waiters(redis_server: RedisServer, name: str, spawn: Spawn) -> None:
    """The backends that queue waiters (here Redis) list them under the holder, a label
    in parentheses as ``-v`` shows a holder's. It ran on from the pid ("pid 42 nightly
    run"), and a waiter with none had a trailing blank."""
    url = f"redis://{redis_server.address}/0"
    with dlock.connect(url) as client, client.lock(name, ttl=30):
        waiters = [
            spawn([DLOCK, "run", *label, name, "--", "true"], env={**os.environ, "DLOCK_URL": url})
            for label in (["--label", "nightly run"], [])
        ]
        deadline = time.monotonic() + 10
        while (status := dlock_cmd(url, "status", name)).stdout.count("waiting #") < 2:
            assert time.monotonic() < deadline, status.stdout + status.stderr
            time.sleep(0.1)
    shown = [line.split(" pid ", 1)[1] for line in status.stdout.splitlines()[2:]]
    expected = [f"{waiters[0].pid} (nightly run)", str(waiters[1].pid)]
    assert sorted(shown) == sorted(expected), status.stdout
    for waiter in waiters:
        assert waiter.wait(timeout=10) == 0


def test_names_and_labels_cannot_drive_the_terminal(db: str, name: str) -> None:
    """Names, hosts and labels come from other clients: printed raw, an escape sequence
    in one would rewrite the operator's screen and a newline would fake a row. They are
    shown as string literals instead; ``--json`` keeps them exact."""
    evil = f"{name}\x1b[2J\nfake-row  1  host  1"
    with dlock.connect(db, label="job\r\x1b]0;owned\x07") as client, client.lock(evil, ttl=30):
        listed = dlock_cmd(db, "list")
        status = dlock_cmd(db, "status", evil)
        conflict = dlock_cmd(db, "run", "-n", evil, "--", "true")
        exact = json.loads(dlock_cmd(db, "list", "--json").stdout)
    for result in (listed, status, conflict):
        output = result.stdout + result.stderr
        assert "\x1b" not in output and "\r" not in output and "\x07" not in output, output
        assert repr("job\r\x1b]0;owned\x07") in output
    assert len(listed.stdout.splitlines()) == 2, "a header and one row"
    assert repr(evil) in listed.stdout and repr(evil) in status.stdout
    assert [info["name"] for info in exact] == [evil]


def test_init_prints_or_creates_the_schema(tmp_path: Path) -> None:
    db = f"sqlite://{tmp_path}/fresh/locks.sqlite3"
    printed = dlock_cmd(db, "init", "--print")
    assert printed.returncode == 0 and "CREATE TABLE" in printed.stdout
    assert not (tmp_path / "fresh").exists(), "--print changes nothing"
    assert dlock_cmd(db, "init").returncode == 0
    assert (tmp_path / "fresh" / "locks.sqlite3").exists()


@pytest.mark.parametrize("server", ["mariadb_server", "postgresql_server"])
@pytest.mark.parametrize("mode", ["lease", "session"])
def test_init_prints_or_creates_a_sql_schema(
    request: pytest.FixtureRequest, server: str, mode: str, name: str
) -> None:
    """For teams that manage migrations: ``create_table=false``, and the schema printed
    or created by ``dlock init``."""
    table = f"cli_init_{uuid.uuid4().hex[:8]}"
    db = request.getfixturevalue(server).url(f"mode={mode}&table={table}&create_table=false")
    printed = dlock_cmd(db, "init", "--print")
    assert printed.returncode == 0, printed.stderr
    # Named as dlock will use it: on MySQL in the URL's database; on PostgreSQL quoted,
    # as a reserved word would need.
    assert re.search(
        rf'CREATE (UNLOGGED )?TABLE IF NOT EXISTS ("?\w+"?\.)?"?{table}"? ', printed.stdout
    )
    with dlock.connect(db) as client, pytest.raises(dlock.BackendError):
        client.lock(name, ttl=5).acquire(timeout=0)  # no table: --print created nothing
    assert dlock_cmd(db, "init").returncode == 0
    with dlock.connect(db) as client, client.lock(name, ttl=5) as lock:
        assert lock.fencing_token is not None


@pytest.mark.parametrize(
    "command", [[], ["run"], ["status"], ["list"], ["release"], ["init"], ["prune"]]
)
def test_help(command: list[str]) -> None:
    result = subprocess.run([DLOCK, *command, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: dlock" in result.stdout
    if command == ["run"]:  # every exit status the README gives
        for status in ("75", "69", "76", "128+N"):
            assert status in result.stdout, status
        for variable in ("DLOCK_NAME", "DLOCK_FENCING_TOKEN", "DLOCK_TTL", "DLOCK_RUN_ID"):
            assert variable in result.stdout, variable
    elif command:  # how a command that cannot do its work ends, which scripts act on
        for status in ("69", "76", "74"):
            assert status in result.stdout, (command, status)


def test_prune_and_init_say_a_backend_without_rows_has_nothing_to_do(
    redis_server: RedisServer,
) -> None:
    """``prune`` said "0 idle names removed" on Redis, as if it had looked."""
    url = f"redis://{redis_server.address}/0"
    for command in ("prune", "init"):
        result = dlock_cmd(url, command)
        assert result.returncode == 0 and "nothing to do" in result.stderr, result
        assert result.stdout == "", result.stdout


def test_help_names_the_default_file(tmp_path: Path) -> None:
    """The file that --url's absence means, as it is for this user: ~/.local/state is
    not it when $XDG_STATE_HOME is set. A path that quoting fills with % (which
    argparse's help formats) is shown too, not a traceback."""
    state = tmp_path / "state 100%"
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    result = subprocess.run([DLOCK, "run", "--help"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    shown = "".join(result.stdout.split())  # argparse wraps it, even inside the path
    assert "sqlite://" + quote(f"{state}/dlock/locks.sqlite3") in shown


def test_url_before_or_after_the_command(db: str, name: str) -> None:
    with dlock.connect(db) as client, client.lock(name, ttl=30):
        env = {k: v for k, v in os.environ.items() if k != "DLOCK_URL"}
        for args in (["--url", db, "status", name], ["status", "--url", db, name]):
            result = subprocess.run([DLOCK, *args], capture_output=True, text=True, env=env)
            assert result.returncode == 0, (args, result.stdout, result.stderr)


@pytest.mark.parametrize("command", [["status", "x"], ["run", "x", "--", "true"]])
def test_a_client_librarys_own_warnings_stay_out_of_stderr(command: list[str]) -> None:
    """dlock's stderr is its command's too: kazoo's warnings as it tried to connect
    ("Connection dropped: ... Connection refused", three of them, and "Failed
    connecting to Zookeeper ...") came before dlock's one-line error, and a server
    that blinked while a command ran put them amid its output. With -v they show."""
    nobody_there = f"zookeeper://127.0.0.1:{free_port()}/dlock?connect_timeout=0.5"
    down = dlock_cmd(nobody_there, *command)
    assert down.returncode == 69, down.stderr
    assert down.stderr.splitlines() == [
        line for line in down.stderr.splitlines() if line.startswith("dlock")
    ], down.stderr
    if command[0] == "run":
        verbose = dlock_cmd(nobody_there, "run", "-v", *command[1:])
        assert "Connection dropped" in verbose.stderr, verbose.stderr


def test_bad_input_and_unreachable_backend(db: str) -> None:
    # Named as the command line has them, not as the library's arguments.
    bad_ttl = dlock_cmd(db, "run", "--ttl", "0", "x", "--", "true")
    assert bad_ttl.returncode == 2 and "--ttl must be" in bad_ttl.stderr
    empty = dlock_cmd(db, "status", "")
    assert empty.returncode == 2 and "empty" in empty.stderr
    unknown = dlock_cmd("nosuch://x", "status", "x")
    assert unknown.returncode == 2 and "unknown URL scheme" in unknown.stderr
    # A Latin-1 file name's byte, as Python decodes $DLOCK_URL: exit 70 and a traceback.
    latin1 = dlock_cmd("sqlite:///tmp/caf\udce9.db", "status", "x")
    assert latin1.returncode == 2 and "percent-encoded (%E9)" in latin1.stderr, latin1.stderr
    unusable = dlock_cmd("sqlite:///proc/no-such-dir/x.db", "run", "x", "--", "true")
    assert unusable.returncode == 76 and "backend error" in unusable.stderr
    nobody_there = f"postgresql://dlock@127.0.0.1:{free_port()}/dlock?connect_timeout=1"
    down = dlock_cmd(nobody_there, "run", "x", "--", "true")
    assert down.returncode == 69 and "backend error" in down.stderr, down.stderr
    negative_wait = dlock_cmd(db, "run", "-w", "-1", "x", "--", "true")
    assert negative_wait.returncode == 2 and "--wait must be >= 0" in negative_wait.stderr
    assert "None" not in negative_wait.stderr, negative_wait.stderr
    for option, value in (("--older-than", "5"), ("--batch", "0")):
        bad_prune = dlock_cmd(db, "prune", option, value)
        assert bad_prune.returncode == 2 and f"{option} must be" in bad_prune.stderr
        assert bad_prune.stderr.rstrip().endswith(f"not {value}"), bad_prune.stderr
    # A number of seconds is repeated as typed: "not 5.0" for 5 read as a different value.
    for command in (("run", "--ttl", "0"), ("run", "-w", "-1"), ("run", "--grace", "-1")):
        echoed = dlock_cmd(db, *command, "x", "--", "true")
        assert echoed.returncode == 2, echoed.stderr
        assert echoed.stderr.rstrip().endswith(f"not {command[-1]}"), echoed.stderr
    not_a_number = dlock_cmd(db, "run", "--ttl", "5s", "x", "--", "true")
    assert not_a_number.returncode == 2, not_a_number.stderr
    assert "--ttl: not a number of seconds: '5s'" in not_a_number.stderr, not_a_number.stderr
    long_label = dlock_cmd(db, "run", "--label", "L" * 600, "x", "--", "true")
    assert long_label.returncode == 2 and "--label is 600" in long_label.stderr, long_label.stderr
    negative_grace = dlock_cmd(db, "run", "--grace", "-1", "x", "--", "true")
    assert negative_grace.returncode == 2 and "--grace" in negative_grace.stderr
    # Refused as it is not finite: "must be >= 0 seconds, not inf" read as a contradiction.
    endless_grace = dlock_cmd(db, "run", "--grace", "inf", "x", "--", "true")
    assert endless_grace.returncode == 2 and "finite" in endless_grace.stderr, endless_grace.stderr
    no_command = dlock_cmd(db, "run", "x")
    assert no_command.returncode == 2 and "no command" in no_command.stderr
    late_option = dlock_cmd(db, "run", "x", "-n", "--", "true")
    assert late_option.returncode == 2 and "options go before NAME" in late_option.stderr
    # A status is one byte: 256 would have exited 0 for "not acquired".
    for code in ("256", "-1", "x"):
        bad_code = dlock_cmd(db, "run", "-n", "-E", code, "x", "--", "true")
        assert bad_code.returncode == 2 and "--conflict-exit-code" in bad_code.stderr, code


def closing_stdout(*args: str) -> list[str]:
    """``dlock ARGS`` run with its stdout closed (``>&-``)."""
    return ["sh", "-c", 'exec "$@" >&-', "sh", DLOCK, *args]


def test_run_passes_the_status_on_whatever_its_stdout(url: str, name: str) -> None:
    """With its stdout closed, ``dlock run`` passes the command's status on: it failed
    with a traceback and status 1, which reads as "lock busy". On every backend (``url``)
    the command finds its stdout closed, as it would without dlock: not a connection to
    the backend that dlock opened on the free descriptor number."""
    script = "if echo written 2>/dev/null; then exit 1; fi; exit 5"
    result = subprocess.run(
        closing_stdout("run", name, "--", "sh", "-c", script),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DLOCK_URL": url},
    )
    assert result.returncode == 5, result.stderr
    assert result.stderr == ""
    full = dlock_cmd(url, "run", name, "--", "sh", "-c", "exit 6", stdout_to="/dev/full")
    assert full.returncode == 6, full.stderr


@pytest.mark.parametrize(
    "args", [["list"], ["list", "--json"], ["status"], ["status", "--json"], ["release", "--force"]]
)
@pytest.mark.parametrize("where", ["closed", "/dev/full"])
def test_output_that_cannot_be_written(db: str, name: str, args: list[str], where: str) -> None:
    """A closed or full stdout ends with status 74 (EX_IOERR) and one line on stderr:
    it gave a traceback and status 1, which reads as "free" or "not held"."""
    if args[0] != "list":
        args = [*args, name]
    with dlock.connect(db) as client:
        lock = client.lock(name, ttl=30)
        assert lock.acquire(timeout=0)
        if where == "closed":
            result = subprocess.run(
                closing_stdout(*args),
                capture_output=True,
                text=True,
                timeout=30,
                env={**os.environ, "DLOCK_URL": db},
            )
        else:
            result = dlock_cmd(db, *args, stdout_to=where)
        with contextlib.suppress(dlock.LockLost):  # released by ``release --force``
            lock.release()
    assert result.returncode == 74, result.stderr
    assert result.stderr.startswith("dlock: cannot write to standard output: ")
    assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["run", "--help"]])
@pytest.mark.parametrize("where", ["closed", "/dev/full"])
def test_help_that_cannot_be_written(args: list[str], where: str) -> None:
    """--help and --version fail as every command's output does (74, one line): they
    exited 0, as argparse does, having printed nothing (a closed stdout, /dev/full)."""
    if where == "closed":
        result = subprocess.run(closing_stdout(*args), capture_output=True, text=True, timeout=30)
    else:
        result = dlock_cmd("", *args, stdout_to=where)
    assert result.returncode == 74, result.stderr
    assert result.stderr.startswith("dlock: cannot write to standard output: ")
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_nothing_to_write_to_a_closed_stdout(db: str) -> None:
    """Nothing to print, nothing to fail: an empty ``list`` with its stdout closed
    succeeds (as GNU tools do)."""
    result = subprocess.run(
        closing_stdout("list"),
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DLOCK_URL": db},
    )
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("args", [["list"], ["list", "--json"], ["status", "--json"], ["--help"]])
def test_a_reader_that_goes_away_ends_the_output_quietly(
    db: str, name: str, args: list[str], spawn: Spawn
) -> None:
    """``dlock list | head``: once the reader has gone, dlock stops without a traceback,
    with the status of a command killed by SIGPIPE (141, as a shell shows it)."""
    if args[0] == "status":
        args = [*args, name]
    with dlock.connect(db) as client, client.lock(name, ttl=30):
        process = spawn(
            [DLOCK, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "DLOCK_URL": db},
        )
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # before dlock writes: it has yet to start Python
        errors = process.stderr.read()
        assert process.wait(30) == 141, errors
        assert errors == ""


#: Keeps the SQLite file argv[1] write-locked from when it creates argv[2] until
#: argv[3] appears (or 20 s have passed), from outside the command's process group.
WRITE_LOCKER = """
import os, sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")
open(sys.argv[2], "w").close()
deadline = time.monotonic() + 20
while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.01)
"""


def test_a_release_that_fails_after_the_command_no_longer_hides_its_status(
    db: str, name: str, tmp_path: Path
) -> None:
    """The command ran to its end under the lock; the give-back that then fails (the
    file kept write-locked past busy_timeout) is told on stderr, and the command's
    status is passed on. dlock exited 69, "worth retrying": a script that retries on it
    ran the command again."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    script = (
        f'setsid "$PYTHON" -c "$LOCKER" {tmp_path}/cli.sqlite3 {ready} {go} >/dev/null 2>&1 & '
        f"until [ -e {ready} ]; do sleep 0.01; done; exit 3"
    )
    env = {**os.environ, "PYTHON": sys.executable, "LOCKER": WRITE_LOCKER}
    try:
        result = dlock_cmd(f"{db}?busy_timeout=0.2", "run", name, "--", "sh", "-c", script, env=env)
    finally:
        go.touch()
    assert result.returncode == 3, result.stderr
    assert "database is locked" in result.stderr and repr(name) in result.stderr


def test_a_command_that_cannot_start_keeps_its_status_when_the_give_back_fails(
    redis_server: RedisServer, name: str
) -> None:
    """Nothing ran: the command is not there. The give-back that then failed made the
    exit status the backend's (76, or 69, "worth retrying"), hiding the 127 of a command
    not found; it is told on stderr instead, and the lease runs out."""
    with refusing_script(redis_server, RELEASE) as proxied:
        result = dlock_cmd(proxied, "run", "--ttl", "5", name, "--", "no-such-command-here")
    assert result.returncode == 127, result.stderr
    assert "cannot run 'no-such-command-here'" in result.stderr, result.stderr
    assert f"giving back {name!r} failed" in result.stderr, result.stderr


def _rename_sqlite(db: str, old: bytes, new: bytes) -> None:
    with sqlite3.connect(db.removeprefix("sqlite://")) as conn:
        conn.execute("UPDATE dlock_locks SET name = ? WHERE name = ?", (new, old))
    conn.close()


def _rename_redis(url: str, old: bytes, new: bytes) -> None:
    server = redis.Redis.from_url(url)
    for key in server.scan_iter(match=b"*{n:" + old + b"}*"):
        server.rename(key, key.replace(b"{n:" + old + b"}", b"{n:" + new + b"}"))
    server.close()


def _rename_etcd(url: str, old: bytes, new: bytes) -> None:
    """Move the lock's key to another name, on the same lease (etcd's JSON gateway)."""
    parts = urlsplit(url)
    base, prefix = f"http://{parts.netloc}", parts.path.rstrip("/").encode() + b"/"

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    [kv] = httpx.post(f"{base}/v3/kv/range", json={"key": b64(prefix + old)}).json()["kvs"]
    put = {"key": b64(prefix + new), "value": kv["value"], "lease": kv.get("lease", "0")}
    deleted = {"key": b64(prefix + old)}
    answer = httpx.post(
        f"{base}/v3/kv/txn",
        json={"success": [{"request_put": put}, {"request_delete_range": deleted}]},
    )
    assert answer.json().get("succeeded"), answer.text


@pytest.mark.parametrize("backend", ["sqlite", "redis", "etcd"])
def test_a_name_not_in_utf8_is_listed_escaped(
    backend: str, db: str, name: str, request: pytest.FixtureRequest
) -> None:
    """A lock name that another program wrote, not in UTF-8, ended ``dlock list`` (and
    ``Client.list``) with a UnicodeDecodeError: an internal error, exit 70. It is
    listed with its bytes kept, shown escaped."""
    if backend == "redis":
        db = f"redis://{request.getfixturevalue('redis_server').address}/0"
    if backend == "etcd":
        db = request.getfixturevalue("etcd_server").url(f"/dlock-{uuid.uuid4().hex[:8]}")
    rename = {"sqlite": _rename_sqlite, "redis": _rename_redis, "etcd": _rename_etcd}[backend]
    foreign = name.encode() + b"\xff"
    with dlock.connect(db) as client, client.lock(name, ttl=30):
        rename(db, name.encode(), foreign)
        [info] = client.list(name)
        assert info.name == name + "\udcff"
        shown = dlock_cmd(db, "list", name)
        assert shown.returncode == 0 and repr(name + "\udcff") in shown.stdout, shown.stderr
        as_json = dlock_cmd(db, "list", "--json", name)
        assert as_json.returncode == 0, as_json.stderr
        assert [row["name"] for row in json.loads(as_json.stdout)] == [name + "\udcff"]
        rename(db, foreign, name.encode())


def test_an_empty_url_no_longer_runs_under_the_default_file(tmp_path: Path) -> None:
    """``--url "$LOCKS"`` with LOCKS unset, or an empty ``$DLOCK_URL``: the command ran
    under the per-user SQLite file, excluding nothing on other hosts. A usage error
    now, and nothing runs."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    for args, url in (
        (["--url", "", "run", "x", "--", "touch", "ran"], None),
        (["run", "--url", "", "x", "--", "touch", "ran"], None),
        (["run", "x", "--", "touch", "ran"], ""),
    ):
        if url is not None:
            env["DLOCK_URL"] = url
        result = subprocess.run(
            [DLOCK, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30
        )
        assert result.returncode == 2, (args, result.stderr)
        assert "URL" in result.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "dlock").exists()


def test_a_stderr_that_cannot_be_written_no_longer_keeps_a_lost_lease_running(
    db: str, name: str, tmp_path: Path, spawn: Spawn
) -> None:
    """What dlock says on stderr (a disk full under the log, /dev/full, a reader gone)
    may fail to be written: the failure raised, so that on a lost lease dlock died of it
    (status 1) before stopping the command, which ran on without the lock; and every
    status dlock sets itself (conflict, backend, cannot run) read as 1. A stderr that is
    closed sent the messages to stdout instead."""
    pidfile = tmp_path / "child.pid"
    script = f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile} && exec sleep 60"
    env = {**os.environ, "DLOCK_URL": db}
    with open(os.devnull, "w") as nothing, open("/dev/full", "w") as full:
        process = spawn(
            [DLOCK, "run", "--ttl", "1", "--grace", "0.5", name, "--", "sh", "-c", script],
            stdout=nothing,
            stderr=full,
            env=env,
        )
        child = wait_for_pid(pidfile, process)
        with dlock.connect(db) as client:
            assert client.force_release(name)
        assert process.wait(15) == 75
        assert gone(child), "the command ran on without the lock"
        with dlock.connect(db) as client, client.lock(name, ttl=30):
            for args, status in (
                (["run", "-n", "-E", "9", name, "--", "true"], 9),
                (["--url", "sqlite:///proc/no-such-dir/x.db", "status", name], 76),
                (["run", "-w", "-1", name, "--", "true"], 2),
            ):
                result = subprocess.run([DLOCK, *args], stderr=full, env=env, timeout=30)
                assert result.returncode == status, args
                # Closed (2>&-), the messages went to stdout, as data.
                closed = subprocess.run(
                    ["sh", "-c", 'exec "$@" 2>&-', "sh", DLOCK, *args],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                    timeout=30,
                )
                assert (closed.returncode, closed.stdout) == (status, ""), args
        missing = str(tmp_path / "no-such-command")
        cannot_run = subprocess.run(
            [DLOCK, "run", name, "--", missing], stderr=full, env=env, timeout=30
        )
        assert cannot_run.returncode == 127


def test_a_home_that_is_not_utf8_no_longer_fails_every_command(tmp_path: Path) -> None:
    """The help names the default file, so every command built it from $HOME: one named
    in another encoding failed them all with a traceback, even given --url, and
    ``dlock run`` exited 1, "lock busy"."""
    home = os.fsdecode(bytes(tmp_path) + b"/h\xe9")
    env = {k: v for k, v in os.environ.items() if k not in ("DLOCK_URL", "XDG_STATE_HOME")}
    env["HOME"] = home
    for args in (["--url", f"sqlite://{tmp_path}/given.db", "status", "x"], ["status", "x"]):
        result = subprocess.run([DLOCK, *args], capture_output=True, text=True, env=env)
        assert result.returncode == 1 and result.stdout == "x: free\n", result.stderr
    assert os.path.exists(os.fsencode(home) + b"/.local/state/dlock/locks.sqlite3")


def test_a_user_without_a_home_directory_no_longer_fails_every_command(tmp_path: Path) -> None:
    """With no $HOME and no password entry (a container run as a bare UID), every
    command failed with an internal error (70, a traceback), --help and those given
    --url too, as did ``connect()`` of a named SQLite file: the default file's path,
    not needed, could not be made. Only the default is out of reach now: a usage
    error, and $XDG_STATE_HOME still names it."""
    uid = next(uid for uid in range(54321, 65534) if not _has_password_entry(uid))
    probe = ["unshare", "--user", f"--map-user={uid}", "true"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("cannot unshare a user namespace")
    env = {k: v for k, v in os.environ.items() if k not in ("DLOCK_URL", "XDG_STATE_HOME")}
    env.pop("HOME", None)

    def dlock_as_nobody(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        argv = ["unshare", "--user", f"--map-user={uid}", DLOCK, *args]
        return subprocess.run(
            argv, capture_output=True, text=True, env={**env, **extra}, cwd=tmp_path
        )

    helped = dlock_as_nobody("status", "--help")
    assert helped.returncode == 0 and "--url" in helped.stdout, helped.stderr
    named = dlock_as_nobody("--url", f"sqlite://{tmp_path}/named.db", "status", "x")
    assert named.returncode == 1 and named.stdout == "x: free\n", named.stderr
    default = dlock_as_nobody("status", "x")
    assert default.returncode == 2 and "XDG_STATE_HOME" in default.stderr, default.stderr
    empty = dlock_as_nobody("status", "x", DLOCK_URL="")
    assert empty.returncode == 2 and "$DLOCK_URL is empty" in empty.stderr, empty.stderr
    state = dlock_as_nobody("status", "x", XDG_STATE_HOME=str(tmp_path))
    assert state.returncode == 1, state.stderr
    assert (tmp_path / "dlock" / "locks.sqlite3").exists()
    # A relative $HOME would make the file depend on the working directory, as the
    # relative $XDG_STATE_HOME that the XDG spec says to ignore.
    relative = dlock_as_nobody("status", "x", HOME="home")
    assert relative.returncode == 2 and "XDG_STATE_HOME" in relative.stderr, relative.stderr


def _has_password_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_a_holder_written_with_a_label_that_is_not_text_no_longer_fails_the_command(
    tmp_path: Path, name: str
) -> None:
    """The holder column is text any program with the file can write: a label that is
    not a string (``"label": 5``) reached the table printer as is, and ``dlock status``
    died of it with a traceback, ``dlock run -E 9`` with status 1. Unreadable, it names
    an unknown holder, as malformed JSON does."""
    path = tmp_path / "cli.sqlite3"
    db = f"sqlite://{path}"
    with dlock.connect(db) as client, client.lock(name, ttl=30):
        with contextlib.closing(sqlite3.connect(path)) as other, other:
            other.execute(
                "UPDATE dlock_locks SET holder = ?", ('{"host": "h", "pid": 1, "label": 5}',)
            )
        status = dlock_cmd(db, "status", name)
        assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
        assert dlock_cmd(db, "run", "-n", "-E", "9", name, "--", "true").returncode == 9
        listed = json.loads(dlock_cmd(db, "list", "--json").stdout)
        assert [info["holder"] for info in listed] == [{"host": "?", "pid": 0, "label": None}]


def test_an_internal_error_exits_with_a_status_of_its_own(db: str, name: str) -> None:
    """A bug of dlock's own (here: the client library raising what it never should)
    exited 1, the conflict code, which a script reads as "busy" and may skip its job on.
    It exits 70 (EX_SOFTWARE) with the trace on stderr."""
    script = (
        "import sys, dlock\n"
        "from dlock import _cli\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('a bug')\n"
        "_cli.connect = broken\n"
        "sys.exit(_cli.main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "run", name, "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DLOCK_URL": db},
    )
    assert done.returncode == 70, done.stderr
    assert "internal error" in done.stderr and "RuntimeError: a bug" in done.stderr
