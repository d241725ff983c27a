"""A host pipeline's worker pool on a host of any size, simulated on a fake clock, to drive
`WorkerPolicy` (colo_data/host/worker_policy.py) as the host's schedule drives it: what
the chunks cost, where the host's thread waited, the CPUs in use, a decision asked for
at every step.

The world. A record costs a worker `cpu` seconds on a CPU and `wait` seconds off it, and
the host's thread `handoff` seconds to hand it on, and the trainer `trainer` seconds of CPU
to take it; the host's thread alone makes one in `cpu + wait + handoff`. Workers share
`budget - others` CPUs less the trainer's (a worker at nice 10 takes what the trainer and
the host's thread leave): beyond them, every busy worker slows in proportion, and each CPU
asked for beyond them costs `CROWDING` of the rate too (switches, caches); with workers at
work everything runs `1 + hidden` times slower, unseen in what a record costs them (CPUs
they contend for with the trainer, say). A worker's speed in a step is 1 plus a normal draw
of sd `noise` (the steps' sum of k workers has sd `noise * sqrt(k)`), and so is the host's
thread's alone. The first worker is ready `SERVER_S` after it is first asked for (a fork
server's start), each further one `FORK_S` after the one before, plus `WARM_S` to set its
job up; workers once started stay. Downstream, a buffer holds `buffer_s` of the best rate;
the trainer takes `demand` records a second (unbounded: whatever is made), and waits when
the buffer is empty; the host's thread waits for room when it is full.

`Host.best` is the best fixed count and its mean rate; `meeting` the fewest workers whose
mean rate meets the demand; `simulate(fixed=k)` runs one count from the start, all its
workers ready.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from colo_data.defaults import INPUT_WAIT
from colo_data.host.worker_policy import WorkerLimits, WorkerPolicy

DT = 0.05  # seconds a step
SERVER_S, FORK_S, WARM_S = 0.3, 0.002, 0.05
CROWDING = 0.05  # of the rate lost per CPU's worth of work asked for beyond the CPUs there are, per CPU there is


@dataclass(frozen=True)
class Host:
    """One simulated host (see the module's docstring); `steps` changes the cost or the
    demand at given seconds: `{60.0: {"cpu": 4e-3}}`."""

    budget: float
    most: int
    cpu: float = 1e-3
    wait: float = 0.0
    handoff: float = 2e-6
    others: float = 0.2
    trainer: float = 0.0
    demand: float = math.inf
    noise: float = 0.0
    remote: bool = False
    buffer_s: float = 0.25
    hidden: float = 0.0
    steps: dict[float, dict[str, float]] = field(default_factory=dict)

    def at(self, seconds: float) -> Host:
        """The host as it is `seconds` into the run (its cost and demand steps taken)."""
        host = self
        for when, change in sorted(self.steps.items()):
            if seconds >= when:
                host = replace(host, **change)
        return host

    @property
    def cpus(self) -> float:
        return math.inf if self.remote else max(0.0, self.budget - self.others)

    def rate(self, workers: int, speed: float) -> float:
        """Records a second with `workers` workers whose speeds add up to `speed` (0: the
        host's thread alone, at `speed`)."""
        t, c, h = self.cpu + self.wait, self.cpu, self.handoff
        per = (workers or 1) / speed  # a record's cost in this step over the mean
        cpu = self.cpus / (c * per + h + self.trainer)  # the CPUs' bound, the trainer's use growing with the rate
        if not workers:
            return min(1 / (t * per + h), cpu)
        wanted = workers * c / t  # CPUs the busy workers ask for
        crowded = max(0.0, wanted - self.cpus) / max(self.cpus, 1e-9)
        return min(workers / (t * per), cpu, 1 / h) / (1 + CROWDING * crowded) / (1 + self.hidden)

    def best(self) -> tuple[int, float]:
        """The best fixed count and its mean rate."""
        counts = np.arange(self.most + 1)
        rates = [self.rate(int(k), float(k) if k else 1.0) for k in counts]
        k = int(np.argmax(rates))
        return k, rates[k]


@dataclass
class Run:
    """A run's record, step by step: the time at each step's end, records taken by the
    trainer, the count asked for and the workers at work, and the trainer's waits."""

    times: list[float] = field(default_factory=list)
    taken: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    working: list[int] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def rate(self, start: float, end: float) -> float:
        """Records a second taken from `start` to `end` seconds."""
        t = np.asarray(self.times)
        picked = (t > start + 1e-9) & (t <= end + 1e-9)
        return float(np.asarray(self.taken)[picked].sum() / (end - start))

    def waited_share(self, start: float = 0.0) -> float:
        t = np.asarray(self.times)
        picked = t > start + 1e-9
        return float(np.asarray(self.waited)[picked].sum() / (picked.sum() * DT))

    def count_at(self, seconds: float) -> int:
        return self.count[int(np.searchsorted(self.times, seconds - 1e-9))]

    def changes(self, start: float = 0.0) -> int:
        """How many times the count changed after `start` seconds."""
        t = np.asarray(self.times)
        counts = np.asarray(self.count)[t > start]
        return int((np.diff(counts) != 0).sum())


class Fixed:
    """A fixed count, its workers ready from the start (the reference runs)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def made(self, *args: object, **kwargs: object) -> None: ...
    def handed(self, *args: object) -> None: ...
    def due(self) -> bool: return False
    def host_batches(self) -> int: return 1
    def request_batches(self, workers: int, last: int) -> int: return 1
    def cpus_used(self, cpus: float | None) -> None: ...

    def decide(self) -> int:
        return self.count


def simulate(host: Host, seconds: float, seed: int = 0, fixed: int | None = None, input_wait: float = INPUT_WAIT) -> Run:
    """`host` driven for `seconds` by a `WorkerPolicy` serving the trainer's `input_wait`
    (or, with `fixed`, that count)."""
    rng = np.random.default_rng(seed)
    now = [0.0]
    policy: WorkerPolicy | Fixed = Fixed(fixed) if fixed is not None else WorkerPolicy(
        WorkerLimits(host.budget, host.most, host.remote, input_wait), rows=32, clock=lambda: now[0]
    )
    ready: list[float] = [0.0] * fixed if fixed is not None else []  # when each worker started is ready
    room = host.buffer_s * host.best()[1]
    buffered = 0.0
    run = Run()
    for step in range(round(seconds / DT)):
        world = host.at(now[0])
        count = policy.decide()
        if count > len(ready):  # start the workers asked for that have not started
            first = now[0] + (0.0 if ready or world.remote else SERVER_S)
            ready += [first + FORK_S * i + WARM_S for i in range(1, count - len(ready) + 1)]
        working = min(count, sum(1 for r in ready if r <= now[0]))
        sd = world.noise * math.sqrt(max(1, working))
        speed = max(0.3 * max(1, working), (working or 1) + sd * rng.standard_normal())
        made = world.rate(working, speed) * DT
        t, c, h = world.cpu + world.wait, world.cpu, world.handoff
        per = (working or 1) / speed  # each record's cost over the mean, at this step's speed
        want = world.demand * DT
        if want == math.inf:  # the trainer takes what is made, and waits for the rest
            taken, room_wait, waited = made, 0.0, DT
        else:
            taken = min(want, buffered + made)
            over = buffered + made - taken - room
            room_wait = DT * over / made if over > 0 and made else 0.0
            made -= max(0.0, over)
            buffered = min(room, buffered + made - taken + max(0.0, over))
            waited = (want - taken) / world.demand
        busy = made * h if working else made * (t * per + h)
        pool_wait = max(0.0, DT - busy - room_wait) if working else 0.0
        if not working:  # the host's thread makes a chunk (its sizes grow at first)
            policy.host_batches()
        else:  # a request to the workers at work, taken back within the step
            policy.request_batches(working, 1)
        records = round(made)  # (what is made and taken is counted in whole records)
        policy.made(records, records * t * per, records * c * per, here=not working)
        policy.handed(records, bool(working), pool_wait, room_wait, waited, round(taken))
        policy.cpus_used(world.others + (made * (c * per + h) + taken * world.trainer) / DT)
        now[0] = (step + 1) * DT
        run.times.append(now[0])
        run.taken.append(taken)
        run.count.append(count)
        run.working.append(working)
        run.waited.append(waited)
        run.reasons.append(getattr(policy, "reason", ""))
    return run


def meeting(host: Host) -> int:
    """The fewest workers whose mean rate meets the host's demand."""
    return next(k for k in range(host.most + 1) if host.rate(k, float(k or 1)) >= host.demand)
