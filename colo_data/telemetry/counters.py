"""Telemetry counters: what the input pipeline costs the trainer and where its time goes.

The trainer side records, per step, the time blocked in `next()` (the input wait) and the
time between calls (the step); the first `warmup` steps (compile, first chunk, sidecar
start) are kept apart from the steady state. The host side adds up each stage's seconds,
items and bytes per chunk (never per record) in `StageTimes`, and samples the workers' CPU
time at most twice a second in `CpuMeter`. `summarize` turns both into a `Telemetry`, with
a one-line verdict naming the bottleneck. Exporters live in `colo_data.telemetry.export`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Literal, TypeVar

import numpy as np
import psutil

from colo_data.runtime.prefetch import close_iterator

T = TypeVar("T")

STAGES = ("order", "read", "io_wait", "decode", "transform", "batch", "pool_wait", "transfer", "shm_write", "handoff")
_LABELS = (
    "order", "read", "read: waiting for I/O", "read: decode", "transform", "batch", "waiting for worker processes",
    "transfer from Ray actors", "shared-memory write", "hand-off",
)
STAGE_LABELS = dict(zip(STAGES, _LABELS, strict=True))
ORDER, READ, IO_WAIT, DECODE, TRANSFORM, BATCH, POOL_WAIT, TRANSFER, SHM_WRITE, HANDOFF = range(len(STAGES))
WORKER_STAGES = (ORDER, READ, TRANSFORM, BATCH)  # the stages that worker processes share out
# Parts of the read stage, not stages of their own: `io_wait` is time the read waited for
# row groups still being fetched (items: requests, bytes: bytes fetched from storage);
# `decode` is time decoding row groups, mostly on background threads (items: row groups).
READ_PARTS = (IO_WAIT, DECODE)
# Time the host waited for chunks of its worker processes (items: records they made): how
# many of the records the workers made, and how long the host stood idle for them. The
# workers' own stages are counted in the stages above. `transfer` is the part of that wait
# spent fetching the shares of Ray actors (`cd.RayWorkers`) from Ray's object store, once
# computed (items: their records, bytes: their bytes).
UNCOUNTED = (*READ_PARTS, POOL_WAIT, TRANSFER)  # shown, but not added up as stages of the critical path
HISTORY = 2**20  # steps kept for percentiles and plots (24 bytes each); totals count every step
CPU_EVERY_S = 0.5


class StageTimes:
    """Cumulative seconds, items and bytes of each stage in `STAGES`, as one flat list of
    floats (3 per stage): cheap to add to, to copy, to pickle and to send.

    Args:
        values: counters to start from (another `StageTimes.values`); None starts at zero.
    """

    __slots__ = ("values",)

    def __init__(self, values: Sequence[float] | None = None) -> None:
        self.values = [0.0] * (3 * len(STAGES)) if values is None else [float(v) for v in values]

    def add(self, stage: int, seconds: float, items: int, nbytes: int) -> None:
        """Count one pass through a stage.

        Args:
            stage: the stage's index in `STAGES` (`READ`, `TRANSFORM`, ...).
            seconds: the time it took.
            items: records it handled.
            nbytes: bytes it produced.
        """
        v, j = self.values, 3 * stage
        v[j] += seconds
        v[j + 1] += items
        v[j + 2] += nbytes

    def merge(self, values: Sequence[float]) -> None:
        """Add another set of counters (a worker's chunk, a finished sidecar session)."""
        v = self.values
        for j, x in enumerate(values):
            v[j] += float(x)


def cpu_of_children(seen: dict[int, float], skip: set[int]) -> float:
    """CPU seconds (user + system) of this process's descendants, the exited ones included.

    Args:
        seen: each pid's last reading, kept between calls (updated here).
        skip: pids of helpers that are not workers, e.g. multiprocessing's resource tracker
            (found and added here).
    """
    for child in psutil.Process().children(recursive=True):
        if child.pid in skip:
            continue
        try:
            if child.pid not in seen and "resource_tracker" in " ".join(child.cmdline()):
                skip.add(child.pid)
                continue
            times = child.cpu_times()
            seen[child.pid] = times.user + times.system
        except psutil.Error:
            continue
    return sum(seen.values())


class CpuMeter:
    """The workers' CPU seconds, sampled at most every `CPU_EVERY_S`. `sample` is `(seconds
    since the first sample, CPU seconds since then)`, replaced whole so that another thread
    reads a consistent pair.

    Args:
        kind: `thread` reads the calling thread's CPU time (the pipeline runs on the thread
            that samples); `children` sums this process's worker processes.
    """

    def __init__(self, kind: Literal["thread", "children"]) -> None:
        self.kind = kind
        self._next = 0.0
        self._seen: dict[int, float] = {}
        self._skip: set[int] = set()
        self._origin: tuple[float, float] | None = None
        self.sample: tuple[float, float] = (0.0, 0.0)

    def maybe_sample(self, now: float) -> None:
        """Take a sample if `CPU_EVERY_S` has passed since the last one (`now`: `perf_counter()`)."""
        if now >= self._next:
            self.take(now)

    def take(self, now: float | None = None) -> None:
        """Take a sample now (`now`: `perf_counter()`, read here when None)."""
        now = time.perf_counter() if now is None else now
        cpu = time.thread_time() if self.kind == "thread" else cpu_of_children(self._seen, self._skip)
        if self._origin is None:
            self._origin = (now, cpu)
        self.sample = (now - self._origin[0], cpu - self._origin[1])
        self._next = now + CPU_EVERY_S


class StepClock:
    """The trainer's per-step record: when each `next()` was called, how long it blocked,
    and how many records it delivered. The last `HISTORY` steps are kept (for percentiles
    and plots) in arrays that grow by doubling, the warm-up steps apart; the steady-state
    totals cover every step.

    Args:
        warmup: the first steps, kept apart from the steady state.
    """

    def __init__(self, warmup: int) -> None:
        self.created = time.perf_counter()
        self.warmup = warmup
        self.count = 0
        self._start = np.zeros(1024)
        self._wait = np.zeros(1024)
        self._records = np.zeros(1024)
        self.warm: list[tuple[float, float, int]] = []
        self.first: tuple[float, float] | None = None
        self.last_return: float | None = None
        self.steady_from: float | None = None
        self.steady_wait = 0.0
        self.steady_records = 0
        self.depth_sum = 0
        self.batch_bytes = 0

    def record(self, start: float, end: float, records: int, depth: int = 0) -> None:
        """Record one step.

        Args:
            start: when `next()` was called (`perf_counter()`).
            end: when it returned.
            records: records in the batch it returned.
            depth: the prefetch queue's fill when it was called.
        """
        n = self.count
        size = len(self._start)
        if n == size and size < HISTORY:
            self._start, self._wait, self._records = (np.resize(a, 2 * size) for a in (self._start, self._wait, self._records))
            size *= 2
        j = n % size
        wait = end - start
        self._start[j] = start
        self._wait[j] = wait
        self._records[j] = records
        self.count = n + 1
        self.last_return = end
        if n == 0:
            self.first = (start, wait)
        if n >= self.warmup:
            self.steady_wait += wait
            self.steady_records += records
            self.depth_sum += depth
            if n == 0:
                self.steady_from = start
        else:
            self.warm.append((start, wait, records))
            if n + 1 == self.warmup:
                self.steady_from = end

    def series(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(number of the first kept step, call times, waits, records) of the kept steps,
        in step order."""
        n, size = self.count, len(self._start)
        if n <= size:
            return 0, self._start[:n].copy(), self._wait[:n].copy(), self._records[:n].copy()
        cut = n % size
        start, wait, records = (np.roll(a, -cut) for a in (self._start, self._wait, self._records))
        return n - size, start, wait, records


def metered(items: Iterator[T], meter: CpuMeter) -> Iterator[T]:
    """`items` as they come, with `meter` sampled on the way (at most every `CPU_EVERY_S`)
    and once more at the end; closes `items` when done or closed."""
    meter.take()
    try:
        for item in items:
            meter.maybe_sample(time.perf_counter())
            yield item
    finally:
        meter.take()
        close_iterator(items)
