"""Cancellations of the asyncio face that have no sync twin, on every backend (the
``url`` fixture): a task cancelled by its own program ends cancelled, and dlock's own
cancellation of a body is never left counted. Found by a helper's audit of the asyncio
face against asyncio's conventions (TaskGroup and ``asyncio.timeout()`` rely on them)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

import pytest

import dlock
import dlock.aio

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="asyncio counts cancellations from 3.11"
)


def current() -> asyncio.Task[object]:
    task = asyncio.current_task()
    assert task is not None
    return task


async def eventually_free(client: dlock.aio.AsyncClient, name: str) -> None:
    """A release cut off is given back in the background, soon."""
    deadline = time.monotonic() + 10
    while await client.inspect(name) is not None:
        assert time.monotonic() < deadline, "the lock was not given back"
        await asyncio.sleep(0.05)


async def renewal_finds_it_lost(lock: dlock.aio.AsyncLock) -> None:
    for _ in range(60):  # 3 s
        if lock.lost:
            break
        await asyncio.sleep(0.05)
    assert lock.lost, "the next renewal should have found the lease gone"


@pytest.mark.parametrize("ends_with", ["block", "release", "extend"])
async def test_a_cancellation_pending_as_a_hold_is_left_stops_the_task(
    url: str, name: str, ends_with: str
) -> None:
    """A task cancelled while it was ready to run (here: by itself), then leaving the
    lock: on Redis the cancellation went into redis-py's call and was dropped there
    (``wait_for`` before Python 3.12), and the task ran on as if never cancelled. It
    stops at the release now, which is cut off as any release and given back (or at
    the extend, which changes nothing)."""
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
        lock = client.lock(name, ttl=10)
        ran_on: list[bool] = []

        async def job() -> None:
            if ends_with == "block":
                async with lock:
                    current().cancel()
            else:
                await lock.acquire()
                current().cancel()
                if ends_with == "extend":
                    await lock.extend()
                await lock.release()
            await asyncio.sleep(0.2)
            ran_on.append(True)

        task = asyncio.create_task(job())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ran_on == [], "the cancellation was dropped: the task ran on"
        if ends_with == "extend":
            # Stopped at the extend, which changes nothing: the hold stays.
            assert lock.owned()
            await lock.release()
        assert not lock.owned()
        await eventually_free(other, name)


async def test_a_programs_own_cancellation_leaves_a_lost_block_cancelled(
    url: str, name: str
) -> None:
    """A reentrant lock's inner block cut off by the task's own cancellation as it
    releases: the cut-off release ends the hold (documented), and the outer block then
    raised LockLost from the cancellation, so the task ended with an error, not
    cancelled, and a TaskGroup or timeout() around it could not tell."""
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as other:
        lock = client.lock(name, ttl=10, reentrant=True)

        async def job() -> None:
            async with lock:
                async with lock:
                    current().cancel()
                await asyncio.sleep(1)

        task = asyncio.create_task(job())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert lock.lost and not lock.owned()
        await eventually_free(other, name)


async def test_a_body_that_catches_the_loss_cancellation_leaves_no_count(
    url: str, name: str
) -> None:
    """dlock cancels a body whose lease is lost. One that caught the cancellation and
    went on left the block with LockLost, and the cancellation counted on its task:
    an ``asyncio.timeout()`` around it then ended the task cancelled rather than with
    TimeoutError."""
    if sys.version_info < (3, 11):  # for mypy, which checks against 3.10
        raise NotImplementedError("asyncio.timeout() and cancelling() are from 3.11")
    async with dlock.aio.connect(url) as client, dlock.aio.connect(url) as admin:
        # Both connected first: on a loaded machine a fresh client's first acquire took
        # longer than the 0.6 s lease it asked for (given back: BackendUnavailable).
        await admin.inspect("connected")
        await client.inspect("connected")
        lock = client.lock(name, ttl=0.6)
        outcome: list[str] = []

        async def job(wait: Callable[[], Awaitable[None]]) -> None:
            try:
                async with asyncio.timeout(2.5):
                    try:
                        async with lock:
                            try:
                                await wait()
                            except asyncio.CancelledError:
                                outcome.append("body cancelled")
                    except dlock.LockLost:
                        counted = current().cancelling()
                        outcome.append(f"LockLost, cancelling {counted}")
                    await asyncio.sleep(10)
            except TimeoutError:
                outcome.append("timed out")

        async def lose_it() -> None:
            # In a task of its own: a cancellation landing in a redis-py call of the
            # body's own may be lost by redis-py (the README's known gap).
            assert await asyncio.shield(asyncio.create_task(admin.force_release(name)))
            await renewal_finds_it_lost(lock)
            await asyncio.sleep(10)

        await asyncio.wait_for(job(lose_it), 15)
        assert outcome == ["body cancelled", "LockLost, cancelling 0", "timed out"], outcome


@pytest.mark.parametrize("ends", ["close", "loss"])
async def test_a_body_whose_hold_was_lost_before_is_not_cancelled_for_a_sharers_hold(
    url: str, name: str, ends: str
) -> None:
    """Two tasks share a lock object that is not reentrant. The first's hold is lost;
    its body catches the cancellation and stays in its block, and the second takes a
    fresh hold in a block of its own. When that hold ends too (the client closes, or
    it is lost), only the second's body is cancelled: the first's was cancelled again,
    for a hold it never had, and left its block with that cancellation still counted."""
    if sys.version_info < (3, 11):  # for mypy, which checks against 3.10
        raise NotImplementedError("cancelling() is from 3.11")
    async with dlock.aio.connect(url) as admin:
        await admin.inspect("connected")
        client = dlock.aio.connect(url)
        lock = client.lock(name, ttl=1.5)
        outcome: list[str] = []
        first_in, second_in = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            try:
                async with lock:
                    first_in.set()
                    try:
                        await asyncio.sleep(10)
                    except asyncio.CancelledError:
                        outcome.append("first cancelled")
                    await second_in.wait()
                    try:
                        await asyncio.sleep(3)
                    except asyncio.CancelledError:
                        outcome.append("first cancelled again")
            except dlock.LockLost:
                outcome.append(f"first: LockLost, cancelling {current().cancelling()}")

        async def second() -> None:
            try:
                async with lock:
                    second_in.set()
                    await asyncio.sleep(10)
            except dlock.LockLost:
                outcome.append("second: LockLost")

        try:
            holder = asyncio.create_task(first())
            await asyncio.wait_for(first_in.wait(), 5)
            assert await admin.force_release(name)
            await renewal_finds_it_lost(lock)
            await asyncio.sleep(0.05)
            taker = asyncio.create_task(second())
            await asyncio.wait_for(second_in.wait(), 5)
            if ends == "close":
                await client.aclose()
            else:
                assert await admin.force_release(name)
            await asyncio.wait_for(asyncio.gather(holder, taker), 10)
        finally:
            await client.aclose()
        assert outcome == [
            "first cancelled",
            "second: LockLost",
            "first: LockLost, cancelling 0",
        ], outcome
