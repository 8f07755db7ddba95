"""TLS to MariaDB and PostgreSQL: the URL's TLS options, against servers that accept only
TLS connections with a client certificate signed by their CA (tests/servers/sql.py).

Each refusal must be a clear error, quickly, and never a lock.
"""

from __future__ import annotations

import asyncio
import gc
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

import dlock
import dlock.aio
from tests.servers import private_dir
from tests.servers.sql import SQLServer, start_mariadb, start_postgresql
from tests.servers.tls import CLIENT_KEY_PASSWORD, Certificates, make_certificates


@dataclass
class TLSServer:
    server: SQLServer
    certificates: Certificates

    def url(self, mode: str, ca: str = "", client_cert: bool = True, key: str = "") -> str:
        """A URL that verifies the server against ``ca`` (default: the right CA) and,
        if ``client_cert``, shows the client certificate with ``key`` (default: the
        plain key)."""
        c = self.certificates
        ca = ca or str(c.ca)
        key = key or str(c.client_key)
        if self.server.scheme == "postgresql":
            options = [f"sslmode=verify-full&sslrootcert={ca}"]
            if client_cert:
                options.append(f"sslcert={c.client_cert}&sslkey={key}")
        else:
            options = [f"ssl_ca={ca}&ssl_verify_identity=true"]
            if client_cert:
                options.append(f"ssl_cert={c.client_cert}&ssl_key={key}")
        return self.server.url("&".join([*options, f"mode={mode}"]))


