"""ZooKeeper: the fair lock recipe, with fencing tokens and session loss handled.

Each lock name is a container node under the root (the server deletes it once empty);
each acquisition attempt queues an ephemeral sequential child named after the owner
token. The lowest child holds the lock, every other one watches only its predecessor
(FIFO, no thundering herd), and a crashed holder's child vanishes with its session. The
fencing token is the child's creation zxid, which the ensemble never reuses, even when
the lock's node is deleted and made again.

kazoo is synchronous and there is no maintained asyncio ZooKeeper client, but its
requests are asynchronous underneath: kazoo's connection thread sends them and sets their
results. So the operations are written once, awaiting each result (``wait_result``): the
sync face blocks on it, an asyncio one is woken by the result's callback, without a
worker thread in between. Round trips are pipelined where they can be.
"""

from __future__ import annotations

import builtins
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any
from urllib.parse import unquote, urlsplit

from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import KazooState, KeeperState, ZnodeStat
from kazoo.security import make_acl, make_digest_acl

from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._fork import ForkFollower
from ..._options import bounded_seconds, query_options
from ..._types import Acquired, Busy, Holder, Lease, LockInfo
from ..._zookeeper_common import (
    CLIENT_ERRORS,
    HEARD_SHARE,
    LOST_CREATE_EVERY,
    LOST_CREATE_WATCH,
    MAX_KNOWN_PARENTS,
    MAX_PAYLOADS,
    MAX_SESSION_TIMEOUT,
    POLL,
    REFUSALS,
    SERVER_REPLIES,
    STALL_SHARE,
    SUSPEND_POLICIES,
    SUSPEND_SHARE,
    TLS_OPTIONS,
    KazooHandler,
    _Ahead,
    _check_hosts,
    _check_root,
    _committed,
    _create_container,
    _decoded,
    _Diagnosis,
    _dump,
    _info,
    _KazooClient,
    _KazooLog,
    _missing_chroot,
    _Node,
    _refused_ops,
    _renewal_chunks,
    _stop_in_background,
    _tls_settings,
    encode_name,
    queue_of,
    queued,
)
from .._primitives import (
    Cancelled,
    Mutex,
    WakeupEvent,
    acquire_within,
    current_task,
    join,
    run_blocking,
    run_detached,
    serving,
    shielded,
    sleep,
    spawn,
    wait_result,
)
from ..backend import AsyncBackend, AsyncWaiter

logger = logging.getLogger("dlock")

#: Mutexes a backend spreads its locks' operations over (by lock name and token).
STRIPES = 64


