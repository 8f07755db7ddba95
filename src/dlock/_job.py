"""Job control for ``dlock run``: the command runs in a process group of its own, which
dlock treats as a shell treats a job.

``dlock run`` must guarantee that nothing the command started runs on once the lock is
lost or released: not the command's own process only, but every process of its group
(and the orphans it leaves, adopted as a subreaper), even once dlock itself is gone (a
guard process, ``_guard.py``). That takes process groups, reaping, the terminal's
foreground (``tcsetpgrp``) and signal forwarding, kept here apart from the command line
itself (``_cli.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any

#: Signals that ``dlock run`` passes on to the command's process group instead of dying
#: of them.
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

#: Stops the terminal causes (Ctrl-Z, reading or configuring it from the background).
TERMINAL_STOPS = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})

#: Forwarded signals that ask the command to end: followed by SIGCONT, so that a stopped
#: process acts on them at once rather than when someone continues it (as GNU timeout).
ENDING_SIGNALS = frozenset({signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT})

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


class Job:
    """The command, run in a process group of its own so that every process it starts
    (and does not move elsewhere with setsid or setpgid) can be signalled and waited for:
    a lost lease stops them all, not only the command's own process, and the lock is
    given back only once the group is empty.

    Towards that group dlock does what a shell's job control does for a job. The group
    starts in the background; when it stops on touching the terminal (SIGTTIN, SIGTTOU)
    while dlock's own group has the terminal, dlock hands the terminal over
    (``tcsetpgrp``) and continues it, so interactive and full-screen programs work, and
    takes it back when the group is gone. A command that never touches the terminal
    leaves it with dlock's group: pipeline neighbours (``dlock run x -- cmd | less``)
    and the script that called dlock keep it, and the terminal's Ctrl-C reaches them
    as before (dlock passes it on). A stop of the command (Ctrl-Z while it has the
    terminal, or a read from the background) is passed to dlock's own group, so the
    shell sees its job stopped. Of dlock's own stops only SIGTSTP (Ctrl-Z while dlock's
    group has the terminal, or ``kill -TSTP``) is passed to the command: SIGSTOP cannot
    be caught, and SIGTTIN or SIGTTOU (dlock itself touching the terminal from the
    background) stop dlock alone, the command running on. A SIGCONT to dlock is passed
    to the command whatever stopped either of them."""

    def __init__(
        self, command: list[str], env: dict[str, str], done: threading.Event, grace: float
    ) -> None:
        become_subreaper()
        #: Ends the group if dlock dies (see _guard.py): started first, so that the
        #: command runs unguarded only until its group's id is written to it.
        run_id = secrets.token_hex(8)
        self.guard = Guard(grace, run_id)
        try:
            self.process = spawn_in_new_group(command, {**env, "DLOCK_RUN_ID": run_id})
        except BaseException:
            self.guard.close()
            raise
        self.pgid = self.process.pid  # the group's leader: its id is the group's
        self.guard.watch(self.pgid)
        #: The group was seen gone: its id may be another's from then on.
        self.gone = False
        self.done = done
        #: The command's own process has ended (and been reaped).
        self.ended = threading.Event()
        #: The group is being ended: its stops are undone rather than passed on.
        self.stopping = False
        #: When the group got its first TERM (``time.monotonic()``), if it got one.
        self.termed_at: float | None = None
        self.terminal = controlling_terminal()
        self.pgrp = os.getpgrp()  # dlock's own group
        threading.Thread(target=self.watch, daemon=True, name="dlock-run-waiter").start()

    def watch(self) -> None:
        """Reap children until the command's process ends, and act on its stops.

        As a subreaper dlock also adopts the orphans of the command's processes;
        reaping them matters: an unreaped zombie keeps the group from looking empty.
        """
        while True:
            try:
                pid, status = os.waitpid(-1, os.WUNTRACED)
            except ChildProcessError:  # cannot happen: this thread alone reaps before the end
                break
            if pid != self.process.pid:
                continue  # an adopted orphan, now reaped
            if os.WIFSTOPPED(status):
                self.stopped(os.WSTOPSIG(status))
                continue
            self.process.returncode = os.waitstatus_to_exitcode(status)
            break
        self.ended.set()
        self.done.set()

    def status(self) -> int:
        """The command's status as ``subprocess`` gives it (-N: died of signal N)."""
        code = self.process.returncode
        return 255 if code is None else code

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every process of the command's group, unless it is gone."""
        if self.gone:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def forward(self, signum: int) -> None:
        if signum == signal.SIGTERM and self.termed_at is None:
            # The group's first TERM, passed on or dlock's own: the grace period runs
            # from it, for the guard (told first, in case dlock is killed next, as
            # ``timeout -k`` and supervisors do) and for ``stop``, and neither sends
            # another (a program may take a second TERM for "quit now").
            self.termed_at = time.monotonic()
            self.guard.stopping()
        self.signal(signum)
        if signum in ENDING_SIGNALS:
            self.signal(signal.SIGCONT)

    def running(self) -> bool:
        """Whether a process of the command's group is left (its leader included, until
        reaped). The group's id cannot be reused while any of them lives."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # there, if not ours to signal (setuid)
        return True

    def wait_gone(self, timeout: float | None) -> bool:
        """Wait until the whole group has ended (True), at most ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while True:
            if self.ended.is_set():
                reap_children()  # orphans adopted since the waiter thread ended
                if not self.running():
                    self.gone = True
                    self.guard.done()
                    return True
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                pause = min(pause, left)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def stop(self, grace: float) -> None:
        """End every process of the group: TERM, then KILL ``grace`` seconds later. A
        TERM the group already got counts, as in the guard: no second one, and the
        grace period runs from it. Returns once none is left."""
        self.stopping = True
        if self.termed_at is None:
            self.forward(signal.SIGTERM)
        else:
            self.signal(signal.SIGCONT)  # a stopped process acts on the TERM it got
        assert self.termed_at is not None
        if not self.wait_gone(max(0.0, self.termed_at + grace - time.monotonic())):
            self.signal(signal.SIGKILL)
            self.wait_gone(None)

    def stopped(self, signum: int) -> None:
        """The command's process stopped (waiter thread)."""
        if self.stopping:
            self.signal(signal.SIGCONT)  # let it act on the TERM
            return
        if signum not in TERMINAL_STOPS:
            return  # SIGSTOP, sent by someone on purpose: theirs to continue
        if signum != signal.SIGTSTP and self.give_terminal():
            self.signal(signal.SIGCONT)
            return
        # As the terminal would have, had the command stayed in our group: stop it,
        # and with it the shell's job (or the calling script); SIGCONT brings us back.
        # (In an orphaned group, with no shell left to continue it, the kernel drops
        # that stop, and the command stays stopped: one in dlock's group would have
        # had its read fail instead.)
        self.take_terminal()
        with contextlib.suppress(OSError):
            os.killpg(self.pgrp, signum)

    def give_terminal(self) -> bool:
        """Hand the terminal to the command's group if dlock's group has it."""
        if self.terminal is None:
            return False
        try:
            if os.tcgetpgrp(self.terminal) != self.pgrp:
                return False
            set_foreground(self.terminal, self.pgid)
        except OSError:
            return False
        return True

    def take_terminal(self) -> None:
        """Take the terminal back from the command's group if it has it."""
        if self.terminal is None:
            return
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(self.terminal) == self.pgid:
                set_foreground(self.terminal, self.pgrp)

    def close(self) -> None:
        self.take_terminal()
        if self.terminal is not None:
            os.close(self.terminal)
            self.terminal = None
        # Unless the group was seen gone, the guard ends what is left of it.
        self.guard.close()


