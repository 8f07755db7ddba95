# DO NOT EDIT: generated from src/dlock/_async/backends/redis.py by scripts/unasync.py.
"""Redis, single server or Redis Cluster: one script call per acquire, release or extend.

Every key of a lock carries the hash tag ``{n:NAME}``, so each script touches one slot
and runs on a cluster as it does on one server (MOVED/ASK are redis-py's business).
Waiters queue on the server (fairness). A release grants the lease to the head of the
queue in the same script and tells it by pub/sub on that waiter's own channel, so the
next holder learns it holds the lock without a round trip of its own and no other
waiter wakes. Pub/sub rather than a list signal: a subscription on an idle pooled
connection can stay open between waits, while a blocking pop would need a connection
parked in it per waiter; a lost message only costs the core's fallback timer, whose
next attempt finds the lease already under the waiter's token.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import re
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, NamedTuple
from urllib.parse import SplitResult, urlencode, urlsplit, urlunsplit

import redis as redis_client
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode as _ClusterNode
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    ClusterError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)
from redis.retry import Retry

from ... import _redis_scripts as scripts
from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._fork import ForkFollower
from ..._options import bounded_seconds, flag, query_options
from ..._tls import certificate_refused, check_tls_files, load_client_files
from ..._types import Acquired, Busy, Holder, Lease, LockInfo
from ..._validation import name_bytes, name_from_bytes
from .._primitives import (
    IS_ASYNC,
    Cancelled,
    WakeupEvent,
    call_with_timeout,
    cancel_requests,
    concurrently,
    current_task,
    lost_cancel,
    run_detached,
    shielded,
    sleep,
)
from ..backend import Backend, Waiter

#: Options this backend takes besides what redis-py reads from the URL's query string.
OPTIONS = {"client", "prefix", "socket_timeout", "socket_connect_timeout", "queue_ttl"}
#: URL query options redis-py understands, passed through to it: its SSL options that
#: both faces take as text (the sync face's OCSP ones need pyOpenSSL and objects).
CLIENT_OPTIONS = {
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_ciphers",
    "ssl_exclude_verify_flags",
    "ssl_include_verify_flags",
    "ssl_min_version",
    "ssl_password",
    "client_name",
    "username",
    "password",
    "db",
    "protocol",
}
#: Connections a client's pool lends at once (on a cluster, per node). redis-py's pools
#: refuse one past their cap, 100 by default, rather than wait: a client with more calls
#: in flight and waiters listening at once (tasks, threads: each holds a connection)
#: failed the rest with BackendUnavailable though the server was fine. The server's
#: ``maxclients`` (10,000 by default) is the bound that matters.
MAX_CONNECTIONS = 2**31 - 1

#: A cluster's startup node (the sync face's class has no type hints).
ClusterNode: Any = _ClusterNode

#: What the sync face's RedisCluster drops without a word: refused with a cluster.
NOT_FOR_CLUSTERS = {"ssl_ciphers", "ssl_min_version"}
#: How long a waiter's place in the queue lasts unless refreshed by its next attempt;
#: well above the core's fallback wait (2 s) so a live waiter never loses its place.
QUEUE_TTL = 6.0
#: Seconds an idle pub/sub connection stays subscribed to its last channel (at least:
#: it is unsubscribed when the next wait begins, or when the client closes).
LINGER = 1.0
#: Seconds a waiter's leave is waited for after its latest attempt got no answer.
LEAVE_AFTER_SILENCE = 0.5
#: Seconds between attempts of a waiter that cannot subscribe (e.g. pub/sub refused).
UNHEARD_POLL = 0.1
#: Seconds after which a waiter whose subscription failed or dropped (a restart, a
#: network fault) subscribes again, polling meanwhile: a wait may last long. Doubled
#: after each failure, so a server that stays unreachable (a Redlock master whose
#: connects time out) is not tried every second.
RESUBSCRIBE_AFTER = 1.0
#: Idle pub/sub connections kept for the next waiter.
IDLE_SUBSCRIBERS = 8

_GLOB_SPECIAL = frozenset(b"*?[]\\")
# A list's passes of SCANs while a resharding moves slots (see ``_slot_views``): a key
# moves once per move, so a second pass finds one that moved during the first; a third
# allows for a move that begins during the second.
SCAN_PASSES = 3
#: What redis-py raises; its cluster errors do not all derive from RedisError.
ERRORS = (RedisError, RedisClusterException)
#: What a closed backend still sends: giving back, never taking.
GIVE_BACKS = (scripts.RELEASE, scripts.DEQUEUE)


#: States that a retry may well find over: a cluster that is down (CLUSTERDOWN,
#: MASTERDOWN, a slot not served) or moving a slot (TRYAGAIN, and redis-py's
#: ClusterError "TTL exhausted" after its redirections ran out). LOADING is
#: redis-py's BusyLoadingError, a ConnectionError already.
TRANSIENT = (ClusterError, TryAgainError, SlotNotCoveredError)
#: Error replies redis-py has no class for, of a server busy for now: BUSY, another
#: client's script running past busy-reply-threshold.
TRANSIENT_REPLIES = ("BUSY ",)
#: How a script that ran in part says that its cluster changed under it: a key it
#: deleted and then wrote again, while its slot moves, is served by the node importing
#: it; or the cluster went down. Unavailable (a retry may find the move over), but
#: never sent again by dlock: unlike TRYAGAIN, the script has run up to there.
CUT_SHORT_BY_THE_CLUSTER = (
    "Script attempted to access a non local key",
    "Script attempted to execute a command while the cluster is down",
)
#: Seconds before a waiter or a call tries again after a cluster refused it for moving
#: the name's slot (see ``moving``); doubled per refusal in a row up to MOVING_RETRY_MAX,
#: less up to half of it at random, so that waiters do not retry in lockstep.
MOVING_RETRY = 0.05
MOVING_RETRY_MAX = 0.5
#: Tries redis-py's cluster client makes of one command (its default 16): enough to
#: follow a MOVED and an ASK; a TRYAGAIN past them is dlock's to ride out (``moving``).
CLUSTER_REQUEST_TTL = 4
_JITTER = random.SystemRandom()
#: dlock's read timeout: its own clients', that of its twin of a given client that has
#: none (``_bounded_twin``), and how long a call rides out a cluster moving the name's
#: slot on a given client (see ``RedisBackend._ride_out_bound``).
SOCKET_TIMEOUT = 5.0
#: A cluster's renewal waits for each node's answers at most this share of the shortest
#: TTL in the batch (and no longer than the ride-out bound, ``socket_timeout``), and then
#: counts those of a node still silent as unknown (None). The renewer sends a lease with
#: about two thirds of its TTL left, and bounds the whole call by the earliest lease's
#: time left (asyncio: a timeout, which would throw every answer away) or tells each
#: lease's loss at its deadline (threads): the answers of the nodes that serve reach it
#: in time, whatever a paused node does. Only a batch whose earliest lease has less than
#: this left (a silent node's, retried until its deadline) can still be cut off whole.
NODE_WAIT = 1 / 6


def moving_delay(refusals: int) -> float:
    """Seconds to wait after ``refusals`` (1 or more) refusals in a row for moving the
    name's slot: MOVING_RETRY doubled per refusal up to MOVING_RETRY_MAX, less up to half
    of it at random (25 to 50 ms first), so that callers do not retry in lockstep."""
    delay = min(MOVING_RETRY * 2 ** min(refusals - 1, 16), MOVING_RETRY_MAX)
    return _JITTER.uniform(delay / 2, delay)


def _serving_master(view: dict[str, Any]) -> bool:
    """Whether a node of CLUSTER NODES (as redis-py parses it) is a master that serves
    slots and that the cluster holds reachable."""
    flags = set(view["flags"].split(","))
    unreachable = {"fail", "handshake", "noaddr"}
    return "master" in flags and bool(view["slots"]) and not flags & unreachable


def _mapped(address: str, view: dict[str, Any], known: set[tuple[str, int]]) -> bool:
    """Whether a node that CLUSTER NODES names at ``address`` (ip:port, and maybe a
    host name) is one of ``known`` (a client's masters, as host and port)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or port == "0":
        return True  # no address to reach it at: nothing to map
    return (host, int(port)) in known or (view["hostname"], int(port)) in known


def _moving_any(views: list[Any]) -> bool:
    """Whether a master in ``views`` (see ``_slot_views``) is moving a slot in or out."""
    return any(migrations for _, _, _, migrations in views)


def moving(exc: BaseException | None) -> bool:
    """A cluster between two maps of its slots, that refused a call before running it.

    Moving the name's slot: the node that serves it answers TRYAGAIN to a script whose
    keys it holds only some of, and so does the node importing it; redis-py tries again
    a few times (and follows MOVED and ASK) and then raises ClusterError "TTL
    exhausted". Every one of those answers comes before the script runs, as does a
    ClusterError's, which redis-py raises only once its redirections ran out (a timeout
    or a lost connection, which may come after the script ran, is another error). Or
    redis-py's "startup_nodes could not agree", mapping the slots before it sends
    anything: nodes that disagree about who serves some, while a resharding's news
    spreads. So a script refused so may be sent again, and a retry may find it over.
    CLUSTERDOWN (a ClusterError as well) is not a move: a cluster that is down. Nor is
    any of them raised while handling a lost connection or a timeout (redis-py's sync
    cluster client maps the slots again there): the script may have run."""
    return (
        isinstance(exc, TryAgainError)
        or (isinstance(exc, ClusterError) and not isinstance(exc, ClusterDownError))
        or (isinstance(exc, RedisClusterException) and "could not agree" in str(exc))
    ) and not _after_a_lost_reply(exc)


def _refused_before_running(exc: BaseException | None) -> bool:
    """A cluster refused a call before running it: moving the name's slot (``moving``),
    or down (CLUSTERDOWN: a node failed, and the others serve no slot until it is
    replaced), not while handling a lost reply."""
    return moving(exc) or (isinstance(exc, ClusterDownError) and not _after_a_lost_reply(exc))


def _after_a_lost_reply(exc: BaseException | None) -> bool:
    """``exc`` was raised while handling a lost connection or a timeout."""
    seen = 0
    while exc is not None and seen < 10:
        exc, seen = exc.__context__, seen + 1
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
            return True
    return False


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _text(value: Any) -> str | None:
    """A script's string reply (bytes, or str with decoded responses); None for nil."""
    return value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else None


def split_url(url: str) -> SplitResult:
    """``urlsplit``, whose ValueError (an unclosed IPv6 bracket) becomes ours. Ports
    are read, and checked, host by host (``_host_and_port``)."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise ConfigurationError(f"bad Redis URL: {exc}") from None


def _with_server(url: str, host: str, port: int) -> str:
    """``url`` naming another server (a cluster's node), with its credentials and options."""
    parts = urlsplit(url)
    auth, at, _ = parts.netloc.rpartition("@")
    if ":" in host:
        host = f"[{host}]"
    return urlunsplit(parts._replace(netloc=f"{auth}{at}{host}:{port}"))


def _check_database(path: str, db: str | None, cluster: bool) -> None:
    """The database number, given once and as digits: redis-py reads a path it cannot
    parse as database 0, and lets ``?db=`` override the path, so a typo would put the
    locks in another database without a word. A cluster has database 0 only, which
    redis-py would say only at the first call, as an error dlock could not tell apart
    from a server's."""
    number = path[1:] if path.startswith("/") else path
    if number and not re.fullmatch("[0-9]+", number):
        raise ConfigurationError(f"the Redis URL's path must be a database number, not {path!r}")
    if db is not None:
        if number:
            raise ConfigurationError("the Redis URL gives the database twice: path and ?db=")
        if not re.fullmatch("[0-9]+", db):
            raise ConfigurationError(f"db must be a database number, not {db!r}")
    if cluster and int(number or db or 0) != 0:
        raise ConfigurationError(
            f"Redis Cluster has only database 0, not {int(number or db or 0)}: "
            "give a cluster URL no database number, or /0"
        )


#: What still applies to a client given with ``client=``: dlock's own key layout.
GIVEN_CLIENT_OPTIONS = {"client", "prefix", "queue_ttl"}


def _seed_addresses(hosts: str, cluster: bool) -> list[str]:
    """The URL's ``host:port`` list: several only for a cluster, whose client maps its
    slots from the first of them that answers (one seed down must not keep new clients
    out)."""
    addresses = [address.strip() for address in hosts.split(",")]
    if len(addresses) > 1 and not cluster:
        raise ConfigurationError(
            "several hosts are a cluster's seeds (redis+cluster://) or Redlock's masters "
            "(redis+redlock://); a redis:// URL names one server"
        )
    if not all(addresses):
        raise ConfigurationError(f"an empty host in the cluster's seeds {hosts!r}")
    return addresses


def _host_and_port(address: str) -> tuple[str, int]:
    parts = urlsplit(f"//{address}")
    try:
        port = parts.port or 6379
    except ValueError as exc:
        raise ConfigurationError(f"bad Redis URL: {address!r}: {exc}") from None
    if not parts.hostname:
        raise ConfigurationError(f"bad Redis URL: {address!r} names no host")
    return parts.hostname, port


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_given_client_url(parts: SplitResult, options: set[str]) -> None:
    """With ``client=``, the client brings its server, database, credentials, timeouts
    and TLS: a URL that says otherwise would be ignored without a word."""
    ignored = sorted(options - GIVEN_CLIENT_OPTIONS)
    if parts.netloc:
        ignored.insert(0, "host, port or credentials")
    if parts.path not in ("", "/"):
        ignored.insert(0, "database")
    if ignored:
        raise ConfigurationError(
            f"with client=, the client's own settings apply; the URL's would be ignored: "
            f"{', '.join(ignored)} (use {parts.scheme}:// with only prefix or queue_ttl)"
        )


#: TLS options naming a file, read at each connect.
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _check_client_options(query: dict[str, str], cluster: bool) -> None:
    """What redis-py would only find wrong at the first connect, and then report as a
    ConnectionError, which dlock would have to call BackendUnavailable (retryable).
    ``ssl_min_version`` is rewritten as the number redis-py reads."""
    check_tls_files(query, _TLS_FILES, directories=("ssl_ca_path",))
    if query.get("protocol", "2") not in ("2", "3"):
        raise ConfigurationError(f"protocol must be 2 or 3, not {query['protocol']!r}")
    if query.get("ssl_cert_reqs", "required") not in ("none", "optional", "required"):
        raise ConfigurationError(
            f"ssl_cert_reqs must be none, optional or required, not {query['ssl_cert_reqs']!r}"
        )
    if cluster and (dropped := sorted(NOT_FOR_CLUSTERS & query.keys())):
        raise ConfigurationError(f"redis-py's cluster client ignores {', '.join(dropped)}")
    if "ssl_min_version" in query:
        query["ssl_min_version"] = str(_tls_version(query["ssl_min_version"]))
    if "ssl_check_hostname" in query:
        # redis-py reads any word but its few false ones as true ("maybe", and "off").
        checked = flag(query["ssl_check_hostname"], "ssl_check_hostname")
        query["ssl_check_hostname"] = "true" if checked else "false"
    for key in query.keys() & URL_QUERY_ARGUMENT_PARSERS.keys():
        parse: Any = URL_QUERY_ARGUMENT_PARSERS[key]  # the sync face's is typed loosely
        try:
            parse(query[key])
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"{key}: {exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if "ssl_ciphers" in query:
            context.set_ciphers(query["ssl_ciphers"])
        if "ssl_ca_data" in query:
            context.load_verify_locations(cadata=query["ssl_ca_data"])
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigurationError(f"TLS options: {exc}") from None
    # As redis-py will at each connect, where a file OpenSSL cannot take (not PEM, a
    # wrong ssl_password) was a ConnectionError, and an encrypted key without
    # ssl_password made OpenSSL ask for its passphrase on the terminal, and wait.
    load_client_files(
        context,
        "Redis",
        ca=query.get("ssl_ca_certs"),
        certfile=query.get("ssl_certfile"),
        keyfile=query.get("ssl_keyfile") or None,
        password=query.get("ssl_password"),
        options=("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_password"),
    )


def _tls_version(value: str) -> int:
    """``TLSv1_2`` (Python's name, as in ``ssl.TLSVersion``) or its number (771)."""
    try:
        return int(ssl.TLSVersion(int(value)) if value.isdigit() else ssl.TLSVersion[value])
    except (KeyError, ValueError):
        raise ConfigurationError(
            f"ssl_min_version must be TLSv1_2, TLSv1_3 or another ssl.TLSVersion, not {value!r}"
        ) from None


#: Refusals that waiting will not mend: the server's (password, ACL), or a file that the
#: client reads to connect (a TLS certificate or key) missing or unreadable.
REFUSALS = (
    AuthenticationError,
    AuthorizationError,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
)


def _refusal(error: BaseException) -> bool:
    """One of REFUSALS somewhere in ``error``'s chain: a cluster client that reached no
    node says "cannot be connected", caused by the last node's refusal."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, REFUSALS):
            return True
        current = current.__cause__ or current.__context__
    return False


#: How redis-py says that a node asked for the cluster's layout is a plain server.
CLUSTER_MODE_OFF = "Cluster mode is not enabled"


def wrap(exc: Exception, where: str) -> BackendError:
    """A redis-py error as dlock's: unreachable, slow or busy servers and clusters between
    states are BackendUnavailable; a server that refuses this client (password, ACL,
    certificate) or a certificate file that is gone is a plain BackendError, which
    retrying will not mend, though redis-py calls it a ConnectionError."""
    if (
        _refusal(exc)
        or certificate_refused(exc)
        # cluster=true against a server that is not in a cluster: a wrong URL.
        or (isinstance(exc, RedisClusterException) and CLUSTER_MODE_OFF in str(exc))
    ):
        return BackendError(f"Redis {where}: refused: {type(exc).__name__}: {exc}")
    if isinstance(exc, AskError):
        # MOVED or ASK (MovedError is an AskError), which a cluster client follows
        # itself: a plain client's server is a cluster node, serving the name's slot
        # elsewhere. Told at that reply, not looked for by a round trip of every call.
        return BackendError(
            f"Redis {where}: the server is a Redis Cluster node, and another node serves "
            f"this name ({type(exc).__name__}: {exc}): use a redis+cluster:// URL "
            f"(or ?cluster=true)"
        )
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)) or (
        isinstance(exc, RedisClusterException) and "connect" in str(exc)
    ):
        return BackendUnavailable(f"Redis {where}: {type(exc).__name__}: {exc}")
    if moving(exc):
        return BackendUnavailable(
            f"Redis {where}: the cluster is moving the name's slot or remapping its slots "
            f"(a retry may find it done): {type(exc).__name__}: {exc}"
        )
    if (
        isinstance(exc, TRANSIENT)
        or (isinstance(exc, ResponseError) and str(exc).startswith(TRANSIENT_REPLIES))
        or (isinstance(exc, ResponseError) and str(exc).startswith(CUT_SHORT_BY_THE_CLUSTER))
        # redis-py's reading of a cluster that does not serve every slot (down).
        or (isinstance(exc, RedisClusterException) and "not covered" in str(exc))
    ):
        return BackendUnavailable(f"Redis {where}: {type(exc).__name__}: {exc}")
    return BackendError(f"Redis {where}: {type(exc).__name__}: {exc}")


def _close_quietly(closable: Any) -> bool:
    """``closable.close()``; False if it failed (a broken connection is closed enough)."""
    try:
        closable.close()
    except (*ERRORS, OSError):
        return False
    return True


def _disconnect_node_pools(client: Any) -> None:
    """Close the connections of a closed cluster client's nodes. redis-py's sync cluster
    closes each node's client, not the pool it gave that client, whose sockets stayed
    open until the collector or the process's exit found them (with a ResourceWarning
    each). Its asyncio cluster closes them itself: its nodes have no such client."""
    nodes = getattr(getattr(client, "nodes_manager", None), "nodes_cache", {})
    for node in list(nodes.values()):
        node_client = getattr(node, "redis_connection", None)
        if node_client is not None:
            with suppress(*ERRORS, OSError):
                node_client.connection_pool.disconnect()


def _wire(command: Sequence[Any]) -> tuple[Any, ...]:
    """A command with its numbers (``int``, ``float``) encoded as redis-py's Encoder would
    (``repr``, as ASCII bytes). With hiredis installed, redis-py hands the arguments to
    ``hiredis.pack_command`` as they are, which converts numbers in C and crashes the
    interpreter (SIGSEGV) when a signal's KeyboardInterrupt lands during that conversion:
    a Ctrl-C at the wrong moment of an acquire or release killed the process, its lease
    left to its TTL. Encoded here, in Python, a Ctrl-C is just a KeyboardInterrupt.
    Strings stay strings: a cluster client reads the command's name as one."""
    return tuple(repr(part).encode() if isinstance(part, int | float) else part for part in command)


class Keys:
    """The keys and the wake-up channel of one lock name, all in one hash slot."""

    __slots__ = ("fence", "info", "lease", "qexp", "queue", "wake")

    def __init__(self, prefix: bytes, name: str) -> None:
        # "n:" keeps the hash tag non-empty even for a name starting with "}".
        base = prefix + b":{n:" + name_bytes(name) + b"}:"
        self.lease = base + b"lease"
        self.fence = base + b"fence"
        self.queue = base + b"queue"
        self.qexp = base + b"qexp"
        self.info = base + b"info"
        #: Followed by a waiter's token: that waiter's pub/sub channel.
        self.wake = base + b"wake:"

    def queued(self) -> tuple[bytes, ...]:
        """The keys of the scripts that hand the lock on to the queue."""
        return (self.lease, self.fence, self.queue, self.qexp, self.info)


def _check_prefix(prefix: object) -> None:
    """The key prefix, as given. Not made a str: ``prefix=None`` or ``b"dlock"`` were
    keys under ``None:`` and ``b'dlock':``, a lock space apart from the clients that
    left the default, where nothing said so."""
    if not isinstance(prefix, str):
        raise ConfigurationError(f"prefix must be a str, not {type(prefix).__name__}")
    if not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError("prefix must be non-empty and contain no '{' or '}'")
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigurationError(
            "prefix is not valid Unicode (it contains a lone surrogate)"
        ) from None


@lru_cache(maxsize=4096)
def _keys(prefix: bytes, name: str) -> Keys:
    """Keys of recently used names, so a hot lock does not re-encode its name each time."""
    return Keys(prefix, name)


class Left(NamedTuple):
    """A leave's outcome: whether the server answered, and the waiter the leave woke
    there without handing it the lease (Redlock's masters; None: nobody)."""

    answered: bool
    woke: str | None = None


@dataclass
class _Waiting:
    """A token waiting for a lock: its place in the queue and its latest attempt."""

    #: Orders the queue: "now" (the server's clock at its first attempt) or, for
    #: Redlock, one arrival in ms shared by every master.
    arrival: str
    #: The number of its latest attempt: a lease handed over is only taken when it names
    #: the latest, so the waiter knows it was granted after that attempt was sent. Each
    #: attempt also (re)takes the place, so a place that lapsed is taken again.
    attempt: int = 0
    #: Out of the queue already (granted by an attempt or handed the lease): leaving
    #: needs no round trip.
    left: bool = False
    #: Attempts in a row that the cluster refused for moving the name's slot.
    refused: int = 0
    #: Its latest attempt got no answer (the server silent): see ``_leave``.
    unanswered: bool = False


class _PubSubWaiter(Waiter):
    """Returns early when a release wakes this waiter, with the lease if it was handed over."""

    notifies = True

    def __init__(self, backend: RedisBackend, pubsub: Any, channel: bytes, token: str) -> None:
        self._backend = backend
        #: None until the first wait: a lock that is free at the first attempt never
        #: subscribes (an idle connection still subscribed to the channel is used at once).
        self.pubsub = pubsub
        self._channel = channel
        self._token = token
        self.broken = False
        #: When a broken waiter subscribes again (never if pub/sub was refused).
        self._resubscribe_at = math.inf
        self._resubscribe_after = RESUBSCRIBE_AFTER

    def _unheard(self, error: Exception) -> None:
        """No subscription: waiting still works on the core's timer and the lease's time
        left, only later. Tried again after a while, unless refused (ACL, password)."""
        self.broken = True
        if isinstance(wrap(error, self._backend._where), BackendUnavailable):
            self._resubscribe_at = time.monotonic() + self._resubscribe_after
            self._resubscribe_after *= 2

    def wait(self, timeout: float) -> Acquired | None:
        if self.broken and time.monotonic() >= self._resubscribe_at:
            self.broken, self._resubscribe_at = False, math.inf
        if self.pubsub is None and not self.broken:
            try:
                self.pubsub = self._backend.subscribe(self._channel)
            except (*ERRORS, OSError) as exc:
                self._unheard(exc)
            # A release before the subscription was not heard: the caller tries again now.
            return None
        # Each attempt refreshes this waiter's place in the queue, which a wait as long
        # as the core's fallback (2 s) would outlast with a short queue_ttl (not polling
        # faster than an unheard waiter for a tiny one).
        refresh = max(self._backend._queue_ttl_ms / 3000, UNHEARD_POLL)
        deadline = time.monotonic() + min(timeout, refresh)
        cancels = cancel_requests()
        while (remaining := deadline - time.monotonic()) > 0:
            if cancel_requests() > cancels:
                # A cancellation that redis-py lost (its reads go through
                # ``asyncio.wait_for`` before Python 3.12): stop now, not at the timeout.
                lost_cancel()
            if self.broken:
                # Nothing will wake us: poll as a backend without notifications would.
                sleep(min(remaining, UNHEARD_POLL))
                return None
            try:
                message = self.pubsub.get_message(ignore_subscribe_messages=True, timeout=remaining)
            except (*ERRORS, OSError) as exc:
                # The subscription is gone: the core's timer still lets us in.
                pubsub, self.pubsub = self.pubsub, None
                self._backend._aclose_quietly(pubsub)
                self._unheard(exc)
                continue
            except (TypeError, ValueError):
                # The client closed under this wait (the sync face: from another thread)
                # and redis-py polled the socket it shut: the core now sees it closed.
                if not self._backend._closed:
                    raise
                return None
            if (
                message is None
                or message.get("type") != "message"
                or _bytes(message.get("channel")) != self._channel
            ):
                continue
            data = _bytes(message.get("data"))
            if not data:
                return None
            handed = self._backend.handed_over(self._token, data)
            if handed is not None:
                return handed
            # A grant meant for an earlier attempt: the next attempt takes it if still ours.
        return None


class _Connections:
    """Connections taken from a redis-py pool once and kept for the lock's own calls.

    redis-py's ``execute_command`` and its pool wrap every command in retry and metrics
    bookkeeping that costs about 8 µs per checkout, as much as a lock script's work on
    the server. We retry nothing and record nothing, so the hot path sends on
    connections kept here (as many as calls were ever in flight at once), checking
    each for a stale reply or a closed socket before use as the pool would.
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._idle: list[Any] = []
        self._follow_fork = ForkFollower(self._forget_parent)

    def _forget_parent(self) -> None:
        """A forked child must not use its parent's sockets (nor close them)."""
        self._idle = []

    def take(self) -> Any:
        self._follow_fork()
        try:
            connection = self._idle.pop()
        except IndexError:
            return self._pool.get_connection()
        if not _connected(connection):
            # Closed after a call cut off: it connects as it sends. The sync face's check
            # would connect it first, and a server that does not answer would then cost
            # the call two timeouts, the check's and the send's.
            return connection
        # redis-py 8 renamed the asyncio client's check to can_read(), the sync client's name.
        check = getattr(connection, "can_read", None) or connection.can_read_destructive
        try:
            if check():
                connection.disconnect()  # reconnects on the next send
        except (*ERRORS, OSError):
            connection.disconnect()
        return connection

    def give_back(self, connection: Any) -> None:
        self._idle.append(connection)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            self._pool.release(connection)


def _no_maintenance_notifications() -> dict[str, Any]:
    """redis-py 8's pool lends its connections unchecked while its maintenance
    notifications (for Redis Enterprise's planned fail-overs) are on, as they are by
    default: after a restart or ``CLIENT KILL`` an asyncio client's next call through the
    pool (a listing's SCAN) went out on a socket the server had closed and failed."""
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # an older redis-py: no such notifications
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


_NO_MAINTENANCE_NOTIFICATIONS = _no_maintenance_notifications()


def _connected(connection: Any) -> bool:
    """Whether a redis-py connection has its socket (redis-py 5's sync face has no
    ``is_connected``)."""
    connected = getattr(connection, "is_connected", None)
    if connected is None:
        return getattr(connection, "_sock", None) is not None
    return bool(connected)


def _bounded_twin(client: Any, seconds: float) -> Any:
    """A client of our own for a given plain client that has no read timeout
    (``socket_timeout=None``, redis-py's default before 8.0), or None when it has one.

    Its connections would wait for a paused server (SIGSTOP, a hung host) until it
    answers again, whatever the caller's timeout: an ``acquire(timeout=1)`` took the
    whole of an 8 s pause. The twin reaches the same server with the same connection
    settings (credentials, database, TLS), each round trip and connect bounded
    by ``seconds`` and retried never, as dlock's own clients are, and with the same cap
    on connections; the given client itself, and its owner's commands, are left as
    they are."""
    if not isinstance(client, redis_client.Redis):
        return None  # a cluster client keeps its own (docs/redis.md)
    pool = client.connection_pool
    kind = type(pool)
    if kind not in (redis_client.ConnectionPool, redis_client.BlockingConnectionPool):
        return None  # a Sentinel's pool, or one of its owner's making: how to copy it is theirs
    settings = dict(pool.connection_kwargs)
    if settings.get("socket_timeout") is not None:
        return None
    settings["socket_timeout"] = seconds
    if settings.get("socket_connect_timeout") is None:
        settings["socket_connect_timeout"] = seconds
    # No silent retries, as on dlock's own clients: redis-py's default retried a SCAN
    # that timed out three times, and a list() took the whole of a 12 s pause.
    settings["retry"] = Retry(NoBackoff(), 0)
    if isinstance(pool, redis_client.BlockingConnectionPool):
        settings["timeout"] = pool.timeout  # how long a caller waits for a connection
    return redis_client.Redis.from_pool(
        kind(
            connection_class=pool.connection_class,
            max_connections=pool.max_connections,
            **settings,
        )
    )


def _own_connections(client: Any) -> _Connections | None:
    """Our own connections for a plain client (from its pool: a single-connection
    client's one connection stays its owner's), never sent through its
    ``execute_command``, which retries what its ``retry`` says (a given client's own,
    three times by default): a script whose reply was lost may have run, and run again
    (a reentrant lock's inner release would free the outer hold). Clusters keep
    redis-py's general path (see ``_run``)."""
    if isinstance(client, redis_client.Redis):
        return _Connections(client.connection_pool)
    return None


@contextlib.contextmanager
def torn_connections_lost() -> Iterator[None]:
    """redis-py's asyncio cluster client answers a CLUSTERDOWN (a failover under
    way) by closing every node's connections, those that other calls are using
    too: a call mid-connect or mid-send then fails on the stream taken from under
    it ("'NoneType' object has no attribute 'writelines'"), an AttributeError that
    reached dlock's caller raw (a chaos helper, killing a master). That is a
    connection lost under the call, after which a script may have run."""
    try:
        yield
    except (AttributeError, RuntimeError) as exc:
        if not _closed_under_the_call(exc):
            raise
        raise RedisConnectionError(
            f"connection closed under the call by the cluster client ({exc})"
        ) from exc


def _closed_under_the_call(exc: BaseException) -> bool:
    """The stock event loop's symptom (the stream already dropped: an AttributeError on
    None), or uvloop's: its transports refuse a write once closed, with a RuntimeError
    ("unable to perform operation on <TCPTransport closed=True ...>; the handler is
    closed") where the stock loop drops the data silently."""
    if isinstance(exc, AttributeError):
        return "'NoneType' object has no attribute" in str(exc)
    return "the handler is closed" in str(exc)


class RedisBackend(Backend):
    """One Redis server or one Redis Cluster, reached through redis-py."""

    #: A blocking acquire's first attempt already joins the queue (if the lock is busy),
    #: saving a waiter the second attempt it would otherwise make after subscribing.
    queues_waiters = True

    def __init__(
        self,
        url: str | None = None,
        *,
        cluster: bool = False,
        client: Any = None,
        prefix: str = "dlock",
        client_options: dict[str, Any] | None = None,
        queue_ttl: float = QUEUE_TTL,
        seeds: Sequence[tuple[str, int]] = (),
    ) -> None:
        _check_prefix(prefix)
        if client is not None and not isinstance(
            client, (redis_client.Redis, redis_client.RedisCluster)
        ):
            # Named from the module in use: unasync would rewrite names spelled out here.
            wanted = f"{redis_client.__name__}.Redis or {redis_client.__name__}.RedisCluster"
            face = "dlock" + (".aio" if IS_ASYNC else "")
            raise ConfigurationError(
                f"client= must be a redis-py client of this face, {wanted} for {face}, "
                f"not {type(client).__module__}.{type(client).__name__}"
            )
        self._url = url
        self._cluster = cluster or isinstance(client, redis_client.RedisCluster)
        #: A cluster's seed nodes after the URL's first: any one answering maps the slots.
        self._seeds = list(seeds)
        #: The client given with ``client=``, if any: never closed nor changed here.
        self._given: Any = client
        self._client: Any = client
        self._connections = None if client is None else _own_connections(client)
        self._owns_client = client is None
        #: The read timeout of ``_client`` when it is a bounded twin of the given client
        #: (see bound_given), else None.
        self._twin_timeout: float | None = None
        if client is not None:
            self.bound_given(SOCKET_TIMEOUT)
        self._prefix = prefix.encode("utf-8")
        self._client_options = client_options or {}
        self._queue_ttl_ms = _ms(queue_ttl)
        #: Clients that pub/sub connections are made from, by server URL (see _listen_on).
        self._subscribers: dict[str, Any] = {}
        #: After close(): calls are refused rather than reconnecting.
        self._closed = False
        #: The event loop the connections above were made in (under asyncio).
        self._loop: Any = None
        #: Idle pub/sub connections: (connection, channel still subscribed, idle since).
        self._idle: list[tuple[Any, bytes | None, float]] = []
        #: A forked child drops the connections above (``_forget_parent``).
        self._follow_fork = ForkFollower(self._forget_parent)
        #: What the processes this one was forked from made, kept unused and unclosed.
        self._parents: list[Any] = []
        #: The tokens waiting through this backend (the sync face: from several threads).
        self._waiting: dict[str, _Waiting] = {}
        #: Tokens whose leave of the queue is still on its way (asyncio: a waiter
        #: cancelled again while leaving has gone on, its leave runs to its end).
        self._leaving: dict[str, WakeupEvent] = {}
        #: Leaves of waiters cancelled, going on by themselves (kept from the collector).
        self._leaves: set[Any] = set()
        self._attempt_numbers = itertools.count(1)
        #: Releases grant the lease to the next waiter (False for Redlock's masters, where
        #: one master cannot grant alone: the waiter is only woken).
        self.hand_over = True
        self._where = self._describe()
        #: The sync face shares a backend between threads: create each client once.
        self._creating = threading.Lock()

    def bound_given(self, seconds: float) -> None:
        """Bound each round trip on a given client that has no read timeout of its own by
        ``seconds`` (see ``_bounded_twin``); Redlock's masters take its shorter one."""
        twin = _bounded_twin(self._given, seconds)
        if twin is not None:
            self._client, self._twin_timeout = twin, seconds
            self._connections = _own_connections(twin)

    def server(self) -> tuple[str, int] | None:
        """The server's (host, port) from the URL (None for a given client)."""
        if self._url is None:
            return None
        parts = urlsplit(self._url)
        return ((parts.hostname or "localhost").lower(), parts.port or 6379)

    def server_identity(self) -> str:
        """The server's ``run_id`` (``INFO server``), one per server process: two
        addresses of one server (a host name and its IP address, 127.0.0.1 and
        ::ffff:127.0.0.1) answer the same."""
        try:
            answer = self._run(self._get_client(), "INFO", "server")
        except ERRORS as exc:
            raise wrap(exc, self._where) from exc
        if isinstance(answer, dict):  # parsed by redis-py (a client without our connections)
            return str(answer.get("run_id", ""))
        for line in _bytes(answer).decode("utf-8", "replace").splitlines():
            if line.startswith("run_id:"):
                return line.partition(":")[2].strip()
        return ""

    def _describe(self) -> str:
        if self._url is None:
            return "(given client)"
        parts = urlsplit(self._url)
        first = (parts.hostname or "localhost", parts.port or 6379)
        return ",".join(_address(host, port) for host, port in [first, *self._seeds])

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> RedisBackend:
        parts = split_url(url)
        scheme = parts.scheme.lower()
        cluster = scheme.endswith("+cluster")
        base_scheme = "rediss" if scheme.startswith("rediss") else "redis"
        query = query_options(parts.query)
        if "cluster" in query:
            asked = flag(query.pop("cluster"), "cluster")
            if cluster and not asked:
                raise ConfigurationError(f"{scheme}:// contradicts cluster=false")
            cluster = asked
        settings: dict[str, Any] = {}
        for key in list(query):
            if key in OPTIONS:
                settings[key] = query.pop(key)
        settings.update(options)
        unknown = (set(settings) - OPTIONS) | (set(query) - CLIENT_OPTIONS)
        if unknown:
            raise ConfigurationError(f"unknown redis option(s): {', '.join(sorted(unknown))}")
        if settings.get("client") is not None:
            _check_given_client_url(parts, set(settings) | set(query))
        _check_database(parts.path, query.get("db"), cluster)
        # First: the files of options that would not be used are no matter.
        if base_scheme == "redis" and any(key.startswith("ssl_") for key in query):
            raise ConfigurationError("ssl_* options need a rediss:// URL")
        _check_client_options(query, cluster)
        client_options: dict[str, Any] = {
            key: bounded_seconds(settings[key], key)
            for key in ("socket_timeout", "socket_connect_timeout")
            if key in settings
        }
        queue_ttl = bounded_seconds(settings.get("queue_ttl", QUEUE_TTL), "queue_ttl")
        auth, at, hosts = parts.netloc.rpartition("@")
        addresses = _seed_addresses(hosts, cluster) if hosts else ["localhost:6379"]
        seeds = [_host_and_port(address) for address in addresses]
        netloc = f"{auth}{at}{addresses[0]}"
        clean = urlunsplit((base_scheme, netloc, parts.path, urlencode(query), ""))
        return cls(
            clean if settings.get("client") is None else None,
            cluster=cluster,
            client=settings.get("client"),
            prefix=settings.get("prefix", "dlock"),
            client_options=client_options,
            queue_ttl=queue_ttl,
            seeds=seeds[1:],
        )

    def _connection_options(self) -> dict[str, Any]:
        # No silent retries: a retried acquire whose first reply was lost would look
        # busy to its own owner. Connect and read timeouts keep failures quick.
        return {
            "socket_connect_timeout": 2.0,
            "socket_timeout": SOCKET_TIMEOUT,
            "retry": Retry(NoBackoff(), 0),
            "max_connections": MAX_CONNECTIONS,
            **_NO_MAINTENANCE_NOTIFICATIONS,
            **self._client_options,
        }

    def _check_open(self) -> None:
        """A closed backend makes no new connection (nobody would close it)."""
        if self._closed:
            raise BackendError(f"Redis {self._where}: the client is closed")

    def _follow_loop(self) -> None:
        """Drop what an earlier event loop made (a client used by two ``asyncio.run``
        calls): its connections cannot be used, nor closed, in another loop, so they
        are left to the garbage collector and new ones are made here. A client given
        with ``client=`` is its owner's: it stays, and works only in its own loop.
        The sync face has no loop: nothing changes."""
        task = current_task()
        loop = None if task is None else task.get_loop()
        if loop is self._loop:
            return
        with self._creating:
            if self._loop is not None:
                # A leave of the earlier loop will not end in this one: not waited for.
                self._idle, self._subscribers, self._leaving = [], {}, {}
                if self._owns_client:
                    self._client = self._connections = None
                elif self._twin_timeout is not None:
                    self.bound_given(self._twin_timeout)  # ours: made anew in this loop
                else:
                    self._connections = _own_connections(self._client)
            self._loop = loop

    def _forget_parent(self) -> None:
        """Drop the connections of the process this one was forked from: their sockets
        are the parent's, to neither use nor close (a child subscribing one to its own
        channel would take the parent's wake-ups away). Our own client is made anew:
        redis-py's pools check for a fork themselves, but start over under a lock that
        another thread of the parent may have held as it forked, and that no thread of
        the child lets go (its first call hung). What the parent made is kept, unused:
        collected, redis-py would close it through those pools. A client given with
        ``client=`` stays; its pool is its owner's to make fork-safe (a bounded twin of
        it is ours: made anew)."""
        self._parents.append((self._client, self._connections, self._idle, self._subscribers))
        self._idle, self._subscribers, self._leaving = [], {}, {}
        self._creating = threading.Lock()
        if self._owns_client:
            self._client = self._connections = None
        elif self._twin_timeout is not None:
            self.bound_given(self._twin_timeout)

    def _get_client(self) -> Any:
        self._check_open()
        self._follow_fork()  # first: it renews the lock that _follow_loop takes
        self._follow_loop()
        if self._client is None:
            with self._creating:
                return self._create_client()
        return self._client

    def _create_client(self) -> Any:
        if self._client is None:
            self._client = self._open_client()
            if not self._cluster:
                self._connections = _own_connections(self._client)
        return self._client

    def _open_client(self) -> Any:
        """A client for the URL. The sync face's cluster client maps the slots as it is
        made, in the first call that needs it: nodes that disagree about some (a
        resharding's news spreading) refuse that before anything is sent, and it is
        made again for as long as a call rides out a move (``_ride_out_bound``). The
        asyncio client maps them in its first call, which rides it out there; it never
        waits here."""
        assert self._url is not None
        deadline = time.monotonic() + self._ride_out_bound()
        refusals = 0
        while True:
            try:
                if self._cluster:
                    cluster = redis_client.RedisCluster.from_url(
                        self._url,
                        startup_nodes=[ClusterNode(host, port) for host, port in self._seeds],
                        # On every 5th MOVED (its default), redis-py's asyncio client
                        # maps the slots again by closing every node's connections,
                        # those other calls are reading from too: a plain resharding
                        # then failed their acquires and releases ("Connection closed
                        # by server"). Patching the moved slot alone closes nothing.
                        reinitialize_steps=0,
                        **self._connection_options(),
                    )
                    # redis-py answers TRYAGAIN by sending again, 16 times in all, the
                    # last 8 after 50 ms each: one attempt of a waiter took ~0.45 s,
                    # past the waiter's timeout. dlock rides a move out itself, within
                    # the caller's bound; redis-py keeps a few tries, for MOVED and ASK.
                    cluster.RedisClusterRequestTTL = CLUSTER_REQUEST_TTL
                    return cluster
                return redis_client.Redis.from_url(self._url, **self._connection_options())
            except ERRORS as exc:
                refusals += 1
                delay = self._move_delay(exc, refusals, deadline)
                if delay is None:
                    raise wrap(exc, self._where) from exc
                time.sleep(delay)
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(f"bad Redis URL or option: {exc}") from exc

    def _keys(self, name: str) -> Keys:
        return _keys(self._prefix, name)

    def _call(
        self,
        script: scripts.Script,
        keys: Sequence[bytes],
        args: Sequence[Any],
        *,
        ride_out: bool = True,
    ) -> Any:
        """EVALSHA, falling back to EVAL when the server forgot the script (restart,
        failover, SCRIPT FLUSH); EVAL caches it again for the next call.

        A cluster that refused it before running it, moving the name's slot, is asked
        again a while (see ``_rode_out``), unless ``ride_out`` is False: an acquire that
        is no re-entry, whose waiter's attempt is answered busy and tries again within
        its wait's own timeout, and whose try answers at once (see ``acquire``)."""
        deadline = math.inf  # set at the first refusal: nothing to do on the usual path
        refusals = 0
        while True:
            if self._closed and script in GIVE_BACKS:
                return self._give_back_when_closed(script, keys, args)
            client = self._get_client()
            try:
                try:
                    return self._run(client, "EVALSHA", script.sha, len(keys), *keys, *args)
                except NoScriptError:
                    return self._run(client, "EVAL", script.source, len(keys), *keys, *args)
            except ERRORS as exc:
                refusals += 1
                if refusals == 1:
                    deadline = time.monotonic() + self._ride_out_bound()
                if not (ride_out and self._rode_out(exc, refusals, deadline)):
                    raise wrap(exc, self._where_for(client, keys)) from exc

    def _where_for(self, client: Any, keys: Sequence[bytes]) -> str:
        """Where a call on ``keys`` went: on a cluster, the node that serves their slot
        as the client maps it now, after the seed. The seed alone named a node that may
        be fine while another was paused or down (a chaos helper's reading)."""
        if not self._cluster or not keys:
            return self._where
        try:
            node = client.get_node_from_key(keys[0]).name
        except ERRORS:
            return self._where
        return f"{self._where} (the node serving the name: {node})"

    def _ride_out_bound(self) -> float:
        """Seconds a call may spend riding out a slot move: the read timeout that already
        bounds each of its round trips (``socket_timeout``, 5 s unless set), so that a
        move costs a caller no more time than a server slow to answer may. A client given
        with ``client=`` has its own, which is not read here: SOCKET_TIMEOUT then."""
        bound = self._connection_options().get("socket_timeout")
        return SOCKET_TIMEOUT if bound is None else float(bound)

    def _rode_out(self, error: BaseException, refusals: int, deadline: float) -> bool:
        """After ``error``, the ``refusals``-th in a row of one call: True once this has
        waited to send the same script again, as the cluster refused it before running
        it, moving the name's slot (``moving``), and a wait (``moving_delay``) still
        ends before ``deadline`` (``time.monotonic()``). False for any other error: a
        script cut short by the move (CUT_SHORT_BY_THE_CLUSTER) ran in part, and one
        whose reply was lost may have run; neither is sent again. A single server
        (Redlock's masters among them) never moves a slot."""
        delay = self._move_delay(error, refusals, deadline)
        if delay is None:
            return False
        sleep(delay)
        return True

    def _move_delay(self, error: BaseException, refusals: int, deadline: float) -> float | None:
        """How long to wait before asking again after ``error``, the ``refusals``-th in
        a row: None unless a cluster refused, moving a slot, and the wait still ends
        before ``deadline``."""
        if not self._cluster or not moving(error):
            return None
        delay = moving_delay(refusals)
        return delay if time.monotonic() + delay <= deadline else None

    def _give_back_when_closed(
        self, script: scripts.Script, keys: Sequence[bytes], args: Sequence[Any]
    ) -> Any:
        """A release or a queue's leave after close(): a wait that the close cut off
        leaves its place, and gives back a lease a release handed to it meanwhile,
        or the name stays taken for the lease's TTL. Sent on a connection of its own,
        closed at once, as nothing would close it later (a caller's client stays theirs;
        a bounded twin of it is made again, as the close closed it)."""
        if self._owns_client:
            client = self._open_client()
        elif self._twin_timeout is not None:
            client = _bounded_twin(self._given, self._twin_timeout)
        else:
            client = self._client
        try:
            return self._execute(client, "EVAL", script.source, len(keys), *keys, *args)
        except ERRORS as exc:
            raise wrap(exc, self._where) from exc
        finally:
            if self._owns_client or self._twin_timeout is not None:
                with suppress(*ERRORS, OSError):
                    client.close()

    def _run(self, client: Any, *command: Any) -> Any:
        """One command, on a connection of our own where we keep them (see _Connections)."""
        connections = self._connections
        if connections is None:
            return self._execute(client, *command)
        (answer,) = self._run_many(connections, [_wire(command)])
        if isinstance(answer, ResponseError):
            raise answer
        return answer

    def _execute(self, client: Any, *command: Any) -> Any:
        """A script call (``EVAL[SHA] script numkeys key ...``) through redis-py's own
        path. On a cluster it goes to the node that serves its first key's slot, named
        here: redis-py then retries nothing (a given client's retries would run a script
        again whose first reply was lost), while it still follows MOVED and ASK, which
        no script ran before."""
        if not self._cluster:
            return client.execute_command(*_wire(command))
        if IS_ASYNC:
            client.initialize()  # the sync face's client maps slots as it is made
        node = client.get_node_from_key(command[3])
        with torn_connections_lost():
            return client.execute_command(*_wire(command), target_nodes=node)

    def _call_many(
        self,
        script: scripts.Script,
        calls: Sequence[tuple[Sequence[bytes], Sequence[Any]]],
        deadline: float | None = None,
    ) -> list[Any]:
        """Many calls of one script in one pipeline: one round trip per server. Those a
        cluster refused, moving their slot, are sent again until ``deadline`` (default:
        the ride-out bound from now; ``list`` gives the one its SCAN began)."""
        if not calls:
            return []
        client = self._get_client()
        if deadline is None:
            deadline = time.monotonic() + self._ride_out_bound()
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        refusals = 0
        while todo:
            try:
                sent = [calls[i] for i in todo]
                answers = self._pipeline(client, "EVALSHA", script.sha, sent)
                missing = [j for j, got in enumerate(answers) if isinstance(got, NoScriptError)]
                if missing:
                    again = self._pipeline(
                        client, "EVAL", script.source, [sent[j] for j in missing]
                    )
                    for j, answer in zip(missing, again, strict=True):
                        answers[j] = answer
            except ERRORS as exc:
                raise wrap(exc, self._where) from exc
            for i, answer in zip(todo, answers, strict=True):
                results[i] = answer
            # Those a cluster refused before running them (moving their slot) are sent
            # again, as by _call; the others have their answers.
            refused = [i for i in todo if moving(results[i])]
            refusals += 1
            if not refused or not self._rode_out(results[refused[0]], refusals, deadline):
                break
            todo = refused
        for result in results:
            if isinstance(result, ERRORS):
                raise wrap(result, self._where) from result
            if isinstance(result, Exception):
                raise BackendError(f"Redis {self._where}: {result!r}") from result
        return results

    def _pipeline(
        self,
        client: Any,
        command: str,
        script: str,
        calls: Sequence[tuple[Sequence[bytes], Sequence[Any]]],
    ) -> list[Any]:
        commands = [_wire((command, script, len(keys), *keys, *args)) for keys, args in calls]
        if self._connections is not None:
            return self._run_many(self._connections, commands)
        pipe = client.pipeline(transaction=False)
        for wired in commands:
            pipe.execute_command(*wired)
        with torn_connections_lost():
            return list(pipe.execute(raise_on_error=False))

    def _run_many(self, connections: _Connections, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Commands in one round trip on a connection of our own (see _Connections), an
        error reply as its answer (a whole reply was read: the connection stays usable).
        Not redis-py's pipeline for renewals: redis-py 8's pool skipped its check for a
        socket the server closed while its maintenance notifications were on (its
        default), and lent a dead connection to the renewal after each restart or
        ``CLIENT KILL``."""
        connection = connections.take()
        try:
            connection.send_packed_command(connection.pack_commands(commands))
            answers: list[Any] = []
            for _ in commands:
                try:
                    answers.append(connection.read_response())
                except ResponseError as exc:
                    answers.append(exc)
            return answers
        except BaseException:
            # Cut off before the replies were read (timeout, cancellation): a later
            # caller must not read them as its own.
            connection.disconnect()
            raise
        finally:
            if self._closed:
                connection.disconnect()
            else:
                connections.give_back(connection)

    def acquire(
        self,
        name: str,
        token: str,
        ttl: float,
        holder: Holder,
        reentrant: bool,
        *,
        keep_place: bool = False,
    ) -> Acquired | Busy:
        if self._leaving:
            # Not a leave of an earlier event loop, or of the parent process: it will
            # not end here.
            self._follow_fork()  # first: a parent's, kept as its own (see _forget_parent)
            self._follow_loop()
            if (leaving := self._leaving.get(token)) is not None:
                # This token's earlier wait is still leaving the queue: sent after this
                # attempt, its leave would take the place this attempt takes and give
                # back the lease it gets.
                leaving.wait(None)
        k = self._keys(name)
        ttl_ms = _ms(ttl)
        waiting = self._waiting.get(token)
        attempt = 0
        if waiting is not None:
            attempt = waiting.attempt = next(self._attempt_numbers)
        args = (
            token,
            ttl_ms,
            holder.to_json(),
            "1" if reentrant else "0",
            self._queue_ttl_ms,
            "1" if keep_place else "0",
            "" if waiting is None else waiting.arrival,
            attempt,
            # A lease handed to a waiter lasts no longer than its place in the queue.
            min(ttl_ms, self._queue_ttl_ms),
        )
        # A call cut off mid-flight may have been granted: the core gives the lease back.
        try:
            # A re-entry (``reentrant``: a fresh acquire never re-enters) rides out a slot
            # move within _call, as a release does; a waiter's attempt is answered busy
            # below, and waits within its own timeout; a try (timeout=0) says so now: it
            # asked not to wait, and a caller who would wait gives a timeout.
            result = self._call(scripts.ACQUIRE, k.queued(), args, ride_out=reentrant)
        except BackendUnavailable as exc:
            if waiting is None:
                raise
            if not moving(exc.__cause__):
                waiting.unanswered = True
                raise
            # Refused before the script ran (a resharding moves the name's slot): no
            # lease to give back, nor place taken. A blocking acquire waits a while and
            # tries again, within its own timeout, rather than fail. The number this
            # attempt took stays the latest: a grant made for the one before may have
            # been made before this one was sent, the moment the core counts it from.
            waiting.refused += 1
            return Busy(retry_after=moving_delay(waiting.refused))
        granted = int(result[0]) == 1
        if waiting is not None:
            waiting.refused = 0
            waiting.unanswered = False
            waiting.left = granted and bool(int(result[3]))
        if granted:
            return Acquired(fencing_token=int(result[1]), count=int(result[2]))
        left = int(result[1])
        return Busy(retry_after=left / 1000 if left >= 0 else None)

    def handed_over(self, token: str, message: bytes) -> Acquired | None:
        """The lease a release handed to waiter ``token`` ("attempt fence lease_ms"), if
        it answers the waiter's latest attempt; the waiter then has left the queue."""
        try:
            attempt, fence, lease_ms = (int(part) for part in message.split())
        except ValueError:
            return None
        waiting = self._waiting.get(token)
        if waiting is None or attempt != waiting.attempt:
            return None
        waiting.left = True
        return Acquired(fencing_token=fence, count=1, ttl=lease_ms / 1000)

    def _hand_over_flag(self) -> str:
        return "1" if self.hand_over else "0"

    def release(self, name: str, token: str) -> int | None:
        k = self._keys(name)
        args = (token, k.wake, self._hand_over_flag())
        left = int(self._call(scripts.RELEASE, k.queued(), args))
        return None if left < 0 else left

    def release_waking(self, name: str, token: str) -> tuple[int | None, str | None]:
        """release(), and the waiter its release woke here, if any (for Redlock)."""
        k = self._keys(name)
        args = (token, k.wake, self._hand_over_flag(), "1")
        left, woke = self._call(scripts.RELEASE, k.queued(), args)
        return (None if int(left) < 0 else int(left)), _text(woke)

    def wake(self, name: str, token: str) -> None:
        """Wake ``token``'s waiter on ``name`` here, where it listens (for Redlock)."""
        self._call(scripts.WAKE, (), (self._keys(name).wake + token.encode(),))

    def extend(self, name: str, token: str, ttl: float) -> bool:
        return bool(int(self._call(scripts.EXTEND, (self._keys(name).lease,), (token, _ms(ttl)))))

    def extend_many(self, leases: Sequence[Lease]) -> list[bool | None]:
        calls = [((self._keys(x.name).lease,), (x.token, _ms(x.ttl))) for x in leases]
        if self._cluster and calls:
            wait = min(NODE_WAIT * min(x.ttl for x in leases), self._ride_out_bound())
            return self._extend_by_node(calls, wait)
        return [bool(int(r)) for r in self._call_many(scripts.EXTEND, calls)]

    def _extend_by_node(
        self, calls: Sequence[tuple[Sequence[bytes], Sequence[Any]]], wait: float
    ) -> list[bool | None]:
        """A cluster's renewal, one pipeline per node (as redis-py's would send), sent to
        every node at once and waited for at most ``wait`` seconds. A node that cannot be
        reached or does not answer by then (paused, partitioned), or a slot nobody serves,
        leaves its leases unknown (None) rather than failing or holding up those of the
        nodes that answer. Raises if none answers."""
        client = self._get_client()
        groups: dict[str | None, list[int]] = {}
        deadline = time.monotonic() + wait
        refusals = 0
        try:
            while IS_ASYNC:
                try:
                    client.initialize()  # the sync face's client maps slots as it is made
                    break
                except ERRORS as exc:
                    # Nodes that disagree about the slots, before anything is sent.
                    refusals += 1
                    if not self._rode_out(exc, refusals, deadline):
                        raise
            for i, (keys, _) in enumerate(calls):
                try:
                    node = client.get_node_from_key(keys[0]).name
                except SlotNotCoveredError:
                    node = None
                groups.setdefault(node, []).append(i)
        except ERRORS as exc:
            raise wrap(exc, self._where) from exc
        nodes = [node for node in groups if node is not None]
        batches = [[calls[i] for i in groups[node]] for node in nodes]
        answers = concurrently(
            [partial(self._call_many, scripts.EXTEND, batch, deadline) for batch in batches],
            max(0.0, deadline - time.monotonic()),
        )
        results: list[bool | None] = [None] * len(calls)
        failure: BackendError | None = None
        for node, answer in zip(nodes, answers, strict=True):
            indices = groups[node]
            if answer is None:  # no answer in time
                failure = failure or BackendUnavailable(
                    f"Redis {self._where} (node {node}): no answer to the renewal within"
                    f" {wait:.3f} s"
                )
            elif isinstance(answer, BackendUnavailable):
                failure = answer
            elif isinstance(answer, Exception):
                raise answer
            else:
                for i, extended in zip(indices, answer, strict=True):
                    results[i] = bool(int(extended))
        if failure is not None and all(result is None for result in results):
            raise failure
        return results

    def _listen_on(self, channel: bytes) -> str | None:
        """The URL of the server to subscribe to ``channel`` on; None for a given client,
        whose own pub/sub picks it. On a cluster, the node that serves the name's slot
        by the client's map: a classic PUBLISH reaches every node, but the seed node of
        the URL may be down while the name's node serves the lock and publishes its
        releases."""
        if self._url is None or not self._cluster:
            return self._url
        client = self._get_client()
        if IS_ASYNC:
            client.initialize()  # the sync face's client maps slots as it is made
        node = client.get_node_from_key(channel)
        return _with_server(self._url, node.host, node.port)

    def _new_pubsub(self, url: str | None) -> Any:
        """A pub/sub connection to ``url`` (see _listen_on)."""
        self._follow_fork()  # first: a parent's, kept as its own (see _forget_parent)
        self._follow_loop()
        with self._creating:
            self._check_open()
            if url is None:
                return self._client.pubsub()
            if url not in self._subscribers:
                options = self._connection_options()
                self._subscribers[url] = redis_client.Redis.from_url(url, **options)
            return self._subscribers[url].pubsub()

    @contextmanager
    def waiter(self, name: str, token: str) -> Iterator[Waiter]:
        self.enqueue(name, token, "now")
        try:
            with self.subscription(name, token) as waiter:
                yield waiter
        except Cancelled:
            # The caller sees its cancellation at once: the leave goes on by itself,
            # as it does when the caller is cancelled again while it waits for it (the
            # token's next attempt waits for it). Awaited, it held the cancellation up
            # for its whole timeout on a server that does not answer.
            self._leave_later(name, token)
            raise
        finally:
            self.dequeue(name, token)

    def _leave_later(self, name: str, token: str) -> None:
        leaving = self._start_leaving(token)
        if leaving is not None:
            run_detached(partial(self._leave, name, token, *leaving), self._leaves, "dlock-leave")

    def enqueue(self, name: str, token: str, arrival: str) -> None:
        """Queue ``token`` with its acquire attempts (the core makes one right after
        entering the waiter), not a round trip of its own; ``arrival`` orders the queue
        ("now": the server's clock)."""
        self._waiting[token] = _Waiting(arrival)

    def dequeue(self, name: str, token: str) -> None:
        """Leave the queue. If this fails, the place lapses by itself after queue_ttl.

        Run to its end even if the waiter is cancelled again meanwhile (asyncio: an
        ``asyncio.timeout``, then its TaskGroup or its caller): cut off, the leave would
        leave the place, and a lease a release handed to it, to keep the others out
        until they lapse. The caller still sees the cancellation at once; the leave is
        bounded by queue_ttl, after which the place has lapsed anyway, and the token's
        next attempt waits for it (see acquire)."""
        leaving = self._start_leaving(token)
        if leaving is not None:
            shielded(self._leave(name, token, *leaving))

    def _start_leaving(self, token: str) -> tuple[WakeupEvent, int, bool] | None:
        """Take ``token``'s wait off the books, its leave now on its way (the token's
        next attempt waits for it, see acquire); None if it has no place to leave.
        Not a coroutine: Redlock starts every master's leave at once, before its waiter
        is cancelled again, so that a next wait of the token is ordered after all of
        them (see RedlockBackend.waiter). ``_leave`` or ``_end_leaving`` follows,
        with what is returned here: the event, the number of the wait's latest attempt
        and whether that attempt got no answer."""
        waiting = self._waiting.pop(token, None)
        if waiting is None or waiting.left:
            return None
        left = self._leaving[token] = WakeupEvent()
        return left, waiting.attempt, waiting.unanswered

    def _end_leaving(self, token: str, left: WakeupEvent) -> None:
        """The leave ``left`` has ended (or will never be sent): the token's next attempt
        goes on."""
        if self._leaving.get(token) is left:
            del self._leaving[token]
        left.set()

    def _leave(
        self, name: str, token: str, left: WakeupEvent, attempt: int, unanswered: bool
    ) -> Left:
        """DEQUEUE: whether the server answered, and whom it woke. ``attempt``, the
        wait's latest, names the only hand-over it may give back: one that arrives late
        (after it got no answer, and the token held the lock again) must leave that hold
        alone.

        After an attempt that got no answer (``unanswered``: the server paused, hung or
        cut off) the caller waits for the leave only briefly: it is on its way to an
        error that has waited out one timeout already, and a second would double how
        late it comes. The leave goes on meanwhile (asyncio: cut off; sync: in its
        thread, the token's next attempt waiting for it); sent on a connection the
        server has not yet answered, it often never arrives, and the place lapses by
        itself (see docs/redis.md)."""
        send = partial(self._send_leave, name, token, left, attempt)
        if not unanswered:
            return send()
        outcome = (concurrently([send], LEAVE_AFTER_SILENCE))[0]
        return outcome if isinstance(outcome, Left) else Left(answered=False)

    def _send_leave(self, name: str, token: str, left: WakeupEvent, attempt: int) -> Left:
        """Send DEQUEUE once. A cluster that refuses it before running it (down, or
        moving the name's slot) gets it again in the background (``_leave_once_served``)
        while the caller goes on: ridden out here, a waiter's timeout was overrun by up
        to the read timeout (5 s) during a slot move; and a leave refused and dropped
        left the place in the line, which the next release handed the lease to, and
        the name stayed free for nobody until the place lapsed (queue_ttl; a chaos
        helper's run: 3.5-4.8 s on names of healthy masters, while another master's
        failure had the whole cluster answer CLUSTERDOWN)."""
        k = self._keys(name)
        args = (token, k.wake, self._hand_over_flag(), attempt)
        until = time.monotonic() + self._queue_ttl_ms / 1000
        again = False
        try:
            woke = call_with_timeout(
                self._call(scripts.DEQUEUE, k.queued(), args, ride_out=False),
                self._queue_ttl_ms / 1000,
            )
        except (BackendError, TimeoutError) as exc:
            again = self._cluster and _refused_before_running(exc.__cause__)
            if again:
                leave = partial(self._leave_once_served, k, token, args, left, until)
                run_detached(leave, self._leaves, "dlock-leave")
            return Left(answered=False)
        finally:
            if not again:
                self._end_leaving(token, left)
        return Left(answered=True, woke=_text(woke))

    def _leave_once_served(
        self, k: Keys, token: str, args: Sequence[Any], left: WakeupEvent, until: float
    ) -> None:
        """Send a leave that the cluster refused before running it again, after a short
        wait (``moving_delay``), until it runs, or is refused otherwise, or its place
        has lapsed anyway (``until``). The token's next attempt waits for it meanwhile
        (see acquire): sent after that attempt, it would take the place of its wait."""
        refusals = 1
        try:
            while (delay := moving_delay(refusals)) < until - time.monotonic():
                sleep(delay)
                try:
                    call_with_timeout(
                        self._call(scripts.DEQUEUE, k.queued(), args, ride_out=False),
                        max(0.0, until - time.monotonic()),
                    )
                    return
                except (BackendError, TimeoutError) as exc:
                    if not _refused_before_running(exc.__cause__):
                        return
                refusals += 1
        finally:
            self._end_leaving(token, left)

    @contextmanager
    def subscription(self, name: str, token: str) -> Iterator[Waiter]:
        """A waiter woken by releases of ``name`` on ``token``'s own channel.

        It subscribes at its first wait, unless an idle connection is still subscribed
        to the channel (a lock object that waits again soon, the usual case under
        contention): that one listens from the start.
        """
        channel = self._keys(name).wake + token.encode()
        waiter = _PubSubWaiter(
            self, self._take_idle(channel, subscribed_only=True)[0], channel, token
        )
        try:
            yield waiter
        finally:
            if waiter.pubsub is not None:
                self._put_back(waiter.pubsub, channel, waiter)

    def subscribe(self, channel: bytes) -> Any:
        """A pub/sub connection subscribed to ``channel``."""
        self._unsubscribe_lingering()
        pubsub, subscribed = self._take_idle(channel)
        try:
            if pubsub is None:
                pubsub = self._new_pubsub(self._listen_on(channel))
            if subscribed != channel:
                if subscribed is not None:
                    pubsub.unsubscribe(subscribed)
                pubsub.subscribe(channel)
        except BaseException:
            if pubsub is not None:
                self._aclose_quietly(pubsub)
            raise
        return pubsub

    def _take_idle(self, channel: bytes, subscribed_only: bool = False) -> tuple[Any, bytes | None]:
        """An idle pub/sub connection, preferably one still subscribed to ``channel``."""
        self._follow_fork()  # first: a parent's, kept as its own (see _forget_parent)
        self._follow_loop()
        with self._creating:
            index = next((i for i, entry in enumerate(self._idle) if entry[1] == channel), None)
            if index is None:
                if subscribed_only or not self._idle:
                    return None, None
                index = len(self._idle) - 1
            pubsub, subscribed, _ = self._idle.pop(index)
            return pubsub, subscribed

    def _put_back(self, pubsub: Any, channel: bytes, waiter: _PubSubWaiter) -> None:
        # The subscription lingers for a moment: a process that waits on the same name
        # again (the usual case under contention) skips UNSUBSCRIBE and SUBSCRIBE, which
        # would otherwise sit between a wake-up and the caller getting the lock.
        with self._creating:
            keep = not waiter.broken and not self._closed
            if keep and len(self._idle) < IDLE_SUBSCRIBERS:
                self._idle.append((pubsub, channel, time.monotonic()))
                return
        self._aclose_quietly(pubsub)

    def _unsubscribe_lingering(self) -> None:
        """Stop idle subscriptions older than LINGER, so idle connections do not keep
        collecting other clients' wake-ups. Runs when a wait begins: a process that
        stops waiting keeps up to IDLE_SUBSCRIBERS subscribed until it waits again or
        closes the client."""
        self._follow_fork()  # first: a parent's, kept as its own (see _forget_parent)
        self._follow_loop()
        cutoff = time.monotonic() - LINGER
        with self._creating:
            stale = [entry for entry in self._idle if entry[1] is not None and entry[2] < cutoff]
            for entry in stale:
                self._idle.remove(entry)
        for i, (pubsub, channel, since) in enumerate(stale):
            try:
                pubsub.unsubscribe(channel)
            except (*ERRORS, OSError):
                pass  # closed below
            except BaseException:
                # Cut off (a cancellation): out of the idle list, the connection would
                # stay open and subscribed, closed by nobody until the client closes,
                # and so would the ones not reached yet. Its reply may still come, so
                # it is closed, even if cancelled again; those go back as they were.
                shielded(self._drop_cut_off([pubsub], stale[i + 1 :]))
                raise
            else:
                with self._creating:
                    if not self._closed:
                        self._idle.append((pubsub, None, since))
                        continue
            try:
                self._aclose_quietly(pubsub)
            except BaseException:
                # Cancelled while it closes (the close goes on, shielded): the ones not
                # reached yet go back as they were, as above.
                shielded(self._drop_cut_off([], stale[i + 1 :]))
                raise

    def _drop_cut_off(self, closing: list[Any], rest: list[tuple[Any, bytes | None, float]]) -> int:
        """Close ``closing`` (a connection whose UNSUBSCRIBE was cut off), and keep
        ``rest`` idle as they were (those there is no room for, or all once closed, are
        closed too). Returns how many were closed."""
        closing = list(closing)
        with self._creating:
            for entry in rest:
                if not self._closed and len(self._idle) < IDLE_SUBSCRIBERS:
                    self._idle.append(entry)
                else:
                    closing.append(entry[0])
        for connection in closing:
            self._aclose_quietly(connection)
        return len(closing)

    def raise_fence(self, name: str, token: str, floor: int) -> bool:
        """Redlock: lift this server's counter to ``floor``; True if ``token`` still holds."""
        k = self._keys(name)
        return bool(int(self._call(scripts.RAISE_FENCE, (k.lease, k.fence), (token, floor))))

    @staticmethod
    def _aclose_quietly(closable: Any) -> None:
        """Close a client or pub/sub connection; a broken one is closed enough.

        To its end even if the caller is cancelled meanwhile (which it still sees): a
        close is often the clean-up of a cancelled wait, and cut off by a second
        cancellation it left the connection open (a pub/sub one still subscribed),
        checked out of its pool, closed by nobody until the client closed."""
        shielded(_close_quietly(closable))

    def _info(self, name: str, reply: Any) -> LockInfo | None:
        if not reply:
            return None
        fence, count, holder, left, *waiting = reply
        return LockInfo(
            name=name,
            fencing_token=int(fence),
            holder=Holder.from_json(holder),
            expires_in=int(left) / 1000 if int(left) >= 0 else None,
            count=int(count),
            waiters=tuple(Holder.from_json(waiter) for waiter in waiting),
        )

    def _inspected(self, name: str) -> tuple[bytes, ...]:
        """The keys INSPECT reads: the lease, and the queue of its waiters."""
        k = self._keys(name)
        return (k.lease, k.queue, k.qexp, k.info)

    def inspect(self, name: str) -> LockInfo | None:
        return self._info(name, self._call(scripts.INSPECT, self._inspected(name), ()))

    def _scan_names(self, prefix: str, deadline: float) -> list[str]:
        """Names of leases under ``prefix``: SCAN (never KEYS), on every cluster master.

        A SCAN the cluster refused, moving slots (redis-py mapping them while the nodes
        disagree about some, a resharding's news spreading), starts over after the
        waits of ``_rode_out``, until ``deadline``, as ``_call`` sends a script again:
        a SCAN only reads, so what a refused one had read is just dropped."""
        head = self._prefix + b":{n:"
        tail = b"}:lease"
        escaped = b"".join(
            b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c])
            for c in head + prefix.encode("utf-8")
        )
        refusals = 0
        while True:
            names: set[str] = set()
            try:
                for key in self._scan(self._get_client(), escaped + b"*" + tail):
                    raw = _bytes(key)
                    if raw.startswith(head) and raw.endswith(tail):
                        names.add(name_from_bytes(raw[len(head) : -len(tail)]))
                return sorted(names)
            except ERRORS as exc:
                refusals += 1
                if not self._rode_out(exc, refusals, deadline):
                    raise wrap(exc, self._where) from exc

    def _scan(self, client: Any, match: bytes) -> list[Any]:
        """The keys matching ``match``, by SCAN on each master. Not redis-py's
        ``scan_iter``: it sends the cursor and count as ints, which hiredis converts in C,
        where a Ctrl-C crashes the interpreter (see ``_wire``)."""
        if not self._cluster:
            return self._scan_node(client, match, {})
        if IS_ASYNC:
            client.initialize()  # the sync face's client maps slots as it is made
        keys: list[Any] = []
        with torn_connections_lost():
            before = self._slot_views(client)
            for _ in range(SCAN_PASSES):
                for node in client.get_primaries():
                    keys += self._scan_node(client, match, {"target_nodes": node})
                if before is None:
                    break  # the cluster does not say: one pass
                after = self._slot_views(client)
                if after == before and not _moving_any(after):
                    break
                before = after
        return keys

    def _slot_views(self, client: Any) -> list[Any] | None:
        """Each master's word on its own slots: config epoch, slots, and the moves it
        is part of (CLUSTER NODES). A pass of SCANs over the masters, one after another,
        misses a key that a resharding MIGRATEs from a master not yet scanned to one
        already scanned; the pass is sound only if no move was under way at its start
        or end and no master's word changed in between (a move that began and ended
        within it bumps the importing master's epoch). None where the cluster does not
        answer CLUSTER NODES (a managed service may rename it): one pass, as before.

        A master serving slots that a master names and the client's map lacks (a node
        added to the cluster: redis-py maps it only once a MOVED sends a command there)
        has the map made again, once: its keys went unscanned, its locks unlisted."""
        read = self._read_slot_views(client)
        if read is not None and read[1]:
            client.nodes_manager.initialize()
            read = self._read_slot_views(client)
        return None if read is None else read[0]

    @staticmethod
    def _read_slot_views(client: Any) -> tuple[list[Any], bool] | None:
        """The masters' words on their slots (see ``_slot_views``), and whether one
        names a master serving slots that ``client`` has not mapped; None if refused."""
        views: list[Any] = []
        unmapped = False
        known = {(node.host, int(node.port)) for node in client.get_primaries()}
        for node in client.get_primaries():
            try:
                answer = client.execute_command("CLUSTER NODES", target_nodes=node)
            except ResponseError:
                return None
            for address, view in answer.items():
                if "myself" in view["flags"]:
                    views.append(
                        (view["node_id"], view["epoch"], view["slots"], view["migrations"])
                    )
                elif _serving_master(view) and not _mapped(address, view, known):
                    unmapped = True
        return views, unmapped

    def _scan_node(self, client: Any, match: bytes, where: dict[str, Any]) -> list[Any]:
        """SCAN one server (on a cluster, the master ``where`` names) to its cursor's end.

        On one server, sent on our kept connections as the lock's commands are: through
        the client's ``scan``, a given client's retries (redis-py 6 and later: three, by
        default) sent a SCAN that timed out again and again, and a list() took the whole
        of a 30 s pause of the server, for a 5 s read timeout."""
        keys: list[Any] = []
        cursor: Any = 0
        while True:
            wired_cursor, wired_match, count = _wire((cursor, match, 1000))
            if self._connections is not None:
                cursor, batch = self._run(
                    client, "SCAN", wired_cursor, "MATCH", wired_match, "COUNT", count
                )
                cursor = int(cursor)  # unparsed: bytes, or str if the client decodes
            else:
                cursor, batch = client.scan(wired_cursor, wired_match, count, **where)
            if isinstance(cursor, dict):  # a cluster client's answer, by node name
                (cursor,) = cursor.values()
            keys += batch
            if cursor == 0:
                return keys

    def list(self, prefix: str) -> list[LockInfo]:
        # One bound for the whole call, as for any other: its SCAN and its INSPECTs.
        deadline = time.monotonic() + self._ride_out_bound()
        names = self._scan_names(prefix, deadline)
        replies = self._call_many(
            scripts.INSPECT, [(self._inspected(name), ()) for name in names], deadline
        )
        infos = (self._info(name, reply) for name, reply in zip(names, replies, strict=True))
        return [info for info in infos if info is not None]

    def force_release(self, name: str) -> bool:
        k = self._keys(name)
        args = (k.wake, self._hand_over_flag())
        return bool(int(self._call(scripts.FORCE_RELEASE, k.queued(), args)))

    def close(self) -> None:
        self._follow_fork()  # what a parent process made is not closed in its child
        self._follow_loop()  # nor what an earlier loop made, in this one
        self._closed = True
        connections, self._connections = self._connections, None
        if connections is not None:
            with suppress(*ERRORS, OSError):
                connections.close()
        idle, self._idle = self._idle, []
        for pubsub, _, _ in idle:
            self._aclose_quietly(pubsub)
        subscribers, self._subscribers = self._subscribers, {}
        for subscriber in subscribers.values():
            self._aclose_quietly(subscriber)
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            self._aclose_quietly(client)
            _disconnect_node_pools(client)
        elif self._twin_timeout is not None:
            self._aclose_quietly(self._client)  # its pool: ours, not the owner's


BACKEND = RedisBackend
