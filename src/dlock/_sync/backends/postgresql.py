# DO NOT EDIT: generated from src/dlock/_async/backends/postgresql.py by scripts/unasync.py.
"""PostgreSQL: a lease table (default) or advisory locks (``?mode=session``).

Driver: psycopg 3, maintained by the PostgreSQL driver's own authors, with a sync and
an asyncio connection in one package (the two faces stay the same code), server-side
prepared statements, and LISTEN/NOTIFY, which wakes lease-mode waiters when a lock is
released instead of polling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg import sql as psql
from psycopg import waiting
from psycopg.abc import PQGen
from psycopg.pq import TransactionStatus

from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._sql import (
    POSTGRESQL,
    POSTGRESQL_FIND_TABLE,
    POSTGRESQL_QUOTE_TABLE,
    POSTGRESQL_TABLE_PERSISTENCE,
    NoSuchSchema,
    ServerSettings,
    advisory_key,
    check_client_key,
    encode_name,
    notify_channel,
    parse_server_url,
    postgresql_statements,
)
from ..._tls import check_tls_files
from ..._types import Acquired, Busy, Holder, Lease
from ._server_sql import Conn, Result, ServerSQLBackend, TurnstileWaiter

#: The turnstile take, prepared once per waiting connection (see ``turnstile_take``).
TAKE = "dlock_take"
TAKE_PARAMETERS = (("name", "bytea"), ("owner", "text"), ("ttl", "float8"), ("holder", "text"))
#: The release of a lease taken in front of the turnstile, prepared with the take.
RELEASE_GATE = "dlock_release_gate"
RELEASE_GATE_PARAMETERS = (("name", "bytea"), ("owner", "text"), ("turnstile", "int8"))
#: Session mode's record of a lock obtained by waiting, prepared likewise.
RECORD = "dlock_record"
RECORD_PARAMETERS = (*TAKE_PARAMETERS, ("key", "int8"))


RV = TypeVar("RV")

#: How long a statement cut off by a cancellation (or Ctrl-C) is asked to stop on the
#: server, and then waited for, before its connection is hung up (see ``_stop_query``).
STOP_QUERY_WITHIN = 0.5
#: psycopg's interval between checks for an interrupt while it waits.
WAIT_INTERVAL = 0.1


class BoundedConnection(psycopg.Connection[Any]):
    """psycopg's connection, with every wait for the server bounded by ``call_timeout``.

    psycopg waits for an answer without limit, and a server that stops answering while
    its host still acknowledges the packets (paused, hung on a stalled disk) never
    trips TCP's own timeouts: a statement would wait forever, and a renewal with it,
    so its holder would never be told that the lease ran out. Past the bound the wait
    raises TimeoutError and dlock drops the connection. A statement cut off by a
    cancellation stops within a second too (``_stop_query``).
    """

    #: Seconds the statement about to run may wait for the server: set by dlock.
    call_timeout: float | None = None

    def wait(
        self, gen: PQGen[RV], interval: float | None = None, timeout: float | None = None
    ) -> RV:
        # A wait psycopg bounds itself (notifies) is left alone.
        bound = self.call_timeout if timeout is None else timeout
        deadline = time.monotonic() + (bound or 0.0)
        every = WAIT_INTERVAL if interval is None else interval
        try:
            return waiting.wait(gen, self.pgconn.socket, interval=every, timeout=bound)
        except psycopg.OperationalError as exc:
            if timeout is None and bound is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer within {bound:.3f} s") from exc
            raise
        except BaseException as exc:
            if (
                not isinstance(exc, Exception)
                and self.pgconn.transaction_status == TransactionStatus.ACTIVE
            ):
                self._stop_query(gen, every)
            raise

    def _stop_query(self, gen: PQGen[Any], interval: float) -> None:
        """A statement cut off while the server runs it (a cancelled task, Ctrl-C): ask
        the server to cancel it, then read on to its end, each for ``STOP_QUERY_WITHIN``
        at most, else hang up. psycopg's own wait allows 5 s for each, which a server
        that does not answer (paused, cut off) spends in full: a cancelled acquire took
        10 s to end. dlock drops the connection either way; the cancel ends a wait
        inside the server at once rather than at its bound."""
        try:
            # A server that does not answer the cancel may still end the query.
            with contextlib.suppress(Exception):
                self.cancel_safe(timeout=STOP_QUERY_WITHIN)
            waiting.wait(gen, self.pgconn.socket, interval=interval, timeout=STOP_QUERY_WITHIN)
        except psycopg.errors.QueryCanceled:
            return  # the end asked for: the session is idle again
        except BaseException as exc:
            # Not answered in time, or cut off again: the session's state is unknown.
            self.pgconn.finish()
            if not isinstance(exc, Exception):
                raise


def _prepare(name: str, parameters: tuple[tuple[str, str], ...], sql: str) -> str:
    """A PREPARE statement for ``sql``, whose ``%(name)s`` become positional."""
    position = {p: f"${i}" for i, (p, _) in enumerate(parameters, 1)}
    body = re.sub(r"%\((\w+)\)s", lambda m: position[m[1]], sql)
    return f"PREPARE {name} ({', '.join(kind for _, kind in parameters)}) AS {body}"


def _lock_waiting(key: int, ms: int) -> str:
    """Wait up to ``ms`` milliseconds for advisory lock ``key``, in a query's implicit
    transaction. The server's ``statement_timeout`` (a role's default, say) would cut
    the wait short, and it is fixed when a statement starts: so a statement before the
    wait turns it off for the transaction (PostgreSQL 13+ times each statement of a
    query on its own), and ``lock_timeout`` bounds the wait instead.

    Once the lock is granted, ``lock_timeout`` is turned off again: it must bound this
    wait alone. A statement after it (the record, the take) that timed out waiting for
    its row would read as this wait timing out, and roll back while the session keeps
    the advisory lock, which is not transactional: the connection would be pooled or
    kept still holding the lock (or the turnstile)."""
    return (
        "SELECT set_config('statement_timeout', '0', true),"
        f" set_config('lock_timeout', '{int(ms)}', true);"
        f" SELECT pg_advisory_lock({int(key)});"
        " SELECT set_config('lock_timeout', '0', true)"
    )


def _literals(conn: Any, parameters: tuple[tuple[str, str], ...], values: dict[str, Any]) -> str:
    """Values as SQL literals, quoted by the driver, for EXECUTE in a simple query."""
    return ", ".join(psql.Literal(values[p]).as_string(conn) for p, _ in parameters)


#: libpq's words for a server that answered and refused this client (credentials,
#: database, TLS settings). Trying again will not help, so these are not
#: BackendUnavailable, which a caller may retry; libpq gives no SQLSTATE for them.
REFUSALS = (
    "password authentication failed",
    "does not exist",  # the role or the database
    "no pg_hba.conf entry",
    "permission denied",
    "not permitted to log in",  # NOLOGIN
    "is not currently accepting connections",  # ALLOW_CONNECTIONS false
    "certificate",
    "alert unknown ca",  # the server does not trust our certificate's issuer
    "SSL was required",
    "does not support SSL",
    # No TLS version both sides speak (a legacy server's TLS 1.1): the server's alert,
    # or the client's own refusal of the version the server answers with.
    "alert protocol version",
    "unsupported protocol",
)


#: libpq's words for an option value it does not know ("invalid sslmode value"), found
#: only as it connects: a misconfiguration, which trying again will not mend.
BAD_OPTION = re.compile(r'invalid \w+ value|value "[^"]*" invalid|may not be used with')

#: The values libpq takes for its enumerated options: anything else fails every
#: connection, so ``connect()`` refuses it (psycopg's conninfo parsing checks names only).
LIBPQ_VALUES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
}


def _check_libpq_values(extra: dict[str, str]) -> None:
    for option, values in LIBPQ_VALUES.items():
        if option in extra and extra[option] not in values:
            raise ConfigurationError(
                f"{option} must be one of {', '.join(values)}, not {extra[option]!r}"
            )


#: SQLSTATEs of a server that ends the session: admin_shutdown (pg_terminate_backend, a
#: fast shutdown), crash_shutdown, cannot_connect_now.
SESSION_ENDED = frozenset({"57P01", "57P02", "57P03"})
#: libpq's words for a connection the server closed (end of file, or reset).
CLOSED_BY_SERVER = "server closed the connection unexpectedly"


def _sslmode_default(extra: dict[str, str]) -> dict[str, str]:
    """Without ``sslmode`` libpq means "prefer": no check of the server's certificate,
    and plain text from a server that offers no TLS. Whoever names a CA or a client
    certificate means TLS: dlock then asks for it, verified against the CA and the host
    name when a CA is given, as its MySQL backend does. An explicit sslmode wins."""
    if "sslmode" in extra or not {"sslrootcert", "sslcert", "sslkey"} & extra.keys():
        return {}
    return {"sslmode": "verify-full" if "sslrootcert" in extra else "require"}


#: libpq options passed through from the URL or ``connect()``: TLS and the like.
PASSTHROUGH = frozenset(
    {
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslpassword",
        "sslcrl",
        "application_name",
        "target_session_attrs",
    }
)


class PostgreSQLBackend(ServerSQLBackend):
    #: The lock keys are made from the table's name as ``format('%I.%I')`` spells it,
    #: which quotes a reserved word: ``table=order`` is found as ``public."order"``, so
    #: ``table=public.order`` must be spelled so too, or the two would be two sets of
    #: locks on one table. Ordinary names need no quotes, so their keys are as before.
    _pins_qualified_table = True

    def __init__(self, settings: ServerSettings) -> None:
        if "." in settings.table:
            # As PostgreSQL reads it (unquoted names fold to lower case), until the
            # first connection spells it (``_driver_find_table``).
            settings = dataclasses.replace(settings, table=settings.table.lower())
        super().__init__(settings)
        _check_libpq_values(settings.extra)
        check_tls_files(
            settings.extra, ("sslrootcert", "sslcert", "sslkey", "sslcrl"), keywords=("system",)
        )
        check_client_key(
            settings.extra.get("sslkey"), settings.extra.get("sslpassword"), "sslpassword"
        )
        #: Whether a pooler stands in front, by driver connection (a borrowed one comes
        #: back again and again).
        self._behind_proxy_by_connection: weakref.WeakKeyDictionary[Any, bool] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> PostgreSQLBackend:
        # libpq's spelling: ``?host=/run/postgresql``, a directory holding the socket.
        # The default table is in public, whatever each role's search_path says: roles
        # with a schema of their own would otherwise each make their own table.
        settings = parse_server_url(
            url, options, PASSTHROUGH, socket_option="host", default_schema="public"
        )
        return cls(settings)

    def _statements(self, table: str) -> tuple[dict[str, str], str]:
        return (
            postgresql_statements(table),
            POSTGRESQL.schema(table, session=self._session_mode),
        )

    def schema_sql(self) -> list[str]:
        """Before a connection has named the table (``dlock init --print``), each part
        is quoted as PostgreSQL reads it unquoted (lower case): a reserved word such as
        ``order`` is then valid, and any other name means the same table."""
        if self._table_pinned:
            return super().schema_sql()
        table = ".".join(f'"{part.lower()}"' for part in self._table.split("."))
        return [POSTGRESQL.schema(table, session=self._session_mode)]

    def _use_table(self, table: str) -> None:
        super()._use_table(table)
        self._prepare_take = _prepare(TAKE, TAKE_PARAMETERS, self._sql["turnstile_take"])
        self._prepare_release_gate = _prepare(
            RELEASE_GATE, RELEASE_GATE_PARAMETERS, self._sql["release_gate"]
        )
        self._prepare_record = _prepare(RECORD, RECORD_PARAMETERS, self._sql["session_record"])

    def _driver_table_durable(self, conn: Conn) -> bool | None:
        rows = (self._run(conn, POSTGRESQL_TABLE_PERSISTENCE, {"table": self._table})).rows
        return None if not rows else rows[0][0] == "p"

    def _driver_find_table(self, conn: Conn, table: str) -> str:
        if "." in table:
            schema, relation = table.split(".")
            params = {"schema": schema, "table": relation}
            found = (self._run(conn, POSTGRESQL_QUOTE_TABLE, params)).rows[0][0]
        else:
            found = (self._run(conn, POSTGRESQL_FIND_TABLE, {"table": table})).rows[0][0]
        if found is None:
            raise ConfigurationError(
                f"no schema to keep the lock table {table!r} in: none of the search_path "
                f"exists; name one, table=<schema>.{table}"
            )
        if str(found).startswith("pg_"):
            # pg_temp above all: a table there is each connection's own, and every
            # client would hold the same name at once.
            raise ConfigurationError(
                f"the lock table {table!r} would be {found}, in a system schema (pg_temp "
                "keeps a table of each connection's own, seen by no other client); name "
                "a schema of your own, table=<schema>.<table>"
            )
        return str(found)

    def _driver_connect(self) -> Any:
        s = self._settings
        params: dict[str, Any] = {
            "host": s.socket or s.host,
            "port": s.port,
            "user": s.user,
            "password": s.password,
            "dbname": s.database,
            # libpq counts whole seconds, at least 2.
            "connect_timeout": max(2, math.ceil(s.connect_timeout)),
            # The kernel gives up on a peer that stops acknowledging (a dead server).
            "tcp_user_timeout": int(s.timeout * 1000),
            **_sslmode_default(s.extra),
            **s.extra,
        }
        return BoundedConnection.connect(autocommit=True, **params)

    def _driver_is_connection(self, value: Any) -> bool:
        return isinstance(value, psycopg.Connection)

    def _driver_setup(self, conn: Conn) -> None:
        result = self._run(conn, self._sql["setup"], {})
        self._note_proxy(conn, int(result.rows[0][0]))
        if conn.behind_proxy:
            # psycopg prepares a statement on the server after its fifth run; behind a
            # transaction-pooling proxy the next run may reach a session that has it
            # already, or lacks it. (A borrowed connection is the application's to set.)
            conn.raw.prepare_threshold = None

    def _behind_proxy(self, conn: Conn) -> bool:
        if conn.behind_proxy is None:
            # Borrowed: asked once per connection of the application's pool.
            known = self._behind_proxy_by_connection.get(conn.raw)
            if known is None:
                result = self._run(conn, self._sql["backend_pid"], {})
                self._note_proxy(conn, int(result.rows[0][0]))
            else:
                conn.behind_proxy = known
        return bool(conn.behind_proxy)

    def _note_proxy(self, conn: Conn, pid: int) -> None:
        """A pooler hands the client a session id of its own at connect, not the
        server's: the two differ only when something stands between."""
        conn.behind_proxy = pid != conn.raw.info.backend_pid
        self._behind_proxy_by_connection[conn.raw] = conn.behind_proxy

    def _driver_adopt(self, raw: Any) -> bool:
        status = raw.info.transaction_status
        if status != psycopg.pq.TransactionStatus.IDLE:
            self._refuse_open_transaction(f"status {status.name}")
        before = bool(raw.autocommit)
        raw.set_autocommit(True)
        return before

    def _driver_restore(self, raw: Any, autocommit: bool) -> None:
        raw.set_autocommit(autocommit)

    def _driver_execute(self, raw: Any, sql: str, params: dict[str, Any], timeout: float) -> Result:
        if isinstance(raw, BoundedConnection):
            raw.call_timeout = timeout
        # Without parameters psycopg uses the simple protocol (several statements allowed,
        # the last one's result is the answer).
        cursor = raw.execute(sql, params or None)
        while cursor.nextset():
            pass
        # pgresult.nfields, not description, which builds a Column object per column.
        result = cursor.pgresult
        rows = cursor.fetchall() if result is not None and result.nfields else []
        return Result(rows, cursor.rowcount, 0)

    def _driver_close(self, raw: Any) -> None:
        raw.close()

    def _driver_abandon(self, raw: Any) -> None:
        # libpq closes the connection itself, without the event loop.
        raw.pgconn.finish()

    def _driver_fileno(self, raw: Any) -> int:
        return int(raw.fileno())

    def _driver_idle_dead(self, raw: Any) -> bool:
        return bool(raw.closed) or self._readable(raw.fileno())

    def _driver_session_ended(self, exc: BaseException) -> bool:
        # The server's FATAL before it closes (terminated, shutting down, starting up
        # again after a crash); or the close without one, which libpq tells from a
        # server that does not answer (a timeout).
        if isinstance(exc, psycopg.Error) and exc.sqlstate in SESSION_ENDED:
            return True
        return isinstance(exc, psycopg.OperationalError) and CLOSED_BY_SERVER in str(exc)

    def _driver_error(self, exc: BaseException) -> BackendError | None:
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            return BackendError(
                "the server is read-only (a replica, or default_transaction_read_only is "
                f"on for this database or role): {exc}"
            )
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return BackendError(f"missing privilege: {exc}")
        if isinstance(exc, psycopg.errors.InvalidSchemaName):
            return NoSuchSchema(
                f"{str(exc).splitlines()[0]}: create the schema first (CREATE SCHEMA), or"
                " name the table in one that exists"
            )
        if isinstance(exc, psycopg.errors.UndefinedTable):
            return self._missing_table(str(exc).splitlines()[0])
        if isinstance(exc, psycopg.errors.SerializationFailure):
            # Only on a connection borrowed with client=: dlock's own are READ COMMITTED.
            return BackendError(
                f"{str(exc).strip()}: dlock needs READ COMMITTED, and this connection's "
                "default_transaction_isolation is stricter; set it to 'read committed' "
                "on the connections given with client="
            )
        if isinstance(exc, psycopg.OperationalError):
            text = str(exc).strip()
            if any(reason in text for reason in REFUSALS):
                return BackendError(f"refused: {text}")
            if BAD_OPTION.search(text):
                return BackendError(f"misconfigured: {text}")
            return BackendUnavailable(text)
        if isinstance(exc, psycopg.Error):
            return BackendError(str(exc).strip())
        return None

    def _is_lock_timeout(self, exc: BaseException) -> bool:
        return isinstance(exc, psycopg.errors.LockNotAvailable)

    def _session_fence(self, result: Result) -> tuple[int, int | None] | None:
        if not result.rows or result.rows[0][0] is None:
            return None  # busy: the row is the holder's lease
        return int(result.rows[0][0]), int(result.rows[0][1])

    def _session_unrecorded(self, result: Result) -> bool:
        # session_acquire's row: fence, session, seconds left, lock taken.
        return bool(result.rows) and result.rows[0][0] is None and bool(result.rows[0][3])

    def _session_key(self, name: str) -> Any:
        return advisory_key(self._table, name)

    def _session_time_left(self, name: str, result: Result) -> float | None:
        # The acquire statement's busy branch reads the holder's lease in the same snapshot.
        if result.rows and result.rows[0][2] is not None:
            return float(result.rows[0][2])
        return None

    def _session_evict(self, name: str) -> int | None:
        rows = (self._call("session_evict", {"name": encode_name(name)})).rows
        return int(rows[0][0]) if rows else None

    # -- lease mode --------------------------------------------------------------------

    def _lease_acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        params = self._params(name, token, ttl=ttl, holder=holder.to_json(), reentrant=reentrant)
        statement = "acquire" if reentrant else "acquire_once"
        waiter = self._lease_waiter_of(token, reentrant, params)
        if waiter is None:
            # Not waiting (yet): one plain statement, the uncontended path.
            result = self._call(statement, params)
            if result.rows:
                self._remember(params["name"])
                return Acquired(int(result.rows[0][0]), int(result.rows[0][1]))
            if self._knows(params["name"]):
                # Busy. When the lease ends matters only to a waiter, whose attempts ask.
                return Busy()
            return self._first_use(params)
        if waiter.first_attempt():
            # The attempt after the take, on its connection once LISTEN is in force,
            # cannot miss a release.
            return Busy()
        if waiter.in_front:
            result = self._run(waiter.conn, self._sql[statement + "_waiting"], params)
        else:
            result = self._call(statement + "_waiting", params)
        if not result.rows:
            granted = self._first_use(params)
        else:
            fence, count, left = result.rows[0]
            if fence is None:
                if left > 0:  # held; 0: free, taken by a faster grant or not yet
                    self._remember(params["name"])
                return Busy(retry_after=max(0.0, float(left)))
            self._remember(params["name"])
            granted = Acquired(int(fence), int(count))
        if isinstance(granted, Acquired) and waiter.in_front:
            waiter.granted = True  # the turnstile stays with the lease
        return granted

    def _first_use(self, params: dict[str, Any]) -> Acquired | Busy:
        """No row came back: ask when the lease ends, and create the row if there is none
        (the name's first use; the new row is ours unless someone was faster)."""
        left = (self._call("time_left", params)).rows
        if left:
            if left[0][0] is None:
                return Busy(retry_after=0.0)  # free: released meanwhile
            self._remember(params["name"])
            return Busy(retry_after=max(0.0, float(left[0][0])))
        created = (self._call("create_row", params)).rows
        if created:
            self._remember(params["name"])
            return Acquired(int(created[0][0]), int(created[0][1]))
        result = self._call("acquire", params)
        if result.rows:
            self._remember(params["name"])
            return Acquired(int(result.rows[0][0]), int(result.rows[0][1]))
        return Busy()

    def _plain_release(self, name: str, token: str) -> int | None:
        params = self._params(name, token, channel=notify_channel(self._table, name))
        result = self._call("release", params)
        return int(result.rows[0][0]) if result.rows else None

    def _extend_batch(self, leases: Sequence[Lease]) -> set[tuple[bytes, str]]:
        params = {
            "names": [encode_name(x.name) for x in leases],
            "owners": [x.token for x in leases],
            "ttls": [x.ttl for x in leases],
        }
        key = "session_extend_many" if self._session_mode else "extend_many"
        result = self._call(key, params)
        return {(bytes(name), owner) for name, owner in result.rows}

    def _lease_force_release(self, name: str) -> bool:
        params = {"name": encode_name(name), "channel": notify_channel(self._table, name)}
        return bool((self._call("force_release", params)).rows)

    def _turnstile_key(self, name: str) -> Any:
        return advisory_key(self._table + ":turnstile", name)

    def _queue_sql(self, waiter: TurnstileWaiter, wait: float) -> tuple[str, dict[str, Any]]:
        if TAKE not in waiter.conn.prepared:
            # The release of a lease taken here runs on this connection too.
            self._run(waiter.conn, f"{self._prepare_take}; {self._prepare_release_gate}", {})
            waiter.conn.prepared |= {TAKE, RELEASE_GATE}
        channel = notify_channel(self._table, waiter.name)
        ms = max(1, math.ceil(wait * 1000))
        return self._take_sql(waiter.conn.raw, waiter.key, channel, waiter.params, ms), {}

    def _queued(self, result: Result) -> tuple[bool, Acquired | None]:
        # A lock timeout raised; an answer means the turnstile is ours.
        if not result.rows:
            return True, None
        return True, Acquired(int(result.rows[0][0]), int(result.rows[0][1]))

    def _cut_off_wait_ended(self, conn: Conn) -> bool:
        # An interrupted query is cancelled on the server and read on to its end
        # (``_stop_query``; psycopg's own wait does so too); the connection is closed
        # if the server does not answer that in time.
        raw = conn.raw
        return not raw.closed and raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    def _wait_in_front(self, waiter: TurnstileWaiter, timeout: float) -> None:
        channel = notify_channel(self._table, waiter.name)
        try:
            for notify in waiter.conn.raw.notifies(timeout=timeout):
                # Earlier waiters' channels may still have sent something: not ours.
                if notify.channel == channel:
                    break
        except psycopg.Error as exc:
            raise BackendUnavailable(f"waiting for a release notification: {exc}") from exc

    def _release_gate_sql(self, conn: Conn, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Release and UNLISTEN in one simple-protocol round trip. The connection is kept
        for waiting afterwards, and nothing reads its socket until its next wait: still
        subscribed, it would pile up the channel's notifications until its backend
        blocked writing them, and stopped reading the server-wide notification queue,
        which then fills, and every NOTIFY (every release) fails."""
        if RELEASE_GATE not in conn.prepared:
            self._run(conn, self._prepare_release_gate, {})
            conn.prepared.add(RELEASE_GATE)
        values = _literals(conn.raw, RELEASE_GATE_PARAMETERS, params)
        return f"UNLISTEN *; EXECUTE {RELEASE_GATE}({values})", {}

    def _take_sql(self, conn: Any, key: int, channel: str, params: dict[str, Any], ms: int) -> str:
        """Listen, queue on the turnstile and take the lease, as one simple-protocol
        round trip: its statements run as one transaction, so the timeout bounds the
        lock wait, and LISTEN (which takes effect at commit) and the take happen only
        once the turnstile is ours. After the turnstile is handed over only the take is
        left to run, inside the server, with a fresh snapshot. Integers and the channel
        (a hex identifier) are interpolated; the values are literals quoted by the
        driver, for the prepared ``turnstile_take``."""
        values = _literals(conn, TAKE_PARAMETERS, params)
        return f"UNLISTEN *; LISTEN {channel}; {_lock_waiting(key, ms)}; EXECUTE {TAKE}({values})"

    def _records_in_wait(self, conn: Conn) -> bool:
        return True

    def _wait_and_record_sql(
        self, conn: Conn, params: dict[str, Any], wait: float
    ) -> tuple[str, dict[str, Any]]:
        """Wait for the advisory lock, then record it (fence, holder, lease, session),
        as one simple-protocol round trip: the record runs inside the server the moment
        the lock is granted. Only integers are interpolated, and literals quoted by the
        driver for the prepared ``session_record``."""
        if RECORD not in conn.prepared:
            self._run(conn, self._prepare_record, {})
            conn.prepared.add(RECORD)
        values = _literals(conn.raw, RECORD_PARAMETERS, params)
        ms = max(1, math.ceil(wait * 1000))
        return f"{_lock_waiting(params['key'], ms)}; EXECUTE {RECORD}({values})", {}

    def _session_force_release(self, name: str) -> int | None:
        result = self._call("session_force_release", {"name": encode_name(name)})
        return int(result.rows[0][0]) if result.rows else None


BACKEND = PostgreSQLBackend
