"""What the backends share about TLS failures."""

from __future__ import annotations

import ssl


def certificate_refused(error: BaseException) -> bool:
    """A TLS handshake failed over a certificate, somewhere in ``error``'s chain: ours
    refused the server's (wrong CA, name or date), or the server refused ours (missing,
    unknown CA, ...). Waiting will not change that, so it is no BackendUnavailable.
    Drivers wrap the ``ssl`` error in their own connection error, hence the chain."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return True
        reason = getattr(current, "reason", None)
        if (
            isinstance(current, ssl.SSLError)
            and isinstance(reason, str)
            and ("CERTIFICATE" in reason or reason.endswith("UNKNOWN_CA"))
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def whose_certificate(error: BaseException) -> str:
    """Which side of a refused handshake (see ``certificate_refused``) refused whose
    certificate, in words that say what to check: OpenSSL's own name the alert alone."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return "the server's certificate is not trusted (check the CA given)"
        current = current.__cause__ or current.__context__
    return "the server refused this client's certificate, or its lack of one"
