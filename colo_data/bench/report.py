"""The report of `colo-data bench`: the table of throughput and input wait per contender (and
their ratio), colo-data's stages and hosts, the verdict or the pipeline's capacity, the next
thing to try; the same as JSON, and the plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from colo_data.bench.runs import Run
from colo_data.host.worker_words import advice
from colo_data.telemetry.counters import IO_WAIT, READ, STAGE_LABELS, STAGES, UNCOUNTED
from colo_data.telemetry.quality import Quality
from colo_data.telemetry.report import HostSide, Stage, Telemetry, cpus_text, who_computes


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f}"


def _table(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right, strict=True)).rstrip()
        for row in rows
    ]


def capacity(telemetry: Telemetry) -> list[str]:
    """What a run with no simulated training step can say: every loader then waits for its
    input all the time, so instead of "input-bound" the pipeline's capacity (records/s,
    batches/s, the shortest step it keeps under 1% input wait) and what limits it."""
    steady = telemetry.steady if telemetry.steady.steps else telemetry.warmup
    if not steady.steps or steady.records_per_s <= 0:
        return ["capacity: no batch was read, so nothing to measure"]
    batches = steady.steps / steady.seconds if steady.seconds > 0 else 0.0
    limit = f"the {telemetry.limit}" if telemetry.limit else "not named: host stages are not measured on this backend"
    return [
        "no training step was simulated: with none, every loader waits for its input all the time, so the input "
        "wait above says nothing about your job",
        f"capacity: {steady.records_per_s:,.0f} records/s, {batches:,.1f} batches/s (one every {1000 / batches:.2f} ms): "
        f"a training step of about {1000 / batches:.2f} ms or longer waits for input under 1% of the time"
        if batches
        else "capacity: unknown",
        f"what limits it: {limit}",
        "add --step-time MS (your training step) to see whether it keeps up with your job",
    ]


def worker_line(stages: Sequence[Stage]) -> str:
    """One worker's (or Ray actor's) shares in words: records, seconds of each stage it ran,
    and for a Ray actor the fetch of its shares with their bytes."""
    records = max((s.items for s in stages if s.name != "transfer"), default=0)
    spent = ", ".join(f"{STAGE_LABELS[s.name]} {s.seconds:.2f} s" for s in stages if s.seconds and s.name != "transfer")
    transfer = next((s for s in stages if s.name == "transfer" and s.items), None)
    fetched = f"; fetched in {transfer.seconds:.2f} s ({_mb(transfer.bytes)} MB)" if transfer else ""
    return f"{records:,} records; {spent or 'nothing yet'}{fetched}"


CPU_STAGES = ("order", "read", "transform", "batch")  # the host stages that are CPU work (read: unless it waits for I/O)


# a CPU budget whose thread or workers keep less than this share of it busy waits rather than
# computes: more CPUs would not help it, more workers (which overlap the waits) would
BUSY = 0.25


def _busy(host: HostSide) -> float | None:
    """The CPUs a host's workers (or, with none, its own thread) keep busy; None where not
    measured."""
    return None if host.worker_cpu is None else host.worker_cpu * host.workers


def next_step(telemetry: Telemetry) -> str:
    """The one thing to try next, by the stage that limits the pipeline: a read that mostly
    waits for I/O more reads in flight; CPU work with CPU to spare worker processes
    (`--workers auto`), also where the work waits rather than computes (its CPUs less than
    `BUSY` busy); CPU work whose thread and workers fill the CPU budget, Ray workers, the
    CPUs of other machines; where the worker policy counts the workers (or they are Ray's),
    what its sentence's bound calls for; the hand-off and the shared-memory write, fewer
    bytes or more hosts; a stage not measured, a longer run."""
    hosts, stage = telemetry.hosts, telemetry.limit_stage
    if not hosts or stage is None:
        return "next: no host stage was measured long enough to name the limit: run longer (--steps N)"
    label = STAGE_LABELS[stage]
    if stage not in CPU_STAGES:
        return (
            f"next: the {label} stage is the limit, and no worker or CPU setting of the host speeds it: fewer bytes a "
            "batch (narrower dtypes, fewer or shorter columns), or more hosts (sidecars) to share the batch"
        )
    if stage == "read":
        read, io_wait = (sum(h.stages[i].seconds for h in hosts) for i in (READ, IO_WAIT))
        if io_wait >= read / 2:
            return (
                f"next: the read stage waits for I/O {io_wait / read:.0%} of its time: more reads in flight, "
                "cd.ArrowSource(..., io_concurrency=N), or a local cache of what was fetched, cache_dir=DIR "
                '(see "Object storage" in the docs)'
            )
    if any(host.remote_workers for host in hosts):
        return _policy_next(hosts, label)
    host = hosts[0]
    budget = cpus_text(host.cpu_budget or 0)
    spare = [h for h in hosts if h.cpu_budget is not None and h.workers + h.worker_processes < h.cpu_budget]
    if spare and not any(h.workers_most for h in hosts):
        return (
            f"next: the {label} stage is CPU work on the host's own thread, and its CPU budget of {budget} has room for "
            'worker processes: --workers auto (in code, workers="auto" on cd.InProcess or cd.Sidecar; --backend sidecar '
            "runs the host beside the trainer with the config's [sidecar] workers)"
        )
    if spare and any(h.worker_processes and h.workers >= h.workers_most for h in hosts):
        return (
            f"next: the {label} stage is CPU work, and the CPU budget of {budget} has room for more than "
            f"{who_computes([host])}, all that --workers allows: --workers auto (as many as the worker policy counts)"
        )
    if spare:  # workers allowed, and the worker policy counts fewer
        return _policy_next(hosts, label)
    busy = _busy(host)
    if busy is not None and host.cpu_budget and busy < BUSY * host.cpu_budget:  # the CPUs are not what it lacks
        if any(h.workers_most for h in hosts):  # the worker policy counts the workers of work that waits
            return _policy_next(hosts, label)
        return (
            f"next: the {label} stage waits more than it computes (it keeps {busy:.1f} of its {budget} CPUs busy): "
            "worker processes overlap the waits, more of them than CPUs: --workers auto"
        )
    who = f"{who_computes([host])} and the host's own thread" if host.worker_processes else "the host's own thread"
    each = " each" if host.worker_processes else ""
    busy_text = f" (at {host.worker_cpu:.0%} CPU{each})" if host.worker_cpu is not None else ""
    return (
        f"next: the host's CPUs are the limit: its {label} stage is CPU work, and its CPU budget of {budget} is taken by "
        f"{who}{busy_text}. Ray workers add the CPUs of other machines: "
        f'--workers \'ray:{{"address": "HEAD:6379", "actors": 2}}\' '
        '(in a config: [sidecar] workers = { ray = "HEAD:6379", actors = 2 }); see "When host CPUs run short: Ray" '
        "in the docs"
    )


def _policy_next(hosts: Sequence[HostSide], label: str) -> str:
    """The next step where the worker policy counts the workers: what the bound its sentence
    names calls for (the first host's that names one)."""
    said = next(((h, what) for h in hosts if h.workers_why and (what := advice(h.workers_why))), None)
    if said is None:
        return (
            f"next: the {label} stage is the limit, and the worker policy counted its workers for a trainer that "
            "took less than now: run longer (--steps N); the count follows within a few seconds"
        )
    host, what = said
    return f"next: the {label} stage is the limit, and host {host.host}'s workers are bound as its sentence above says: {what}"


def report(runs: Sequence[Run], step_ms: float) -> str:
    """The report table: throughput, input wait, percentiles and warm-up per contender (and
    their ratio), then colo-data's stage breakdown and hosts; then, with a simulated step of
    `step_ms`, the verdict, and with none the pipeline's capacity and what limits it."""
    lines = []
    if any(run.interrupted for run in runs):
        done = ", ".join(f"{r.telemetry.steps} {r.name} steps" for r in runs)
        lines += [f"interrupted (Ctrl-C): partial report after {done}", ""]
    steady = [run.telemetry.steady for run in runs]
    ratio = len(runs) == 2 and steady[1].records_per_s > 0
    rows = [["steady state", *(run.name for run in runs), *(["ratio"] if ratio else [])]]

    def row(label: str, values: Sequence[str], ratio_of: Callable[[Telemetry], float] | None = None) -> None:
        """A row of the table; with two contenders and `ratio_of`, their ratio too."""
        cells = [label, *values]
        if ratio:
            ours, theirs = (ratio_of(run.telemetry) for run in runs) if ratio_of else (0.0, 0.0)
            cells.append(f"{ours / theirs:.2f}x" if theirs else "")
        rows.append(cells)

    row("steps (after warm-up)", [f"{s.steps:,}" for s in steady])
    row("records/s", [f"{s.records_per_s:,.0f}" for s in steady], lambda t: t.steady.records_per_s)
    row("MB/s", [_mb(s.bytes_per_s) for s in steady], lambda t: t.steady.bytes_per_s)
    row("input wait, share of wall time", [f"{s.input_wait_share:.2%}" for s in steady])
    row("wait p50 / p90 / p99 (ms)", [f"{_ms(s.wait_p50_s)} / {_ms(s.wait_p90_s)} / {_ms(s.wait_p99_s)}" for s in steady])
    row("wait max (ms)", [_ms(s.wait_max_s) for s in steady])
    row("step p50 (ms)", [_ms(s.step_p50_s) for s in steady])
    row("first batch (s)", [f"{r.telemetry.first_batch_s:.2f}" if r.telemetry.first_batch_s is not None else "-" for r in runs])
    row(
        "warm-up: steps, s, wait share",
        [
            f"{r.telemetry.warmup.steps}, {r.telemetry.warmup.seconds:.2f}, {r.telemetry.warmup.input_wait_share:.0%}"
            for r in runs
        ],
    )
    lines += _table(rows, [False, *([True] * (len(rows[0]) - 1))])
    colo = runs[0].telemetry
    steps = max(1, colo.steady.steps if colo.steady.steps else colo.warmup.steps)
    stages = colo.stages
    parts = {STAGES[i] for i in UNCOUNTED}  # read's parts, the wait for workers: shown, not added
    busy = sum(s.seconds for s in stages if s.name not in parts) or 1.0
    lines += ["", f"colo-data stages ({'steady state' if colo.steady.steps else 'warm-up'}, all hosts; hand-off in the trainer)"]
    stage_rows = [["stage", "ms/batch", "share", "records", "MB"]]
    for s in stages:
        no_ring = s.name == "shm_write" and all(host.ring_slots is None for host in colo.hosts)
        if s.name != "handoff" and (not colo.hosts or no_ring):
            continue  # a stage this backend does not have (or, colocated, does not measure)
        if s.name in parts and not s.items:
            continue  # no object storage (I/O wait) or nothing decoded in the background
        stage_rows.append(
            [
                STAGE_LABELS[s.name],
                f"{s.seconds * 1000 / steps:.3f}",
                "-" if s.name in parts else f"{s.seconds / busy:.0%}",
                f"{s.items:,}",
                _mb(s.bytes),
            ]
        )
    lines += _table(stage_rows, [False, True, True, True, True])
    read = next((s.seconds for s in stages if s.name == "read"), 0.0)
    if any(s.name == "decode" and s.items and s.seconds > read for s in stages):
        lines.append(
            "(read: decode runs ahead on background threads, beside the other stages, and is not part of the read's "
            "time: it can exceed it)"
        )
    lines.append("")
    for host in colo.hosts:
        cpu = f" at {host.worker_cpu:.0%} CPU" if host.worker_cpu is not None else ""
        ring = (
            f"; ring {host.ring_slots_in_use:.1f} of {host.ring_slots} slots in use, {_mb(host.shm_bytes)} MB shared memory"
            if host.ring_slots_in_use is not None
            else ""
        )
        budget = (
            f"CPU budget {cpus_text(host.cpu_budget)} ({host.cpu_budget_source})"
            if host.cpu_budget is not None
            else "CPU budget unknown"
        )
        lines.append(f"host {host.host}: {host.runs_in}; {who_computes([host])}{cpu}; {budget}{ring}")
        if host.workers_why:
            lines.append(f"  {host.workers_why}")
        if host.workers_chosen:
            lines.append(f"  at most: {host.workers_chosen}")
        noun = "Ray actor" if host.remote_workers else "worker"
        lines += [f"  {noun} {i}: {worker_line(stages)}" for i, stages in enumerate(host.worker_stages)]
    if colo.queue_depth is not None:
        lines.append(f"prefetch queue: {colo.queue_depth:.1f} of {colo.prefetch} batches ready at next() on average")
    for run in runs[1:]:
        lines += [f"{run.name}: {note}" for note in run.notes]
    lines += ["", f"verdict: {colo.verdict}"] if step_ms else ["", *capacity(colo)]
    lines += [next_step(colo)] if colo.input_bound or not step_ms else []
    return "\n".join(lines)


def as_json(runs: Sequence[Run], settings: dict[str, Any]) -> dict[str, Any]:
    """The report as one JSON object: the settings, each run's telemetry and notes, and the
    records/s ratio of colo-data to Grain when both ran to a steady state."""
    out: dict[str, Any] = {"settings": settings, "interrupted": any(r.interrupted for r in runs)}
    for run in runs:
        out[run.name.lower()] = {**run.telemetry.as_dict(), "notes": run.notes}
    if len(runs) == 2 and runs[1].telemetry.steady.records_per_s:
        out["ratio_records_per_s"] = runs[0].telemetry.steady.records_per_s / runs[1].telemetry.steady.records_per_s
    return out


def plot(runs: Sequence[Run], path: str, title: str) -> list[str]:
    """A PNG: input wait per step (warm-up shaded) and throughput over time, per contender;
    where colo-data's run has them, the fill of its packed and padded columns between
    samples and a mixture's component shares so far against their weights. Returns the
    panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = runs[0].quality
    filled = bool(samples and samples[-1][1].columns)
    mixed = bool(samples and samples[-1][1].mixture)
    fig, axes = plt.subplots(2 + filled + mixed, 1, figsize=(10, 3.5 * (2 + filled + mixed)))
    wait_ax, rate_ax = axes[0], axes[1]
    for run in runs:
        trace = run.trace
        wait_ax.plot(trace.step, np.maximum(trace.input_wait_s * 1000, 1e-3), lw=0.8, label=run.name)
        if len(trace.step) > 1:
            returned = trace.start_s + trace.input_wait_s - trace.start_s[0]
            width = max(returned[-1] / 100, 0.01)
            counts, edges = np.histogram(returned, bins=np.arange(0, returned[-1] + width, width), weights=trace.records)
            rate_ax.plot(edges[:-1] + width / 2, np.maximum(counts / width, 1), lw=1, label=run.name)
    warmup = runs[0].trace.warmup_steps
    if warmup:
        wait_ax.axvspan(0, warmup, color="0.9", label="warm-up")
    wait_ax.set(xlabel="step", ylabel="input wait (ms)", yscale="log", title=title)
    rate_ax.set(xlabel="seconds since the first next()", ylabel="records/s", yscale="log", title="throughput")
    if filled:
        _plot_fill(axes[2], samples)
    if mixed:
        _plot_shares(axes[-1], samples)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return [ax.get_title() for ax in axes]


def _plot_fill(ax: Any, samples: Sequence[tuple[int, Quality]]) -> None:
    """Each packed or padded column's fill (tokens over token places) between samples."""
    steps = [step for step, _ in samples]
    for column in samples[-1][1].columns:
        key = (column.column, column.kind, column.length)
        counts = np.zeros((len(samples) + 1, 2))  # (tokens, token places) at each sample, from zero
        for i, (_, q) in enumerate(samples, 1):
            counts[i] = next(((c.tokens, c.rows * c.length) for c in q.columns if (c.column, c.kind, c.length) == key), (0, 0))
        tokens, places = np.diff(counts, axis=0).T
        fill = np.divide(tokens, places, out=np.full(len(tokens), np.nan), where=places > 0)
        ax.plot(steps, fill, lw=1, label=f"{column.column} ({column.kind} to {column.length})")
    ax.set(xlabel="step", ylabel="fill", ylim=(0, 1.05), title="fill of packed and padded columns, between samples")


def _plot_shares(ax: Any, samples: Sequence[tuple[int, Quality]]) -> None:
    """Each mixture component's share of the records so far, its weight dashed."""
    steps = [step for step, _ in samples]
    for i, component in enumerate(samples[-1][1].mixture):
        shares = [q.mixture[i].share for _, q in samples]
        (line,) = ax.plot(steps, shares, lw=1, label=component.component)
        ax.axhline(component.weight, color=line.get_color(), ls="--", lw=0.8)
    ax.set(xlabel="step", ylabel="share of the records", ylim=(0, 1.05), title="mixture shares so far (dashed: weights)")
