"""`WorkerPolicy`: how many workers a host pipeline shares its chunks out to, computed from
a model of the work and of the trainer's demand, and revised as they move. It is pure: the
host's schedule (`pool_schedule.py`) tells it what chunks cost and where time went, and
reads the count back; the clock is given, so a simulation of big hosts tests it.

The model. A record costs a worker `t` seconds of work, `c` of them on a CPU (the rest it
waits: a fetch, a remote call), and the host's own thread `h` seconds to hand it on (take
the workers' shares, join them, pass them downstream). With k workers the host delivers at
most C(k) = min(k / t, cpus / (c + h), 1 / h, T) records a second, `cpus` being the budget
less what the trainer and everything else use (no bound for workers on a cluster, whose CPUs
are not the host's; before workers are taken, at most budget * (c + h) / (c + h + o), `o`
the CPU seconds that use takes a record handed on: as if it grew with the rate, as a waiting
trainer's does), and `T` what workers delivered before they were given up (below). The
host's thread alone delivers `A`, the best of its rates, and of what the trainer took while
it fed it (until measured, 1 / (t' + h), t' its own records' cost: a worker's may cost more).
The trainer takes `D` records a second, measured while it waits for input no more than
its target share of the time (`WorkerLimits.input_wait`, by default `defaults.INPUT_WAIT`);
once it has waited more for `STARVED_S`, it takes all it gets.

The count is the fewest workers that deliver min(D, C(most)) (at that rate k workers are
busy D * t of the time) and a margin of them to spare, none where the host's thread alone
delivers that, or where workers would add less than `GAIN` to it. The margin closes the loop
on the trainer's input wait, which the model cannot see coming (a request held by its
slowest share, every CPU slower for seconds): it starts at `MARGIN`, grows by `GROW` at each
decision at which the trainer waited more than its target for a demand the workers could
meet, and falls back over `FADE_S` while it did not. Accelerator time costs far more than
the CPUs spared. Where the best rate is the bound, more workers add nothing: half a worker.
Workers at work that deliver less than half the gain asked while the trainer waits (a cost
the model missed: CPUs they contend for), judged only once each has worked a share at that
count (not while they start, nor while older requests drain), are given up, and what they
delivered bounds the model's rate (as `T`) for `CEILING_S`.

Costs are running means (`FadingMeans`) that fade over seconds (noise is averaged) and start
afresh when two decisions in a row measure them far off (a 4x costlier record is followed
within two). Before any worker has worked, the host's own chunks tell `t` and `c` (the first,
warming up, left out) and its time besides them `h`. A decision comes every `DECIDE_S`, and
a decision comes between chunks: the host's thread's chunks hold about that much of its time,
a request about `SHARE_S` of each worker's. The count rises at once and falls only once a
lower one has been enough for `HOLD_S`, to one more than it needs: noise does not move it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from colo_data import defaults
from colo_data.host.fading_means import FadingMeans
from colo_data.host.worker_words import Terms, sentence

DECIDE_S, FIRST_S = 0.25, 0.1  # seconds between decisions; to the first, after the feed starts
FED = 0.002  # where its waits are not told: the host's thread waited for room this share of the time
STARVED_S = 0.75  # the trainer waits for more after this long of waiting (noise drains a buffer at times)
# workers beyond those the rate needs, a share of them: at first and at least; grown this much at each decision at which
# the trainer waited more than its target (stragglers and slower spells cost what the model does not see), up to 1.0,
# and back towards the least over `FADE_S` where it did not (accelerators cost far more than the CPUs spared)
MARGIN, GROW, FADE_S = 0.1, 2.0, 8.0
GAIN = 1.3  # workers are used where they would deliver this much more than the host's thread alone...
# ...or up to this much, less the longer the host's thread alone has been measured, until `ALONE_S` (a process
# runs slower in its first second: its caches, its allocator and the trainer's own start; the CPUs it leaves too)
EARLY_GAIN, ALONE_S = 2.0, 0.5
ALONE_WINDOWS = 8  # the host's thread alone, the workers at work: the best of this many decisions' rates
ALONE = 1.1  # the host's thread alone serves a demand it meets with this much to spare
HOLD_S = 1.0  # a lower count is taken once it has been enough for this long
WARM_S = 0.5  # the host's first chunks are left out until they are full, or for this long at most
FIRST_WAIT = 2.0  # before workers have worked, the host's own records count at most this many times their CPU
# time as work: in a trainer's process its thread also waits for the interpreter's lock, which is not the records'
CEILING_S = 30.0  # what workers given up delivered bounds the model's rate this long
SHARE_S = 0.05  # a worker's share of a request takes about this long: its messages cost under 1% of it
CHUNK_BYTES = 64 * 2**20  # a chunk's columns (the host's own, a request's, a colocated call's) take at most this much


@dataclass(frozen=True)
class WorkerLimits:
    """What bounds the count: the host's CPU budget, the most workers its pool may use
    (configured, "auto"'s bound, Ray actors, partitions), whether they are a cluster's; and
    the trainer's input wait it serves, a share of the time (`input_wait_target`)."""

    budget: float
    most: int
    remote: bool = False
    input_wait: float = defaults.INPUT_WAIT


class WorkerPolicy:
    """The count of workers (`count`) of one host pipeline, and why (`reason`), decided from
    what the host's schedule reports (`made`, `handed`, `cpus_used`) on a clock it is given
    (seconds, monotonic), within `limits`, for batches of `rows` host rows (chunk sizes are
    in batches). See the module's docstring for the model."""

    def __init__(self, limits: WorkerLimits, rows: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.rows, self._clock = limits, rows, clock
        self.count, self.reason = 0, "no workers yet: measuring what a record costs"
        self._workers = FadingMeans(2)  # a worker's record: seconds of work, of CPU
        self._here = FadingMeans(2)  # a record the host's thread made: seconds of work, of CPU
        self._handoff = FadingMeans(1)  # the host's thread's seconds handing on a record the workers made
        # records a second the host's thread alone, and the workers at work now, delivered to a trainer
        # that waited, in their last decisions (the best of them: the first seconds run slower)
        self._alone: deque[float] = deque(maxlen=ALONE_WINDOWS)
        self._pooled_rates: deque[float] = deque(maxlen=ALONE_WINDOWS)
        self._alone_s, self._restarts = 0.0, (0, 0)  # the host's thread alone measured for so long
        self._demand = FadingMeans(1)  # records a second the trainer takes, while known
        self._ceiling: tuple[float, float] | None = None  # what workers given up delivered, and when
        self._bytes = 0.0  # of a record's columns
        self._record_s = 0.0  # seconds the host's thread's last chunk took a record
        self._others: tuple[float, float] | None = None  # the trainer and the rest use: CPUs, seconds a record
        self._lower_since: float | None = None  # since when a lower count has been enough
        self._fed_at, self._decided = -math.inf, False  # when the trainer last waited less than its target; decided yet
        self._margin, self._rose_at = MARGIN, -math.inf  # workers beyond the need, a share of it; when the count last rose
        self._warm: float | None = None  # when the host's chunks came to their full size (see `_warming`)
        # requests asked of the workers and taken back; the first asked of every worker counted; when it was taken
        self._asks, self._takes, self._all_worked = 0, 0, math.inf
        self._all_asked: int | None = None
        self._host_batches = 0  # of the host's last chunk
        self._full_batches = defaults.CHUNK_RECORDS // rows or 1  # of a full one
        self._start = clock()
        self._new_window()

    def _new_window(self) -> None:
        self._made = [0.0] * 6  # since the last decision: workers' records, work, CPU; the host's own the same
        self._handed = self._pooled = 0  # records handed on; of them, made by the workers
        self._taken: int | None = None  # records the trainer took, where told
        self._waits = [0.0, 0.0]  # seconds the host's thread waited for the workers, for room downstream
        self._input_wait: float | None = None  # seconds the trainer waited for input, where told
        self._used: float | None = None

    def made(self, records: int, work_s: float, cpu_s: float, here: bool, nbytes: int = 0) -> None:
        """A chunk (or a worker's share) of `records` records cost `work_s` seconds of work (on a CPU or
        waiting, not for a CPU), `cpu_s` on a CPU; `here`: the host's thread made it; `nbytes`: its columns'."""
        if records and nbytes:  # the chunks' sizes need it from the first on
            self._bytes = nbytes / records
        if here and records and self._warm is not None:  # (the first chunk's imports are not its records')
            self._record_s = work_s / records
        if not here:  # a request of the workers taken back: once the first shared out to all of them is, they are judged
            self._takes += 1
            if self._all_asked is not None and self._takes >= self._all_asked:
                self._all_worked = min(self._all_worked, self._clock())
        if here and self._warming():
            return
        for i, amount in enumerate((records, work_s, cpu_s), start=3 if here else 0):
            self._made[i] += amount

    def handed(
        self, records: int, pooled: bool, pool_wait_s: float, room_wait_s: float, input_wait_s: float | None, taken: int | None
    ) -> None:
        """The host's thread handed `records` records on (`pooled`: the workers made them) after
        waiting `pool_wait_s` seconds for the workers and `room_wait_s` for room downstream; the
        trainer waited `input_wait_s` for input and took `taken` records meanwhile (None: not told,
        the records handed on tell). The first chunk is left out: the measurements start after it."""
        if self._warming(handed=True):  # from the next chunk on the host's thread runs at its pace
            self._start = self._clock()
            return
        self._handed, self._pooled = self._handed + records, self._pooled + (records if pooled else 0)
        self._waits = [self._waits[0] + pool_wait_s, self._waits[1] + room_wait_s]
        if input_wait_s is not None:
            self._input_wait = (self._input_wait or 0.0) + input_wait_s
        if taken is not None:
            self._taken = (self._taken or 0) + taken

    def cpus_used(self, cpus: float | None) -> None:
        """CPUs of the budget that everything (the trainer, the host's thread, the workers)
        used since the last decision; None where it is not measured."""
        self._used = cpus

    def due(self) -> bool:
        """Whether the next `decide` decides (`cpus_used` is worth measuring now)."""
        return self._clock() - self._start >= (DECIDE_S if self._decided else FIRST_S) and self._handed > 0

    def decide(self) -> int:
        """The count now: a new decision every `DECIDE_S` (the first after `FIRST_S`), else the last."""
        if not self.due():
            return self.count
        elapsed = (now := self._clock()) - self._start
        (w_records, w_work, w_cpu, h_records, h_work, h_cpu), (pool_wait, room_wait) = self._made, self._waits
        self._workers.add(w_records, [w_work, w_cpu], elapsed)
        self._here.add(h_records, [h_work, h_cpu], elapsed)
        if (self._workers.restarts, self._here.restarts) != self._restarts:  # a new cost: the host's rate alone too
            if self._workers.restarts != self._restarts[0]:  # and the host's own records' cost before it
                self._here = FadingMeans(2)
            self._restarts, self._alone_s = (self._workers.restarts, self._here.restarts), 0.0
            self._alone.clear()
            self._pooled_rates.clear()
        host_s = max(0.0, elapsed - pool_wait - room_wait - h_work)  # the host's thread's own time, handing on
        if not self._pooled or not h_records:  # (alone, its time besides making the chunks: a sidecar's writes)
            self._handoff.add(self._handed, [host_s], elapsed)
        if self._used is not None:  # the trainer and the rest: CPUs, and CPU seconds a record handed on
            others = max(0.0, self._used - (w_cpu + h_cpu + host_s) / elapsed)
            seen, per = self._others, others * elapsed / self._handed
            self._others = (others, per) if seen is None else (0.5 * (seen[0] + others), 0.5 * (seen[1] + per))
        told = self._input_wait
        fed = room_wait > FED * elapsed if told is None else told <= self.limits.input_wait * elapsed
        # the closed loop: the margin the workers at work leave grows while the trainer waits on a demand they could
        # meet (once the last rise has had time to tell), and falls back slowly while it does not
        if self.count and self._pooled == self._handed:
            grow = not fed and now - self._rose_at >= HOLD_S / 2 and self._demand.per() is not None
            least = MARGIN + (self._margin - MARGIN) * max(0.0, 1.0 - elapsed / FADE_S)
            self._margin = min(1.0, self._margin * GROW) if grow else least
        taken = self._handed if self._taken is None else self._taken
        if not self._pooled:  # the host's thread alone: as fast as it goes, or (the trainer fed) what it took
            self._alone.append(max(self._handed, taken if fed else 0) / elapsed)
            self._alone_s += elapsed
        if fed:  # what the trainer takes is known: what it took
            self._demand.add(elapsed, [taken], elapsed)
            self._fed_at = now
        else:
            if now - self._fed_at >= STARVED_S:  # the trainer waits: what it took before no longer tells
                self._demand = FadingMeans(1)
            if self._pooled == self._handed and self._start >= self._all_worked:  # the workers at work, as fast as they
                self._pooled_rates.append(self._handed / elapsed)  # go, once each has worked a share at this count
        model = self._model()
        if model is not None:
            (low, high), before = model.counts(self.limits.most), self.count
            if low > self.count:
                self.count, self._lower_since, self._rose_at = low, None, now
            elif high < self.count:
                self._lower_since = now if self._lower_since is None else self._lower_since
                if now - self._lower_since >= HOLD_S:
                    self.count, self._lower_since = high, None
                    if not high and model.pooled is not None:  # what workers delivered bounds the model
                        self._ceiling = (model.pooled, now)
            else:
                self._lower_since = None
            if self.count != before:
                self._pooled_rates.clear()
                self._all_asked, self._all_worked = None, math.inf
            self.reason = model.explain(self.count, self.limits)
        self._decided, self._start = True, now
        self._new_window()
        return self.count

    def _model(self) -> _Model | None:
        """The model's terms as measured (None before anything is)."""
        here, c_here = self._here.per(0), self._here.per(1)
        here = min(here, FIRST_WAIT * c_here) if here is not None and c_here else here
        t, c = (self._workers.per(0), self._workers.per(1)) if self._workers.units else (here, c_here)
        if not t or c is None:  # (before a worker has worked, the host's own records tell)
            return None
        alone, pooled, h = max(self._alone, default=None), max(self._pooled_rates, default=None), self._handoff.per() or 0.0
        others, per = self._others or (0.0, 0.0)
        cpus = math.inf if self.limits.remote else max(0.0, self.limits.budget - others)
        if not self.count and per and not self.limits.remote:  # (as if the others' use grew with the rate)
            cpus = min(cpus, self.limits.budget * (c + h) / (c + h + per))
        ceiling = self._ceiling[0] if self._ceiling and self._clock() - self._ceiling[1] < CEILING_S else math.inf
        gain = GAIN + (EARLY_GAIN - GAIN) * (0.0 if self.count else max(0.0, 1.0 - self._alone_s / ALONE_S))
        demand = self._demand.per() or math.inf
        return _Model(t, c, h, cpus, demand, alone, ceiling, gain, here or t, pooled, self._margin)

    def _warming(self, handed: bool = False) -> bool:
        """Whether the host's chunks still warm up (left out of the measurements): the first pays
        for imports and first reads, the next, smaller than a full one, for a call each (on a light
        pipeline, several times their records' cost), until `WARM_S` after the first was `handed`."""
        now = self._clock()
        if self._warm is None:  # the first chunk
            if handed:
                self._warm = now + WARM_S
            return True
        if now < self._warm and self._host_batches < self._full_batches:
            return True
        self._warm = min(self._warm, now)
        return False

    def host_batches(self) -> int:
        """Batches of the next chunk the host's thread makes: 1, then twice the last up to
        `CHUNK_RECORDS` records and `CHUNK_BYTES`, and to about `DECIDE_S` of the thread's
        time (a decision comes between chunks: a costly record's chunk must not hold it)."""
        batches = min(2 * self._host_batches or 1, self._full_batches)
        if self._record_s:
            batches = min(batches, max(1, math.ceil(DECIDE_S / self._record_s / self.rows)))
        self._host_batches = bounded(batches, self._bytes, self.rows)
        return self._host_batches

    def request_batches(self, workers: int, last: int) -> int:
        """Batches of a request to `workers` workers, `last` those of the last (at first, the
        host's last chunk's): a share of about `SHARE_S` of a worker's time (a share's cost
        holds a call's: smaller ones cost more a record), at most twice the last, and at most
        `CHUNK_BYTES`. Fewer workers get less at once: a request shared out to the first
        ready of many holds them no longer than a share's time, so the next one reaches the rest."""
        self._asks += 1
        if self._all_asked is None and workers >= self.count:
            self._all_asked = self._asks
        t = self._workers.per() or self._here.per()
        batches = min(2 * last, math.ceil(workers * SHARE_S / t / self.rows)) if t else last
        return bounded(batches, self._bytes, self.rows)


def bounded(batches: int, record_bytes: float, rows: int) -> int:
    """`batches` of `rows` records, or fewer where their columns would pass `CHUNK_BYTES`
    (a record taking `record_bytes`; 0: not known yet), at least one: memory follows the
    bytes of the batches, not the records of a chunk (chunks of 512 records of 4 MiB took
    3.7 GiB at peak, where 2 records a batch need 8 MiB)."""
    if not record_bytes:
        return max(1, batches)
    return max(1, min(batches, math.ceil(CHUNK_BYTES / record_bytes / rows)))


@dataclass(frozen=True)
class _Model:
    """The model's terms as the module's docstring names them (t, c, h, cpus, D, A where
    measured, T, the gain asked for, t'; and what the workers at work delivered while the
    trainer waited, where measured) and what follows from them."""

    t: float
    c: float
    h: float
    cpus: float
    demand: float
    alone: float | None
    ceiling: float
    gain: float
    here: float
    pooled: float | None
    margin: float

    def rate(self, workers: float) -> float:
        """Records a second with `workers` workers (0: the host's thread alone)."""
        t, c, h = self.t, self.c, self.h
        cpu = self.cpus / (c + h) if c + h else math.inf
        if not workers:
            return min(1 / (self.here + h), cpu) if self.alone is None else self.alone
        return min(workers / t, cpu, 1 / h if h else math.inf, self.ceiling)

    def counts(self, most: int) -> tuple[int, int]:
        """The count to rise to: the fewest workers that deliver the goal, and `margin` of
        them to spare, none where the host's thread alone does or workers would not add
        `gain`; and to fall to: one more, none where the host's thread alone does with
        `ALONE` to spare or workers add (or added) less than half of `gain`."""
        alone, best = self.rate(0), self.rate(most)
        goal = min(self.demand, best)
        need = goal * self.t  # workers busy at that rate
        spare = need * self.margin if self.demand < best else min(0.5, need * MARGIN)  # (beyond the best rate's
        low = min(most, max(1, math.ceil(need + spare)))  # bound, more would not add: half a worker)
        high = min(most, low + 1)
        if alone >= goal or best < self.gain * alone:
            low = 0
        if alone >= ALONE * goal or min(best, self.pooled or best) < (1 + self.gain) / 2 * alone:
            high = 0
        return low, min(high, low + 1)

    def explain(self, count: int, limits: WorkerLimits) -> str:
        """Why `count` workers, in one sentence (`worker_words`)."""
        terms = (self.t, self.c, self.h, self.cpus, self.demand, self.rate(0), self.rate(limits.most), self.ceiling)
        return sentence(count, Terms(*terms, limits.budget, limits.most))
