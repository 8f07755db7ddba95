# DO NOT EDIT: generated from src/dlock/_async/backends/_server_sql.py by scripts/unasync.py.
"""What the MariaDB/MySQL and PostgreSQL backends share: pooling, both modes, errors.

Each database module supplies the driver calls and its dialect's statements
(``dlock._sql``); the lease rules, the session-lock bookkeeping and the waiting live
here once.

Lease mode keeps leases in a table, decided by the server's clock; its waiters queue on
the database's own lock (a turnstile), so a release hands the lease over inside the
server. Session mode takes the database's own lock (``GET_LOCK``, advisory locks) on a
connection dedicated to it, and pairs it with a lease row renewed like lease mode's (in
batches, on any connection). A crashed holder's connection closes and frees the lock at
once; a holder that stops renewing (paused, partitioned) is evicted by the next acquirer
once its lease has run out by the server's clock, by ending its database session.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import select
import sys
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._fork import ForkFollower
from ..._sql import DEFAULT_TABLES, NoSuchSchema, ServerSettings, encode_name, lock_info
from ..._types import Acquired, Busy, Holder, Lease, LockInfo
from ..._validation import SHORTEST_PRUNE_AGE
from .._primitives import (
    Cancelled,
    call_with_timeout,
    current_task,
    sleep,
    spawn,
    uncancel,
    wait_done,
)
from ..backend import Backend, Waiter

#: Idle connections kept per backend, for statements and (apart) for lease waits; more
#: are closed when given back.
POOL_SIZE = 16
#: Where ``call_with_timeout`` bounds a statement (under asyncio), it does so this long
#: after the driver's own bound, so that a driver which has one ends its wait itself (a
#: cancelled psycopg query is first cancelled on the server, which a hung server makes
#: last up to 1 s more on dlock's connections, 10 s on an application's).
BACKSTOP = 0.5
#: Names known to have a row; more than this many and the record starts over.
KNOWN_NAMES = 10_000
#: How long a name seen held stays known to have a row (its busy answers then need no
#: second query), in seconds: far less than the shortest age ``prune`` accepts.
KNOWN_FOR = SHORTEST_PRUNE_AGE / 10
#: Seconds between the give-backs of a turnstile wait cut off in flight, until its own
#: bound has passed (``_give_back_cut_off``).
CUT_OFF_RETRY = 0.1
#: Owner tokens kept whose give-backs got no answer until the core asks about them
#: (``may_write_late``); more, and the oldest are forgotten (a lock object dropped
#: unused never asks).
LATE_WRITERS = 10_000


@dataclass
class Result:
    rows: list[tuple[Any, ...]]
    rowcount: int
    insert_id: int


@dataclass
class Conn:
    """A driver connection and what we set on its session."""

    raw: Any
    #: The database's id of this session (backend pid, connection id).
    session_id: int | None = None
    #: Where the server sees this session come from (MySQL: host and port), which tells
    #: it apart from a later session of the same id (the server restarted).
    session_address: str | None = None
    #: How many times it went back to the pool: a reused one may have died meanwhile.
    uses: int = 0
    #: The server's idle timeout is off for this session (it held a lock or waited).
    no_idle_timeout: bool = False
    #: A borrowed session's own idle timeout, put back before it is returned.
    idle_timeout: Any = None
    #: A connection pooler (PgBouncer and the like) stands between us and the server,
    #: which may run consecutive statements in different sessions; None: not known yet.
    behind_proxy: bool | None = None
    #: The backend's own prepared statements (SQL PREPARE) on this session.
    prepared: set[str] = field(default_factory=set)
    #: Borrowed from the application's pool (``client=``), else ours to close.
    loan: Loan | None = None
    #: The event loop it was made in (under asyncio; None in the sync face): it can be
    #: neither used nor closed in another.
    loop: Any = None
    #: Closed, or given back closed (``_drop``).
    dropped: bool = False
    #: Statements begun on it, and whether one is waiting for its answer: a socket
    #: readable meanwhile holds that answer, not the server's word that it ended it.
    statements: int = 0
    running: bool = False


@dataclass
class Loan:
    """How a connection borrowed from the application's pool goes back: as it came
    (its own autocommit setting), through the context manager that lent it or
    SQLAlchemy's pooled-connection proxy."""

    autocommit: bool
    context: Any = None
    proxy: Any = None


@dataclass
class Held:
    """A session lock held by this backend: its connection is never pooled meanwhile."""

    conn: Conn
    name: str
    key: Any
    fence: int
    count: int = 1


