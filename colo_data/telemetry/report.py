"""The typed telemetry result and its verdict: `summarize` turns a loader's step clock and
the hosts' stage counters into a `Telemetry` whose one-line verdict names the bottleneck."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colo_data.telemetry.counters import (
    HANDOFF,
    IO_WAIT,
    READ,
    STAGE_LABELS,
    STAGES,
    UNCOUNTED,
    WORKER_STAGES,
    StageTimes,
    StepClock,
)
from colo_data.telemetry.quality import Quality, QualityCounts, mixture_shares, quality

INPUT_BOUND_SHARE = 0.05  # steady input wait above this share of wall time: input-bound
# a loop that spends less than this between batches (the median) takes no training step: it waits
# for input all the time, and the rate it reads at is the pipeline's capacity, not a job's wait
NO_STEP_S = 1e-4


@dataclass(frozen=True)
class Phase:
    """Trainer-side numbers over a span of steps: the warm-up or the steady state.
    `input_wait_share` is the time blocked in `next()` over the span's wall time; a step's
    time (`step_p50_s`) is from a batch's return to the next call."""

    steps: int
    seconds: float
    input_wait_s: float
    input_wait_share: float
    records: int
    records_per_s: float
    bytes_per_s: float
    wait_p50_s: float
    wait_p90_s: float
    wait_p99_s: float
    wait_max_s: float
    step_p50_s: float


@dataclass(frozen=True)
class Stage:
    """One stage's totals: seconds spent, items (records) through it, bytes it produced."""

    name: str
    seconds: float
    items: int
    bytes: int


@dataclass(frozen=True)
class HostSide:
    """One host pipeline: where it runs, its stages, what computes them (`workers`: the
    worker processes or Ray actors at work now, else 1 for the host's own thread;
    `worker_processes`: whether any are at work) and why (`workers_why`), their mean CPU use
    (1.0 is one core busy; None where not measured), its CPU budget, and its shared-memory
    ring."""

    host: int
    runs_in: str
    stages: tuple[Stage, ...]
    workers: int
    worker_processes: bool
    worker_cpu: float | None
    cpu_budget: float | None
    cpu_budget_source: str | None
    ring_slots: int | None
    ring_slots_in_use: float | None
    shm_bytes: int
    workers_chosen: str = ""  # the most workers and why (`choose_workers`' reason)
    remote_workers: bool = False  # the workers are of their own kind (Ray actors), not this host's processes
    # by worker process or Ray actor: the stages of the shares of chunks it made (a Ray
    # actor's include `transfer`, the fetch of its shares); empty without workers
    worker_stages: tuple[tuple[Stage, ...], ...] = ()
    workers_why: str = ""  # the workers at work now and why, in one sentence (the worker policy's)
    workers_most: int = 0  # the most worker processes (or Ray actors) allowed (`workers_chosen`); 0: none


@dataclass(frozen=True)
class Telemetry:
    """A loader's telemetry (`Loader.telemetry()`). Stages and CPU cover the steady state
    once the warm-up is over, the whole run before. `verdict` is one line: whether the
    trainer waits for input, and if so which stage, how busy the workers are and the CPU
    budget. `as_dict()` gives plain JSON-ready values."""

    backend: str
    steps: int
    warmup_steps: int
    first_batch_s: float | None
    startup_s: float | None
    warmup: Phase
    steady: Phase
    prefetch: int
    queue_depth: float | None
    handoff: Stage
    hosts: tuple[HostSide, ...]
    input_bound: bool
    bottleneck: str | None
    verdict: str
    limit: str | None = None  # what limits the pipeline (`limit`), whether or not the trainer waits
    limit_stage: str | None = None  # the stage of `limit` (a name in `STAGES`)
    components: dict[str, int] | None = None  # a cd.Mix's records of each component since the loader started
    quality: Quality = field(default_factory=Quality)  # what the batches are made of, since the loader started

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain, JSON-ready values (nested dataclasses become dicts)."""
        return dataclasses.asdict(self)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage summed over the hosts, the trainer's hand-off included."""
        totals = StageTimes()
        for host in self.hosts:
            for i, stage in enumerate(host.stages):
                totals.add(i, stage.seconds, stage.items, stage.bytes)
        totals.add(HANDOFF, self.handoff.seconds, self.handoff.items, self.handoff.bytes)
        return _stages(totals.values)


TelemetrySource = Callable[[], Telemetry]  # what exporters read: `Loader.telemetry`


