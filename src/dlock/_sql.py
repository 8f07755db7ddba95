"""What the SQL backends share that has no I/O: identifiers, URLs, names, and the SQL.

SQLite, MariaDB/MySQL and PostgreSQL keep the same lease table and the same rules; a
:class:`Dialect` says only how each database spells them. Values are always bound
parameters (``%(name)s`` style for the server drivers); only validated identifiers are
interpolated.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from ._errors import BackendError, ConfigurationError
from ._options import bounded_seconds, flag, query_options
from ._types import Holder, LockInfo
from ._validation import name_bytes, name_from_bytes

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

MODES = ("lease", "session")
DEFAULT_TABLES = {"lease": "dlock_locks", "session": "dlock_session_locks"}


def check_identifier(value: object, what: str) -> str:
    """Allow only plain identifiers: they are interpolated into SQL, values never are."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"{what} must be a plain SQL identifier (letters, digits, _; at most 63), not {value!r}"
        )
    return value


def check_table(value: object) -> str:
    """A server's lock table: a plain identifier, or one qualified by its schema
    (PostgreSQL) or database (MySQL), ``locks.dlock_locks``; each part checked."""
    if not isinstance(value, str) or value.count(".") > 1:
        raise ConfigurationError(
            f"table must be a plain SQL identifier or schema.table, not {value!r}"
        )
    for part in value.split("."):
        check_identifier(part, "table")
    return value


def quote_mysql_identifier(value: str) -> str:
    """A name the server gave (a database's) as MySQL reads it: plain, or in backticks."""
    return value if _IDENTIFIER.fullmatch(value) else "`" + value.replace("`", "``") + "`"


#: PostgreSQL: an unqualified table as its schema and name, quoted where they need it.
#: The table the search_path finds if there is one, else where ``CREATE TABLE`` would
#: make it (the first schema of the search_path that exists; NULL if none does).
POSTGRESQL_FIND_TABLE = """
    SELECT coalesce(
        (SELECT format('%%I.%%I', n.nspname, c.relname)
         FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE c.oid = pg_catalog.to_regclass(%(table)s)),
        (SELECT format('%%I.%%I', s, lower(%(table)s))
         FROM pg_catalog.current_schema() AS s WHERE s IS NOT NULL))"""

#: Whether a table survives a restart ('p', a plain table) or not ('u', UNLOGGED, as
#: session mode makes its own); no row if there is no such table.
POSTGRESQL_TABLE_PERSISTENCE = """
    SELECT relpersistence FROM pg_catalog.pg_class
    WHERE oid = pg_catalog.to_regclass(%(table)s)"""

#: MySQL: a table's storage engine (MEMORY, as session mode makes its own table, does
#: not survive a restart); no row if there is no such table.
MYSQL_TABLE_ENGINE = """
    SELECT ENGINE FROM information_schema.TABLES
    WHERE TABLE_SCHEMA = COALESCE(%(schema)s, DATABASE()) AND TABLE_NAME = %(table)s"""

#: PostgreSQL: a qualified table spelled as the unqualified one's lookup spells it (a
#: reserved word such as ``order`` quoted), so that lock keys made from either spelling
#: are one set.
POSTGRESQL_QUOTE_TABLE = "SELECT format('%%I.%%I', lower(%(schema)s), lower(%(table)s))"


def encode_name(name: str) -> bytes:
    """Names are stored as their UTF-8 bytes: PostgreSQL text cannot hold NUL, and byte
    order is code point order, so listing sorts exactly as Python sorts str."""
    return name_bytes(name)


def decode_name(stored: str | bytes | bytearray | memoryview) -> str:
    return stored if isinstance(stored, str) else name_from_bytes(bytes(stored))


# The keys below are cached: a lock name is usually used again and again, and hashing it
# on every acquire and release is measurable next to a 100 µs round trip.
def _digest(table: str, name: str) -> bytes:
    return hashlib.sha256(table.encode() + b"\0" + encode_name(name)).digest()


@functools.lru_cache(maxsize=4096)
def advisory_key(table: str, name: str) -> int:
    """A PostgreSQL advisory lock key over the whole signed 64-bit space.

    A 16-bit or CRC32 key makes unrelated names collide (and so block each other) after
    a few hundred names; 64 bits of SHA-256 make that practically impossible.
    """
    return int.from_bytes(_digest(table, name)[:8], "big", signed=True)


@functools.lru_cache(maxsize=4096)
def named_lock_key(table: str, name: str) -> str:
    """A ``GET_LOCK`` name: MySQL allows 64 characters, so the name is hashed (232 bits)."""
    return "dlock:" + _digest(table, name).hex()[:58]


@functools.lru_cache(maxsize=4096)
def notify_channel(table: str, name: str) -> str:
    """A LISTEN/NOTIFY channel per lock name: a plain identifier, safe to interpolate."""
    return "dlock_" + _digest(table, name).hex()[:40]


class NoSuchSchema(BackendError):
    """The schema (PostgreSQL) or database (MySQL) that the lock table is named in, or
    that the URL names, does not exist: neither the table's creation nor `dlock init`
    can make it, so the advice to grant CREATE or run `dlock init` is not given."""


@dataclass(frozen=True)
class ServerSettings:
    """Everything a MariaDB/MySQL or PostgreSQL URL and its options say."""

    host: str
    port: int | None
    user: str | None
    password: str | None
    database: str | None
    mode: str
    table: str
    connect_timeout: float
    timeout: float
    create_table: bool
    #: Driver-specific options passed through (TLS files, sslmode, ...).
    extra: dict[str, str]
    #: A callable returning a new connection, instead of connecting from the URL.
    client: Any = None
    #: A Unix socket instead of TCP (MySQL: its path; PostgreSQL: its directory).
    socket: str | None = None

    @property
    def address(self) -> str:
        """Where the server is, for error messages."""
        return self.socket or f"{self.host}:{self.port or 'default'}"


