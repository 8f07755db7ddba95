"""etcd: a key per held lock, bound to a lease of its own, through etcd's v3 JSON gateway.

Acquiring is one transaction: if the key was never created (``create_revision == 0``),
put it with a lease granted for this acquisition; else read it. The fencing token is
the key's create revision, the cluster-wide revision of that put, which only grows.
Every later write of the key (re-entry, release, extend) compares its ``mod_revision``
with the one it last saw, so nothing is read and then written blindly. The lease, on the
server's clock, frees the key of a holder that stopped renewing (crashed, paused); a live
holder whose own ttl runs out unrenewed revokes its lease itself (the reaper), since
etcd counts leases in whole seconds and may keep it a little longer. Waiters watch the
key from the revision their attempt saw, so no release between the attempt and the
watch is missed.

Waiters queue, in arrival order: a waiter's busy attempt puts a key of its own in the
name's queue, bound to a waiter lease kept alive while it waits (so a waiter that
crashed loses its place after ``queue_ttl``): one task of the client (a thread in the
sync face) renews all its waiters' places together. A grant needs the lock key never
created and no queue key older than the attempt's own (none at all for an attempt
without a place), and deletes the attempt's queue key. Each waiter watches the deletion
of the queue key just ahead of its own, the head the lock key's: a release wakes only
the head.

The HTTP calls go through httpx, whose ``AsyncClient`` and ``Client`` have the same API,
so this one module generates the sync face. With ``user:password@`` in the URL, every call
carries the token of one authentication, made at first use and again when the server
says the token expired (a refusal that comes before anything is applied).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import copy
import hashlib
import json
import math
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx

from ..._errors import BackendError, BackendUnavailable, ConfigurationError
from ..._fork import ForkFollower
from ..._options import bounded_seconds, flag, query_options
from ..._registry import split_url
from ..._tls import (
    certificate_refused,
    handshake_cut_off,
    load_client_files,
    whose_certificate,
)
from ..._types import Acquired, Busy, Holder, Lease, LockInfo
from ..._validation import name_bytes, name_from_bytes
from .._primitives import (
    IS_ASYNC,
    Mutex,
    WakeupEvent,
    current_task,
    run_detached,
    serving,
    shielded,
    spawn,
)
from ..backend import AsyncBackend, AsyncWaiter

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/dlock"
#: Seconds one request may take (connecting, then waiting for the answer).
TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
TLS_OPTIONS = ("ca", "certfile", "keyfile", "keyfile_password", "verify_certs")
OPTIONS = frozenset({"timeout", "connect_timeout", "queue_ttl", *TLS_OPTIONS})
#: Seconds a waiter's place in a queue outlives its last keepalive (as Redis's).
QUEUE_TTL = 6.0
#: What follows the prefix in the queues' keys: no lock key has it there, as lock names
#: and prefixes are UTF-8, in which the byte 0xFF never occurs.
QUEUE_MARK = b"\xffqueue/"
#: etcd's longest lease (its ``MaxLeaseTTL``).
MAX_LEASE = 9_000_000_000
#: gRPC status codes that mean the request may or may not have been applied: the leader
#: was lost or the proposal timed out (UNAVAILABLE), a deadline passed, it was cut off.
UNSURE_CODES = frozenset({1, 4, 14})
#: etcd's default limit of operations in one transaction (``--max-txn-ops``).
MAX_TXN_OPS = 128
#: Keepalives sent in one request (see _keepalive).
KEEPALIVE_BATCH = 64
#: What the server answers a request whose token ran out (``--auth-token-ttl``, 300 s by
#: default, counted from the token's last use) or was never issued by it: refused
#: before anything was applied, so the request is sent again with a new token.
INVALID_TOKEN = "invalid auth token"
#: What it answers a request without a token when authentication is enabled.
NO_USER = "user name is empty"
#: What it answers an authentication with a wrong user name or password.
AUTH_FAILED = "authentication failed"
#: What it answers an authentication when authentication is not enabled.
AUTH_DISABLED = "authentication is not enabled"
PERMISSION_DENIED = "permission denied"
#: A request refused for a lease that has ended (revoked, or run out).
LEASE_NOT_FOUND = "lease not found"
#: Rounds of a compare-and-write that lost to a write of the same owner token (another
#: user of the lock object) before giving up.
ROUNDS = 20
#: A revoke the cluster could not answer (a member down or silent) is asked again by the
#: reaper, with every other one left unanswered, first after this many seconds, then
#: twice as long each round left unanswered up to REVOKE_RETRY_MAX, for
#: REVOKE_RETRY_FOR at most. etcd starts every lease's TTL afresh when a member becomes
#: leader (a restart, a failover): left alone, a waiter's place or a lost hold kept a
#: free lock out of reach for its whole TTL after the cluster was back.
REVOKE_RETRY_FIRST = 0.2
REVOKE_RETRY_MAX = 2.0
REVOKE_RETRY_FOR = 300.0
#: The most leases kept to revoke again (each is a few dozen bytes).
MAX_UNREVOKED = 10_000


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def lease_seconds(ttl: float) -> int:
    """The lease granted for ``ttl``: whole seconds, never shorter (etcd may lengthen it
    to its minimum; the holder gives it up at its ttl itself)."""
    return min(MAX_LEASE, max(1, math.ceil(ttl)))


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\x00"  # every key
    end[-1] += 1
    return bytes(end)


@dataclass(frozen=True)
class _Credentials:
    """A user of etcd's own authentication; the password is never shown (repr)."""

    user: str
    password: str = field(repr=False)


class _TokenRefused(BackendError):
    """The server refused the request's token (expired, or none sent): nothing was
    applied, and the request may be sent again once a new token is at hand."""


@dataclass
class _Held:
    """What this process knows of a lease it holds: the lease and the TTL asked for it,
    the key as we last wrote it (its value, and its revision then), and when the
    holder's own ttl runs out (on this host's monotonic clock)."""

    lease: int
    asked: int
    value: _Value
    mod_revision: int
    deadline: float


@dataclass
class _Place:
    """A waiter's place in its name's queue: the waiter lease its queue key is bound to,
    the key's create revision (its rank), when the lease was last renewed (on this
    host's monotonic clock; by the keeper, see _keep_places), and the key whose deletion
    the waiter waits for (the one just ahead in the queue, or the lock's), as a read at
    revision ``watch_from`` - 1 found it (created at ``watch_created``).

    ``quiet``: the last wait ended at its timeout (its watch's, or the rest of it taken
    by a look), having seen that key stay: an attempt now would find the queue and the
    lock as the last one did, so none is sent (the core's fallback timer costs no
    writes). The next wait counts from the place's last sight of that key, so a change
    meanwhile still ends it at once."""

    lease: int
    rank: int
    renewed: float
    watch: str
    watch_from: int
    watch_created: int = 0
    quiet: bool = False
    #: Our grant deleted the queue key: the lease holds nothing any more.
    used: bool = False
    #: The keeper found the lease ended: the next attempt takes a place at the back.
    lapsed: bool = False
    #: Why the keeper's last renewal failed (the cluster did not answer it, or refused
    #: it): the waiter's next wait raises it, as a wait that renewed its place did.
    unrenewed: BackendError | None = None

    def follow(self, key: str, kv: dict[str, Any], revision: int) -> None:
        """Wait next for the deletion of ``key``, found as ``kv`` by a read at
        ``revision``."""
        self.watch, self.watch_created = key, int(kv["create_revision"])
        self.watch_from = revision + 1


@dataclass(frozen=True)
class _Value:
    token: str
    count: int
    ttl: float
    holder: dict[str, Any]

    def dump(self) -> str:
        return b64(
            json.dumps(
                {"token": self.token, "count": self.count, "ttl": self.ttl, "holder": self.holder},
                separators=(",", ":"),
            ).encode("utf-8")
        )

    @classmethod
    def load(cls, kv: dict[str, Any]) -> _Value:
        try:
            data = json.loads(unb64(kv.get("value")))
            return cls(str(data["token"]), int(data["count"]), float(data["ttl"]), data["holder"])
        except (ValueError, KeyError, TypeError):
            # Not written by dlock: nobody's token, held as long as it exists.
            return cls("", 1, math.inf, {})


