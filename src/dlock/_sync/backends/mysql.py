# DO NOT EDIT: generated from src/dlock/_async/backends/mysql.py by scripts/unasync.py.
"""MariaDB and MySQL 8: a lease table (default) or ``GET_LOCK`` (``?mode=session``).

Driver: PyMySQL, and for asyncio its aio-libs twin with the same API and exceptions, so
both faces are one source; pure Python (no ``libmariadb-dev`` to build). TLS is off
unless asked for: PyMySQL would otherwise build a default SSL context for every
connection (~18 ms).

The SQL is limited to what both MariaDB 10.6+ and MySQL 8 accept (no RETURNING); only
MariaDB is tested here, as MySQL 8 is not packaged by Debian.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import os
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

import pymysql
import pymysql.cursors
from pymysql.charset import charset_by_name
from pymysql.constants import CLIENT, SERVER_STATUS

from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._options import flag
from ..._sql import (
    MYSQL,
    MYSQL_TABLE_ENGINE,
    NoSuchSchema,
    ServerSettings,
    check_client_key,
    encode_name,
    mysql_statements,
    named_lock_key,
    parse_server_url,
    quote_mysql_identifier,
)
from ..._tls import certificate_refused, check_tls_files
from ..._types import Acquired, Busy, Holder, Lease
from .._primitives import IS_ASYNC, call_with_timeout, sleep
from ._server_sql import Conn, Result, ServerSQLBackend, TurnstileWaiter

PASSTHROUGH = frozenset(
    {"ssl", "ssl_ca", "ssl_cert", "ssl_key", "ssl_key_password", "ssl_verify_identity", "charset"}
)
#: Server error codes that deserve their own message.
ACCESS_DENIED = {1044, 1045, 1142, 1143, 1227}
#: KILL of another user's session without CONNECTION ADMIN (MySQL 8: CONNECTION_ADMIN)
#: or SUPER.
NOT_THREAD_OWNER = 1095
#: The client library's own errors (CR_*: cannot connect, server gone away, lost
#: connection). Server errors from 3000 on (MySQL 8) and 4000 on (MariaDB) are refusals
#: like any other: a locked account, TLS required, a statement's time limit.
CLIENT_ERRORS = range(2000, 3000)
#: Server errors that end the connection or turn it away for now: too many
#: connections, shutting down, killed (MariaDB), closed as idle (MySQL 8.0.24+; on
#: MariaDB 4031 is a trigger-order error, which dlock's statements cannot raise); and
#: the login's own limits, which free up as its other connections end or the hour
#: passes: max_user_connections (1203), an account's resource limits (1226).
CONNECTION_ENDED = {1040, 1053, 1203, 1226, 1927, 4031}
#: Errors of a session the server ended: shutting down, killed (MariaDB), closed as
#: idle (MySQL 8), and the client library's CR_SERVER_GONE_ERROR and CR_SERVER_LOST
#: for a connection closed under a statement (a KILL, a restart), which are also how
#: PyMySQL words a read that timed out (told apart by its cause, ``_timed_out``).
SESSION_ENDED = {1053, 1927, 4031, 2006, 2013}
#: A row lock wait that the server ended: ER_LOCK_WAIT_TIMEOUT (another transaction
#: held the row past ``innodb_lock_wait_timeout``), ER_LOCK_DEADLOCK. The statement is
#: undone and nothing is held: worth trying again, as PostgreSQL's are.
LOCK_WAIT_ENDED = {1205, 1213}
#: ER_RECORD_FILE_FULL: the session mode's MEMORY table reached max_heap_table_size.
TABLE_FULL = 1114
READ_ONLY = {1290, 1792, 1836}
#: The statements that wait in the server: each begins with its ``SELECT GET_LOCK``.
WAITS = ("turnstile_take", "session_wait", "session_wait_and_record")
#: ER_NO_SUCH_TABLE.
NO_SUCH_TABLE = 1146
#: ER_BAD_DB_ERROR: the database the URL or the table names does not exist.
NO_SUCH_DATABASE = 1049
#: ``create_row``'s insert id for a name whose row exists and is held (a new row's is
#: its fence, the clock in microseconds; a free row's is 0).
HELD_ROW = 1


def _table_full(exc: BackendError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, pymysql.MySQLError) and cause.args[:1] == (TABLE_FULL,)


#: TLS settings that are not a certificate file: alone, they do not turn TLS on.
TLS_SETTINGS = ("ssl_verify_identity", "ssl_key_password")


def _tls_flag(extra: dict[str, str], option: str, default: str) -> bool:
    """A TLS switch: a spelling not known is refused, never read as off (libpq's
    ``ssl=require`` meant no TLS at all). ``required`` is MySQL's own word for on."""
    value = extra.get(option, default)
    if value.lower() == "required":
        return True
    try:
        return flag(value, option)
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"{exc} (yes, on, 1 and required mean true; PostgreSQL's sslmode=require is "
            "ssl=true here)"
        ) from None