@dataclass(frozen=True)
class HostCounters:
    """A host's cumulative counters at one moment (subtracted to get the steady state):
    stage values, the CPU sample `(time, seconds)`, the ring's `(slots-in-use sum,
    announcements)`, each worker's stage values, and the data-quality counts
    (`QualityCounts.values`, never subtracted: they count from the loader's start); and the
    workers at work and why (`HostShare.workers_now`; None where not told)."""

    stages: tuple[float, ...]
    cpu: tuple[float, float] | None
    ring: tuple[float, float] | None
    workers: tuple[tuple[float, ...], ...] = ()
    quality: Mapping[str, np.ndarray] = field(default_factory=dict)
    at_work: tuple[int, str] | None = None


def added_by_worker(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """Two sets of workers' stage values added worker by worker (one may have more workers)."""
    out = [list(values) for values in a]
    for i, values in enumerate(b):
        if i == len(out):
            out.append([0.0] * len(values))
        out[i] = [x + y for x, y in zip(out[i], values, strict=True)]
    return tuple(tuple(values) for values in out)


@dataclass(frozen=True)
class HostInfo:
    """What does not change during a run: where the host runs, the most workers it may use
    (`workers_most`; 1, the host's own thread, where `workers_allowed` is false) and its
    resources."""

    host: int
    runs_in: str
    workers_most: int
    workers_allowed: bool
    cpu_budget: float | None
    cpu_budget_source: str | None
    ring_slots: int | None
    shm_bytes: int
    workers_chosen: str = ""  # the most workers and why (`choose_workers`' reason)
    remote_workers: bool = False  # the workers are of their own kind (Ray actors), not this host's processes


def _stages(values: Sequence[float] | np.ndarray) -> tuple[Stage, ...]:
    return tuple(
        Stage(name, float(values[3 * i]), int(values[3 * i + 1]), int(values[3 * i + 2])) for i, name in enumerate(STAGES)
    )


def _phase(
    steps: int, seconds: float, wait_s: float, records: int, batch_bytes: int, start: np.ndarray, wait: np.ndarray
) -> Phase:
    """A phase of `steps` steps lasting `seconds`; `start` and `wait` are its kept steps."""
    between = start[1:] - (start[:-1] + wait[:-1])
    q = np.percentile(wait, [50, 90, 99]) if len(wait) else np.zeros(3)
    per_s = 1 / seconds if seconds > 0 else 0.0
    return Phase(
        steps=steps,
        seconds=seconds,
        input_wait_s=wait_s,
        input_wait_share=wait_s * per_s,
        records=records,
        records_per_s=records * per_s,
        bytes_per_s=steps * batch_bytes * per_s,
        wait_p50_s=float(q[0]),
        wait_p90_s=float(q[1]),
        wait_p99_s=float(q[2]),
        wait_max_s=float(wait.max()) if len(wait) else 0.0,
        step_p50_s=float(np.median(between)) if len(between) else 0.0,
    )


def cpus_text(cpus: float) -> str:
    """2.0, 0.5, 1.25: whole budgets keep one decimal, to read as a quantity of CPUs."""
    return f"{cpus:.1f}" if cpus == int(cpus) else f"{cpus:g}"


def _short_source(source: str | None) -> str:
    if not source:
        return "unknown"
    if source.startswith("cgroup"):
        return "cgroup"
    if source.startswith("affinity"):
        return "affinity mask"
    return source.split("=")[0]


def _critical_seconds(hosts: Sequence[HostSide], handoff: Stage, shared_thread: bool) -> dict[str, float]:
    """Each stage's time on the critical path: a stage that worker processes share out
    counts once per worker, hosts with their own processes run side by side (the slowest
    counts), hosts sharing the trainer's one thread add up. The read stage's parts and the
    wait for worker processes (`UNCOUNTED`) are not counted."""
    out = {name: 0.0 for i, name in enumerate(STAGES) if i not in UNCOUNTED}
    for host in hosts:
        for i, stage in enumerate(host.stages):
            if i in UNCOUNTED:
                continue
            seconds = stage.seconds / host.workers if host.worker_processes and i in WORKER_STAGES else stage.seconds
            out[stage.name] = out[stage.name] + seconds if shared_thread else max(out[stage.name], seconds)
    out["handoff"] += handoff.seconds
    return out


def verdict(
    steady: Phase, warmup: Phase, warmup_steps: int, limited: tuple[str | None, str | None]
) -> tuple[bool, str | None, str]:
    """Whether the trainer waits for input and, if so, which stage holds it up.

    Args:
        steady: the steady state's numbers.
        warmup: the warm-up's numbers (reported while there is no steady state yet).
        warmup_steps: steps the warm-up lasts.
        limited: what limits the pipeline, as `limit` gives it.

    Returns:
        (input-bound?, bottleneck stage or None, the one-line verdict).
    """
    if steady.steps == 0:
        return False, None, f"warming up: {warmup.steps} of {warmup_steps} warm-up steps done, no steady-state steps yet"
    share = steady.input_wait_share
    stage, limiting = limited
    if steady.step_p50_s < NO_STEP_S and share >= INPUT_BOUND_SHARE:
        capacity = f"no training step between batches ({steady.step_p50_s * 1e6:.0f} µs a step outside next()), so the "
        capacity += f"loop waits for input all the time: the pipeline's capacity is {steady.records_per_s:,.0f} records/s"
        return True, stage, capacity + (f"; what limits it: {limiting}" if limiting else "")
    if share < INPUT_BOUND_SHARE:
        return False, None, f"not input-bound: wait {share:.1%} of step time"
    if stage is None:
        return True, None, f"input-bound: wait {share:.1%} of step time; host stages not measured on this backend"
    return True, stage, f"input-bound: {limiting}; wait {share:.1%} of step time"


def who_computes(hosts: Sequence[HostSide]) -> str:
    """Who computes `hosts`' chunks, in words: "the host's own thread" where they have no
    worker processes (`workers` then counts that thread), else "2 worker processes" (local,
    or Ray actors)."""
    if not any(h.worker_processes for h in hosts):
        return "the host's own thread" if len(hosts) == 1 else f"the {len(hosts)} hosts' own threads"
    count = sum(h.workers for h in hosts if h.worker_processes)
    return f"{count} worker process{'' if count == 1 else 'es'}"


def limit(hosts: Sequence[HostSide], handoff: Stage, shared_thread: bool) -> tuple[str | None, str | None]:
    """The stage with the most time on the critical path and what holds it, e.g. `("read",
    "read stage; the host's own thread at 42% CPU; CPU budget 2.0 (affinity mask)")`, whether or not the
    trainer waits; (None, None) where the hosts' stages are not measured."""
    critical = _critical_seconds(hosts, handoff, shared_thread)
    if not hosts or not any(critical.values()):
        return None, None
    stage = max(critical, key=lambda name: critical[name])
    parts = [f"{STAGE_LABELS[stage]} stage"]
    if stage == "read":
        read = sum(h.stages[READ].seconds for h in hosts)
        io_wait = sum(h.stages[IO_WAIT].seconds for h in hosts)
        if read > 0 and io_wait > 0:
            parts[0] += f" ({io_wait / read:.0%} of it waiting for I/O)"
    cpus = [h.worker_cpu for h in hosts if h.worker_cpu is not None]
    workers = who_computes(hosts if not shared_thread else hosts[:1])
    parts.append(f"{workers} at {sum(cpus) / len(cpus):.0%} CPU" if cpus else workers)
    budget = hosts[0]
    if budget.cpu_budget is not None:
        parts.append(f"CPU budget {cpus_text(budget.cpu_budget)} ({_short_source(budget.cpu_budget_source)})")
    return stage, "; ".join(parts)


def summarize(
    *,
    backend: str,
    clock: StepClock,
    prefetch: int,
    queue_depth_known: bool,
    handoff: Sequence[float],
    infos: Sequence[HostInfo],
    now: Sequence[HostCounters],
    handoff_at_warmup: Sequence[float] | None,
    at_warmup_hosts: Sequence[HostCounters] | None,
    shared_thread: bool,
) -> Telemetry:
    """Build the `Telemetry` from the step clock and the counters, now and at the end of the
    warm-up once it is over (the difference is the steady state).

    Args:
        backend: the backend's name, as reported.
        clock: the trainer's step clock.
        prefetch: batches the loader prefetches.
        queue_depth_known: whether the steps recorded the prefetch queue's depth.
        handoff: the trainer's hand-off stage values now.
        infos: each host's fixed facts, in host order.
        now: each host's counters now.
        handoff_at_warmup: the hand-off stage values at the end of the warm-up, or None.
        at_warmup_hosts: each host's counters at the end of the warm-up, or None.
        shared_thread: whether the hosts run on the trainer's one thread.
    """
    warm = np.asarray(clock.warm, dtype=float).reshape(-1, 3)
    warm_seconds = float(warm[-1, 0] + warm[-1, 1] - warm[0, 0]) if len(warm) else 0.0
    warm_wait, warm_records = float(warm[:, 1].sum()), int(warm[:, 2].sum())
    warmup = _phase(len(warm), warm_seconds, warm_wait, warm_records, clock.batch_bytes, warm[:, 0], warm[:, 1])
    first, start, wait, _ = clock.series()
    cut = max(0, clock.warmup - first)
    steady_steps = max(0, clock.count - clock.warmup)
    steady_seconds = 0.0
    if steady_steps and clock.steady_from is not None and clock.last_return is not None:
        steady_seconds = clock.last_return - clock.steady_from
    steady = _phase(
        steady_steps, steady_seconds, clock.steady_wait, clock.steady_records, clock.batch_bytes, start[cut:], wait[cut:]
    )
    before_hosts = at_warmup_hosts if at_warmup_hosts is not None else [None] * len(now)
    hosts = []
    counts = QualityCounts()
    for info, current, before in zip(infos, now, before_hosts, strict=True):
        values = np.asarray(current.stages) - (np.asarray(before.stages) if before is not None else 0.0)
        earlier = [[-v for v in w] for w in before.workers] if before is not None else []
        workers = tuple(_stages(w)[:HANDOFF] for w in added_by_worker(current.workers, earlier))
        at_work, why = (current.at_work[0], current.at_work[1]) if current.at_work else (info.workers_most, "")
        processes = info.workers_allowed and at_work > 0
        count = at_work if processes else 1
        cpu = None
        if current.cpu is not None:
            t0, c0 = before.cpu if before is not None and before.cpu is not None else (0.0, 0.0)
            if current.cpu[0] > t0:
                cpu = (current.cpu[1] - c0) / (current.cpu[0] - t0) / count
        in_use = None
        if current.ring is not None:
            s0, k0 = before.ring if before is not None and before.ring is not None else (0.0, 0.0)
            if current.ring[1] > k0:
                in_use = (current.ring[0] - s0) / (current.ring[1] - k0)
        counts.merge(current.quality)
        hosts.append(
            HostSide(
                host=info.host,
                runs_in=info.runs_in,
                stages=_stages(values)[:HANDOFF],
                workers=count,
                worker_processes=processes,
                worker_cpu=cpu,
                cpu_budget=info.cpu_budget,
                cpu_budget_source=info.cpu_budget_source,
                ring_slots=info.ring_slots,
                ring_slots_in_use=in_use,
                shm_bytes=info.shm_bytes,
                workers_chosen=info.workers_chosen,
                remote_workers=info.remote_workers,
                worker_stages=workers,
                workers_why=why,
                workers_most=info.workers_most if info.workers_allowed else 0,
            )
        )
    hand = np.asarray(handoff) - (np.asarray(handoff_at_warmup) if handoff_at_warmup is not None else 0.0)
    handoff_stage = _stages(hand)[HANDOFF]
    limited = limit(hosts, handoff_stage, shared_thread)
    bound, bottleneck, line = verdict(steady, warmup, clock.warmup, limited)
    return Telemetry(
        backend=backend,
        steps=clock.count,
        warmup_steps=clock.warmup,
        first_batch_s=clock.first[1] if clock.first else None,
        startup_s=clock.first[0] + clock.first[1] - clock.created if clock.first else None,
        warmup=warmup,
        steady=steady,
        prefetch=prefetch,
        queue_depth=clock.depth_sum / steady_steps if queue_depth_known and steady_steps else None,
        handoff=handoff_stage,
        hosts=tuple(hosts),
        input_bound=bound,
        bottleneck=bottleneck,
        verdict=line,
        limit=limited[1],
        limit_stage=limited[0],
        quality=quality(counts.values),
    )


def with_mixture(telemetry: Telemetry, counts: dict[str, int], slots: Sequence[int]) -> Telemetry:
    """`telemetry` with a mixture's records of each component since the loader started
    (`counts`) and their shares against the weights (`slots`: the schedule's)."""
    mixed = dataclasses.replace(telemetry.quality, mixture=mixture_shares(counts, slots))
    return dataclasses.replace(telemetry, components=counts, quality=mixed)


@dataclass(frozen=True)
class StepTrace:
    """The kept steps one by one (for plots): step numbers, seconds from the loader's
    creation to each `next()` call, the wait in it, and the records it delivered."""

    step: np.ndarray
    start_s: np.ndarray
    input_wait_s: np.ndarray
    records: np.ndarray
    warmup_steps: int

    @classmethod
    def of(cls, clock: StepClock) -> StepTrace:
        """The steps that `clock` keeps."""
        first, start, wait, records = clock.series()
        return cls(np.arange(first, first + len(start)), start - clock.created, wait, records, clock.warmup)
