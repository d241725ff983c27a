"""A harsher world than `worker_sim.py`'s for a host's worker policy: the host's schedule
(`colo_data/host/pool_schedule.py`'s `PooledChunks`) replayed on a fake clock, event by
event, driving any object with `WorkerPolicy`'s interface through `made`, `handed`,
`cpus_used`, `due`/`decide`, `host_batches` and `request_batches` as that schedule does.
Issue 78: the policy passes its own simulation, whose world is its model's (smooth
per-step rates, decisions every step); the next policy must be judged where the model's
assumptions do not hold, and so must today's.

The world.
- A record costs `cpu` seconds on a CPU at speed 1 and `wait` seconds off it; the host's
  thread spends `handoff` seconds of CPU a record to hand any chunk on (join, pass).
- Every CPU's speed moves together, in plateaus of 2 to 8 s, a factor exp(σ z)
  (`Plateaus`); a record's CPU part takes `cpu / speed`, and so do the CPU seconds told.
- The host's thread makes a chunk of n records whole: n records of cost x take n x seconds
  and nothing is decided before it ends (sizes from `host_batches()`). Each chunk and each
  share costs its mean times a lognormal draw of σ `noise` (15%: a straggler tail).
- The pool's feed opens at time 0 and starts its fork server, ready `SERVER_S` later;
  workers asked for are forked one by one, `FORK_S` each, and set the feed up in `WARM_S`.
- A request (sizes from `request_batches()`) is cut into equal runs (shares) that go, in
  order, to whichever of the workers ready at ask time is free first (`ProcessFeed`'s
  queue); `AHEAD` requests in the pool's hands; a request is done when its slowest share
  is. A share costs `share_s` on top (its messages).
- Workers (nice 10) share the CPUs the trainer and the rest (`others`) and the host's thread
  leave; past them every busy worker slows alike, and each CPU's worth asked for beyond them
  costs `CROWDING` of their throughput. The work told excludes the wait for a CPU, as
  thread times do.
- Downstream, as in process: a queue of one chunk (the `Prefetcher`), and the chunk the
  trainer side takes its batches from. The trainer takes a batch of `rows` records a step
  and computes `rows / demand` seconds (unbounded: none); it waits when it has no batch.
  Its waits and takes are told to the policy, as `Downstream` tells them.

`simulate` runs one policy (or fixed count) and one trainer; `run` runs a policy on one
`Case` and seed with a trainer that takes half of the best fixed count's rate and with one
that takes all it gets, and measures them against that count (all its workers started
from time 0, same world and seed): the figures of issue 78, which `targets` checks.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, Protocol

import numpy as np

from colo_data.host.pool_schedule import AHEAD
from colo_data.host.worker_policy import CHUNK_BYTES, SHARE_S, WorkerLimits, WorkerPolicy
from colo_data.runtime.budget import CpuBudget
from colo_data.workers.settings import auto_most

SERVER_S, FORK_S, WARM_S = 0.3, 0.005, 0.15  # the fork server's start; a fork; a worker's set-up of the feed
CROWDING = 0.05  # of the workers' throughput lost per CPU's worth asked for beyond the CPUs left, per CPU left
PLATEAU_S = (2.0, 8.0)  # a plateau of the CPUs' speed lasts a uniform draw between these
SECONDS = 40.0  # a run (the issue saw a pool given up from 6 s to 37 s)
RATE_WINDOW_S = 0.5  # the delivered rate's sliding window, for the time to 0.9 of the best
SETTLE_S = 5.0  # "after the first few seconds": the input wait, and the windows, from here
WINDOW_S = 5.0  # the windows held to 0.85 of the best
GRID_S = 0.05  # windows slide by this much
RECORDS = {  # the record kinds: (seconds on a CPU, seconds off it)
    "cpu 0.1 ms": (1e-4, 0.0),
    "cpu 1 ms": (1e-3, 0.0),
    "cpu 10 ms": (1e-2, 0.0),
    "wait 2 ms": (5e-5, 2e-3),
}


class Policy(Protocol):
    """What the schedule asks of a worker policy (`WorkerPolicy`'s interface)."""

    count: int

    def made(self, records: int, work_s: float, cpu_s: float, here: bool, nbytes: int = 0) -> None: ...
    def handed(
        self, records: int, pooled: bool, pool_wait_s: float, room_wait_s: float, input_wait_s: float | None, taken: int | None
    ) -> None: ...
    def cpus_used(self, cpus: float | None) -> None: ...
    def due(self) -> bool: ...
    def decide(self) -> int: ...
    def host_batches(self) -> int: ...
    def request_batches(self, workers: int, last: int) -> int: ...


PolicyFactory = Callable[[WorkerLimits, int, Callable[[], float]], Policy]  # (limits, rows, clock) -> policy


def most(budget: float) -> int:
    """The bound of "auto" for `budget` CPUs, on a host with memory to spare."""
    return auto_most(CpuBudget(budget, 0, "simulated", int(budget), None), memory=2**40)


@dataclass(frozen=True)
class Host:
    """One simulated host (see the module's docstring): its CPU budget, a record's costs,
    the σ of the CPUs' speed plateaus, and the rest of the world."""

    budget: float
    cpu: float = 1e-3
    wait: float = 0.0
    plateau: float = 0.0
    handoff: float = 4e-6  # a record of 2,048 tokens (8 KiB) joined and passed on: about 2 µs of copy and as much besides
    others: float = 0.5  # CPUs the trainer and the rest use
    noise: float = 0.15
    share_s: float = 1e-4
    record_bytes: int = 8192
    rows: int = 32  # a host batch, and the trainer's step

    @classmethod
    def of(cls, kind: str, budget: float, plateau: float = 0.0) -> Host:
        """A host whose records are of `kind` (`RECORDS`)."""
        cpu, wait = RECORDS[kind]
        return cls(budget, cpu, wait, plateau)

    @property
    def most(self) -> int:
        return most(self.budget)

    @property
    def mean_cost(self) -> float:
        """A record's mean seconds of a worker at speed 1 (the noise's mean included)."""
        return (self.cpu + self.wait) * math.exp(self.noise**2 / 2)

    def rate(self, workers: int) -> float:
        """Records a second that `workers` deliver at mean speed: each `1 / mean_cost`, the CPUs
        left by the others bounding workers and the host's thread together, and the host's
        thread's hand-off (the model's own terms, `WorkerPolicy`'s C(k))."""
        cpus = max(0.0, self.budget - self.others) / (self.cpu + self.handoff)
        return min(workers / self.mean_cost, cpus, 1 / self.handoff)

    def need(self, demand: float) -> int:
        """The fewest workers whose mean rate meets `demand` (`most` where none does)."""
        return next((k for k in range(1, self.most + 1) if self.rate(k) >= demand), self.most)

    def best_count(self) -> int:
        """The fewest workers that reach the model's best rate."""
        return self.need(0.999 * self.rate(self.most))


@dataclass(frozen=True)
class Case:
    """A host and how long each run lasts."""

    host: Host
    seconds: float = SECONDS

    @property
    def label(self) -> str:
        h = self.host
        kind = next((k for k, v in RECORDS.items() if v == (h.cpu, h.wait)), f"cpu {h.cpu:g} s, wait {h.wait:g} s")
        return f"{kind}, {h.budget:g} CPUs, plateaus {h.plateau:.0%}"


class Plateaus:
    """The CPUs' speed: a factor exp(σ z) for plateaus of `PLATEAU_S` seconds, drawn from the
    seed alone (every run of a seed, fixed or not, sees the same)."""

    def __init__(self, sigma: float, seconds: float, seed: int) -> None:
        rng = np.random.default_rng([seed, 7])
        starts = [0.0]
        while starts[-1] <= seconds + 60.0:  # (a run's last chunk may end past its end)
            starts.append(starts[-1] + rng.uniform(*PLATEAU_S))
        self.starts = starts
        self.speeds = np.clip(np.exp(sigma * rng.standard_normal(len(starts))), 0.4, 2.5).tolist()

    def at(self, t: float) -> tuple[float, float]:
        """The speed at `t` and when it next changes."""
        i = bisect.bisect_right(self.starts, t) - 1
        return self.speeds[i], self.starts[i + 1] if i + 1 < len(self.starts) else math.inf

    def work(self, t: float, units: float, wait: float, cpu: float) -> tuple[float, float]:
        """When a thread that starts at `t` ends `units` of (`wait` off a CPU + `cpu` on one at
        the speed), with a CPU to itself; and its CPU seconds."""
        cpu_s = 0.0
        while True:
            speed, change = self.at(t)
            per = wait + cpu / speed
            can = (change - t) / per
            if units <= can:
                return t + units * per, cpu_s + units * cpu / speed
            t, units, cpu_s = change, units - can, cpu_s + can * cpu / speed


class Request(NamedTuple):
    """A request in the pool's hands: its position and batches, the progress (see `Pool`) at
    which its slowest share is done, and its work in mean records (noise and messages in)."""

    position: int
    batches: int
    done: float
    units: float


class Pool:
    """The workers. Every busy worker progresses alike (same records, same CPUs), so
    progress is one clock `v`, in mean records a worker: a share of n records whose draw
    is e takes n e + its messages of it, from where the worker's last share ends (or `v`
    now); how fast `v` runs depends on the CPUs' speed and how many workers are busy,
    which is known from the shares asked for."""

    def __init__(self, host: Host, plateaus: Plateaus, rng: np.random.Generator, ready: int) -> None:
        self.host, self.plateaus, self.rng = host, plateaus, rng
        self.ready_at = np.full(host.most, math.inf)
        self.ready_at[:ready] = 0.0  # a fixed count: all started from time 0
        self.started, self.forked = ready, 0.0
        self.server = 0.0 if ready else SERVER_S  # the feed opens at 0, and with it the fork server
        self.free = np.zeros(host.most)  # each worker's progress when its last share asked ends
        self.starts, self.ends = np.empty(0), np.empty(0)  # the shares not done
        self.t = self.v = 0.0
        self.cpu_s = 0.0  # CPU seconds of the workers and the host's thread since the last reading
        self.read_at: float | None = None

    def ready(self, workers: int, t: float) -> int:
        """How many of the first `workers` are ready at `t`, those not started starting now."""
        if workers > self.started:
            first = max(self.forked, self.server, t)
            forks = first + FORK_S * np.arange(1, workers - self.started + 1)
            self.ready_at[self.started : workers] = forks + WARM_S
            self.started, self.forked = workers, float(forks[-1])
        return int((self.ready_at[:workers] <= t).sum())

    def ask(self, position: int, batches: int, workers: int) -> Request:
        """A request of `batches` at `position` cut into `workers` equal runs as
        `ChunkWork._share_rows` cuts them, each share going, in order, to whichever of the
        first `workers` (ready) is free first (`ProcessFeed`'s queue: a slow worker takes
        fewer)."""
        records = batches * self.host.rows
        sizes = np.diff(np.arange(workers + 1) * records // workers)  # share s's run: [s n // k, (s + 1) n // k)
        units = sizes * self.rng.lognormal(0.0, self.host.noise, workers) + self.host.share_s / (self.host.cpu + self.host.wait)
        begin, end = np.empty(workers), np.empty(workers)
        for share, cost in enumerate(units):
            w = int(np.argmin(self.free[:workers]))
            begin[share] = max(self.free[w], self.v)
            end[share] = self.free[w] = begin[share] + cost
        live = self.ends > self.v
        self.starts, self.ends = np.concatenate([self.starts[live], begin]), np.concatenate([self.ends[live], end])
        return Request(position, batches, float(end.max()), float(units.sum()))

    def cpus_used(self) -> float | None:
        """CPUs of the budget used since the last reading (None at the first)."""
        last, self.read_at = self.read_at, self.t
        used, self.cpu_s = self.cpu_s, 0.0
        return None if last is None or self.t <= last else self.host.others + used / (self.t - last)

    def until(self, t: float, host_cpu: Callable[[float], float]) -> None:
        """Go on to time `t`, the host's thread using `host_cpu(speed)` of a CPU meanwhile."""
        self._go(t, math.inf, host_cpu)

    def done_at(self, progress: float) -> float:
        """When `progress` is reached (the host's thread waiting meanwhile)."""
        self._go(math.inf, progress, lambda speed: 0.0)
        return self.t

    def _go(self, t_stop: float, v_stop: float, host_cpu: Callable[[float], float]) -> None:
        h = self.host
        while self.t < t_stop - 1e-12 and self.v < v_stop - 1e-12:
            speed, change = self.plateaus.at(self.t)
            t_end = min(t_stop, change)
            cpu, mine = h.cpu / speed, host_cpu(speed)
            full = 1.0 / (h.wait + cpu)  # a busy worker's mean records a second with a CPU when it wants one
            left = max(1e-3, h.budget - h.others - mine)
            if (self.free > self.v).sum() * cpu * full <= left:  # no CPU to contend for: every busy worker at `full`
                dv = min((t_end - self.t) * full, v_stop - self.v)
                self._spend(dv / full, [self.v, self.v + dv], cpu, mine)
                continue
            live = self.ends > self.v  # else busy workers as they are, segment by segment of progress
            points = np.concatenate([np.maximum(self.starts[live], self.v), self.ends[live]])
            order = np.argsort(points, kind="stable")
            steps = np.concatenate([np.ones(live.sum()), -np.ones(live.sum())])[order]
            xs = np.concatenate([[self.v], points[order], [self.v + 1e300]])
            busy = np.concatenate([[0.0], np.cumsum(steps)])  # over each span of `xs`
            want = busy * cpu * full
            crowded = left / (1 + CROWDING * np.maximum(0.0, want - left) / left)
            rate = np.where(want <= left, full, np.minimum(full, crowded / np.maximum(busy, 1) / cpu))
            dx = np.diff(xs)
            elapsed, progress = np.cumsum(dx / rate), np.cumsum(dx)
            room, stop = t_end - self.t, v_stop - self.v
            j = min(int(np.searchsorted(np.maximum(elapsed / room, progress / stop), 1.0)), len(dx) - 1)
            base_t, base_v = (float(elapsed[j - 1]), float(progress[j - 1])) if j else (0.0, 0.0)
            part = min((room - base_t) * rate[j], stop - base_v, dx[j])
            spent = base_t + part / rate[j]
            self.cpu_s += cpu * (float((busy[:j] * dx[:j]).sum()) + busy[j] * part) + mine * spent
            self.t, self.v = self.t + spent, self.v + base_v + part

    def _spend(self, seconds: float, span: list[float], cpu: float, mine: float) -> None:
        """`seconds` pass with no contention while progress runs over `span`."""
        a, b = span
        self.cpu_s += cpu * float((np.clip(self.ends, a, b) - np.clip(self.starts, a, b)).sum()) + mine * seconds
        self.t, self.v = self.t + seconds, b


class Fixed:
    """A fixed count (the reference runs): every request of the schedule's sizes, with a
    record's true cost."""

    def __init__(self, count: int, host: Host) -> None:
        self.count, self.reason, self._host = count, f"{count} workers, fixed", host

    def made(self, records: int, work_s: float, cpu_s: float, here: bool, nbytes: int = 0) -> None: ...
    def handed(self, *told: object) -> None: ...
    def cpus_used(self, cpus: float | None) -> None: ...
    def due(self) -> bool:
        return False

    def decide(self) -> int:
        return self.count

    def host_batches(self) -> int:
        return 1

    def request_batches(self, workers: int, last: int) -> int:
        """`WorkerPolicy`'s rule, on the true cost."""
        h = self._host
        batches = max(last, min(2 * last, math.ceil(workers * SHARE_S / h.mean_cost / h.rows)))
        return max(1, min(batches, math.ceil(CHUNK_BYTES / h.record_bytes / h.rows)))


class Trainer:
    """The trainer's side: a queue of one chunk, and the chunk it takes batches from, a step
    of `rows` records each `step_s` seconds; what it waited and took, told as it happens."""

    def __init__(self, rows: int, step_s: float) -> None:
        self.rows, self.step_s = rows, step_s
        self.needs_at = 0.0  # when it asks for its next chunk (it waits from then)
        self.queued: tuple[int, float] | None = None  # records, when put
        self.takes: list[tuple[float, int, float]] = []  # when it took a chunk, its records, the wait before it
        self.waited, self.taken = 0.0, 0  # told so far

    def settle(self, t: float) -> None:
        """Take the queued chunk where the trainer asked for it by `t`."""
        if self.queued is not None and max(self.needs_at, self.queued[1]) <= t:
            records, put = self.queued
            took = max(self.needs_at, put)
            self.takes.append((took, records, took - self.needs_at))
            self.waited, self.taken = self.waited + took - self.needs_at, self.taken + records
            self.needs_at, self.queued = took + records / self.rows * self.step_s, None

    def put(self, records: int, t: float) -> float:
        """The host's thread puts a chunk at `t`; when it could (it waits for room)."""
        self.settle(t)
        if self.queued is not None:  # full: until the trainer takes the one there
            t = self.needs_at
            self.settle(t)
        self.queued = (records, t)
        self.settle(t)
        return t


@dataclass
class Trace:
    """One run: when the trainer took each chunk (its records, the wait before it), and at
    each chunk the host's thread handed on the policy's count, the workers its requests went
    to, and its reason."""

    seconds: float
    rows: int
    step_s: float
    takes: np.ndarray  # (chunks, 3): time, records, wait
    decided: np.ndarray  # (chunks, 3): time, count, workers asked
    waiting_from: float  # when the trainer asked for the chunk it had not got at the end
    reasons: list[str] = field(default_factory=list)

    def steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per step: when the trainer took its batch, its records, and how long it waited for it."""
        times, records, waits = self.takes.T
        n = (records / self.rows).astype(int)
        first = np.repeat(np.cumsum(n) - n, n)
        i = np.arange(n.sum()) - first
        at = np.repeat(times, n) + i * self.step_s
        waited = np.where(i == 0, np.repeat(waits, n), 0.0)
        keep = at <= self.seconds
        return at[keep], np.full(keep.sum(), float(self.rows)), waited[keep]

    def taken(self, at: np.ndarray) -> np.ndarray:
        """Records the trainer took by each time of `at`."""
        times, records, _ = self.steps()
        return np.concatenate([[0.0], np.cumsum(records)])[np.searchsorted(times, at, side="right")]

    def rate(self, start: float, end: float) -> float:
        """Records a second taken from `start` to `end`."""
        a, b = self.taken(np.asarray([start, end]))
        return float((b - a) / (end - start))

    def rates(self, window: float, starts: np.ndarray) -> np.ndarray:
        """Records a second taken over `window` from each of `starts`."""
        return (self.taken(starts + window) - self.taken(starts)) / window

    def waited_share(self, start: float = 0.0) -> float:
        """The share of the time from `start` on that the trainer waited for input."""
        times, _, waits = self.takes.T
        waited = np.clip(times, start, self.seconds) - np.clip(times - waits, start, self.seconds)
        still = self.seconds - min(self.seconds, max(start, self.waiting_from))  # a wait not over at the end
        return float((waited.sum() + still) / (self.seconds - start))

    def given_up(self) -> tuple[float, float] | None:
        """When the count, once above 0, was 0 again (the pool given up): first and last
        time; None where it never was."""
        times, counts, _ = self.decided.T
        taken = np.flatnonzero(counts > 0)
        again = times[taken[0] :][counts[taken[0] :] == 0] if len(taken) else times[:0]
        return (float(again[0]), float(again[-1])) if len(again) else None

    def count_median(self, start: float = 0.0) -> float:
        """The policy's count's median over time from `start` on."""
        times, counts, _ = self.decided.T
        held = np.diff(np.clip(np.concatenate([times, [self.seconds]]), start, self.seconds))
        order = np.argsort(counts, kind="stable")
        cumulative = np.cumsum(held[order])
        return float(counts[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


def simulate(policy: PolicyFactory | int, host: Host, demand: float, seed: int = 0, seconds: float = SECONDS) -> Trace:
    """`host` driven for `seconds` by a policy made by `policy` (or a fixed count of workers
    all started at time 0), for a trainer that takes `demand` records a second (math.inf:
    all it gets), as `PooledChunks` drives it (its steps are marked by its names)."""
    now = [0.0]
    chosen: Policy
    if isinstance(policy, int):
        chosen = Fixed(policy, host)
    else:
        chosen = policy(WorkerLimits(host.budget, host.most), host.rows, lambda: now[0])
    plateaus, rng = Plateaus(host.plateau, seconds, seed), np.random.default_rng([seed, 11])
    pool = Pool(host, plateaus, rng, policy if isinstance(policy, int) else 0)
    trainer = Trainer(host.rows, 0.0 if math.isinf(demand) else host.rows / demand)
    rows, w, c = host.rows, host.wait, host.cpu
    pool.cpus_used()  # PooledChunks: measured from the feed's opening
    position, frontier, here, request, level = 0, None, 1, 0, 0
    asked: deque[Request] = deque()
    room, seen = 0.0, (0.0, 0)
    decided: list[tuple[float, int, int]] = []
    reasons: list[str] = []
    while now[0] < seconds:
        t = now[0]
        pool.until(t, lambda speed: 0.0)
        if chosen.due():  # _due
            chosen.cpus_used(pool.cpus_used())
        count = chosen.decide()
        level = pool.ready(min(count, host.most), t) if count else 0  # _steer
        if level and frontier is None:
            frontier, request = position + here * rows, 0
        while level and len(asked) < AHEAD:
            assert frontier is not None
            request = chosen.request_batches(level, request or here)
            asked.append(pool.ask(frontier, request, level))
            frontier += request * rows
        if not asked and not level:  # _next
            frontier = None
        if asked and asked[0].position == position:
            part = asked.popleft()
            done = pool.done_at(part.done)
            pool_wait, now[0] = max(0.0, done - t), max(t, done)
            speed, _ = plateaus.at(now[0])
            records, pooled, work, cpu_s = part.batches * rows, True, part.units * (w + c / speed), part.units * c / speed
            chosen.made(records, work, cpu_s, here=False, nbytes=records * host.record_bytes)
        else:
            batches = chosen.host_batches()
            stop = asked[0].position if asked else frontier
            if stop is not None:
                batches = min(batches, (stop - position) // rows)
            here, records, pooled, pool_wait = batches, batches * rows, False, 0.0
            end, cpu_s = plateaus.work(t, records * rng.lognormal(0.0, host.noise), w, c)
            pool.until(end, lambda speed: (c / speed) / (w + c / speed))
            now[0] = end
            chosen.made(records, end - t, cpu_s, here=True, nbytes=records * host.record_bytes)
        end, _ = plateaus.work(now[0], records, 0.0, host.handoff)  # joined and passed on: the host's thread's CPU
        pool.until(end, lambda speed: 1.0)
        now[0] = end
        position += records
        trainer.settle(now[0])
        told, seen = (trainer.waited - seen[0], trainer.taken - seen[1]), (trainer.waited, trainer.taken)
        chosen.handed(records, pooled, pool_wait, room, *told)
        began = now[0]
        now[0] = trainer.put(records, began)  # the yield: a wait for room in the queue
        room = now[0] - began
        decided.append((began, chosen.count, level))
        reasons.append(getattr(chosen, "reason", ""))
    trainer.settle(seconds)
    takes, decisions = np.asarray(trainer.takes).reshape(-1, 3), np.asarray(decided).reshape(-1, 3)
    return Trace(seconds, rows, trainer.step_s, takes, decisions, trainer.needs_at, reasons)


@lru_cache(maxsize=256)
def best_fixed(case: Case, seed: int) -> tuple[int, float, Trace]:
    """The best fixed count in `case`'s world and seed (of the model's best count, 10% fewer
    and 15% more), its rate after its first second, and its run, for a trainer that takes
    all it gets. Fixed shares and stragglers leave CPUs idle at each request's end: past
    the CPUs, a few more workers often deliver more."""
    host, best = case.host, case.host.best_count()
    counts = sorted({min(host.most, max(1, round(best * f))) for f in (0.9, 1.0, 1.15)})
    runs = {k: simulate(k, host, math.inf, seed, case.seconds) for k in counts}
    rates = {k: run.rate(1.0, case.seconds) for k, run in runs.items()}
    k = max(rates, key=lambda n: rates[n])
    return k, rates[k], runs[k]


@dataclass(frozen=True)
class Figures:
    """Issue 78's figures of one case and seed. A trainer that takes half of the best
    rate: its input wait from `SETTLE_S` on and overall, the count's median and the
    need at mean speed. A trainer that takes all it gets: when the delivered rate over
    `RATE_WINDOW_S` first reaches 0.9 of the best fixed count's over the same window (its
    first second left out: inf, never), and the lowest `WINDOW_S` window from `SETTLE_S` on
    over the best fixed count's in the same window (both see the same CPU plateaus)."""

    best: int
    best_rate: float
    wait_after: float
    wait: float
    count_median: float
    need: int
    time_to_90: float
    lowest_window: float

    @property
    def over_need(self) -> float:
        return self.count_median / self.need