class ServerSQLBackend(Backend):
    """The shared part; subclasses implement the ``_driver_*`` methods and lease SQL."""

    #: The server's blocking lock waits whole multiples of this many seconds (MySQL 8's
    #: ``GET_LOCK``); None or 0: any wait.
    _wait_grain: float | None = None
    #: Whether a qualified table is named by the first connection too, for one spelling
    #: of the lock keys (PostgreSQL quotes reserved words); else it is used as given.
    _pins_qualified_table = False

    def __init__(self, settings: ServerSettings):
        self._settings = settings
        self._session_mode = settings.mode == "session"
        self.knows_losses = self._session_mode  # see lease_lost
        self._use_table(settings.table)
        #: Whether ``_table`` is the table's full name, as every statement and lock key
        #: spells it. An unqualified table is named in full once the client's first
        #: connection has found it (``_pin_table``).
        self._table_pinned = "." in settings.table and not self._pins_qualified_table
        # A session-mode wait is the database's own lock: it cannot miss a release, so
        # a blocking acquire needs no attempt before entering the waiter.
        self.queues_waiters = self._session_mode
        self._idle: list[Conn] = []
        self._schema_ready = not settings.create_table
        #: Whether the table was found made for this client's mode (``_check_table_kind``).
        self._table_kind_checked = False
        self._held: dict[str, Held] = {}
        #: Session locks a waiter obtained inside the server, for the next acquire.
        self._parked: dict[str, Held] = {}
        #: Session waiters by owner token, told the latest attempt's parameters.
        self._waiting: dict[str, _SessionWaiter] = {}
        #: Lease mode: names whose row exists, so a busy answer needs no second query;
        #: by when (``time.monotonic``) this backend last saw the name's lease held.
        self._known: dict[bytes, float] = {}
        #: Lease mode: connections that queue on turnstiles, apart from the statement pool.
        self._queueing: list[Conn] = []
        #: Lease waiters by owner token: the one in front of the turnstile acquires on its
        #: own connection.
        self._front: dict[str, TurnstileWaiter] = {}
        #: Leases taken in front of the turnstile, by owner token: the turnstile stays
        #: held on their connection until they end.
        self._gates: dict[str, Gate] = {}
        #: Clean-ups of lease waiters cut off, running in the background, until each
        #: is done: the token's next acquire and ``close`` wait for them, and one an
        #: event loop ended before it was done runs again in the next (``_follow_loop``).
        self._clean_ups: dict[TurnstileWaiter, Any] = {}
        #: Owner tokens whose clean-ups sent a give-back that got no answer: it may
        #: reach the server at any later time, and free a hold taken under that token.
        self._late_writers: dict[str, bool] = {}
        #: The event loop that made the connections kept above (``_follow_loop``).
        self._loop: Any = None
        #: Our own connections (not borrowed) from their making until they are closed,
        #: by ``id``: wherever they are, pooled or in a call in flight, a forked child
        #: disowns them all (``_forget_parent``).
        self._ours: dict[int, Conn] = {}
        #: A forked child forgets them on first use (``_forget_parent``).
        self._follow_fork = ForkFollower(self._forget_parent)
        self._closed = False

    # -- driver hooks ----------------------------------------------------------------

    @abstractmethod
    def _statements(self, table: str) -> tuple[dict[str, str], str]:
        """This database's statements and schema DDL for ``table``."""

    @abstractmethod
    def _driver_table_durable(self, conn: Conn) -> bool | None:
        """Whether the lock table survives a restart: a plain table, as lease mode makes
        it, not an UNLOGGED (PostgreSQL) or MEMORY (MySQL) one, as session mode makes
        its own; None if there is no such table."""

    @abstractmethod
    def _driver_find_table(self, conn: Conn, table: str) -> str:
        """The unqualified ``table`` named in full, as ``conn`` finds it (or would
        create it), or ConfigurationError if it has nowhere to be; a qualified one (only
        where ``_pins_qualified_table``) in the same spelling."""

    @abstractmethod
    def _driver_connect(self) -> Any:
        """A new connection from the URL's settings."""

    @abstractmethod
    def _driver_is_connection(self, value: Any) -> bool:
        """True for the driver's own connection object (which is a context manager too)."""

    @abstractmethod
    def _driver_adopt(self, raw: Any) -> bool:
        """Make a connection from ``client=`` fit for dlock (autocommit), or refuse it
        with ConfigurationError; return its autocommit setting before. One inside a
        transaction is refused (``_refuse_open_transaction``)."""

    def _driver_setup(self, conn: Conn) -> None:
        """Give a new connection of ours the session settings dlock's statements need.
        A borrowed connection keeps the application's."""

    @abstractmethod
    def _driver_restore(self, raw: Any, autocommit: bool) -> None:
        """Give a borrowed connection its own autocommit setting back."""

    def _driver_end_loan(self, context: Any, closed: bool) -> None:
        """Return a connection to the pool whose context manager lent it; ``closed``:
        it goes back closed, and the pool makes a new one in its place."""
        context.__exit__(None, None, None)

    @abstractmethod
    def _driver_execute(self, raw: Any, sql: str, params: dict[str, Any], timeout: float) -> Result:
        """Run ``sql``; a driver that can bound its own wait for the answer does so by
        ``timeout`` seconds (the sync face has no other bound)."""

    @abstractmethod
    def _driver_close(self, raw: Any) -> None: ...

    @abstractmethod
    def _driver_abandon(self, raw: Any) -> None:
        """Close a connection made in an event loop that has ended, without that loop;
        where the driver cannot, leave it to the garbage collector."""

    def _driver_disown(self, raw: Any) -> None:
        """Let go of this process's copy of a connection its parent made, whose socket
        is /dev/null here already (``_disown``); a thread of the parent may have been
        using it at the fork."""
        self._driver_abandon(raw)

    @abstractmethod
    def _driver_fileno(self, raw: Any) -> int:
        """The file descriptor of the connection's socket."""

    @abstractmethod
    def _driver_idle_dead(self, raw: Any) -> bool:
        """True when an idle connection is known dead without a round trip: the server
        closed it (restart, killed session) or sent something unasked for."""

    @abstractmethod
    def _driver_session_ended(self, exc: BaseException) -> bool:
        """True when a statement's failure says the server ended the session (killed,
        shut down, its connection closed), not that no answer came in time."""

    @abstractmethod
    def _driver_error(self, exc: BaseException) -> BackendError | None:
        """The dlock error for a driver exception, or None if it is not the driver's."""

    @abstractmethod
    def _is_lock_timeout(self, exc: BaseException) -> bool:
        """True when a blocking lock wait ended by its timeout (not a failure)."""

    @abstractmethod
    def _session_fence(self, result: Result) -> tuple[int, int | None] | None:
        """(fence, session id) from a session acquire, or None if the lock was busy."""

    def _session_unrecorded(self, result: Result) -> bool:
        """The session acquire took the lock, but the name has no row yet (its first
        use): ``session_record`` is run next on the same connection. Only where the
        acquire statement does not create the row itself."""
        return False

    @abstractmethod
    def _session_key(self, name: str) -> Any: ...

    @abstractmethod
    def _session_time_left(self, name: str, result: Result) -> float | None:
        """Seconds left on the lease of the holder of a busy session lock, if known."""

    @abstractmethod
    def _session_evict(self, name: str) -> int | None:
        """End the session of a holder whose lease has run out (it still holds the lock);
        the session ended, or None if there was none to end."""

    # -- connections -----------------------------------------------------------------

    def schema_sql(self) -> list[str]:
        """The DDL ``dlock init`` runs (and prints) for teams that manage migrations."""
        return [self._schema]

    def init(self) -> None:
        """Create the lock table now, whatever ``create_table`` says."""
        self._follow_loop()
        self._schema_ready = False
        conn = self._take()
        # A new connection has just run the DDL; a pooled one may predate the table.
        if not self._schema_ready:
            try:
                self._ensure_schema(conn)
            except BaseException:
                self._drop(conn)
                raise
        self._give(conn)

    def _connect(self) -> Conn:
        if self._closed:
            raise BackendError("this dlock client is closed")
        bound = self._settings.connect_timeout + 1
        try:
            raw, loan = call_with_timeout(self._open(), bound)
        except ConfigurationError:
            raise
        except Exception as exc:
            # A pool that has nothing to lend (SQLAlchemy's own timeout, or ours on a
            # pool that waits for ever) is a server out of reach for now, as a
            # connection that does not come is.
            address = self._settings.address
            if isinstance(exc, TimeoutError):
                raise BackendUnavailable(
                    f"{address}: cannot connect: no connection within {bound:g} s"
                    " (connect_timeout + 1)"
                ) from exc
            if _pool_timed_out(exc):
                raise BackendUnavailable(
                    f"{address}: cannot connect: the client= pool lent no connection in time: {exc}"
                ) from exc
            if _pool_closed(exc):
                # psycopg_pool's is a psycopg OperationalError, read as the server out of
                # reach; a closed pool lends nothing ever again.
                raise BackendError(
                    f"{address}: cannot connect: the client= pool is closed: {exc}"
                ) from exc
            raise self._wrap(exc, "cannot connect") from exc
        conn = Conn(raw, loan=loan, loop=_running_loop())
        if loan is None:
            self._ours[id(conn)] = conn
        try:
            if loan is None:
                self._driver_setup(conn)
            # Ours are known from their setup; a borrowed one is asked (once).
            if self._session_mode and (
                conn.behind_proxy if loan is None else self._behind_proxy(conn)
            ):
                raise ConfigurationError(
                    "session mode is refused through a connection pooler (PgBouncer, "
                    "Odyssey, RDS Proxy and the like: the server's id of the session is "
                    "not the one given at connect). Pooling by transaction would run the "
                    "lock's statements in different server sessions and leave the lock on "
                    "a session that other clients then use. Connect session mode to the "
                    "database directly, or use lease mode, which works through poolers"
                )
            if not self._table_pinned:
                self._pin_table(conn)
            if not self._schema_ready:
                self._ensure_schema(conn)
            if not self._table_kind_checked:
                self._check_table_kind(conn)
        except BaseException:
            self._drop(conn)
            raise
        return conn

    def _use_table(self, table: str) -> None:
        self._table = table
        self._sql, self._schema = self._statements(table)

    @staticmethod
    def _refuse_open_transaction(status: str) -> None:
        """dlock's statements commit on their own: adopting a connection in the middle of
        the application's transaction would commit its unfinished work with them (MySQL
        commits when autocommit is turned on) or fail (PostgreSQL)."""
        raise ConfigurationError(
            f"client= gave a connection inside a transaction ({status}): dlock commits its "
            "own statements, and would commit the application's work with them; lend a "
            "connection that is not in a transaction"
        )

    def _pin_table_first(self) -> None:
        """Before an operation makes lock keys (turnstile, channel) from the table's
        name: the client's first connection pins the table, and stays pooled."""
        if not self._table_pinned:
            self._give(self._take())

    def _pin_table(self, conn: Conn) -> None:
        """Name an unqualified table in full, as the client's first connection finds it
        (a qualified one, where ``_pins_qualified_table``, as the server spells it).

        Where an unqualified table is depends on the connection (PostgreSQL's
        search_path, MySQL's current database), and the application's connections may
        differ (a tenant's search_path, a ``USE``). One client must mean one table in
        every statement and every lock key, or two holders could each take a name in a
        table of their own. It also keeps ``CREATE TABLE`` from making a new table in
        front of one further along the search_path.
        """
        table = self._driver_find_table(conn, self._table)
        if not self._table_pinned:  # a concurrent first connection may have been faster
            self._table_pinned = True
            self._use_table(table)

    def _open(self) -> tuple[Any, Loan | None]:
        """A connection from the URL, or from ``client=``: a function returning a
        connection, or a borrowed one (a pool's context manager, such as psycopg_pool's
        ``pool.connection`` or pymysql's ``pool.acquire``; SQLAlchemy's
        ``engine.raw_connection``)."""
        factory = self._settings.client
        if factory is None:
            return self._driver_connect(), None
        for _ in range(POOL_SIZE):
            raw, loan = self._borrow(factory)
            # The application's pool may lend a connection that died while idle, and a
            # statement that fails in flight is never sent again: weed it out first,
            # before adopting it, which may take a round trip (PyMySQL's autocommit).
            if loan is not None and self._driver_idle_dead(raw):
                self._connection_died()
                self._give_back(raw, loan, keep=False)
                continue
            try:
                autocommit = self._driver_adopt(raw)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._give_back(raw, loan, keep=False)
                raise
            if loan is not None:
                loan.autocommit = autocommit
            return raw, loan
        raise BackendUnavailable("the client= pool lent only dead connections")

    def _borrow(self, factory: Any) -> tuple[Any, Loan | None]:
        made = factory()
        if self._driver_is_connection(made):
            return made, None
        loan = Loan(autocommit=False)
        if hasattr(made, "__enter__"):
            loan.context = made
            made = made.__enter__()
        elif inspect.isawaitable(made):
            # Under asyncio the factory may be a coroutine function.
            made = made
        if hasattr(made, "driver_connection"):
            loan.proxy = made
            made = made.driver_connection
        lent = loan if loan.context is not None or loan.proxy is not None else None
        if not self._driver_is_connection(made):
            # Something else (another driver's connection, a sync one for the asyncio
            # face): refused by name, not misused.
            with contextlib.suppress(Exception):
                self._give_back(made, lent, keep=False)
            raise ConfigurationError(
                f"client= gave a {type(made).__module__}.{type(made).__name__}, "
                f"not a connection of this face's driver"
            )
        return made, lent

    def _give_back(self, raw: Any, loan: Loan | None, keep: bool) -> None:
        """Close a connection of ours; return a borrowed one to its pool, as it came if
        ``keep``, else closed (the pool then replaces it).

        A borrowed connection goes back whatever happens, cancelled or interrupted
        at any step: the application's pool would otherwise lose it for good, and
        drain. One whose restore did not finish goes back closed."""
        restored = False
        try:
            if keep and loan is not None:
                with contextlib.suppress(Exception):
                    self._driver_restore(raw, loan.autocommit)
                    restored = True
            else:
                restored = keep
        finally:
            try:
                if not restored:
                    with contextlib.suppress(Exception):
                        if loan is not None and loan.proxy is not None:
                            loan.proxy.invalidate()  # closes it, and the pool forgets it
                        else:
                            self._driver_close(raw)
            finally:
                if loan is not None:
                    if loan.context is not None:
                        self._driver_end_loan(loan.context, closed=not restored)
                    elif loan.proxy is not None and restored:
                        loan.proxy.close()

    def _ensure_schema(self, conn: Conn) -> None:
        try:
            self._run(conn, self._schema, {})
        except BackendError as exc:
            if isinstance(exc, NoSuchSchema):
                raise
            # Without CREATE privilege the table may still exist (made by `dlock init`).
            try:
                self._run(conn, f"SELECT 1 FROM {self._table} WHERE 1 = 0", {})
            except BackendError:
                raise BackendError(
                    f"cannot create the lock table {self._table!r} ({exc}); grant CREATE "
                    "or create it beforehand with `dlock init` as a privileged user"
                ) from exc
        self._schema_ready = True

    def _check_table_kind(self, conn: Conn) -> None:
        """Refuse a table made for the other mode. A lease-mode and a session-mode client
        of one table do not exclude each other (session mode takes the database's own
        lock, whatever lease the name's row holds), and a lease kept in a table that a
        restart empties is lost with it. Which mode made a table shows in its kind."""
        durable = self._driver_table_durable(conn)
        if durable is None:
            return  # not there yet (create_table=false): every statement will say so
        if durable == self._session_mode:
            made, mode = ("lease", "session") if durable else ("session", "lease")
            raise ConfigurationError(
                f"the lock table {self._table!r} was made for {made} mode"
                f" ({'a plain table' if durable else 'UNLOGGED or MEMORY: a restart empties it'}),"
                f" and this client is in {mode} mode: clients of one table in two modes"
                " do not exclude each other. Keep each mode in a table of its own (the"
                f" defaults are {DEFAULT_TABLES['lease']} and {DEFAULT_TABLES['session']});"
                f" `dlock init --print` shows the table {mode} mode makes"
            )
        self._table_kind_checked = True

    def _missing_table(self, reason: str) -> BackendError:
        """The lock table is not there (``create_table=false``, or dropped since): say
        how to make it. Never re-created behind the holders' backs: a table that
        vanished was dropped on purpose, or this is not the database it was made in."""
        return BackendError(
            f"the lock table {self._table!r} does not exist ({reason}); create it with "
            "`dlock init` (or connect with create_table=true)"
        )

    def _take(self) -> Conn:
        """A pooled connection that is not known dead, else a new one.

        Dead ones are weeded out here, before a statement is sent, because a statement
        that fails in flight is never sent again: it may have committed. The pop is the
        check (the sync face's caller and renewer threads share the pool: another may
        take the last one between a look and a pop).
        """
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                break
            if not self._driver_idle_dead(conn.raw):
                return conn
            self._connection_died()
            self._drop(conn)
        return self._connect()

    def _connection_died(self) -> None:
        """The server may have restarted, or failed over to a replica, or been restored
        from a backup: a name's row seen before may be gone. Names known to have one are
        asked about again (on their next busy answer), or a try-lock of a name whose row
        was lost would be told "busy" for as long as this client lives."""
        self._known.clear()

    def _follow_loop(self) -> None:
        """Drop what an event loop that has ended made (a client used by two
        ``asyncio.run`` calls): its connections can be neither used nor closed (which
        awaits) in another loop. Pooled ones, those kept for waiting and those keeping a
        turnstile (a lease lives on in its row) are abandoned, and new ones are made in
        this loop. A session lock's connection stays, or the lock would go with it,
        until its release (``_session_release``). The sync face has no loop."""
        self._follow_fork()
        loop = _running_loop()
        if loop is self._loop:
            return
        stale = [*self._idle, *self._queueing, *(gate.conn for gate in self._gates.values())]
        stale += [parked.conn for parked in self._parked.values()]
        self._idle, self._queueing = [], []
        self._gates.clear()
        self._parked.clear()
        self._loop = loop
        for conn in stale:
            self._abandon(conn)
        # asyncio.run cancels the tasks left when it ends, a clean-up with them, maybe
        # before it ever ran: what a turnstile wait cut off may have taken is given back.
        for waiter in list(self._clean_ups):
            self._spawn_clean_up(waiter)

    def _forget_parent(self) -> None:
        """In a child after ``os.fork()``, on first use: forget every connection the
        parent made, and connect afresh. They are the parent's database sessions: the
        child's statements on them would cross replies with the parent's, and a session
        lock or turnstile kept on one is the parent's, never the child's to release.
        Each is let go without a word to the server (``_disown``), those that the
        parent's other threads had in use at the fork too (a statement, a wait): kept
        open here, the child's copy of the socket would keep the parent's session, and a
        session lock taken on it, alive after the parent dies, for as long as the child
        lives. One borrowed with ``client=`` is only forgotten: after a fork, the
        application's pool is the application's business."""
        inherited, self._ours = list(self._ours.values()), {}
        self._idle, self._queueing = [], []
        self._gates.clear()
        self._held.clear()
        self._parked.clear()
        self._clean_ups.clear()  # the parent's to finish
        self._late_writers.clear()  # a child's locks take tokens of their own
        self._loop = _running_loop()
        for conn in inherited:
            self._disown(conn.raw)

    def _disown(self, raw: Any) -> None:
        """Close this process's copy of a connection its parent made, sending nothing.

        A driver's close says goodbye to the server (psycopg's Terminate, PyMySQL's
        COM_QUIT), which ends the parent's session; pymysql's unhooks the socket from
        the parent's event loop, whose epoll instance the child shares. So the socket is
        first replaced, in this process only, by /dev/null, which the goodbye then goes
        to. Merely dropped, the connection would keep the parent's session open after
        the parent dies, for as long as the child lives, and pymysql's finalizer would
        still unhook it."""
        with contextlib.suppress(Exception):
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, self._driver_fileno(raw))
            finally:
                os.close(null)
            self._driver_disown(raw)

    def _abandon(self, conn: Conn) -> None:
        """Let go of a connection of an event loop that has ended, without awaiting it.
        Its socket is closed here where the driver allows, so that the server ends its
        session (and what it holds) now, not when the garbage collector gets to it. One
        borrowed with ``client=`` cannot go back to a pool of that loop either."""
        self._forget_ours(conn)
        with contextlib.suppress(Exception):
            self._driver_abandon(conn.raw)

    def _forget_ours(self, conn: Conn) -> None:
        """Before a connection is closed: a child forked later must not disown it, as
        its file descriptor's number may be another file's by then."""
        self._ours.pop(id(conn), None)

    def _give(self, conn: Conn) -> None:
        """Back to the pool; beyond its size (after a burst) closed at once."""
        conn.uses += 1
        if conn.loan is not None:
            # Borrowed: back to the application's pool at once, not kept idle here;
            # closed if it carries statements we prepared, which a later borrower of
            # it would find in the way.
            keep = False  # cut off while restoring: back closed, but back
            try:
                keep = not conn.prepared and self._restore_idle_timeout(conn)
            finally:
                self._give_back(conn.raw, conn.loan, keep=keep)
            return
        if len(self._idle) < POOL_SIZE and not self._closed:
            self._idle.append(conn)
        else:
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        # A broken connection may fail to close; it is gone either way. A borrowed one
        # goes back to its pool closed: it may hold a lock, a LISTEN, a statement cut
        # off in flight.
        if conn.dropped:
            return  # a borrowed connection goes back to its pool once
        conn.dropped = True
        self._forget_ours(conn)
        if conn.loop is not _running_loop():
            self._abandon(conn)
            return
        with contextlib.suppress(Exception):
            self._give_back(conn.raw, conn.loan, keep=False)

    @staticmethod
    def _readable(fd: int) -> bool:
        """An idle connection's socket with something to read is closed or broken."""
        if fd < 0:
            return True
        try:
            return bool(select.select([fd], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def _wrap(self, exc: BaseException, what: str = "", bound: float | None = None) -> BackendError:
        if isinstance(exc, BackendError):
            return exc
        prefix = self._settings.address
        if isinstance(exc, TimeoutError):
            seconds = self._settings.timeout if bound is None else bound
            return BackendUnavailable(f"{prefix}: no answer within {seconds:g} s")
        error = self._driver_error(exc)
        if error is None:
            return BackendError(f"{prefix}: {what or 'failed'}: {exc!r}")
        return type(error)(f"{prefix}: {what + ': ' if what else ''}{error}")

    def _run(self, conn: Conn, sql: str, params: dict[str, Any], wait: float = 0) -> Result:
        bound = self._settings.timeout + wait
        conn.statements += 1
        conn.running = True
        try:
            return call_with_timeout(
                self._driver_execute(conn.raw, sql, params, bound), bound + BACKSTOP
            )
        except Exception as exc:
            error = self._wrap(exc, bound=bound)
            if isinstance(error, BackendUnavailable):
                self._connection_died()
            raise error from exc
        finally:
            conn.running = False

    def _call(self, key: str, params: dict[str, Any], sql: str | None = None) -> Result:
        """One statement on a pooled connection, sent once.

        Never retried after a failure: a timeout or a connection lost in flight says
        nothing about whether the statement committed, and running it again could
        count a re-entry twice. Connections that died while idle are replaced before
        sending (``_take``); the core decides what a failed operation means.
        """
        conn = self._take()
        statement = self._sql[key] if sql is None else sql
        try:
            result = self._run(conn, statement, params)
        except BaseException:
            self._drop(conn)
            raise
        self._give(conn)
        return result

    def close(self) -> None:
        self._follow_loop()
        for clean_up in list(self._clean_ups.values()):
            wait_done(clean_up)
        self._closed = True
        conns = [*self._idle, *self._queueing, *(gate.conn for gate in self._gates.values())]
        conns += [held.conn for held in (*self._held.values(), *self._parked.values())]
        self._idle.clear()
        self._queueing.clear()
        self._gates.clear()
        self._held.clear()
        self._parked.clear()
        for conn in conns:
            self._drop(conn)

    # -- the seam --------------------------------------------------------------------

    def _remember(self, name: bytes) -> None:
        """``name``'s lease is held right now (granted, or seen busy): its row cannot be
        pruned for ``SHORTEST_PRUNE_AGE`` at least. A free row may be old enough to go."""
        if len(self._known) >= KNOWN_NAMES:
            self._known.clear()
        self._known[name] = time.monotonic()

    def _knows(self, name: bytes) -> bool:
        """Whether ``name`` certainly has a row: it was seen held within ``KNOWN_FOR``."""
        seen = self._known.get(name)
        return seen is not None and time.monotonic() - seen < KNOWN_FOR

    def _params(self, name: str, token: str, **more: Any) -> dict[str, Any]:
        return {"name": encode_name(name), "owner": token, **more}

    def acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        self._follow_loop()
        self._pin_table_first()
        if self._session_mode:
            return self._session_acquire(name, token, ttl, holder, reentrant)
        return self._lease_acquire(name, token, ttl, holder, reentrant)

    @abstractmethod
    def _lease_acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy: ...

    def release(self, name: str, token: str) -> int | None:
        self._follow_loop()
        if self._session_mode:
            return self._session_release(name, token)
        return self._lease_release(name, token)

    @abstractmethod
    def _plain_release(self, name: str, token: str) -> int | None:
        """Release a lease not taken through the turnstile, on a pooled connection."""

    def extend(self, name: str, token: str, ttl: float) -> bool:
        self._follow_loop()
        if self._session_mode:
            return self._session_extend(name, token, ttl)
        result = self._call("extend", self._params(name, token, ttl=ttl))
        if result.rowcount > 0:
            return True
        self._lease_lost(token)
        return False

    def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        self._follow_loop()
        if len(leases) == 1:
            return [self.extend(leases[0].name, leases[0].token, leases[0].ttl)]
        return self._renewed(leases, self._extend_batch(leases))

    @abstractmethod
    def _extend_batch(self, leases: Sequence[Lease]) -> set[tuple[bytes, str]]:
        """Renew many leases in as few round trips as the database allows; return the
        (name, owner) pairs renewed."""

    def prune(self, older_than: float, limit: int) -> int:
        """Every name used leaves a row, which keeps its fencing counter. A name made
        again after its row went starts at the server's clock in microseconds, above
        every token of the old row (all older than ``older_than``), unless the server's
        clock went back by more than that."""
        self._follow_loop()
        key = "session_prune" if self._session_mode else "prune"
        params = {"age": older_than, "age_us": int(older_than * 1_000_000), "batch": limit}
        return (self._call(key, params)).rowcount

    def inspect(self, name: str) -> LockInfo | None:
        self._follow_loop()
        key = "session_inspect" if self._session_mode else "inspect"
        result = self._call(key, {"name": encode_name(name)})
        return lock_info(*result.rows[0]) if result.rows else None

    # -- session mode ----------------------------------------------------------------

    def _session_acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        """An attempt that finds the holder's lease run out ends the holder's session,
        waits until the server has freed its lock, and tries once more: so a try-lock
        takes a lock whose lease has run out, as in lease mode (it used to end the
        holder and answer busy, and the lock went to whoever asked next)."""
        outcome = self._session_attempt(name, token, ttl, holder, reentrant)
        if not isinstance(outcome, int):
            return outcome
        self._until_lock_left(name, outcome)
        again = self._session_attempt(name, token, ttl, holder, reentrant)
        return Busy() if isinstance(again, int) else again

    def _session_attempt(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy | int:
        """One attempt; an int is the session of an expired holder it ended."""
        held = self._held.get(token)
        if held is not None:
            if not reentrant:
                return Busy()
            # Re-entry renews the lease, as on every backend, and fails if it is gone.
            if not self._session_extend(name, token, ttl):
                return Busy()
            count = self._session_count(token, held, +1)
            return Busy() if count is None else Acquired(held.fence, count)
        parked = self._parked.pop(token, None)
        conn = parked.conn if parked is not None else self._take()
        key = self._session_key(name)
        params = self._params(name, token, ttl=ttl, holder=holder.to_json(), key=key)
        try:
            statement = "session_record" if parked is not None else "session_acquire"
            result = self._run(conn, self._sql[statement], params)
            if parked is None and self._session_unrecorded(result):
                result = self._run(conn, self._sql["session_record"], params)
            granted = self._session_fence(result)
            self._check_session(conn, granted)
            if granted is not None:
                self._exempt_from_idle_timeout(conn)
        except BaseException as exc:
            self._abandon_session(conn, key, exc)
            raise
        if granted is None:
            self._give(conn)
            waiter = self._waiting.get(token)
            if waiter is not None:
                waiter.params = params
                self._fit_waiter(waiter, ttl)
            left = self._session_time_left(name, result)
            if left is not None and left <= 0:
                ended = self._session_evict(name)
                return Busy() if ended is None else ended
            return Busy(retry_after=left)
        self._held[token] = Held(conn, name, key, granted[0])
        return Acquired(granted[0], 1)

    def _abandon_session(self, conn: Conn, key: Any, exc: BaseException) -> None:
        """A session acquire failed: whatever happened, closing the session frees any
        lock it may have taken (once the server has noticed the close)."""
        self._drop(conn)

    def _exempt_from_idle_timeout(self, conn: Conn, returned_open: bool = True) -> None:
        """Turn the server's idle timeout off, once, for a session that holds a lock or
        waits (MySQL's ``wait_timeout``, PostgreSQL's ``idle_session_timeout``). A DBA
        sets it to reap leaked connections; a session lock's connection sits idle on
        purpose, and ending it would free the lock under a live holder (told within a
        second, see lease_lost, but no longer holding it); a lease waiter in front of
        the queue sits idle until a notification. A holder that stops renewing is still
        ended, by eviction once its lease has run out. ``returned_open`` false: a
        borrowed connection that goes back closed (a waiter's) has no setting of its own
        to put back."""
        if conn.no_idle_timeout:
            return
        if conn.loan is not None and returned_open:
            # The application's connection goes back to its pool as it came.
            result = self._run(conn, self._sql["idle_timeout"], {})
            conn.idle_timeout = result.rows[0][0]
        self._run(conn, self._sql["no_idle_timeout"], {})
        conn.no_idle_timeout = True

    def _restore_idle_timeout(self, conn: Conn) -> bool:
        """Put a borrowed session's idle timeout back; False if that failed."""
        if conn.no_idle_timeout and conn.idle_timeout is not None:
            try:
                self._run(conn, self._sql["idle_timeout_restore"], {"value": conn.idle_timeout})
            except BackendError:
                return False
            conn.no_idle_timeout, conn.idle_timeout = False, None
        return True

    @staticmethod
    def _check_session(conn: Conn, granted: tuple[int, int | None] | None) -> None:
        """The statement that took the lock ran in the connection's own session."""
        if granted is None or granted[1] is None:
            return
        if conn.session_id is None:
            conn.session_id = granted[1]
        elif granted[1] != conn.session_id:
            raise ConfigurationError(
                "session mode needs one database session for the lock's lifetime, but "
                "statements on one connection ran in different sessions: a "
                "transaction-pooling proxy (PgBouncer transaction mode, ProxySQL "
                "multiplexing) is in front of the database; connect directly or use "
                "lease mode"
            )

    def _session_count(self, token: str, held: Held, delta: int) -> int | None:
        """Re-entry or partial release: keep the row's count (for inspection) in step."""
        result = self._call("session_count", self._params(held.name, token, delta=delta))
        if result.rowcount == 0:
            self._session_lost(token)
            return None
        held.count += delta
        return held.count

    def _session_lost(self, token: str) -> None:
        """Give up a session lock whose lease is gone: close its connection, freeing it."""
        held = self._held.pop(token, None)
        if held is not None:
            self._drop(held.conn)

    def lease_lost(self, name: str, token: str) -> bool:
        """Session mode: the server closed the connection holding the lock (a restart,
        a killed session), which freed it at once; the renewer asks each second, so the
        holder is told then, not at its next renewal. The core's give-back then closes
        it (``_session_release``). A look at the socket: no round trip."""
        held = self._held.get(token)
        if held is None or held.name != name:
            return False
        conn = held.conn
        statements = conn.statements
        if conn.running or not self._driver_idle_dead(conn.raw):
            return False
        # Looked at while idle and still held: what the socket had was not the answer
        # to a statement begun meanwhile from another thread (a release takes the lock
        # out of ``_held`` before it sends the unlock).
        return self._held.get(token) is held and conn.statements == statements

    def _session_release(self, name: str, token: str) -> int | None:
        held = self._held.get(token)
        if held is None or held.name != name:
            return None
        if held.count > 1:
            return self._session_count(token, held, -1)
        if self._held.pop(token, None) is None:
            return None  # the renewer gave it up meanwhile
        if held.conn.loop is not _running_loop():
            return self._release_abandoned(held, token)
        if self._driver_idle_dead(held.conn.raw):
            # The server ended the session (killed, force-released, restarted), and its
            # lock with it: by now it is not ours.
            self._drop(held.conn)
            return None
        try:
            result = self._run(held.conn, self._sql["session_unlock"], {"key": held.key})
        except BaseException as exc:
            # Failed, cancelled or interrupted, the unlock sent or not: no longer in
            # ``_held``, the connection must not be left open, and closing it frees the
            # lock. No answer (a hung server) says nothing of whether the lock was still
            # ours: the error is raised, not reported as a loss. The server ending the
            # session as the unlock came (PostgreSQL's pg_terminate_backend takes effect
            # after it returns) is, as when it is found ended before.
            self._drop(held.conn)
            if isinstance(exc, BackendError) and self._session_ended(exc):
                return None
            raise
        if result.rows and result.rows[0][0]:
            self._give(held.conn)
            return 0
        self._drop(held.conn)
        return None

    def _release_abandoned(self, held: Held, token: str) -> int | None:
        """Release a session lock taken in an event loop that has ended, whose
        connection cannot run the unlock here: closing its session frees the lock. Asked
        first, on another connection, whether it was still ours; then it waits, as an
        unlock would, until the server has let go of it."""
        params = self._params(held.name, token)
        try:
            owned = bool((self._call("session_owned", params)).rows)
        finally:
            self._abandon(held.conn)
        if not owned:
            return None
        deadline = time.monotonic() + self._settings.timeout
        while (self._call("session_owned", params)).rows:
            if time.monotonic() >= deadline:
                raise BackendUnavailable(
                    f"{self._settings.address}: the session of an earlier event loop still "
                    "holds the lock after its connection was closed"
                )
            sleep(0.005)
        return 0

    def _session_ended(self, exc: BackendError) -> bool:
        """Whether a failed statement's error is the server's word that the session
        ended: never a timeout, which only says that no answer came."""
        cause = exc.__cause__
        return cause is not None and not _timed_out(cause) and self._driver_session_ended(cause)

    def _session_extend(self, name: str, token: str, ttl: float) -> bool:
        result = self._call("session_extend", self._params(name, token, ttl=ttl))
        if result.rowcount > 0:
            return True
        self._session_lost(token)
        return False

    def _renewed(self, leases: Sequence[Lease], renewed: set[tuple[bytes, str]]) -> list[bool]:
        """Which leases a batch renewed; session locks that were not are given up."""
        results = [(encode_name(x.name), x.token) in renewed for x in leases]
        for lease, ok in zip(leases, results, strict=True):
            if not ok:
                if self._session_mode:
                    self._session_lost(lease.token)
                else:
                    self._lease_lost(lease.token)
        return results

    def _lock_wait(self, wait: float) -> float:
        """The longest wait up to ``wait`` that the server's blocking lock makes; 0: it
        cannot wait that briefly."""
        grain = self._wait_grain
        return math.floor(wait / grain) * grain if grain else wait

    def _fit_waiter(self, waiter: Waiter, ttl: float) -> None:
        """Tell a waiter for a lease of ``ttl`` whether it can wait inside the server at
        all (its waits there are bounded by a third of the TTL and half the operation
        timeout) and how briefly; where it cannot, it backs off with jitter."""
        waiter.notifies = self._lock_wait(min(ttl / 3, self._settings.timeout / 2)) > 0
        waiter.shortest_wait = self._wait_grain or 0.0

    def _session_wait(self, waiter: _SessionWaiter, timeout: float) -> Acquired | None:
        """Block inside the server until the lock is ours or ``timeout`` passes.

        Where the connection can (PostgreSQL; MariaDB/MySQL with multi-statements),
        the same round trip records the lock in its row the moment it is granted, and
        the grant is returned. Otherwise the lock obtained is parked for the acquire
        that the core makes next, which records it: no polling either way.
        """
        name, token = waiter.name, waiter.token
        if token in self._parked:
            return None  # obtained already: the core's next attempt records it
        if token in self._held:
            # Held under this owner token by another user of the lock object: nothing
            # to wait for in the server, and returning at once would make a busy loop.
            sleep(timeout)
            return None
        conn = self._take()
        # Bounded by the operation timeout, so a dead server is noticed in time.
        wait = max(0.001, min(timeout, self._settings.timeout / 2))
        # The parameters of the attempt that found the lock busy, to record it with.
        record = waiter.params if self._records_in_wait(conn) else None
        if record is not None:
            # A grant counts (on the client) from before this wait: most of its lease
            # is left when the wait is bounded by a third of the TTL.
            wait = max(0.001, min(wait, float(record["ttl"]) / 3))
        wait = self._lock_wait(wait)
        if wait == 0:
            # Too brief a wait for the server: the core's next attempt tries the lock.
            self._give(conn)
            sleep(timeout)
            return None
        key = self._session_key(name)
        ms = max(1, math.ceil(wait * 1000))
        try:
            if record is not None:
                sql, params = self._wait_and_record_sql(conn, record, wait)
            else:
                sql = self._sql["session_wait"]
                params = {"key": key, "wait": wait, "wait_ms": str(ms)}
            result = self._run(conn, sql, params, wait=wait)
            granted = None if record is None else self._session_fence(result)
            self._check_session(conn, granted)
            if granted is not None:
                self._exempt_from_idle_timeout(conn)
        except BackendError as exc:
            if self._is_lock_timeout(exc.__cause__ or exc):
                # PostgreSQL may grant the lock just as the timeout ends the wait, and a
                # session lock outlives the statement that failed: pooled so, the
                # connection held the lock for nobody, and every later acquire made
                # on it stacked a level that its release left (a chaos helper's run).
                self._unlock_and_give(conn, key)
                return None
            self._drop(conn)
            if isinstance(exc, BackendUnavailable) and (conn.uses > 0 or self._session_ended(exc)):
                # A pooled connection that died while idle, or a session the server
                # ended under the wait (killed): nothing is held, and the core tries
                # again, which tells a server that is down.
                return None
            raise
        except BaseException:
            # Closing the session frees any lock it may have taken.
            self._drop(conn)
            raise
        if granted is not None:
            self._held[token] = Held(conn, name, key, granted[0])
            return Acquired(granted[0], 1)
        if record is None and self._got_wait(result):
            self._parked[token] = Held(conn, name, key, 0)
        else:
            self._give(conn)
        return None

    def _records_in_wait(self, conn: Conn) -> bool:
        """True when one round trip on ``conn`` can wait for a session lock and record it."""
        return False

    def _wait_and_record_sql(
        self, conn: Conn, params: dict[str, Any], wait: float
    ) -> tuple[str, dict[str, Any]]:
        """A query (and its parameters) that waits for the lock up to ``wait`` seconds,
        then records it; its last statement's result is the record's."""
        raise NotImplementedError

    def _got_wait(self, result: Result) -> bool:
        """PostgreSQL's pg_advisory_lock returns void (it raised on timeout);
        MySQL's GET_LOCK returns 1 for granted, 0 for timed out."""
        return True

    def _unpark(self, token: str) -> None:
        parked = self._parked.pop(token, None)
        if parked is not None:
            self._unlock_and_give(parked.conn, parked.key)

    def _unlock_and_give(self, conn: Conn, key: Any) -> None:
        """Let go of the session lock ``key`` that ``conn`` holds or may hold, and pool
        the connection; closed instead if that fails, or is cut off by a second
        interrupt or cancellation (the lock may still be on the connection, which would
        go back to the pool holding it; closing it frees the lock)."""
        try:
            self._run(conn, self._sql["session_unlock"], {"key": key})
        except BaseException as exc:
            self._drop(conn)
            if not isinstance(exc, BackendError):
                raise
            return
        self._give(conn)

    @contextmanager
    def waiter(self, name: str, token: str) -> Iterator[Waiter]:
        self._follow_loop()
        if not self._session_mode:
            with self._lease_waiter(name, token) as lease_waiter:
                yield lease_waiter
            return
        waiter = _SessionWaiter(self, name, token)
        self._waiting[token] = waiter
        try:
            yield waiter
        finally:
            self._waiting.pop(token, None)
            self._unpark(token)

    def force_release(self, name: str) -> bool:
        self._follow_loop()
        self._pin_table_first()
        if not self._session_mode:
            return self._lease_force_release(name)
        session = self._session_force_release(name)
        if session is None:
            return False
        self._until_lock_left(name, session)
        return True

    @abstractmethod
    def _lease_force_release(self, name: str) -> bool: ...

    @abstractmethod
    def _session_force_release(self, name: str) -> int | None:
        """End the holder's database session (only it can free the database's lock);
        the session ended, or None if nobody held the lock."""

    def _until_lock_left(self, name: str, session: int) -> None:
        """A session ended from outside (KILL, pg_terminate_backend) frees its locks as
        it exits, which can come after the call has returned: wait for that, so that a
        force release that says True leaves the lock free for the next acquire. Bounded
        by the operation timeout: past it, the server frees the lock when the session
        does end."""
        params = {"key": self._session_key(name), "session": session}
        deadline = time.monotonic() + self._settings.timeout
        pause = 0.001
        while True:
            rows = (self._call("session_lock_kept", params)).rows
            if not (rows and rows[0][0]) or time.monotonic() >= deadline:
                return
            sleep(pause)
            pause = min(2 * pause, 0.05)

    # -- lease mode: the turnstile ---------------------------------------------------

    @abstractmethod
    def _turnstile_key(self, name: str) -> Any:
        """The database lock that lease waiters of ``name`` queue on."""

    def _queues_on(self, conn: Conn) -> bool:
        """True when waiters can queue on ``conn`` (one round trip must hold the wait and
        the take); else they back off with jitter."""
        return True

    def _behind_proxy(self, conn: Conn) -> bool:
        """True when a connection pooler may run the statements of ``conn`` in different
        server sessions: a queue's session state (its place on the turnstile, a LISTEN)
        would be left on a session that other clients then use, so waiters back off
        with jitter instead."""
        return False

    @abstractmethod
    def _queue_sql(self, waiter: TurnstileWaiter, wait: float) -> tuple[str, dict[str, Any]]:
        """The query that waits up to ``wait`` seconds for the turnstile, then takes the
        lease inside the server if it is free."""

    @abstractmethod
    def _queued(self, result: Result) -> tuple[bool, Acquired | None]:
        """From the queue query's answer: in front of the queue, and the lease if taken."""

    #: Whether the waiter in front hears a release of a lease whose holder did not queue
    #: (PostgreSQL: NOTIFY); if not, it polls, with the client's backoff.
    notifies_in_front: bool = True

    @abstractmethod
    def _wait_in_front(self, waiter: TurnstileWaiter, timeout: float) -> None:
        """In front of the queue with the lease busy: wait (up to ``timeout``) for its
        release, the one hand-over the turnstile does not make."""

    @contextmanager
    def _lease_waiter(self, name: str, token: str) -> Iterator[Waiter]:
        """Waiters queue on the database's own lock (the turnstile) inside the server.

        The waiter that gets the turnstile takes the lease in the same round trip if it
        is free, and keeps the turnstile for as long as it holds the lease; its release
        leaves the turnstile, so the next waiter takes the lease inside the server, as
        the database's own blocking lock hands over. If the lease is busy (its holder
        did not queue), the waiter in front waits for the release (``_wait_in_front``).
        Were every waiter to race for each release, the fastest would win it; through
        the turnstile the server serves them one by one, in arrival order.
        """
        try:
            conn = self._queueing.pop()
        except IndexError:
            # A pooled one, not a new one: behind a pooler it cannot queue, and goes
            # back to the pool (a new connection per wait, each through the pooler).
            conn = self._take()
        try:
            # A borrowed connection is asked (a round trip) before it can queue.
            queues = self._queues_on(conn) and not self._behind_proxy(conn)
        except BaseException:
            self._drop(conn)
            raise
        if not queues:
            self._give(conn)
            yield Waiter()
            return
        waiter = TurnstileWaiter(self, conn, name, token, self._turnstile_key(name))
        self._front[token] = waiter
        try:
            yield waiter
        except BaseException:
            # In the background, and nothing awaited here: a second cancellation would
            # cut a clean-up short (keeping a borrowed connection, skipping the
            # give-back), and a hung server or an exhausted pool would hold up this one.
            # The session is hung up on first, here, in case the loop ends before the
            # clean-up runs.
            waiter.ended = waiter.cut_off and self._cut_off_wait_ended(waiter.conn)
            self._hang_up(waiter.conn)
            self._spawn_clean_up(waiter)
            raise
        finally:
            self._front.pop(token, None)
        if waiter.granted:
            self._gates[token] = Gate(waiter.conn, waiter.key)
        elif waiter.took:
            # Handed a lease it never held: on MariaDB/MySQL the row goes on naming this
            # session as the keeper, whose turnstile lets anyone in, so the connection
            # must not queue again (newcomers would pass it). Closing leaves the turnstile.
            self._drop(waiter.conn)
        elif waiter.in_front:
            # One round trip; the next waiter moves to the front.
            self._leave_turnstile(waiter.conn)
        else:
            # The waiter may have replaced a connection that died while idle (restart).
            self._keep_for_waiting(waiter.conn)

    def _spawn_clean_up(self, waiter: TurnstileWaiter) -> None:
        clean_up = spawn(partial(self._clean_up_waiter, waiter), name="dlock-waiter-clean-up")
        self._clean_ups[waiter] = clean_up

    def _clean_up_waiter(self, waiter: TurnstileWaiter) -> None:
        """Run ``_end_waiter`` to its end. Cancelled, it starts over: asyncio.run cancels
        the tasks left when it ends, then waits for them, and a turnstile wait cut off
        just before may take the lease for nobody once the loop is gone. A clean-up
        cancelled before it began runs in the next loop (``_follow_loop``)."""
        while True:
            try:
                self._end_waiter(waiter)
            except Cancelled:
                uncancel(current_task())
                continue
            self._clean_ups.pop(waiter, None)
            return

    def _end_waiter(self, waiter: TurnstileWaiter) -> None:
        """End a lease waiter left by an error, a cancellation or an interrupt.

        Its connection is closed first, which leaves the turnstile and gives a borrowed
        one back to its pool, so that the statements below can borrow one even from a
        pool the waiter exhausted. A turnstile wait cut off in flight may go on in the
        server and take the lease for the dead session: it is ended there where the
        backend can, and the take is given back (``_give_back_cut_off``).
        """
        self._drop(waiter.conn)
        if waiter.cut_off:
            ended = waiter.ended
            if not ended:
                with contextlib.suppress(Exception):
                    ended = self._end_cut_off_wait(waiter)
            self._give_back_cut_off(waiter, ended)

    def _give_back_cut_off(self, waiter: TurnstileWaiter, ended: bool) -> None:
        """Give back what a turnstile wait cut off in flight may have taken: once if
        the server said the wait is over (``ended``), else again every
        ``CUT_OFF_RETRY`` until its own bound has passed, by when the dead session's
        wait has ended and its take with it; a take is then held by nobody for that long
        at most, not for its whole TTL. Failing give-backs are tried for an operation
        timeout more; then the lease, if taken, ends by its TTL."""
        while True:
            started = time.monotonic()
            try:
                self._plain_release(waiter.name, waiter.token)
            except Exception:
                self._note_late_writer(waiter.token)
                if started >= waiter.wait_ends + self._settings.timeout:
                    return
            else:
                if ended or started >= waiter.wait_ends:
                    return
            sleep(CUT_OFF_RETRY)

    def _hang_up(self, conn: Conn) -> None:
        """End the session of a lease waiter left at once, without awaiting: the server
        then ends a wait that goes on in it sooner."""

    def _cut_off_wait_ended(self, conn: Conn) -> bool:
        """True when the connection of a turnstile wait cut off in flight shows that
        its query has ended in the server (the driver cancelled it there itself)."""
        return False

    def _end_cut_off_wait(self, waiter: TurnstileWaiter) -> bool:
        """End a turnstile wait cut off in flight in the server too, its connection
        closed already; True once the server says it has ended (with the take after it)."""
        return False

    def _note_late_writer(self, token: str) -> None:
        """A give-back under ``token`` got no answer (see ``may_write_late``)."""
        self._late_writers[token] = True
        if len(self._late_writers) > LATE_WRITERS:
            del self._late_writers[next(iter(self._late_writers))]

    def may_write_late(self, token: str) -> bool:
        """A clean-up's give-back under ``token`` that got no answer may be applied
        after the token's next hold began, and release it; so may one still being
        sent. With a new token, that next hold need not wait for the clean-up either."""
        return self._late_writers.pop(token, False) or any(
            waiter.token == token for waiter in list(self._clean_ups)
        )

    def _cut_offs_done(self, token: str) -> None:
        """Wait for the clean-ups of ``token``'s waiters cut off: their give-backs
        release under the token, and must not release a lease it takes anew."""
        for waiter, clean_up in list(self._clean_ups.items()):
            if waiter.token == token:
                wait_done(clean_up)

    def _lease_waiter_of(
        self, token: str, reentrant: bool, params: dict[str, Any]
    ) -> TurnstileWaiter | None:
        """The turnstile waiter an acquire is made in, told the attempt's parameters (for
        its take). Outside one, a fresh acquisition first drops a gate left by an earlier
        one (lost, never released): it only blocks the queue."""
        waiter = self._front.get(token)
        if waiter is None:
            if not reentrant:
                self._cut_offs_done(token)
                self._drop_gate(token)
            return None
        waiter.params = params
        # Each attempt says anew whether the lease is ours: a grant handed over in the
        # previous wait may have been gone when the core confirmed it, and kept as
        # granted, a wait that then timed out kept the turnstile for a lease not held.
        waiter.granted = False
        if not waiter.in_front:
            self._fit_waiter(waiter, float(params["ttl"]))
        return waiter

    def _queue(self, waiter: TurnstileWaiter, timeout: float) -> Acquired | None:
        """Wait in the queue; in front, take the lease if it is free."""
        # A lease taken here counts (on the client) from before this wait: the wait is
        # bounded by a third of the TTL, so most of the lease is left; and by half the
        # operation timeout, which alone bounds a sync MySQL connection's answers.
        ttl = float(waiter.params["ttl"])
        wait = self._lock_wait(max(0.001, min(timeout, ttl / 3, self._settings.timeout / 2)))
        if wait == 0:
            # Too brief a wait for the server: back off here, then only try the turnstile.
            sleep(timeout)
        sql, params = self._queue_sql(waiter, wait)
        # By then the wait has ended in the server, and the take after it too.
        waiter.wait_ends = time.monotonic() + wait + BACKSTOP
        try:
            # A waiter's borrowed connection goes back closed (_keep_for_waiting).
            self._exempt_from_idle_timeout(waiter.conn, returned_open=False)
            result = self._run(waiter.conn, sql, params, wait=wait)
        except BackendError as exc:
            # PostgreSQL's lock timeout is an OperationalError, so it arrives as
            # unavailable: checked first, it keeps the connection.
            if self._is_lock_timeout(exc.__cause__ or exc):
                return None
            waiter.cut_off = True
            if not isinstance(exc, BackendUnavailable):
                raise
            # The connection died (server restart): start over on a new one; the core
            # simply tries again. Its session is gone, its wait with it, and after a
            # restart its id may be another's: if no new connection comes, the clean-up
            # must not end that session's wait.
            waiter.conn.session_id = None
            self._drop(waiter.conn)
            waiter.conn = self._connect()
            try:
                self._plain_release(waiter.name, waiter.token)
            except Exception:
                # No answer: applied late, it would free what this token takes next.
                # So the acquire fails; the clean-up gives back again, and the next
                # hold takes a new token (may_write_late).
                self._note_late_writer(waiter.token)
                raise exc from exc.__cause__
            waiter.cut_off = False
            return None
        except BaseException:
            waiter.cut_off = True
            raise
        in_front, granted = self._queued(result)
        if not in_front:
            return None  # the wait timed out
        waiter.in_front = True
        waiter.notifies = self.notifies_in_front
        if granted is None:
            # Busy, or the name has no row yet: the core's next attempt, on this
            # connection, learns which (and makes the row).
            return None
        self._remember(waiter.params["name"])
        waiter.granted = waiter.took = True
        return granted

    def _lease_release(self, name: str, token: str) -> int | None:
        gate = self._gates.pop(token, None)
        if gate is not None and self._driver_idle_dead(gate.conn.raw):
            # Its session is gone (a restart), and the turnstile with it; or it has
            # something unasked for to read. The lease itself lives on in the table.
            self._drop(gate.conn)
            gate = None
        if gate is None:
            return self._plain_release(name, token)
        # On the connection holding the turnstile: the last release leaves it, and the
        # waiter blocked on it takes the lease inside the server.
        params = self._params(name, token, turnstile=gate.key)
        try:
            sql, params = self._release_gate_sql(gate.conn, params)
            result = self._run(gate.conn, sql, params)
        except BaseException:
            self._drop(gate.conn)  # closing frees the turnstile
            raise
        count = result.rows[0][0] if result.rows else None
        if count is None:
            # Not ours any more (expired, taken over): the turnstile is left all the same,
            # and the connection closed, not kept for waiting. On MariaDB/MySQL the row
            # still names its session as the keeper (only our release clears that), so
            # that anyone may take a lease run out behind it; queueing again, in front
            # of the queue, that session would let newcomers pass it.
            self._drop(gate.conn)
            return None
        if count:
            self._gates[token] = gate
        else:
            self._keep_for_waiting(gate.conn)
        return int(count)

    def _release_gate_sql(self, conn: Conn, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The release on the connection keeping the turnstile (and its parameters):
        where waiting leaves session state beyond the turnstile (PostgreSQL's LISTEN),
        the same round trip clears it, as the connection may be kept for waiting."""
        return self._sql["release_gate"], params

    def _leave_turnstile(self, conn: Conn) -> None:
        """Leave the turnstile (on PostgreSQL, unlisten too) in one round trip; the
        connection is kept for waiting (or, broken, closed, which leaves it too)."""
        try:
            self._run(conn, self._sql["leave_turnstile"], {})
        except BaseException:
            self._drop(conn)
            raise
        self._keep_for_waiting(conn)

    def _keep_for_waiting(self, conn: Conn) -> None:
        """Keep a waiting connection for the next wait. One borrowed from the
        application's pool goes back instead (closed: it carries dlock's state, such as
        a LISTEN or a PREPARE): dlock keeps none of the application's connections idle.
        At most ``POOL_SIZE`` are kept, as for statements: their idle timeout is off, so
        those a burst of waiters opened would otherwise stay open for the client's life."""
        if conn.loan is not None or self._closed or len(self._queueing) >= POOL_SIZE:
            self._drop(conn)
        else:
            self._queueing.append(conn)

    def _drop_gate(self, token: str) -> None:
        gate = self._gates.pop(token, None)
        if gate is not None:
            self._drop(gate.conn)

    def _lease_lost(self, token: str) -> None:
        """The lease ended without a release (expired, taken over, force-released): the
        turnstile it kept must not hold the queue up."""
        self._drop_gate(token)

    # Last: below this point ``list`` names the method, not the builtin.
    def list(self, prefix: str) -> list[LockInfo]:
        self._follow_loop()
        key = "session_list" if self._session_mode else "list"
        result = self._call(key, {"prefix": encode_name(prefix)})
        return [lock_info(*row) for row in result.rows]


def _running_loop() -> Any:
    """The running event loop (under asyncio), or None (sync face)."""
    task = current_task()
    return None if task is None else task.get_loop()


def _pool_timed_out(exc: BaseException) -> bool:
    """SQLAlchemy's pool found no connection to lend within its ``pool_timeout``."""
    errors = sys.modules.get("sqlalchemy.exc")
    return errors is not None and isinstance(exc, errors.TimeoutError)


def _pool_closed(exc: BaseException) -> bool:
    """psycopg_pool's pool was closed by the application."""
    pools = sys.modules.get("psycopg_pool")
    return pools is not None and isinstance(exc, pools.PoolClosed)


def _timed_out(exc: BaseException) -> bool:
    """A timeout anywhere in the chain of causes: a driver's read timeout (PyMySQL's
    "Lost connection ... (timed out)") is no answer, however it is worded."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TimeoutError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


class _SessionWaiter(Waiter):
    #: The wait happens inside the server and ends the moment the lock is free.
    notifies = True

    def __init__(self, backend: ServerSQLBackend, name: str, token: str) -> None:
        self._backend = backend
        self.name = name
        self.token = token
        #: The latest busy attempt's parameters (owner, ttl, holder, key).
        self.params: dict[str, Any] | None = None

    def wait(self, timeout: float) -> Acquired | None:
        return self._backend._session_wait(self, timeout)


@dataclass
class Gate:
    """A lease taken in front of the turnstile, and the connection that keeps it."""

    conn: Conn
    key: Any


class TurnstileWaiter(Waiter):
    #: A queued wait ends the moment the turnstile is handed over.
    notifies = True

    def __init__(
        self, backend: ServerSQLBackend, conn: Conn, name: str, token: str, key: Any
    ) -> None:
        self._backend = backend
        self.conn = conn
        self.name = name
        self.token = token
        self.key = key
        self.in_front = False
        #: No attempt made inside this waiter yet.
        self.fresh = True
        #: The lease was taken in front of the turnstile, which stays with it.
        self.granted = False
        #: A lease was handed over to this waiter's connection inside the server, whether
        #: or not the core then held it (it may have lapsed before it was confirmed).
        self.took = False
        #: A take failed in flight: it may have committed.
        self.cut_off = False
        #: When (``time.monotonic``) the latest wait and take are over in the server.
        self.wait_ends = 0.0
        #: Cut off, the server has ended the wait already (``_cut_off_wait_ended``).
        self.ended = False
        #: The latest attempt's parameters (owner, ttl, holder), for the take.
        self.params: dict[str, Any] = {}

    def first_attempt(self) -> bool:
        """True once, for the core's attempt on entering the waiter: it would only repeat
        the attempt just made, and the take in front of the turnstile comes next."""
        fresh, self.fresh = self.fresh, False
        return fresh

    def wait(self, timeout: float) -> Acquired | None:
        if not self.in_front:
            return self._backend._queue(self, timeout)
        self._backend._wait_in_front(self, timeout)
        return None
