# DO NOT EDIT: generated from src/dlock/_async/backends/postgresql.py by scripts/unasync.py.
"""PostgreSQL: a lease table (default) or advisory locks (``?mode=session``).

Driver: psycopg 3, maintained by the PostgreSQL driver's own authors, with a sync and
an asyncio connection in one package (the two faces stay the same code), server-side
prepared statements, and LISTEN/NOTIFY, which wakes lease-mode waiters when a lock is
released instead of polling.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg import sql as psql
from psycopg.abc import PQGen

from ..._errors import BackendError, BackendUnavailable
from ..._sql import (
    POSTGRESQL,
    ServerSettings,
    advisory_key,
    encode_name,
    notify_channel,
    parse_server_url,
    postgresql_statements,
)
from ..._types import Acquired, Busy, Holder, Lease
from ..backend import Waiter
from ._server_sql import Conn, Result, ServerSQLBackend

#: The turnstile take, prepared once per waiting connection (see ``turnstile_take``).
TAKE = "dlock_take"
TAKE_PARAMETERS = (("name", "bytea"), ("owner", "text"), ("ttl", "float8"), ("holder", "text"))
#: Session mode's record of a lock obtained by waiting, prepared likewise.
RECORD = "dlock_record"
RECORD_PARAMETERS = (*TAKE_PARAMETERS, ("key", "int8"))


RV = TypeVar("RV")


class BoundedConnection(psycopg.Connection[Any]):
    """psycopg's connection, with every wait for the server bounded by ``call_timeout``.

    psycopg waits for an answer without limit, and a server that stops answering while
    its host still acknowledges the packets (paused, hung on a stalled disk) never
    trips TCP's own timeouts: a statement would wait forever, and a renewal with it,
    so its holder would never be told that the lease ran out. Past the bound the wait
    raises TimeoutError and dlock drops the connection. (Cancelling the task instead,
    as ``asyncio.timeout`` does, makes psycopg first ask the hung server to cancel the
    query: 10 s more.)
    """

    #: Seconds the statement about to run may wait for the server: set by dlock.
    call_timeout: float | None = None

    def wait(
        self, gen: PQGen[RV], interval: float | None = None, timeout: float | None = None
    ) -> RV:
        # A wait psycopg bounds itself (notifies) is left alone.
        bound = self.call_timeout if timeout is None else timeout
        deadline = time.monotonic() + (bound or 0.0)
        try:
            if interval is None:
                return super().wait(gen, timeout=bound)
            return super().wait(gen, interval, bound)
        except psycopg.OperationalError as exc:
            if timeout is None and bound is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer within {bound:.3f} s") from exc
            raise


def _prepare(name: str, parameters: tuple[tuple[str, str], ...], sql: str) -> str:
    """A PREPARE statement for ``sql``, whose ``%(name)s`` become positional."""
    position = {p: f"${i}" for i, (p, _) in enumerate(parameters, 1)}
    body = re.sub(r"%\((\w+)\)s", lambda m: position[m[1]], sql)
    return f"PREPARE {name} ({', '.join(kind for _, kind in parameters)}) AS {body}"


def _literals(conn: Any, parameters: tuple[tuple[str, str], ...], values: dict[str, Any]) -> str:
    """Values as SQL literals, quoted by the driver, for EXECUTE in a simple query."""
    return ", ".join(psql.Literal(values[p]).as_string(conn) for p, _ in parameters)


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
    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(
            settings,
            postgresql_statements(settings.table),
            POSTGRESQL.schema(settings.table, session=settings.mode == "session"),
        )
        #: Connections that wait on the turnstile and LISTEN, apart from the statement pool.
        self._listeners: list[Conn] = []
        #: Waiters by owner token: the one in front of the turnstile acquires on its own
        #: connection.
        self._front: dict[str, _TurnstileWaiter] = {}
        #: Leases taken in front of the turnstile, by owner token: the turnstile stays
        #: held on their connection until they end.
        self._gates: dict[str, _Gate] = {}
        self._prepare_take = _prepare(TAKE, TAKE_PARAMETERS, self._sql["turnstile_take"])
        self._prepare_record = _prepare(RECORD, RECORD_PARAMETERS, self._sql["session_record"])

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> PostgreSQLBackend:
        return cls(parse_server_url(url, options, PASSTHROUGH))

    def _driver_connect(self) -> Any:
        s = self._settings
        params: dict[str, Any] = {
            "host": s.host,
            "port": s.port,
            "user": s.user,
            "password": s.password,
            "dbname": s.database,
            # libpq counts whole seconds, at least 2.
            "connect_timeout": max(2, math.ceil(s.connect_timeout)),
            # The kernel gives up on a peer that stops acknowledging (a dead server).
            "tcp_user_timeout": int(s.timeout * 1000),
            **s.extra,
        }
        return BoundedConnection.connect(autocommit=True, **params)

    def _driver_is_connection(self, value: Any) -> bool:
        return isinstance(value, psycopg.Connection)

    def _driver_adopt(self, raw: Any) -> bool:
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

    def _driver_idle_dead(self, raw: Any) -> bool:
        return bool(raw.closed) or self._readable(raw.fileno())

    def _driver_error(self, exc: BaseException) -> BackendError | None:
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            return BackendError(f"the server is a read-only replica: {exc}")
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return BackendError(f"missing privilege: {exc}")
        if isinstance(exc, psycopg.OperationalError):
            return BackendUnavailable(str(exc).strip())
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

    def _session_evict(self, name: str) -> None:
        self._call("session_evict", {"name": encode_name(name)})

    # -- lease mode --------------------------------------------------------------------

    def _lease_acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        params = self._params(name, token, ttl=ttl, holder=holder.to_json(), reentrant=reentrant)
        statement = "acquire" if reentrant else "acquire_once"
        waiter = self._front.get(token)
        if waiter is None:
            if not reentrant:
                # A fresh acquisition: a gate left by an earlier one (lost, never
                # released) only blocks the queue.
                self._drop_gate(token)
            # Not waiting (yet): one plain statement, the uncontended path.
            result = self._call(statement, params)
            if result.rows:
                return Acquired(int(result.rows[0][0]), int(result.rows[0][1]))
            if params["name"] in self._known:
                # Busy. When the lease ends matters only to a waiter, whose attempts ask.
                return Busy()
            return self._first_use(params)
        waiter.params = params
        if waiter.in_front:
            result = self._run(waiter.conn, self._sql[statement + "_waiting"], params)
        elif waiter.fresh:
            # The core's attempt on entering the waiter would only repeat the one just
            # made: the take in front of the turnstile comes next, and the attempt
            # after it, on its connection once LISTEN is in force, cannot miss a
            # release.
            waiter.fresh = False
            return Busy()
        else:
            result = self._call(statement + "_waiting", params)
        if not result.rows:
            granted = self._first_use(params)
        else:
            self._remember(params["name"])
            fence, count, left = result.rows[0]
            if fence is None:
                return Busy(retry_after=max(0.0, float(left)))
            granted = Acquired(int(fence), int(count))
        if isinstance(granted, Acquired) and waiter.in_front:
            waiter.granted = True  # the turnstile stays with the lease
        return granted

    def _first_use(self, params: dict[str, Any]) -> Acquired | Busy:
        """No row came back: ask when the lease ends, and create the row if there is none
        (the name's first use; the new row is ours unless someone was faster)."""
        left = (self._call("time_left", params)).rows
        if left:
            self._remember(params["name"])
            return Busy(retry_after=0.0 if left[0][0] is None else max(0.0, float(left[0][0])))
        created = (self._call("create_row", params)).rows
        self._remember(params["name"])
        if created:
            return Acquired(int(created[0][0]), int(created[0][1]))
        result = self._call("acquire", params)
        if result.rows:
            return Acquired(int(result.rows[0][0]), int(result.rows[0][1]))
        return Busy()

    def _lease_release(self, name: str, token: str) -> int | None:
        gate = self._gates.pop(token, None)
        if gate is not None and self._driver_idle_dead(gate.conn.raw):
            # Its session is gone (a restart), and the turnstile with it; or it only has
            # notifications to read. The lease itself lives on in the table.
            self._drop(gate.conn)
            gate = None
        if gate is None:
            params = self._params(name, token, channel=notify_channel(self._table, name))
            result = self._call("release", params)
            return int(result.rows[0][0]) if result.rows else None
        # On the connection holding the turnstile: the last release leaves it, and the
        # waiter blocked on it takes the lease inside the server.
        params = self._params(name, token, turnstile=gate.key)
        try:
            result = self._run(gate.conn, self._sql["release_gate"], params)
        except BaseException:
            self._drop(gate.conn)  # closing frees the turnstile
            raise
        if not result.rows:
            # Not ours any more (expired, taken over): leave the turnstile all the same.
            self._leave_turnstile(gate.conn)
            return None
        count = int(result.rows[0][0])
        if count:
            self._gates[token] = gate
        else:
            self._keep_for_waiting(gate.conn)
        return count

    def _leave_turnstile(self, conn: Conn) -> None:
        """Unlisten and leave the turnstile in one round trip; the connection goes back
        to the waiters' pool (or, broken, is closed, which leaves it too)."""
        try:
            self._run(conn, "UNLISTEN *; SELECT pg_advisory_unlock_all()", {})
        except BaseException:
            self._drop(conn)
            raise
        self._keep_for_waiting(conn)

    def _keep_for_waiting(self, conn: Conn) -> None:
        """Keep a waiting connection for the next wait. One borrowed from the
        application's pool goes back instead (closed: it carries dlock's LISTEN and
        PREPARE): dlock keeps none of the application's connections idle."""
        if conn.loan is not None:
            self._drop(conn)
        else:
            self._listeners.append(conn)

    def _drop_gate(self, token: str) -> None:
        gate = self._gates.pop(token, None)
        if gate is not None:
            self._drop(gate.conn)

    def _lease_lost(self, token: str) -> None:
        # The lease ended without a release (expired, taken over, force-released): the
        # turnstile it kept must not hold the queue up.
        self._drop_gate(token)

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

    @contextmanager
    def _lease_waiter(self, name: str, token: str) -> Iterator[Waiter]:
        """Waiters queue on an advisory lock (the turnstile) inside the server.

        The waiter that gets the turnstile takes the lease in the same round trip if it
        is free, and keeps the turnstile for as long as it holds the lease; its release
        leaves the turnstile, so the next waiter takes the lease inside the server, as
        the database's own blocking lock hands over. If the lease is busy (its holder
        did not queue), the waiter in front LISTENs and the holder's release notifies.
        Were every waiter to listen, each release would wake them all to race for the
        lease; through the turnstile the server wakes one, in arrival order.
        """
        try:
            conn = self._listeners.pop()
        except IndexError:
            conn = self._connect()
        waiter = _TurnstileWaiter(
            self,
            conn,
            notify_channel(self._table, name),
            advisory_key(self._table + ":turnstile", name),
        )
        self._front[token] = waiter
        try:
            yield waiter
        except BaseException:
            self._drop(waiter.conn)  # frees the turnstile
            if waiter.cut_off:
                # A take cut off in flight may have committed: give it back.
                with contextlib.suppress(Exception):
                    self._lease_release(name, token)
            raise
        finally:
            self._front.pop(token, None)
        if waiter.granted:
            self._gates[token] = _Gate(waiter.conn, waiter.key)
        elif waiter.in_front:
            # One simple-protocol round trip; the next waiter moves to the front.
            self._leave_turnstile(waiter.conn)
        else:
            # The waiter may have replaced a connection that died while idle (restart).
            self._keep_for_waiting(waiter.conn)

    def _take_sql(self, conn: Any, key: int, channel: str, params: dict[str, Any], ms: int) -> str:
        """Listen, queue on the turnstile and take the lease, as one simple-protocol
        round trip: its statements run as one transaction, so the timeout bounds the
        lock wait, and LISTEN (which takes effect at commit) and the take happen only
        once the turnstile is ours. After the turnstile is handed over only the take is
        left to run, inside the server, with a fresh snapshot. Integers and the channel
        (a hex identifier) are interpolated; the values are literals quoted by the
        driver, for the prepared ``turnstile_take``."""
        values = _literals(conn, TAKE_PARAMETERS, params)
        return (
            f"UNLISTEN *; LISTEN {channel}; SELECT pg_advisory_lock({int(key)})"
            f" FROM (SELECT set_config('lock_timeout', '{ms}', true)) AS s;"
            f" EXECUTE {TAKE}({values})"
        )

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
        return (
            f"SELECT pg_advisory_lock({int(params['key'])})"
            f" FROM (SELECT set_config('lock_timeout', '{ms}', true)) AS s;"
            f" EXECUTE {RECORD}({values})"
        ), {}

    def _session_force_release(self, name: str) -> bool:
        result = self._call("session_force_release", {"name": encode_name(name)})
        return any(row[0] for row in result.rows)

    def close(self) -> None:
        conns = [*self._listeners, *(gate.conn for gate in self._gates.values())]
        self._listeners, self._gates = [], {}
        for conn in conns:
            self._drop(conn)
        super().close()


@dataclass
class _Gate:
    """A lease taken in front of the turnstile, and the connection that keeps it."""

    conn: Conn
    key: int


class _TurnstileWaiter(Waiter):
    notifies = True

    def __init__(self, backend: PostgreSQLBackend, conn: Conn, channel: str, key: int):
        self._backend = backend
        self.conn = conn
        self._channel = channel
        self.key = key
        self.in_front = False
        #: No attempt made inside this waiter yet.
        self.fresh = True
        #: The lease was taken in front of the turnstile, which stays with it.
        self.granted = False
        #: A take failed in flight: it may have committed.
        self.cut_off = False
        #: The latest attempt's parameters (owner, ttl, holder), for the take.
        self.params: dict[str, Any] = {}

    def wait(self, timeout: float) -> Acquired | None:
        if not self.in_front:
            return self._queue(timeout)
        try:
            for notify in self.conn.raw.notifies(timeout=timeout):
                # Earlier waiters' channels may still have sent something: not ours.
                if notify.channel == self._channel:
                    break
        except psycopg.Error as exc:
            raise BackendUnavailable(f"waiting for a release notification: {exc}") from exc
        return None

    def _queue(self, timeout: float) -> Acquired | None:
        backend = self._backend
        if TAKE not in self.conn.prepared:
            backend._run(self.conn, backend._prepare_take, {})
            self.conn.prepared.add(TAKE)
        # A lease taken here counts (on the client) from before this wait: the wait is
        # bounded by a third of the TTL, so most of the lease is left.
        wait = min(timeout, float(self.params["ttl"]) / 3)
        ms = max(1, math.ceil(wait * 1000))
        sql = backend._take_sql(self.conn.raw, self.key, self._channel, self.params, ms)
        try:
            result = backend._run(self.conn, sql, {}, wait=wait)
        except BackendError as exc:
            # LockNotAvailable is an OperationalError, so it arrives as unavailable:
            # the turnstile's own timeout, checked first, keeps the connection.
            if backend._is_lock_timeout(exc.__cause__ or exc):
                return None
            self.cut_off = True
            if not isinstance(exc, BackendUnavailable):
                raise
            # The connection died (server restart): start over on a new one; the core
            # simply tries again.
            backend._drop(self.conn)
            self.conn = backend._connect()
            with contextlib.suppress(Exception):
                params = {**self.params, "channel": self._channel}
                backend._call("release", params)
            self.cut_off = False
            return None
        except BaseException:
            self.cut_off = True
            raise
        self.in_front = True
        if not result.rows:
            # Busy, or the name has no row yet: the core's next attempt asks again on
            # this connection, now listening, and learns which (and makes the row).
            return None
        backend._remember(self.params["name"])
        self.granted = True
        return Acquired(int(result.rows[0][0]), int(result.rows[0][1]))


BACKEND = PostgreSQLBackend