@pytest.fixture(scope="module", params=["mariadb", "postgresql"])
def tls_server(request: pytest.FixtureRequest) -> Iterator[TLSServer]:
    workdir = private_dir("sql-tls")
    certificates = make_certificates(workdir)
    start = start_mariadb if request.param == "mariadb" else start_postgresql
    server = start(tls=certificates)
    yield TLSServer(server, certificates)
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(params=["lease", "session"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _name() -> str:
    return f"tls-{uuid.uuid4().hex}"


def test_locks_over_verified_tls_in_both_faces(tls_server: TLSServer, mode: str) -> None:
    """The server refuses any connection without TLS and a client certificate signed by
    its CA, so a lock taken at all was taken over such a connection."""
    url = tls_server.url(mode)
    name = _name()
    with dlock.connect(url) as client, client.lock(name, ttl=5) as lock:
        assert lock.fencing_token is not None
        info = client.inspect(name)
        assert info is not None and info.fencing_token == lock.fencing_token

    async def in_asyncio() -> int | None:
        async with dlock.aio.connect(url) as client, client.lock(name, ttl=5) as lock:
            return lock.fencing_token

    assert asyncio.run(in_asyncio()) is not None
    gc.collect()  # a socket left open by the closed client is reported here, not later


def test_encrypted_client_key_with_its_passphrase(tls_server: TLSServer, mode: str) -> None:
    c = tls_server.certificates
    password = "sslpassword" if tls_server.server.scheme == "postgresql" else "ssl_key_password"
    url = tls_server.url(mode, key=str(c.client_key_encrypted))
    with (
        dlock.connect(f"{url}&{password}={CLIENT_KEY_PASSWORD}") as client,
        client.lock(_name(), ttl=5) as lock,
    ):
        assert lock.fencing_token is not None
    # Without it OpenSSL would ask on the terminal: refused before any connection.
    with pytest.raises(dlock.ConfigurationError, match=f"encrypted.*{password}"):
        dlock.connect(url)
    # A wrong one: MySQL's TLS context is built by dlock, at connect(); libpq loads
    # the key when it connects.
    wrong = f"{url}&{password}=not-{CLIENT_KEY_PASSWORD}"
    if tls_server.server.scheme == "postgresql":
        with dlock.connect(wrong) as client, pytest.raises(dlock.BackendError, match="key"):
            client.lock(_name(), ttl=5).acquire(timeout=0)
    else:
        with pytest.raises(dlock.ConfigurationError, match="cannot load ssl_cert"):
            dlock.connect(wrong)


def test_refused_tls_is_a_clear_error_never_a_lock(tls_server: TLSServer, mode: str) -> None:
    c = tls_server.certificates
    pg = tls_server.server.scheme == "postgresql"
    plain = "&sslmode=disable" if pg else ""
    # Each refusal says which server, and why, as a plain BackendError (MariaDB refuses
    # a REQUIRE X509 user without a certificate as it refuses a wrong password).
    wrong = [
        ("certificate verify failed", tls_server.url(mode, ca=str(c.other_ca))),
        (
            "client certificate" if pg else "access denied",
            tls_server.url(mode, client_cert=False),
        ),
        (
            "no pg_hba.conf entry" if pg else "access denied",
            tls_server.server.url(f"mode={mode}{plain}"),
        ),
    ]
    if pg:
        # A client certificate from a CA the server does not trust (self-signed). Not
        # on MariaDB: there the client may see the server's alert or only the closed
        # connection, which a server going away also gives (BackendUnavailable).
        ours, theirs = c.other_ca, c.other_ca.with_suffix(".key")
        stranger = f"mode={mode}&sslrootcert={c.ca}&sslcert={ours}&sslkey={theirs}"
        wrong.append(("unknown ca", tls_server.server.url(stranger)))
    address = f"127.0.0.1:{tls_server.server.port}: "
    for why, url in wrong:
        start = time.monotonic()
        with dlock.connect(url) as client, pytest.raises(dlock.BackendError) as refused:
            client.lock(_name(), ttl=5).acquire(timeout=5)
        assert time.monotonic() - start < 3, why
        assert str(refused.value).startswith(address), refused.value
        assert why in str(refused.value), refused.value
        # Misconfigured, not unavailable: a caller retrying ConnectionError would loop.
        assert not isinstance(refused.value, dlock.BackendUnavailable), refused.value


@pytest.mark.parametrize("tls_server", ["postgresql"], indirect=True)
def test_a_server_of_older_tls_versions_only_is_refused_not_unavailable(
    tls_server: TLSServer,
) -> None:
    """A server that offers only TLS versions the client will not speak (a legacy
    server's TLS 1.1) will not change its mind: that is a misconfiguration, a plain
    BackendError. libpq's "tlsv1 alert protocol version" was BackendUnavailable, which
    a caller may retry for ever. (MariaDB's TLS versions are fixed at its start.)"""
    server, c = tls_server.server, tls_server.certificates
    admin = psycopg.connect(
        f"host=127.0.0.1 port={server.port} user={server.user} dbname={server.database}"
        f" sslmode=require sslcert={c.client_cert} sslkey={c.client_key}",
        autocommit=True,
    )
    try:
        admin.execute("ALTER SYSTEM SET ssl_min_protocol_version = 'TLSv1'")
        admin.execute("ALTER SYSTEM SET ssl_max_protocol_version = 'TLSv1.1'")
        admin.execute("SELECT pg_reload_conf()")
        with (
            dlock.connect(tls_server.url("lease")) as client,
            pytest.raises(dlock.BackendError, match="protocol version") as refused,
        ):
            client.lock(_name(), ttl=5).acquire(timeout=0)
        assert not isinstance(refused.value, dlock.BackendUnavailable), refused.value
    finally:
        admin.execute("ALTER SYSTEM RESET ssl_min_protocol_version")
        admin.execute("ALTER SYSTEM RESET ssl_max_protocol_version")
        admin.execute("SELECT pg_reload_conf()")
        admin.close()


def test_a_ca_alone_means_verified_tls(tls_server: TLSServer) -> None:
    """A CA named and TLS not asked for in so many words: on PostgreSQL no ``sslmode``
    (dlock asks for ``verify-full``; libpq's own default, ``prefer``, falls back to
    plain text, which ``test_tls_asked_of_a_server_without_it_is_refused`` tries
    against a server without TLS), on MySQL no ``ssl=true``. A right setup gets in,
    host name included, and a server from another CA is kept out."""
    c = tls_server.certificates
    pg = tls_server.server.scheme == "postgresql"

    def url(ca: Path) -> str:
        if pg:
            return tls_server.server.url(
                f"sslrootcert={ca}&sslcert={c.client_cert}&sslkey={c.client_key}"
            )
        return tls_server.server.url(f"ssl_ca={ca}&ssl_cert={c.client_cert}&ssl_key={c.client_key}")

    with dlock.connect(url(c.ca)) as client, client.lock(_name(), ttl=5) as lock:
        assert lock.fencing_token is not None
    with (
        dlock.connect(url(c.other_ca)) as client,
        pytest.raises(dlock.BackendError, match="certificate verify failed"),
    ):
        client.lock(_name(), ttl=5).acquire(timeout=5)


@pytest.mark.parametrize("value", ["require", "enabled", "verify_ca", "ture"])
def test_an_unknown_mysql_ssl_value_is_refused(value: str) -> None:
    """Only a spelling that is known means TLS on or off: ``ssl=require`` (libpq's
    word) or ``ssl=enabled`` meant no TLS at all, and the lock went over plain text."""
    with pytest.raises(dlock.ConfigurationError, match="ssl must be true or false"):
        dlock.connect(f"mysql://dlock@127.0.0.1:1/dlock?ssl={value}")


@pytest.mark.parametrize(
    ("value", "checked"),
    [("true", True), ("yes", True), ("on", True), ("1", True), ("false", False), ("off", False)],
)
def test_mysql_host_name_check_reads_every_spelling(value: str, checked: bool) -> None:
    """``ssl_verify_identity=yes`` or ``=on`` turned the host-name check off: a server
    with a certificate made for another host was accepted."""
    url = f"mysql://dlock@127.0.0.1:1/dlock?ssl=true&ssl_verify_identity={value}"
    with dlock.connect(url) as client:
        context: Any = client._backend._ssl  # type: ignore[attr-defined]
        assert context.check_hostname is checked


def test_an_unknown_mysql_ssl_verify_identity_is_refused() -> None:
    with pytest.raises(dlock.ConfigurationError, match="ssl_verify_identity must be true or"):
        dlock.connect("mysql://dlock@127.0.0.1:1/dlock?ssl=true&ssl_verify_identity=sure")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ssl_verify_identity=true", "ssl_verify_identity without TLS: add ssl=true"),
        ("ssl_verify_identity=maybe", "ssl_verify_identity must be true or false"),
        ("ssl_key_password=secret", "ssl_key_password without TLS"),
        ("ssl=false&ssl_ca=/etc/ssl/ca.pem", "ssl=false with ssl_ca: TLS is off"),
        ("ssl=off&ssl_verify_identity=false", "ssl=false with ssl_verify_identity"),
    ],
)
def test_mysql_tls_settings_with_tls_off_are_refused(query: str, message: str) -> None:
    """``ssl_verify_identity`` alone (any spelling, even an unknown one) was accepted
    and the lock went over plain text; ``ssl=false`` with a CA file turned TLS on."""
    with pytest.raises(dlock.ConfigurationError, match=message):
        dlock.connect(f"mysql://dlock@127.0.0.1:1/dlock?{query}")


