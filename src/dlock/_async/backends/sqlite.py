"""The embedded default: a lease table in a SQLite file, for processes on one host.

SQLite has no client/server split and no notifications, so waiters back off with
jitter. Every statement runs in a worker thread under asyncio.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ... import _fork, _sqlite_fork
from ..._backoff import Backoff
from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._options import bounded_seconds, query_options
from ..._registry import is_default_sqlite_url
from ..._sql import (
    DEFAULT_TABLES,
    check_identifier,
    encode_name,
    lock_info,
    sqlite_statements,
)
from ..._types import Acquired, Busy, Holder, Lease, LockInfo
from .._primitives import run_blocking, run_blocking_in_order
from ..backend import AsyncBackend

T = TypeVar("T")

#: Only Linux has a boot clock and a boot id: elsewhere, leases are timed by the wall clock.
LINUX = sys.platform.startswith("linux")
#: SQLite's ``synchronous`` settings that dlock takes: ``normal`` may lose the last
#: grants to a power loss (the docs' trade for speed); ``off`` syncs nothing, and a
#: crash of the host or a power loss can corrupt the file, so it is refused.
SYNCHRONOUS_MODES = ("normal", "full", "extra")


BOOT_ID = "/proc/sys/kernel/random/boot_id"
TIME_NAMESPACE_OFFSETS = "/proc/self/timens_offsets"
TIME_NAMESPACE = "/proc/self/ns/time"
TIME_NAMESPACE_FOR_CHILDREN = "/proc/self/ns/time_for_children"


def _read_boot_id() -> str:
    with open(BOOT_ID) as f:
        boot = f.read().strip()
    if not boot:
        raise ValueError(f"{BOOT_ID} is empty")
    return boot


def _read_boot_clock_offset() -> float:
    """How far this process's boot clock runs ahead of the host's: a time namespace
    (Linux 5.6+: ``unshare --time``, CRIU restoring a container) offsets it.

    ``timens_offsets`` shows the offsets of the namespace that the process's children
    get (``time_for_children``), which is its own unless it has unshared one for them
    and not entered it (``unshare(CLONE_NEWTIME)``, as ``unshare --time`` does before
    it forks): such a process reads the clock of its own namespace and cannot learn
    that one's offset, so it is refused rather than timed a day off, say.
    """
    try:
        own = os.readlink(TIME_NAMESPACE)
    except FileNotFoundError:  # a kernel without time namespaces
        return 0.0
    with open(TIME_NAMESPACE_OFFSETS) as f:
        lines = f.read().splitlines()
    # Read after the offsets: the namespace for children is the process's own again
    # only if it moves into it itself (setns), which a process with threads cannot do.
    if os.readlink(TIME_NAMESPACE_FOR_CHILDREN) != own:
        raise BackendError(
            "SQLite leases are timed by the host's boot clock, and this process has made"
            " a time namespace for its children (unshare(CLONE_NEWTIME)) without being in"
            f" it: {TIME_NAMESPACE_OFFSETS} shows the children's clock offsets, not those"
            " of the clock this process reads, so it cannot tell the host's time. Its"
            " children, in that namespace, can: use dlock from one of them"
        )
    for line in lines:
        clock, seconds, nanoseconds = line.split()
        # Named since Linux 5.6; the clock's number is accepted on writing.
        if clock in ("boottime", str(time.CLOCK_BOOTTIME)):
            return int(seconds) + int(nanoseconds) / 1e9
    return 0.0


#: The host's boot id and this process's boot clock offset, and the process generation
#: (see dlock._fork) they were read in: a forked child may be in another time namespace.
#: Read once per generation (a system call per lease operation would cost more than the
#: rest of the clock): a process that used dlock and then unshared a time namespace for
#: its children keeps its own offset, which is right, as its clock has not changed; one
#: that moves into another namespace itself (setns(), single-threaded only, or
#: checkpointed and restored by CRIU) would keep a stale offset and boot id.
_boot_clock: tuple[int, str, float] | None = None


def _host_boot_clock() -> tuple[str, float]:
    global _boot_clock
    clock = _boot_clock
    if clock is None or clock[0] != _fork.generation:
        generation = _fork.generation
        try:
            clock = (generation, _read_boot_id(), _read_boot_clock_offset())
        except (OSError, ValueError) as exc:
            # Falling back to the wall clock, untagged, would make every other
            # process's lease look like one of an earlier boot, dead: taken over.
            raise BackendError(
                "SQLite leases are timed by the host's boot clock, tagged with its boot"
                f" id, and this process cannot read the boot id ({BOOT_ID}) or its time"
                f" namespace's clock offset ({TIME_NAMESPACE_OFFSETS}): {exc}. Without"
                " them it cannot tell a live lease from one of an earlier boot; make"
                " /proc available, or use a server backend"
            ) from exc
        _boot_clock = clock
    return clock[1], clock[2]


def _boot_and_now() -> tuple[str, float]:
    """The host's clock for leases: time since boot, tagged with the boot's identity.

    Wall-clock steps (NTP, a VM resumed) would shorten or stretch leases; the boot
    clock does not step, and a lease from an earlier boot is dead by definition. Every
    process on the host must read the same clock: in a time namespace, the host's is
    this process's less the namespace's offset. Where there is no boot clock (not
    Linux), the wall clock it is; on Linux, a process that cannot read the boot id
    is refused (``BackendError``) rather than timed by another clock than the others.
    """
    if LINUX:
        boot, offset = _host_boot_clock()
        return boot, time.clock_gettime(time.CLOCK_BOOTTIME) - offset
    return "", time.time()


#: The directories dlock makes (its default file's, and any file's for ``dlock init``):
#: writable by their creator only, as SQLite makes the file (0644), less the umask,
#: even when that is 0: another user who could write in the directory could delete or
#: replace the lock file in use (see docs/sqlite.md).
DIRECTORY_MODE = 0o755


def _make_directories(directory: Path) -> None:
    """``mkdir -p`` with :data:`DIRECTORY_MODE` for every directory made: ``Path.mkdir``
    gives the missing parents the default mode, 0777 less the umask."""
    for path in (*reversed(directory.parents), directory):
        if not path.is_dir():
            with contextlib.suppress(FileExistsError):  # made by another process meanwhile
                os.mkdir(path, DIRECTORY_MODE)


#: SQLITE_BUSY, SQLITE_LOCKED: another connection holds the lock the statement needs.
BUSY_CODES = (5, 6)
#: SQLITE_IOERR: reading or writing the file failed.
IO_ERROR = 10
#: What a failed read or write may come from besides the disk.
IO_ERROR_HINT = (
    " (if the lock file was deleted or replaced while other processes had it open, its"
    " -wal and -shm files at the path are still theirs, and the new file cannot be used"
    " until they close it: see docs/sqlite.md)"
)


def _busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+; extended codes
    if code is not None:
        return (code & 0xFF) in BUSY_CODES
    return "locked" in str(exc) or "busy" in str(exc)


def _io_failed(exc: sqlite3.Error) -> bool:
    """A failed read or write of the file: worth retrying, as it may pass (a file
    deleted or replaced in use, until the processes that had it open close it)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return bool((code & 0xFF) == IO_ERROR)
    return "disk I/O error" in str(exc)