def _ssl_context(extra: dict[str, str]) -> ssl.SSLContext | None:
    """One context per backend, built once (not per connection), or None for no TLS.

    TLS is on with ``ssl=true`` or any certificate file. A TLS setting given with TLS
    off (``ssl_verify_identity`` alone, or with ``ssl=false``) is refused: the lock
    would go over plain text while the URL reads as if checked."""
    files = [key for key in ("ssl_ca", "ssl_cert", "ssl_key") if key in extra]
    verify_identity = _tls_flag(extra, "ssl_verify_identity", "true")
    if "ssl" in extra and not _tls_flag(extra, "ssl", "false"):
        given = [*files, *(key for key in TLS_SETTINGS if key in extra)]
        if given:
            raise ConfigurationError(
                f"ssl=false with {', '.join(given)}: TLS is off, so they would do nothing;"
                " drop them, or drop ssl=false"
            )
        return None
    if "ssl" not in extra and not files:
        given = [key for key in TLS_SETTINGS if key in extra]
        if given:
            raise ConfigurationError(
                f"{', '.join(given)} without TLS: add ssl=true (or ssl_ca=...), or the lock"
                " goes over plain text"
            )
        return None
    # After the checks above: a file's absence is no matter where TLS is refused.
    check_tls_files(extra, files)
    context = ssl.create_default_context(cafile=extra.get("ssl_ca"))
    context.check_hostname = verify_identity
    if "ssl_cert" in extra:
        key, password = extra.get("ssl_key"), extra.get("ssl_key_password")
        check_client_key(key, password, "ssl_key_password")
        try:
            # A password, even empty, keeps OpenSSL from asking on the terminal.
            context.load_cert_chain(extra["ssl_cert"], key, password=password or "")
        except (OSError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot load ssl_cert {extra['ssl_cert']!r} with ssl_key "
                f"{key!r} (a wrong ssl_key_password?): {exc}"
            ) from exc
    return context


def _shut_down(sock: Any) -> None:
    """Shut down both directions of a stream's socket, as the event loop hands it out
    (``get_extra_info("socket")``), through a duplicate of its file descriptor: the
    loop's object need not forward ``shutdown()`` (uvloop's PseudoSocket refuses it with
    a TypeError), and a shutdown acts on the connection, whichever descriptor asks."""
    if sock is None:
        return
    with socket.socket(fileno=os.dup(sock.fileno())) as dup:
        dup.shutdown(socket.SHUT_RDWR)