class Guard:
    """The guard process (_guard.py) and the pipe only dlock writes to it, line by line:
    the command's group id, "stopping" once dlock sends it TERM, "done" once it is gone.
    The end of the pipe without "done" (dlock died, or left the group behind) has the
    guard stop the group as a lost lease does: TERM, then KILL after the grace period,
    counted from dlock's own TERM if it sent one.

    Spawned and never waited for (posix_spawn, no Popen): dlock does not wait for it to
    read "done", and reaps it as it reaps the command's orphans (a subreaper)."""

    def __init__(self, grace: float, run_id: str) -> None:
        self.pipe: int | None = None
        #: Why there is none, if there is none (told on stderr by the caller).
        self.missing = ""
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")
        if not sys.executable:
            self.missing = "no Python interpreter to start it with (sys.executable)"
            return
        if not os.path.isfile(script):
            self.missing = f"{script} is not a file (dlock imported from an archive?)"
            return
        read, write = os.pipe()
        try:
            with open(os.devnull, "wb") as null:
                os.posix_spawn(
                    sys.executable,
                    # dlock's session, where the command's group will be.
                    [sys.executable, "-I", "-S", script, repr(grace), run_id, str(os.getsid(0))],
                    os.environ,
                    file_actions=[
                        (os.POSIX_SPAWN_DUP2, read, 0),
                        (os.POSIX_SPAWN_DUP2, null.fileno(), 1),
                        (os.POSIX_SPAWN_DUP2, null.fileno(), 2),
                    ],
                    # A session of its own: the terminal's signals are dlock's to pass on.
                    setsid=True,
                )
        except OSError:
            os.close(write)
            raise
        finally:
            os.close(read)
        self.pipe = write

    def watch(self, pgid: int) -> None:
        self._tell(f"{pgid}\n")

    def stopping(self) -> None:
        self._tell("stopping\n")

    def done(self) -> None:
        self._tell("done\n")
        self.close()

    def close(self) -> None:
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None

    def _tell(self, line: str) -> None:
        if self.pipe is not None:
            with contextlib.suppress(OSError):  # a guard that died: nothing to tell
                os.write(self.pipe, line.encode())


