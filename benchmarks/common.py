"""Measuring locks the same way for every backend: latency, and contention across processes.

Timings are noisy on a shared machine, so every table compares against a baseline row
measured in the same run, and reports ratios.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol

import dlock
import dlock.aio


class LockHandle(Protocol):
    def acquire(self) -> None: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


class DlockHandle:
    """dlock's sync face as a contending process uses it: one client, one lock."""

    def __init__(self, url: str, name: str = "bench", ttl: float = 30.0) -> None:
        self.client = dlock.connect(url)
        self.lock = self.client.lock(name, ttl=ttl)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.client.close()


@contextmanager
def dlock_ops(url: str) -> Iterator[dict[str, Callable[[], object]]]:
    """dlock's uncontended acquire+release on both faces, ready for :func:`measure_latencies`."""
    client = dlock.connect(url)
    lock = client.lock("uncontended", ttl=30)
    loop = asyncio.new_event_loop()
    aclient = dlock.aio.connect(url)
    alock = aclient.lock("uncontended-async", ttl=30)

    def sync_acquire_release() -> None:
        lock.acquire(timeout=0)
        lock.release()

    async def async_acquire_release() -> None:
        await alock.acquire(timeout=0)
        await alock.release()

    try:
        yield {
            "dlock sync": sync_acquire_release,
            "dlock asyncio": lambda: loop.run_until_complete(async_acquire_release()),
        }
    finally:
        client.close()
        loop.run_until_complete(aclient.aclose())
        loop.close()


def open_dlock(url: str) -> DlockHandle:
    """For :func:`measure_contention`: module level, so spawned processes can import it."""
    return DlockHandle(url)


@dataclass(frozen=True)
class Latency:
    median_us: float
    p99_us: float


@dataclass(frozen=True)
class Contention:
    sections_per_s: float
    median_handoff_ms: float
    longest_wait_ms: float
    counter: int
    expected: int


def _samples(op: Callable[[], object], iterations: int) -> list[float]:
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        op()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def _summary(samples: list[float]) -> Latency:
    samples = sorted(samples)
    return Latency(statistics.median(samples), samples[max(0, int(len(samples) * 0.99) - 1)])


def measure_latency(op: Callable[[], object], iterations: int = 2000, warmup: int = 200) -> Latency:
    """Median and 99th percentile of one call of ``op``, in microseconds."""
    _samples(op, warmup)
    return _summary(_samples(op, iterations))


