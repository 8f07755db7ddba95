# DO NOT EDIT: generated from src/dlock/_async/backends/postgresql.py by scripts/unasync.py.
"""PostgreSQL: a lease table (default) or advisory locks (``?mode=session``).

Driver: psycopg 3, maintained by the PostgreSQL driver's own authors, with a sync and
an asyncio connection in one package (the two faces stay the same code), server-side
prepared statements, and LISTEN/NOTIFY, which wakes lease-mode waiters when a lock is
released instead of polling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors

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
        #: Connections that LISTEN for waiters, kept apart from the statement pool.
        self._listeners: list[Any] = []
        #: Waiters by owner token: the one in front of the turnstile acquires on its own
        #: connection, so getting the lease and leaving the turnstile is one statement.
        self._front: dict[str, _TurnstileWaiter] = {}

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
        return psycopg.Connection.connect(autocommit=True, **params)

    def _driver_adopt(self, raw: Any) -> None:
        raw.set_autocommit(True)

    def _driver_execute(self, raw: Any, sql: str, params: dict[str, Any]) -> Result:
        # Without parameters psycopg uses the simple protocol (several statements allowed).
        cursor = raw.execute(sql, params or None)
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
            # Not waiting (yet): one plain statement, the uncontended path.
            result = self._call(statement, params)
            if result.rows:
                return Acquired(int(result.rows[0][0]), int(result.rows[0][1]))
            if params["name"] in self._known:
                # Busy. When the lease ends matters only to a waiter, whose attempts ask.
                return Busy()
            return self._first_use(params)
        if waiter.in_front:
            params["turnstile"] = waiter.key
            result = self._run(waiter.conn, self._sql[statement + "_in_front"], params)
        elif waiter.fresh:
            # The core's attempt on entering the waiter would only repeat the one just
            # made: the attempt in front of the turnstile, made after LISTEN, is the one
            # that cannot miss a release.
            waiter.fresh = False
            return Busy()
        else:
            result = self._call(statement + "_waiting", params)
        if not result.rows:
            return self._first_use(params)
        self._remember(params["name"])
        fence, count, left = result.rows[0]
        if fence is None:
            return Busy(retry_after=max(0.0, float(left)))
        waiter.in_front = False  # if it was, the statement left the turnstile
        return Acquired(int(fence), int(count))

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

    @contextmanager
    def _lease_waiter(self, name: str, token: str) -> Iterator[Waiter]:
        """Waiters queue on an advisory lock (the turnstile); the one in front LISTENs.

        The holder's release notifies in its own statement. Were every waiter to listen,
        each release would wake them all to race for the lease; through the turnstile the
        server wakes one, in arrival order, and the rest stay blocked inside the server.
        """
        try:
            raw = self._listeners.pop()
        except IndexError:
            raw = (self._connect()).raw
        waiter = _TurnstileWaiter(
            self,
            Conn(raw),
            notify_channel(self._table, name),
            advisory_key(self._table + ":turnstile", name),
        )
        self._front[token] = waiter
        try:
            yield waiter
            if waiter.in_front:
                # One simple-protocol round trip; the next waiter moves to the front.
                self._run(waiter.conn, "UNLISTEN *; SELECT pg_advisory_unlock_all()", {})
        except BaseException:
            self._driver_close(waiter.conn.raw)
            raise
        finally:
            self._front.pop(token, None)
        # Still listening if it got the lease in front: the next waiter to use this
        # connection unlistens (with its LISTEN) and ignores other channels meanwhile.
        # The waiter may have replaced a connection that died while idle (restart).
        self._listeners.append(waiter.conn.raw)

    def _session_force_release(self, name: str) -> bool:
        result = self._call("session_force_release", {"name": encode_name(name)})
        return any(row[0] for row in result.rows)

    def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for raw in listeners:
            self._driver_close(raw)
        super().close()


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

    def wait(self, timeout: float) -> None:
        if not self.in_front:
            # Blocked inside the server until the waiters ahead have got the lock, then
            # listening, in one round trip: a simple-protocol query of statements that
            # run as one transaction, so the timeout applies to the lock wait and LISTEN
            # takes effect only if the turnstile was taken. Only integers and the
            # channel (a hex identifier) are interpolated; it drops what an earlier
            # waiter on this connection listened to.
            sql = (
                f"SELECT set_config('lock_timeout', '{max(1, math.ceil(timeout * 1000))}', true);"
                f" SELECT pg_advisory_lock({int(self.key)}); UNLISTEN *; LISTEN {self._channel}"
            )
            try:
                self._backend._run(self.conn, sql, {}, wait=timeout)
            except BackendError as exc:
                # LockNotAvailable is an OperationalError, so it arrives as unavailable:
                # the turnstile's own timeout, checked first, keeps the connection.
                if self._backend._is_lock_timeout(exc.__cause__ or exc):
                    return
                if not isinstance(exc, BackendUnavailable):
                    raise
                # The listener died (server restart): start over on a new one; the core
                # simply tries again.
                self._backend._driver_close(self.conn.raw)
                self.conn = self._backend._connect()
                return
            # Listening before the core's next attempt, so no release goes unnoticed.
            self.in_front = True
            return
        try:
            for notify in self.conn.raw.notifies(timeout=timeout):
                # Earlier waiters' channels may still have sent something: not ours.
                if notify.channel == self._channel:
                    break
        except psycopg.Error as exc:
            raise BackendUnavailable(f"waiting for a release notification: {exc}") from exc


BACKEND = PostgreSQLBackend