class _QuietCursor(pymysql.cursors.Cursor):  # type: ignore[misc]
    """The asyncio driver turns server notes into Python warnings with an extra SHOW
    WARNINGS round trip (``CREATE TABLE IF NOT EXISTS`` on an existing table); dlock
    needs neither. (The threaded driver does neither already.)

    Bytes (lock names) are sent as hex literals, ``X'…'``, which mean the same in
    every ``sql_mode``. The asyncio driver quotes bytes with backslash escapes even on
    a server whose ``sql_mode`` has ``NO_BACKSLASH_ESCAPES``, where a backslash is an
    ordinary character: a name with a quote in it would end the literal early and let
    the rest of the name run as SQL. (The threaded driver minds the mode; both faces
    send the same literals all the same.)"""

    def _show_warnings(self, conn: Any) -> None:
        return None

    def _escape_args(self, args: Any, conn: Any) -> Any:
        if isinstance(args, dict):
            return {key: _literal(value, conn) for key, value in args.items()}
        return tuple(_literal(value, conn) for value in args)


def _literal(value: Any, conn: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return f"X'{value.hex()}'"
    return str(conn.escape(value))


class _TLSNotOffered(Exception):
    """Raised by ``_Connection`` before it logs in (not an OSError, which the drivers
    would turn into "cannot connect", a server out of reach)."""


class _Connection(pymysql.Connection):  # type: ignore[misc]
    """The driver's connection, which logs in only over TLS when TLS was asked for.

    The drivers go on in plain text when the server's greeting does not offer TLS (a
    server without it, or someone in between who strips the offer), and send the login
    first: the user name and password hash, or the password itself if the server asks
    for the cleartext plugin. libpq's sslmode=require sends nothing."""

    def _request_authentication(self) -> None:
        # The asyncio driver keeps the context it was given; the threaded one a flag.
        wanted = getattr(self, "_ssl_context", None) or getattr(self, "ssl", False)
        if wanted and not self.server_capabilities & CLIENT.SSL:
            raise _TLSNotOffered
        super()._request_authentication()


class MySQLBackend(ServerSQLBackend):
    def __init__(self, settings: ServerSettings) -> None:
        if settings.client is None and settings.database and "." not in settings.table:
            # dlock's own connections use the URL's database and never another: the
            # table is named in full without asking the first one (``_pin_table``).
            table = f"{quote_mysql_identifier(settings.database)}.{settings.table}"
            settings = dataclasses.replace(settings, table=table)
        super().__init__(settings)
        charset = settings.extra.get("charset")
        if charset is not None:
            known = charset_by_name(charset)
            if known is None:
                # The driver would fail each connection with an AttributeError.
                raise ConfigurationError(f"charset {charset!r} is not one PyMySQL knows")
            try:
                codecs.lookup(known.encoding)
            except LookupError:
                # Each connection failed with it, as a refusal (binary: no text codec).
                raise ConfigurationError(
                    f"charset {charset!r} has no Python codec to read text with"
                ) from None
        try:
            self._ssl = _ssl_context(settings.extra)
        except ConfigurationError as exc:
            raise ConfigurationError(f"TLS options: {exc}") from None
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"TLS options: {exc}") from exc

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> MySQLBackend:
        # PyMySQL's spelling: ``?unix_socket=/run/mysqld/mysqld.sock``.
        return cls(parse_server_url(url, options, PASSTHROUGH, socket_option="unix_socket"))

    #: Told by the first connection (``_note_server``).
    _mariadb = False

    def _statements(self, table: str) -> tuple[dict[str, str], str]:
        statements = mysql_statements(table)
        if self._mariadb:
            for key in WAITS:
                statements[key] = f"SET STATEMENT max_statement_time = 0 FOR {statements[key]}"
        return statements, MYSQL.schema(table, session=self._session_mode)

    def _driver_table_durable(self, conn: Conn) -> bool | None:
        schema, _, table = self._settings.table.rpartition(".")
        params = {"schema": schema or None, "table": table}
        rows = (self._run(conn, MYSQL_TABLE_ENGINE, params)).rows
        if not rows or rows[0][0] is None:
            return None
        engine = rows[0][0]
        engine = engine.decode() if isinstance(engine, bytes) else str(engine)
        return engine.upper() != "MEMORY"

    def _driver_find_table(self, conn: Conn, table: str) -> str:
        database = (self._run(conn, "SELECT DATABASE()", {})).rows[0][0]
        if database is None:
            raise ConfigurationError(
                f"no database to keep the lock table {table!r} in: name one in the URL "
                f"(mysql://host/<database>) or in the table, table=<database>.{table}"
            )
        return f"{quote_mysql_identifier(str(database))}.{table}"

    def _driver_connect(self) -> Any:
        s = self._settings
        kwargs: dict[str, Any] = {
            "host": s.host,
            "port": s.port or 3306,
            "user": s.user or "",
            "password": s.password or "",
            "charset": s.extra.get("charset", "utf8mb4"),
            "connect_timeout": s.connect_timeout,
            "autocommit": True,
            # UPDATE reports matched rows, so an extend that changes nothing still counts.
            # Several statements in one query let a session-mode waiter record the lock
            # inside the server the moment its wait ends (values are still escaped by
            # the driver).
            "client_flag": CLIENT.FOUND_ROWS | CLIENT.MULTI_STATEMENTS,
            "ssl": self._ssl,
            "cursorclass": _QuietCursor,
            "unix_socket": s.socket,
        }
        if IS_ASYNC:
            kwargs["db"] = s.database
        else:
            # The threaded driver reads the handshake under its read timeout: a server
            # that accepts but does not answer (paused) cost the statements' timeout,
            # not connect_timeout. Set to theirs once connected.
            kwargs.update(
                database=s.database,
                read_timeout=s.connect_timeout,
                write_timeout=s.connect_timeout,
                ssl_disabled=self._ssl is None,
            )
        try:
            raw = _Connection(**kwargs)
            if IS_ASYNC:
                raw._connect()  # the threaded driver connects as it is made
            else:
                raw._read_timeout = raw._write_timeout = s.timeout
        except _TLSNotOffered:
            raise BackendError(
                f"{self._settings.address}: refused: TLS was asked for, but the server "
                "does not offer it; not logging in, nor locking, over an unencrypted "
                "connection"
            ) from None
        self._note_server(raw)
        return raw

    def _note_server(self, raw: Any) -> None:
        """MySQL 8 reads ``GET_LOCK``'s timeout as whole seconds (its source takes the
        argument as an integer, rounded); MariaDB takes fractions. Waits are cut to
        what the server makes, so none outlasts its bound.

        MariaDB's ``max_statement_time`` (a DBA's guard against runaway queries) ends a
        ``GET_LOCK`` wait early, as if it had timed out: the waiter would ask again and
        again and lose its place in the queue. Its waits turn it off for themselves
        (``SET STATEMENT``, MariaDB's own syntax); the wait's timeout bounds them."""
        if self._wait_grain is not None:
            return
        self._mariadb = "MariaDB" in raw.get_server_info()
        self._wait_grain = 0.0 if self._mariadb else 1.0
        self._use_table(self._table)

    def _driver_is_connection(self, value: Any) -> bool:
        return isinstance(value, pymysql.Connection)

    def _driver_adopt(self, raw: Any) -> bool:
        if not getattr(raw, "client_flag", 0) & CLIENT.FOUND_ROWS:
            raise ConfigurationError(
                "a client= connection for MariaDB/MySQL needs client_flag=CLIENT.FOUND_ROWS "
                "(pymysql.constants.CLIENT): without it a renewal that changes nothing "
                "counts as lost"
            )
        if raw.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS:
            self._refuse_open_transaction("the server reports one open")
        self._note_server(raw)
        before = bool(raw.get_autocommit())
        raw.autocommit(True)
        return before

    def _driver_restore(self, raw: Any, autocommit: bool) -> None:
        raw.autocommit(autocommit)

    def _driver_end_loan(self, context: Any, closed: bool) -> None:
        """The asyncio driver's pool wakes an acquire waiting for a connection only
        when one comes back open: one given back closed (a waiter's, which carries the
        turnstile) left the application's tasks waiting on a full pool asleep, though it
        had room again. Woken here as the pool's own release wakes them, in a task of
        the pool's loop."""
        pool: Any = getattr(context, "_pool", None)
        super()._driver_end_loan(context, closed)
        if closed and IS_ASYNC and hasattr(pool, "_wakeup"):
            pool._loop.create_task(pool._wakeup())

    def _driver_execute(self, raw: Any, sql: str, params: dict[str, Any], timeout: float) -> Result:
        # PyMySQL's read timeout (the operation timeout, fixed per connection) bounds the
        # sync face; waits inside the server are kept shorter than it (_session_wait).
        # The cursor class is given here too, for connections brought with ``client=``.
        with raw.cursor(_QuietCursor) as cursor:
            cursor.execute(sql, params or None)
            while True:
                rows = cursor.fetchall()
                result = Result(list(rows or ()), cursor.rowcount, cursor.lastrowid or 0)
                # Several statements: the last one's result is the answer.
                if not cursor.nextset():
                    return result

    def _driver_close(self, raw: Any) -> None:
        writer = getattr(raw, "_writer", None) if IS_ASYNC else None
        raw.close()
        if writer is not None:
            # Over TLS the event loop still has to close the socket after the TLS
            # goodbye; a loop that ended first (asyncio.run) would leave it open.
            with contextlib.suppress(Exception):
                call_with_timeout(writer.wait_closed(), min(1.0, self._settings.timeout))

    def _driver_abandon(self, raw: Any) -> None:
        if not IS_ASYNC:
            raw.close()
            return
        # pymysql's close hands the socket to the transport's event loop, which has
        # ended: the transport is only marked closing (the loop refuses the rest), and
        # its socket is shut down and closed here. The connection forgets its streams,
        # so that its finalizer does not close them again. Over TLS the socket is shut
        # down, and its file left to the garbage collector.
        writer = getattr(raw, "_writer", None)
        raw._writer = raw._reader = None
        if writer is None:
            return
        transport = writer.transport
        with contextlib.suppress(OSError):
            _shut_down(transport.get_extra_info("socket"))
        with contextlib.suppress(RuntimeError):
            transport.close()
        own = getattr(transport, "_sock", None)
        if own is not None:
            transport._sock = None
            own.close()

    def _driver_disown(self, raw: Any) -> None:
        if IS_ASYNC:
            self._driver_abandon(raw)
        # PyMySQL's close takes the lock of the connection's buffered reader, which a
        # thread of the parent reading at the fork holds for ever here: the child would
        # hang. Its finalizer closes the socket (/dev/null by now) once it is unused.

    def _driver_fileno(self, raw: Any) -> int:
        if IS_ASYNC:
            return int(raw._writer.get_extra_info("socket").fileno())
        return int(raw._sock.fileno())

    def _driver_idle_dead(self, raw: Any) -> bool:
        if IS_ASYNC:
            # The event loop reads the socket as data comes, into the stream reader; what
            # came since it last ran (a restart while it was blocked) is still unread.
            reader = getattr(raw, "_reader", None)
            if reader is None or reader._eof or reader._buffer:
                return True
            try:
                fd = self._driver_fileno(raw)
            except (AttributeError, OSError):
                return True
            return self._readable(fd)
        sock = getattr(raw, "_sock", None)
        return sock is None or self._readable(sock.fileno())

    def _driver_session_ended(self, exc: BaseException) -> bool:
        code = exc.args[0] if isinstance(exc, pymysql.MySQLError) and exc.args else None
        return code in SESSION_ENDED

    def _driver_error(self, exc: BaseException) -> BackendError | None:
        if not isinstance(exc, pymysql.MySQLError):
            return None
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
        text = exc.args[1] if len(exc.args) > 1 else str(exc)
        if code in ACCESS_DENIED:
            return BackendError(f"access denied: {text}")
        if code == NOT_THREAD_OWNER:
            return BackendError(
                f"missing privilege: ({code}) {text}: ending another user's session (a"
                " force release, an eviction) needs CONNECTION ADMIN (MySQL 8:"
                " CONNECTION_ADMIN) or SUPER, or the holder's own user"
            )
        if certificate_refused(exc):
            return BackendError(f"refused: ({code}) {text}")
        if code in READ_ONLY:
            return BackendError(f"the server is read-only (a replica?): {text}")
        if code == NO_SUCH_DATABASE:
            return NoSuchSchema(
                f"({code}) {text}: create the database first (CREATE DATABASE), or name one"
                " that exists"
            )
        if code == NO_SUCH_TABLE:
            return self._missing_table(text)
        if (
            code in CLIENT_ERRORS
            or code in CONNECTION_ENDED
            or code in LOCK_WAIT_ENDED
            or isinstance(exc, pymysql.err.InterfaceError)
        ):
            return BackendUnavailable(f"({code}) {text}")
        return BackendError(f"({code}) {text}")

    def _is_lock_timeout(self, exc: BaseException) -> bool:
        return False  # GET_LOCK answers 0 on timeout

    def _session_fence(self, result: Result) -> tuple[int, int | None] | None:
        return (result.insert_id, None) if result.rowcount > 0 else None

    def _session_key(self, name: str) -> Any:
        return named_lock_key(self._table, name)

    def _session_time_left(self, name: str, result: Result) -> float | None:
        rows = (self._call("session_time_left", {"name": encode_name(name)})).rows
        return float(rows[0][0]) if rows else None

    def _session_evict(self, name: str) -> int | None:
        """Two steps (MySQL cannot KILL from inside a statement): a holder renewing
        between them must not be killed, so the row is cleared, still expired, first."""
        key = encode_name(name)
        rows = (self._call("session_expired_holder", {"name": key})).rows
        ended = None
        for (session,) in rows:
            params = {"name": key, "session": int(session)}
            cleared = (self._call("session_clear_expired", params)).rowcount > 0
            if cleared and self._kill(int(session)):
                ended = int(session)
        return ended

    def _kill(self, session: int, statement: str = "kill") -> bool:
        try:
            self._call(statement, {"id": session})
        except BackendError as exc:
            if "Unknown thread" not in str(exc):
                raise
            return False  # it ended meanwhile
        return True

    def _got_wait(self, result: Result) -> bool:
        return bool(result.rows) and result.rows[0][0] == 1

    def _records_in_wait(self, conn: Conn) -> bool:
        # A client= connection may have been opened without multi-statements.
        return bool(getattr(conn.raw, "client_flag", 0) & CLIENT.MULTI_STATEMENTS)

    _queues_on = _records_in_wait

    def _wait_and_record_sql(
        self, conn: Conn, params: dict[str, Any], wait: float
    ) -> tuple[str, dict[str, Any]]:
        return self._sql["session_wait_and_record"], {**params, "wait": wait}

    def _session_acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        """A name's first lock may find the MEMORY table full (its size is fixed when
        the server starts): the rows of free names are pruned and the lock tried once
        more. The failed statement was refused by the server, which wrote nothing, and
        the lock it took was given up (``_abandon_session``), so trying again cannot
        count anything twice, nor find our own lock busy."""
        try:
            return super()._session_acquire(name, token, ttl, holder, reentrant)
        except BackendError as exc:
            if not _table_full(exc):
                raise
        self._call("session_make_room", {})
        return super()._session_acquire(name, token, ttl, holder, reentrant)

    def _abandon_session(self, conn: Conn, key: Any, exc: BaseException) -> None:
        """Refused for a full table, the statement had already taken the lock on its
        connection, which is still usable: unlock it there. Closing the connection
        would free it too, but only once the server has noticed the close, so that an
        attempt right after could find the lock still held by the closed session."""
        if isinstance(exc, BackendError) and _table_full(exc):
            try:
                self._run(conn, self._sql["session_unlock"], {"key": key})
            except BaseException:
                self._drop(conn)
                raise
            self._give(conn)
            return
        super()._abandon_session(conn, key, exc)

    # -- lease mode --------------------------------------------------------------------

    def _lease_acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        params = self._params(
            name,
            token,
            ttl=ttl,
            holder=holder.to_json(),
            reentrant=reentrant,
            turnstile=self._turnstile_key(name),
        )
        statement = "acquire" if reentrant else "acquire_once"
        waiter = self._lease_waiter_of(token, reentrant, params)
        if waiter is None:
            result = self._call(statement, params)
        else:
            if waiter.first_attempt():
                return Busy()
            if waiter.in_front:
                # On the connection holding the turnstile: a free lease is kept for it.
                try:
                    result = self._run(waiter.conn, self._sql["acquire_front"], params)
                except BaseException:
                    # Cut off, it may still run in the waiter's session, and take the
                    # lease for nobody after every give-back (a chaos helper: a client
                    # closed at once, 5 of 228): the clean-up ends that session first.
                    waiter.cut_off = True
                    raise
            else:
                result = self._call(statement, params)
        if result.rowcount > 0:
            count = 1
            if reentrant:
                # The OK packet carries one number (the fence); re-entry needs the count.
                rows = (self._call("count", params)).rows
                count = int(rows[0][0]) if rows else 1
            if waiter is not None and waiter.in_front:
                waiter.granted = True  # the turnstile stays with the lease
            self._remember(params["name"])
            return Acquired(result.insert_id, count)
        if self._knows(params["name"]):
            return Busy()
        # First use of this name here (or not seen held lately): create its row, already
        # held by us if it is new.
        created = self._call("create_row", params)
        if created.insert_id == HELD_ROW:
            self._remember(params["name"])
            return Busy()
        if created.insert_id:
            self._remember(params["name"])
            return Acquired(created.insert_id, 1)
        # Someone else's free row appeared (or was there): one more try for it.
        result = self._call("acquire", params)
        if result.rowcount > 0:
            self._remember(params["name"])
            return Acquired(result.insert_id, 1)
        return Busy()

    def _plain_release(self, name: str, token: str) -> int | None:
        result = self._call("release", self._params(name, token))
        return result.insert_id if result.rowcount > 0 else None

    def _turnstile_key(self, name: str) -> Any:
        return named_lock_key(self._table + ":turnstile", name)

    def _queue_sql(self, waiter: TurnstileWaiter, wait: float) -> tuple[str, dict[str, Any]]:
        conn = waiter.conn
        if conn.session_id is None:
            # Asked of the server, once per waiting connection: the handshake's thread id
            # is a proxy's where one stands between (``_end_cut_off_wait``).
            (session, address), *_ = (self._run(conn, self._sql["session_identity"], {})).rows
            conn.session_id = int(session)
            conn.session_address = None if address is None else str(address)
        return self._sql["turnstile_take"], {**waiter.params, "wait": wait}

    def _hang_up(self, conn: Conn) -> None:
        # The socket is shut down, not closed: pymysql's close leaves that to the event
        # loop, which may end first (asyncio.run), and the clean-up still closes it. The
        # sync face's clean-up thread closes it at once.
        if IS_ASYNC:
            with contextlib.suppress(Exception):
                _shut_down(conn.raw._writer.get_extra_info("socket"))

    def _end_cut_off_wait(self, waiter: TurnstileWaiter) -> bool:
        """Closing the connection ends a ``GET_LOCK`` wait only once the server notices
        (MariaDB 10.11: about half a second later); a turnstile handed over before
        then still goes to the dead session, which takes the lease. Nor does a wait
        not seen running show that it will not run: the server may not have read it
        yet, or be between its statements (the take after the ``GET_LOCK``): a chaos
        run's lease held by nobody until its TTL, found so. So the session itself is
        killed, and the server asked until it has ended: what it ran by then is given
        back after. Only the session still there from the same address (host and
        port): after a restart its id may be another's. Over a Unix socket (no port)
        only the session seen running this wait is killed, its query alone; else it
        is waited for."""
        session, address = waiter.conn.session_id, waiter.conn.session_address
        if session is None or address is None:
            return False
        own_address = ":" in address
        params = {"id": session, "address": address, "statement": f"%{waiter.key}%"}
        deadline = time.monotonic() + self._settings.timeout
        killed = False
        while rows := (self._call("session_state", params)).rows:
            if not killed and (own_address or rows[0][0]):
                killed = True
                if not self._kill(session, "kill" if own_address else "kill_query"):
                    return True  # it ended meanwhile
            elif time.monotonic() >= deadline:
                return False
            else:
                sleep(0.005)
        return True

    def _queued(self, result: Result) -> tuple[bool, Acquired | None]:
        in_front, taken, fence = result.rows[0]
        return bool(in_front), Acquired(int(fence), 1) if taken and taken > 0 else None

    #: MySQL cannot notify: the waiter in front polls, while the turnstile keeps
    #: newcomers out.
    notifies_in_front = False

    def _wait_in_front(self, waiter: TurnstileWaiter, timeout: float) -> None:
        sleep(timeout)  # the client's backoff, jittered

    def _lease_force_release(self, name: str) -> bool:
        return (self._call("force_release", {"name": encode_name(name)})).rowcount > 0

    def _session_force_release(self, name: str) -> int | None:
        rows = (self._call("session_holder", {"name": encode_name(name)})).rows
        if not rows:
            return None
        session = int(rows[0][0])
        # KILL first: refused (another user's session, without CONNECTION ADMIN), it
        # changes nothing, where a row cleared first left the lock held but shown free,
        # and the holder's next renewal told it lost. A renewal racing with the kill
        # fails its check that the session still holds the lock, or the next one fails
        # its owner check on the cleared row; the holder learns of the kill within a
        # second anyway (its socket closes).
        if not self._kill(session):
            return None
        self._call("session_clear", {"name": encode_name(name), "session": session})
        return session

    def _extend_batch(self, leases: Sequence[Lease]) -> set[tuple[bytes, str]]:
        """Per distinct TTL (usually one) an UPDATE, and only when it matched fewer rows
        than asked (FOUND_ROWS counts matched rows), a SELECT of which are still held."""
        prefix = "session_" if self._session_mode else ""
        renewed: set[tuple[bytes, str]] = set()
        by_ttl: dict[float, list[Lease]] = {}
        for lease in leases:
            by_ttl.setdefault(lease.ttl, []).append(lease)
        for ttl, group in by_ttl.items():
            params: dict[str, Any] = {"ttl": ttl}
            pairs = []
            for i, lease in enumerate(group):
                params[f"n{i}"] = encode_name(lease.name)
                params[f"o{i}"] = lease.token
                pairs.append(f"(%(n{i})s, %(o{i})s)")
            placeholders = ", ".join(pairs)
            update = self._sql[f"{prefix}extend_many"].format(pairs=placeholders)
            updated = self._call("", params, sql=update)
            if updated.rowcount == len(group):
                renewed.update((encode_name(x.name), x.token) for x in group)
                continue
            select = self._sql[f"{prefix}renewed"].format(pairs=placeholders)
            rows = (self._call("", params, sql=select)).rows
            renewed.update((bytes(name), bytes(owner).decode()) for name, owner in rows)
        return renewed


BACKEND = MySQLBackend