@dataclass
class Result:
    """A policy's runs on one case and seed, the best fixed count's, and the figures."""

    case: Case
    seed: int
    half: Trace
    unbounded: Trace
    reference: Trace
    figures: Figures


def run(policy: PolicyFactory | int, case: Case, seed: int = 0) -> Result:
    """`policy` (or a fixed count) on `case` with seed `seed`, measured against the best
    fixed count: `Result.figures`; `targets` lists those that miss the issue's targets."""
    best, best_rate, reference = best_fixed(case, seed)
    host, seconds = case.host, case.seconds
    demand = 0.5 * best_rate
    half = simulate(policy, host, demand, seed, seconds)
    unbounded = simulate(policy, host, math.inf, seed, seconds)
    ends = np.arange(RATE_WINDOW_S, seconds + 1e-9, GRID_S)
    starts = np.maximum(ends - RATE_WINDOW_S, 1.0)  # the best fixed count's, after its own first second
    reached = np.flatnonzero(unbounded.rates(RATE_WINDOW_S, ends - RATE_WINDOW_S) >= 0.9 * reference.rates(RATE_WINDOW_S, starts))
    starts = np.arange(SETTLE_S, seconds - WINDOW_S + 1e-9, GRID_S * 5)
    lowest = np.min(unbounded.rates(WINDOW_S, starts) / reference.rates(WINDOW_S, starts))
    figures = Figures(
        best=best,
        best_rate=best_rate,
        wait_after=half.waited_share(SETTLE_S),
        wait=half.waited_share(),
        count_median=half.count_median(),
        need=host.need(demand),
        time_to_90=float(ends[reached[0]]) if len(reached) else math.inf,
        lowest_window=float(lowest),
    )
    return Result(case, seed, half, unbounded, reference, figures)


