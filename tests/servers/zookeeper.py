"""Private ZooKeeper servers from the Debian ``zookeeper`` package: standalone or an ensemble.

Every node runs with a 100 ms tick so sessions can be as short as 0.2 s (the session
timeout bounds how long a crashed or paused holder keeps its locks, which the suite's
crash tests expect within a few seconds), and a large ``maxSessionTimeout`` so fault
tests can choose longer ones. Empty lock nodes (containers) are deleted within
:data:`CONTAINER_CHECK_MS`, not a minute, so the tests often meet a lock node deleted
under a client that knew it. Nodes can be killed, paused and restarted one by one;
:meth:`leader` finds the one to kill for the leader-failure tests. A standalone server
can also serve TLS on a second port (``tls=True``), requiring client certificates.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.servers import (
    ServerProcess,
    free_port,
    port_open,
    private_dir,
    start_all,
    stop_every,
)
from tests.servers.tls import Certificates, make_certificates

JAR = Path("/usr/share/java/zookeeper.jar")
#: Netty's codecs, which its TLS handler needs: the Debian jar's manifest leaves them out.
NETTY_CODEC_JAR = Path("/usr/share/java/netty-codec.jar")
#: SLF4J's binding to log4j 1.2 (Debian's libslf4j-java and liblog4j1.2-java, which the
#: zookeeper package pulls in), for the log4j.properties written below: without it the
#: server logs through SLF4J's no-op logger, and one that exited at startup said nothing
#: of why in its log.
LOGGING_JARS = [Path("/usr/share/java/slf4j-log4j12.jar"), Path("/usr/share/java/log4j-1.2.jar")]
TICK_MS = 100
#: How often the server deletes empty container nodes (ZooKeeper's default: a minute).
CONTAINER_CHECK_MS = 200


def four_letter(port: int, command: str = "srvr", timeout: float = 0.5) -> str:
    """Send a four-letter word (there is no nc here) and return the answer, or ''."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(command.encode())
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


def mode(port: int) -> str | None:
    """'leader', 'follower' or 'standalone' once the node serves clients, else None."""
    for line in four_letter(port).splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None


def _readiness(port: int, *, standalone: bool, secure_port: int | None) -> Callable[[], bool]:
    """A standalone node is ready when it serves; an ensemble node serves only once a
    quorum exists, which needs the others started too, so it is "up" when it answers."""
    if secure_port is not None:
        return lambda: mode(port) is not None and port_open(secure_port)
    if standalone:
        return lambda: mode(port) is not None
    return lambda: four_letter(port, "ruok") == "imok"