def measure_latencies(
    ops: dict[str, Callable[[], object]],
    iterations: int = 2000,
    warmup: int = 200,
    rounds: int = 10,
) -> dict[str, Latency]:
    """Like :func:`measure_latency` for several ops, interleaved in ``rounds`` blocks.

    Interleaving spreads the machine's drift (other load, disk state) over every op
    alike, so their ratios mean something even when absolute timings wander.
    """
    for op in ops.values():
        _samples(op, warmup)
    samples: dict[str, list[float]] = {label: [] for label in ops}
    for _ in range(rounds):
        for label, op in ops.items():
            samples[label] += _samples(op, max(1, iterations // rounds))
    return {label: _summary(values) for label, values in samples.items()}


#: Sections each contending process runs, all processes at once, before the timed ones.
WARM_UP_SECTIONS = 5


def _contender(
    open_lock: Callable[[Any], LockHandle],
    config: Any,
    sections: int,
    barrier: Any,
    counter: Any,
    results: Any,
) -> None:
    handle = open_lock(config)
    # Before the start, all at once, so that connecting (and loading scripts), including
    # what a library opens only to wait for a busy lock, is not timed: steady state.
    barrier.wait()
    for _ in range(WARM_UP_SECTIONS):
        handle.acquire()
        handle.release()
    barrier.wait()
    records = []
    for _ in range(sections):
        waiting = time.monotonic()
        handle.acquire()
        acquired = time.monotonic()
        # Unprotected read-modify-write: overlapping critical sections lose increments.
        value = counter.value
        time.sleep(0)
        counter.value = value + 1
        released = time.monotonic()
        handle.release()
        records.append((waiting, acquired, released))
    handle.close()
    results.put(records)


def measure_contention(
    open_lock: Callable[[Any], LockHandle],
    config: Any,
    processes: int = 8,
    sections: int = 50,
) -> Contention:
    """Run ``processes`` spawned processes that each take the lock ``sections`` times.

    ``open_lock`` must be a module-level function: it runs in the spawned processes.
    The processes first contend for a few untimed sections (connecting, also for
    waiting, is not timed, for any library). Hand-off is the time from one holder's
    release to the next holder's acquire, counted only when the next holder was already
    waiting.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    counter = context.RawValue("q", 0)
    results = context.Queue()
    workers = [
        context.Process(
            target=_contender, args=(open_lock, config, sections, barrier, counter, results)
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    records = [record for _ in workers for record in results.get(timeout=600)]
    for worker in workers:
        worker.join()
        if worker.exitcode != 0:
            raise RuntimeError(f"a contending process exited with {worker.exitcode}")
    records.sort(key=lambda record: record[1])
    span = records[-1][2] - records[0][1]
    handoffs = [
        (after[1] - before[2]) * 1000 for before, after in pairwise(records) if after[0] < before[2]
    ]
    return Contention(
        sections_per_s=len(records) / span if span > 0 else float("inf"),
        median_handoff_ms=statistics.median(handoffs) if handoffs else 0.0,
        longest_wait_ms=max(acquired - waiting for waiting, acquired, _ in records) * 1000,
        counter=int(counter.value),
        expected=processes * sections,
    )


def measure_contention_rounds(
    setups: dict[str, tuple[Callable[[Any], LockHandle], Any]],
    rounds: int = 3,
    processes: int = 8,
    sections: int = 200,
) -> dict[str, list[Contention]]:
    """:func:`measure_contention` of every setup (``label: (open_lock, config)``), run in
    ``rounds`` interleaved rounds; each label's results in round order.

    A contention run lasts a fraction of a second, so one burst of other load on the
    machine can halve a row. Interleaving spreads such bursts over every setup alike,
    and results of one round are comparable with each other.
    """
    runs: dict[str, list[Contention]] = {label: [] for label in setups}
    for _ in range(rounds):
        for label, (open_lock, config) in setups.items():
            runs[label].append(measure_contention(open_lock, config, processes, sections))
    return runs


def combine_rounds(results: list[Contention]) -> Contention:
    """One row for several rounds: the median rate and hand-off, the longest wait of all
    rounds and the counters added up (exact only if every round was)."""
    return Contention(
        sections_per_s=statistics.median(c.sections_per_s for c in results),
        median_handoff_ms=statistics.median(c.median_handoff_ms for c in results),
        longest_wait_ms=max(c.longest_wait_ms for c in results),
        counter=sum(c.counter for c in results),
        expected=sum(c.expected for c in results),
    )


def contention_rows(
    runs: dict[str, list[Contention]], processes: int
) -> list[tuple[str, Latency | None, Contention | None]]:
    """One table row per setup of :func:`measure_contention_rounds`: its rounds combined."""
    return [
        (f"{label}, {processes} processes", None, combine_rounds(results))
        for label, results in runs.items()
    ]


def print_round_rates(runs: dict[str, list[Contention]], peers: Sequence[str]) -> None:
    """Each setup's rate in every round, then dlock's against each peer's: the ratio of
    their median rates, and the median of the per-round ratios (each round runs every
    setup back to back, so its ratio is less exposed to the machine's drifting load)."""
    for label, results in runs.items():
        rates = ", ".join(f"{c.sections_per_s:.0f}" for c in results)
        print(f"{label} sections/s per round: {rates}")
    ours = runs["dlock"]
    for peer in peers:
        ratio = combine_rounds(ours).sections_per_s / combine_rounds(runs[peer]).sections_per_s
        paired = sorted(
            d.sections_per_s / k.sections_per_s for d, k in zip(ours, runs[peer], strict=True)
        )
        print(
            f"dlock vs {peer} under contention: median rounds {ratio:.2f}x, "
            f"median of per-round ratios {paired[len(paired) // 2]:.2f}x"
        )


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def print_table(
    title: str,
    rows: list[tuple[str, Latency | None, Contention | None]],
    baseline: str,
) -> None:
    """Print one run's results with ratios against the row labelled ``baseline``."""
    base = {label: (lat, con) for label, lat, con in rows}[baseline]
    base_lat = base[0].median_us if base[0] else None
    base_con = base[1].sections_per_s if base[1] else None
    width = max(28, *(len(label) for label, _, _ in rows))
    header = (
        f"{'':{width}} {'median µs':>10} {'p99 µs':>9} {'vs base':>8} │ {'sect/s':>8} "
        f"{'vs base':>8} {'hand-off ms':>11} {'max wait ms':>11} {'counter':>11}"
    )
    print(f"\n{title}  (baseline: {baseline})")
    print(header)
    print("─" * len(header))
    for label, lat, con in rows:
        left = (
            f"{lat.median_us:10.1f} {lat.p99_us:9.1f} {_ratio(lat.median_us, base_lat):>8}"
            if lat
            else f"{'-':>10} {'-':>9} {'-':>8}"
        )
        right = (
            f"{con.sections_per_s:8.0f} {_ratio(con.sections_per_s, base_con):>8} "
            f"{con.median_handoff_ms:11.2f} {con.longest_wait_ms:11.1f} "
            f"{con.counter:>5}/{con.expected:<5}"
            if con
            else f"{'-':>8} {'-':>8} {'-':>11} {'-':>11} {'-':>11}"
        )
        print(f"{label:{width}} {left} │ {right}")