#: Requests share a few connections: httpx's pool matches every request against
#: every connection it has, and every idle one against all of them (httpcore 1.0), so
#: each request cost CPU in proportion to the square of the connections a burst had
#: opened. Those past the cap wait their turn (within the request timeout), never
#: failed: a request is short. Idle ones are not capped apart: past that cap httpcore
#: closed idle connections, at times one just lent to a thread that had not begun its
#: request yet, whose read then failed (EBADF) with etcd fine. Under asyncio the cap is
#: lower: every request's CPU is the one event loop's, and there each connection costs
#: more (anyio answers httpcore's check of an idle one with a getpeername per call),
#: so past a few they cost waiters more CPU than they save in waiting: 120 waiters of
#: one client took their locks with 2.7-3.2 s of CPU at 2, 3.4-4.2 s at 4, 4.7-5.1 s at
#: 8 and 6.6-9.3 s at 32. Threads gain from more (2.8 s at 32, 6.3-7.2 s at 4).
#: Nor are idle ones closed for their age (httpx's keepalive expiry, 5 s), for the same
#: reason: one idle past it was closed at another request's pass through the pool
#: after being lent, and its request failed (EBADF). The waiters' places renewed by the
#: keeper, a client's connections sit idle for as long as its waiters wait. The server
#: closing one makes it readable, which the pool checks before lending it.
REQUEST_LIMITS = httpx.Limits(
    max_connections=8 if IS_ASYNC else 32, max_keepalive_connections=None, keepalive_expiry=None
)
#: Watches are not capped: each holds a connection for as long as its wait, and a cap
#: left the rest waiting out their pool timeout (PoolTimeout, with etcd fine).
WATCH_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)


async def _closed(response: httpx.Response) -> httpx.Response:
    """``response``, closed: a streamed one read no further (or by nobody, its caller
    cancelled) must give its connection back."""
    await response.aclose()
    return response


def _waiter_holder(kv: dict[str, Any]) -> Holder:
    """The holder a queue key records (see ``_take_place``)."""
    try:
        return Holder.from_json(json.dumps(json.loads(unb64(kv.get("value")))["holder"]))
    except (ValueError, KeyError, TypeError):
        return Holder.from_json("{}")


def _parse_hosts(netloc: str, default_port: int) -> list[tuple[str, int]]:
    hosts = []
    for item in netloc.split(","):
        host, port_text = item, ""
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            if rest and not rest.startswith(":"):
                raise ConfigurationError(f"bad etcd host {item!r}")
            port_text = rest[1:]
        elif ":" in item:
            host, _, port_text = item.rpartition(":")
            if ":" in host:
                # Else "::1" was host "::" and port 1, and "fe80::1" an invalid URL to
                # httpx at the first request to that member (a failover's, perhaps).
                raise ConfigurationError(
                    f"etcd host {item!r} is not host:port (an IPv6 address is written in"
                    " brackets, [::1]:2379)"
                )
        if not host:
            raise ConfigurationError(f"empty host in etcd URL host list {netloc!r}")
        port = default_port
        if port_text:
            # ASCII digits: "³".isdigit() is true, and int() refuses it.
            if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
                raise ConfigurationError(f"bad port {port_text!r} in etcd host {item!r}")
            port = int(port_text)
        hosts.append((host, port))
    return hosts


def _ssl_context(settings: dict[str, Any]) -> ssl.SSLContext:
    verify = flag(settings.get("verify_certs", True), "verify_certs")
    certfile, keyfile = settings.get("certfile"), settings.get("keyfile")
    password = settings.get("keyfile_password")
    if not certfile and (keyfile or password):
        raise ConfigurationError("etcd TLS: keyfile and keyfile_password need certfile")
    ca = settings.get("ca")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if not ca:
        context.load_default_certs()  # given a CA, only that one is trusted
    load_client_files(context, "etcd", ca=ca, certfile=certfile, keyfile=keyfile, password=password)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class AsyncEtcdWaiter(AsyncWaiter):
    """Waits for its turn: watches the key ahead of its place in the queue (or the
    lock's, at the head) for its deletion, keeping the place alive meanwhile."""

    notifies = True

    def __init__(self, backend: AsyncEtcdBackend, name: str, token: str) -> None:
        self.backend = backend
        self.name = name
        self.token = token

    async def wait(self, timeout: float) -> None:
        await self.backend._wait_turn(self.name, self.token, timeout)