def wait_goal(case: Case) -> float:
    """The input wait the issue allows a trainer that takes half: 0.5%, 1% with 20% plateaus."""
    return 0.01 if case.host.plateau >= 0.2 else 0.005


def time_goal(case: Case) -> float:
    """Seconds the issue allows to 0.9 of the best: 3, 5 with 20% plateaus."""
    return 5.0 if case.host.plateau >= 0.2 else 3.0


def targets(result: Result) -> list[str]:
    """The issue's targets that `result` misses, in words (none: all met)."""
    f, case, missed = result.figures, result.case, []
    if f.wait_after > wait_goal(case):
        missed.append(f"input wait after {SETTLE_S:g} s {f.wait_after:.2%} > {wait_goal(case):.1%}")
    if f.count_median > 1.3 * f.need + 2:
        missed.append(f"count median {f.count_median:g} > 1.3 x the need {f.need} + 2")
    if f.time_to_90 > time_goal(case):
        missed.append(f"0.9 of the best at {f.time_to_90:.2f} s > {time_goal(case):g} s")
    if f.lowest_window < 0.85:
        missed.append(f"a {WINDOW_S:g}-s window at {f.lowest_window:.3f} of the best < 0.85")
    return [f"{case.label}, seed {result.seed}: {m}" for m in missed]


def policy_now(limits: WorkerLimits, rows: int, clock: Callable[[], float]) -> Policy:
    """Today's policy (`WorkerPolicy`), as a factory `run` takes."""
    return WorkerPolicy(limits, rows, clock)
