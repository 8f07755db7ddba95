"""Cancel an asyncio waiter while its server does not answer, and time it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

import dlock.aio


async def cancel_a_parked_waiter(
    url: str, name: str, pause: Callable[[], None], resume: Callable[[], None]
) -> float:
    """A waiter parked behind a holder is cancelled while the server is paused (by
    ``pause``): how long the cancellation took. Once the server is back (``resume``)
    and the holder has released, the waiter's lock object must acquire: its leave of
    the queue, gone on by itself, kept nothing of its token's in the way."""
    async with dlock.aio.connect(url) as holders, dlock.aio.connect(url) as client:
        holder = holders.lock(name, ttl=30)
        assert await holder.acquire(timeout=0)
        lock = client.lock(name, ttl=30)
        waiting = asyncio.create_task(lock.acquire(timeout=30))
        # Parked: in line behind the holder (a fixed sleep could end before a loaded
        # machine's attempt had queued it, and cancel an attempt instead of a wait).
        deadline = time.monotonic() + 10
        while not ((info := await holders.inspect(name)) and info.waiters):
            assert time.monotonic() < deadline, "the waiter never got in line"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # past its attempt, in its wait for a release
        pause()
        try:
            started = time.monotonic()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            took = time.monotonic() - started
        finally:
            resume()
        await holder.release()
        assert await lock.acquire(timeout=10), "the waiter's token is stuck"
        await lock.release()
        return took
