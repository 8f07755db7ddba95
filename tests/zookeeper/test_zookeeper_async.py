"""The asyncio face on ZooKeeper: cancellation leaves the queue, loss cancels the body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from kazoo.client import KazooClient

import dlock
import dlock.aio
from tests.servers.zookeeper import ZooKeeperEnsemble


async def test_cancelled_waiter_leaves_the_queue(zookeeper_server: ZooKeeperEnsemble) -> None:
    url = zookeeper_server.url()
    name = f"cancel-{time.monotonic_ns()}"
    async with dlock.aio.connect(url) as first, dlock.aio.connect(url) as second:
        holder = first.lock(name, ttl=5)
        await holder.acquire()
        task = asyncio.create_task(second.lock(name, ttl=5).acquire())
        for _ in range(100):
            info = await first.inspect(name)
            if info is not None and len(info.waiters) == 1:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the waiter never queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The cancellation is seen at once; the node's delete goes on by itself (a
        # round trip later here, awaited it held a cancellation up for a whole
        # operation timeout on a server that does not answer).
        for _ in range(100):
            info = await first.inspect(name)
            assert info is not None
            if info.waiters == ():
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail(f"the cancelled waiter is still queued: {info.waiters}")
        await holder.release()
        assert await first.inspect(name) is None


@pytest.mark.parametrize("auto_renew", [True, False], ids=["renewed", "not-renewed"])
async def test_expired_session_cancels_the_body(
    zookeeper_server: ZooKeeperEnsemble, auto_renew: bool
) -> None:
    """The session expires under the body (a twin client with its id ends it): the body
    is cancelled and on_lost told once; with auto_renew=False too, its TTL far off (the
    session's end is the lease's end all the same)."""
    name = f"expire-async-{auto_renew}-{time.monotonic_ns()}"
    lost: list[object] = []
    async with dlock.aio.connect(zookeeper_server.url(session_timeout=4)) as client:
        body_finished = False
        with pytest.raises(dlock.LockLost):
            async with client.lock(name, ttl=60, auto_renew=auto_renew, on_lost=lost.append):
                zk = client._backend._zk  # type: ignore[attr-defined]
                twin = KazooClient(hosts=zookeeper_server.hosts, client_id=zk.client_id)
                await asyncio.to_thread(twin.start)
                await asyncio.to_thread(twin.stop)
                twin.close()
                await asyncio.sleep(5)
                body_finished = True
        assert not body_finished and len(lost) == 1


async def test_attempts_cut_off_mid_request_leave_no_node_behind(
    zookeeper_server: ZooKeeperEnsemble,
) -> None:
    """asyncio operations await kazoo's replies in the loop: cancelled at any of those
    points, an attempt (queued or not) must not leave a node blocking the line."""
    name = f"cut-off-{time.monotonic_ns()}"
    url = zookeeper_server.url()
    zk = KazooClient(hosts=zookeeper_server.hosts, timeout=5)
    await asyncio.to_thread(zk.start)
    async with dlock.aio.connect(url) as first, dlock.aio.connect(url) as second:
        holder = first.lock(name, ttl=10)
        await holder.acquire()
        parent = first._backend._parent(name)  # type: ignore[attr-defined]
        for steps in range(40):
            lock = second.lock(name, ttl=10)
            task = asyncio.create_task(lock.acquire(timeout=0 if steps % 2 else 5))
            for _ in range(steps // 2):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                assert not await task
        # Give-backs of attempts cut off after their create was sent delete the node
        # once the create's reply is in: until then the node may not be listed yet.
        for give_back in second._give_backs:
            await asyncio.wait_for(asyncio.wait([give_back]), 10)
        deadline = time.monotonic() + 10
        while len(await asyncio.to_thread(zk.get_children, parent)) > 1:
            assert time.monotonic() < deadline, await asyncio.to_thread(zk.get_children, parent)
            await asyncio.sleep(0.05)
        await holder.release()
        assert await second.lock(name, ttl=10).acquire(timeout=0)
    await asyncio.to_thread(zk.stop)
    zk.close()


def test_a_client_serves_a_second_event_loop(zookeeper_server: ZooKeeperEnsemble) -> None:
    """A client used by two asyncio.run calls: the per-key stripes and the reaper of
    the first loop cannot serve the second; both are made again there."""
    url = zookeeper_server.url()
    name = f"two-loops-{time.monotonic_ns()}"
    names = [f"{name}-{i}" for i in range(20)]
    client = dlock.aio.connect(url)

    async def contend() -> None:
        # 200 keys on 64 stripes, all in flight at once: many stripes must wait.
        locks = [client.lock(n, ttl=10) for n in names * 10]
        await asyncio.gather(*(lock.acquire(timeout=0) for lock in locks))
        assert sum(lock.owned() for lock in locks) == len(names)
        await asyncio.gather(*(lock.release() for lock in locks if lock.owned()))

    async def unrenewed_lease_ends(last: bool) -> None:
        try:
            await contend()
            lock = client.lock(name, ttl=0.5, auto_renew=False)
            assert await lock.acquire(timeout=0)
            deadline = time.monotonic() + 5
            while await client.inspect(name) is not None:
                assert time.monotonic() < deadline, "the lease outlived its ttl"
                await asyncio.sleep(0.05)
        finally:
            if last:
                await client.aclose()

    asyncio.run(unrenewed_lease_ends(last=False))
    asyncio.run(unrenewed_lease_ends(last=True))


def test_a_lease_left_by_an_ended_loop_ends_once_another_loop_inspects(
    zookeeper_server: ZooKeeperEnsemble,
) -> None:
    """The reaper of an unrenewed lease is a task of the loop that took it: once that
    loop ended, any operation in a new loop (here only inspection) starts it again."""
    url = zookeeper_server.url()
    name = f"ended-loop-{time.monotonic_ns()}"
    client = dlock.aio.connect(url)

    async def take() -> None:
        assert await client.lock(name, ttl=0.5, auto_renew=False).acquire(timeout=0)

    async def inspect_until_freed() -> None:
        try:
            deadline = time.monotonic() + 5
            while await client.inspect(name) is not None:
                assert time.monotonic() < deadline, "the lease outlived its ttl"
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    asyncio.run(take())
    asyncio.run(inspect_until_freed())


async def test_a_close_after_a_cancelled_one_is_quiet(zookeeper_server: ZooKeeperEnsemble) -> None:
    """A close cut off while the server answered nothing left its stop running in a
    thread; the next close stopped the client again, racing it, and kazoo's bare
    Exception ("Cannot close connection until it is stopped") came out of aclose()
    (a helper's finding, 5 of 6). The client is stopped once."""
    client = dlock.aio.connect(zookeeper_server.url(session_timeout=1.5))
    lock = client.lock(f"close-twice-{time.monotonic_ns()}", ttl=5)
    assert await lock.acquire(timeout=0)
    server = zookeeper_server.nodes[0]
    server.pause()
    try:
        await asyncio.sleep(1.6)  # past the session
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.aclose(), 0.2)
    finally:
        server.resume()
    await client.aclose()


async def test_a_renewal_cut_off_by_its_bound_says_so_in_words(
    zookeeper_server: ZooKeeperEnsemble, caplog: pytest.LogCaptureFixture
) -> None:
    """The renewal of a lease whose server is paused is cut off when the lease runs
    out, and warns of it. The warning showed the asyncio bound's error as a repr,
    "they ran out meanwhile: TimeoutError('no answer within 1.989 s')" (a chaos run,
    a paused leader), where the other warnings say what happened in words."""
    server = zookeeper_server.nodes[0]
    async with dlock.aio.connect(zookeeper_server.url(operation_timeout=5)) as client:
        lock = client.lock(f"renewal-words-{time.monotonic_ns()}", ttl=2)
        assert await lock.acquire(timeout=0)
        with caplog.at_level(logging.WARNING, "dlock"):
            server.pause()
            try:
                deadline = time.monotonic() + 10
                while not any("renewing" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "the renewal never failed"
                    await asyncio.sleep(0.05)
            finally:
                server.resume()
    (warning,) = [r.getMessage() for r in caplog.records if "renewing" in r.getMessage()]
    assert "the backend did not answer in time (no answer within" in warning, warning
    assert "Error(" not in warning, warning
