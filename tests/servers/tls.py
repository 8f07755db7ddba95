"""Throwaway certificates for the TLS tests, made with ``openssl`` in a private directory.

One CA signs a server certificate (for the names given) and a client certificate; a
second CA signs nothing the servers use, so a client that trusts only it must refuse
them. Nothing is trusted outside the test that made them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Passphrase of the encrypted copy of the client key.
CLIENT_KEY_PASSWORD = "dlock-test-passphrase"


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: The client key again, encrypted with :data:`CLIENT_KEY_PASSWORD`.
    client_key_encrypted: Path
    #: A CA that signed none of the above.
    other_ca: Path


def openssl(workdir: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True, timeout=60)


def _self_signed_ca(workdir: Path, stem: str, subject: str) -> Path:
    openssl(
        workdir,
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        subject,
        "-keyout",
        f"{stem}.key",
        "-out",
        f"{stem}.crt",
    )
    return workdir / f"{stem}.crt"


def _signed(workdir: Path, stem: str, subject: str, names: Sequence[str]) -> tuple[Path, Path]:
    """A key and a certificate for ``names`` (``IP:...``, ``DNS:...``), signed by ca.crt."""
    openssl(
        workdir,
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        subject,
        "-keyout",
        f"{stem}.key",
        "-out",
        f"{stem}.csr",
    )
    (workdir / f"{stem}.ext").write_text(f"subjectAltName={','.join(names)}\n")
    openssl(
        workdir,
        "x509",
        "-req",
        "-in",
        f"{stem}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{stem}.ext",
        "-out",
        f"{stem}.crt",
    )
    return workdir / f"{stem}.crt", workdir / f"{stem}.key"


def make_certificates(
    workdir: Path, server_names: Sequence[str] = ("IP:127.0.0.1", "DNS:localhost")
) -> Certificates:
    """A CA, a server certificate valid for ``server_names``, a client certificate."""
    ca = _self_signed_ca(workdir, "ca", "/CN=dlock test CA")
    other_ca = _self_signed_ca(workdir, "other-ca", "/CN=dlock unrelated test CA")
    server_cert, server_key = _signed(workdir, "server", "/CN=dlock test server", server_names)
    client_cert, client_key = _signed(workdir, "client", "/CN=dlock test client", ["IP:127.0.0.1"])
    openssl(
        workdir,
        "pkey",
        "-in",
        "client.key",
        "-aes256",
        "-passout",
        f"pass:{CLIENT_KEY_PASSWORD}",
        "-out",
        "client-encrypted.key",
    )
    return Certificates(
        ca=ca,
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
        client_key_encrypted=workdir / "client-encrypted.key",
        other_ca=other_ca,
    )