class AsyncEtcdBackend(AsyncBackend):
    #: A waiter holds a place in the name's queue, kept across its attempts.
    queues_waiters = True

    def __init__(
        self,
        hosts: list[tuple[str, int]],
        prefix: bytes,
        *,
        tls: ssl.SSLContext | None,
        timeout: float,
        connect_timeout: float,
        credentials: _Credentials | None = None,
        queue_ttl: float = QUEUE_TTL,
    ) -> None:
        scheme = "https" if tls is not None else "http"
        self._endpoints = [
            f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
            for host, port in hosts
        ]
        self._where = ",".join(f"{host}:{port}" for host, port in hosts)
        self._current = 0
        self._prefix = prefix
        self._tls = tls
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._connect_timeout = connect_timeout
        self._queue_ttl = queue_ttl
        self._client: httpx.AsyncClient | None = None
        #: Watches apart, not capped (see REQUEST_LIMITS and WATCH_LIMITS).
        self._watcher: httpx.AsyncClient | None = None
        self._loop: Any = None
        self._closed = False
        self._creating = threading.Lock()
        #: Guards _held and _busy, shared with the reaper (a thread in the sync face).
        self._lock = threading.Lock()
        #: (name, token) -> our calls on its key in flight.
        self._busy: dict[tuple[str, str], int] = {}
        #: (name, token) -> what we hold.
        self._held: dict[tuple[str, str], _Held] = {}
        #: (name, token) of waiters -> their place in the name's queue.
        self._places: dict[tuple[str, str], _Place] = {}
        self._waiting: set[tuple[str, str]] = set()
        #: Leaves of waiters cancelled, going on by themselves (kept from the collector).
        self._leaves: set[Any] = set()
        #: Leases that a leave or give-back running by itself (see run_detached) has
        #: not yet revoked: the close revokes them, as it does not wait for those.
        self._cut_off: set[int] = set()
        self._reaper: Any = None
        self._reaper_wakeup = WakeupEvent()
        self._reaper_next = math.inf
        #: Starting and ending the reaper and the keeper.
        self._reaper_lock = threading.Lock()
        #: Renews the places together (see _keep_places); started by the first place.
        self._keeper: Any = None
        self._keeper_wakeup = WakeupEvent()
        #: The waiters' watches open, by the endpoint each went to (see _cut_watches).
        self._watches: dict[int, set[httpx.Response]] = {}
        #: Leases of places that a grant emptied, for the reaper to revoke.
        self._emptied: list[int] = []
        #: Leases whose revoke went unanswered, for the reaper to revoke again (each
        #: until when to keep asking), all in one round at _revoke_at; the wait before
        #: the next round after one left unanswered (see REVOKE_RETRY_FIRST).
        self._unrevoked: dict[int, float] = {}
        self._revoke_at = math.inf
        self._revoke_delay = REVOKE_RETRY_FIRST
        #: When a revoke last went unanswered.
        self._unanswered_at = -math.inf
        self._credentials = credentials
        #: The token of the last authentication; "" when the server said it has
        #: authentication disabled (nothing to send), None before the first one.
        self._auth_token: str | None = None
        #: One authentication at a time; the others wait for its token.
        self._authenticating = Mutex()
        self._follow_fork = ForkFollower(self._forget_parent)

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> AsyncEtcdBackend:
        parts = split_url(url)
        scheme = parts.scheme.lower()
        netloc = parts.netloc
        credentials: _Credentials | None = None
        if "@" in netloc:
            userinfo, netloc = netloc.rsplit("@", 1)
            user, _, password = userinfo.partition(":")
            if not user:
                raise ConfigurationError("etcd credentials need a user name (user:password@)")
            credentials = _Credentials(unquote(user), unquote(password))
        query = query_options(parts.query)
        settings: dict[str, Any] = {**query, **options}
        unknown = set(settings) - OPTIONS
        if unknown:
            raise ConfigurationError(f"unknown etcd option(s): {', '.join(sorted(unknown))}")
        tls = scheme == "etcds"
        if not tls and any(key in settings for key in TLS_OPTIONS):
            raise ConfigurationError("the TLS options (ca, certfile, ...) need an etcds:// URL")
        hosts = _parse_hosts(netloc or "127.0.0.1", DEFAULT_PORT)
        path = unquote(parts.path) or DEFAULT_PREFIX
        if path == "/":
            path = DEFAULT_PREFIX
        if not path.strip("/"):
            # "//" would be the prefix "/": every key of the cluster a lock name, to
            # list and to force-release (Kubernetes' /registry/... among them).
            raise ConfigurationError(
                f"etcd URL path {parts.path!r} names the root of the key space: give a"
                f" prefix of the locks' own (default {DEFAULT_PREFIX})"
            )
        prefix = path.rstrip("/").encode("utf-8", "surrogateescape") + b"/"
        return cls(
            hosts,
            prefix,
            tls=_ssl_context(settings) if tls else None,
            timeout=bounded_seconds(settings.get("timeout", TIMEOUT), "timeout"),
            connect_timeout=bounded_seconds(
                settings.get("connect_timeout", CONNECT_TIMEOUT), "connect_timeout"
            ),
            credentials=credentials,
            queue_ttl=bounded_seconds(settings.get("queue_ttl", QUEUE_TTL), "queue_ttl"),
        )

    # -- the HTTP client ----------------------------------------------------------

    def _forget_parent(self) -> None:
        """A forked child neither uses the parent's connections nor renews or revokes
        its leases: they are the parent's."""
        self._client = self._watcher = None
        self._held, self._busy, self._places, self._waiting = {}, {}, {}, set()
        self._emptied, self._unrevoked, self._revoke_at = [], {}, math.inf
        self._reaper = self._keeper = None
        # The parent's: shut down here, they would end its watches too.
        self._watches = {}
        self._lock = threading.Lock()
        self._reaper_lock = threading.Lock()
        self._creating = threading.Lock()
        self._authenticating = Mutex()

    def _follow_loop(self) -> None:
        """Connections of an earlier event loop (a client used by two ``asyncio.run``
        calls) cannot be used in another: they are left to the garbage collector."""
        task = current_task()
        loop = None if task is None else task.get_loop()
        if loop is not self._loop:
            with self._creating:
                self._client = self._watcher = None
                self._loop = loop
                self._authenticating = Mutex()

    def _http(self, watch: bool = False) -> httpx.AsyncClient:
        """The HTTP client for requests, or for watches (``watch``)."""
        if self._closed:
            raise self._closed_error()
        self._follow_fork()
        self._follow_loop()
        client = self._watcher if watch else self._client
        if client is None:
            with self._creating:
                client = self._watcher if watch else self._client
                if client is None:
                    # trust_env off: no proxy from the environment between us and etcd.
                    # Plain http makes no TLS: httpx's default (verify=True) loaded the
                    # CA bundle for each client, 50-200 ms of CPU that a short lease's
                    # first acquire spent (on a loaded machine, past its end). A bare
                    # context has no CA, so it would trust no server if ever used.
                    client = httpx.AsyncClient(
                        timeout=self._timeout,
                        verify=self._tls or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
                        trust_env=False,
                        limits=WATCH_LIMITS if watch else REQUEST_LIMITS,
                    )
                    if watch:
                        self._watcher = client
                    else:
                        self._client = client
        return client

    def _closed_error(self) -> BackendError:
        return BackendError(f"etcd {self._where}: the client is closed")

    def _fail(self, exc: BaseException) -> BackendError:
        if certificate_refused(exc):
            return BackendError(
                f"etcd {self._where}: TLS certificate refused: {whose_certificate(exc)}"
                f" (ca, certfile, keyfile): {exc}"
            )
        hint = ""
        tls_cut = self._tls is not None and isinstance(exc, httpx.ConnectError)
        if tls_cut and handshake_cut_off(exc):
            # Unavailable still: the same cut comes from a server going down.
            hint = " (the server cut the TLS handshake off: if it serves plain HTTP, use etcd://)"
        return BackendUnavailable(f"etcd {self._where}: {type(exc).__name__}: {exc}{hint}")

    async def _post(
        self,
        path: str,
        body: dict[str, Any] | bytes,
        *,
        lines: bool = False,
        resend: float | None = None,
    ) -> dict[str, Any]:
        """One gateway call, with the token of our user if we have one. A request whose
        token the server refused (it expired) goes once more with a new token: that
        refusal comes before anything is applied. ``resend``: see ``_send``."""
        self._http()  # a closed client, or a new event loop (with its own mutex), first
        token = await self._token()
        try:
            return await self._send(path, body, lines=lines, token=token, resend=resend)
        except _TokenRefused as exc:
            if self._credentials is None:
                raise BackendError(self._unauthenticated(str(exc))) from None
            token = await self._authenticate(token)
        try:
            return await self._send(path, body, lines=lines, token=token, resend=resend)
        except _TokenRefused as exc:
            raise BackendError(self._unauthenticated(str(exc))) from None

    async def _send(
        self,
        path: str,
        body: dict[str, Any] | bytes,
        *,
        lines: bool,
        token: str | None,
        resend: float | None = None,
    ) -> dict[str, Any]:
        """One gateway call; ``lines``: the answer is a stream of messages, returned as
        ``{"lines": [...]}``. A connection that could not be made (nothing was sent)
        moves on to the next endpoint; anything after sending is not retried: its
        request may have been applied. Except with ``resend``, for a request that does
        no harm if sent twice (a keepalive, a read, a lease grant or revoke): each
        endpoint but the last one tried gets that many seconds to answer, and one that
        does not, or answers that it cannot serve, is left for the next one, which is
        asked the same. (One endpoint alone gets the whole request timeout, as any
        request.)"""
        client = self._http()
        headers = {"Authorization": token} if token else {}
        last: BaseException | None = None
        for tried in range(len(self._endpoints)):
            limit = self._timeout
            if resend is not None and tried < len(self._endpoints) - 1:
                # A host that does not answer the connect is left within connect_timeout
                # here too, not within the resend's whole time.
                limit = httpx.Timeout(resend, connect=min(resend, self._connect_timeout))
            used = self._current
            base = self._endpoints[used]
            try:
                # Shielded: see _stream.
                if isinstance(body, bytes):
                    response = await shielded(
                        client.post(base + path, content=body, headers=headers, timeout=limit)
                    )
                else:
                    response = await shielded(
                        client.post(base + path, json=body, headers=headers, timeout=limit)
                    )
            except RuntimeError as exc:
                # httpx's "the client has been closed": a close() came between taking
                # the client and sending (a cut-off caller's revoke, in the background).
                if not self._closed:
                    raise
                raise self._closed_error() from exc
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if certificate_refused(exc):
                    raise self._fail(exc) from exc
                last = exc
                self._move_on(used)
                continue
            except httpx.HTTPError as exc:
                failure = self._left(used, self._fail(exc))
                if resend is None:
                    raise failure from exc
                last = exc
                continue
            if lines and response.status_code == 200:
                try:
                    messages = [json.loads(line) for line in response.content.splitlines() if line]
                except ValueError:
                    raise BackendError(f"etcd {self._where}: unreadable answer") from None
                for message in messages:
                    refused = message.get("error")
                    if refused is not None and self._token_refused(refused):
                        raise self._refusal(refused)
                return {"lines": messages}
            try:
                return self._answer(response.status_code, response.content)
            except BackendUnavailable as exc:
                if resend is None:
                    raise self._left(used, exc) from None
                self._left(used, exc)
                last = exc
        assert last is not None
        if isinstance(last, BackendError):
            raise last
        raise self._fail(last) from last

    def _move_on(self, used: int) -> None:
        """Send the next requests to the host after endpoint ``used``, unless another
        call has moved on from it already."""
        if self._current == used:
            self._current = (used + 1) % len(self._endpoints)
            if len(self._endpoints) > 1:
                self._cut_watches(used)

    def _cut_watches(self, used: int) -> None:
        """End the waiters' watches on endpoint ``used``, which the client has left: a
        watch runs its waiter's whole wait (its place renewed by the keeper meanwhile),
        and one on a member that hangs heard no release until the wait's end (a 30 s
        fallback: 30 s). Each ends as its stream does (shut down under it, whichever
        thread or task reads it) with BackendUnavailable, which ends the wait (see
        _wait_turn): the next attempt goes to the member the client moved to."""
        for response in builtins.list(self._watches.get(used, ())):
            stream = response.extensions.get("network_stream")
            # A socket.socket, or asyncio's TransportSocket (which has shutdown too).
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    @contextlib.contextmanager
    def _watching(self, used: int, response: httpx.Response) -> Iterator[None]:
        """Note ``response`` as a watch open on endpoint ``used`` (see _cut_watches)."""
        watches = self._watches.setdefault(used, set())
        watches.add(response)
        try:
            if self._current != used:
                self._cut_watches(used)  # left while this watch was being opened
            yield
        finally:
            watches.discard(response)

    def _left(self, used: int, error: BackendError) -> BackendError:
        """A request sent to endpoint ``used`` got no usable answer: it is not sent
        again (it may yet be applied), but when that host is unavailable (paused, hung,
        cut off from its quorum) the next request goes to the next host, rather than
        every one waiting out its timeout there."""
        if isinstance(error, BackendUnavailable):
            self._move_on(used)
        return error

    def _answer(self, status: int, content: bytes) -> dict[str, Any]:
        try:
            data = json.loads(content)
        except ValueError:
            data = None
        if status == 200 and isinstance(data, dict):
            return data
        if isinstance(data, dict) and "error" in data:
            raise self._refusal(data)
        text = content[:200].decode("utf-8", "replace")
        if status >= 500:
            raise BackendUnavailable(f"etcd {self._where}: HTTP {status}: {text}")
        raise BackendError(f"etcd {self._where}: HTTP {status}: {text}")

    def _refusal(self, data: dict[str, Any]) -> BackendError:
        error = data.get("error")
        message = data.get("message") or (
            error.get("message") if isinstance(error, dict) else error
        )
        code = data.get("code") or (error.get("grpc_code") if isinstance(error, dict) else None)
        if code in UNSURE_CODES:
            return BackendUnavailable(f"etcd {self._where}: {message}")
        if self._token_refused(data):
            return _TokenRefused(f"etcd {self._where}: {message}")
        if PERMISSION_DENIED in str(message):
            return BackendError(self._denied())
        return BackendError(f"etcd {self._where}: {message}")

    @staticmethod
    def _token_refused(data: Any) -> bool:
        """Whether an error (``{"message": ...}``, or a watch's cancel reason) says the
        request's token was missing or refused."""
        text = str(data.get("message") or data.get("error")) if isinstance(data, dict) else data
        return INVALID_TOKEN in str(text) or NO_USER in str(text)

    def _unauthenticated(self, message: str) -> str:
        if self._credentials is None:
            return (
                f"etcd {self._where}: the server has authentication enabled: credentials"
                " are needed (etcd://user:password@host/prefix)"
            )
        return f"etcd {self._where}: user {self._credentials.user!r} was not let in: {message}"

    def _denied(self) -> str:
        end = prefix_end(self._prefix)
        who = f"user {self._credentials.user!r}" if self._credentials else "this client"
        return (
            f"etcd {self._where}: permission denied to {who} on the lock keys under"
            f" {self._prefix.decode('utf-8', 'replace')!r}: dlock needs readwrite on the"
            f" range [{self._prefix.decode('utf-8', 'replace')!r},"
            f" {end.decode('utf-8', 'replace')!r})"
        )

    # -- authentication ----------------------------------------------------------------

    async def _token(self) -> str | None:
        """The token to send: none without credentials; else the current one, after
        authenticating if this client has not yet (lazily: ``connect`` sends nothing)."""
        if self._credentials is None:
            return None
        token = self._auth_token
        if token is None:
            token = await self._authenticate(None)
        return token

    async def _authenticate(self, stale: str | None) -> str:
        """A new token in place of ``stale`` (the one refused, or None at first). Calls
        that find it stale together authenticate once: the others take its token."""
        credentials = self._credentials
        assert credentials is not None
        async with self._authenticating:
            if self._auth_token is not None and self._auth_token != stale:
                return self._auth_token
            body = {"name": credentials.user, "password": credentials.password}
            try:
                answer = await self._send("/v3/auth/authenticate", body, lines=False, token=None)
            except BackendUnavailable:
                raise
            except BackendError as exc:
                if AUTH_DISABLED in str(exc):
                    # Nothing to send: every request is let in. Should the server enable
                    # authentication later, its refusals bring us back here.
                    self._auth_token = ""
                    return ""
                if AUTH_FAILED in str(exc):
                    raise BackendError(
                        f"etcd {self._where}: authentication failed for user"
                        f" {credentials.user!r}: wrong user name or password"
                    ) from None
                raise
            token = answer.get("token")
            if not isinstance(token, str) or not token:
                raise BackendError(f"etcd {self._where}: authentication answered no token")
            self._auth_token = token
            return token

    # -- keys and leases ------------------------------------------------------------

    def _key(self, name: str) -> bytes:
        return self._prefix + name_bytes(name)

    def _queue(self, name: str) -> bytes:
        """The prefix of ``name``'s queue keys: a hash of the name, of one length for
        every name, so that no name's queue range holds another's keys."""
        digest = hashlib.sha256(name_bytes(name)).hexdigest().encode("ascii")
        return self._prefix + QUEUE_MARK + digest + b"/"

    def _queue_range(self, name: str) -> dict[str, str]:
        queue = self._queue(name)
        return {"key": b64(queue), "range_end": b64(prefix_end(queue))}

    def _place_key(self, name: str, token: str) -> str:
        return b64(self._queue(name) + token.encode("utf-8", "surrogateescape"))

    async def _grant(self, ttl: int) -> tuple[int, int]:
        """A new lease, asked again of the next member where one does not answer: a
        grant that one applies after all is a lease no key uses, which ends by its TTL.
        Every acquire begins with one, so a member that hangs costs the acquire a
        while, not the acquire."""
        answer = await self._post("/v3/lease/grant", {"TTL": str(ttl)}, resend=self._resend_after())
        if answer.get("error"):
            raise BackendError(f"etcd {self._where}: lease not granted: {answer['error']}")
        return int(answer["ID"]), int(answer["TTL"])

    async def _revoke(self, lease: int) -> bool:
        """Revoke ``lease`` (deleting the keys bound to it); False if it was gone. Asked
        again of the next member where one does not answer: every lease revoked is ours
        alone, to be ended, so a revoke applied twice, or late, ends nothing else; left
        to a member that hangs, a waiter's place would hold up the queue until its
        lease ran out."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease)}, resend=self._resend_after())
        except BackendError as exc:
            if LEASE_NOT_FOUND in str(exc):
                return False
            raise
        return True

    def _revoke_by_itself(self, lease: int, name: str) -> None:
        """Revoke the lease of a caller cut off (a cancellation, a Ctrl-C) by itself,
        noted until that has run, so that a close meanwhile revokes it (else a process
        that closes and exits at once left a waiter's place, or a lock put for nobody,
        to hold up the others until its lease ran out)."""
        self._cut_off.add(lease)

        async def revoke() -> None:
            try:
                await self._revoke_quietly(lease)
            finally:
                self._cut_off.discard(lease)

        run_detached(revoke, self._leaves, name)

    async def _revoke_quietly(self, lease: int) -> bool:
        """Revoke a lease of ours that no key of ours needs; False if the cluster did
        not answer. Such a revoke is asked again by the reaper (see
        REVOKE_RETRY_FIRST), else the lease ends by its TTL. One refused (an error
        that asking again would not change) is left to its TTL too."""
        try:
            await self._revoke(lease)
        except BackendUnavailable:
            self._revoke_later(lease)
            return False
        except BackendError:
            pass
        # The cluster answers: a next round needs no long wait.
        self._revoke_delay = REVOKE_RETRY_FIRST
        if self._unrevoked:
            with self._lock:
                self._unrevoked.pop(lease, None)
        return True

    def _revoke_later(self, lease: int) -> None:
        now = self._unanswered_at = time.monotonic()
        with self._lock:
            if lease not in self._unrevoked:
                if len(self._unrevoked) >= MAX_UNREVOKED:
                    return
                self._unrevoked[lease] = now + REVOKE_RETRY_FOR
            if self._revoke_at != math.inf:
                return  # a round is due already: this one joins it
            self._revoke_at = at = now + self._revoke_delay
            self._revoke_delay = min(self._revoke_delay * 2, REVOKE_RETRY_MAX)
        self._start_reaper(at)

    async def _keepalive(self, leases: builtins.list[int], resend: float | None = None) -> set[int]:
        """Renew each lease to its granted TTL; return those that were still alive.

        The gateway streams one keepalive per line of the request, and answers each in a
        line, but under load it may end its answer before it has given them all (seen
        from 32 lines on, etcd 3.4). A renewal can be sent twice harmlessly, so the
        unanswered ones go again, until every lease has its answer."""
        alive: set[int] = set()
        left = builtins.list(dict.fromkeys(leases))
        for _ in range(ROUNDS):
            if not left:
                return alive
            batch = left[:KEEPALIVE_BATCH]
            body = "".join(json.dumps({"ID": str(lease)}) + "\n" for lease in batch)
            answer = await self._post(
                "/v3/lease/keepalive", body.encode("ascii"), lines=True, resend=resend
            )
            answered = set()
            for message in answer["lines"]:
                result = message.get("result")
                if not isinstance(result, dict):
                    raise self._refusal(message)
                lease = int(result.get("ID", 0))
                answered.add(lease)
                if int(result.get("TTL", 0)) > 0:  # a zero is left out of the JSON
                    alive.add(lease)
            left = [lease for lease in left if lease not in answered]
        if left:
            raise BackendUnavailable(f"etcd {self._where}: keepalives left unanswered")
        return alive

    async def _txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
        resend: float | None = None,
    ) -> dict[str, Any]:
        """``resend`` only for a transaction that only reads (see ``_send``)."""
        body: dict[str, Any] = {"compare": compare, "success": success}
        if failure:
            body["failure"] = failure
        return await self._post("/v3/kv/txn", body, resend=resend)

    @staticmethod
    def _ranged(answer: dict[str, Any], index: int = 0) -> dict[str, Any] | None:
        """The key read by the ``index``-th range of a transaction's answer, if any."""
        responses = answer.get("responses") or []
        kvs = responses[index].get("response_range", {}).get("kvs") or []
        return kvs[0] if kvs else None

    @staticmethod
    def _revision(answer: dict[str, Any]) -> int:
        return int(answer["header"]["revision"])

    def _begin(self, ident: tuple[str, str]) -> _Held | None:
        """Count one of our calls on ``ident``'s key as in flight (the reaper leaves its
        lease alone meanwhile); return what we hold there, if anything. A lease the
        reaper has taken is no longer held: a call that begins after is told so."""
        with self._lock:
            self._busy[ident] = self._busy.get(ident, 0) + 1
            return self._held.get(ident)

    def _end(self, ident: tuple[str, str]) -> None:
        with self._lock:
            left = self._busy.pop(ident, 1) - 1
            if left:
                self._busy[ident] = left
            held = self._held.get(ident)
        if not left and held is not None:
            # The reaper's wait left this hold out while it was in use (an extend that
            # moved or renewed it, an acquire): it counts again, with its new deadline.
            self._start_reaper(held.deadline)

    @contextlib.contextmanager
    def _using(self, ident: tuple[str, str]) -> Iterator[_Held | None]:
        held = self._begin(ident)
        try:
            yield held
        finally:
            self._end(ident)

    def _hold(self, ident: tuple[str, str], held: _Held) -> None:
        with self._lock:
            self._held[ident] = held
        self._start_reaper(held.deadline)

    def _drop(self, ident: tuple[str, str], lease: int | None = None) -> None:
        with self._lock:
            held = self._held.get(ident)
            if held is not None and (lease is None or held.lease == lease):
                del self._held[ident]

    # -- the seam --------------------------------------------------------------------

    async def acquire(
        self, name: str, token: str, ttl: float, holder: Holder, reentrant: bool
    ) -> Acquired | Busy:
        ident = (name, token)
        place = self._places.get(ident)
        if place is not None and place.quiet and not place.lapsed and ident in self._waiting:
            return Busy()
        with self._using(ident):
            sent = time.monotonic()
            asked = lease_seconds(ttl)
            lease, _ = await self._grant(asked)
            try:
                return await self._acquire(
                    ident,
                    token,
                    _Value(token, 1, ttl, json.loads(holder.to_json())),
                    reentrant,
                    lease,
                    asked,
                    sent + ttl,
                )
            except BackendError as exc:
                if not reentrant:
                    # Ours alone: if the put went through, this revokes it (a give-back).
                    await self._revoke_quietly(lease)
                if LEASE_NOT_FOUND in str(exc) and not isinstance(exc, BackendUnavailable):
                    # A lease granted for this attempt (the lock's, or its place's in
                    # the queue) ran out before its put came: etcd or this client
                    # stalled longer than its TTL. Nothing was put, and a stall is
                    # worth waiting out, as a grant that comes too late.
                    queued = lease_seconds(self._queue_ttl)
                    raise BackendUnavailable(
                        f"{exc}: a lease granted for this acquire ended before its put"
                        f" reached etcd (the lock's of {asked} s, or its place's in the"
                        f" queue of {queued} s: a stall that long)"
                    ) from exc
                raise
            except BaseException:
                # Cut off (cancelled) with its put perhaps in flight, which runs on to
                # its answer (shielded) and may take the lock for nobody after the
                # core's give-back found nothing to release: the name stayed held until
                # the give-back looked again, a second later. Revoking the put's lease
                # ends it whichever lands first: a put on a revoked lease is refused,
                # and a revoke deletes the key the put made. By itself: the caller sees
                # its cancellation at once.
                if not reentrant:
                    self._revoke_by_itself(lease, "dlock-give-back")
                raise

    async def _acquire(
        self,
        ident: tuple[str, str],
        token: str,
        value: _Value,
        reentrant: bool,
        lease: int,
        asked: int,
        deadline: float,
    ) -> Acquired | Busy:
        name = ident[0]
        key = b64(self._key(name))
        waiting = ident in self._waiting
        for _ in range(ROUNDS):
            place = self._places.get(ident) if waiting else None
            success: list[dict[str, Any]] = [
                {"request_put": {"key": key, "value": value.dump(), "lease": str(lease)}}
            ]
            failure: list[dict[str, Any]] = [{"request_range": {"key": key}}]
            if place is not None:
                success.append({"request_delete_range": {"key": self._place_key(name, token)}})
                failure += self._ahead_reads(name, token, place.rank)
            answer = await self._txn(
                [
                    {"target": "CREATE", "key": key, "create_revision": "0"},
                    *self._first_in_line(name, token, place),
                ],
                success,
                failure,
            )
            revision = self._revision(answer)
            if answer.get("succeeded"):
                self._hold(ident, _Held(lease, asked, value, revision, deadline))
                if place is not None:
                    place.used = True
                return Acquired(revision)
            kv = self._ranged(answer)
            if kv is not None and reentrant and _Value.load(kv).token == token:
                entered = await self._reenter(ident, token, kv, value.ttl, lease, asked, deadline)
                if entered is not None:
                    return entered
                continue
            # (Our own token on a fresh attempt: an attempt cut off in flight, which the
            # core gives back; not ours to count.)
            if waiting and await self._line_up(ident, value, answer, place):
                continue  # at the head, and the lock was released meanwhile
            await self._revoke_quietly(lease)
            return Busy()
        raise BackendError(f"etcd {self._where}: {name!r} kept changing under us")

    def _first_in_line(self, name: str, token: str, place: _Place | None) -> list[dict[str, Any]]:
        """The compares that let an attempt pass only the waiters queued after it: with
        a place of rank r, our own queue key is there, created at r, and every queue key
        of the name was created at r or later; without one, the queue is empty. The
        first: a place that ended before the keeper saw it (a lapse, its lease revoked)
        passed the second when others had queued behind it, and its waiter was granted
        ahead of them, though such a place goes to the back."""
        if place is None:
            return [{"target": "CREATE", **self._queue_range(name), "create_revision": "0"}]
        return [
            {
                "target": "CREATE",
                "key": self._place_key(name, token),
                "create_revision": str(place.rank),
            },
            {
                "target": "CREATE",
                **self._queue_range(name),
                "result": "GREATER",
                "create_revision": str(place.rank - 1),
            },
        ]

    def _ahead_reads(self, name: str, token: str, rank: int) -> list[dict[str, Any]]:
        """Reads of our own queue key, then of the one just ahead of it (the newest
        created before ``rank``), if any."""
        return [
            {"request_range": {"key": self._place_key(name, token)}},
            {
                "request_range": {
                    **self._queue_range(name),
                    "sort_order": "DESCEND",
                    "sort_target": "CREATE",
                    "limit": "1",
                    "max_create_revision": str(rank - 1),
                }
            },
        ]

    async def _reenter(
        self,
        ident: tuple[str, str],
        token: str,
        kv: dict[str, Any],
        ttl: float,
        lease: int,
        asked: int,
        deadline: float,
    ) -> Acquired | None:
        """Count one more entry of the hold ``kv`` shows ours, moving its key to
        ``lease``; None if the key changed meanwhile (the caller looks again)."""
        key = kv["key"]
        found = _Value.load(kv)
        again = _Value(token, found.count + 1, ttl, found.holder)
        answer = await self._txn(
            [{"target": "MOD", "key": key, "mod_revision": kv["mod_revision"]}],
            [{"request_put": {"key": key, "value": again.dump(), "lease": str(lease)}}],
        )
        if not answer.get("succeeded"):
            return None
        self._hold(ident, _Held(lease, asked, again, self._revision(answer), deadline))
        old = int(kv.get("lease", 0))
        if old and old != lease:
            await self._revoke_quietly(old)
        return Acquired(int(kv["create_revision"]), again.count)

    async def _line_up(
        self, ident: tuple[str, str], value: _Value, answer: dict[str, Any], place: _Place | None
    ) -> bool:
        """After a waiter's busy attempt: keep its place (or take one, at the back, if it
        had none or it lapsed), and note whose deletion to wait for, from after the
        revision that showed it still there. True when the waiter is at the head and the
        lock is free: attempt again at once."""
        name = ident[0]
        revision = self._revision(answer)
        lock = self._ranged(answer)
        if place is not None and self._ranged(answer, 1) is not None:
            ahead = self._ranged(answer, 2)
        else:
            if place is not None:
                self._places.pop(ident, None)
                await self._revoke_quietly(place.lease)
            place, revision, lock, ahead = await self._take_place(ident, value)
        if ahead is not None:
            place.follow(ahead["key"], ahead, revision)
        elif lock is not None:
            place.follow(b64(self._key(name)), lock, revision)
        else:
            return True
        return False

    async def _put_place(
        self, ident: tuple[str, str], value: _Value, mine: str
    ) -> tuple[_Place, dict[str, Any]]:
        """Grant a waiter lease and put our queue key on it. A lease that ran out before
        its put came (this client or etcd stalled past queue_ttl: seen on a machine
        overloaded by hundreds of waiters) put nothing; granted anew once, rather than
        fail the acquire."""
        name, token = ident
        record = json.dumps({"token": token, "holder": value.holder}, separators=(",", ":"))
        granted_again = False
        while True:
            sent = time.monotonic()
            lease, _ = await self._grant(lease_seconds(self._queue_ttl))
            # Noted before the put: a waiter cut off meanwhile (cancelled) revokes it as
            # it leaves, rather than leave a place holding up the queue until it ends.
            place = self._places[ident] = _Place(lease, 0, sent, "", 0)
            self._keep_places()
            try:
                answer = await self._txn(
                    [],
                    [
                        {
                            "request_put": {
                                "key": mine,
                                "value": b64(record.encode("utf-8")),
                                "lease": str(lease),
                            }
                        },
                        {"request_range": {"key": b64(self._key(name))}},
                        # The newest two of the queue (a transaction reads its own writes).
                        {
                            "request_range": {
                                **self._queue_range(name),
                                "sort_order": "DESCEND",
                                "sort_target": "CREATE",
                                "limit": "2",
                            }
                        },
                    ],
                )
            except BackendError as exc:
                self._places.pop(ident, None)
                ran_out = LEASE_NOT_FOUND in str(exc) and not isinstance(exc, BackendUnavailable)
                if not ran_out:
                    await self._revoke_quietly(lease)
                if granted_again or not ran_out:
                    raise
                granted_again = True
                continue
            return place, answer

    async def _take_place(
        self, ident: tuple[str, str], value: _Value
    ) -> tuple[_Place, int, dict[str, Any] | None, dict[str, Any] | None]:
        """Put our key at the back of the name's queue, on a waiter lease of its own;
        return the place, the revision then, the lock key and the key just ahead."""
        name, token = ident
        mine = self._place_key(name, token)
        place, answer = await self._put_place(ident, value, mine)
        revision = place.rank = self._revision(answer)
        responses = answer.get("responses") or []
        newest = (responses[2].get("response_range", {}).get("kvs") or []) + [None, None]
        if newest[0] is not None and newest[0]["key"] == mine:
            return place, revision, self._ranged(answer, 1), newest[1]
        # Our key was there already (put by an attempt whose answer was lost), and
        # keeps the rank it had: one more read finds who is ahead of it.
        own = await self._read(mine)
        place.rank = int(own["create_revision"]) if own is not None else revision
        revision, lock, _, ahead = await self._look(name, token, place.rank)
        return place, revision, lock, ahead

    async def _look(
        self, name: str, token: str, rank: int
    ) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
        """The revision, then the lock key, our queue key and the one just ahead of it."""
        answer = await self._txn(
            [],
            [
                {"request_range": {"key": b64(self._key(name))}},
                *self._ahead_reads(name, token, rank),
            ],
            resend=self._resend_after(),
        )
        return (
            self._revision(answer),
            self._ranged(answer),
            self._ranged(answer, 1),
            self._ranged(answer, 2),
        )

    async def release(self, name: str, token: str) -> int | None:
        ident = (name, token)
        key = b64(self._key(name))
        with self._using(ident) as held:
            # What we last wrote, if we know it: then one compare-and-write does it.
            # Else (a give-back of an attempt whose answer was lost) read the key first.
            kv: dict[str, Any] | None = None
            if held is None:
                kv = await self._read(key)
            for _ in range(ROUNDS):
                if held is not None:
                    current, expected = held.value, held.mod_revision
                else:
                    if kv is None or _Value.load(kv).token != token:
                        self._drop(ident)
                        return None
                    current, expected = _Value.load(kv), int(kv["mod_revision"])
                compare = [{"target": "MOD", "key": key, "mod_revision": str(expected)}]
                read = [{"request_range": {"key": key}}]
                if current.count > 1:
                    less = _Value(token, current.count - 1, current.ttl, current.holder)
                    put = {"key": key, "value": less.dump(), "ignore_lease": True}
                    answer = await self._txn(compare, [{"request_put": put}], read)
                    if answer.get("succeeded"):
                        with self._lock:
                            now = self._held.get(ident)
                            if now is not None:
                                now.value, now.mod_revision = less, self._revision(answer)
                        return less.count
                else:
                    try:
                        answer = await self._txn(
                            compare,
                            [{"request_delete_range": {"key": key, "prev_kv": True}}],
                            read,
                        )
                    except BackendUnavailable:
                        # Deleted or not, the last entry is left (the core gives up a
                        # hold whose release failed), and the key's lease is this
                        # hold's alone: revoked once the cluster answers, it ends the
                        # key then, not at the holder's deadline (the reaper's).
                        lease = held.lease if held is not None else int((kv or {}).get("lease", 0))
                        if lease:
                            self._revoke_later(lease)
                        raise
                    if answer.get("succeeded"):
                        deleted = answer["responses"][0].get("response_delete_range", {})
                        previous = (deleted.get("prev_kvs") or [{}])[0]
                        lease = int(previous.get("lease", 0))
                        self._drop(ident)
                        if lease:
                            await self._revoke_quietly(lease)
                        return 0
                kv, held = self._ranged(answer), None
        raise BackendError(f"etcd {self._where}: {name!r} kept changing under us")

    def _resend_after(self) -> float:
        """A read's, lease grant's or revoke's time to answer at a member before the
        next one is asked (see ``_send``): a fifth of the request timeout."""
        return (self._timeout.read or TIMEOUT) / 5

    async def _read_only(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post(path, body, resend=self._resend_after())

    async def _read(self, key: str) -> dict[str, Any] | None:
        return (await self._read_at(key))[1]

    async def _read_at(self, key: str) -> tuple[int, dict[str, Any] | None]:
        """The revision of the read, and ``key`` as it found it (None if absent)."""
        answer = await self._read_only("/v3/kv/range", {"key": key})
        kvs = answer.get("kvs") or []
        return self._revision(answer), kvs[0] if kvs else None

    async def extend(self, name: str, token: str, ttl: float) -> bool:
        return (await self.extend_many([Lease(name, token, ttl)]))[0]

    async def extend_many(self, leases: Sequence[Lease]) -> builtins.list[bool]:
        """Renew the lease of each lock whose TTL is unchanged (keepalive), then read
        every such key in one transaction to check that it is still ours as we last
        wrote it. A new TTL moves the key to a new lease, one lock at a time.

        Both change nothing if sent twice: each member but the last gets a sixth of the
        shortest ttl to answer them, at most a fifth of the request timeout as any
        request that may be sent twice, then the next is asked (a member that hangs
        must not keep a renewal waiting out the request timeout, longer than a short
        lease; capped at the whole timeout, a lease of 30 s or more had a lost quorum
        cost an extend() the timeout at every member, 15 s with three)."""
        idents = [(lease.name, lease.token) for lease in leases]
        per_member = min([self._resend_after(), *(lease.ttl / 6 for lease in leases)])
        answers = [False] * len(leases)
        sent = time.monotonic()
        records = [self._begin(ident) for ident in idents]
        try:
            renewed: list[int] = []
            moved: list[int] = []
            for index, (lease, held) in enumerate(zip(leases, records, strict=True)):
                if held is None:
                    continue  # released, or given up by the reaper: not held
                if held.asked != lease_seconds(lease.ttl):
                    moved.append(index)
                else:
                    renewed.append(index)
            kept: list[int] = []
            if renewed:
                ids = [records[index].lease for index in renewed]  # type: ignore[union-attr]
                alive = await self._keepalive(ids, resend=per_member)
                kept = [index for index, lease in zip(renewed, ids, strict=True) if lease in alive]
            found: builtins.list[dict[str, Any] | None] = []
            for start in range(0, len(kept), MAX_TXN_OPS):
                answer = await self._txn(
                    [],
                    [
                        {"request_range": {"key": b64(self._key(leases[i].name))}}
                        for i in kept[start : start + MAX_TXN_OPS]
                    ],
                    resend=per_member,
                )
                found += [self._ranged(answer, i) for i in range(len(answer["responses"]))]
            if kept:
                for index, kv in zip(kept, found, strict=True):
                    held = self._held.get(idents[index])
                    if held is None or kv is None or _Value.load(kv).token != leases[index].token:
                        self._drop(idents[index])
                    elif (
                        int(kv["mod_revision"]) == held.mod_revision
                        and int(kv.get("lease", 0)) == held.lease
                    ):
                        held.deadline = max(held.deadline, sent + leases[index].ttl)
                        answers[index] = True
                    else:
                        # Ours, but not as we last wrote it (a write of another user of
                        # the lock object whose answer was lost): move it, re-read.
                        moved.append(index)
            for index in moved:
                lease = leases[index]
                answers[index] = await self._move(lease.name, lease.token, lease.ttl, sent)
        finally:
            for ident in idents:
                self._end(ident)
        return answers

    async def _move(self, name: str, token: str, ttl: float, sent: float) -> bool:
        """Put the key, if still ours, on a new lease of ``ttl`` (compare and put), then
        revoke the old lease: a lease's TTL cannot be changed."""
        ident = (name, token)
        key = b64(self._key(name))
        asked = lease_seconds(ttl)
        fresh: int | None = None
        #: True while a put of the key on the fresh lease may have been applied unseen.
        unsure = False
        try:
            for _ in range(ROUNDS):
                kv = await self._read(key)
                if kv is None or _Value.load(kv).token != token:
                    self._drop(ident)
                    return False
                if fresh is None:
                    fresh, _ = await self._grant(asked)
                stored = _Value.load(kv)
                value = _Value(token, stored.count, ttl, stored.holder)
                unsure = True
                answer = await self._txn(
                    [{"target": "MOD", "key": key, "mod_revision": kv["mod_revision"]}],
                    [{"request_put": {"key": key, "value": value.dump(), "lease": str(fresh)}}],
                )
                unsure = False
                if answer.get("succeeded"):
                    lease, fresh = fresh, None
                    self._hold(
                        ident, _Held(lease, asked, value, self._revision(answer), sent + ttl)
                    )
                    old = int(kv.get("lease", 0))
                    if old:
                        await self._revoke_quietly(old)
                    return True
            raise BackendError(f"etcd {self._where}: {name!r} kept changing under us")
        finally:
            # Not one the put may have taken: the key, still ours, would go with it,
            # under a holder that counts it held (the core keeps a hold whose extend
            # failed). Then it ends by its TTL, or carries the hold, which the next
            # renewal finds on a lease it did not expect and moves again.
            if fresh is not None and not unsure:
                await self._revoke_quietly(fresh)

    # -- waiting -----------------------------------------------------------------------

    @asynccontextmanager
    async def waiter(self, name: str, token: str) -> AsyncIterator[AsyncEtcdWaiter]:
        ident = (name, token)
        self._waiting.add(ident)
        cut_short = False
        try:
            yield AsyncEtcdWaiter(self, name, token)
        except BaseException:
            # Cancelled, or failed (the cluster does not answer): the leave would add a
            # request timeout of its own to what the caller waited already.
            cut_short = True
            raise
        finally:
            self._waiting.discard(ident)
            place = self._places.pop(ident, None)
            if not self._places:
                # The keeper ends now, not at the renewal it waits for: left waiting, its
                # task outlived the wait, and an event loop closed meanwhile (by a
                # program that runs its calls with run_until_complete) destroyed it.
                self._keeper_wakeup.set()
            if place is not None and place.used:
                # The grant deleted our key; its lease, which holds nothing now, is
                # revoked by the reaper, not in the new holder's way.
                with self._lock:
                    self._emptied.append(place.lease)
                self._start_reaper(-math.inf)
            elif place is not None and cut_short:
                # The caller sees its cancellation or failure at once: the leave goes on
                # by itself (awaited, it held the caller up for a whole request timeout
                # on a server that does not answer).
                self._revoke_by_itself(place.lease, "dlock-leave")
            elif place is not None:
                # Leave the queue: run to its end even if cancelled again, else the
                # place holds up the waiters behind it until its lease runs out.
                await shielded(self._revoke_quietly(place.lease))

    async def _wait_turn(self, name: str, token: str, timeout: float) -> None:
        """Wait in line (see ``_wait_in_line``). A member that dies or hangs under the
        watch or a look ends the wait once the next request has been moved to the next
        member: a wait changes nothing, and the place outlives the member, so the next
        attempt looks again through the next member (and fails, as it should, if none
        answers)."""
        host = self._current
        try:
            await self._wait_in_line(name, token, timeout)
        except BackendUnavailable:
            if self._current == host:
                raise

    async def _wait_in_line(self, name: str, token: str, timeout: float) -> None:
        """Return when the waiter may be first in line with the lock free, its place
        lapsed, or after ``timeout``. The keeper renews the place meanwhile, so the
        watch runs the whole wait (see _keep_places). When the key ahead goes, looks who
        is ahead now and waits on, so that a grant to the head wakes nobody else."""
        ident = (name, token)
        lock_key = b64(self._key(name))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            place = self._places.get(ident)
            if place is not None:
                place.quiet = False
            if place is None:
                # No place (the attempt found the lock held by our own token, its
                # give-back in flight): wait for the lock key's deletion.
                await self._watch_deletion(lock_key, None, left)
                return
            if place.lapsed:
                self._places.pop(ident, None)
                return  # the next attempt takes a new one
            if place.unrenewed is not None:
                # A copy: the waiters of one client that share the failure raise it
                # each in a thread (or task) of its own.
                raise copy.copy(place.unrenewed) from place.unrenewed
            watch = place.watch or lock_key
            if not await self._watch_deletion(watch, place if place.watch else None, left):
                place.quiet = True  # unless the loop goes on (see _Place)
                continue
            if watch == lock_key:
                return
            revision, lock, own, ahead = await self._look(name, token, place.rank)
            if own is None:
                self._places.pop(ident, None)
                await self._revoke_quietly(place.lease)
                return
            if ahead is not None:
                place.follow(ahead["key"], ahead, revision)
            elif lock is not None:
                place.follow(lock_key, lock, revision)
            else:
                return
        place = self._places.get(ident)
        if place is not None and place.watch:
            # Run out by a look (a loaded client, a slow member): the key it watches
            # was last seen staying, as when a watch times out. Otherwise each such
            # wait cost an attempt (a grant, a transaction, a revoke), and 120 waiters
            # of one loaded client so kept it busy enough that its holder's 120
            # releases took 37 s.
            place.quiet = True

    async def _watch_deletion(self, key: str, seen: _Place | None, timeout: float) -> bool:
        """Whether ``key`` is deleted within ``timeout``, counting from ``seen``: the
        place whose watched key it is, last found by a read at its ``watch_from`` - 1
        (created at its ``watch_created``).

        The watch itself starts at its creation: etcd serves a watch that starts at a
        past revision from a loop that runs every 100 ms, which delayed most hand-offs
        under contention by up to that (any write since the read makes the start past).
        When the watch was created after other writes, the key is read once more, with
        the watch in place: gone, or created anew, it was deleted; still there, that read
        is the place's last sight of it, so the next wait's watch, on a cluster written
        to by nobody meanwhile, needs no read (120 idle waiters of one client read 60
        times a second, one read per 2 s fallback wait each)."""
        request: dict[str, Any] = {"key": key}
        client = self._http(watch=True)
        auth = await self._token()
        deadline = time.monotonic() + timeout
        used = self._current
        base = self._endpoints[used]
        limit = httpx.Timeout(self._timeout.read, connect=self._timeout.connect, read=timeout)
        try:
            async with self._stream(
                client,
                client.build_request(
                    "POST",
                    base + "/v3/watch",
                    json={"create_request": request},
                    headers={"Authorization": auth} if auth else {},
                    timeout=limit,
                ),
            ) as response:
                with self._watching(used, response):
                    if response.status_code != 200:
                        content = await response.aread()
                        self._answer(response.status_code, content)
                        return True
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        message = json.loads(line)
                        if self._released(message):  # a refused (cancelled) watch included
                            return True
                        if seen is not None and self._created_after(message, seen.watch_from):
                            revision, kv = await self._read_at(key)
                            if kv is None or int(kv["create_revision"]) != seen.watch_created:
                                return True
                            seen.watch_from = revision + 1
                        if time.monotonic() >= deadline:
                            return False
        except httpx.ReadTimeout:
            return False
        except RuntimeError as exc:  # as in _send: closed between taking it and sending
            if not self._closed:
                raise
            raise self._closed_error() from exc
        except httpx.HTTPError as exc:
            if self._closed:
                raise self._closed_error() from exc
            raise self._left(used, self._fail(exc)) from exc
        except BackendUnavailable as exc:
            # Said by the member in the stream: one that is stopping ends its watches
            # with "transport is closing". The next request goes to the next member.
            self._left(used, exc)
            raise
        return True

    @staticmethod
    @asynccontextmanager
    async def _stream(
        client: httpx.AsyncClient, request: httpx.Request
    ) -> AsyncIterator[httpx.Response]:
        """``client.stream``, whose request runs to its answer even if the caller is
        cancelled meanwhile (its response then closed unread), as every request here
        does: httpx's pool (httpcore, its issue 1093) kept a connection whose request
        was cancelled while it was being made, neither usable nor ever reclaimed, until
        every call of the client failed with PoolTimeout. The response is closed, also
        when the caller is cancelled again as it closes."""
        response = await shielded(client.send(request, stream=True), _closed)
        try:
            yield response
        finally:
            await shielded(_closed(response))

    @staticmethod
    def _created_after(message: dict[str, Any], start: int) -> bool:
        """Whether ``message`` tells the watch's creation at revision ``start`` or later."""
        result = message.get("result")
        if not isinstance(result, dict) or not result.get("created"):
            return False
        return int((result.get("header") or {}).get("revision", 0)) >= start

    def _released(self, message: dict[str, Any]) -> bool:
        """Whether one message of the watch stream tells a deletion (or ends the watch,
        and the next attempt looks again)."""
        result = message.get("result")
        if not isinstance(result, dict):
            raise self._refusal(message)
        if result.get("canceled"):
            self._watch_canceled(str(result.get("cancel_reason") or ""))
            return True
        if result.get("compact_revision"):
            return True
        return any(event.get("type") == "DELETE" for event in result.get("events") or ())

    def _watch_canceled(self, reason: str) -> None:
        """A watch the server would not create: refused for want of permission or of
        credentials, that is an error; refused for an expired token (or for none, sent
        because the server had authentication disabled when we asked), the next attempt
        authenticates again (the token is dropped) and watches anew."""
        stale = INVALID_TOKEN in reason or (NO_USER in reason and self._auth_token == "")
        if stale and self._credentials is not None:
            self._auth_token = None
        elif self._token_refused(reason):
            raise BackendError(self._unauthenticated(reason))
        elif PERMISSION_DENIED in reason:
            raise BackendError(self._denied())

    # -- the waiters' places ----------------------------------------------------------

    def _keep_places(self) -> None:
        """Have the keeper renew the places (started by a place put while none runs)."""
        with self._reaper_lock:
            if not self._closed and not serving(self._keeper):
                self._keeper_wakeup = WakeupEvent()
                self._keeper = spawn(self._keep, name="dlock-etcd-places")

    async def _keep(self) -> None:
        """Renew this client's places together, each about a third of its lease after
        its last renewal, until none is left. Renewed by their waiters, each place cost
        a keepalive of its own and cut its waiter's watch short, to be opened again:
        120 waiters of one client sent 200 requests a second while they waited."""
        lease = lease_seconds(self._queue_ttl)
        while not self._closed:
            self._keeper_wakeup.clear()  # set by the last wait's end, and by close
            with self._reaper_lock:
                # From a copy, taken at once: in the sync face the waiters' threads put
                # and drop their places meanwhile, and an iteration of the dict itself
                # that a thread switch let one of them change raised (the keeper ended,
                # and the places of the waiters left in line lapsed).
                places = [p for p in self._places.copy().values() if not (p.used or p.lapsed)]
                if not places:
                    self._keeper = None
                    return
            now = time.monotonic()
            first = min(place.renewed for place in places) + lease / 3
            if first > now:
                await self._keeper_wakeup.wait(first - now)
                continue
            # With it, those due within a sixth of the lease: the places of waiters that
            # came together go on being renewed together.
            due = [place for place in places if place.renewed + lease / 3 <= now + lease / 6]
            sent = time.monotonic()
            try:
                # Sent again to the next member if one hangs (see _send): left to the
                # request timeout, a place with a short queue_ttl would lapse.
                alive = await self._keepalive(
                    [place.lease for place in due], resend=self._queue_ttl / 6
                )
            except BackendError as exc:
                # Unanswered or refused: each waiter is told at its next wait; asked
                # again shortly, for the waiters that go on (their places may lapse
                # meanwhile: the next keepalive, or the waiter's attempt, finds that).
                for place in due:
                    place.unrenewed = exc
                await self._keeper_wakeup.wait(self._queue_ttl / 6)
                continue
            for place in due:
                place.unrenewed = None
                if place.lease in alive:
                    place.renewed = sent
                else:
                    place.lapsed = True

    # -- leases that run out unrenewed -------------------------------------------------

    def _start_reaper(self, deadline: float) -> None:
        with self._reaper_lock:
            if self._closed:
                return
            if not serving(self._reaper):
                self._reaper_wakeup = WakeupEvent()
                self._reaper_next = math.inf
                self._reaper = spawn(self._reap, name="dlock-etcd-reaper")
            if deadline <= self._reaper_next:
                self._reaper_wakeup.set()

    async def _reap(self) -> None:
        """Revoke the leases whose holder's ttl ran out unrenewed (etcd would keep them
        until the lease's whole seconds end), and those of places a grant emptied."""
        while not self._closed:
            self._reaper_wakeup.clear()
            self._reaper_next = -math.inf
            now = time.monotonic()
            with self._lock:
                due = [
                    (ident, held)
                    for ident, held in self._held.items()
                    if held.deadline <= now and not self._busy.get(ident)
                ]
                for ident, _ in due:
                    del self._held[ident]
                emptied, self._emptied = self._emptied, []
                again = []
                if self._revoke_at <= now:
                    self._revoke_at = math.inf
                    self._unrevoked = {
                        lease: until for lease, until in self._unrevoked.items() if until > now
                    }
                    again = builtins.list(self._unrevoked)
            await self._revoke_in_turn([held.lease for _, held in due] + emptied + again)
            if self._closed:
                return
            with self._lock:
                deadline = min(
                    (h.deadline for i, h in self._held.items() if not self._busy.get(i)),
                    default=math.inf,
                )
                deadline = min(deadline, self._revoke_at)
            self._reaper_next = deadline
            wait = deadline - time.monotonic()
            await self._reaper_wakeup.wait(max(0.001, wait) if wait != math.inf else None)

    async def _revoke_in_turn(self, leases: builtins.list[int]) -> None:
        """Revoke ``leases`` (the reaper's), until the cluster leaves one unanswered:
        each of the rest would wait out the same timeout, so they are asked again
        later with it (see _revoke_later)."""
        for index, lease in enumerate(leases):
            if not await self._revoke_quietly(lease):
                for rest in leases[index + 1 :]:
                    self._revoke_later(rest)
                return

    # -- inspection --------------------------------------------------------------------

    async def _info(
        self, kv: dict[str, Any], queued: Sequence[dict[str, Any]] = ()
    ) -> LockInfo | None:
        lease = int(kv.get("lease", 0))
        value = _Value.load(kv)
        expires_in: float | None = None
        if lease:
            answer = await self._read_only("/v3/lease/timetolive", {"ID": str(lease)})
            left = int(answer.get("TTL", 0))  # a zero is left out of the JSON
            if left < 0:
                return None  # expired; the server deletes the key in a moment
            expires_in = float(min(left, value.ttl))
        name = name_from_bytes(unb64(kv["key"])[len(self._prefix) :])
        return LockInfo(
            name=name,
            fencing_token=int(kv["create_revision"]),
            holder=Holder.from_json(json.dumps(value.holder)),
            expires_in=expires_in,
            count=value.count,
            waiters=tuple(_waiter_holder(entry) for entry in queued),
        )

    async def _queued(self, start: bytes) -> builtins.list[dict[str, Any]]:
        """The queue keys under ``start``, oldest first (in the order they are served)."""
        answer = await self._read_only(
            "/v3/kv/range",
            {
                "key": b64(start),
                "range_end": b64(prefix_end(start)),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
            },
        )
        return builtins.list(answer.get("kvs") or ())

    async def inspect(self, name: str) -> LockInfo | None:
        kv = await self._read(b64(self._key(name)))
        if kv is None:
            return None
        return await self._info(kv, await self._queued(self._queue(name)))

    async def list(self, prefix: str) -> builtins.list[LockInfo]:
        start = self._key(prefix)
        # Not into the queues, which follow the lock keys (see QUEUE_MARK).
        end = min(prefix_end(start), self._prefix + QUEUE_MARK)
        answer = await self._read_only("/v3/kv/range", {"key": b64(start), "range_end": b64(end)})
        kvs = answer.get("kvs") or ()
        queues: dict[bytes, builtins.list[dict[str, Any]]] = {}
        if kvs:
            for entry in await self._queued(self._prefix + QUEUE_MARK):
                queue = unb64(entry["key"]).rpartition(b"/")[0] + b"/"
                queues.setdefault(queue, []).append(entry)
        infos = []
        for kv in kvs:
            key = unb64(kv["key"])[len(self._prefix) :]
            if QUEUE_MARK in key:
                # No lock name of dlock's has it (UTF-8 has no 0xFF): a queue key of a
                # client whose prefix is below this one's, not a lock. (A name another
                # program wrote may have the byte, and is listed, escaped.)
                continue
            name = name_from_bytes(key)
            info = await self._info(kv, queues.get(self._queue(name), ()))
            if info is not None:
                infos.append(info)
        return infos

    async def force_release(self, name: str) -> bool:
        answer = await self._post(
            "/v3/kv/deleterange", {"key": b64(self._key(name)), "prev_kv": True}
        )
        if not int(answer.get("deleted", 0)):
            return False
        for kv in answer.get("prev_kvs") or ():
            lease = int(kv.get("lease", 0))
            if lease:
                await self._revoke_quietly(lease)
        return True

    async def aclose(self) -> None:
        self._follow_fork()
        self._follow_loop()
        # The waits of this client end with it: their places must not hold up the
        # waiters behind them until their leases run out.
        leaving, self._places = builtins.list(self._places.values()), {}
        with self._lock:
            emptied, self._emptied = self._emptied, []
            unrevoked, self._unrevoked = builtins.list(self._unrevoked), {}
        # A leave or give-back notes its unanswered revoke before it ends (and leaves
        # _cut_off): such a lease is one of the unrevoked, asked under their rule.
        cut_off, self._cut_off = builtins.list(self._cut_off - set(unrevoked)), set()
        if time.monotonic() < self._unanswered_at + (self._timeout.read or TIMEOUT):
            unrevoked = []  # one went unanswered within a timeout: so would these
        # Once each, the unanswered ones too (the reaper ends with the client), until
        # the cluster leaves one unanswered: each of the rest would wait as long.
        for lease in [place.lease for place in leaving] + cut_off + emptied + unrevoked:
            try:
                await self._revoke(lease)
            except BackendUnavailable:
                break
            except BackendError:
                pass
        self._closed = True
        self._reaper_wakeup.set()
        self._keeper_wakeup.set()
        clients = [self._client, self._watcher]
        self._client = self._watcher = None
        for client in clients:
            if client is not None:
                with contextlib.suppress(httpx.HTTPError, OSError):
                    await client.aclose()


BACKEND = AsyncEtcdBackend