def check_client_key(key_file: str | None, password: str | None, password_option: str) -> None:
    """Refuse an encrypted client key given without its passphrase: OpenSSL would ask
    for it on the terminal, holding up the acquire (or failing obscurely without one)."""
    if not key_file or password:
        return
    try:
        with open(key_file, "rb") as file:
            head = file.read(4096)
    except OSError:
        return  # missing or unreadable: the driver says so
    # PEM marks both forms: "BEGIN ENCRYPTED PRIVATE KEY" and "Proc-Type: 4,ENCRYPTED".
    if b"ENCRYPTED" in head:
        raise ConfigurationError(
            f"the client key {key_file} is encrypted: give its passphrase as {password_option}"
        )


def parse_server_url(
    url: str,
    options: dict[str, Any],
    passthrough: frozenset[str],
    socket_option: str,
    default_schema: str | None = None,
) -> ServerSettings:
    """Split ``scheme://user:pass@host:port/db?opt=..`` plus ``connect()`` keywords.

    ``passthrough`` names the driver options (mostly TLS) handed to the driver as given;
    ``socket_option``, the driver's own name for a Unix socket to connect through;
    ``default_schema``, where the default table lives.
    """
    parts = urlsplit(url)
    settings: dict[str, Any] = query_options(parts.query)
    settings.update(options)
    known = {"mode", "table", "connect_timeout", "timeout", "create_table", "client", socket_option}
    unknown = set(settings) - known - passthrough
    if unknown:
        raise ConfigurationError(
            f"unknown {parts.scheme} option(s): {', '.join(sorted(unknown))}; known: "
            f"{', '.join(sorted(known | passthrough))}"
        )
    empty = sorted(key for key in passthrough | {socket_option} if settings.get(key) == "")
    if empty:
        # The URL's query refuses these already; a keyword must not slip one through.
        raise ConfigurationError(f"empty {parts.scheme} option(s): {', '.join(empty)}")
    if settings.get("client") is not None:
        _check_given_client_url(parts, set(settings) & (passthrough | {socket_option}))
    mode = str(settings.get("mode", "lease")).lower()
    if mode not in MODES:
        raise ConfigurationError(f"mode must be {' or '.join(MODES)}, not {mode!r}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigurationError(f"{url!r} has an invalid port") from None
    database = unquote(parts.path.lstrip("/")) or None
    default_table = DEFAULT_TABLES[mode]
    if default_schema is not None:
        default_table = f"{default_schema}.{default_table}"
    return ServerSettings(
        host=parts.hostname or "localhost",
        port=port,
        user=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        database=database,
        mode=mode,
        table=check_table(settings.get("table", default_table)),
        connect_timeout=bounded_seconds(settings.get("connect_timeout", 5), "connect_timeout"),
        timeout=bounded_seconds(settings.get("timeout", 10), "timeout"),
        create_table=flag(settings.get("create_table", True), "create_table"),
        extra={k: str(v) for k, v in settings.items() if k in passthrough},
        client=_client_factory(settings.get("client")),
        socket=str(settings[socket_option]) if settings.get(socket_option) else None,
    )


def _check_given_client_url(parts: SplitResult, ignored_options: set[str]) -> None:
    """With ``client=``, the connections bring their server, database, credentials and
    TLS: a URL that says otherwise would be ignored without a word."""
    ignored = sorted(ignored_options)
    if parts.path not in ("", "/"):
        ignored.insert(0, "database")
    if parts.netloc:
        ignored.insert(0, "host, port or credentials")
    if ignored:
        raise ConfigurationError(
            f"with client=, the connections' own settings apply; the URL's would be "
            f"ignored: {', '.join(ignored)} (use {parts.scheme}:// with only dlock's "
            f"options: mode, table, create_table, timeout, connect_timeout)"
        )


def _client_factory(value: Any) -> Any:
    """``client=`` is called for each connection: a pool object itself is refused
    here, with what to pass instead, rather than failing at the first acquire."""
    if value is not None and not callable(value):
        raise ConfigurationError(
            f"client= must be a function returning a connection or lending one "
            f"(a pool's connection/acquire, SQLAlchemy's engine.raw_connection), "
            f"not {type(value).__name__}"
        )
    return value


def lock_info(
    name: str | bytes, fence: int, count: int, expires_in: float | None, holder: str | None
) -> LockInfo:
    return LockInfo(
        name=decode_name(name),
        fencing_token=int(fence),
        holder=Holder.from_json(holder),
        expires_in=None if expires_in is None else float(expires_in),
        count=int(count),
    )


@dataclass(frozen=True)
class Dialect:
    """How one database spells the shared lease table.

    The table keeps a row per name forever (``owner`` NULL when free) so that its
    fencing counter survives release. Expiry compares ``expires`` with ``now``: the
    *server's* clock in epoch seconds for MariaDB/MySQL and PostgreSQL, so clients with
    skewed clocks agree; for SQLite, which has no server, the host's boot clock.
    Statements are written with ``%(name)s`` parameters and converted for SQLite. The
    ``table`` they are given is interpolated: one :func:`check_table` allowed, or the
    schema the server named for it, quoted (``_pin_table`` in the server backends).
    """

    name: str
    #: The clock, evaluated once per statement.
    now: str
    #: The server's clock in whole microseconds since the epoch: the floor of the
    #: fencing counters (see :func:`next_fence`). SQLite's is the host's wall clock.
    clock_us: str
    name_type: str
    owner_type: str
    #: True when ``name`` starts with the bytes of ``%(prefix)s``.
    prefix_match: str
    key_type: str = "BIGINT"
    table_options: str = ""
    #: Columns only this dialect has (SQLite's boot id): name, type, value on grant.
    extra_columns: tuple[tuple[str, str, str], ...] = ()
    #: Session mode columns: which database session holds the database's own lock.
    session_columns: bool = True
    #: Session mode's table: kept out of the write-ahead log / in memory, so that taking
    #: a lock never waits for a disk flush (its fencing counter does not need one).
    session_table: str = "TABLE"
    session_table_options: str = ""
    #: Session mode's holder column (MEMORY tables store every row at full width).
    session_holder_type: str = "VARCHAR(1024)"
    #: The larger of its arguments (SQLite's scalar MAX).
    greatest: str = "GREATEST"

    def schema(self, table: str, session: bool = False) -> str:
        columns = [
            f"name {self.name_type} PRIMARY KEY",
            f"owner {self.owner_type}",
            "fence BIGINT NOT NULL",
            "count INTEGER NOT NULL DEFAULT 0",
            "expires DOUBLE PRECISION NOT NULL DEFAULT 0",
            f"holder {self.session_holder_type if session else 'VARCHAR(1024)'}",
            *(f"{column} {kind}" for column, kind, _ in self.extra_columns),
        ]
        if self.session_columns:
            columns += ["session BIGINT", f"lock_key {self.key_type}"]
        kind, options = (
            (self.session_table, self.session_table_options)
            if session
            else ("TABLE", self.table_options)
        )
        return f"CREATE {kind} IF NOT EXISTS {table} ({', '.join(columns)}){options}"

    def next_fence(self, previous: str) -> str:
        """A server's next fencing token: one more than ``previous``, and never below
        the server's clock in microseconds (a new row starts at the clock).

        The table can fall behind tokens already handed out. Session mode's is not
        crash-safe (UNLOGGED, MEMORY): a crash or a restart empties it. The lease table
        can lose its latest grants in a failover to an asynchronous replica, or in a
        restore from a backup, while a holder cut off by it still writes with its token.
        Tokens handed out so far are at most the clock at their time (a name is taken at
        most once per microsecond), so after such a loss the clock alone keeps them
        increasing, unless the server's clock went back by more than the outage lasted.
        While the row lives, the ``+ 1`` keeps them increasing whatever the clock does.
        """
        return f"{self.greatest}({previous} + 1, {self.clock_us})"

    def live(self, alias: str = "") -> str:
        extra = "".join(f" AND {alias}{c} = {value}" for c, _, value in self.extra_columns)
        return f"({alias}owner IS NOT NULL AND {alias}expires > {self.now}{extra})"

    def inspect(self, table: str) -> str:
        return (
            f"SELECT name, fence, count, expires - {self.now}, holder FROM {table}"
            f" WHERE name = %(name)s AND {self.live()}"
        )

    def list(self, table: str) -> str:
        return (
            f"SELECT name, fence, count, expires - {self.now}, holder FROM {table}"
            f" WHERE {self.prefix_match} AND {self.live()} ORDER BY name"
        )

    def extend(self, table: str) -> str:
        return (
            f"UPDATE {table} SET expires = {self.now} + %(ttl)s"
            f" WHERE name = %(name)s AND owner = %(owner)s AND {self.live()}"
        )

    def release(self, table: str) -> str:
        """One level off the owner's live lease; the last frees the row (the fence stays)."""
        return f"""
            UPDATE {table} SET
                count = count - 1,
                owner = CASE WHEN count > 1 THEN owner END,
                holder = CASE WHEN count > 1 THEN holder END
            WHERE name = %(name)s AND owner = %(owner)s AND {self.live()}"""

    def force_release(self, table: str) -> str:
        return f"""
            UPDATE {table} SET owner = NULL, count = 0, holder = NULL
            WHERE name = %(name)s AND {self.live()}"""

    def idle_for(self, age: str, age_us: str) -> str:
        """A row nobody has held for ``age`` seconds: its lease ended that long ago (a
        MySQL release stores minus its moment), and its last grant is older still, so a
        row made again for the name starts above every token it handed out."""
        return f"ABS(expires) < {self.now} - {age} AND fence < {self.clock_us} - {age_us}"


POSTGRESQL = Dialect(
    name="postgresql",
    # date_part gives float8 directly; extract() would compute a numeric and cast it.
    now="date_part('epoch', clock_timestamp())",
    clock_us="(date_part('epoch', clock_timestamp()) * 1000000)::bigint",
    name_type="BYTEA",
    owner_type="TEXT",
    prefix_match="substring(name FROM 1 FOR length(%(prefix)s)) = %(prefix)s",
    session_table="UNLOGGED TABLE",
)
MYSQL = Dialect(
    name="mysql",
    # UTC_TIMESTAMP(6) is fixed for the whole statement, so every comparison in it
    # agrees. Not UNIX_TIMESTAMP(NOW(6)): that converts local time back to the epoch, and
    # in a time zone with daylight saving it reads an hour ahead during the first pass of
    # the repeated autumn hour, then jumps back, which would expire live leases early.
    now="(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) / 1e6)",
    clock_us="TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))",
    name_type="VARBINARY(1020)",
    # Binary, so that owner tokens compare exactly, whatever the default collation.
    owner_type="VARBINARY(64)",
    prefix_match="LEFT(name, LENGTH(%(prefix)s)) = %(prefix)s",
    key_type="VARCHAR(64)",
    table_options=" ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
    # MEMORY: no redo log, no transaction; emptied by a restart (the session locks it
    # describes are gone then too). Rows are fixed width: ASCII holder JSON as bytes.
    session_table_options=" ENGINE=MEMORY DEFAULT CHARSET=ascii",
    session_holder_type="VARBINARY(1024)",
)
SQLITE = Dialect(
    name="sqlite",
    # The host's boot clock, passed in by the client: SQLite has no server.
    now="%(now)s",
    # Fencing counters start from the host's wall clock, as the servers' start from
    # theirs: a lock file replaced or restored from a copy still hands out larger tokens.
    # Read by SQLite as the statement runs, once it has the file's write lock (not before
    # a wait of up to busy_timeout for it), in whole milliseconds.
    clock_us="CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
    # Names are bound as UTF-8 BLOBs, as on the servers: SQLite's length() and substr()
    # of TEXT stop at a NUL, of a BLOB they count bytes.
    name_type="BLOB",
    owner_type="TEXT",
    prefix_match="substr(name, 1, length(%(prefix)s)) = %(prefix)s",
    # A lease from an earlier boot of the host is dead whatever its clock says.
    extra_columns=(("boot", "TEXT NOT NULL DEFAULT ''", "%(boot)s"),),
    session_columns=False,
    greatest="MAX",
)


def upsert_statements(table: str, d: Dialect) -> dict[str, str]:
    """SQLite's lease operations, with ``INSERT .. ON CONFLICT .. RETURNING``: each is one
    statement. (PostgreSQL has its own: rows stay, so its acquire is a plain UPDATE.)"""
    now = d.now
    # Inside ON CONFLICT, "x" is the existing row.
    live = d.live("x.")
    reenter = f"({live} AND x.owner = %(owner)s AND %(reentrant)s)"
    extra = "".join(f", {column}" for column, _, _ in d.extra_columns)
    extra_values = "".join(f", {value}" for _, _, value in d.extra_columns)
    extra_set = "".join(f", {column} = excluded.{column}" for column, _, _ in d.extra_columns)
    return {
        # A free or expired name is taken (fence + 1), a live one re-entered by its owner
        # (count + 1), anything else left alone. The row lock taken by ON CONFLICT
        # decides; nothing is read first. A new row counts on from the floor that
        # ``prune`` leaves in the row of the empty name (no lock has that name), and
        # every token from the clock (see Dialect.next_fence).
        "acquire": f"""
            INSERT INTO {table} AS x (name, owner, fence, count, expires, holder{extra})
            VALUES (%(name)s, %(owner)s, {d.next_fence(sqlite_fence_floor(table))}, 1,
                    {now} + %(ttl)s, %(holder)s{extra_values})
            ON CONFLICT (name) DO UPDATE SET
                fence = CASE WHEN {reenter} THEN x.fence ELSE {d.next_fence("x.fence")} END,
                count = CASE WHEN {reenter} THEN x.count + 1 ELSE 1 END,
                owner = excluded.owner, expires = excluded.expires,
                holder = excluded.holder{extra_set}
            WHERE NOT {live} OR {reenter}
            RETURNING fence, count""",
        # Busy: when does the current lease end? A hint for the waiter.
        "time_left": f"SELECT expires - {now} FROM {table} WHERE name = %(name)s AND {d.live()}",
        "release": d.release(table) + " RETURNING count",
        "extend": d.extend(table) + " RETURNING 1",
        "inspect": d.inspect(table),
        "list": d.list(table),
        "force_release": d.force_release(table) + " RETURNING 1",
    }


def sqlite_fence_floor(table: str) -> str:
    """SQLite's fencing floor: above every token of the rows ``prune`` deleted."""
    return f"COALESCE((SELECT fence FROM {table} WHERE name = X''), 0)"


def sqlite_statements(table: str) -> dict[str, str]:
    """SQLite: the same statements, with ``:name`` parameters.

    New rows' tokens start from the host's wall clock, which an NTP step can set back,
    so ``prune`` also keeps the largest token of the rows it deletes in a row of the
    empty name: the floor, which a new row counts on from too.
    Rows of an earlier boot of the host have been idle for at least the time since
    boot, which the boot clock (``now``) counts.
    """
    # A batch of idle rows, the same in both statements of one transaction (by name).
    batch = f"""SELECT name, fence FROM {table} WHERE name <> X'' AND CASE WHEN boot = %(boot)s
        THEN expires < %(now)s - %(age)s ELSE %(now)s > %(age)s END
        ORDER BY name LIMIT %(batch)s"""
    statements = {
        "schema": SQLITE.schema(table),
        **upsert_statements(table, SQLITE),
        "raise_floor": f"""
            INSERT INTO {table} (name, fence, count, expires, boot)
            SELECT X'', MAX(fence), 0, 0, '' FROM ({batch}) WHERE true HAVING COUNT(*) > 0
            ON CONFLICT (name) DO UPDATE SET fence = MAX(fence, excluded.fence)""",
        "prune": f"DELETE FROM {table} WHERE name IN (SELECT name FROM ({batch}))",
    }
    return {key: re.sub(r"%\((\w+)\)s", r":\1", sql) for key, sql in statements.items()}


def postgresql_statements(table: str) -> dict[str, str]:
    """PostgreSQL: every operation is one statement, one round trip."""
    d = POSTGRESQL
    now = d.now

    # Session mode: a row is held while its session still holds the advisory lock (the
    # 64-bit key is split by PostgreSQL into classid, the high half, and objid, the low).
    def held_by(row: str) -> str:
        return f"""EXISTS (SELECT 1 FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                  AND l.pid = {row}.session
                  AND l.classid::bigint = ({row}.lock_key >> 32) & 4294967295
                  AND l.objid::bigint = {row}.lock_key & 4294967295)"""

    held = held_by(table)
    columns = f"name, fence, count, expires - {now}, holder"
    live = d.live()
    reenter = f"({live} AND owner = %(owner)s AND %(reentrant)s)"
    # Rows stay after release, so acquire is a plain UPDATE of the name's row: cheaper
    # than ON CONFLICT DO UPDATE, which locks the row before updating it. A concurrent
    # acquirer re-checks the WHERE on the row it waited for, so one of them wins.
    acquire = f"""
            UPDATE {table} SET
                fence = CASE WHEN {reenter} THEN fence ELSE {d.next_fence("fence")} END,
                count = CASE WHEN {reenter} THEN count + 1 ELSE 1 END,
                owner = %(owner)s, expires = {now} + %(ttl)s, holder = %(holder)s
            WHERE name = %(name)s AND (NOT {live} OR {reenter})
            """
    acquire_once = f"""
            UPDATE {table} SET fence = {d.next_fence("fence")}, count = 1,
                owner = %(owner)s, expires = {now} + %(ttl)s, holder = %(holder)s
            WHERE name = %(name)s AND NOT {live}
            """
    returning = "RETURNING fence, count"
    # The last release need not wait for its commit to reach the disk: lost in a crash,
    # it leaves the lease to run out, exactly as a crashed holder's would; and any later
    # grant's commit, which does wait, flushes the write-ahead log past it first. (Not a
    # partial release: the holder goes on by the count it returned.)
    unflushed = "CASE WHEN count = 0 THEN set_config('synchronous_commit', 'off', true) END"

    def waiting(update: str) -> str:
        """A waiter's attempt: granted, the fence and count; busy, in the same round trip,
        the seconds left on the holder's lease (0: free, a concurrent grant was
        faster); no row at all: the name was never used."""
        return f"""
            WITH a AS ({update} {returning})
            SELECT fence, count, NULL::float8 FROM a
            UNION ALL
            SELECT NULL, NULL, CASE WHEN {live} THEN expires - {now} ELSE 0 END FROM {table}
            WHERE name = %(name)s AND NOT EXISTS (SELECT FROM a)"""

    return {
        # Every statement relies on READ COMMITTED: an UPDATE that waited for a
        # concurrent one re-checks its WHERE on the row as that one left it. Under a
        # database's or role's stricter default (REPEATABLE READ, SERIALIZABLE) it
        # would fail instead ("could not serialize access"), and contended acquires
        # with it. A short lock_timeout (a DBA's guard against lock queues) would cancel
        # such a wait: dlock's statements hold a row for microseconds, and their waits
        # are bounded by its own timeout (its turnstile waits set their own). The
        # server's id of the session tells whether a pooler stands between.
        "setup": """
            SELECT pg_backend_pid() FROM (SELECT
                set_config('default_transaction_isolation', 'read committed', false),
                set_config('lock_timeout', '0', false)) AS s""",
        "backend_pid": "SELECT pg_backend_pid()",
        "acquire": acquire + returning,
        # The usual, non-reentrant acquire: shorter to evaluate.
        "acquire_once": acquire_once + returning,
        "acquire_waiting": waiting(acquire),
        "acquire_once_waiting": waiting(acquire_once),
        # The waiter that gets the turnstile runs this in the same round trip, inside the
        # server, the moment the turnstile is handed over. A lease released through the
        # turnstile committed before the turnstile was free, so this statement's snapshot
        # sees it free: the plain acquire takes it. Busy (the holder did not queue), it
        # takes nothing and locks nothing, so a release that commits before our LISTEN
        # does would go unheard: the waiter asks once more on its connection, LISTEN in
        # force by then (``acquire_once_waiting``).
        "turnstile_take": acquire_once + returning,
        # Not taken: NULL if the row is free (released meanwhile), no row if the name was
        # never used (then ``create_row``), else the seconds left on the holder's lease.
        "time_left": f"""
            SELECT CASE WHEN {live} THEN expires - {now} END FROM {table}
            WHERE name = %(name)s""",
        "create_row": f"""
            INSERT INTO {table} (name, owner, fence, count, expires, holder)
            VALUES (%(name)s, %(owner)s, {d.clock_us}, 1, {now} + %(ttl)s, %(holder)s)
            ON CONFLICT (name) DO NOTHING
            RETURNING fence, count""",
        # The last release wakes waiters on the name's channel, in the same statement.
        "release": d.release(table)
        + f" RETURNING count, CASE WHEN count = 0 THEN pg_notify(%(channel)s, '') END, {unflushed}",
        # A lease taken through the turnstile is released on the connection holding it,
        # and the last release leaves it: the next waiter, blocked on it in the server,
        # takes the lease there (turnstile_take). Nobody listens meanwhile. The session's
        # hold is traded for one that ends with this transaction (CASE fixes the order),
        # so the next waiter wakes once, after the release has committed, not first at
        # the unlock and again at the commit, on the row.
        "release_gate": d.release(table)
        + f""" RETURNING count, CASE WHEN count = 0 THEN
                CASE WHEN pg_advisory_xact_lock(%(turnstile)s) IS NULL THEN NULL
                     ELSE pg_advisory_unlock(%(turnstile)s) END END, {unflushed}""",
        "leave_turnstile": "UNLISTEN *; SELECT pg_advisory_unlock_all()",
        "extend": d.extend(table) + " RETURNING 1",
        "extend_many": _pg_extend_many(table),
        "inspect": d.inspect(table),
        "list": d.list(table),
        "force_release": d.force_release(table) + " RETURNING pg_notify(%(channel)s, '')",
        # Session mode: the advisory lock excludes; the row carries the fencing counter,
        # the holder, its lease and its session. Taking the lock and bumping the counter
        # is one statement; when busy, the same statement tells how long the holder's
        # lease lasts. One row always: fence, session, seconds left, lock taken.
        # The row usually exists, so this only UPDATEs: a name's first use (lock taken,
        # no row) is recorded by ``session_record`` next. An upsert branch here would
        # cost the server over a quarter more on every acquire, run or not.
        "session_acquire": f"""
            WITH l AS (SELECT pg_try_advisory_lock(%(key)s) AS ok),
            bump AS (
                UPDATE {table} SET fence = {d.next_fence("fence")}, owner = %(owner)s,
                    count = 1, expires = {now} + %(ttl)s, holder = %(holder)s,
                    session = pg_backend_pid(), lock_key = %(key)s
                FROM l WHERE l.ok AND name = %(name)s
                RETURNING fence, session)
            SELECT bump.fence, bump.session,
                CASE WHEN NOT l.ok THEN
                    (SELECT expires - {now} FROM {table} WHERE name = %(name)s) END,
                l.ok
            FROM l LEFT JOIN bump ON true""",
        # The lock is ours (taken by a waiter inside the server, or on the name's first
        # use): record it, creating the row if there is none.
        "session_record": f"""
            INSERT INTO {table} AS x
                (name, owner, fence, count, expires, holder, session, lock_key)
            VALUES (%(name)s, %(owner)s, {d.clock_us}, 1, {now} + %(ttl)s, %(holder)s,
                    pg_backend_pid(), %(key)s)
            ON CONFLICT (name) DO UPDATE SET
                fence = {d.next_fence("x.fence")}, owner = excluded.owner, count = 1,
                expires = excluded.expires, holder = excluded.holder,
                session = excluded.session, lock_key = excluded.lock_key
            RETURNING fence, session""",
        # true: the timeout lasts for this statement's transaction only, not for the
        # pooled connection's later statements.
        "session_wait": """
            SELECT pg_advisory_lock(%(key)s)
            FROM (SELECT set_config('lock_timeout', %(wait_ms)s, true)) AS s""",
        "session_unlock": "SELECT pg_advisory_unlock(%(key)s)",
        # PostgreSQL 14 added the setting (and the timeout); before, there is nothing to
        # do, and the setting reads as NULL.
        "no_idle_timeout": """
            SELECT set_config('idle_session_timeout', '0', false)
            WHERE current_setting('idle_session_timeout', true) IS NOT NULL""",
        "idle_timeout": "SELECT current_setting('idle_session_timeout', true)",
        "idle_timeout_restore": "SELECT set_config('idle_session_timeout', %(value)s, false)",
        # Re-entry and partial release: only while the session still holds the lock.
        "session_count": f"""
            UPDATE {table} SET count = count + %(delta)s
            WHERE name = %(name)s AND owner = %(owner)s AND {held} RETURNING count""",
        "session_extend": d.extend(table) + f" AND {held} RETURNING 1",
        # Batched renewal checks pg_locks too: a holder whose session was ended by the
        # server (pg_terminate_backend, idle timeout) still has a live row.
        "session_extend_many": _pg_extend_many(table, f"AND {held}"),
        # A holder whose lease ran out (paused, partitioned) still holds the advisory lock:
        # only ending its session frees it, and only while the lease is still expired.
        # The row is locked first, as by ``session_force_release``: a plain read saw the
        # row as of the statement's start, so a renewal that had found the lease live
        # but committed after that start was not seen, and its holder's session was
        # ended while it was told "renewed". Locking waits for such a renewal and checks
        # the expiry again on the row it left. The row is cleared too, so that a renewal
        # that had checked but not yet written fails its owner check on the new row.
        "session_evict": f"""
            WITH target AS (
                SELECT session, lock_key FROM {table}
                WHERE name = %(name)s AND expires <= {now} FOR UPDATE),
            ended AS (
                -- CASE fixes the order: only a session that holds the lock is ended.
                SELECT target.session,
                       CASE WHEN {held_by("target")}
                            THEN pg_terminate_backend(target.session::int) ELSE false END AS ok
                FROM target)
            UPDATE {table} SET owner = NULL, count = 0, holder = NULL
            FROM ended WHERE name = %(name)s AND ended.ok RETURNING ended.session""",
        "session_inspect": f"""SELECT {columns} FROM {table}
            WHERE name = %(name)s AND {d.live()} AND {held}""",
        # Whether the lock is still the owner's (a release that cannot run the unlock).
        "session_owned": f"""SELECT 1 FROM {table}
            WHERE name = %(name)s AND owner = %(owner)s AND {held}""",
        "session_list": f"""SELECT {columns} FROM {table}
            WHERE {d.prefix_match} AND {d.live()} AND {held} ORDER BY name""",
        # A batch at a time (see ``prune``); the condition is checked again on the row
        # as it is when deleted, which a concurrent grant may have changed.
        "prune": _pg_prune(table, d.idle_for("%(age)s", "%(age_us)s")),
        # A session lock outlives its lease while its session lives (paused holder).
        "session_prune": _pg_prune(table, f"{d.idle_for('%(age)s', '%(age_us)s')} AND NOT {held}"),
        # Only its own session can free an advisory lock; the row is cleared as well.
        # The row is locked first (FOR UPDATE), and only then is the holder's session
        # ended (``ended`` reads the locked row). Ending it inside the UPDATE's own
        # condition let the waiter, granted at that moment, write the row before the
        # UPDATE did: READ COMMITTED then checked the condition again on the waiter's
        # row, and ended the waiter's session too (or, not seeing its lock yet, cleared
        # nothing and answered "was not held"). Locked, the waiter's record waits for
        # this statement's commit and is written after it.
        "session_force_release": f"""
            WITH target AS (
                SELECT session, lock_key FROM {table} WHERE name = %(name)s FOR UPDATE),
            ended AS (
                SELECT target.session, CASE WHEN {held_by("target")}
                            THEN pg_terminate_backend(target.session::int) ELSE false END AS ok
                FROM target)
            UPDATE {table} SET owner = NULL, count = 0, holder = NULL
            FROM ended WHERE name = %(name)s AND ended.ok
            RETURNING ended.session""",
        # Whether a session ended by a force release still holds the lock: it frees it
        # only as it exits, after pg_terminate_backend has returned.
        "session_lock_kept": f"""SELECT {held_by("k")}
            FROM (SELECT %(session)s::bigint AS session, %(key)s::bigint AS lock_key) AS k""",
    }


def _pg_prune(table: str, idle: str) -> str:
    return f"""
        DELETE FROM {table} WHERE {idle} AND name = ANY(ARRAY(
            SELECT name FROM {table} WHERE {idle} LIMIT %(batch)s))"""


def _pg_extend_many(table: str, condition: str = "") -> str:
    now = POSTGRESQL.now
    return f"""
        UPDATE {table} SET expires = {now} + v.ttl
        FROM (SELECT * FROM unnest(%(names)s::bytea[], %(owners)s::text[],
                                   %(ttls)s::float8[])) AS v(name, owner, ttl)
        WHERE {table}.name = v.name AND {table}.owner = v.owner AND {table}.expires > {now}
            {condition}
        RETURNING {table}.name, {table}.owner"""


def mysql_statements(table: str) -> dict[str, str]:
    """MariaDB and MySQL 8: only SQL both accept (no RETURNING, no CTE with DML).

    Without RETURNING, results travel in the OK packet: the affected-row count and
    ``LAST_INSERT_ID(expr)``, which the client reads as the insert id.
    """
    d = MYSQL
    now = d.now
    live = d.live()
    held = "IS_USED_LOCK(lock_key) = session"
    columns = f"name, fence, count, expires - {now}, holder"
    # Lease waiters queue on a GET_LOCK turnstile (the backend's ``_lease_waiter``). A
    # lease free while someone is queued goes to the waiter in front, which polls: a
    # newcomer must not pass it. A lease taken in front keeps the turnstile until its
    # last release, and the row's ``session`` names that keeper meanwhile (0 otherwise).
    # If its lease runs out first (paused, quiet), anyone may take over, or the queue
    # would be stuck behind it. One IS_USED_LOCK per statement: each costs ~5 µs.
    turnstile = "IS_USED_LOCK(%(turnstile)s)"
    may_take = f"IFNULL({turnstile}, 0) IN (0, session)"
    acquire_front = f"""
            UPDATE {table} SET fence = LAST_INSERT_ID({d.next_fence("fence")}), count = 1,
                session = CONNECTION_ID(),
                holder = %(holder)s, expires = {now} + %(ttl)s, owner = %(owner)s
            WHERE name = %(name)s AND NOT {live} AND {turnstile} = CONNECTION_ID()"""
    session_upsert = f"""
            INSERT INTO {table} (name, owner, fence, count, expires, holder, session, lock_key)
            SELECT %(name)s, %(owner)s, LAST_INSERT_ID({d.clock_us}), 1, {now} + %(ttl)s,
                   %(holder)s, CONNECTION_ID(), %(key)s
            FROM DUAL WHERE {{condition}}
            ON DUPLICATE KEY UPDATE
                fence = LAST_INSERT_ID({d.next_fence("fence")}), owner = %(owner)s, count = 1,
                expires = {now} + %(ttl)s, holder = %(holder)s,
                session = CONNECTION_ID(), lock_key = %(key)s"""
    return {
        # Rows are created free on first use of a name; from then on, acquire is one
        # UPDATE. Single-table UPDATE assigns left to right, so fence and count are
        # computed before owner and expires change.
        "acquire": f"""
            UPDATE {table} SET
                fence = IF({live} AND owner = %(owner)s,
                           LAST_INSERT_ID(fence), LAST_INSERT_ID({d.next_fence("fence")})),
                count = IF({live} AND owner = %(owner)s, count + 1, 1),
                holder = %(holder)s, expires = {now} + %(ttl)s, owner = %(owner)s
            WHERE name = %(name)s
                AND ((NOT {live} AND {may_take}) OR (owner = %(owner)s AND %(reentrant)s))""",
        # Inserted: the insert id is the new fence (the clock: far above 1). Already
        # there: the update clause, evaluated after VALUES, sets it to 1 if the row's
        # lease is held, else to 0, and changes nothing (INSERT IGNORE would warn).
        "create_row": f"""
            INSERT INTO {table} (name, owner, fence, count, expires, holder)
            VALUES (%(name)s, %(owner)s, LAST_INSERT_ID({d.clock_us}), 1, {now} + %(ttl)s,
                    %(holder)s)
            ON DUPLICATE KEY UPDATE fence = fence + 0 * LAST_INSERT_ID({live})""",
        # The usual, non-reentrant acquire: shorter to send, parse and evaluate.
        "acquire_once": f"""
            UPDATE {table} SET fence = LAST_INSERT_ID({d.next_fence("fence")}), count = 1,
                holder = %(holder)s, expires = {now} + %(ttl)s, owner = %(owner)s
            WHERE name = %(name)s AND NOT {live} AND {may_take}""",
        # The waiter in front of the queue, on the connection that holds the turnstile.
        "acquire_front": acquire_front,
        # A waiter queues on the turnstile and, the moment it is its own, takes a free
        # lease inside the server (multi-statements; values escaped by the driver). The
        # answer: in front of the queue, lease taken, its fence.
        "turnstile_take": f"""SELECT GET_LOCK(%(turnstile)s, %(wait)s); {acquire_front};
            SELECT COALESCE({turnstile} = CONNECTION_ID(), 0), ROW_COUNT(), LAST_INSERT_ID()""",
        "count": f"SELECT count FROM {table} WHERE name = %(name)s AND owner = %(owner)s",
        # The last release ends the lease but leaves owner and holder: an update that
        # keeps the row's size is done in place by InnoDB (~5% faster). ``expires``
        # becomes minus the moment of release: never live again, whatever the clock
        # does, and ``prune`` still knows when the name was last used. Every
        # assignment reads the count as it was, before ``count`` is assigned last: the
        # same whether the server assigns left to right (MySQL's default) or all at
        # once (MariaDB's ``SIMULTANEOUS_ASSIGNMENT``).
        "release": f"""
            UPDATE {table} SET
                expires = IF(count > 1, expires, -{now}), count = LAST_INSERT_ID(count - 1)
            WHERE name = %(name)s AND owner = %(owner)s AND expires > {now}""",
        # A lease taken in front of the turnstile is released on the connection keeping
        # it; the last release (or one that finds the lease gone) leaves it, so the next
        # waiter, blocked on it in the server, takes the lease there. Answer: the count
        # left, NULL when the lease was not ours.
        # The last release leaves the turnstile inside its UPDATE, before its commit: the
        # next waiter's take then waits for the row lock, which InnoDB frees at commit,
        # before the commit's flush to disk. So the take runs while the release is being
        # flushed, not after it (docs/sql.md has the numbers). A grant is flushed after
        # the release it follows: the redo log is one sequence.
        "release_gate": f"""
            UPDATE {table} SET expires = IF(count > 1, expires, -{now}),
                session = IF(count > 1, session, IF(RELEASE_LOCK(%(turnstile)s), 0, 0)),
                count = LAST_INSERT_ID(count - 1)
            WHERE name = %(name)s AND owner = %(owner)s AND expires > {now};
            SELECT IF(ROW_COUNT() > 0, LAST_INSERT_ID(), NULL),
                IF(ROW_COUNT() > 0, NULL, RELEASE_LOCK(%(turnstile)s))""",
        "leave_turnstile": "SELECT RELEASE_ALL_LOCKS()",
        "extend": d.extend(table),
        # Batches: {pairs} is "(%(n0)s, %(o0)s), (%(n1)s, %(o1)s), ..." built by the caller.
        "extend_many": f"""
            UPDATE {table} SET expires = {now} + %(ttl)s
            WHERE (name, owner) IN ({{pairs}}) AND expires > {now}""",
        "renewed": f"""
            SELECT name, owner FROM {table}
            WHERE (name, owner) IN ({{pairs}}) AND expires > {now}""",
        "inspect": d.inspect(table),
        "list": d.list(table),
        "force_release": d.force_release(table),
        # Session mode: GET_LOCK inside the INSERT takes the lock and bumps the fencing
        # counter in one round trip; the row is written only if the lock was granted.
        "session_acquire": session_upsert.format(condition="GET_LOCK(%(key)s, 0) = 1"),
        "session_record": session_upsert.format(condition="TRUE"),
        # With multi-statements: wait, and record the lock the moment it is granted,
        # inside the server (the second statement's result is the answer).
        "session_wait_and_record": "SELECT GET_LOCK(%(key)s, %(wait)s); "
        + session_upsert.format(condition="IS_USED_LOCK(%(key)s) = CONNECTION_ID()"),
        "session_time_left": f"""
            SELECT expires - {now} FROM {table} WHERE name = %(name)s AND {held}""",
        "session_wait": "SELECT GET_LOCK(%(key)s, %(wait)s)",
        "session_unlock": "SELECT RELEASE_LOCK(%(key)s)",
        # The largest value MySQL and MariaDB accept: a year.
        "no_idle_timeout": "SET SESSION wait_timeout = 31536000",
        "idle_timeout": "SELECT @@SESSION.wait_timeout",
        "idle_timeout_restore": "SET SESSION wait_timeout = %(value)s",
        # Re-entry and partial release: only while the session still holds the lock.
        "session_count": f"""
            UPDATE {table} SET count = LAST_INSERT_ID(count + %(delta)s)
            WHERE name = %(name)s AND owner = %(owner)s AND {held}""",
        "session_extend": d.extend(table) + f" AND {held}",
        "session_extend_many": f"""
            UPDATE {table} SET expires = {now} + %(ttl)s
            WHERE (name, owner) IN ({{pairs}}) AND expires > {now} AND {held}""",
        "session_renewed": f"""
            SELECT name, owner FROM {table}
            WHERE (name, owner) IN ({{pairs}}) AND expires > {now} AND {held}""",
        "session_expired_holder": f"""
            SELECT session FROM {table}
            WHERE name = %(name)s AND expires <= {now} AND {held}""",
        # Eviction clears the row only if the lease is still expired: a holder that
        # renewed since the SELECT above keeps its lock; one that renews after this
        # finds the row cleared, so it never renews a lease whose session is killed.
        "session_clear_expired": f"""
            UPDATE {table} SET owner = NULL, count = 0, holder = NULL
            WHERE name = %(name)s AND session = %(session)s AND expires <= {now}""",
        "session_inspect": f"""SELECT {columns} FROM {table}
            WHERE name = %(name)s AND {live} AND {held}""",
        "session_list": f"""SELECT {columns} FROM {table}
            WHERE {d.prefix_match} AND {live} AND {held} ORDER BY name""",
        "session_holder": f"SELECT session FROM {table} WHERE name = %(name)s AND {held}",
        "session_owned": f"""SELECT 1 FROM {table}
            WHERE name = %(name)s AND owner = %(owner)s AND {held}""",
        # The MEMORY table is full: rows of names nobody holds go. Their counters are
        # below the clock, which keeps their next tokens increasing without them.
        "session_make_room": f"""
            DELETE FROM {table} WHERE fence < {d.clock_us} AND IS_USED_LOCK(lock_key) IS NULL""",
        "prune": f"""
            DELETE FROM {table} WHERE {d.idle_for("%(age)s", "%(age_us)s")}
            LIMIT %(batch)s""",
        "session_prune": f"""
            DELETE FROM {table} WHERE {d.idle_for("%(age)s", "%(age_us)s")}
                AND IS_USED_LOCK(lock_key) IS NULL
            LIMIT %(batch)s""",
        "session_clear": f"""
            UPDATE {table} SET owner = NULL, count = 0, holder = NULL
            WHERE name = %(name)s AND session = %(session)s""",
        # KILL takes a literal; PyMySQL interpolates the integer parameter client-side.
        "kill": "KILL CONNECTION %(id)s",
        # Whether a killed session still holds the lock: a KILL returns before the
        # session has ended, and its locks go only as it ends.
        "session_lock_kept": "SELECT IS_USED_LOCK(%(key)s) = %(session)s",
        "kill_query": "KILL QUERY %(id)s",
        # A session's own id and address, as the server sees them (past a proxy); one
        # row, whatever the processlist shows.
        "session_identity": """
            SELECT CONNECTION_ID(),
                (SELECT host FROM information_schema.processlist WHERE id = CONNECTION_ID())""",
        # Whether a session is still there (from where it was), and runs a statement.
        "session_state": """
            SELECT info LIKE %(statement)s FROM information_schema.processlist
            WHERE id = %(id)s AND host = %(address)s""",
    }
