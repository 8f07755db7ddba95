"""TLS to a real ZooKeeper: one standalone server with a TLS-only port that requires
client certificates, from a throwaway CA (tests/servers/tls.py).

What must hold: a lock works over TLS with the right certificates, and every mistake
(wrong CA, wrong name, no client certificate, plaintext against the TLS port and the
reverse) is a dlock error, soon and saying why, never a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import dlock
import dlock.aio
from tests.servers.tls import CLIENT_KEY_PASSWORD
from tests.servers.zookeeper import ZooKeeperEnsemble

#: Long enough that a refusal seen well before it was not a timeout.
PATIENT = 10.0


@pytest.fixture(scope="module")
def tls_server() -> Iterator[ZooKeeperEnsemble]:
    server = ZooKeeperEnsemble(tls=True)
    server.start()
    yield server
    server.stop()


def unique(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}"


def refused(url: str) -> tuple[dlock.BackendError, float]:
    """The error an acquisition through ``url`` raises, and how long it took."""
    started = time.monotonic()
    with dlock.connect(url) as client, pytest.raises(dlock.BackendError) as caught:
        client.lock(unique("refused"), ttl=5).acquire(timeout=0)
    return caught.value, time.monotonic() - started


def assert_refused(
    server: ZooKeeperEnsemble,
    url: str,
    root: str,
    *words: str,
    within: float,
    certificate: bool = True,
) -> None:
    """Acquiring through ``url`` fails within ``within`` seconds, with a message naming
    each of ``words``, and leaves nothing under ``root``. A ``certificate`` refusal is
    misconfigured, never ``BackendUnavailable`` (which a caller may retry); a failure
    whose cause cannot be told apart from a server going away is unavailable."""
    error, elapsed = refused(url)
    assert isinstance(error, dlock.BackendUnavailable) is not certificate, repr(error)
    for word in words:
        assert word in str(error), f"{word!r} missing from {error}"
    assert elapsed < within, f"refused after {elapsed:.1f} s, not at once"
    assert_nothing_under(server, root)


def assert_nothing_under(server: ZooKeeperEnsemble, root: str) -> None:
    """No lock and no queued node was left by a client that could not connect."""
    with dlock.connect(server.url(root)) as plain:
        assert plain.list() == []


def test_a_lock_over_tls_is_exclusive_and_handed_on(tls_server: ZooKeeperEnsemble) -> None:
    root = f"/{unique('tls')}"
    name = unique("handoff")
    with (
        dlock.connect(tls_server.tls_url(root), label="first") as first,
        dlock.connect(tls_server.tls_url(root), label="second") as second,
        dlock.connect(tls_server.url(root)) as plain,
    ):
        holder = first.lock(name, ttl=5)
        assert holder.acquire(timeout=0)
        # The same server's plaintext port sees the lock the TLS client took.
        info = plain.inspect(name)
        assert info is not None and info.holder.label == "first"
        assert info.fencing_token == holder.fencing_token
        assert not second.lock(name, ttl=5).acquire(timeout=0)

        waiter = second.lock(name, ttl=5)
        acquired = threading.Event()

        def wait() -> None:
            if waiter.acquire(timeout=PATIENT):
                acquired.set()

        thread = threading.Thread(target=wait)
        thread.start()
        for _ in range(200):
            info = first.inspect(name)
            if info is not None and len(info.waiters) == 1:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the waiter never queued over TLS")
        assert not acquired.is_set()
        token = holder.fencing_token
        holder.release()
        thread.join(PATIENT)
        assert acquired.is_set()
        assert waiter.fencing_token is not None and token is not None
        assert waiter.fencing_token > token
        assert not holder.owned()
        waiter.extend()  # the lease is renewed over TLS too
        assert waiter.owned()
        waiter.release()
        assert plain.inspect(name) is None


def test_an_encrypted_client_key_needs_its_password(tls_server: ZooKeeperEnsemble) -> None:
    assert tls_server.certificates is not None
    encrypted = tls_server.certificates.client_key_encrypted
    url = tls_server.tls_url(keyfile=encrypted, keyfile_password=CLIENT_KEY_PASSWORD)
    with dlock.connect(url) as client, client.lock(unique("encrypted"), ttl=5) as lock:
        assert lock.fencing_token is not None
    # Found at connect(), not as a connection that never comes (nor a password prompt).
    with pytest.raises(dlock.ConfigurationError, match="keyfile_password"):
        dlock.connect(tls_server.tls_url(keyfile=encrypted))
    with pytest.raises(dlock.ConfigurationError):
        dlock.connect(tls_server.tls_url(keyfile=encrypted, keyfile_password="wrong"))


def test_a_server_certificate_from_another_ca_is_refused_at_once(
    tls_server: ZooKeeperEnsemble,
) -> None:
    assert tls_server.certificates is not None
    root = f"/{unique('wrong-ca')}"
    url = tls_server.tls_url(root, ca=tls_server.certificates.other_ca, connect_timeout=PATIENT)
    assert_refused(
        tls_server,
        url,
        root,
        "TLS certificate refused",
        "CERTIFICATE_VERIFY_FAILED",
        within=PATIENT / 2,
    )


def test_the_server_name_is_checked(tls_server: ZooKeeperEnsemble) -> None:
    """The server's certificate names 127.0.0.1 only: reached as localhost (the same
    address), it is refused unless the name check is switched off."""
    root = f"/{unique('wrong-name')}"
    url = tls_server.tls_url(root, host="localhost", connect_timeout=PATIENT)
    assert_refused(
        tls_server, url, root, "TLS certificate refused", "localhost", within=PATIENT / 2
    )
    unchecked = tls_server.tls_url(root, host="localhost", check_hostname=0)
    with dlock.connect(unchecked) as client, client.lock(unique("unchecked"), ttl=5) as lock:
        assert lock.fencing_token is not None


def test_a_client_without_a_certificate_is_refused_at_once(
    tls_server: ZooKeeperEnsemble,
) -> None:
    root = f"/{unique('no-cert')}"
    url = tls_server.tls_url(root, certfile=None, keyfile=None, connect_timeout=PATIENT)
    assert_refused(
        tls_server, url, root, "TLS certificate refused", "CERTIFICATE", within=PATIENT / 2
    )


def test_verify_certs_off_accepts_any_server_certificate(tls_server: ZooKeeperEnsemble) -> None:
    """The option does what it says (and is documented as unsafe)."""
    assert tls_server.certificates is not None
    url = tls_server.tls_url(ca=tls_server.certificates.other_ca, verify_certs=0)
    with dlock.connect(url) as client, client.lock(unique("unverified"), ttl=5) as lock:
        assert lock.fencing_token is not None


def test_plaintext_against_the_tls_port_fails_in_bounded_time(
    tls_server: ZooKeeperEnsemble,
) -> None:
    root = f"/{unique('plain-to-tls')}"
    url = f"zookeeper://127.0.0.1:{tls_server.secure_port}{root}?connect_timeout=1"
    # The message points at the likely mistake.
    assert_refused(tls_server, url, root, "tls=1", within=1 + 3, certificate=False)


def test_tls_against_the_plaintext_port_fails_in_bounded_time(
    tls_server: ZooKeeperEnsemble,
) -> None:
    root = f"/{unique('tls-to-plain')}"
    url = tls_server.tls_url(root, connect_timeout=1).replace(
        f":{tls_server.secure_port}/", f":{tls_server.client_ports[0]}/"
    )
    assert_refused(tls_server, url, root, "SSL", within=1 + 3, certificate=False)


async def test_the_asyncio_face_over_tls(tls_server: ZooKeeperEnsemble) -> None:
    name = unique("aio")
    async with dlock.aio.connect(tls_server.tls_url()) as client:
        async with client.lock(name, ttl=5) as lock:
            assert lock.fencing_token is not None
            info = await client.inspect(name)
            assert info is not None and info.fencing_token == lock.fencing_token
        assert await client.inspect(name) is None
    with pytest.raises(dlock.BackendError, match="TLS certificate refused") as caught:
        assert tls_server.certificates is not None
        url = tls_server.tls_url(ca=tls_server.certificates.other_ca, connect_timeout=PATIENT)
        async with dlock.aio.connect(url) as client:
            await client.lock(name, ttl=5).acquire(timeout=0)
    assert not isinstance(caught.value, dlock.BackendUnavailable)
