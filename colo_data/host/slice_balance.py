"""`SliceBalance`: how many of a host's partitions its own thread computes beside its
workers (`slices.cut`), found by trial. The host's thread also joins the batches and hands
them on (to the trainer in process, to shared memory in a sidecar), so the share that keeps
it and the workers equally busy depends on the backend and the pipeline; a fixed share
suited one backend only. It decides from the batches handed on, the host's waits for the
workers and a clock it is given, so it is tested without timing; `HostPipeline._sliced`
cuts the slices again when it says."""

from __future__ import annotations

import time
from collections.abc import Callable

from colo_data.host.pool_policy import DECIDE_CHUNKS, DECIDE_S

START_SHARE = 0.5  # the host's thread starts at this much of a worker's share of the partitions
_WAITING = 0.05  # the host's thread waits for the workers more than this part of the time: it can take more
_GAIN = 0.03  # a step is kept when the batches come this much faster with it


def first_share(count: int, workers: int) -> int:
    """The partitions the host's thread computes first, of `count` shared with `workers`
    workers: `START_SHARE` of a worker's share, at least one, leaving one a worker."""
    return min(max(1, count - workers), max(1, round(START_SHARE * count / (workers + START_SHARE))))


class SliceBalance:
    """The host's thread's partitions (`here`), of `count` shared with `workers` workers.

    It measures the batches' rate over `DECIDE_S` (and `DECIDE_CHUNKS` chunks), then tries
    one partition more for the host's thread where it waited for the workers more than
    `_WAITING` of the time, else one fewer; a step is kept while it makes the batches come
    `_GAIN` faster, and the next one in the same direction is tried; the first that does not
    pay goes back to the one before, and there it settles.

    Args:
        count: the host's partitions.
        workers: the workers beside its thread.
        clock: seconds, monotonic.
    """

    def __init__(self, count: int, workers: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.here = first_share(count, workers)
        self._low, self._high = 1, max(1, count - workers)
        self._clock = clock
        self._start, self._batches, self._chunks, self._waited = clock(), 0, 0, 0.0
        self._fresh = False  # the slices were just cut again: the next chunk is not measured
        self._best: tuple[int, float] | None = None  # the share kept so far and its rate
        self._step = 0  # +1: more for the host's thread, -1: fewer (0: not chosen yet)
        self.settled = self._low == self._high

    def restart(self) -> None:
        """The slices were cut again: the measurement of the new share starts after the next
        chunk (the first after a cut holds the workers' and the host's new start)."""
        self._fresh = True

    def record(self, batches: int, waited: float) -> int | None:
        """A chunk of `batches` batches was handed on, after waiting `waited` seconds for the
        workers' part of it. Returns the share to cut the slices to now, or None."""
        if self._fresh:
            self._fresh = False
            self._start, self._batches, self._chunks, self._waited = self._clock(), 0, 0, 0.0
            return None
        self._batches, self._chunks, self._waited = self._batches + batches, self._chunks + 1, self._waited + waited
        elapsed = self._clock() - self._start
        if self.settled or elapsed < DECIDE_S or self._chunks < DECIDE_CHUNKS:
            return None
        rate, waiting = self._batches / elapsed, self._waited / elapsed
        if self._best is None:  # the first share's rate: the direction follows the waits
            self._best, self._step = (self.here, rate), 1 if waiting > _WAITING else -1
        elif rate > self._best[1] * (1 + _GAIN):  # the step paid: keep it, try the next
            self._best = (self.here, rate)
        else:  # it did not: back to the one before, and settle there
            self.settled = True
            return self._cut(self._best[0])
        following = self.here + self._step
        if not self._low <= following <= self._high:
            self.settled = True
            return None
        return self._cut(following)

    def _cut(self, here: int) -> int | None:
        changed = here != self.here
        self.here = here
        self.restart()
        return here if changed else None
