"""`PoolPolicy`: when a host pipeline hands chunk work to its worker pool, and to how many
workers. It decides from what the host observes (records delivered, the pool's idle CPUs,
its workers' readiness and count) and a clock it is given, so it is tested without timing;
`HostPipeline._pooled` does the sharing out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colo_data.host.chunk_work import ChunkPool

DECIDE_S = 0.5  # seconds of production measured before the pool is taken on or given up...
# ...and at least this many chunks of it: a rate over fewer is a count of whole chunks (a CPU-bound
# pipeline on one CPU made a 512-record chunk in 0.3 s, and one Ray actor was given up on 0.5 s windows)
DECIDE_CHUNKS = 4
# the first measurement, which decides whether a local pool's first worker is wanted, is this
# short (and one chunk): a worker forked from the pool's preloaded server is ready in milliseconds
# once asked, and its own trial decides whether it pays (measured from the second half second, a
# CPU-bound pipeline's first worker began 0.64 s after the loader was made; from this, 0.36 s)
_FIRST_S = 0.125
_IDLE_CPUS = 0.5  # CPUs of the budget that must go unused, while the host's thread produces, for the pool to start
_SLOWER = 0.9  # one worker that delivers less than this times the host thread's rate alone is given up...
_RETRY_S = 10.0  # ...and tried again after this long (doubling each time)
# one more worker is kept when the stream runs this much faster with it (5%), or, with many, when it
# adds half of what each producer (the host's thread and the workers) adds on average
_GAIN = 0.05


class PoolPolicy:
    """How many of `pool`'s workers a host's new chunk requests are shared out to (`level`; 0:
    the pool is not asked), never slower than the host's thread alone.

    The pool is wanted only while at least `_IDLE_CPUS` of the CPU budget go unused as the
    host's thread works (the workers start then, the first time; a remote pool is asked for
    at once), measured first over `_FIRST_S` and one chunk, then over each `DECIDE_S`, and
    used from the moment its first worker is ready, one worker at first (judged, the first
    time, against the host's rate alone from the first measurement until then). Each
    count of workers is on trial for `DECIDE_S` (and `DECIDE_CHUNKS`) from its first chunk:
    one more is started while the last made the stream faster by `_GAIN` and, for local
    workers, `_IDLE_CPUS` went unused over the trial (a worker started on a busy budget takes
    its CPU from the workers at work, at the same nice: beside the first, a second one's
    start held the light pipeline in process on 2 CPUs at about 0.8x of one worker's rate for
    seconds), and shares the chunks from the moment it is ready (asked for a share before, a
    starting worker held the stream up for the second of its start: 2 workers ran the light
    pipeline in process at half of one's rate); a count that does not pay goes back to the
    one before; a single worker that delivers less than `_SLOWER` times what the host's thread
    did alone is given up, and tried again after `_RETRY_S` (doubling, but for a remote
    pool). On 2 CPUs a light pipeline through a sidecar kept both busy without workers (two
    beside it ran at half its rate); in process one worker doubled it and a second added
    nothing; a CPU-bound one gained from both.

    `ready` below is the pool stream's `PoolStream.ready` (None while the stream is not
    open): asking it starts workers, so the policy asks it exactly when it needs the answer.

    Args:
        pool: the pool; the policy reads its `count`, `remote` and `idle_cpus()` (whose
            measurement window starts here, and again at each call).
        chunk_records: host records in one chunk (a measurement covers `DECIDE_CHUNKS`).
        clock: seconds, monotonic.
    """

    def __init__(self, pool: ChunkPool, chunk_records: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.level = 0  # the workers each new request is shared out to (0: the pool is not asked)
        self._pool, self._clock = pool, clock
        self._chunk, self._enough = chunk_records, DECIDE_CHUNKS * chunk_records  # host records a measurement needs
        self._measured = False  # the first measurement (`_FIRST_S`, one chunk) is made
        self._taken_on = False  # the pool has been taken on once
        self._wanted = pool.remote  # the pool is to be used from the moment its first worker is ready
        self._rates = [0.0]  # host records/s delivered with 0, 1, ... workers (with 0: while no worker starts)
        self._started = int(pool.remote)  # the workers asked for so far (they start when first asked)
        self._was_ready = False  # they were all ready at the last measurement
        pool.idle_cpus()  # the idle CPUs are measured from here
        self._window, self._made = clock(), 0  # this measurement's start and the host records delivered since
        self._trial: float | None = None  # while a count of workers is on trial: when its first chunk came (0.0: not yet)
        self._trial_from = 0  # the position of the first chunk asked of the count on trial
        self._settled = False  # the count of workers that pays is found
        self._growing = False  # one more worker is starting, to be tried once it is ready
        self._retry, self._retry_at = _RETRY_S, 0.0

    def wants_stream(self, ready: Callable[[int], bool] | None) -> bool:
        """Once a chunk while the pool is not in use: every `DECIDE_S` (and `DECIDE_CHUNKS`)
        measures the host's rate alone and the idle CPUs; True when the pool's stream is to be
        opened now (its first worker starts)."""
        now = self._clock()
        span, enough = (DECIDE_S, self._enough) if self._measured else (_FIRST_S, self._chunk)
        if now - self._window < span or self._made < enough:
            return False
        self._measured = True
        idle = self._pool.idle_cpus()
        # (while local workers start, they take CPU from the host's thread; a remote pool's do not)
        if ready is None or self._was_ready or self._pool.remote:
            self._rates[0] = self._made / (now - self._window)
        self._window, self._made = now, 0
        self._was_ready = ready is not None and ready(self._started)  # a dead worker raises here
        # once asked for, the pool is wanted until its first worker is ready (starting, it leaves no CPU unused)
        self._wanted = self._wanted or (now >= self._retry_at and idle is not None and idle >= _IDLE_CPUS)
        if self._wanted and ready is None:
            self._started = 1
            return True
        return False

    def adjust(self, frontier: int | None, ready: Callable[[int], bool] | None) -> bool:
        """Once a chunk (`frontier`: the first position not yet asked of the pool, None while it
        is not in use): takes the pool on, tries one more worker, gives one up, or follows a
        fall of `pool.count`. True when the pool is taken on now (its first worker is ready)."""
        now = self._clock()
        taken_on = False
        if self._wanted and ready is not None and ready(1):  # from here the first worker works beside the host's thread
            if not self._taken_on and self._made >= self._chunk:
                # the first time, the host's rate alone is the one since the first measurement (a
                # fork of the preloaded server takes its CPU from none): more chunks than that one
                self._rates[0] = self._made / (now - self._window)
            self.level, self._wanted, self._settled, taken_on = 1, False, False, True
            self._taken_on = True
            # its trial is timed from its first chunk: the pool holds none of the host's, so any it makes from now on
            self._trial, self._trial_from = 0.0, 0
            del self._rates[1:]
        elif self._growing and frontier is not None and ready is not None and ready(self.level + 1):  # asked from here
            self.level, self._trial, self._trial_from, self._growing = self.level + 1, 0.0, frontier, False
        elif self._trial and now - self._trial >= DECIDE_S and self._made >= self._enough:
            self._judge(now, ready)
        if self.level > self._pool.count:  # the pool's share of this host fell (a shared pool that more hosts joined)
            self.level, self._trial, self._growing, self._settled = self._pool.count, None, False, True
            del self._rates[self.level + 1 :]
        return taken_on

    def _judge(self, now: float, ready: Callable[[int], bool] | None) -> None:
        """The end of the trial of `level` workers: give the pool up, go back one, start one
        more (to be tried once it is ready), or settle."""
        assert self._trial is not None
        level, rates = self.level, self._rates
        rates.append(self._made / (now - self._trial))
        self._trial = None
        if level == 1 and rates[1] < _SLOWER * rates[0]:  # the pool costs more than it gives
            # (a remote pool's trial costs the host no CPU: it is tried again as often as at first)
            self.level, self._retry_at = 0, now + self._retry
            self._retry = self._retry if self._pool.remote else 2 * self._retry
        elif level > 1 and rates[level] < rates[level - 1] * (1 + min(_GAIN, 0.5 / level)):  # it did not pay
            self.level, self._settled = level - 1, True
        elif level < self._pool.count and not self._settled:
            # start one more, tried once it is ready, where CPU went unused in this trial (a local
            # worker started on a busy budget takes its CPU from the workers at work: see above; a
            # Ray pool's actors take none of the host's, and it says so: infinitely many unused)
            idle = self._pool.idle_cpus()
            if idle is None or idle < _IDLE_CPUS:
                self._settled = True
            else:
                assert ready is not None  # a count is on trial only once the stream is open
                self._growing, self._started = True, max(self._started, level + 1)
                ready(level + 1)

    def delivered(self, rows: int, at: int | None = None) -> None:
        """The host handed on a chunk of `rows` records; `at`: its position, if the pool made
        it. A trial is timed from the first chunk of its count, and so is the CPU it leaves
        unused (that chunk's records are not counted)."""
        if at is not None and self._trial == 0.0 and at >= self._trial_from:
            self._trial, self._made = self._clock(), 0
            self._pool.idle_cpus()
        else:
            self._made += rows

    def released(self) -> None:
        """The pool was given up and its last chunk taken: the host's rate alone is measured
        again from here."""
        self._window, self._made = self._clock(), 0
