"""A lock user in its own OS process, driven by the conformance tests.

worker.py sections URL NAME COUNT RECORDS COUNTER
    Enter the critical section COUNT times; record (fencing token, entry, exit) on
    the system-wide monotonic clock, and increment COUNTER (a file) without any
    other protection, so that overlapping sections lose increments.
worker.py hold URL NAME TTL
    Acquire, print "acquired TOKEN", then obey commands on stdin, one per line:
    release, extend, acquire (again, waiting up to 5 s), check. Exits at end of input.
worker.py wait URL NAME TIMEOUT
    Find the lock busy, print "waiting", then wait for it up to TIMEOUT: print "listening"
    once the wait is one that a release must end promptly (see ``listens``), then
    "acquired AT" (the system-wide monotonic clock) or "timed out".
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import dlock.aio
from dlock._async._primitives import IS_ASYNC, run_blocking
from dlock._async.backend import AsyncWaiter
from dlock._types import Acquired
from tests.conformance.helpers import run_main

#: A sections worker normally finishes in seconds; one still running after this long is
#: stuck, and prints every thread's stack (to the test's captured output) as it exits.
STUCK_AFTER = 150.0


def awaiting(coro: Any) -> list[str]:
    """Where a suspended coroutine waits, outermost first (a task's own stack shows only
    its outermost frame)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


def report_state(client: dlock.aio.AsyncClient) -> None:
    """On SIGUSR1, sent by a test that finds its workers stuck: this client's backend
    state (its queue nodes, waiters, session) and, under asyncio, every task's stack."""
    lines = [f"== worker {os.getpid()}: backend state"]
    # Each value shortened: CI keeps only part of a failure's output, and every
    # worker's state must fit in it.
    lines += [f"  {key} = {value!r:.600}" for key, value in sorted(vars(client._backend).items())]
    print("\n".join(lines), file=sys.stderr, flush=True)
    if IS_ASYNC:
        for task in asyncio.all_tasks():
            print(f"== task {task.get_name()}, awaiting:", file=sys.stderr)
            print("\n".join(awaiting(task.get_coro())), file=sys.stderr, flush=True)
    else:
        faulthandler.dump_traceback(all_threads=True)


async def sections(url: str, name: str, count: int, records: Path, counter: Path) -> None:
    faulthandler.dump_traceback_later(STUCK_AFTER, exit=True)
    log = []
    async with dlock.aio.connect(url, label="sections") as client:
        if IS_ASYNC:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, report_state, client)
        else:
            signal.signal(signal.SIGUSR1, lambda *_: report_state(client))
        lock = client.lock(name, ttl=10)
        for _ in range(count):
            async with lock:
                entered = time.monotonic()
                value = int(counter.read_text() or "0")
                counter.write_text(str(value + 1))
                exited = time.monotonic()
            log.append((lock.fencing_token, entered, exited))
    records.write_text(json.dumps(log))


async def hold(url: str, name: str, ttl: float) -> None:
    lost_calls: list[object] = []
    async with dlock.aio.connect(url, label="holder") as client:
        lock = client.lock(name, ttl=ttl, on_lost=lost_calls.append)
        # The connection's set-up first: under load, a new process's first acquire of a
        # 1 s lease was granted 1.056 s after it was sent (given back: BackendUnavailable).
        await client.inspect(name)
        await lock.acquire()
        print(f"acquired {lock.fencing_token}", flush=True)
        while True:
            command = (await run_blocking(sys.stdin.readline)).strip()
            if not command:
                return
            try:
                if command == "release":
                    await lock.release()
                elif command == "extend":
                    await lock.extend()
                elif command == "acquire":
                    await lock.acquire(timeout=5)
                answer = f"ok lost={lock.lost} on_lost={len(lost_calls)} owned={lock.owned()}"
            except dlock.LockError as exc:
                answer = type(exc).__name__
            print(answer, flush=True)


