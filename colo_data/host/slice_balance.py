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
_SETTLED_S = 4 * DECIDE_S  # once settled, the host's waits are measured over this long


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
    pay goes back to the one before, and there it settles. Where the host's thread waited
    for the workers longer than one of its partitions takes (its busy time over its
    partitions), one more partition for it shortens every chunk whatever the rates say, so
    that step is taken and kept without them: rates measured half a second apart on a
    machine whose CPUs change speed by 1.6x in plateaus sent a filtered pipeline back to a
    share at which its host waited for its worker a third of the time (2 workers in process
    ran at 1.2x to 1.8x of none from run to run). Once settled, the waits are still
    measured, over `_SETTLED_S`, and such a step still taken: measured at the start (the
    workers just started), they had called for none where the host then waited a quarter
    of the time.

    Args:
        count: the host's partitions.
        workers: the workers beside its thread.
        clock: seconds, monotonic.
    """

    _start: float  # the measurement's start (`_measure_from_now`), and since then:
    _batches: int  # the batches handed on,
    _chunks: int  # the chunks,
    _waited: float  # and the seconds waited for the workers

    def __init__(self, count: int, workers: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.here = first_share(count, workers)
        self._low, self._high = 1, max(1, count - workers)
        self._clock = clock
        self._measure_from_now()
        self._fresh = False  # the slices were just cut again: the next chunk is not measured
        self._best: tuple[int, float] | None = None  # the share kept so far and its rate
        self._step = 0  # +1: more for the host's thread, -1: fewer (0: not chosen yet)
        self._waited_for = False  # the host's waits called for the step to this share
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
            self._measure_from_now()
            return None
        self._batches, self._chunks, self._waited = self._batches + batches, self._chunks + 1, self._waited + waited
        elapsed = self._clock() - self._start
        if elapsed < (_SETTLED_S if self.settled else DECIDE_S) or self._chunks < DECIDE_CHUNKS:
            return None
        rate, waiting = self._batches / elapsed, self._waited / elapsed
        # the host's thread waited longer than one of its partitions takes: one more for it pays
        short = waiting > _WAITING and waiting > (1 - waiting) / self.here
        if self.settled:  # settled on too few for the host's thread, it goes on waiting: one more
            self._measure_from_now()
            return self._cut(self.here + 1) if short and self.here < self._high else None
        if self._best is None:  # the first share's rate: the direction follows the waits
            self._step = 1 if waiting > _WAITING else -1
        elif not (short and self._step > 0) and rate <= self._best[1] * (1 + _GAIN):  # the step did not pay
            self.settled = True
            # a step the waits called for beats the share before it: settle on it
            return None if self._waited_for else self._cut(self._best[0])
        self._best, self._waited_for = (self.here, rate), short and self._step > 0  # keep this step, try the next
        following = self.here + self._step
        if not self._low <= following <= self._high:
            self.settled = True
            return None
        return self._cut(following)

    def _measure_from_now(self) -> None:
        """Start a measurement: its start, and the batches, chunks and waits since."""
        self._start, self._batches, self._chunks, self._waited = self._clock(), 0, 0, 0.0

    def _cut(self, here: int) -> int | None:
        changed = here != self.here
        self.here = here
        self.restart()
        return here if changed else None