class AsyncSQLiteBackend(AsyncBackend):
    def __init__(
        self,
        path: str,
        *,
        table: str = DEFAULT_TABLES["lease"],
        busy_timeout: float = 10.0,
        synchronous: str = "full",
        create_directory: bool = False,
    ) -> None:
        if path.startswith("//") and not path.startswith("///"):
            # sqlite:////abs/path.db, as SQLAlchemy spells an absolute path: the same file.
            path = path[1:]
        # Resolved now: every open (after a fork, or of a replaced file) must find the
        # file the first one did, whatever directory the process has moved to since.
        try:
            self._path = os.path.abspath(path)
        except OSError as exc:  # the working directory was deleted
            raise ConfigurationError(
                f"{path!r} is relative to the working directory, which cannot be found"
                f" ({exc.strerror}); name the file by an absolute path"
            ) from None
        self._table = check_identifier(table, "table")
        if self._table.lower().startswith("sqlite_"):
            raise ConfigurationError(
                f"table {table!r}: SQLite keeps names that start with sqlite_ for itself"
            )
        if synchronous not in SYNCHRONOUS_MODES:
            why = (
                ": off syncs nothing, and a crash of the host can corrupt the lock file"
                if synchronous == "off"
                else ""
            )
            raise ConfigurationError(
                f"synchronous={synchronous!r}: use full (the default), normal or extra{why}"
            )
        self._synchronous = synchronous
        #: Only dlock's own default file (in the user's state directory) gets its
        #: directory made: a missing directory in a path the user named is more likely
        #: a typo, which would give a lock file of its own, excluding nobody.
        self._create_directory = create_directory
        # SQLite takes it as an int of milliseconds: past that, it would wrap to none.
        self._busy_timeout = bounded_seconds(busy_timeout, "busy_timeout")
        self._connection: sqlite3.Connection | None = None
        #: The (device, inode) of the file the connection has open (see _same_file).
        self._file: tuple[int, int] | None = None
        # One connection shared by the caller's thread and the renewer's, one at a time;
        # and the thread using it (see dlock._sqlite_fork).
        self._mutex = threading.Lock()
        #: Lease writes whose caller was cancelled while their thread ran on (asyncio).
        self._cut_off: set[Any] = set()
        self._user: int | None = None
        #: Closed by aclose(): a statement made since (the give-back of an acquire whose
        #: grant came back after its client's close stopped waiting for it) opens the
        #: file for itself only, as nothing would close it later.
        self._closed = False
        # Quoted: a plain identifier may be a keyword (``order``), as the servers allow.
        self._sql = sqlite_statements(f'"{self._table}"')
        _sqlite_fork.register(self)  # its connection is closed before a fork

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> AsyncSQLiteBackend:
        parts = urlsplit(url)
        if parts.netloc:
            raise ConfigurationError(
                f"{url!r}: a sqlite URL names a file, as sqlite:///absolute/path.db "
                "or sqlite:relative/path.db"
            )
        # %FF is the byte 0xFF of a file name not in UTF-8, as the OS gives it to Python.
        path = unquote(parts.path, errors="surrogateescape")
        if not path:
            raise ConfigurationError(f"{url!r} names no database file")
        if path.lstrip("/") == ":memory:":
            # Every connection would get a database of its own: no exclusion at all.
            # sqlite:///:memory: is SQLAlchemy's spelling of it, not a file in / here.
            raise ConfigurationError(
                f"{url!r}: an in-memory SQLite database is private to one connection, so"
                " it cannot lock anything against another client; name a file"
            )
        if "\x00" in path:
            raise ConfigurationError(f"{url!r}: a database file name cannot contain NUL")
        settings: dict[str, Any] = query_options(parts.query)
        settings.update(options)
        unknown = set(settings) - {"table", "busy_timeout", "synchronous"}
        if unknown:
            raise ConfigurationError(f"unknown sqlite option(s): {', '.join(sorted(unknown))}")
        return cls(
            path,
            table=settings.get("table", DEFAULT_TABLES["lease"]),
            busy_timeout=bounded_seconds(settings.get("busy_timeout", 10.0), "busy_timeout"),
            synchronous=str(settings.get("synchronous", "full")).lower(),
            create_directory=is_default_sqlite_url(url),
        )

    def schema_sql(self) -> list[str]:
        """The DDL ``dlock init`` runs (and prints), as on the server databases."""
        return [self._sql["schema"]]

    async def init(self) -> None:
        """Create the lock table now (opening the database does), and the file's
        directory if missing: asked for explicitly, not a typo met by a lock."""
        self._create_directory = True
        await run_blocking(self._run, "SELECT 1", {})

    def _connect(self) -> sqlite3.Connection:
        """Open the file. Only a file kept locked past ``busy_timeout`` is worth retrying
        (``BackendUnavailable``, as in a statement); a file that is not a database, a
        directory, or one this process may not open or create is refused."""
        conn: sqlite3.Connection | None = None
        try:
            self._make_or_check_directory()
            conn = sqlite3.connect(
                self._path,
                timeout=self._busy_timeout,
                isolation_level=None,
                check_same_thread=False,
            )
            self._use_wal(conn)
            conn.execute(f"PRAGMA synchronous={self._synchronous}")
            conn.execute(self._sql["schema"])
        except (OSError, sqlite3.Error) as exc:
            if conn is not None:
                conn.close()
            message = f"cannot open SQLite database {self._path!r}: {exc}"
            if isinstance(exc, sqlite3.Error) and _busy(exc):
                raise BackendUnavailable(message) from exc
            if isinstance(exc, sqlite3.Error) and _io_failed(exc):
                raise BackendUnavailable(message + IO_ERROR_HINT) from exc
            raise BackendError(message + self._unwritable_directory()) from exc
        return conn

    def _make_or_check_directory(self) -> None:
        directory = Path(self._path).parent
        if self._create_directory:
            _make_directories(directory)
        elif not directory.is_dir():
            raise BackendError(
                f"cannot open SQLite database {self._path!r}: its directory {str(directory)!r}"
                " does not exist (dlock makes only its default file's directory, and"
                " `dlock init` any file's: create it, or check the path)"
            )

    def _unwritable_directory(self) -> str:
        """Why a writable file may still not open: SQLite's own message ("unable to open
        database file", "attempt to write a readonly database") names the file, but in
        WAL mode every opener creates the -wal and -shm files beside it."""
        directory = os.path.dirname(self._path)
        if not os.path.isdir(directory) or os.access(directory, os.W_OK):
            return ""
        return (
            f" (the directory {directory!r} is not writable: SQLite creates the database's"
            " -wal and -shm files beside it, so every process that locks needs to write there)"
        )

    def _identity(self) -> tuple[int, int] | None:
        """The (device, inode) of the file now at the path, or None if there is none."""
        try:
            status = os.stat(self._path)
        except OSError:
            return None
        return status.st_dev, status.st_ino

    def _open(self) -> sqlite3.Connection:
        """Connect to the file at the path, and note which file that is. A file replaced
        while it was being opened is opened again (once): the connection may be to the
        old one."""
        before = self._identity()
        conn = self._connect()
        self._file = self._identity()
        if before is not None and before != self._file:
            conn.close()
            conn = self._connect()
            self._file = self._identity()
        return conn

    def _same_file(self) -> bool:
        """Whether the path still names the file the connection has open. One deleted
        (a clean-up) or replaced (``mv``) while in use is a file no process that opens
        the path sees: leases taken and renewed there exclude nobody. A stat per
        transaction, against an fsync per commit."""
        return self._file is not None and self._identity() == self._file

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL (kept in the file: the first opener does it).

        Switching takes an exclusive lock, and SQLite answers "database is locked" at
        once, without its busy handler, when another process opens the new file at the
        same moment: try again with jitter until the busy timeout.
        """
        deadline = time.monotonic() + self._busy_timeout
        backoff = Backoff()
        for attempt in itertools.count():
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(backoff.delay(attempt, None, notifies=False))

    def _run(self, statement: str, params: dict[str, Any]) -> list[Any]:
        """Run one statement (its own transaction) and return its rows."""
        return self._run_batch(statement, [params])[0]

    def _run_batch(self, statement: str, batch: list[dict[str, Any]]) -> list[list[Any]]:
        """Run a statement once per parameter set, in one transaction (one fsync)."""
        return [rows for rows, _ in self._transaction([(statement, p) for p in batch])]

    def _transaction(self, steps: list[tuple[str, dict[str, Any]]]) -> list[tuple[list[Any], int]]:
        """Run statements in one transaction; each one's rows and changed-row count."""
        _sqlite_fork.check_process()
        with self._using():
            try:
                return self._transaction_now(steps)
            finally:
                if self._closed and self._connection is not None:
                    self._connection.close()
                    self._connection = None

    def _transaction_now(
        self, steps: list[tuple[str, dict[str, Any]]]
    ) -> list[tuple[list[Any], int]]:
        """_transaction's work, under the mutex."""
        if self._connection is not None and not self._same_file():
            # Closing skips the checkpoint and the WAL's deletion: SQLite sees the
            # file has moved, and the WAL at the path is the new file's.
            self._connection.close()
            self._connection = None
        if self._connection is None:
            self._connection = self._open()
        conn = self._connection
        try:
            if len(steps) == 1:
                cursor = conn.execute(*steps[0])
                return [(cursor.fetchall(), cursor.rowcount)]
            conn.execute("BEGIN IMMEDIATE")
            try:
                results = []
                for statement, params in steps:
                    cursor = conn.execute(statement, params)
                    results.append((cursor.fetchall(), cursor.rowcount))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return results
        except sqlite3.Error as exc:
            if _busy(exc):
                # Another connection kept the file write-locked past busy_timeout:
                # not answering in time, like a hung server, and worth retrying.
                raise BackendUnavailable(
                    f"SQLite {self._path!r}: {exc} for busy_timeout={self._busy_timeout:g} s"
                ) from exc
            if _io_failed(exc):
                raise BackendUnavailable(f"SQLite {self._path!r}: {exc}{IO_ERROR_HINT}") from exc
            raise BackendError(f"SQLite {self._path!r}: {exc}") from exc

    def _acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        boot, now = _boot_and_now()
        params = {
            "name": encode_name(name),
            "owner": token,
            "boot": boot,
            "now": now,
            "ttl": ttl,
            "holder": holder.to_json(),
            "reentrant": reentrant,
        }
        rows = self._run(self._sql["acquire"], params)
        if rows:  # granted (or re-entered); otherwise ask how long the current lease lasts
            return Acquired(fencing_token=rows[0][0], count=rows[0][1])
        left = self._run(self._sql["time_left"], params)
        return Busy(retry_after=max(0.0, left[0][0]) if left and left[0][0] is not None else None)

    async def acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        return await self._in_order(self._acquire, name, token, ttl, holder, reentrant)

    def _release(self, name: str, token: str) -> int | None:
        boot, now = _boot_and_now()
        params = {"name": encode_name(name), "owner": token, "boot": boot, "now": now}
        rows = self._run(self._sql["release"], params)
        return rows[0][0] if rows else None

    async def release(self, name: str, token: str) -> int | None:
        return await self._in_order(self._release, name, token)

    def _extend_all(self, leases: list[Lease]) -> list[bool]:
        boot, now = _boot_and_now()
        batch = [
            {"name": encode_name(x.name), "owner": x.token, "boot": boot, "now": now, "ttl": x.ttl}
            for x in leases
        ]
        return [bool(rows) for rows in self._run_batch(self._sql["extend"], batch)]

    async def extend(self, name: str, token: str, ttl: float) -> bool:
        result = await self._in_order(self._extend_all, [Lease(name, token, ttl)])
        return result[0]

    async def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        return await self._in_order(self._extend_all, list(leases))

    async def _in_order(self, func: Callable[..., T], *args: Any) -> T:
        """A lease write, after those whose caller was cancelled while their thread ran
        on (asyncio): a give-back must not overtake the acquire it gives back."""
        return await run_blocking_in_order(self._cut_off, func, *args)

    def _infos(self, statement: str, params: dict[str, Any]) -> list[LockInfo]:
        boot, now = _boot_and_now()
        rows = self._run(statement, {**params, "boot": boot, "now": now})
        return [lock_info(*row) for row in rows]

    async def inspect(self, name: str) -> LockInfo | None:
        infos = await run_blocking(self._infos, self._sql["inspect"], {"name": encode_name(name)})
        return infos[0] if infos else None

    async def list(self, prefix: str) -> list[LockInfo]:
        return await run_blocking(self._infos, self._sql["list"], {"prefix": encode_name(prefix)})

    def _force_release(self, name: str) -> bool:
        boot, now = _boot_and_now()
        rows = self._run(
            self._sql["force_release"], {"name": encode_name(name), "boot": boot, "now": now}
        )
        return bool(rows)

    async def force_release(self, name: str) -> bool:
        return await run_blocking(self._force_release, name)

    def _prune(self, older_than: float, limit: int) -> int:
        boot, now = _boot_and_now()
        params = {"boot": boot, "now": now, "age": older_than, "batch": limit}
        # One transaction: an acquire sees either the old row or the raised floor.
        steps = [(self._sql["raise_floor"], params), (self._sql["prune"], params)]
        return self._transaction(steps)[1][1]

    async def prune(self, older_than: float, limit: int) -> int:
        """Every name used keeps a row; names made again count on from the largest
        token of the rows deleted (kept in the floor row)."""
        return await run_blocking(self._prune, older_than, limit)

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        with self._mutex:
            self._user = threading.get_ident()
            try:
                yield
            finally:
                self._user = None

    def _close(self) -> None:
        self._closed = True
        if _sqlite_fork.refusal_now() is not None:
            # Left alone: its statement may be the parent's, cut off by the fork (and
            # its mutex held by a thread that is not here).
            return
        with self._using():
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    async def aclose(self) -> None:
        await run_blocking(self._close)


BACKEND = AsyncSQLiteBackend
