"""Real server processes for the tests: started privately, killable, pausable.

Each backend's harness lives in its own module here and builds on :class:`ServerProcess`.
Nothing here talks to a server that happens to run on the machine already.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

#: Ports for pytest-xdist's workers (``gw0``, ``gw1``, ...): a band of ``BAND`` each
#: from ``FIRST_BANDED``, below the kernel's ephemeral range (32768 and up on Linux),
#: where no client connection takes its local port either.
FIRST_BANDED, BAND, BANDS = 20000, 1500, 8
#: Where in its band a worker starts: at random, as two test runs at once (a developer's
#: and a helper's) both have a ``gw0``; starting at the band's first port, they took the
#: same ports in step, and one's servers failed to start ("exited at startup", "address
#: already in use") or a readiness check found the other run's server.
_next_in_band = random.randrange(BAND)


def free_port() -> int:
    """A loopback port nobody listens on right now.

    Each pytest-xdist worker takes ports from a band of its own. Two workers asking
    the kernel could be given one port between one's check and its server's start:
    the second server would fail to start, or a readiness check would find the other
    worker's server and a test would run against it.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return _bindable(0)
    global _next_in_band
    first = FIRST_BANDED + (int(worker[2:]) % BANDS) * BAND
    for _ in range(BAND):
        port = first + _next_in_band % BAND
        _next_in_band += 1
        with contextlib.suppress(OSError):
            return _bindable(port)
    raise RuntimeError(f"no free port in {first}..{first + BAND - 1}")


