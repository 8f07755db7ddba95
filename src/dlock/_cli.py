"""The ``dlock`` command: run a command under a lock, inspect locks, force-release them.

Conventions follow ``flock(1)``: ``-w SECONDS`` waits at most that long, ``-n`` does not
wait, ``-E CODE`` sets the exit status for "lock not acquired" (default 1, as flock).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from . import __version__
from ._errors import BackendError, LockError, LockLost
from ._sync.client import DEFAULT_TTL, Client, connect
from ._sync.lock import Lock
from ._types import LockInfo
from ._validation import DEFAULT_PRUNE_AGE, SHORTEST_PRUNE_AGE

#: Exit statuses of our own (the child's status passes through ``run`` unchanged).
EXIT_CONFLICT = 1  # flock's default; -E changes it
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the backend could not be used
EXIT_LOST = 75  # EX_TEMPFAIL: the lease was lost while the command ran

#: Signals that ``dlock run`` passes on to the command instead of dying of them.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with connect(args.url, label=getattr(args, "label", None)) as client:
            status: int = args.handler(client, args)
            sys.stdout.flush()  # a reader that went away shows here, not at exit
            return status
    except BrokenPipeError:
        # ``dlock list | head``: end quietly, as a command killed by SIGPIPE would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except BackendError as exc:
        print(f"dlock: backend error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except LockError as exc:  # bad URL, name, TTL or timeout
        print(f"dlock: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def exit_status(text: str) -> int:
    """0-255: a process's status is one byte, so 256 would read as 0, success."""
    try:
        code = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= code <= 255:
        raise argparse.ArgumentTypeError(f"an exit status is 0-255, not {code}")
    return code


