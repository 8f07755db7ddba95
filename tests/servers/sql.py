"""Private MariaDB and PostgreSQL servers for the tests and benchmarks.

Each runs from the Debian packages on a free loopback port with its data in a temporary
directory, so tests may kill and restart it without touching a system service.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ServerProcess, free_port, port_open, private_dir, require_binary
from tests.servers.tls import Certificates

PG_BIN = Path("/usr/lib/postgresql/15/bin")
#: Session mode holds one connection per held lock; the conformance suite holds 200.
MAX_CONNECTIONS = 500


@dataclass
class SQLServer:
    process: ServerProcess
    port: int
    scheme: str
    user: str
    password: str
    database: str

    def url(self, query: str = "") -> str:
        url = f"{self.scheme}://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"
        return f"{url}?{query}" if query else url

    def connect(self, autocommit: bool = True, **options: Any) -> Any:
        """A plain driver connection (sync), independent of dlock; ``options`` go to the
        driver (PyMySQL's ``client_flag``, another ``database``)."""
        if self.scheme == "postgresql":
            import psycopg

            return psycopg.connect(self.url(), autocommit=autocommit, **options)
        import pymysql

        settings: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "database": self.database,
            "autocommit": autocommit,
            "ssl_disabled": True,
        }
        return pymysql.connect(**(settings | options))

    def stop(self) -> None:
        """Stop the server and remove its temporary directory."""
        self.process.stop()
        shutil.rmtree(self.process.workdir, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start again on the same port and data (the data survives)."""
        self.process.restart()

    def crash_restart(self) -> None:
        """Stop without a clean shutdown, then start on the same data: PostgreSQL's
        immediate mode recovers from its WAL and empties UNLOGGED tables; MariaDB loses
        its MEMORY tables (as on any restart)."""
        process = self.process.process
        assert process is not None
        self.process.signal(signal.SIGQUIT if self.scheme == "postgresql" else signal.SIGKILL)
        process.wait(30)
        self.process.process = None
        self.process.start()


def _pg_ready(port: int) -> bool:
    result = subprocess.run(
        [str(PG_BIN / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"],
        capture_output=True,
    )
    return result.returncode == 0


def start_postgresql(durable: bool = False, tls: Certificates | None = None) -> SQLServer:
    """initdb into a fresh directory owned by ``postgres``, then run ``postgres`` directly.

    Commits are not flushed to disk unless ``durable`` (the database's default, which
    the benchmarks can ask for): the tests need no durability and run faster without.
    With ``tls``, TCP clients must use TLS and show a certificate signed by its CA.
    """
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError("PostgreSQL 15 not found: run ./scripts/test, which installs postgresql")
    root = private_dir("postgresql")
    root.chmod(0o755)
    data = root / "data"
    shutil.chown(root, "postgres")
    subprocess.run(
        [
            str(PG_BIN / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        user="postgres",
    )
    port = free_port()
    command = [
        str(PG_BIN / "postgres"),
        "-D",
        str(data),
        "-p",
        str(port),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        f"unix_socket_directories={root}",
        "-c",
        f"max_connections={MAX_CONNECTIONS}",
    ]
    if tls is not None:
        command += _postgresql_tls(data, tls)
    if not durable:
        for setting in ("fsync=off", "synchronous_commit=off", "full_page_writes=off"):
            command += ["-c", setting]
    # A fast shutdown: SIGTERM waits for clients, and SIGKILL of the postmaster would
    # leave its backends running.
    process = ServerProcess(
        "postgresql",
        command,
        lambda: _pg_ready(port),
        workdir=root,
        user="postgres",
        stop_signal=signal.SIGINT,
    )
    process.start()
    return SQLServer(process, port, "postgresql", "postgres", "", "postgres")


def _postgresql_tls(data: Path, tls: Certificates) -> list[str]:
    """Server options for TLS; TCP connections without it, or without a client
    certificate signed by the CA, are refused (pg_hba.conf)."""
    for source, target in (
        (tls.server_cert, "server.crt"),
        (tls.server_key, "server.key"),
        (tls.ca, "ca.crt"),
    ):
        shutil.copy(source, data / target)
        shutil.chown(data / target, "postgres")
        (data / target).chmod(0o600)
    (data / "pg_hba.conf").write_text(
        "local all all trust\nhostssl all all 127.0.0.1/32 trust clientcert=verify-ca\n"
    )
    return [
        *("-c", "ssl=on", "-c", f"ssl_cert_file={data / 'server.crt'}"),
        *("-c", f"ssl_key_file={data / 'server.key'}", "-c", f"ssl_ca_file={data / 'ca.crt'}"),
    ]


def start_mariadb(durable: bool = False, tls: Certificates | None = None) -> SQLServer:
    """mariadb-install-db into a fresh directory, then run ``mariadbd`` on a free port.

    ``durable``: flush the redo log on every commit (the default of InnoDB). With
    ``tls``, the ``dlock`` user must connect with TLS and a certificate signed by its CA.
    """
    install = require_binary("mariadb-install-db", "mariadb-server")
    mariadbd = require_binary("mariadbd", "mariadb-server")
    root = private_dir("mariadb")
    data = root / "data"
    # A temporary directory of its own: in the shared /tmp, two servers bootstrapping
    # at once (xdist workers) ran into each other's temporary tables, and one failed
    # ("Could not remove temporary table ... Unknown table 'mysql.tmp_user_sys'").
    tmp = root / "tmp"
    tmp.mkdir()
    subprocess.run(
        [
            install,
            "--no-defaults",
            f"--datadir={data}",
            f"--tmpdir={tmp}",
            "--user=root",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    command = [
        mariadbd,
        "--no-defaults",
        f"--datadir={data}",
        f"--tmpdir={tmp}",
        "--user=root",
        f"--port={port}",
        "--bind-address=127.0.0.1",
        f"--socket={root}/sock",
        f"--pid-file={root}/pid",
        f"--log-error={root}/err",
        "--skip-name-resolve",
        f"--max-connections={MAX_CONNECTIONS}",
        f"--innodb-flush-log-at-trx-commit={1 if durable else 2}",
    ]
    require = ""
    if tls is not None:
        command += [f"--ssl-cert={tls.server_cert}", f"--ssl-key={tls.server_key}"]
        command += [f"--ssl-ca={tls.ca}"]
        require = " REQUIRE X509"
    process = ServerProcess("mariadb", command, lambda: port_open(port), workdir=root)
    process.start()
    # The root account has no password yet; create the database and a password user.
    subprocess.run(
        [
            "mariadb",
            f"--socket={root}/sock",
            "-uroot",
            "-e",
            "CREATE DATABASE dlock;"
            f" CREATE USER 'dlock'@'%' IDENTIFIED BY 'secret'{require};"
            " GRANT ALL ON *.* TO 'dlock'@'%' WITH GRANT OPTION;",
        ],
        check=True,
        capture_output=True,
    )
    return SQLServer(process, port, "mysql", "dlock", "secret", "dlock")


def start_pgbouncer(upstream: SQLServer, pool_mode: str = "transaction") -> SQLServer:
    """PgBouncer (from the Debian package) in front of ``upstream``, trusting its user,
    with two server sessions per database, so that clients share them."""
    binary = require_binary("pgbouncer", "pgbouncer")
    root = private_dir("pgbouncer")
    root.chmod(0o755)
    port = free_port()
    users = root / "users.txt"
    users.write_text(f'"{upstream.user}" ""\n')
    config = root / "pgbouncer.ini"
    config.write_text(
        f"""[databases]
{upstream.database} = host=127.0.0.1 port={upstream.port} dbname={upstream.database}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {users}
pool_mode = {pool_mode}
default_pool_size = 2
"""
    )
    for path in (root, users, config):
        shutil.chown(path, "postgres")
    # PgBouncer refuses to run as root.
    process = ServerProcess(
        "pgbouncer", [binary, str(config)], lambda: port_open(port), workdir=root, user="postgres"
    )
    process.start()
    return SQLServer(
        process, port, "postgresql", upstream.user, upstream.password, upstream.database
    )


@pytest.fixture(scope="session")
def postgresql_server() -> Iterator[SQLServer]:
    server = start_postgresql()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[SQLServer]:
    server = start_mariadb()
    yield server
    server.stop()
