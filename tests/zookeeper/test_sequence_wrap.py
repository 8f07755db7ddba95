"""Queue order once a lock node's sequence counter reaches 2**31 - 1.

ZooKeeper names a sequential child after its parent's counter of child creates (its
internal cversion, a signed 32-bit int). At 2**31 - 1 the counter stops: every later
child gets the suffix 2147483647, or, while creates are in flight together, negative
ones (``-2147483648``, ``-2147483647``...). A lock node that is never empty when the
server looks (a hot lock) or not a container (made by an older dlock) gets there after
2**31 acquisitions. The server here starts from a snapshot whose lock nodes' counters
are already near that limit (``ZooKeeperEnsemble.seed``): everything else is the real
server's doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient

import dlock
import dlock.aio
from dlock._types import Acquired, Holder
from tests.servers.zookeeper import ZooKeeperEnsemble

LAST = 2**31 - 1
ROOT = "/dlock-wrapped"
#: Lock node -> its counter in the snapshot. Plain persistent nodes, as an older dlock
#: made them: the server never deletes them, so the counter stays.
COUNTERS = {
    ROOT: 0,
    f"{ROOT}/tie": LAST,
    f"{ROOT}/fifo": LAST - 3,
    f"{ROOT}/negative": LAST - 1,
    f"{ROOT}/fifo-async": LAST - 1,
    f"{ROOT}/same-name": LAST,
}


@pytest.fixture(scope="module")
def wrapped_server() -> Iterator[ZooKeeperEnsemble]:
    server = ZooKeeperEnsemble(1)
    try:
        server.seed(COUNTERS)
        server.start()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture
def raw(wrapped_server: ZooKeeperEnsemble) -> Iterator[KazooClient]:
    zk = KazooClient(hosts=wrapped_server.hosts)
    zk.start()
    yield zk
    zk.stop()
    zk.close()


def suffix(path: str) -> int:
    """The sequence number the server gave a child named ``<hex token>-<number>``."""
    return int(path.rsplit("/", 1)[-1].split("-", 1)[1])


def last_in_a_hash_set(suffix: int) -> str:
    """An owner token whose node the server lists after (almost) any other.

    The server lists children in its hash set's order, by the bucket of Java's
    ``String.hashCode`` (spread as ``HashMap`` does): a node in the last bucket of any
    table up to 1024 wide comes after every node in another bucket. Only so that a
    newcomer placed by that order, as a tie with the holder, would come first."""
    for candidate in range(1 << 20):
        token = f"{candidate:032x}"
        code = 0
        for char in f"{token}-{suffix}":
            code = (31 * code + ord(char)) & 0xFFFFFFFF
        if (code ^ (code >> 16)) & 1023 == 1023:
            return token
    raise AssertionError("no token found")


def test_a_lock_node_past_its_last_sequence_number_grants_one_holder(
    wrapped_server: ZooKeeperEnsemble, raw: KazooClient
) -> None:
    """Every node now gets the suffix 2147483647: a newcomer must never be put ahead
    of the holder (the server lists children in no order of its own)."""
    url = wrapped_server.url(ROOT)
    with dlock.connect(url) as first, dlock.connect(url) as second:
        backend: Any = first._backend
        token = last_in_a_hash_set(LAST)
        held = backend.acquire("tie", token, 60.0, Holder.current(), False)
        assert isinstance(held, Acquired)
        assert raw.get_children(f"{ROOT}/tie") == [f"{token}-{LAST}"]
        granted = []
        for _ in range(10):
            lock = second.lock("tie", ttl=60)
            if lock.acquire(timeout=0):
                granted.append(lock.fencing_token)
                lock.release()
        assert granted == [], f"granted while {held.fencing_token} held the lock"
        info = second.inspect("tie")
        assert info is not None and info.fencing_token == held.fencing_token
        assert backend.release("tie", token) == 0


def test_waiters_past_the_last_sequence_number_are_served_in_order(
    wrapped_server: ZooKeeperEnsemble, raw: KazooClient
) -> None:
    """Waiters that queue across the limit (suffixes 2147483645 to 2147483647, then
    2147483647 again) get the lock one at a time, in the order they queued, with
    growing fencing tokens."""
    url = wrapped_server.url(ROOT)
    clients = [dlock.connect(url) for _ in range(7)]
    try:
        holder = clients[0].lock("fifo", ttl=60)
        assert holder.acquire(timeout=0)
        inside = 0
        overlaps: list[int] = []
        order: list[tuple[int, int]] = []
        guard = threading.Lock()

        def wait(index: int) -> None:
            nonlocal inside
            lock = clients[index].lock("fifo", ttl=60)
            assert lock.acquire(timeout=60)
            token = lock.fencing_token
            assert token is not None
            with guard:
                inside += 1
                overlaps.append(inside)
                order.append((index, token))
            time.sleep(0.05)
            with guard:
                inside -= 1
            lock.release()

        threads = []
        for index in range(1, 7):
            backend: Any = clients[index]._backend
            thread = threading.Thread(target=wait, args=(index,))
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 10
            while not backend._nodes:  # queued before the next one starts
                assert time.monotonic() < deadline
                time.sleep(0.005)
        suffixes = sorted(suffix(child) for child in raw.get_children(f"{ROOT}/fifo"))
        assert suffixes.count(LAST) >= 3, suffixes  # the limit was reached, and stayed
        holder.release()
        for thread in threads:
            thread.join(60)
        assert [index for index, _ in order] == list(range(1, 7))
        tokens = [token for _, token in order]
        assert tokens == sorted(set(tokens)) and tokens[0] > (holder.fencing_token or 0)
        assert max(overlaps) == 1
    finally:
        for client in clients:
            client.close()


def test_negative_sequence_numbers_keep_their_place(
    wrapped_server: ZooKeeperEnsemble, raw: KazooClient
) -> None:
    """Creates in flight together past the limit get negative suffixes, which the
    server writes as '-' and digits. The queue is still the order of creation, for
    inspection and for a newcomer, which must not find itself or anyone else ahead of
    the node that was created first."""
    parent = f"{ROOT}/negative"
    labels = [f"queued-{index}" for index in range(12)]
    creates = [
        raw.create_async(
            f"{parent}/{index:032x}-",
            Holder(host="h", pid=index, label=label).to_json().encode(),
            ephemeral=True,
            sequence=True,
        )
        for index, label in enumerate(labels)
    ]
    paths = [result.get(timeout=10) for result in creates]
    assert any(suffix(path) in (LAST, -(2**31)) for path in paths), paths
    with dlock.connect(wrapped_server.url(ROOT)) as client:
        info = client.inspect("negative")
        assert info is not None
        assert [info.holder.label, *(waiter.label for waiter in info.waiters)] == labels, paths
        assert info.fencing_token == raw.exists(paths[0]).czxid
        assert not client.lock("negative", ttl=60).acquire(timeout=0)
        for path in paths:
            raw.delete(path)
        lock = client.lock("negative", ttl=60)
        assert lock.acquire(timeout=0)
        lock.release()


def test_a_node_given_up_does_not_stop_its_lock_object_past_the_limit(
    wrapped_server: ZooKeeperEnsemble, raw: KazooClient
) -> None:
    """Past the limit the server names every node of one owner token alike. A lock
    object's node given up and not deleted yet (the reaper waits for its next try)
    has the very name its next create would get: that create must not fail on it
    (NodeExists), nor queue behind it. The object's own given-up node goes first."""
    with dlock.connect(wrapped_server.url(ROOT, operation_timeout=1)) as client:
        backend: Any = client._backend
        delete_orphans = backend._delete_orphans
        gate = threading.Event()

        def later() -> None:  # the reaper's next try, once the test lets it
            gate.wait(30)
            delete_orphans()

        backend._delete_orphans = later
        token = "c" * 32
        key = ("same-name", token)
        try:
            first = backend.acquire(*key, 60.0, Holder.current(), False)
            assert isinstance(first, Acquired)
            path = backend._nodes[key].path
            assert path.endswith(f"-{LAST}")
            with backend._stripe(key):
                backend._give_up(key, backend._nodes[key])
            again = backend.acquire(*key, 60.0, Holder.current(), False)
            assert isinstance(again, Acquired) and again.fencing_token > first.fencing_token
            assert raw.exists(path).czxid == again.fencing_token, "made again, at that name"
        finally:
            gate.set()
            backend._delete_orphans = delete_orphans
        assert backend.release(*key) == 0
        assert raw.get_children(f"{ROOT}/same-name") == []


