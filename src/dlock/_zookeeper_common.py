"""The ZooKeeper backend's face-independent parts, written once for both faces.

kazoo is synchronous: its connection thread sends the requests and sets their
results, and the two faces differ only in how they wait for one (``wait_result`` in
``_primitives``). So all that runs on kazoo's own threads, or does no I/O, is the same
in both: the handler, client and result classes given to kazoo, the logger adapter that
learns from kazoo's log why a connection fails and when the server last heard us, the
watch on the node ahead, node names and queue order, option checks and the constants.
It lives here, once, and not in ``_async/backends/zookeeper.py`` and again in its
generated twin, which now hold only what awaits results or takes the face's mutexes:
the backend and its waiter.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import re
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from kazoo.client import KazooClient
from kazoo.exceptions import (
    AuthFailedError,
    BadArgumentsError,
    ConnectionClosedError,
    ConnectionDropped,
    InvalidACLError,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
    RuntimeInconsistency,
    UnimplementedError,
)
from kazoo.handlers.threading import AsyncResult, KazooTimeoutError, SequentialThreadingHandler
from kazoo.hosts import collect_hosts
from kazoo.protocol.serialization import Auth, Create2
from kazoo.protocol.states import EventType, KeeperState, WatchedEvent, ZnodeStat
from kazoo.security import OPEN_ACL_UNSAFE

from ._errors import BackendError, ConfigurationError
from ._options import flag
from ._tls import certificate_refused, load_client_files
from ._types import Holder, LockInfo

logger = logging.getLogger("dlock")

#: Suffix ZooKeeper appends to a sequential node: ten digits.
SEQUENCE_DIGITS = 10
#: A queued node's name ends with the sequence suffix: the parent's count of child
#: creates, a signed 32-bit int, formatted ``%010d``. Past 2**31 - 1 it is negative,
#: as ``-`` and nine or ten digits (see :func:`queue_of`).
QUEUED = re.compile(rf"-(\d{{{SEQUENCE_DIGITS}}}|-\d{{{SEQUENCE_DIGITS - 1},{SEQUENCE_DIGITS}}})$")
#: The count of child creates at which ZooKeeper's sequence numbers stop following the
#: order of creation (see :func:`queue_of`).
LAST_SEQUENCE = 2**31 - 1
#: Characters kept as they are in a node name; everything else is %-escaped UTF-8.
SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
#: A name made only of those characters is its own node name.
PLAIN = re.compile(r"[A-Za-z0-9_-]+")
#: What a suspended connection means for held locks (see docs/zookeeper.md).
SUSPEND_POLICIES = ("session", "lost")
#: How often a renewal waiting for its answer re-checks whether the session was given up.
POLL = 0.05
#: Share of the session timeout a suspended session surely outlives the suspension:
#: kazoo drops a connection after hearing nothing for 2/3 of the session timeout, so
#: the server may expire the session 1/3 of it after we notice; a quarter leaves a
#: margin for scheduling.
SUSPEND_SHARE = 1 / 4
#: Share of the session timeout after the last answered request at which a client whose
#: requests go unanswered (while kazoo still thinks it is connected) gives up its locks.
STALL_SHARE = 3 / 4
#: Share of the session timeout after the server was last heard (our own clients: any
#: reply, kazoo's pings too) at which locks are given up: the server may expire the
#: session a session timeout after it last heard from us; the rest is a margin for
#: scheduling and for the reply's way back.
HEARD_SHARE = 3 / 4
#: What kazoo logs as it sends a request (the connect, a ping, an operation), with the
#: request's xid first among the arguments.
SENDING = "Sending request"
#: What it logs as it reads an answer: to an operation, with the xid first among the
#: arguments; to a ping, to the authentication, to the connect (its ``SENDING`` xid is
#: None). A watch event is not an answer: it says when it was read, not when sent.
ANSWERS = ("Received response", "Received error")
PING_ANSWER, PING_XID = "Received Ping", -2
AUTH_ANSWER, AUTH_XID = "Received AUTH", -4
SESSION_CREATED = "Session created"
#: Where kazoo starts a connection: requests sent on the one before get no answer.
CONNECTING = "Connecting to"
#: What it warns of a host name that does not resolve (the host, then the error), before
#: any connection attempt: that host is skipped.
UNRESOLVED = "Cannot resolve"
#: What kazoo logs, with the traceback, as an error kills its connection thread; the
#: thread then re-raises it, for the interpreter to print once more.
LOOP_DIED = "Unhandled exception in connection loop"
#: A create whose reply was lost and that a search did not find may be applied later
#: all the same (sent on a connection that dropped, it can go on through the ensemble):
#: its node is searched for again every LOST_CREATE_EVERY seconds, until
#: LOST_CREATE_WATCH seconds after that search or after the connection last came back.
LOST_CREATE_EVERY = 1.0
LOST_CREATE_WATCH = 30.0
#: Lock nodes known to exist, so their first-use create is skipped (a bounded cache).
MAX_KNOWN_PARENTS = 10_000
#: Encoded node data kept for reuse (one per holder and TTL in use).
MAX_PAYLOADS = 64
#: The most a renewal's transaction carries (paths and data, with some room per op): far
#: below the 1 MB a server takes in one request (its ``jute.maxbuffer``).
MAX_RENEWAL_BYTES = 256 * 1024

#: The longest session timeout: ZooKeeper counts it in 32-bit milliseconds (kazoo's
#: connection thread dies of a longer one, and the client then never connects).
MAX_SESSION_TIMEOUT = (2**31 - 1) // 1000
#: Characters ZooKeeper refuses in a path (its PathUtils.validatePath).
BAD_PATH_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\uf8ff\ufff0-\uffff]")

#: Options that configure TLS; each needs ``tls=1``.
TLS_OPTIONS = ("ca", "certfile", "keyfile", "keyfile_password", "verify_certs", "check_hostname")

#: Errors that are the server's reply to a request (so it heard us), not a lost one.
SERVER_REPLIES = (NoNodeError, NodeExistsError, NotEmptyError)
#: Errors from kazoo and its threading handler that mean "could not use ZooKeeper".
CLIENT_ERRORS = (KazooException, KazooTimeoutError, OSError, ssl.SSLError)
#: The server answered and refused (credentials, the root's ACL, a path it will not
#: take, a request it does not know): retrying will not help, so not unavailable.
REFUSALS = (NoAuthError, AuthFailedError, BadArgumentsError, InvalidACLError, UnimplementedError)


def _tls_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """kazoo's TLS arguments from the options, checked now: a TLS option without
    ``tls=1``, a key without its certificate, or a file that cannot be loaded would
    otherwise show only as a connection that never comes (kazoo retries until the
    connect timeout) or, worse, as a plaintext or unauthenticated one.
    """
    given = sorted(key for key in TLS_OPTIONS if key in settings)
    if not flag(settings.get("tls", False), "tls"):
        if given:
            raise ConfigurationError(f"zookeeper option(s) {', '.join(given)} need tls=1")
        return {}
    verify_certs = flag(settings.get("verify_certs", True), "verify_certs")
    check_hostname = flag(settings.get("check_hostname", verify_certs), "check_hostname")
    if check_hostname and not verify_certs:
        raise ConfigurationError("check_hostname=1 needs verify_certs=1")
    files: dict[str, str] = {
        key: str(settings[key]) for key in ("ca", "certfile", "keyfile") if key in settings
    }
    if "keyfile" in files and "certfile" not in files:
        raise ConfigurationError("keyfile needs certfile (the client certificate)")
    if "certfile" in files:
        # kazoo ignores a certificate given without a key file: the key is then in it.
        files.setdefault("keyfile", files["certfile"])
    password = settings.get("keyfile_password")
    if password is not None and "certfile" not in files:
        raise ConfigurationError("keyfile_password needs certfile (the client certificate)")
    # Loaded once now (into a context of no use after), to refuse a file now rather
    # than at every connection.
    load_client_files(
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
        "zookeeper",
        ca=files.get("ca"),
        certfile=files.get("certfile"),
        keyfile=files.get("keyfile"),
        password=None if password is None else str(password),
    )
    tls: dict[str, Any] = {
        "use_ssl": True,
        "verify_certs": verify_certs,
        "check_hostname": check_hostname,
        **files,
    }
    if password is not None:
        tls["keyfile_password"] = str(password)
    return tls


def _check_root(root: str) -> None:
    """Refused now, not at first use as kazoo's bare ValueError or the server's refusal:
    a relative, empty or otherwise invalid segment."""
    if root == "/":
        return
    if not root.startswith("/") or root.endswith("/"):
        raise ConfigurationError(f"root {root!r} must be an absolute ZooKeeper path")
    if any(segment in ("", ".", "..") for segment in root[1:].split("/")):
        raise ConfigurationError(f"root {root!r} has an empty, '.' or '..' segment")
    bad = BAD_PATH_CHARS.search(root)
    if bad:
        raise ConfigurationError(f"root {root!r}: ZooKeeper refuses the character {bad[0]!r}")


def _check_hosts(hosts: str) -> None:
    """kazoo reads the host list only when connecting, and says what is wrong with it
    by a bare ValueError then."""
    for host in hosts.split(","):
        try:
            # kazoo takes port 0 and an empty port for the default, 2181.
            port = urlsplit(f"//{host}").port
            if port == 0 or (port is None and host.rstrip().endswith(":")):
                raise ValueError
        except ValueError:
            unbracketed = host.count(":") > 1 and "[" not in host
            hint = " (an IPv6 address is written in brackets, [::1]:2181)" if unbracketed else ""
            raise ConfigurationError(
                f"bad ZooKeeper host list {hosts!r}: bad port in {host!r}{hint}"
            ) from None
    try:
        collect_hosts(hosts)
    except ValueError as exc:
        raise ConfigurationError(f"bad ZooKeeper host list {hosts!r}: {exc}") from exc


def encode_name(name: str) -> str:
    """A node name for any lock name: '/' and NUL cannot appear, nor '.' alone."""
    if PLAIN.fullmatch(name):
        return name
    return "".join(
        char if char in SAFE else "".join(f"%{byte:02X}" for byte in char.encode()) for char in name
    )


def decode_name(node: str) -> str:
    return unquote(node, errors="strict")


def sequence_of(child: str) -> int:
    match = QUEUED.search(child)
    assert match is not None
    return int(match[1])


def queued(children: list[str]) -> list[str]:
    """The queued nodes among a lock node's children, in no order.

    Other children are not dlock's: at root '/', ZooKeeper's own /zookeeper node has
    children ('config', 'quota') and a name 'zookeeper' would meet them.
    """
    return [child for child in children if QUEUED.search(child)]


def creates_of(stat: ZnodeStat) -> int:
    """How many children were ever created under a node: the counter that numbers its
    sequential children. ZooKeeper shows clients ``cversion`` as twice that, less the
    children left (each create but theirs was followed by a delete), in 32 bits."""
    changes: int = stat.cversion + stat.numChildren
    return (changes % 2**32) // 2


def queue_of(children: list[str], stat: ZnodeStat) -> list[str] | None:
    """The queued nodes among a lock node's children, in order, from a listing that
    read the lock node's ``stat`` with them; None if their sequence numbers may not
    follow the order of creation (the caller then orders them by ``czxid``).

    ZooKeeper numbers a sequential child with its parent's count of child creates, a
    signed 32-bit int that it never lets fall: once the count reaches 2**31 - 1, every
    later child gets 2147483647 again, or, while creates are in flight together,
    -2147483648, -2147483647 and on. Until then (the count read with the children
    is below it) every child listed was numbered before that, each with its own
    number, in the order of creation. A lock node deleted when empty starts again from
    0, but a lock that is never free when the server looks keeps its node, and so does
    a plain persistent one (made by an older dlock): 2**31 attempts get there.

    A negative number in the line means the same whatever the count reads: a server
    that let the count run on past 2**31 - 1 would show it low again (the count is
    shown doubled, in 32 bits), while it numbers children below zero.
    """
    if creates_of(stat) >= LAST_SEQUENCE:
        return None
    line = sorted(queued(children), key=sequence_of)
    if line and sequence_of(line[0]) < 0:
        return None
    return line


@dataclass
class _Node:
    """One queued or held child of this client, keyed by (lock name, owner token)."""

    path: str
    session: int
    czxid: int
    data: dict[str, Any]
    held: bool = False
    #: Monotonic time after which a held lease that was not extended is given up.
    deadline: float = 0.0
    #: The lease ended (reaped, session gone, deleted by someone): never held again.
    gone: bool = False
    #: The node just ahead of this one in its latest listing, and what we know of it.
    ahead: _Ahead | None = None
    #: A listing showed other nodes. Only then can a waiter behind us need to be told
    #: that this node held the lock (see the backend's ``_delete``): a
    #: waiter whose own listing showed nothing ahead of ours knows it already, and
    #: whatever else it saw ahead of ours was created before ours, so our listing (sent
    #: right after our create) saw it too, or saw that waiter.
    contended: bool = False
    #: A listing of the queue sent right behind the create (kazoo's async result).
    listing: Any = None


class _Ahead:
    """The node just ahead of one of ours, as its watches tell us (see docs/zookeeper.md).

    One object per (our node, predecessor): an event is only ever credited to the
    watch that produced it. Its callbacks run on kazoo's threads and never block.
    """

    def __init__(self, path: str, wake: Callable[[], None]) -> None:
        self.path = path
        self._wake = wake
        #: The node was the lowest once, so nothing can be ahead of it any more: a
        #: listing showed it first, or its data was rewritten, which dlock does only
        #: while holding (renewal, re-entry, and the release of a contended lock).
        self.held = False
        self.deleted = False
        #: Watches registered and not fired yet (so not registered again).
        self.watching_data = False
        self.watching_delete = False

    def __repr__(self) -> str:
        flags = [
            f for f in ("held", "deleted", "watching_data", "watching_delete") if getattr(self, f)
        ]
        return f"<_Ahead {self.path!r} {' '.join(flags) or '-'}>"

    def on_event(self, event: WatchedEvent) -> None:
        if event.type == EventType.CHANGED:
            # Nothing to do until the node goes: no need to wake the waiter for this.
            self.held = True
            self.watching_data = False
            return
        if event.type == EventType.DELETED:
            self.deleted = True
            self.watching_data = self.watching_delete = False
        self._wake()


class _Diagnosis:
    """Why a client does not connect: the latest error kazoo reported for each server.

    Written by kazoo's connection thread (which server it is trying, from the handler;
    what failed, from its log), read by the thread waiting for the first session.
    """

    def __init__(self) -> None:
        self.servers: set[tuple[str, int]] = set()
        self.current: tuple[str, int] | None = None
        self.errors: dict[tuple[str, int], BaseException] = {}
        #: Servers that refused the TLS certificates at least once.
        self.refused: set[tuple[str, int]] = set()
        #: When the server last surely heard us (monotonic): when the latest request it
        #: answered was sent, not when its answer was read. An answer read after a
        #: pause (SIGSTOP, GC) may have waited in the socket since before it, while the
        #: server expired the session.
        self.heard_at = 0.0
        #: When each operation that awaits its answer was sent: (xid, time), in the
        #: order sent, which is the order answered on one connection.
        self._sent: deque[tuple[int, float]] = deque()
        #: The same for the connect (xid None), a ping and the authentication, one of
        #: each at a time.
        self._sent_special: dict[int | None, float] = {}
        #: The session timeout the server granted (seconds), once a session is made: a
        #: server clamps the one asked for to its own range (2 to 20 ticks by default).
        self.negotiated: float | None = None

    def sent(self, xid: int | None) -> None:
        if isinstance(xid, int) and xid > 0:
            self._sent.append((xid, time.monotonic()))
        else:
            self._sent_special[xid] = time.monotonic()

    def answered(self, xid: int | None) -> None:
        sent: float | None = None
        if isinstance(xid, int) and xid > 0:
            # Those sent before it were answered before it, some unlogged (an
            # ``exists`` of a missing node): dropped, or they would pile up.
            pending = self._sent
            while pending and pending[0][0] <= xid:
                answered, at = pending.popleft()
                if answered == xid:
                    sent = at
        else:
            sent = self._sent_special.pop(xid, None)
        if sent is not None and sent > self.heard_at:
            self.heard_at = sent

    def connecting(self) -> None:
        """A new connection: the requests still in flight on the last get no answer,
        and xids start again."""
        self._sent.clear()
        self._sent_special.clear()

    def reset(self, servers: Sequence[tuple[str, int]]) -> None:
        self.servers = {(host.strip(), int(port)) for host, port in servers}
        self.current = None
        self.errors = {}
        self.refused = set()

    def attempt(self, server: tuple[str, int]) -> None:
        self.current = server

    def unresolved(self, host: str, error: BaseException) -> None:
        """``host`` has no address (kazoo skips it, before any attempt names a server)."""
        for server in self.servers:
            if server[0] == host.strip():
                self.errors[server] = error

    def failed(self, error: BaseException) -> None:
        server = self.current
        if server is None:
            return
        self.errors[server] = error
        if certificate_refused(error):
            self.refused.add(server)

    def refused_everywhere(self) -> bool:
        return bool(self.servers) and self.servers <= self.refused

    def closed_by_server(self) -> bool:
        """Some server accepted the connection and then closed it without a word (or
        answered nonsense): not one that said nothing in time (paused), whose
        time-out kazoo raises as a KazooTimeoutError."""
        return any(
            isinstance(error, ConnectionDropped) and _cause(error) is None
            for error in self.errors.values()
        )

    def __str__(self) -> str:
        return "; ".join(
            f"{host}:{port}: {_cause(error) or error}"
            for (host, port), error in sorted(self.errors.items())
        )


def _stop_in_background(zk: KazooClient) -> None:
    """Stop and close a client that got no session, without waiting for it: its
    connection thread may be reading a handshake that only the read's own time-out
    ends (a server that accepts and then says nothing: paused), and ``stop`` waits for
    that thread, which cost a connect another connect_timeout."""
    threading.Thread(
        target=lambda: (zk.stop(), zk.close()), name="dlock-zookeeper-stop", daemon=True
    ).start()


def _cause(error: BaseException) -> BaseException | None:
    """The socket or TLS error kazoo wrapped (in ``ConnectionDropped``), if any."""
    return error.__context__


def _without_secrets(arg: object) -> object:
    """What kazoo logs of a request or reply, its secrets masked: it logs them as they
    are, the digest's ``user:password`` (DEBUG) and the session's password (its
    BLATHER level), which let whoever reads the log take the session over."""
    if isinstance(arg, Auth):
        return arg._replace(auth=f"{str(arg.auth).partition(':')[0]}:***")
    if isinstance(arg, tuple) and "passwd" in getattr(arg, "_fields", ()):
        return arg._replace(passwd=b"***")  # type: ignore[attr-defined]
    return arg


class _KazooLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """kazoo's own logger, which also hands each error kazoo warns about (a failed
    connection attempt, mostly) to a :class:`_Diagnosis`: kazoo's ``start`` only ever
    says "Connection time-out", and its log is the one place that says why. It is also
    the one place that says when the server last heard us: when kazoo sent the request
    (a ping too) whose answer it read latest."""

    def __init__(self, diagnosis: _Diagnosis) -> None:
        super().__init__(logging.getLogger("kazoo.client"), {})
        self._diagnosis = diagnosis

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if isinstance(msg, str):
            self._note(msg, args)
            args = tuple(_without_secrets(arg) for arg in args)
        if msg == LOOP_DIED:
            # dlock recovers from it (see the backend's _connect) and says so in one
            # line, from the thread's end (KazooHandler.spawn): no traceback on stderr
            # for it.
            level = logging.DEBUG
        if level >= logging.WARNING:
            for arg in args:
                if isinstance(arg, BaseException):
                    self._diagnosis.failed(arg)
        super().log(level, msg, *args, **kwargs)

    def _note(self, msg: str, args: tuple[object, ...]) -> None:
        """Note a request sent or answered, or a new connection or session."""
        diagnosis = self._diagnosis
        if msg.startswith(SENDING) and args:
            diagnosis.sent(args[0])  # type: ignore[arg-type]
        elif msg.startswith(ANSWERS) and args:
            diagnosis.answered(args[0])  # type: ignore[arg-type]
        elif msg == PING_ANSWER:
            diagnosis.answered(PING_XID)
        elif msg == AUTH_ANSWER:
            diagnosis.answered(AUTH_XID)
        elif msg.startswith(SESSION_CREATED):
            diagnosis.answered(None)
            if len(args) > 2:
                with suppress(TypeError, ValueError):
                    diagnosis.negotiated = float(args[2]) / 1000  # type: ignore[arg-type]
        elif msg.startswith(CONNECTING):
            diagnosis.connecting()
        elif (
            msg.startswith(UNRESOLVED)
            and len(args) > 1
            and isinstance(args[0], str)
            and isinstance(args[1], BaseException)
        ):
            diagnosis.unresolved(args[0], args[1])


class KazooHandler(SequentialThreadingHandler):  # type: ignore[misc]
    """kazoo's threading handler, with less work per request and per hand-off.

    kazoo's own ``select`` builds and closes an epoll selector on every call, and its
    connection thread calls it several times per request: ``poll`` needs no set-up,
    which saves about a third of the client's CPU per request. And the watches on the
    node ahead run on the connection thread instead of being queued for kazoo's
    callback thread: they only record the event and set a wake-up, so a hand-off wakes
    one thread less. dlock uses it for the clients it creates; the benchmarks use it
    for the raw baseline, so that baseline is the same client. It also makes the TLS
    connections (see :func:`_tls_connection`), and tells a :class:`_Diagnosis` which
    server each connection attempt is for.
    """

    def __init__(self, diagnosis: _Diagnosis | None = None) -> None:
        super().__init__()
        self._diagnosis = diagnosis

    def create_connection(
        self,
        address: tuple[str, int],
        hostname: str | None = None,
        timeout: float | None = None,
        use_ssl: bool = False,
        **tls: Any,
    ) -> socket.socket:
        if self._diagnosis is not None:
            self._diagnosis.attempt((hostname or address[0], address[1]))
        if use_ssl:
            return _tls_connection(address, hostname, timeout, **tls)
        connection: socket.socket = super().create_connection(
            address, hostname=hostname, timeout=timeout, **tls
        )
        return connection

    def select(
        self, rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: float | None = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        if not hasattr(select, "poll"):  # Windows
            result: tuple[list[Any], list[Any], list[Any]] = super().select(
                rlist, wlist, xlist, timeout
            )
            return result
        poller = select.poll()
        for item in rlist:
            poller.register(item, select.POLLIN)
        for item in wlist:
            poller.register(item, select.POLLOUT)
        ready = dict(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))
        if not ready:
            return [], [], []
        if any(events & select.POLLNVAL for events in ready.values()):
            # As kazoo's own select does for a closed descriptor: a socket error,
            # which the connection turns into a dropped connection.
            raise OSError(errno.EBADF, "select on a closed file descriptor")
        failed = select.POLLERR | select.POLLHUP
        return (
            [item for item in rlist if ready.get(_fd(item), 0) & (select.POLLIN | failed)],
            [item for item in wlist if ready.get(_fd(item), 0) & (select.POLLOUT | failed)],
            [],
        )

    def spawn(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> threading.Thread:
        """kazoo's threads; its connection thread ends quietly when an error kills it.

        The error has reached the request in flight and the client is closed then
        (kazoo issue 254: see the backend's _call and _connect); the interpreter would
        print its traceback on stderr as well, on top of kazoo's own. (Its queue
        workers, which dlock does not replace, are left as kazoo makes them.)
        """
        if getattr(func, "__name__", None) != "zk_loop":
            return cast(threading.Thread, super().spawn(func, *args, **kwargs))

        def zk_loop() -> None:
            try:
                func(*args, **kwargs)
            except Exception as exc:
                logger.warning(
                    f"dlock: kazoo's connection thread failed ({exc!r}); the next call"
                    " connects anew"
                )

        thread = threading.Thread(target=zk_loop, daemon=True)
        thread.start()
        return thread

    def async_result(self) -> AsyncResult:
        return _InlineResult(self)

    def dispatch_callback(self, callback: Any) -> None:
        if getattr(callback.func, "__func__", None) is _Ahead.on_event:
            try:
                callback.func(*callback.args)
            except Exception:  # the connection thread must carry on (a closed loop)
                logger.debug("dlock: a watch callback failed", exc_info=True)
            return
        super().dispatch_callback(callback)


class _InlineResult(AsyncResult):  # type: ignore[misc]
    """Completion callbacks run where the result is set (the connection thread), not
    on kazoo's completion thread. kazoo chains one for every create (and sync); they
    only pass a result on, so this saves a thread hop per create. Only for dlock's own
    client, whose results nothing else links blocking callbacks to."""

    def _do_callbacks(self) -> None:
        for callback in self._callbacks:
            try:
                callback(self)
            except Exception:  # the connection thread must carry on
                logger.debug("dlock: a completion callback failed", exc_info=True)


def _tls_connection(
    address: tuple[str, int],
    hostname: str | None,
    timeout: float | None,
    *,
    ca: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    keyfile_password: str | None = None,
    verify_certs: bool = True,
    check_hostname: bool = False,
    options: ssl.Options | None = None,
    ciphers: str | None = None,
) -> ssl.SSLSocket:
    """A TLS connection with kazoo's options, where a failed handshake closes its socket.

    kazoo's own leaves it to the garbage collector (it wraps the socket before
    connecting, and ``SSLSocket.connect`` does not close on failure; wrapping a
    connected one does). ``ca`` given, only that CA is trusted, else the system's
    (kazoo trusts both). The files are read at every connection, so renewed
    certificates are used from the next one on.
    """
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = check_hostname
    context.verify_mode = ssl.CERT_REQUIRED if verify_certs else ssl.CERT_NONE
    if options is not None:
        context.options = options
    if ciphers:
        context.set_ciphers(ciphers)
    if certfile:
        context.load_cert_chain(certfile, keyfile, keyfile_password or "")
    raw = socket.create_connection(address, timeout)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return context.wrap_socket(raw, server_hostname=hostname)
    except BaseException:
        raw.close()  # a no-op once the TLS socket took it over (and closed itself)
        raise


def _fd(item: Any) -> int:
    return item if isinstance(item, int) else int(item.fileno())


class _CreateContainer(Create2):  # type: ignore[misc]
    """ZooKeeper's ``createContainer`` request (3.5.3 on; kazoo does not offer it): the
    same fields and reply as ``create2``. The server deletes a container node once
    its last child is gone (it looks every ``znode.container.checkIntervalMs``, a
    minute by default), and never while it has one."""

    __slots__ = ()
    type = 19


#: CreateMode.CONTAINER
CONTAINER = 4


class _KazooClient(KazooClient):  # type: ignore[misc]
    """kazoo's client, but a Ctrl-C stays a Ctrl-C: kazoo's ``_call`` wakes its
    connection thread under a bare ``except:``, so a KeyboardInterrupt raised there (a
    SIGINT handled as the wake-up's send returns) was swallowed and the request failed
    with ConnectionClosedError instead: an acquire went on (retried) and took the lock,
    an ``extend()`` raised BackendUnavailable, a ``release()`` returned. Here only an
    Exception fails the request; anything else leaves it queued (sent with the next
    wake-up or ping, as a request cut off in flight) and goes on out to the caller."""

    def _call(self, request: Any, async_object: Any) -> Any:
        if self._state in (
            KeeperState.AUTH_FAILED,
            KeeperState.CLOSED,
            KeeperState.EXPIRED_SESSION,
        ):
            return super()._call(request, async_object)
        self._queue.append((request, async_object))
        write_sock = self._connection._write_sock
        try:
            write_sock.send(b"\0")
        except Exception:
            async_object.set_exception(ConnectionClosedError("Connection has been closed"))
        return None


def _create_container(zk: KazooClient, path: str) -> AsyncResult:
    """Like ``zk.create_async(path, b"")`` (with the client's ACL), for a container."""
    result: AsyncResult = zk.handler.async_result()
    request = _CreateContainer(
        (zk.chroot or "") + path, b"", zk.default_acl or OPEN_ACL_UNSAFE, CONTAINER
    )
    zk._call(request, result)  # as kazoo's create_async does; on failure, result has it
    return result


def _renewal_chunks(
    rewrites: list[tuple[int, Any, dict[str, Any], bytes]],
) -> list[list[tuple[int, Any, dict[str, Any], bytes]]]:
    """A renewal's rewrites (index, node, data, encoded data), in transactions of at
    most MAX_RENEWAL_BYTES each."""
    chunks: list[list[tuple[int, Any, dict[str, Any], bytes]]] = []
    size = 0
    for rewrite in rewrites:
        cost = len(rewrite[1].path.encode()) + len(rewrite[3]) + 32
        if not chunks or size + cost > MAX_RENEWAL_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(rewrite)
        size += cost
    return chunks


def _refused_ops(results: list[Any]) -> dict[int, BaseException]:
    """The operations a transaction failed on, by position (none: it was applied). The
    others are told as rolled back (before the failure) or not tried (after it)."""
    return {
        position: result
        for position, result in enumerate(results)
        if isinstance(result, Exception)
        and not isinstance(result, (RolledBackError, RuntimeInconsistency))
    }


def _committed(results: list[Any]) -> None:
    """Raise the error of a failed transaction (kazoo returns them as results)."""
    for result in results:
        if isinstance(result, Exception) and not isinstance(
            result, (RolledBackError, RuntimeInconsistency)
        ):
            raise result
    for result in results:
        if isinstance(result, Exception):
            raise result


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def _decoded(node: str) -> str | None:
    try:
        return decode_name(node)
    except UnicodeDecodeError:
        return None  # not a node dlock made


def _info(name: str, entries: list[tuple[bytes, ZnodeStat]]) -> LockInfo:
    """The first node holds the lock; the rest wait in this order."""
    data, stat = entries[0]
    fields: dict[str, Any] = {}
    with suppress(ValueError):
        fields = json.loads(data)
    ttl = fields.get("ttl")
    expires_in = None
    if isinstance(ttl, (int, float)):
        expires_in = max(0.0, ttl - (time.time() - stat.mtime / 1000))
    count = fields.get("count")
    return LockInfo(
        name=name,
        fencing_token=stat.czxid,
        holder=Holder.from_json(data),
        expires_in=expires_in,
        count=count if isinstance(count, int) else 1,
        waiters=tuple(Holder.from_json(waiting) for waiting, _ in entries[1:]),
    )


def _missing_chroot(zk: KazooClient) -> BackendError:
    return BackendError(f"ZooKeeper: the client's chroot {zk.chroot!r} does not exist")
