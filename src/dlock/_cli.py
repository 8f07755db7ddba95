"""The ``dlock`` command: run a command under a lock, inspect locks, force-release them.

Conventions follow ``flock(1)``: ``-w SECONDS`` waits at most that long, ``-n`` does not
wait, ``-E CODE`` sets the exit status for "lock not acquired" (default 1, as flock).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import logging
import math
import os
import signal
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NamedTuple, TextIO

from . import __version__
from ._errors import BackendError, BackendUnavailable, ConfigurationError, LockError, LockLost
from ._job import Interrupted, Job, forwarding_signals
from ._registry import default_sqlite_url
from ._sync.client import DEFAULT_TTL, Client, connect
from ._sync.lock import LOST_MESSAGE, Lock
from ._types import LockInfo
from ._validation import (
    DEFAULT_PRUNE_AGE,
    MAX_BATCH,
    SHORTEST_PRUNE_AGE,
    check_batch,
    check_label,
    check_prune_age,
    check_timeout,
    check_ttl,
)

#: Exit statuses of our own (the child's status passes through ``run`` unchanged).
EXIT_CONFLICT = 1  # flock's default; -E changes it
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the backend could not be reached; worth retrying
EXIT_REFUSED = 76  # EX_PROTOCOL: the backend answered with a refusal or failure
EXIT_IOERR = 74  # EX_IOERR: the output could not be written (closed, disk full)
EXIT_LOST = 75  # EX_TEMPFAIL: the lease was lost while the command ran
EXIT_SOFTWARE = 70  # EX_SOFTWARE: an internal error (a bug), told apart from "busy"

DEFAULT_GRACE = 10.0  # seconds between TERM and KILL


def main(argv: Sequence[str] | None = None) -> int:
    # Ctrl-C (SIGINT) wherever no handler of dlock run's own is in, the parsing and the
    # writing of the output too: 130, quietly, as a shell shows a command it killed.
    try:
        return command_line(argv)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except Exception:
        # A bug of dlock's own, or of a library under it: not 1, which a script reads
        # as "busy" (and may skip its job on), but a status of its own, with the trace.
        note(f"dlock: internal error:\n{traceback.format_exc().rstrip()}")
        return EXIT_SOFTWARE


def command_line(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    stdout = sys.stdout  # None if the caller closed it (>&-)
    # --help and --version print, then exit (0): their text is written as a command's
    # output is, so that one that cannot be written is told and ends with 74 (or 141),
    # not with a success that printed nothing. (argparse's own errors go to stderr.)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            args = parser.parse_args(argv)
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else EXIT_USAGE
        return write_output(stdout, printed.getvalue(), code)
    if not getattr(args, "verbose", False):
        # dlock's stderr is its command's too: a client library's warnings about its
        # connections (kazoo's "Connection dropped", "Transition to CONNECTING") would
        # come amid its output. dlock tells what matters itself; -v shows them.
        logging.getLogger("kazoo").setLevel(logging.ERROR)
    if args.handler is cmd_run:
        args.command, args.separated = run_command(argv, args.name, args.command)
        try:  # before connect() checks it, to name it as the command line has it
            check_label(args.label, "--label")
        except LockError as exc:
            note(f"dlock run: {exc}")
            return EXIT_USAGE
    # What a command prints is written once it is done: a failure to write it is then
    # told apart from the backend's, and ends with a status of its own. (``run`` prints
    # nothing there: its command writes to the descriptor itself.)
    output = io.StringIO()
    try:
        with (
            connect(args.url, label=getattr(args, "label", None)) as client,
            contextlib.redirect_stdout(output),
        ):
            status: int = args.handler(client, args)
    except BackendError as exc:
        # Told apart so a script retries only what a retry can mend: a server that is
        # down, not one that refuses the credentials or is a read-only replica.
        note(f"dlock: backend error: {exc}")
        return EXIT_UNAVAILABLE if isinstance(exc, BackendUnavailable) else EXIT_REFUSED
    except LockError as exc:  # bad URL, name, TTL or timeout
        note(f"dlock: {exc}")
        return EXIT_USAGE
    except Interrupted as stop:
        # dlock run: a signal as an error left its wait, before the handlers stopped
        # raising (past the ``except`` that catches them there). Asked to end, as well.
        return 128 + stop.signum
    return write_output(stdout, output.getvalue(), status)


def write_output(stream: TextIO | None, text: str, status: int) -> int:
    if not text:
        return status  # nothing to write: a closed stdout is no error (as GNU tools)
    try:
        if stream is None:
            raise OSError(errno.EBADF, "it is closed")
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        # ``dlock list | head``: end quietly, as a command killed by SIGPIPE would.
        discard_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:  # /dev/full, a closed descriptor, an I/O error
        discard_stdout()
        note(f"dlock: cannot write to standard output: {exc.strerror}")
        return EXIT_IOERR
    return status


def discard_stdout() -> None:
    """Point descriptor 1 at /dev/null: what stays in Python's buffer after a failed
    write is flushed again at exit, and would fail again (status 120, a traceback)."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != 1:  # 1 itself when it was closed (>&-) and nothing took its number since
        os.dup2(null, 1, inheritable=False)
        os.close(null)