def build_parser() -> argparse.ArgumentParser:
    url_help = "backend URL (default: $DLOCK_URL, else a SQLite file in ~/.local/state/dlock)"
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
            "sees DLOCK_NAME and DLOCK_FENCING_TOKEN in its environment. Exit status: the "
            f"command's; the conflict code if the lock was not acquired; {EXIT_LOST} if the "
            f"lease was lost (the command is stopped: TERM, then KILL); {EXIT_UNAVAILABLE} if "
            "the backend failed."
        ),
    )
    run.add_argument(
        "--ttl", type=float, default=DEFAULT_TTL, help="lease in seconds (%(default)s)"
    )
    wait = run.add_mutually_exclusive_group()
    wait.add_argument("-w", "--wait", type=float, metavar="SECONDS", help="wait at most this long")
    wait.add_argument("-n", "--nonblock", action="store_true", help="fail at once if held")
    run.add_argument(
        "-E",
        "--conflict-exit-code",
        type=exit_status,
        default=EXIT_CONFLICT,
        metavar="CODE",
        help="exit status when the lock is not acquired (%(default)s)",
    )
    run.add_argument("--label", help="free-form text shown as part of the holder's identity")
    run.add_argument(
        "--grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="after a lost lease, time between TERM and KILL (%(default)s)",
    )
    run.add_argument("name", metavar="NAME")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser(
        "status",
        parents=[common],
        help="show who holds a lock",
        description="Show the holder of NAME. Exit status 0 if held, 1 if free.",
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("name", metavar="NAME")
    status.set_defaults(handler=cmd_status)

    listing = commands.add_parser(
        "list",
        parents=[common],
        help="list held locks",
        description="List held locks whose names start with PREFIX (default: all).",
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
            "that its lease is lost. Exit status 0 if it was held, 1 if it was free."
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
            "(dlock otherwise creates it on first use). --print shows the SQL instead."
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
            "later still get larger fencing tokens."
        ),
    )
    prune.add_argument(
        "--older-than",
        type=float,
        default=DEFAULT_PRUNE_AGE,
        metavar="SECONDS",
        help=f"idle for at least this long, >= {SHORTEST_PRUNE_AGE:g} (%(default)s)",
    )
    prune.add_argument(
        "--batch",
        type=int,
        default=1000,
        metavar="ROWS",
        help="rows deleted per transaction (%(default)s)",
    )
    prune.set_defaults(handler=cmd_prune)
    return parser


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command is args.command and command and command[0].startswith("-"):
        # argparse stops at NAME: "dlock run NAME -n -- cmd" would run "-n".
        print(
            f"dlock run: {command[0]!r} after NAME: options go before NAME, the command after --",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not command:
        print("dlock run: no command given (dlock run NAME -- COMMAND ...)", file=sys.stderr)
        return EXIT_USAGE
    if not math.isfinite(args.grace) or args.grace < 0:
        print(f"dlock run: --grace must be >= 0 seconds, not {args.grace}", file=sys.stderr)
        return EXIT_USAGE
    lost = threading.Event()
    done = threading.Event()

    def on_lost(_: Lock) -> None:
        lost.set()
        done.set()

    lock = client.lock(args.name, ttl=args.ttl, on_lost=on_lost)
    timeout = 0 if args.nonblock else args.wait
    # Handlers go in before the wait: a signal then ends the wait (a lock got meanwhile
    # is given back at once, not left to its TTL); once the lock is held, signals are
    # kept for the child and passed on as soon as it runs.
    with forwarding_signals() as forwarder:
        try:
            acquired = lock.acquire(timeout=timeout)
            forwarder.waiting = False
        except Interrupted as stop:
            forwarder.waiting = False
            if lock.owned():
                lock.release()
            return 128 + stop.signum
        if not acquired:
            print(
                f"dlock: {args.name!r} is held by someone else{describe(client, args.name)}",
                file=sys.stderr,
            )
            return int(args.conflict_exit_code)
        env = {
            **os.environ,
            "DLOCK_NAME": args.name,
            "DLOCK_FENCING_TOKEN": str(lock.fencing_token),
            "DLOCK_TTL": str(args.ttl),
        }
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            lock.release()
            print(f"dlock: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        forwarder.attach(child)

        def wait_for_child() -> None:
            child.wait()
            done.set()

        threading.Thread(target=wait_for_child, daemon=True).start()
        done.wait()
        if lost.is_set() and child.poll() is None:
            return stop_after_loss(child, lock, args.grace)
        # Still under the handlers: a signal now goes to the ended child (nowhere), and
        # cannot kill dlock halfway through the release.
        return finish(child, lock)


def finish(child: subprocess.Popen[bytes], lock: Lock) -> int:
    """The command ended on its own: give the lock back and pass its status on."""
    status = child.wait()
    try:
        lock.release()
    except LockLost as exc:
        print(f"dlock: {exc}; the command may have run without the lock", file=sys.stderr)
        return EXIT_LOST
    return 128 - status if status < 0 else status


def stop_after_loss(child: subprocess.Popen[bytes], lock: Lock, grace: float) -> int:
    print(
        f"dlock: lost the lock {lock.name!r} ({lock._lost_reason}); stopping the command",
        file=sys.stderr,
    )
    child.terminate()
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return EXIT_LOST


class Interrupted(BaseException):
    """A signal ended the wait for the lock (a BaseException, as KeyboardInterrupt is:
    nothing on the way may take it for a failure to retry)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class forwarding_signals:
    """Termination signals end the wait for the lock, then go to the child while it
    runs. SIGINT is passed on too, unless dlock runs in its terminal's foreground: the
    terminal's Ctrl-C then reaches the child already (it shares our process group),
    and twice would be one too many."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.waiting = True
        self.pending: list[int] = []
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> forwarding_signals:
        self.saved[signal.SIGINT] = signal.signal(signal.SIGINT, self.interrupt)
        for signum in FORWARDED_SIGNALS:
            self.saved[signum] = signal.signal(signum, self.forward)
        return self

    def interrupt(self, signum: int, frame: object) -> None:
        if self.waiting or not in_terminal_foreground():
            self.forward(signum, frame)

    def attach(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        for signum in self.pending:
            child.send_signal(signum)

    def forward(self, signum: int, frame: object) -> None:
        if self.waiting:
            raise Interrupted(signum)
        if self.child is None:
            self.pending.append(signum)
        elif self.child.poll() is None:
            self.child.send_signal(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def in_terminal_foreground() -> bool:
    """Whether our process group is the foreground one of our controlling terminal."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal: no Ctrl-C from one either
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def shown(text: str) -> str:
    """Text that other clients wrote (names, hosts, labels), fit for a terminal: with
    a control or other unprintable character it is shown as a Python string literal,
    so it cannot move the cursor, rewrite the screen or fake a row (``--json`` gives
    it exactly)."""
    return text if text.isprintable() else repr(text)


def describe(client: Client, name: str) -> str:
    info = client.inspect(name)
    if info is None:
        return ""
    holder = info.holder
    label = f" ({shown(holder.label)})" if holder.label else ""
    return f": {shown(holder.host)} pid {holder.pid}{label}, fencing token {info.fencing_token}"


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
            label = shown(waiter.label or "")
            print(f"  waiting #{position}: {shown(waiter.host)} pid {waiter.pid} {label}")
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


def cmd_init(client: Client, args: argparse.Namespace) -> int:
    # Only the table-keeping backends (SQLite, MySQL, PostgreSQL) have a schema.
    schema_sql = getattr(client._backend, "schema_sql", None)
    init = getattr(client._backend, "init", None)
    if schema_sql is None or init is None:
        print("dlock init: this backend keeps no schema; nothing to do", file=sys.stderr)
        return 0
    if args.print:
        for statement in schema_sql():
            print(textwrap.dedent(statement).strip() + ";")
        return 0
    init()
    print("dlock init: lock table ready")
    return 0


def cmd_prune(client: Client, args: argparse.Namespace) -> int:
    removed = client.prune(args.older_than, batch=args.batch)
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