class AsyncZooKeeperWaiter(AsyncWaiter):
    """Woken by the watches on the node ahead (or by a new session)."""

    notifies = True

    def __init__(self) -> None:
        self._event = WakeupEvent()

    def wake(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> None:
        await self._event.wait(timeout)
        self._event.clear()


class AsyncZooKeeperBackend(AsyncBackend):
    queues_waiters = True

    def __init__(
        self,
        hosts: str,
        root: str = "/dlock",
        *,
        session_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        operation_timeout: float = 5.0,
        on_suspend: str = "session",
        auth: tuple[str, str] | None = None,
        tls: dict[str, Any] | None = None,
        client: KazooClient | None = None,
    ) -> None:
        if on_suspend not in SUSPEND_POLICIES:
            raise ConfigurationError(
                f"on_suspend must be {' or '.join(SUSPEND_POLICIES)}, not {on_suspend!r}"
            )
        for label, value in [
            ("session_timeout", session_timeout),
            ("connect_timeout", connect_timeout),
            ("operation_timeout", operation_timeout),
        ]:
            if not (value > 0 and math.isfinite(value)):
                raise ConfigurationError(f"{label} must be a positive number of seconds")
        if session_timeout > MAX_SESSION_TIMEOUT:
            raise ConfigurationError(
                f"session_timeout must be at most {MAX_SESSION_TIMEOUT} seconds"
                " (ZooKeeper counts it in 32-bit milliseconds)"
            )
        _check_root(root)
        if client is None:
            _check_hosts(hosts)
        if auth is not None and not auth[0]:
            raise ConfigurationError("zookeeper credentials need a user name (user:password@)")
        if auth is not None and client is not None:
            # Applying them would change the caller's session for good (add_auth), and
            # our nodes would need an ACL other than the client's default_acl.
            raise ConfigurationError(
                "with client=, credentials are the kazoo client's own (its auth_data and"
                " default_acl): user:password@ in the URL is refused"
            )
        if client is not None:
            # The session is that client's, made with its own timeout: the ensemble may
            # expire it that long after it last heard from us, whatever ours says. The
            # graces below count from the shorter of the two.
            asked = getattr(client, "_session_timeout", None)  # kazoo keeps it in ms
            if isinstance(asked, (int, float)) and asked > 0:
                session_timeout = min(session_timeout, asked / 1000)
            # The URL names none (refused above): errors name the client's ensemble.
            with suppress(AttributeError, TypeError, ValueError):
                hosts = ",".join(f"{host}:{port}" for host, port in client.hosts)
        self._root = "" if root == "/" else root
        self._hosts = hosts
        self._session_timeout = session_timeout
        self._connect_timeout = connect_timeout
        # An answer later than this would come after the stall rule below gave up.
        self._op_timeout = min(operation_timeout, session_timeout * STALL_SHARE)
        self._on_suspend = on_suspend
        self._auth = auth
        self._tls = tls or {}
        self._owns_client = client is None
        #: The client that close() stopped, and the lock that makes it stop once.
        self._stopping = threading.Lock()
        self._stopped: KazooClient | None = None
        self._zk: KazooClient | None = client
        #: A forked child starts a session of its own (``_forget_parent``).
        self._follow_fork = ForkFollower(self._forget_parent)
        self._parents: set[str] = set()
        self._payloads: dict[tuple[Holder, float], tuple[dict[str, Any], bytes]] = {}
        self._renew_now: Callable[[], None] = lambda: None
        self._closed = False
        self._start_over()

    def _start_over(self) -> None:
        """What one process keeps of its session, before the first connection."""
        #: What went wrong connecting, as kazoo reports it (for the clients we create).
        self._diagnosis: _Diagnosis | None = None
        self._start_lock = threading.Lock()
        self._stripes = [Mutex() for _ in range(STRIPES)]
        #: The event loop the stripes were made in (None: the sync face, or not yet).
        self._stripes_loop: object = None
        self._nodes: dict[tuple[str, str], _Node] = {}
        #: Creates whose reply was lost: the node may exist; found by its token prefix.
        self._pending: set[tuple[str, str]] = set()
        #: Those of them looked for in vain, or that their give-back could not look for
        #: (the server did not answer), with when to stop looking (the monotonic
        #: clock): the reaper looks for them again, and deletes them once found.
        self._lost_creates: dict[tuple[str, str], float] = {}
        #: Nodes we gave up but did not delete yet, by path, with their lock's key and
        #: their czxid: the reaper deletes them (only them: see _delete_orphan).
        self._orphans: dict[str, tuple[tuple[str, str], int]] = {}
        #: The reaper should try deleting orphans (one was added, or a connection is back).
        self._orphans_due = False
        #: Waits in progress per (name, token): more than one when threads or tasks
        #: share a lock object, and then they share its node in the queue.
        self._waiters: dict[tuple[str, str], list[AsyncZooKeeperWaiter]] = {}
        #: Leaves of waiters cancelled, going on by themselves (kept from the collector).
        self._leaves: set[Any] = set()
        self._suspended_at: float | None = None
        #: Before the latest request that was answered: the server heard us after this.
        self._heard_at = 0.0
        #: When a reply (a result or a server-side error) last arrived.
        self._answered_at = 0.0
        #: Set when a request went unanswered while kazoo still thought it connected.
        self._stalled_since: float | None = None
        #: When a request last went unanswered: a release sent within an operation
        #: timeout of it would most likely sit out the timeout too.
        self._timed_out_at = -math.inf
        self._connected = threading.Event()
        self._session_id = 0
        self._reaper: Any = None
        self._reaper_lock = threading.Lock()
        self._reaper_wakeup = WakeupEvent()
        #: When the reaper wakes next by itself: a lease ending later needs no wake-up.
        self._reaper_next = float("inf")

    def _forget_parent(self) -> None:
        """In a child after ``os.fork()``, on first use: start a session of its own.

        kazoo's connection thread stayed in the parent, so the inherited client would
        only queue requests that nobody sends; and its session is the parent's, whose
        nodes (the parent's locks) the child must neither renew nor delete. That client
        is dropped as it is: stopping it would wake the parent's thread (through the
        socket pair they share), then wait 10 s for a thread that is not here. A
        caller's client (``client=``) cannot be made again here: using it is refused.
        """
        self._zk = None
        # Perhaps taken by a thread that stayed in the parent, stopping its client.
        self._stopping = threading.Lock()
        self._start_over()

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> AsyncZooKeeperBackend:
        parts = urlsplit(url)
        netloc = parts.netloc
        auth: tuple[str, str] | None = None
        if "@" in netloc:
            credentials, netloc = netloc.rsplit("@", 1)
            user, _, password = credentials.partition(":")
            auth = (unquote(user), unquote(password))
        client = options.pop("client", None)
        if not netloc and client is None:
            raise ConfigurationError(f"{url!r} names no ZooKeeper host")
        settings: dict[str, Any] = query_options(parts.query)
        settings.update(options)
        known = {"session_timeout", "connect_timeout", "operation_timeout", "on_suspend", "tls"}
        unknown = set(settings) - known - set(TLS_OPTIONS)
        if unknown:
            raise ConfigurationError(f"unknown zookeeper option(s): {', '.join(sorted(unknown))}")
        durations = {
            key: bounded_seconds(settings.get(key, default), key)
            for key, default in [
                ("session_timeout", 10.0),
                ("connect_timeout", 5.0),
                ("operation_timeout", 5.0),
            ]
        }
        tls = _tls_settings(settings)
        if client is not None and not isinstance(client, KazooClient):
            raise ConfigurationError("client= must be a kazoo.client.KazooClient")
        if client is not None and tls:
            raise ConfigurationError("with client=, TLS is the kazoo client's own setting")
        if client is not None and netloc:
            # One ensemble named, another used, without a word.
            raise ConfigurationError(
                f"with client=, the ensemble is the kazoo client's own: the URL's hosts"
                f" ({netloc!r}) would be ignored; write it zookeeper:///{parts.path.lstrip('/')}"
            )
        return cls(
            netloc,
            # "/" (a trailing slash) names the default root, as on etcd; "/locks/" is
            # "/locks": two spellings, one lock space.
            unquote(parts.path).rstrip("/") or "/dlock",
            on_suspend=str(settings.get("on_suspend", "session")),
            auth=auth,
            tls=tls,
            client=client,
            **durations,
        )

    # -- connection and session ------------------------------------------------------

    async def _client(self) -> KazooClient:
        """The started client; connecting happens here, on first use. Never once
        closed: a caller's client (``client=``) stays connected, but nothing would
        renew or reap what we made with it then."""
        if self._closed:
            raise BackendError("the ZooKeeper backend is closed")
        # Any operation in a new event loop restarts the reaper there (see _stripes_here).
        self._stripes_here()
        zk = self._zk
        if zk is not None and zk.connected and self._session_id:
            return zk
        started: KazooClient = await run_blocking(self._connect)
        return started

    def _connect(self) -> KazooClient:
        with self._start_lock:
            if self._closed:
                raise BackendError("the ZooKeeper backend is closed")
            zk = self._zk
            if (
                zk is not None
                and self._owns_client
                and self._session_id
                and zk.client_state == KeeperState.CLOSED
            ):
                # kazoo's connection thread ended by itself (an error in it: see _call),
                # and a client cannot start again: a new one, with a new session (the
                # old one's end was told as the thread ended: LOST).
                self._zk = None
                zk.remove_listener(self._on_state)
                self._stop_quietly(zk)
                self._end_session(self._session_id)
                self._session_id = 0
            if self._zk is None and not self._owns_client:
                raise ConfigurationError(
                    "the ZooKeeper client given as client= was made before os.fork(): its "
                    "connection thread stayed in the parent process, and its session is "
                    "the parent's; in this process, connect with a KazooClient made here"
                )
            if self._zk is None:
                acl = None
                if self._auth is not None:
                    # Inspection works for everyone; taking and freeing locks only with
                    # these credentials.
                    acl = [
                        make_digest_acl(*self._auth, all=True),
                        make_acl("world", "anyone", read=True),
                    ]
                self._diagnosis = diagnosis = _Diagnosis()
                self._zk = _KazooClient(
                    handler=KazooHandler(diagnosis),
                    logger=_KazooLog(diagnosis),
                    hosts=self._hosts,
                    timeout=self._session_timeout,
                    auth_data=[("digest", ":".join(self._auth))] if self._auth else None,
                    default_acl=acl,
                    **self._tls,
                )
            zk = self._zk
            if not self._session_id:
                zk.add_listener(self._on_state)
                if not zk.connected:
                    self._heard_at = time.monotonic()
                    try:
                        self._start(zk)
                    except (BackendError, *CLIENT_ERRORS) as exc:
                        zk.remove_listener(self._on_state)
                        if self._owns_client:
                            self._zk = None  # a stopped and closed client cannot restart
                        if isinstance(exc, BackendError):
                            raise
                        raise BackendUnavailable(
                            f"cannot connect to ZooKeeper {self._hosts!r}: {exc!r}"
                        ) from exc
                self._session_id = zk.client_id[0] if zk.client_id else 0
                if zk.connected:
                    self._connected.set()
            return zk

    def _start(self, zk: KazooClient) -> None:
        """``zk.start()``, but saying why no session came, and not waiting out the
        connect timeout once every server refused the TLS certificates (the server's
        or ours): kazoo would try again until then, and that cannot change meanwhile.
        """
        diagnosis = self._diagnosis  # None for a client passed in: it has its own log
        if diagnosis is not None:
            diagnosis.reset(zk.hosts)
        live = zk.start_async()
        deadline = time.monotonic() + self._connect_timeout
        while not zk.connected:
            remaining = deadline - time.monotonic()
            refused = diagnosis is not None and diagnosis.refused_everywhere()
            if remaining <= 0 or refused:
                _stop_in_background(zk)
                raise self._no_session(refused)
            live.wait(min(POLL, remaining))

    def _no_session(self, refused: bool) -> BackendError:
        where = f"cannot connect to ZooKeeper {self._hosts!r}"
        diagnosis = self._diagnosis
        if refused:
            # Every server was reached and refused the certificate: misconfigured, not
            # unavailable (which a caller may retry).
            return BackendError(f"{where}: TLS certificate refused: {diagnosis}")
        message = f"{where}: no session in {self._connect_timeout:g} s"
        if diagnosis is not None and diagnosis.errors:
            message += f": {diagnosis}"
            if not self._tls and diagnosis.closed_by_server():
                message += " (closed by the server: a TLS port needs tls=1)"
        elif diagnosis is not None:
            # No attempt failed yet: one is still waiting for an answer.
            message += ": no server answered in time"
        return BackendUnavailable(message)

    # Not only "gone": a renewal is refused too once the session's grace is over (no
    # answer for too long), whether or not the server ended the session.
    refused_renewal = (
        "renewing it, ZooKeeper no longer had the lock's node, or could no longer vouch"
        " for it (its session may have ended)"
    )

    # Not only ended: a session cut off for longer than it surely lives is given up
    # too, whether or not the ensemble has ended it yet (see _session_alive).
    reported_lost = (
        "the ZooKeeper session holding it ended, or was cut off for longer than it surely"
        " lives (the suspension grace)"
    )

    def watch_leases(self, renew_now: Callable[[], None]) -> bool:
        self._renew_now = renew_now
        return True

    def lease_lost(self, name: str, token: str) -> bool:
        key = (name, token)
        node = self._nodes.get(key)
        # A node not known (released, or given up already) is not ours to tell about.
        if node is None or not node.held or self._session_alive(node):
            return False
        self._give_up(key, node)
        return True

    def _alive_until(self) -> float:
        """Until when the session surely lives (inf: nothing casts doubt on it).

        Our own client's log tells when the server last surely heard us (when the
        request it answered latest was sent: see _Diagnosis.heard_at), and that counts
        even while kazoo reports no trouble: a process paused past the session timeout
        must not be told its leases were renewed when it resumes, nor take a watch
        event read then for a hand-off, before kazoo notices its connection is dead.
        And a request that timed out during a short server pause costs nothing while
        kazoo's pings were answered just before it.
        A caller's client (``client=``) shows only dlock's own requests: the grace
        then counts from when the suspension or stall was noticed.
        """
        suspended, stalled = self._suspended_at, self._stalled_since
        if self._on_suspend == "lost" and (suspended is not None or stalled is not None):
            return -math.inf
        diagnosis = self._diagnosis
        if diagnosis is not None:
            heard = diagnosis.heard_at
            # The server's clock runs the session it granted, longer or shorter than
            # the one asked for: kazoo pings a third of the way through that one.
            session_timeout = diagnosis.negotiated or self._session_timeout
            return heard + session_timeout * HEARD_SHARE
        until = math.inf
        if stalled is not None:
            until = stalled + self._session_timeout * STALL_SHARE
        if suspended is not None:
            until = min(until, suspended + self._session_timeout * SUSPEND_SHARE)
        return until

    def _renew_at_grace_end(self) -> None:
        """Wake the renewer now, and again when the session may be gone."""
        self._renew_now_and_after(max(0.0, self._alive_until() - time.monotonic()))

    def _renew_now_and_after(self, delay: float) -> None:
        """Wake the renewer now, and again when a grace ends (it decides then)."""
        timer = threading.Timer(delay, self._renew_now)
        timer.daemon = True
        timer.start()
        self._renew_now()

    def _on_state(self, state: str) -> None:
        """kazoo's connection thread: record the state, never block, wake the renewer."""
        if state != KazooState.CONNECTED:
            self._connected.clear()
        if state == KazooState.SUSPENDED:
            self._suspended_at = time.monotonic()
            logger.warning(f"dlock: ZooKeeper connection suspended{self._at_stake()}")
            self._renew_at_grace_end()
        elif state == KazooState.LOST:
            self._suspended_at = None
            self._end_session(self._session_id)
            self._renew_now()
        else:  # CONNECTED
            self._suspended_at = None
            self._stalled_since = None
            self._connected.set()
            zk = self._zk
            session = zk.client_id[0] if zk is not None and zk.client_id else 0
            if session != self._session_id:
                if self._session_id:
                    self._end_session(self._session_id)
                    self._renew_now()
                self._session_id = session
                # A create of the session that ended can no longer be applied.
                self._lost_creates.clear()
            # Back: a create sent before the connection dropped may be applied now.
            until = time.monotonic() + LOST_CREATE_WATCH
            for key in list(self._lost_creates):
                self._lost_creates[key] = until
            if self._orphans or self._lost_creates:
                # Not _start_reaper: an asyncio reaper can only be started in its loop,
                # and it runs already (orphans started it).
                self._orphans_due = True
                self._reaper_wakeup.set()

    def _end_session(self, session: int) -> None:
        """The session is gone and its ephemeral nodes with it: so are our leases."""
        for node in list(self._nodes.values()):
            if node.session == session:
                node.gone = True
        for key in list(self._waiters):
            self._wake(key)

    def _wake(self, key: tuple[str, str]) -> None:
        """Wake every wait on ``key`` (kazoo's thread calls this through the watches)."""
        for waiter in tuple(self._waiters.get(key, ())):
            waiter.wake()

    def _session_alive(self, node: _Node) -> bool:
        """False once the node's session ended or was suspended or stalled for too long."""
        if node.gone or node.session != self._session_id:
            return False
        return time.monotonic() < self._alive_until()

    def _heard(self, since: float) -> None:
        """The session was alive at ``since`` if a reply arrived after it; an operation
        that sent nothing (or got no reply) proves nothing."""
        if self._answered_at < since:
            return
        if since > self._heard_at:
            self._heard_at = since
        self._stalled_since = None

    def _at_stake(self) -> str:
        """What a warning of a failing connection adds: that held locks may be lost, if
        this client holds any (a waiter alone, as under ``dlock run``, holds nothing)."""
        held = any(node.held for node in list(self._nodes.values()))
        return "; held locks may be lost" if held else ""

    def _stalled(self) -> None:
        """A request timed out although kazoo reports a connection.

        kazoo counts every request it *sends* as a heartbeat, so a client that keeps
        sending into a dead connection never notices the silence. The server may
        expire the session a session timeout after it last heard from us, which was
        no earlier than the last answered request: give the locks up before that.
        """
        self._timed_out_at = time.monotonic()
        if self._stalled_since is not None:
            return
        self._stalled_since = self._heard_at
        logger.warning(f"dlock: ZooKeeper does not answer{self._at_stake()}")
        self._renew_at_grace_end()

    def _silent(self) -> bool:
        """A request went unanswered within the last operation timeout: another sent
        now would most likely sit the timeout out too."""
        return (
            self._stalled_since is not None
            and time.monotonic() < self._timed_out_at + self._op_timeout
        )

    async def _call(self, result: Any, timeout: float | None = None) -> Any:
        """Wait for one of kazoo's async results, bounded by the operation timeout,
        noting that the server replied (a server-side error is a reply)."""
        try:
            value = await wait_result(result, self._op_timeout if timeout is None else timeout)
        except SERVER_REPLIES:
            self._answered_at = time.monotonic()
            raise
        except RuntimeError as exc:
            # kazoo's connection thread died reading a reply ("xids do not match", its
            # issue 254) and handed its error to the request: the connection is gone
            # for good (see _connect).
            raise ConnectionClosedError(f"kazoo's connection failed: {exc!r}") from exc
        self._answered_at = time.monotonic()
        return value

    async def _call_while_alive(self, result: Any, node: _Node) -> Any:
        """Like :meth:`_call`, but None as soon as the node's session is given up.

        The renewer must not sit out a whole operation timeout once another request
        or the connection state has shown that the session may be gone.
        """
        deadline = time.monotonic() + self._op_timeout
        while True:
            try:
                return await self._call(result, min(POLL, max(0.0, deadline - time.monotonic())))
            except KazooTimeoutError:
                if not self._session_alive(node):
                    return None
                if time.monotonic() >= deadline:
                    raise

    async def _catch_up(self, zk: KazooClient) -> None:
        """Make the next reads see every write committed before now.

        A server answers reads from its own replica, which may lag the leader: another
        client's re-entry or release would be missed. Acquisition needs no sync: its
        create is a write, and reads after it on this session see everything before it.
        """
        await self._call(zk.sync_async("/"))

    def _stripe(self, key: tuple[str, str]) -> Mutex:
        """Operations on one (name, token) run one at a time: the caller's, the
        renewer's and the reaper's, and a cancelled waiter's clean-up."""
        return self._stripes_here()[hash(key) % STRIPES]

    def _stripes_here(self) -> list[Mutex]:
        """The stripes, made again in a new event loop (a client used by two
        ``asyncio.run`` calls): an asyncio lock that once had to wait stays bound to
        its loop and refuses to wait in another. That loop has ended, so nothing holds
        the old ones. The reaper was a task of that loop: it is started again here.
        Until then (no operation in a running loop), a lease not renewed outlives its
        ``ttl``: kazoo's thread keeps the session, and with it the node."""
        task = current_task()  # always None on the sync face
        loop = None if task is None else task.get_loop()
        if loop is not self._stripes_loop:
            self._stripes_loop = loop
            self._stripes = [Mutex() for _ in range(STRIPES)]
            if self._reaper is not None:
                self._start_reaper(orphans=True)
        return self._stripes

    def _parent(self, name: str) -> str:
        return f"{self._root}/{encode_name(name)}"

    # -- acquisition ------------------------------------------------------------------

    async def _acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        key = (name, token)
        # No later than the core's start of the attempt, which it counts the lease from.
        began = time.monotonic()

        async def attempt(retrying: bool) -> Acquired | Busy:
            zk = await self._client()
            node = self._nodes.get(key)
            if node is not None and node.held:
                return await self._reenter(zk, key, node, ttl, reentrant)
            for _ in range(3):
                sent = time.monotonic()
                node = await self._own_node(zk, key, ttl, holder)
                # A create answered ends a stall (see _stalled) before the queue is
                # checked: else, with the grace at nothing (on_suspend=lost) or its end
                # past (client=), each node is given up as it is made, and acquires
                # failed after a short server pause until another call ended the stall.
                self._heard(sent)
                result = await self._check_queue(zk, key, node, ttl, began)
                if self._closed:
                    await self._closed_meanwhile(zk, key)
                if result is not None:
                    return result
            raise BackendError(f"lock {name!r}: the queue node keeps vanishing")

        async with self._stripe(key):
            acquired: Acquired | Busy = await self._guarded(attempt)
            return acquired

    async def _closed_meanwhile(self, zk: KazooClient, key: tuple[str, str]) -> None:
        """Closed (from another thread) while this attempt ran: its node may have come
        after close deleted ours, and would then be neither renewed nor reaped."""
        node = self._nodes.get(key)
        if node is not None:
            try:
                await self._delete(zk, key, node)
            except CLIENT_ERRORS:
                logger.debug("dlock: could not delete a node after close", exc_info=True)
        raise BackendError("the ZooKeeper backend is closed")

    def _wrap(self, exc: BaseException) -> BackendError:
        """kazoo's error as dlock's, naming the servers (kazoo's time-outs and lost
        connections say nothing more of themselves than their class)."""
        if isinstance(exc, BackendError):
            return exc
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, KazooTimeoutError) and not str(exc):
            detail += f" (no answer within {self._op_timeout:g} s)"
        where = f"ZooKeeper {self._hosts!r}"
        if isinstance(exc, REFUSALS):
            hint = (
                " (wrong or missing user:password for the root?)"
                if isinstance(exc, NoAuthError)
                else ""
            )
            return BackendError(f"{where} refused: {detail}{hint}")
        return BackendUnavailable(f"{where}: {detail}")

    async def _guarded(self, op: Callable[[bool], Any]) -> Any:
        """Run ``op``, again after a dropped connection, until the operation timeout.

        In an ensemble a dropped connection is usually one server going away, and kazoo
        reconnects to another within the same session: the operation can carry on (a
        create whose reply was lost is found again by its token). ``op`` is told when
        it runs again, as a delete that now finds nothing may be its own earlier one.
        """
        deadline = time.monotonic() + self._op_timeout
        retrying = False
        while True:
            started = time.monotonic()
            try:
                result = await op(retrying)
            except (ConnectionLoss, SessionExpiredError) as exc:
                # Expired: kazoo refused the request before sending it, and makes a new
                # session at once (what a session held is lost, and told as such).
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await run_blocking(self._connected.wait, remaining):
                    raise self._wrap(exc) from exc
                retrying = True
                continue
            except CLIENT_ERRORS as exc:
                if isinstance(exc, KazooTimeoutError):
                    self._stalled()
                raise self._wrap(exc) from exc
            self._heard(started)
            return result

    async def _reenter(
        self, zk: KazooClient, key: tuple[str, str], node: _Node, ttl: float, reentrant: bool
    ) -> Acquired | Busy:
        """Enter a held lock again; Busy (once) if the lease is gone, so that the core
        reports the loss. A fresh acquisition after that creates a new node.

        The core counts a re-entry as a renewal, so the lease runs ``ttl`` from now:
        the reaper's deadline and the ``ttl`` recorded for inspection move with it.
        """
        if not self._session_alive(node):
            self._give_up(key, node)
            return Busy()
        if not reentrant:
            return Busy()
        data = {**node.data, "count": node.data["count"] + 1, "ttl": ttl}
        try:
            await self._call(zk.set_async(node.path, _dump(data)))
        except NoNodeError:
            self._forget(key, node)
            return Busy()
        node.data = data
        self._lease(node, ttl)
        return Acquired(fencing_token=node.czxid, count=data["count"])

    async def _own_node(
        self, zk: KazooClient, key: tuple[str, str], ttl: float, holder: Holder
    ) -> _Node:
        """Our queued node for ``key``: the existing one, one found after a lost reply,
        or a new one."""
        node = self._nodes.get(key)
        if node is not None and (node.gone or node.session != self._session_id):
            self._forget(key, node)
            node = None
        if node is not None:
            return node
        name, token = key
        parent = self._parent(name)
        data, payload = self._payload(holder, ttl)
        session = self._session_id
        if key in self._pending:
            # Curator's protection: a create that succeeded on the server but whose reply
            # was lost left a node whose name starts with our token. Adopt it.
            found = await self._find_own(zk, parent, token)
            self._pending.discard(key)
            if found is None:
                self._watch_lost_create(key)
            else:
                path, stat = found
                node = _Node(path, stat.ephemeralOwner, stat.czxid, data)
                if node.session == session:
                    self._nodes[key] = node
                    return node
        if self._orphans:
            await self._drop_orphans_of(zk, key)
        self._pending.add(key)
        path, stat, listing = await self._create(zk, parent, f"{parent}/{token}-", payload)
        self._pending.discard(key)
        node = _Node(path, stat.ephemeralOwner, stat.czxid, data, listing=listing)
        self._nodes[key] = node
        return node

    async def _drop_orphans_of(self, zk: KazooClient, key: tuple[str, str]) -> None:
        """Delete the nodes of ``key`` given up and not deleted yet, before it queues a
        new one (the caller holds its stripe). Left to the reaper, such a node would be
        ahead of the new one in the line; and past 2**31 creates under the lock node
        (see queue_of) it has the very name the new one gets, which the server would
        refuse (NodeExists) until the reaper's next try."""
        for path, (owner, czxid) in list(self._orphans.items()):
            if owner == key:
                await self._delete_orphan(zk, path, czxid)
                if self._orphans.get(path) == (owner, czxid):
                    del self._orphans[path]

    def _payload(self, holder: Holder, ttl: float) -> tuple[dict[str, Any], bytes]:
        """A new node's data, and its encoding: the same for every acquisition of a
        client with one TTL, so made once (the dict is never changed in place)."""
        cached = self._payloads.get((holder, ttl))
        if cached is None:
            # Holder.from_json reads these fields back for inspection.
            data = {**json.loads(holder.to_json()), "count": 1, "ttl": ttl}
            cached = data, _dump(data)
            if len(self._payloads) >= MAX_PAYLOADS:
                self._payloads.clear()
            self._payloads[(holder, ttl)] = cached
        return cached

    async def _create(
        self, zk: KazooClient, parent: str, prefix: str, data: bytes
    ) -> tuple[str, ZnodeStat, Any]:
        """Create our sequential node, and the lock's node first if it may be missing.

        The requests are pipelined: a session's requests are served in order, so the
        listing sent behind the create already includes the new node, and a lock used
        for the first time costs no extra round trip for making its node. The lock's
        node is a container, which the server deletes once it is empty, so names used
        once do not stay forever; a node we knew of may thus be gone, and is made again.
        """
        known = parent in self._parents
        for _ in range(3):
            made = None if known else _create_container(zk, parent)
            created = zk.create_async(
                prefix, data, ephemeral=True, sequence=True, include_data=True
            )
            listing = zk.get_children_async(parent, include_data=True)
            no_root = False
            refused: BaseException | None = None
            if made is not None:
                try:
                    await self._call(made)
                except NodeExistsError:
                    pass
                except NoNodeError:
                    no_root = True
                except REFUSALS as exc:
                    # The root refuses new lock nodes (its ACL), yet the lock node may
                    # exist and take our create: its answer is due at once, read below.
                    refused = exc
            # Always read the create's own answer, whatever the lock node's said: another
            # client may make the root and the lock node between our two requests, and a
            # node created then but not taken as ours would head the queue for good.
            try:
                path, stat = await self._call(created)
            except NoNodeError:
                if refused is not None:
                    raise refused from None  # no lock node, and the root refuses one
                if no_root:
                    await self._make_root(zk)  # first use of this root
                known = False  # deleted once empty (by the server, or pruned): make it again
                continue
            if len(self._parents) >= MAX_KNOWN_PARENTS:
                self._parents.clear()
            self._parents.add(parent)
            return path, stat, listing
        raise BackendError(f"cannot create a lock node under {parent!r}")

    async def _make_root(self, zk: KazooClient) -> None:
        """Make the root and its missing ancestors (pipelined). Not kazoo's
        ``ensure_path``: it waits for its answers with no bound, with the stripe held."""
        segments = self._root.split("/")[1:]
        paths = ["/" + "/".join(segments[: i + 1]) for i in range(len(segments))]
        for result in [zk.create_async(path, b"") for path in paths]:
            try:
                await self._call(result)
            except NodeExistsError:
                pass
            except NoNodeError:
                # Only under a chroot that does not exist (the client's hosts end in
                # a path): a misconfiguration that no retry mends.
                raise _missing_chroot(zk) from None

    async def _check_chroot(self, zk: KazooClient) -> None:
        """A read found no node: under a chroot that does not exist (a passed-in client
        whose hosts end in a path) that is a misconfiguration, not a free lock. One
        round trip, only on that path."""
        if zk.chroot and await self._call(zk.exists_async("/")) is None:
            raise _missing_chroot(zk)

    async def _find_own(
        self, zk: KazooClient, parent: str, token: str, besides: str | None = None
    ) -> tuple[str, ZnodeStat] | None:
        """Our node whose create's reply was lost, if the create went through.

        The reply may have been lost with the connection, and the server we are on
        now may not have applied that create yet: catch up first. A node of ours we
        gave up (waiting for the reaper) carries our token too, but is not this one;
        nor is ``besides`` (the node the token holds or queues in now).
        """
        await self._catch_up(zk)
        try:
            children = await self._call(zk.get_children_async(parent))
        except NoNodeError:
            return None
        skip = {*self._orphans, besides}
        for child in children:
            if child.startswith(f"{token}-") and f"{parent}/{child}" not in skip:
                stat = await self._call(zk.exists_async(f"{parent}/{child}"))
                if stat is not None:
                    return f"{parent}/{child}", stat
        return None

    async def _check_queue(
        self, zk: KazooClient, key: tuple[str, str], node: _Node, ttl: float, began: float
    ) -> Acquired | Busy | None:
        """Held if our node is the lowest; else queue behind the predecessor (inside a
        waiter) or leave (outside one). None: our node vanished, start again.
        ``began``: when the acquire call began (see _granted)."""
        waiting = key in self._waiters
        ahead = node.ahead
        if (
            waiting
            and ahead is not None
            and ahead.deleted
            and ahead.held
            and self._session_alive(node)
        ):
            # The hand-off without a round trip: the node just ahead of ours was the
            # lowest once and is gone, and the queue is in the order of creation, so
            # nothing can ever be ahead of ours again.
            return self._granted(node, ttl, handed=began)
        parent, child = node.path.rsplit("/", 1)
        listing, node.listing = node.listing, None
        if listing is None:
            listing = zk.get_children_async(parent, include_data=True)
        try:
            children = await self._queue(zk, parent, await self._call(listing))
        except NoNodeError:
            # The lock node holds ours until it is deleted: ours was (force release,
            # session end), then the empty lock node was deleted.
            children = []
        if child not in children:
            self._forget(key, node)
            return None
        if len(children) > 1:
            node.contended = True
        position = children.index(child)
        if position == 0:
            if not self._session_alive(node):
                # The listing was answered, then the session ended (or may have) before
                # we got to it: the node went with it, so this is no grant. Try again
                # (in the new session; in a doubted one, the reply to a new create
                # shows whether it lives).
                self._give_up(key, node)
                return None
            return self._granted(node, ttl)
        if not waiting:
            await self._delete(zk, key, node)
            return Busy()
        predecessor = f"{parent}/{children[position - 1]}"
        if ahead is None or ahead.path != predecessor:
            self._unwatch(node)
            ahead = node.ahead = _Ahead(predecessor, partial(self._wake, key))
        if position == 1:
            ahead.held = True
        await self._watch(zk, ahead)
        if ahead.deleted:
            if ahead.held and self._session_alive(node):
                return self._granted(node, ttl)
            self._wake(key)  # gone already, but what was ahead of it? List again.
        return Busy()

    async def _queue(
        self, zk: KazooClient, parent: str, listed: tuple[list[str], ZnodeStat]
    ) -> list[str]:
        """The queue in order, from a listing of ``parent`` with its stat: by sequence
        number, or, once the lock node's count of creates reached the limit where
        sequence numbers no longer follow the order of creation (see
        :func:`queue_of`), by creation zxid, which never wraps (one pipelined read
        more per listing, on such a node only). A node gone meanwhile has left it."""
        children, stat = listed
        ordered = queue_of(children, stat)
        if ordered is not None:
            return ordered
        reads = [(child, zk.exists_async(f"{parent}/{child}")) for child in queued(children)]
        created = []
        for child, result in reads:
            found = await self._call(result)
            if found is not None:
                created.append((found.czxid, child))
        return [child for _, child in sorted(created)]

    async def _watch(self, zk: KazooClient, ahead: _Ahead) -> None:
        """Watch the node ahead for its deletion, and, until we know it held the lock,
        for a rewrite of its data (pipelined: one round trip).

        A child watch fires only when the node is deleted (an ephemeral node has no
        children), so renewals of the holder ahead wake nobody. ``get`` rather than
        ``exists``: on a missing node it leaves no watch behind.
        """
        data = None
        if not ahead.held and not ahead.watching_data:
            ahead.watching_data = True
            data = zk.get_async(ahead.path, watch=ahead.on_event)
        deletion = None
        if not ahead.watching_delete:
            ahead.watching_delete = True
            deletion = zk.get_children_async(ahead.path, watch=ahead.on_event)
        for result in (data, deletion):
            if result is None:
                continue
            try:
                answer = await self._call(result)
            except NoNodeError:
                ahead.deleted = True
                continue
            except BaseException:
                ahead.watching_data = ahead.watching_delete = False  # may be unregistered
                raise
            if result is data and answer[1].version > 0:
                ahead.held = True
        if ahead.deleted:
            ahead.watching_data = ahead.watching_delete = False

    def _granted(self, node: _Node, ttl: float, handed: float | None = None) -> Acquired:
        """``handed``: granted on the watch event of the node ahead, with no round trip
        since the attempt began (at ``handed``, the monotonic clock). The core counts
        the lease from the attempt, but the server last heard us earlier (our latest
        answered ping, up to a third of the session before): the session surely lives
        only until _alive_until, which may come first. A holder paused past it and
        resumed must not find ``owned()`` true while another client holds the lock, so
        the lease told ends no later: counted, as the core counts it, from the
        attempt's start (which the core took before this call began), not from now.
        From now, an attempt that waited longer than that for its stripe (or for the
        CPU, on a loaded machine) was told a lease that had ended by the core's count
        before it was granted: the grant was given back and the acquire failed."""
        node.held = True
        self._unwatch(node)
        self._lease(node, ttl)
        lease = None
        if handed is not None:
            surely = self._alive_until() - handed
            if surely < ttl:
                lease = max(0.0, surely)
        return Acquired(fencing_token=node.czxid, count=int(node.data["count"]), ttl=lease)

    def _lease(self, node: _Node, ttl: float) -> None:
        """The held node's lease runs ``ttl`` from now. The reaper sleeps until the
        earliest deadline it knew of: one that is now earlier (a grant, or an extend or
        re-entry to a shorter TTL) must wake it, or the node outlives its lease."""
        node.deadline = time.monotonic() + ttl
        if node.deadline < self._reaper_next:
            self._start_reaper()

    async def acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        self._follow_fork()
        return await self._acquire(name, token, ttl, holder, reentrant)

    @asynccontextmanager
    async def waiter(self, name: str, token: str) -> AsyncIterator[AsyncZooKeeperWaiter]:
        self._follow_fork()
        key = (name, token)
        waiter = AsyncZooKeeperWaiter()
        self._waiters.setdefault(key, []).append(waiter)
        cancelled = False
        try:
            yield waiter
        except Cancelled:
            cancelled = True
            raise
        finally:
            sharers = self._waiters[key]
            sharers.remove(waiter)
            if not sharers:
                del self._waiters[key]
            node = self._nodes.get(key)
            # Another wait of the same lock object still queues in this node.
            if node is not None and not node.held and key not in self._waiters:
                if cancelled:
                    # The caller sees its cancellation at once: the leave goes on by
                    # itself (awaited, it held the cancellation up for a whole
                    # operation timeout on a server that does not answer).
                    leave = partial(self._leave_queue, name, token)
                    run_detached(leave, self._leaves, "dlock-leave")
                else:
                    # Run to the end even if cancelled again: a node left behind would
                    # block the line until the session ends.
                    await shielded(self._leave_queue(name, token))

    async def _leave_queue(self, name: str, token: str) -> bool:
        """Timeout or cancellation: a queued (not held) node must not block the line.
        True if there was one (deleted now, or by the reaper once it can)."""
        key = (name, token)
        async with self._stripe(key):
            node = self._nodes.get(key)
            if node is None or node.held:
                return False
            try:
                zk = await self._client()
                await self._delete(zk, key, node)
            except (BackendError, *CLIENT_ERRORS):
                logger.debug("dlock: could not leave the queue of %r", name, exc_info=True)
                self._forget(key, node)
                self._orphan(key, node)
            return True

    async def _delete(
        self, zk: KazooClient, key: tuple[str, str], node: _Node, held: bool = False
    ) -> bool:
        """Delete our node and forget it; False if it was already gone.

        ``held``: the node holds the lock. If a waiter may be behind it, its data is
        rewritten in the same transaction, which tells that waiter (watching for it)
        that this node was the lowest: it may then take the lock on the deletion
        without listing the queue again. Never for a node that did not hold.
        """
        try:
            if held and node.contended:
                transaction = zk.transaction()
                transaction.set_data(node.path, b"")
                transaction.delete(node.path)
                _committed(await self._call(transaction.commit_async()))
            else:
                await self._call(zk.delete_async(node.path))
            existed = True
        except NoNodeError:
            existed = False
        self._forget(key, node)
        return existed

    def _forget(self, key: tuple[str, str], node: _Node) -> None:
        node.gone = True
        self._unwatch(node)
        if self._nodes.get(key) is node:
            del self._nodes[key]

    def _unwatch(self, node: _Node) -> None:
        """Drop the watch callbacks on the node ahead of ours once ours no longer waits.

        kazoo keeps them until that node changes or goes: a client polling with short
        timeouts behind a long hold would pile up one (and its waiter) per attempt, all
        woken at once by the release. The server keeps one watch per path and session,
        and kazoo ignores an event with no callback left.
        """
        ahead, node.ahead = node.ahead, None
        zk = self._zk
        if ahead is None or zk is None:
            return
        path = (zk.chroot or "") + ahead.path
        for watchers in (zk._data_watchers, zk._child_watchers):
            found = watchers.get(path)
            if found:
                found.discard(ahead.on_event)
        ahead.watching_data = ahead.watching_delete = False

    # -- release and renewal ----------------------------------------------------------

    async def _release(self, name: str, token: str) -> int | None:
        key = (name, token)

        async def release(retrying: bool) -> int | None:
            node = self._nodes.get(key)
            if node is None and key not in self._pending:
                return None
            zk = await self._client()
            if node is None:
                # An attempt interrupted mid-create: its node may exist all the same.
                try:
                    await self._drop_lost_create(zk, key)
                except CLIENT_ERRORS:
                    # The server may yet apply that create, once it answers again: a
                    # node nobody knows of would then head the queue for as long as the
                    # session lives. The reaper looks for it then.
                    self._watch_lost_create(key)
                    raise
                return None
            if node.held and not node.gone and node.session == self._session_id:
                # The connection is down or does not answer (a request timed out in
                # the last operation timeout): a delete would sit out the timeout too,
                # once per lock when a client closes. The reaper deletes the node once
                # the server answers again; if it never does, the node goes with the
                # session. After that, a release tries again: nothing else may be sent
                # that would show the server answers again.
                if not self._session_alive(node):
                    self._give_up(key, node)  # its lease was declared lost already
                    return None
                if self._silent():
                    self._give_up(key, node)
                    raise BackendUnavailable(
                        f"lock {name!r}: ZooKeeper does not answer; its node is deleted"
                        " once it does, or goes with the session"
                    )
            if not node.held or not self._session_alive(node):
                if not node.gone or node.session == self._session_id:
                    await self._delete(zk, key, node)
                self._forget(key, node)
                return None
            count = int(node.data["count"])
            if count > 1:
                data = {**node.data, "count": count - 1}
                try:
                    await self._call(zk.set_async(node.path, _dump(data)))
                except NoNodeError:
                    self._forget(key, node)
                    return None
                node.data = data
                return count - 1
            # After a lost reply, finding nothing most likely means our delete went through.
            return 0 if await self._delete(zk, key, node, held=True) or retrying else None

        async with self._stripe(key):
            try:
                remaining: int | None = await self._guarded(release)
            except BaseException:
                node = self._nodes.get(key)
                if node is not None and not node.held:
                    # A node in the line that this could not delete (no answer, a
                    # connection that stayed down, cancelled): the caller gives up
                    # (a give-back is not retried), and no one else would delete it,
                    # while it stays in the line for as long as the session lives,
                    # heading it once those ahead go. The reaper deletes it once the
                    # server answers (a held node's ends at its deadline anyway).
                    self._give_up(key, node)
                raise
            return remaining

    async def release(self, name: str, token: str) -> int | None:
        self._follow_fork()
        return await self._release(name, token)

    async def _extend_all(self, leases: list[Lease]) -> list[bool]:
        """Rewrite each held node (one transaction for the batch: see _extend_locked).

        The write proves the session alive now and moves ``mtime``, from which
        inspection tells how long the lease has left.
        """
        zk = await self._client()
        started = time.monotonic()
        answers = [False] * len(leases)
        while True:
            alive = self._alive_leases(leases)
            if not alive:
                return answers
            batch = [leases[index] for index in alive]
            taken = await self._take_stripes(batch)
            if taken is not None:
                break
        try:
            extended = await self._extend_locked(zk, batch)
        finally:
            for stripe in reversed(taken):
                stripe.release()
        for index, answer in zip(alive, extended, strict=True):
            answers[index] = answer
        if any(extended):
            self._heard(started)
        return answers

    def _alive_leases(self, leases: list[Lease]) -> list[int]:
        """The indexes of the leases still held in a live session; those whose session is
        gone are given up. A lease with no held node is lost too: one given up while
        waiting for a stripe is forgotten, and counting it alive then would wait for the
        stripe again, telling the loss only once the stripe is free."""
        alive = []
        for index, lease in enumerate(leases):
            key = (lease.name, lease.token)
            node = self._nodes.get(key)
            if node is None or not node.held:
                continue
            if self._session_alive(node):
                alive.append(index)
            else:
                self._give_up(key, node)
        return alive

    async def _take_stripes(self, leases: list[Lease]) -> list[Mutex] | None:
        """Hold the stripes of the whole batch (in one order, and no other operation
        holds two) so a re-entry or release cannot interleave with the rewrite.

        None, holding none, once a lease's session is given up meanwhile: another
        operation may hold a stripe while it waits for a connection or an answer, and
        the loss must be told before the server lets another client take the lock.
        """
        all_stripes = self._stripes_here()
        stripes = [
            all_stripes[i] for i in sorted({hash((x.name, x.token)) % STRIPES for x in leases})
        ]
        taken: list[Mutex] = []
        try:
            for stripe in stripes:
                while not await acquire_within(stripe, POLL):
                    if len(self._alive_leases(leases)) < len(leases):
                        for held in reversed(taken):
                            held.release()
                        return None
                # Counted as taken only once acquired: a renewal cancelled (timed out)
                # while waiting for the next one must still give back those it holds.
                taken.append(stripe)
        except BaseException:
            for held in reversed(taken):
                held.release()
            raise
        return taken

    async def _extend_locked(self, zk: KazooClient, leases: list[Lease]) -> list[bool]:
        """Rewrite the held nodes of ``leases`` in one transaction (a multi; more for a
        batch past MAX_RENEWAL_BYTES, all pipelined): one write for the ensemble to
        agree on, not one per lease. Under load that is what a renewal costs: 200
        pipelined writes took a three-node ensemble 1.5 s (4 s at worst) with 6 CPU
        burners on 2 CPUs, longer than leases of 3 s could wait; one transaction of
        them 0.15 s (0.47 s). A transaction is applied whole or not at all: one whose
        node is gone (its session ended, a force release) is sent again without it."""
        answers: list[bool] = [False] * len(leases)
        pending: list[tuple[int, _Node, dict[str, Any], bytes]] = []
        for index, lease in enumerate(leases):
            node = self._nodes.get((lease.name, lease.token))
            if node is None or not node.held:
                continue
            if not self._session_alive(node):
                self._give_up((lease.name, lease.token), node)
                continue
            if self._suspended_at is not None:
                # A write would only queue until the connection is back. The session
                # surely lives until the grace ends, when the renewer asks again.
                self._lease(node, lease.ttl)
                answers[index] = True
                continue
            data = {**node.data, "ttl": lease.ttl}
            pending.append((index, node, data, _dump(data)))
        while pending:
            sent = []
            for chunk in _renewal_chunks(pending):
                transaction = zk.transaction()
                for _, node, _, payload in chunk:
                    transaction.set_data(node.path, payload)
                sent.append((chunk, transaction.commit_async()))
            pending = []
            for chunk, result in sent:
                try:
                    results = await self._call_while_alive(result, chunk[0][1])
                except CLIENT_ERRORS as exc:
                    if isinstance(exc, KazooTimeoutError):
                        self._stalled()
                    raise self._wrap(exc) from exc
                refused = {} if results is None else _refused_ops(results)
                for position, (index, node, data, payload) in enumerate(chunk):
                    key = (leases[index].name, leases[index].token)
                    if results is None:
                        self._give_up(key, node)  # the session was given up meanwhile
                        continue
                    if refused:
                        error = refused.get(position)
                        if error is None:
                            pending.append((index, node, data, payload))  # not applied
                        elif isinstance(error, NoNodeError):
                            self._forget(key, node)
                        else:
                            raise self._wrap(error)
                        continue
                    stat = results[position]
                    if stat.ephemeralOwner != node.session or not self._session_alive(node):
                        self._give_up(key, node)
                        continue
                    node.data = data
                    self._lease(node, leases[index].ttl)
                    answers[index] = True
        return answers

    def _give_up(self, key: tuple[str, str], node: _Node) -> None:
        """A lease declared lost while its node may still exist (a suspended session
        that comes back): delete the node as soon as the connection allows."""
        if not node.gone and node.session == self._session_id:
            self._orphan(key, node)
        self._forget(key, node)

    def _orphan(self, key: tuple[str, str], node: _Node) -> None:
        """A node of ours that nobody holds: until deleted, it blocks the lock."""
        self._orphans[node.path] = (key, node.czxid)
        self._start_reaper(orphans=True)

    async def extend(self, name: str, token: str, ttl: float) -> bool:
        self._follow_fork()
        result = await self._extend_all([Lease(name, token, ttl)])
        return result[0]

    async def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        self._follow_fork()
        return await self._extend_all(list(leases))

    def _watch_lost_create(self, key: tuple[str, str]) -> None:
        """Have the reaper look for the node of a lost create, from now for
        LOST_CREATE_WATCH seconds (not longer for each search in vain)."""
        if key not in self._lost_creates:
            self._lost_creates[key] = time.monotonic() + LOST_CREATE_WATCH
            self._start_reaper(orphans=True)

    async def _drop_lost_create(self, zk: KazooClient, key: tuple[str, str]) -> None:
        """Delete the node of a create whose reply was lost, if it went through (the
        caller holds the key's stripe); if none is found, it may come yet: watched.
        Not the node the key holds or queues in (a retry that created anew)."""
        name, token = key
        node = self._nodes.get(key)
        found = await self._find_own(
            zk, self._parent(name), token, besides=None if node is None else node.path
        )
        self._pending.discard(key)
        if found is None:
            self._watch_lost_create(key)
            return
        self._lost_creates.pop(key, None)
        with suppress(NoNodeError):
            await self._call(zk.delete_async(found[0]))

    async def _delete_lost_creates(self, zk: KazooClient) -> None:
        """Look again for the nodes of lost creates (see _drop_lost_create), and delete
        those found; stop looking once their watch is over."""
        for key, until in list(self._lost_creates.items()):
            async with self._stripe(key):
                if time.monotonic() >= until:
                    if self._lost_creates.get(key) == until:
                        # Not del: kazoo's thread may clear them meanwhile (see _on_state).
                        self._lost_creates.pop(key, None)
                    continue
                with suppress(*CLIENT_ERRORS):
                    await self._drop_lost_create(zk, key)

    async def _delete_orphans(self) -> None:
        """Delete given-up nodes; those that fail stay for the next try."""
        zk = self._zk
        if zk is None or not self._connected.is_set():
            return  # the next CONNECTED wakes the reaper
        if self._silent():
            # Not into the silence: a request here holds its lock's stripe for the
            # operation timeout, and with it every release that shares the stripe (a
            # client closing into the silence). The reaper tries again after a while.
            return
        await self._delete_lost_creates(zk)
        for path, (key, czxid) in list(self._orphans.items()):
            async with self._stripe(key):
                if self._orphans.get(path) != (key, czxid):
                    continue  # given up anew at this path meanwhile: for the next round
                try:
                    await self._delete_orphan(zk, path, czxid)
                except CLIENT_ERRORS:
                    continue
                del self._orphans[path]

    async def _delete_orphan(self, zk: KazooClient, path: str, czxid: int) -> None:
        """Delete the given-up node at ``path`` if it is still the one created at
        ``czxid``; the caller holds its lock's stripe.

        The path may name another node of ours by now: the given-up one went another
        way (its session ended, a force release) while this waited for the connection
        or a next try, its lock node was deleted once empty and made again (or, past
        2**31 creates, numbers repeat: see queue_of), and the same lock object, whose
        owner token starts the name, queued again and got the same number. Deleting
        that one would leave its holder believing it holds a lock anyone may take.
        Only this process makes nodes under its tokens, and it creates one for this
        key only under the stripe held here, so the node read now is still there when
        deleted: the version read (for which the server checks) is belt and braces.
        """
        stat = await self._call(zk.exists_async(path))
        if stat is None or stat.czxid != czxid:
            return  # gone, and the path is free or names another node
        with suppress(NoNodeError):
            await self._call(zk.delete_async(path, version=stat.version))

    # -- leases that run out without renewal -------------------------------------------

    def _start_reaper(self, orphans: bool = False) -> None:
        """Wake the reaper, starting it on first use (in an operation: an asyncio reaper
        is a task of the operations' loop), and again if it does not serve this loop
        (its loop ended: a client used by two ``asyncio.run`` calls)."""
        if orphans:
            self._orphans_due = True
        # Threads granted their first locks at once would each start one.
        with self._reaper_lock:
            if not serving(self._reaper) and not self._closed:
                # The old wake-up event is bound to the old loop too.
                self._reaper_wakeup = WakeupEvent()
                self._reaper_next = float("inf")
                self._orphans_due = self._orphans_due or bool(self._orphans or self._lost_creates)
                self._reaper = spawn(self._reap, name="dlock-zookeeper-reaper")
            self._reaper_wakeup.set()

    async def _reap(self) -> None:
        """Delete held nodes whose lease ran out unrenewed (``auto_renew=False``), and
        nodes given up (orphans).

        The session keeps ephemeral nodes alive for as long as the process lives, so
        without this a lease would never end while its holder is alive but idle.
        """
        while not self._closed:
            # Cleared before looking: whatever is added after this wakes the next wait.
            self._reaper_wakeup.clear()
            self._reaper_next = float("inf")  # while reaping, every grant wakes it
            now = time.monotonic()
            due = [
                (key, node)
                for key, node in list(self._nodes.items())
                if node.held and not node.gone and node.deadline <= now
            ]
            for key, node in due:
                async with self._stripe(key):
                    if self._nodes.get(key) is not node or node.deadline > time.monotonic():
                        continue
                    if self._silent():
                        self._give_up(key, node)  # deleted once the server answers
                        continue
                    try:
                        await self._delete(await self._client(), key, node)
                    except (BackendError, *CLIENT_ERRORS):
                        self._give_up(key, node)
            if self._orphans_due:
                self._orphans_due = False
                await self._delete_orphans()
            if self._closed:
                return
            held = list(self._nodes.values())
            deadline = min(
                (n.deadline for n in held if n.held and not n.gone), default=float("inf")
            )
            wait = deadline - time.monotonic()
            if self._orphans or self._lost_creates:
                # Some could not be deleted, or may come yet: try again after a while.
                self._orphans_due = True
                wait = min(wait, self._op_timeout)
                if self._lost_creates:
                    wait = min(wait, LOST_CREATE_EVERY)
            self._reaper_next = deadline
            await self._reaper_wakeup.wait(max(0.001, wait) if wait != float("inf") else None)

    # -- inspection -------------------------------------------------------------------

    async def _infos(self, zk: KazooClient, names: list[str]) -> list[LockInfo]:
        """Holder and queue of each name, with every read pipelined (the caller syncs)."""
        listed = [(name, zk.get_children_async(self._parent(name))) for name in names]
        queues: list[tuple[str, list[Any]]] = []
        for name, result in listed:
            try:
                # Ordered by creation below, from each node's stat (see queue_of).
                children = queued(await self._call(result))
            except NoNodeError:
                continue
            parent = self._parent(name)
            queues.append((name, [zk.get_async(f"{parent}/{child}") for child in children]))
        infos = []
        for name, reads in queues:
            entries = []
            for result in reads:
                with suppress(NoNodeError):  # left the queue meanwhile
                    entries.append(await self._call(result))
            entries.sort(key=lambda entry: entry[1].czxid)
            if entries:
                infos.append(_info(name, entries))
        return infos

    async def _inspect(self, _: bool, name: str) -> LockInfo | None:
        zk = await self._client()
        await self._catch_up(zk)
        infos = await self._infos(zk, [name])
        if not infos:
            await self._check_chroot(zk)
        return infos[0] if infos else None

    async def inspect(self, name: str) -> LockInfo | None:
        self._follow_fork()
        info: LockInfo | None = await self._guarded(partial(self._inspect, name=name))
        return info

    async def _list(self, _: bool, prefix: str) -> list[LockInfo]:
        zk = await self._client()
        await self._catch_up(zk)
        try:
            nodes = await self._call(zk.get_children_async(self._root or "/"))
        except NoNodeError:
            await self._check_chroot(zk)
            return []
        names = sorted(
            name for name in (_decoded(node) for node in nodes) if name and name.startswith(prefix)
        )
        return await self._infos(zk, names)

    async def list(self, prefix: str) -> list[LockInfo]:
        self._follow_fork()
        infos: list[LockInfo] = await self._guarded(partial(self._list, prefix=prefix))
        return infos

    async def _force_release(self, retrying: bool, name: str, deleted: builtins.list[str]) -> bool:
        """``deleted``: the holder's node whose delete was sent, kept across runs. Run
        again after a dropped connection, the delete may have been applied with its
        reply lost: the head of the queue is then the next holder, handed the lock by
        that delete, and not for this call to end. Only the node tried is deleted."""
        zk = await self._client()
        await self._catch_up(zk)
        if retrying and deleted:
            with suppress(NoNodeError):  # gone: our delete (or its holder's release)
                await self._call(zk.delete_async(deleted[0]))
            return True
        parent = self._parent(name)
        while True:
            try:
                found, stat = await self._call(zk.get_children_async(parent, include_data=True))
                children = await self._queue(zk, parent, (found, stat))
            except NoNodeError:
                await self._check_chroot(zk)
                return False
            if not children:
                if not found:  # not a node of someone else's (such as /zookeeper)
                    await self._prune(zk, parent)
                return False
            deleted[:] = [f"{parent}/{children[0]}"]
            try:
                await self._call(zk.delete_async(deleted[0]))
                return True
            except NoNodeError:
                continue  # released meanwhile: the next in line now holds it

    async def _prune(self, zk: KazooClient, parent: str) -> None:
        """Drop an empty lock node (a create racing with this just makes it again)."""
        with suppress(NoNodeError, NotEmptyError):
            await self._call(zk.delete_async(parent))

    async def force_release(self, name: str) -> bool:
        self._follow_fork()
        deleted: builtins.list[str] = []  # the class's own list() shadows the type
        freed: bool = await self._guarded(partial(self._force_release, name=name, deleted=deleted))
        return freed

    async def _close(self) -> None:
        self._closed = True
        self._reaper_wakeup.set()
        await join(self._reaper, timeout=1.0)
        zk = self._zk
        if zk is None:
            return
        if self._owns_client:
            await self._delete_orphans_before_stop()
        zk.remove_listener(self._on_state)
        if self._owns_client:
            # Ending the session makes the ensemble delete every node it made. kazoo's
            # stop waits for the server to answer its close, up to 2/3 of the session
            # timeout (13 s of a 20 s session), on a server that does not answer: in a
            # thread of its own, waited for an operation timeout at most, and not at all
            # once a request went unanswered (a release just now). Left running, it ends
            # by itself; the nodes go with the session, as a crashed client's do.
            stopping = threading.Thread(
                target=self._stop_quietly, args=(zk,), name="dlock-zookeeper-stop", daemon=True
            )
            stopping.start()
            await run_blocking(stopping.join, 0.0 if self._silent() else self._op_timeout)
        else:
            await self._delete_own_nodes(zk)

    async def _delete_orphans_before_stop(self) -> None:
        """Delete the given-up nodes (releases cut off by an outage) before the session
        ends, the connection given up to an operation timeout to come back (not into
        a silence: see _silent). Ending the session deletes them only if its close
        reaches the server: kazoo's stop on a connection just dropped (an outage that
        ends resets it), or while it reconnects, gives the session up instead, and
        they kept their locks until it expired, though the server answers again."""
        deadline = time.monotonic() + self._op_timeout
        while self._orphans and not self._silent():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await run_blocking(self._connected.wait, remaining):
                return
            await self._delete_orphans()
            if self._orphans:
                await sleep(POLL)  # a request failed on the dropped connection

    async def _delete_own_nodes(self, zk: KazooClient) -> None:
        """The caller's session outlives us: delete our nodes ourselves (best effort),
        or a lock not renewed would never end."""
        for node in self._nodes.values():
            self._unwatch(node)
        paths = [n.path for n in self._nodes.values() if n.session == self._session_id]
        # An orphan's path that names a node of ours made since is deleted already.
        paths.extend(path for path in self._orphans if path not in paths)
        self._nodes.clear()
        self._orphans.clear()
        for result in [zk.delete_async(path) for path in paths]:
            try:
                await self._call(result)
            except (NoNodeError, *CLIENT_ERRORS):
                logger.debug("dlock: could not delete a node on close", exc_info=True)
        for key in list(self._lost_creates):
            try:
                await self._drop_lost_create(zk, key)
            except CLIENT_ERRORS:
                logger.debug("dlock: could not delete a node on close", exc_info=True)

    async def aclose(self) -> None:
        self._follow_fork()
        await self._close()

    def _stop_quietly(self, zk: KazooClient) -> None:
        try:
            self._stop_once(zk)
        except CLIENT_ERRORS:
            logger.debug("dlock: error closing the ZooKeeper client", exc_info=True)

    def _stop_once(self, zk: KazooClient) -> None:
        """Stop and close ``zk``, once. A close cut off (cancelled) while its stop ran
        in a thread left that stop running, and a second close's raced it: kazoo raised
        a bare Exception ("Cannot close connection until it is stopped")."""
        with self._stopping:
            if zk is not self._stopped:
                zk.stop()
                zk.close()
                self._stopped = zk


BACKEND = AsyncZooKeeperBackend