async def test_the_asyncio_face_serves_waiters_past_the_limit_in_order(
    wrapped_server: ZooKeeperEnsemble,
) -> None:
    """The same in the asyncio face: waiters queued past the limit (all numbered
    2147483647), each behind the one before, get the lock one at a time in that order,
    with growing fencing tokens."""
    url = wrapped_server.url(ROOT)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(dlock.aio.connect(url)) for _ in range(6)]
        holder = clients[0].lock("fifo-async", ttl=60)
        assert await holder.acquire(timeout=0)
        order: list[tuple[int, int]] = []
        inside: list[int] = []

        async def wait(index: int) -> None:
            lock = clients[index].lock("fifo-async", ttl=60)
            assert await lock.acquire(timeout=15)
            assert lock.fencing_token is not None
            inside.append(index)
            order.append((len(inside), lock.fencing_token))
            await asyncio.sleep(0.05)
            inside.remove(index)
            await lock.release()

        tasks = []
        for index in range(1, 6):
            tasks.append(asyncio.create_task(wait(index)))
            for _ in range(500):  # queued before the next one starts
                info = await clients[0].inspect("fifo-async")
                if info is not None and len(info.waiters) == index:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the waiter never queued")
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert [holders for holders, _ in order] == [1] * 5, "two holders at once"
        tokens = [token for _, token in order]
        assert tokens == sorted(set(tokens)) and tokens[0] > (holder.fencing_token or 0)


def test_negative_sequence_numbers_under_a_low_count_are_ordered_by_creation(
    zookeeper_server: ZooKeeperEnsemble,
) -> None:
    """A server whose count of creates went negative (ZooKeeper 3.8 stops it at
    2**31 - 1; one that let it run on would show a count that reads low again) names
    children with negative numbers while the count read with them is small. Such a
    name in the line means the numbers are not in the order of creation. The children
    here are named so by hand, in this order: the first created holds the lock."""
    name = f"negative-low-count-{time.monotonic_ns()}"
    with dlock.connect(zookeeper_server.url()) as client:
        assert client.inspect(name) is None  # connected
        backend: Any = client._backend
        zk: Any = backend._zk
        parent = backend._parent(name)
        zk.ensure_path(parent)
        first = zk.create(f"{parent}/{'1' * 32}-0000000007", b"{}", ephemeral=True)
        later = zk.create(f"{parent}/{'2' * 32}--000000003", b"{}", ephemeral=True)
        assert client.force_release(name)
        assert zk.exists(first) is None, "the first created was the holder"
        assert zk.exists(later) is not None
        zk.delete(later)
        zk.delete(parent)