@pytest.mark.parametrize(
    "query",
    [
        "mysql://dlock@127.0.0.1:1/dlock?ssl_ca={missing}",
        "mysql://dlock@127.0.0.1:1/dlock?ssl=true&ssl_cert={missing}",
        "postgresql://dlock@127.0.0.1:1/dlock?sslrootcert={missing}",
        "postgresql://dlock@127.0.0.1:1/dlock?sslcert={missing}",
        "postgresql://dlock@127.0.0.1:1/dlock?sslmode=require&sslcrl={missing}",
    ],
)
def test_a_tls_file_that_is_not_there_is_named(query: str, tmp_path: Path) -> None:
    """libpq took a missing sslrootcert as given, and then said that the server does
    not support SSL (when that came first); PyMySQL's error named no file."""
    missing = str(tmp_path / "nowhere.pem")
    with pytest.raises(dlock.ConfigurationError, match=f"={re.escape(repr(missing))}: no such"):
        dlock.connect(query.format(missing=missing))


@pytest.mark.parametrize("value", ["true", "required"])
def test_mysql_ssl_on_builds_a_context(value: str) -> None:
    with dlock.connect(f"mysql://dlock@127.0.0.1:1/dlock?ssl={value}") as client:
        assert client._backend._ssl is not None  # type: ignore[attr-defined]


def test_an_option_value_libpq_refuses_as_it_connects_is_not_retryable(
    postgresql_server: SQLServer,
) -> None:
    """Some option values libpq checks only as it connects ("weak sslmode "require" may
    not be used with sslrootcert=system"; "invalid ... value" from a libpq older than
    dlock's lists of values): misconfigured, a plain BackendError, never the
    BackendUnavailable that a caller may retry."""
    url = postgresql_server.url("sslrootcert=system&sslmode=require")
    with dlock.connect(url) as client, pytest.raises(dlock.BackendError) as caught:
        client.lock(_name(), ttl=5).acquire(timeout=0)
    assert "sslrootcert=system" in str(caught.value), caught.value
    assert not isinstance(caught.value, dlock.BackendUnavailable), caught.value