class ZooKeeperEnsemble:
    """One standalone server (size 1) or a quorum of several on loopback."""

    def __init__(self, size: int = 1, *, tls: bool = False) -> None:
        """``tls``: a standalone server that also serves TLS on :attr:`secure_port`, with
        throwaway :attr:`certificates`, and refuses TLS clients without a certificate."""
        if not JAR.exists():
            raise RuntimeError(f"{JAR} not found: run ./scripts/test, which installs zookeeper")
        if tls and size != 1:
            raise ValueError("the TLS server is a standalone one")
        if tls and not NETTY_CODEC_JAR.exists():
            raise RuntimeError(f"{NETTY_CODEC_JAR} not found: zookeeper needs libnetty-java")
        self.size = size
        self.root = private_dir("zookeeper")
        self.client_ports = [free_port() for _ in range(size)]
        self.secure_port: int | None = None
        self.certificates: Certificates | None = None
        classpath = [JAR, *(jar for jar in LOGGING_JARS if jar.exists())]
        tls_lines: list[str] = []
        if tls:
            self.secure_port = free_port()
            self.certificates = certs = make_certificates(self.root, ["IP:127.0.0.1"])
            # A PEM key store is the private key followed by its certificate chain.
            keystore = self.root / "server-keystore.pem"
            keystore.write_text(certs.server_key.read_text() + certs.server_cert.read_text())
            classpath.append(NETTY_CODEC_JAR)
            tls_lines = [
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"secureClientPort={self.secure_port}",
                "secureClientPortAddress=127.0.0.1",
                f"ssl.keyStore.location={keystore}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={certs.ca}",
                "ssl.trustStore.type=PEM",
                "ssl.clientAuth=need",
            ]
        peers = [(free_port(), free_port()) for _ in range(size)]
        self.nodes: list[ServerProcess] = []
        for index in range(size):
            conf = self.root / f"node{index + 1}"
            data = conf / "data"
            data.mkdir(parents=True)
            lines = [
                f"tickTime={TICK_MS}",
                "initLimit=50",
                "syncLimit=20",
                f"dataDir={data}",
                f"clientPort={self.client_ports[index]}",
                "clientPortAddress=127.0.0.1",
                "admin.enableServer=false",
                "4lw.commands.whitelist=ruok,srvr",
                "forceSync=no",
                f"minSessionTimeout={2 * TICK_MS}",
                "maxSessionTimeout=60000",
                *tls_lines,
            ]
            if size > 1:
                (data / "myid").write_text(f"{index + 1}\n")
                lines += [
                    f"server.{i + 1}=127.0.0.1:{peer}:{election}"
                    for i, (peer, election) in enumerate(peers)
                ]
            (conf / "zoo.cfg").write_text("\n".join(lines) + "\n")
            (conf / "log4j.properties").write_text(
                "log4j.rootLogger=WARN, CONSOLE\n"
                "log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\n"
            )
            port = self.client_ports[index]
            self.nodes.append(
                ServerProcess(
                    f"zookeeper{index + 1}",
                    [
                        "java",
                        "-Xms32m",
                        "-Xmx256m",
                        "-XX:+UseSerialGC",
                        f"-Dznode.container.checkIntervalMs={CONTAINER_CHECK_MS}",
                        "-cp",
                        ":".join(str(path) for path in [conf, *classpath]),
                        "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                        str(conf / "zoo.cfg"),
                    ],
                    ready=_readiness(port, standalone=size == 1, secure_port=self.secure_port),
                    workdir=conf,
                )
            )

    def seed(self, counters: dict[str, int]) -> None:
        """Before :meth:`start`: persistent nodes (list parents first) whose children's
        sequence counter starts at the value given, written into a snapshot of each
        node's data directory by ZooKeeper's own classes (``java/SeedSnapshot.java``,
        compiled here). A counter cannot otherwise reach 2**31 - 1 in a test: the
        server counts every child created, one create at a time."""
        if any(node.process is not None for node in self.nodes):
            raise RuntimeError("seed the snapshot before the servers start")
        if shutil.which("javac") is None:
            raise RuntimeError("javac not found: run ./scripts/test, which installs a JDK")
        source = Path(__file__).parent / "java" / "SeedSnapshot.java"
        build = self.root / "seed-classes"
        build.mkdir(exist_ok=True)
        subprocess.run(
            ["javac", "-cp", str(JAR), "-d", str(build), str(source)],
            check=True,
            capture_output=True,
        )
        arguments = [str(value) for item in counters.items() for value in item]
        for index in range(self.size):
            data = self.root / f"node{index + 1}" / "data"
            subprocess.run(
                ["java", "-cp", f"{JAR}:{build}", "SeedSnapshot", str(data), *arguments],
                check=True,
                capture_output=True,
            )

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.client_ports)

    def url(self, path: str = "/dlock", **options: object) -> str:
        query = "&".join(f"{key}={value}" for key, value in options.items())
        return f"zookeeper://{self.hosts}{path}" + (f"?{query}" if query else "")

    def tls_url(self, path: str = "/dlock", host: str = "127.0.0.1", **options: object) -> str:
        """A URL of the TLS port, trusting the test CA and presenting the client
        certificate; ``options`` add to or replace (None: leave out) those."""
        if self.certificates is None or self.secure_port is None:
            raise RuntimeError("this server was started without TLS")
        settings: dict[str, object] = {
            "tls": 1,
            "ca": self.certificates.ca,
            "certfile": self.certificates.client_cert,
            "keyfile": self.certificates.client_key,
            **options,
        }
        query = "&".join(f"{key}={value}" for key, value in settings.items() if value is not None)
        return f"zookeeper://{host}:{self.secure_port}{path}?{query}"

    def start(self) -> None:
        start_all(self.nodes, self.wait_serving)

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Wait until every running node serves clients (a quorum formed)."""
        deadline = time.monotonic() + timeout
        for node, port in zip(self.nodes, self.client_ports, strict=True):
            if node.process is None:
                continue
            while mode(port) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} does not serve:\n{node.log_tail()}")
                time.sleep(0.05)

    def leader(self) -> int:
        """Index of the current leader (or the standalone server)."""
        for index, port in enumerate(self.client_ports):
            if self.nodes[index].process is not None and mode(port) in {"leader", "standalone"}:
                return index
        raise RuntimeError("no leader")

    def stop(self) -> None:
        try:
            stop_every(self.nodes, ServerProcess.kill)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def zookeeper_server() -> Iterator[ZooKeeperEnsemble]:
    """A standalone server, for the fast backend-specific tests."""
    server = ZooKeeperEnsemble(1)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def zookeeper_ensemble() -> Iterator[ZooKeeperEnsemble]:
    """Three nodes on loopback: the conformance suite and the failover tests."""
    ensemble = ZooKeeperEnsemble(3)
    ensemble.start()
    yield ensemble
    ensemble.stop()
