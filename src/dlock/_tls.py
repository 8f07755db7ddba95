"""What the backends share about TLS: their client files, and their failures."""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator, Mapping, Sequence

from ._errors import ConfigurationError


def check_tls_files(
    settings: Mapping[str, str],
    options: Sequence[str],
    keywords: Sequence[str] = (),
    directories: Sequence[str] = (),
) -> None:
    """Refuse a certificate, key or CRL file (a CA directory among ``directories``) that
    is not there to read, naming it: the driver would say so only as it connects, if at
    all in words that name it (libpq says that the server does not support SSL, when
    that comes first; redis-py raises a ConnectionError, retryable). ``keywords``:
    values that name no file (libpq's ``sslrootcert=system``)."""
    for option in (*options, *directories):
        path = settings.get(option)
        if path is None or path in keywords:
            continue
        if not os.path.exists(path):
            raise ConfigurationError(f"{option}={path!r}: no such file or directory")
        right_kind = os.path.isdir(path) if option in directories else os.path.isfile(path)
        if not right_kind or not os.access(path, os.R_OK):
            kind = "directory" if option in directories else "file"
            raise ConfigurationError(f"{option}={path!r}: not a {kind} this process can read")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its causes, each once. Drivers wrap the ``ssl`` error in their own
    connection error, hence the chain."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def certificate_refused(error: BaseException) -> bool:
    """A TLS handshake failed over a certificate, somewhere in ``error``'s chain: ours
    refused the server's (wrong CA, name or date), or the server refused ours (missing,
    unknown CA, ...). Waiting will not change that, so it is no BackendUnavailable."""
    for current in _chain(error):
        if isinstance(current, ssl.SSLCertVerificationError):
            return True
        reason = getattr(current, "reason", None)
        if (
            isinstance(current, ssl.SSLError)
            and isinstance(reason, str)
            and ("CERTIFICATE" in reason or reason.endswith("UNKNOWN_CA"))
        ):
            return True
    return False


def whose_certificate(error: BaseException) -> str:
    """Which side of a refused handshake (see ``certificate_refused``) refused whose
    certificate, in words that say what to check: OpenSSL's own name the alert alone."""
    if any(isinstance(current, ssl.SSLCertVerificationError) for current in _chain(error)):
        return "the server's certificate is not trusted (check the CA given)"
    return "the server refused this client's certificate, or its lack of one"


def handshake_cut_off(error: BaseException) -> bool:
    """A connection closed or reset as it was made (under TLS: in the handshake), as a
    server that does not speak TLS on that port does (etcd serving plain HTTP), and as
    one going down may."""
    return any(
        isinstance(current, (ssl.SSLEOFError, ConnectionResetError)) for current in _chain(error)
    )


#: What etcd's and ZooKeeper's URLs call the CA, certificate, key and key password.
CLIENT_FILE_OPTIONS = ("ca", "certfile", "keyfile", "keyfile_password")


def load_client_files(
    context: ssl.SSLContext,
    backend: str,
    *,
    ca: str | None,
    certfile: str | None,
    keyfile: str | None,
    password: str | None,
    options: tuple[str, str, str, str] = CLIENT_FILE_OPTIONS,
) -> None:
    """Load the CA to trust and the client's certificate into ``context``, naming the
    file in any error. A key is always loaded with a password (an empty one if none is
    given): without one, OpenSSL asks on the terminal for an encrypted key's
    passphrase, and the caller waited there. ``options``: what the URL calls the four,
    for the error."""
    ca_option, cert_option, key_option, _ = options
    what = f"{ca_option}={ca!r}"
    try:
        if ca:
            context.load_verify_locations(ca)
        if certfile:
            what = f"{cert_option}={certfile!r} with {key_option}={keyfile!r}"
            context.load_cert_chain(certfile, keyfile, str(password or ""))
    except OSError as exc:  # ssl.SSLError is one too
        hint = ""
        if certfile and isinstance(exc, ssl.SSLError):
            hint = _key_hint(exc, certfile, keyfile, password, options)
        raise ConfigurationError(f"{backend} TLS: cannot load {what}: {exc}{hint}") from exc


def _key_hint(
    exc: ssl.SSLError,
    certfile: str,
    keyfile: str | None,
    password: str | None,
    options: tuple[str, str, str, str],
) -> str:
    """What to check when OpenSSL refused a client certificate and its key. It says
    "PEM lib" alike for an encrypted key without its password and for no key at all (a
    certfile without its key, and no keyfile): the file is looked at to tell them apart."""
    _, cert_option, key_option, password_option = options
    if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
        return f" (the private key is not the one of the certificate in {cert_option})"
    source, option = (keyfile, key_option) if keyfile else (certfile, cert_option)
    try:
        with open(source, "rb") as file:
            pem = file.read(1 << 20)
    except OSError:
        return ""
    if b"ENCRYPTED" in pem:
        return f" ({'wrong' if password else 'encrypted: no'} {password_option}?)"
    if b"PRIVATE KEY" not in pem:
        give = "" if keyfile else f": give the key as {key_option}"
        return f" (no private key in {option}{give})"
    return ""