class Seconds(float):
    """A number of seconds that messages repeat as it was typed: "not 5", not "not 5.0"."""

    text: str

    def __new__(cls, text: str) -> Seconds:
        try:  # float's own spellings: "1e3", "inf", "nan"
            seconds = super().__new__(cls, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        seconds.text = text.strip()
        return seconds

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def exit_status(text: str) -> int:
    """0-255: a process's status is one byte, so 256 would read as 0, success."""
    try:
        code = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= code <= 255:
        raise argparse.ArgumentTypeError(f"an exit status is 0-255, not {code}")
    return code


#: How every command but ``run`` (which says its own) ends when it cannot do its work.
FAILURE_STATUSES = (
    f"On failure: {EXIT_USAGE} for a bad argument, {EXIT_UNAVAILABLE} if the backend could "
    f"not be reached, {EXIT_REFUSED} if it refused or failed (credentials, privileges, a "
    f"read-only replica), {EXIT_IOERR} if the output could not be written, {EXIT_SOFTWARE} "
    "on an internal error (a bug)."
)


def build_parser() -> argparse.ArgumentParser:
    # argparse formats help with %: a quoted path's own % must be doubled.
    try:
        fallback = default_sqlite_url().replace("%", "%%")
    except ConfigurationError:  # no home directory: said when the default is used
        fallback = "none: no home directory is known"
    url_help = f"backend URL (default: $DLOCK_URL, else {fallback})"
    # --url is accepted before and after the command; SUPPRESS keeps the subcommand's
    # absent --url from overwriting one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=url_help)
    parser = argparse.ArgumentParser(
        prog="dlock", description="Distributed locks with leases and fencing tokens."
    )
    parser.add_argument("--url", help=url_help)
    parser.add_argument("--version", action="version", version=f"dlock {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        parents=[common],
        help="run a command while holding a lock",
        description=(
            "Run COMMAND while holding the lock NAME, renewing its lease. The command "
            "sees DLOCK_NAME, DLOCK_FENCING_TOKEN, DLOCK_TTL and DLOCK_RUN_ID in its "
            "environment. It runs in a "
            "process group of its own: signals to dlock are passed to the whole group, and "
            "the lock is released only once no process of the group is left (what the "
            "command leaves running is stopped: TERM, then KILL after --grace). Exit "
            "status: the command's (also if giving the lock back then fails); the "
            "conflict code if the lock was not acquired; "
            f"{EXIT_LOST} if the lease was lost (the group is stopped the same way); "
            f"{EXIT_UNAVAILABLE} if the backend could not be reached, {EXIT_REFUSED} if it "
            "refused or failed (credentials, privileges, a read-only replica); 128+N if "
            "signal N (TERM, HUP, QUIT, USR1, USR2, INT) ends dlock while it waits for the "
            "lock or before it starts the command (it runs nothing, and gives back a lock "
            f"it got); {EXIT_SOFTWARE} on an internal error (a bug)."
        ),
    )
    run.add_argument(
        "--ttl",
        type=Seconds,
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help=f"lease in seconds ({DEFAULT_TTL:g})",
    )
    wait = run.add_mutually_exclusive_group()
    # --timeout: flock(1)'s name for the same option.
    wait.add_argument(
        "-w", "--wait", "--timeout", type=Seconds, metavar="SECONDS", help="wait at most this long"
    )
    wait.add_argument("-n", "--nonblock", action="store_true", help="fail at once if held")
    run.add_argument(
        "-E",
        "--conflict-exit-code",
        type=exit_status,
        default=EXIT_CONFLICT,
        metavar="CODE",
        help="exit status when the lock is not acquired (%(default)s)",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=(
            "when the lock is busy, say on stderr who holds it and that dlock waits, then "
            "how long the wait took"
        ),
    )
    run.add_argument("--label", help="free-form text shown as part of the holder's identity")
    run.add_argument(
        "--grace",
        type=Seconds,
        default=DEFAULT_GRACE,
        metavar="SECONDS",
        help=(
            "time between TERM and KILL when the command's processes are stopped after a "
            f"lost lease, or left running when it ends ({DEFAULT_GRACE:g})"
        ),
    )
    run.add_argument("name", metavar="NAME")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser(
        "status",
        parents=[common],
        help="show who holds a lock",
        description=(
            f"Show the holder of NAME. Exit status 0 if held, 1 if free. {FAILURE_STATUSES}"
        ),
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("name", metavar="NAME")
    status.set_defaults(handler=cmd_status)

    listing = commands.add_parser(
        "list",
        parents=[common],
        help="list held locks",
        description=(
            "List held locks whose names start with PREFIX (default: all). Exit status 0. "
            f"{FAILURE_STATUSES}"
        ),
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    listing.set_defaults(handler=cmd_list)

    release = commands.add_parser(
        "release",
        parents=[common],
        help="force-release a lock held by someone else",
        description=(
            "Free NAME whoever holds it. The evicted holder learns at its next renewal "
            "that its lease is lost. Exit status 0 if it was held, 1 if it was free. "
            f"{FAILURE_STATUSES}"
        ),
    )
    release.add_argument("--force", action="store_true", required=True, help="required")
    release.add_argument("name", metavar="NAME")
    release.set_defaults(handler=cmd_release)

    init = commands.add_parser(
        "init",
        parents=[common],
        help="create the lock table (SQL backends)",
        description=(
            "Create the lock table now, for teams that manage schema changes themselves "
            "(dlock otherwise creates it on first use). --print shows the SQL instead. "
            f"Exit status 0. {FAILURE_STATUSES}"
        ),
    )
    init.add_argument("--print", action="store_true", help="print the SQL, change nothing")
    init.set_defaults(handler=cmd_init)

    prune = commands.add_parser(
        "prune",
        parents=[common],
        help="delete the rows of names idle for long (SQL backends)",
        description=(
            "Delete the lock table's rows of names nobody has held for SECONDS (by the "
            "server's clock). Every name used keeps a row (its fencing counter), so "
            "per-entity names grow the table; run this from a scheduler. Names made again "
            "later still get larger fencing tokens. Other backends keep no such rows: "
            f"nothing to do. Exit status 0. {FAILURE_STATUSES}"
        ),
    )
    prune.add_argument(
        "--older-than",
        type=Seconds,
        default=DEFAULT_PRUNE_AGE,
        metavar="SECONDS",
        help=f"idle for at least this long, >= {SHORTEST_PRUNE_AGE:g} ({DEFAULT_PRUNE_AGE:g})",
    )
    prune.add_argument(
        "--batch",
        type=int,
        default=1000,
        metavar="ROWS",
        help=f"rows deleted per transaction, 1 to {MAX_BATCH} (%(default)s)",
    )
    prune.set_defaults(handler=cmd_prune)
    return parser


def run_command(argv: list[str], name: str, parsed: list[str]) -> tuple[list[str], bool]:
    """``dlock run``'s command, and whether it came after a ``--`` separator.

    argparse drops the ``--`` after NAME before it hands the rest over, so from what it
    parsed alone, ``NAME -- -x`` looks like the misplaced option ``NAME -x`` and
    ``NAME -- -- cmd`` like ``NAME -- cmd``; the arguments themselves tell them apart.
    """
    if "--" in argv:
        cut = argv.index("--")
        if cut > 0 and argv[cut - 1] == name and argv[cut + 1 :] == parsed:
            return parsed, True
    if parsed[:1] == ["--"]:
        return parsed[1:], True
    return parsed, False


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    command = args.command
    if not args.separated and command and command[0].startswith("-"):
        # argparse stops at NAME: "dlock run NAME -n -- cmd" would run "-n".
        note(f"dlock run: {command[0]!r} after NAME: options go before NAME, the command after --")
        return EXIT_USAGE
    if not command:
        note("dlock run: no command given (dlock run NAME -- COMMAND ...)")
        return EXIT_USAGE
    if not math.isfinite(args.grace) or args.grace < 0:
        note(f"dlock run: --grace must be a finite number of seconds >= 0, not {args.grace}")
        return EXIT_USAGE
    grace = float(args.grace)  # as typed in messages only: the guard is handed its repr
    try:  # named as the command line has them, not as the library's arguments
        ttl = check_ttl(args.ttl, "--ttl")
        wait = check_timeout(args.wait, "--wait")
    except LockError as exc:
        note(f"dlock run: {exc}")
        return EXIT_USAGE
    lost = threading.Event()
    done = threading.Event()

    def on_lost(_: Lock) -> None:
        lost.set()
        done.set()

    # The loss is told once, by stop_after_loss, with what dlock does about it.
    logging.getLogger("dlock").addFilter(lambda record: record.msg != LOST_MESSAGE)
    lock = client.lock(args.name, ttl=ttl, on_lost=on_lost)
    # -w as typed (a Seconds), for -v to repeat: not "1.23457e+06" for 1234567.
    timeout = 0 if args.nonblock else None if wait is None else args.wait
    # Handlers go in before the wait: a signal then ends the wait (a lock got meanwhile
    # is given back at once, not left to its TTL); once the lock is held, signals are
    # kept: one that came before the command starts ends dlock all the same, later ones
    # are passed on as soon as it runs. One that comes as they go in is kept until
    # listen(), which raises it inside the try.
    with forwarding_signals() as forwarder:
        try:
            forwarder.listen()
            acquired, waited = acquire(client, lock, timeout, args.verbose)
            # Asked while a signal still ends dlock: a backend round trip, as long as the
            # backend takes (a signal kept for a command that will not run was lost).
            holder = "" if acquired else holder_if_told(client, args.name)
            forwarder.waiting = False
        except Interrupted as stop:
            # (The handler stopped listening as it raised: later signals are kept.)
            if lock.owned():
                give_back_unused(lock)
            return 128 + stop.signum
        if not acquired:
            note(not_acquired(args.name, holder, waited))
            return int(args.conflict_exit_code)
        env = {
            **os.environ,
            "DLOCK_NAME": args.name,
            "DLOCK_FENCING_TOKEN": str(lock.fencing_token),
            # "30", not "30.0": shell arithmetic takes whole numbers only.
            "DLOCK_TTL": str(int(ttl)) if ttl.is_integer() else repr(ttl),
        }
        if forwarder.pending:
            # Since the wait: not a signal for a command that has not started (which
            # would start only to get it, and perhaps do its first step).
            give_back_unused(lock)
            return 128 + forwarder.pending[0]
        try:
            job = Job(command, env, done, grace)
        except OSError as exc:
            note(f"dlock: cannot run {command[0]!r}: {exc}")
            give_back_unused(lock)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        if job.guard.missing:
            note(f"dlock: no guard for the command ({job.guard.missing}): killed, dlock leaves it")
        try:
            forwarder.attach(job)
            # In slices: a signal whose handler is due as the main thread goes back to
            # sleep in a lock's wait runs only when it wakes.
            while not done.wait(0.1):
                pass
            if lost.is_set() and (not job.ended.is_set() or job.running()):
                return stop_after_loss(job, lock, grace)
            # Still under the handlers: a signal now goes to what is left of the group,
            # and cannot kill dlock halfway through the release.
            return finish(job, lock, grace)
        finally:
            job.close()


class Waited(NamedTuple):
    """A wait that ``-v`` announced, and that ended without the lock."""

    holder: str  #: as the announcement named it (see holder_if_told)
    seconds: float  #: how long it took


def acquire(
    client: Client, lock: Lock, timeout: float | None, verbose: bool
) -> tuple[bool, Waited | None]:
    """Take the lock, waiting at most ``timeout`` seconds (None: for ever). One try
    first, with or without ``verbose``, so that the flag changes the output alone: if
    the lock is busy, ``verbose`` says so on stderr, with its holder if the backend
    tells it, before the wait (else silent, like a hang), and how long the wait took
    once it is over: at once if it got the lock, else the caller says it with why (the
    Waited returned)."""
    given = timeout
    timeout = check_timeout(timeout)  # a bad one is refused before the try, as it was
    start = time.monotonic()
    if lock.acquire(timeout=0):
        return True, None
    if timeout == 0:
        return False, None
    holder = ""
    if verbose:
        holder = holder_if_told(client, lock.name)
        bound = "" if timeout is None else f" (at most {given} s)"
        note(f"dlock: {lock.name!r} is held by someone else{holder}; waiting{bound}")
    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
    acquired = lock.acquire(timeout=left)
    seconds = time.monotonic() - start
    if acquired and verbose:
        note(f"dlock: acquired {lock.name!r} after {seconds:.3f} s of waiting")
    return acquired, Waited(holder, seconds) if verbose and not acquired else None


def not_acquired(name: str, holder: str, waited: Waited | None) -> str:
    """Why ``dlock run`` did not get the lock, naming its holder (``holder``). After a
    wait that ``-v`` announced, with the holder it named then, the line adds what is
    new only: how long the wait took, and the holder if another has it now."""
    if waited is None:
        return f"dlock: {name!r} is held by someone else{holder}"
    now = f"; now held by someone else{holder}" if holder and holder != waited.holder else ""
    return f"dlock: did not acquire {name!r} after {waited.seconds:.3f} s of waiting{now}"


def holder_if_told(client: Client, name: str) -> str:
    """Who holds the lock (host, pid, label, fencing token), for a line that changes no
    outcome: a backend that fails to say names nobody, and the run goes on as it would
    (the wait meets a failure that lasts; a lock not acquired exits with the conflict
    code, not the backend's). So does a holder that released it since the try (a wait
    then takes the lock at once). A signal still ends dlock (not a BackendError)."""
    try:
        info = client.inspect(name)
    except BackendError:
        return ""
    if info is None:
        return ""
    holder = info.holder
    label = f" ({shown(holder.label)})" if holder.label else ""
    return f": {shown(holder.host)} pid {holder.pid}{label}, fencing token {info.fencing_token}"


def note(text: str) -> None:
    """A line on stderr. One that cannot be written (stderr closed, on a full disk, its
    reader gone) is dropped: it must change no outcome, neither the exit status nor
    what dlock does next (such as stopping a command whose lease is lost)."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError):
            print(text, file=sys.stderr)


def finish(job: Job, lock: Lock, grace: float) -> int:
    """The command's own process ended: stop what it left running in its process group
    (the lock covers it until then), give the lock back, pass the command's status on."""
    # A moment first for processes that are ending anyway (a signal to the group ends
    # them together with the command's own process).
    if not job.wait_gone(0.2):
        note(
            f"dlock: the command has ended; stopping what it left running (process group "
            f"{job.pgid}) before releasing {lock.name!r}"
        )
        job.stop(grace)
    status = job.status()
    try:
        lock.release()
    except LockLost as exc:
        note(f"dlock: {exc}; the command may have run without the lock")
        return EXIT_LOST
    except BackendError as exc:
        # The command ran to its end under the lock: its status stands. The backend's
        # (69, "worth retrying") would have a script run it again.
        note(
            f"dlock: the command has ended, but giving back {lock.name!r} failed ({exc}); "
            "it is free once its lease runs out"
        )
    return 128 - status if status < 0 else status


def give_back_unused(lock: Lock) -> None:
    """Give back a lock no command ran under. dlock's status says why nothing ran (a
    signal, a command that cannot start): a give-back that fails is told, not made the
    status (the backend's 69 would have a script retry a command that is not there)."""
    try:
        lock.release()
    except (LockLost, BackendError) as exc:
        note(f"dlock: giving back {lock.name!r} failed ({exc}); it is free once its lease runs out")


def stop_after_loss(job: Job, lock: Lock, grace: float) -> int:
    note(f"dlock: lost the lock {lock.name!r} ({lock._lost_reason}); stopping the command")
    job.stop(grace)
    return EXIT_LOST


def shown(text: str) -> str:
    """Text that other clients wrote (names, hosts, labels), fit for a terminal: with
    a control or other unprintable character it is shown as a Python string literal,
    so it cannot move the cursor, rewrite the screen or fake a row (``--json`` gives
    it exactly)."""
    return text if text.isprintable() else repr(text)


def as_dict(info: LockInfo) -> dict[str, Any]:
    return asdict(info)


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    info = client.inspect(args.name)
    if args.json:
        print(json.dumps(as_dict(info) if info else None, indent=2))
    elif info is None:
        print(f"{shown(args.name)}: free")
    else:
        print_table([info])
        for position, waiter in enumerate(info.waiters, 1):
            # As -v names a holder: a label with a blank ran on from the pid.
            label = f" ({shown(waiter.label)})" if waiter.label else ""
            print(f"  waiting #{position}: {shown(waiter.host)} pid {waiter.pid}{label}")
    return 0 if info else 1


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    infos = client.list(args.prefix)
    if args.json:
        print(json.dumps([as_dict(info) for info in infos], indent=2))
    elif infos:
        print_table(infos)
    return 0


def cmd_release(client: Client, args: argparse.Namespace) -> int:
    if client.force_release(args.name):
        print(f"{shown(args.name)}: released")
        return 0
    print(f"{shown(args.name)}: was not held")
    return 1


def keeps_a_table(client: Client) -> bool:
    """Only the table-keeping backends (SQLite, MySQL, PostgreSQL) have a schema to make
    and a row per name to prune."""
    backend = client._backend
    return hasattr(backend, "schema_sql") and hasattr(backend, "init")


def cmd_init(client: Client, args: argparse.Namespace) -> int:
    if not keeps_a_table(client):
        note("dlock init: this backend keeps no schema; nothing to do")
        return 0
    backend: Any = client._backend
    if args.print:
        for statement in backend.schema_sql():
            print(textwrap.dedent(statement).strip() + ";")
        return 0
    backend.init()
    print("dlock init: lock table ready")
    return 0


def cmd_prune(client: Client, args: argparse.Namespace) -> int:
    try:
        older_than = check_prune_age(args.older_than, "--older-than")
        check_batch(args.batch, "--batch")
    except LockError as exc:
        note(f"dlock prune: {exc}")
        return EXIT_USAGE
    if not keeps_a_table(client):
        note("dlock prune: this backend keeps no row per name; nothing to do")
        return 0
    removed = client.prune(older_than, batch=args.batch)
    print(f"dlock prune: {removed} idle names removed")
    return 0


def print_table(infos: list[LockInfo]) -> None:
    rows = [("NAME", "TOKEN", "HOLDER", "PID", "LABEL", "EXPIRES IN", "COUNT")]
    for info in infos:
        expires = "-" if info.expires_in is None else f"{info.expires_in:.1f}s"
        rows.append(
            (
                shown(info.name),
                str(info.fencing_token),
                shown(info.holder.host),
                str(info.holder.pid),
                shown(info.holder.label or ""),
                expires,
                str(info.count),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


if __name__ == "__main__":
    sys.exit(main())