def listens(waiter: AsyncWaiter, timeout: float, backoff_cap: float) -> bool:
    """Whether the wait that ``waiter`` is about to make, up to ``timeout``, is one that
    a release must end promptly. The core enters the backend's waiter (subscribed;
    ZooKeeper: queued and watching the node ahead), makes an attempt, and waits if it
    found the lock busy: at a wait, only a release lets it in. Except a wait that only
    gets ready to listen and returns for the core to try again: a Redis waiter's first
    (it subscribes; one subscribed already listens from its first), and a SQL turnstile
    waiter's until it is in front of the queue (it queues, and on PostgreSQL LISTENs:
    then, the lease busy, its next wait is for the release's NOTIFY). A waiter that
    cannot be woken (SQLite; MySQL's in front) polls: its wait counts once its backoff
    has reached its cap (full jitter: at least half of it), which must stay short."""
    if not waiter.notifies:
        return timeout >= backoff_cap / 2
    # By the waiter's class, so that a new or renamed one stops here rather than
    # counting a wait that only gets ready (a test that would then pass untested).
    kind = type(waiter).__name__.removeprefix("Async")
    state = vars(waiter)
    if kind == "_PubSubWaiter":
        return state["pubsub"] is not None or bool(state["broken"])
    if kind == "TurnstileWaiter":
        return bool(state["in_front"])
    # etcd's watch starts at the revision the busy attempt saw: it listens from the start.
    if kind in ("ZooKeeperWaiter", "_SessionWaiter", "EtcdWaiter"):
        return True
    raise AssertionError(f"worker.listens has no rule for {type(waiter).__name__}")


class Waits:
    """The waits of one client's lock users in its backend's waiters, under way now:
    those that a release must end promptly (see ``listens``), and those that only get
    ready to listen."""

    def __init__(self) -> None:
        self.listening = 0
        self.getting_ready = 0
        self.guard = threading.Lock()


def observe_waits(
    client: dlock.aio.AsyncClient, first: Callable[[], object] | None = None
) -> Waits:
    """Count ``client``'s waits (see ``Waits``), and call ``first`` as the first that a
    release must end promptly starts. An observation: the real waiter does all the
    waiting."""
    real_waiter = client._backend.waiter
    waits = Waits()
    reported: list[bool] = []

    @asynccontextmanager
    async def observed(lock_name: str, token: str) -> AsyncIterator[AsyncWaiter]:
        async with real_waiter(lock_name, token) as waiter:
            real_wait = waiter.wait

            async def wait(timeout: float) -> Acquired | None:
                listening = listens(waiter, timeout, client._backoff.maximum)
                with waits.guard:
                    if listening:
                        waits.listening += 1
                        if not reported and first is not None:
                            reported.append(True)
                            first()
                    else:
                        waits.getting_ready += 1
                try:
                    return await real_wait(timeout)
                finally:
                    with waits.guard:
                        if listening:
                            waits.listening -= 1
                        else:
                            waits.getting_ready -= 1

            waiter.wait = wait  # type: ignore[method-assign]
            yield waiter

    client._backend.waiter = observed  # type: ignore[method-assign,assignment]
    return waits


async def wait(url: str, name: str, timeout: float) -> None:
    async with dlock.aio.connect(url, label="waiter") as client:
        observe_waits(client, partial(print, "listening", flush=True))
        lock = client.lock(name, ttl=10)
        if await lock.acquire(timeout=0):
            raise SystemExit("the lock was free: nothing to wait for")
        print("waiting", flush=True)
        if await lock.acquire(timeout=timeout):
            print(f"acquired {time.monotonic()}", flush=True)
            await lock.release()
        else:
            print("timed out", flush=True)


async def main(argv: list[str]) -> None:
    if argv[0] == "sections":
        await sections(argv[1], argv[2], int(argv[3]), Path(argv[4]), Path(argv[5]))
    elif argv[0] == "hold":
        await hold(argv[1], argv[2], float(argv[3]))
    elif argv[0] == "wait":
        await wait(argv[1], argv[2], float(argv[3]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    run_main(main(sys.argv[1:]))