def spawn_in_new_group(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    if sys.version_info >= (3, 11):
        return subprocess.Popen(command, env=env, process_group=0)
    # 3.10 has no process_group=; setpgrp is one system call, made before exec.
    return subprocess.Popen(command, env=env, preexec_fn=os.setpgrp)


def become_subreaper() -> None:
    """On Linux, have the orphans of the command's processes re-parented to dlock rather
    than to PID 1, which in a container may never reap them: a zombie left in the
    command's group would keep dlock waiting for the group to end."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_children() -> None:
    """Reap whatever children have ended (orphans adopted as a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def controlling_terminal() -> int | None:
    """A descriptor of dlock's controlling terminal, if it has one."""
    try:
        return os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None


def set_foreground(terminal: int, pgid: int) -> None:
    """``tcsetpgrp`` with SIGTTOU blocked in this thread: from a background group the
    call would otherwise stop dlock, and the kernel lets it through when it is blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(terminal, pgid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Interrupted(BaseException):
    """A signal ended the wait for the lock (a BaseException, as KeyboardInterrupt is:
    nothing on the way may take it for a failure to retry)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class forwarding_signals:
    """Termination signals end the wait for the lock, then go to the command's process
    group while it runs: INT too, since a Ctrl-C that reaches dlock's group does not
    reach the command's (and one typed while the command has the terminal reaches only
    the command). Once the command runs, a stop of dlock (SIGTSTP) stops the command's
    group too, and SIGCONT continues it."""

    def __init__(self) -> None:
        self.job: Job | None = None
        #: A signal raises Interrupted: set by listen(), inside the ``try`` that catches
        #: it. Until then signals are kept in ``pending``: one raised as the handlers
        #: go in, or before that ``try``, escaped it (a traceback, status 1).
        self.waiting = False
        self.pending: list[int] = []
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> forwarding_signals:
        for signum in FORWARDED_SIGNALS:
            # One ignored as dlock started (``nohup``; INT and QUIT in a script's
            # background job) stays ignored, by dlock and by the command, as a shell
            # keeps it: a handler of ours would have the command take it by default.
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self.saved[signum] = signal.signal(signum, self.forward)
        return self

    def listen(self) -> None:
        """Let a signal end the wait from here on, and end it now if one came while
        the handlers went in."""
        self.waiting = True
        if self.pending:
            self.waiting = False
            raise Interrupted(self.pending[0])

    def attach(self, job: Job) -> None:
        self.job = job
        if signal.getsignal(signal.SIGTSTP) is not signal.SIG_IGN:
            self.saved[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, self.suspend)
        self.saved[signal.SIGCONT] = signal.signal(signal.SIGCONT, self.resume)
        for signum in self.pending:
            job.forward(signum)

    def forward(self, signum: int, frame: object) -> None:
        if self.waiting:
            # Once: a second signal must not interrupt the handling of the first (the
            # give-back of a lock got meanwhile), nor escape it.
            self.waiting = False
            raise Interrupted(signum)
        if self.job is None:
            self.pending.append(signum)
        else:
            self.job.forward(signum)

    def suspend(self, signum: int, frame: object) -> None:
        assert self.job is not None
        # SIGSTOP, not SIGTSTP: the waiter thread ignores that stop rather than taking
        # it for one of the command's own, to pass on to dlock's group (perhaps after
        # dlock has been continued already).
        self.job.signal(signal.SIGSTOP)
        self.job.take_terminal()
        # Stop as the default action would. The signal is sent from the main thread to
        # dlock's pid, so the kernel delivers it to this thread on its way out of kill():
        # stopped there, or dropped if dlock's group is orphaned (no shell to continue
        # it), in which case the command goes on too, as the kernel's rule intends.
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), signal.SIGTSTP)
        finally:
            signal.signal(signal.SIGTSTP, self.suspend)
        self.job.signal(signal.SIGCONT)

    def resume(self, signum: int, frame: object) -> None:
        assert self.job is not None
        self.job.signal(signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