def _bindable(port: int) -> int:
    """``port`` (0: one the kernel picks) if it can be bound on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def private_dir(prefix: str) -> Path:
    """A temporary directory outside the source tree (a data dir named ``etcd`` once
    shadowed an import)."""
    return Path(tempfile.mkdtemp(prefix=f"dlock-{prefix}-"))


def start_all(servers: Sequence[ServerProcess], then: Callable[[], object] = lambda: None) -> None:
    """Start ``servers`` (then run ``then``, e.g. wait for a quorum): if one fails, kill
    those already running rather than leave them to outlive the test run."""
    try:
        for server in servers:
            server.start()
        then()
    except BaseException as failure:
        stop_every(servers, ServerProcess.kill, failure)


Server = TypeVar("Server")


def stop_every(
    servers: Iterable[Server],
    stop: Callable[[Server], object],
    failure: BaseException | None = None,
) -> None:
    """``stop`` every server, even those after one whose stop fails (a kill whose wait
    times out), then raise ``failure`` if given, else the first error, and say every
    later error on stderr: a loop that stopped at the first left the others running,
    and hid the error that it was in."""
    for server in servers:
        try:
            stop(server)
        except BaseException as error:
            if failure is None:
                failure = error
            else:
                print(f"stopping {server!r} failed too: {error!r}", file=sys.stderr)
    if failure is not None:
        raise failure


class ServerProcess:
    """One server process that a test may kill, pause (SIGSTOP), resume and restart."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        ready: Callable[[], bool],
        *,
        workdir: Path,
        env: dict[str, str] | None = None,
        user: str | None = None,
        startup_timeout: float = 30.0,
        stop_signal: int | None = None,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.ready = ready
        self.workdir = workdir
        self.env = env
        self.user = user
        self.startup_timeout = startup_timeout
        #: A server's own clean, quick shutdown (PostgreSQL: SIGINT); then also used by
        #: restart(), where SIGKILL would leave such a server's children running.
        self.stop_signal = stop_signal
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{name}.log"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
            env={**os.environ, **(self.env or {})},
            user=self.user,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at startup:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} not ready in time:\n{self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def pause(self) -> None:
        """Stop the server and its children (PostgreSQL serves each connection from a
        child in a process group of its own), and wait until they are stopped: the
        server then answers nothing while its host's kernel still acknowledges."""
        family = self._family()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not all(_stopped(pid) for pid in family):
            assert time.monotonic() < deadline, f"{self.name} did not stop"
            time.sleep(0.005)

    def resume(self) -> None:
        for pid in self._family():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _family(self) -> list[int]:
        if self.process is None or self.process.poll() is not None:
            return []
        parent = self.process.pid
        return [parent, *(pid for pid in _pids() if _parent(pid) == parent)]

    def kill(self) -> None:
        if self.process is None:
            return
        self.resume()
        self.signal(signal.SIGKILL)
        self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        """Graceful stop (``stop_signal`` or SIGTERM), then SIGKILL."""
        if self.process is None:
            return
        self.resume()
        self.signal(self.stop_signal or signal.SIGTERM)
        try:
            self.process.wait(30 if self.stop_signal else 10)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        if self.stop_signal is None:
            self.kill()
        else:
            self.stop()
        self.start()


class Partition:
    """A TCP relay to one server that can be cut: while cut, bytes are neither read nor
    passed on, as when a network partition swallows packets (no reset, no FIN). Its
    connections can also be held apart (``hold``): what they carry reaches the server
    late, when ``deliver`` lets it go, as a request held up in the network does."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.port = free_port()
        self.cut = threading.Event()
        self._closed = threading.Event()
        #: One event per relayed connection: set, its pipes reset it (see drop).
        self._links: list[tuple[threading.Event, list[threading.Thread]]] = []
        #: Set while the connections relayed before ``hold`` pass nothing on.
        self._held: list[threading.Event] = []
        #: Bytes that hold the connection whose request carries them (see hold_on);
        #: ``marked`` is set once one did.
        self._marker: bytes | None = None
        self.marked = threading.Event()
        self._links_lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            dropped, held = threading.Event(), threading.Event()
            threads = [
                threading.Thread(
                    target=self._pipe, args=(source, sink, dropped, held, up), daemon=True
                )
                for source, sink, up in ((client, server, True), (server, client, False))
            ]
            # Known to hold() before a byte passes up (the client's first answer waits for
            # the lock): a connection left out, once this thread was slow to add it, went
            # on unheld. Started before drop() can see them, since it joins them.
            with self._links_lock:
                for thread in threads:
                    thread.start()
                self._links.append((dropped, threads))
                self._held.append(held)

    def _pipe(
        self,
        source: socket.socket,
        sink: socket.socket,
        dropped: threading.Event,
        held: threading.Event,
        up: bool,
    ) -> None:
        try:
            source.settimeout(0.05)
        except OSError:
            return  # the other direction's thread ended the connection, and closed both
        with source, sink:
            while not self._closed.is_set():
                if dropped.is_set():
                    for sock in (source, sink):
                        # Closed with unread data and no linger: a reset, the data lost.
                        with contextlib.suppress(OSError):
                            sock.setsockopt(
                                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                            )
                    return
                if self.cut.is_set() or held.is_set():
                    time.sleep(0.01)
                    continue
                try:
                    chunk = source.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                if up:
                    self._hold_if_marked(chunk, held)
                # Read just as the cut began: held back with the rest.
                while (self.cut.is_set() or held.is_set()) and not (
                    dropped.is_set() or self._closed.is_set()
                ):
                    time.sleep(0.01)
                if dropped.is_set():
                    continue
                try:
                    sink.sendall(chunk)
                except OSError:
                    return

    def hold(self) -> None:
        """Hold every connection relayed so far: what it carries, sent already or sent
        later, is passed on only by ``deliver``. Connections made afterwards are relayed
        as before (while not cut)."""
        with self._links_lock:
            for held in self._held:
                held.set()

    def hold_on(self, marker: bytes) -> None:
        """Hold the first connection that sends a request carrying ``marker`` from then
        on, that request included, as ``hold`` does; the others are relayed as before."""
        self.marked.clear()
        self._marker = marker

    def _hold_if_marked(self, chunk: bytes, held: threading.Event) -> None:
        with self._links_lock:
            if self._marker is not None and self._marker in chunk:
                self._marker = None
                held.set()
                self._held.append(held)
                self.marked.set()

    def deliver(self) -> None:
        """Pass on what the connections held by ``hold`` kept back, in order, late."""
        with self._links_lock:
            held, self._held = self._held, []
        for event in held:
            event.clear()

    def drop(self) -> None:
        """Reset every relayed connection, losing the bytes a cut held back (sent, never
        passed on): a connection that dies with requests in flight that the server
        never sees. Connections made afterwards are relayed as before."""
        with self._links_lock:
            links, self._links, self._held = self._links, [], []
        for dropped, _ in links:
            dropped.set()
        for _, threads in links:
            for thread in threads:
                thread.join(5)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class Outage:
    """A backend that a test may cut off: from ``begin`` to ``end`` it answers nothing
    within the timeouts that ``url`` sets."""

    url: str

    def begin(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.end()


class Partitioned(Outage):
    """Servers reached through relays (one each) that are cut, as a network partition
    does: a request in flight when it begins is lost, not held back to be applied when
    it ends (as a paused server would)."""

    def __init__(self, url: Callable[[list[int]], str], ports: list[int]) -> None:
        self.partitions = [Partition(port) for port in ports]
        #: Made from the relays' ports, in the order of ``ports``.
        self.url = url([partition.port for partition in self.partitions])

    def begin(self) -> None:
        for partition in self.partitions:
            partition.cut.set()

    def end(self) -> None:
        for partition in self.partitions:
            partition.drop()
            partition.cut.clear()

    def close(self) -> None:
        self.end()
        for partition in self.partitions:
            partition.close()


class SharedRelays(Partitioned):
    """Partitioned through relays that outlive the test (a session's cluster, whose
    nodes announce them): closing ends the outage and leaves the relays."""

    def __init__(self, partitions: list[Partition], url: str) -> None:
        self.partitions = partitions
        self.url = url

    def close(self) -> None:
        self.end()


class WriteLocked(Outage):
    """An SQLite file that another connection keeps write-locked (``BEGIN EXCLUSIVE``)
    past the client's short ``busy_timeout``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite://{path}?busy_timeout=0.5"
        self._blocker: sqlite3.Connection | None = None

    def begin(self) -> None:
        self._blocker = sqlite3.connect(self.path, isolation_level=None)
        self._blocker.execute("BEGIN EXCLUSIVE")

    def end(self) -> None:
        if self._blocker is not None:
            self._blocker.close()
            self._blocker = None


def require_binary(name: str, package: str) -> str:
    """Path of a server binary; the README's test command installs ``package``."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: run ./scripts/test, which installs {package}")
    return path


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2 :].split()


def _parent(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if fields else 0


def _stopped(pid: int) -> bool:
    fields = _stat(pid)
    return not fields or fields[0] in ("T", "t", "Z", "X")
