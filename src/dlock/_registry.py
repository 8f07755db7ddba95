"""Which module implements which URL schemes. Adding a backend adds one entry here."""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qsl, quote, urlsplit

from ._errors import BackendNotInstalled, ConfigurationError


@dataclass(frozen=True)
class Entry:
    #: Module under ``dlock._async.backends`` (and its generated ``dlock._sync`` twin).
    module: str
    #: URL schemes this module serves.
    schemes: tuple[str, ...]
    #: ``pip install 'dlock[extra]'`` brings the client library, or None if none is needed.
    extra: str | None = None
    #: Top-level modules whose absence means the extra is missing.
    requires: tuple[str, ...] = ()


_REDIS = ("redis",)
ENTRIES = [
    Entry("sqlite", ("sqlite",)),
    Entry("redis", ("redis", "rediss", "redis+cluster", "rediss+cluster"), "redis", _REDIS),
    Entry("redlock", ("redis+redlock", "rediss+redlock"), "redis", _REDIS),
    Entry("mysql", ("mysql", "mariadb"), "mysql", ("pymysql", "aiomysql")),
    Entry("postgresql", ("postgresql", "postgres"), "postgresql", ("psycopg",)),
    Entry("zookeeper", ("zookeeper",), "zookeeper", ("kazoo",)),
    Entry("etcd", ("etcd", "etcds"), "etcd", ("httpx",)),
]

#: URL scheme -> the entry that serves it.
BACKENDS: dict[str, Entry] = {scheme: entry for entry in ENTRIES for scheme in entry.schemes}


def default_url() -> str:
    """``$DLOCK_URL``, else a SQLite file in the user's state directory. Set but empty
    (``DLOCK_URL=$UNSET``), it is refused: some backend was meant, not a per-user file."""
    url = os.environ.get("DLOCK_URL")
    if url is None:
        return default_sqlite_url()
    if not url:
        try:
            default = f" ({default_sqlite_url()})"
        except ConfigurationError:
            default = ""
        raise ConfigurationError(
            f"$DLOCK_URL is empty: set it to a backend URL, or unset it for the default{default}"
        )
    return url


def default_sqlite_url() -> str:
    """The embedded default: a SQLite file in the user's state directory."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        # The XDG spec says to ignore a relative path: it would make the file, and so
        # the locks, depend on the working directory.
        try:
            home = Path.home()
        except RuntimeError:  # no $HOME, and no password entry (a container's bare UID)
            home = None
        if home is None or not home.is_absolute():
            raise ConfigurationError(
                "no default lock file: the home directory is unknown (no $HOME, and no"
                " password entry for this user) or relative; set $XDG_STATE_HOME to an"
                " absolute path, or give a URL"
            )
        state = str(home / ".local" / "state")
    # A file name is bytes: one not in UTF-8 (a home named in Latin-1) is escaped as its
    # bytes, which the sqlite URL's unquoting gives back.
    path = str(Path(state, "dlock", "locks.sqlite3").absolute())
    return "sqlite://" + quote(path, errors="surrogateescape")


#: ``scheme://user:password@``: the password, up to the host's "@" (a "#" or "?" in it,
#: which ought to be escaped, included).
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*:)[^@/]*@")


def is_default_sqlite_url(url: str) -> bool:
    """Whether ``url`` names the default file (False when there is none: no home)."""
    try:
        return url == default_sqlite_url()
    except ConfigurationError:
        return False


def shown_url(url: str) -> str:
    """``url`` as an error message may show it: its password, if any, hidden."""
    return _PASSWORD.sub(r"\1***@", url)


def split_url(url: str) -> SplitResult:
    """``urlsplit``, whose ValueError (an unclosed IPv6 bracket) becomes ours."""
    if not isinstance(url, str) or ":" not in url:
        raise ConfigurationError(f"not a dlock URL: {url!r} (expected e.g. sqlite:///path/to.db)")
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise ConfigurationError(f"{shown_url(url)!r} cannot be parsed as a URL: {exc}") from None


def _password_spilled(url: str) -> bool:
    """A password with an unencoded '/' or '?' ends the host part there: the rest of
    the password and the real host land in the path (``//user:s3cr/t@host/db``) or in
    an option's name (``//user:s3cr?t@host/db``), and the errors that followed quoted
    them. No path or option name of a server URL has an '@' of its own (SQLite's
    file names may, and have no host)."""
    parts = split_url(url)
    if parts.scheme.lower() == "sqlite" or "@" in parts.netloc:
        return False
    names = (item.partition("=")[0] for item in parts.query.split("&"))
    return "@" in parts.path or any("@" in name for name in names)


def scheme_of(url: str) -> str:
    return split_url(url).scheme.lower()


def load_backend(package: str, url: str, options: dict[str, Any]) -> Any:
    """Import the backend for ``url``'s scheme from ``package`` and build it."""
    scheme = scheme_of(url)
    # Some parsers strip them, some keep them: a file or prefix named with a trailing
    # space (pasted from a config file) was a lock space apart from the one without.
    # An ASCII space inside (a SQLite file's directory) is plain to see, and kept.
    unseen = [char for char in url if not char.isprintable()]
    if unseen or url != url.strip():
        if unseen:
            blank, where = unseen[0], "a control character"
        elif url[0].isspace():
            blank, where = url[0], "a blank at its start"
        else:
            blank, where = url[-1], "a blank at its end"
        if "\ud800" <= blank <= "\udfff":
            # A byte not in UTF-8 (a Latin-1 file name in --url or $DLOCK_URL), as
            # Python decodes argv and the environment, or a lone surrogate: quote()
            # could not encode it, and the refusal was an internal error's traceback.
            where = "a byte that is not UTF-8" if blank >= "\udc80" else "a lone surrogate"
        try:
            written = quote(blank, errors="surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate stands for no byte to write
            raise ConfigurationError(
                f"{scheme}:// URL has {where} ({blank!r}), which is not valid Unicode"
            ) from None
        raise ConfigurationError(
            f"{scheme}:// URL has {where} ({blank!r}):"
            f" write it percent-encoded ({written}), or drop it"
        )
    if _password_spilled(url):
        # Not shown: what follows the break is the rest of a password.
        raise ConfigurationError(
            f"{scheme}:// URL has an '@' after its host: a password's '/', '?' or '#'"
            " is written percent-encoded (%2F, %3F, %23), and an '@' elsewhere too (%40)"
        )
    if split_url(url).fragment:
        raise ConfigurationError(
            f"{shown_url(url)!r} has a #fragment, which no backend reads: a '#' in a"
            " password or a file name is written %23"
        )
    query = split_url(url).query
    twice = sorted({key for key, _ in parse_qsl(query, keep_blank_values=True)} & set(options))
    if twice:
        # As for an option given twice in the query: which one was meant? Silently the
        # keyword's, a table or key prefix apart from the URL's was a lock space apart.
        raise ConfigurationError(
            f"option(s) {', '.join(twice)} given both in the URL's query and as keywords"
            " to connect(): give each once"
        )
    entry = BACKENDS.get(scheme)
    if entry is None:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigurationError(
            f"unknown URL scheme {scheme!r} in {shown_url(url)!r}; known: {known}"
        )
    try:
        module = importlib.import_module(f"{package}.backends.{entry.module}")
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in entry.requires:
            raise BackendNotInstalled(
                f"the {scheme}:// backend needs {missing!r}: pip install 'dlock[{entry.extra}]'"
            ) from exc
        raise
    return module.BACKEND.from_url(url, options)
