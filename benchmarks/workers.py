"""Workers as the worker policy counts them: 0, 1, 2 and "auto" allowed, in process and
through the sidecar, on a light and a CPU-bound pipeline, each run in a fresh process, window
by window; CPU-bound packed and filtered ones; and one whose records wait instead of compute.

Pipelines (benchmarks/workers_child.py): `light`, 12 Parquet files of token lists in small,
uneven row groups (150 to 1,500 rows), block shuffle, a 64-token pad, batch 32; `cpu`, the
same with a CPU-bound per-record Python function before the pad. Each run builds
`cd.Loader(pipeline, backend=cd.InProcess(workers=N) | cd.Sidecar(workers=N))` and reads
`BATCHES` batches, each `jax.block_until_ready`, noting when each arrives. Rates are taken
over windows of `WINDOW` batches after the first batch (the first window starts with it),
about 0.1 s of each pipeline here, and over the steady state (the second half of the run);
configurations are interleaved within each round. A window shorter than that measures the
scheduler rather than the pipeline: on 2 CPUs shared by 3 or 4 busy processes, one of them
waits several milliseconds at a time for a CPU, and windows of 100 light batches (about 15
ms) read 0.6x to 0.8x between two runs of one configuration. A window's rate in a run is the
median of it and its neighbour on either side: an interpreter's pause (a garbage
collection, say) slows one window in every configuration, but near a different batch in
each run, and would be taken for the configuration's own. Per window, the median over the
rounds is compared. The light pipeline runs `2N + 1` rounds for the CPU-bound one's `N`:
the margin of its window goals is about the noise of a window's median over 5 rounds, and
its runs are the shorter (about 2 to 4 s against 6). Goals:

- on the light pipeline, with 2 workers, every window at least 0.9x the same window with
  none, in process and through the sidecar: more workers are never slower, also while
  they start (the CPU-bound pipeline's windows are shown too). The light pipeline also
  runs with none a second time, as a contender of its own: the same ratio between two
  runs of the same configuration is the noise floor of that measure;
- "auto" at least 0.9x the best of 0, 1 and 2 workers allowed, in the steady state (the
  table says how many were at work at the end of its runs, and why);
- the CPU-bound pipeline through a sidecar with 2 workers at least 1.85x one in-process
  thread (in process, no workers), steadily (every round);
- the CPU-bound pipeline with 2 workers at least 1.7x none over its first `EARLY` steps after
  the first batch, in process and through the sidecar (the table shows how long those steps
  took, beside the first batch's time: a worker that is not ready by then cannot help);
- CPU-bound packed and filtered pipelines written as a user writes them (`cpu packed`: the
  records packed into rows of 256 tokens, then the same per-record work on each row in
  `transforms=`; `cpu filtered`: `cpu` keeping the records of 40 tokens or more; neither
  names partitions: each gets the 16 it chooses, whose slices the workers compute) with 2
  workers at least 1.5x the same pipeline with none in process (the
  default backend), in the steady state, in process and through the sidecar: the rate "with no
  workers" that the issue's goal and its own measurement (one rate with no workers, beside
  `cd.InProcess(workers=2)` and `cd.Sidecar(workers=2)`) compare both with, as the padded
  goal above does. The sidecar against a sidecar with none is shown too, without a goal: on
  2 CPUs a sidecar with no workers already uses about 1.25 of them (its thread computes while
  the trainer reads), so 2 workers can add at most about 2 / 1.25 = 1.6x there;
- `wait`: the light pipeline whose records each wait 2 ms first (`time.sleep`, as a
  per-record fetch or remote call would), with 16 workers allowed, at least 10x none over
  5 to 15 s after `cd.Loader(...)`, in process and through the sidecar; with the default
  settings (`cd.Loader(pipeline)`) at least as fast over those seconds as Grain's default
  iterator running the same function over the same records (`MapDataset.source(...).map(f)
  .batch(32).to_iter_dataset()`, whose 16 read threads overlap the waits), with its first
  batch 0.5 s or less after `cd.Loader(...)`.

Start ("workers ready sooner"), timed from `cd.Loader(...)`: how much sooner 2 workers
bring batch N than none (none's time to it over 2 workers'), with the goals: the CPU-bound
pipeline's batch 1,200 at least 1.5x sooner in process, the light pipeline's batches 400 and
4,000 at least 0.9x (never later); a sidecar's first batch with 2 workers within 1.0 s; and,
shown without a goal, the CPU-bound pipeline's batch 120 (a fresh interpreter's imports take
about 0.2 s before a first worker can work), its batch 1,200 through a sidecar (the sidecar's
own start, a fresh interpreter, precedes its first batch, and 2 workers at their steady rate
from that batch on would bring batch 1,200 about 1.5x sooner at most on 2 CPUs: the goal
would measure the machine's noise), and when the first worker process began its first chunk
(after its warm-up batch; workers_pipeline.note_start notes it in the worker).

Run: `.venv/bin/python benchmarks/workers.py [--rounds N] [--quick] [--out DIR] [--pipelines light,cpu]
[--before PATH]`. `--before` names another colo-data tree (e.g. the commit before a change, without
its own venv: its `colo_data` is imported from it, the benchmark's modules from here): the light and
CPU-bound pipelines' configurations with 0 and 2 workers run with it too, interleaved with the others
in every round, and their start figures are compared.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import harness
from children import run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = "import json, sys, workers_child; workers_child.main(json.loads(sys.argv[1]))"
BATCH = 32
WINDOW = {"light": 1000, "cpu": 100, "cpu packed": 100, "cpu filtered": 100, "wait": 100}  # batches: about 0.1 s here
EARLY = 120  # the first steps after the first batch, rated on their own
NEIGHBOURS = 1  # windows on either side of one, for its rate
# 2 to 10 s a run here; the sliced pipelines' long enough that the second half, their steady
# state, starts well after their workers have started
BATCHES = {"light": 16000, "cpu": 4000, "cpu packed": 4000, "cpu filtered": 6000}
PIPELINES = ("light", "cpu", "cpu packed", "cpu filtered", "wait")
SLICED = ("cpu packed", "cpu filtered")  # partitioned: run with 0 and 2 workers
# `wait` runs for `WAIT_S` seconds from `cd.Loader(...)` and is rated over `WAIT_RATED` of them
WAIT_S, WAIT_RATED = 15.0, (5.0, 15.0)
WAIT_COUNTS: tuple[tuple[str, int | str], ...] = (
    ("inprocess", 0), ("inprocess", 16), ("sidecar", 0), ("sidecar", 16), ("inprocess", "default"), ("grain", "default"),
)  # fmt: skip
RATED = "rated_records_per_s"  # records a second over `WAIT_RATED`
BACKENDS = ("inprocess", "sidecar")
COUNTS: tuple[int | str, ...] = (0, 1, 2, "auto")
AGAIN = "0 (again)"
BEFORE = " [before]"  # the suffix of a configuration run with the `--before` tree
# the start goals: none's time to batch N, timed from `cd.Loader(...)`, over 2 workers'
SOONER = {"cpu": ((120, None), (1200, ">= 1.5")), "light": ((400, ">= 0.9"), (4000, ">= 0.9"))}
IN_PROCESS_ONLY = {("cpu", 1200)}  # goals of `SOONER` that hold in process alone (see the docstring)
SIDECAR_FIRST_BATCH = "<= 1.0"  # seconds, with 2 workers
FIRST_CHUNK = "first_worker_chunk_s"  # when the first worker process began its first chunk, after the loader was made
STEADY = "steady_records_per_s"
FIRST_STEPS = "first_steps_records_per_s"  # over the `EARLY` steps after the first batch
# the performance page's figures: (the start of a ratio's name, what, peer)
HEADLINES = (
    ("light, inprocess: auto", '`workers="auto"`, in process, light pipeline', "the best fixed count"),
    ("cpu, inprocess: auto", '`workers="auto"`, in process, CPU-bound pipeline', "the best fixed count"),
    ("cpu: sidecar, 2 workers / in process, none", "CPU-bound pipeline: sidecar with 2 workers", "in process, no workers"),
    ("light, inprocess: 2 workers / none, lowest", "light pipeline, in process, 2 workers, lowest window", "no workers"),
    ("light, sidecar: 2 workers / none, lowest", "light pipeline, sidecar, 2 workers, lowest window", "no workers"),
    ("cpu packed, inprocess: 2 workers / none", "packed CPU-bound pipeline, in process: 2 workers", "no workers"),
    (
        "cpu packed, sidecar: 2 workers / in process, none",
        "packed CPU-bound pipeline, sidecar: 2 workers",
        "in process, no workers",
    ),
    ("cpu packed, sidecar: 2 workers / sidecar, none", "packed CPU-bound pipeline, sidecar: 2 workers", "sidecar, no workers"),
    ("cpu filtered, inprocess: 2 workers / none", "filtered CPU-bound pipeline, in process: 2 workers", "no workers"),
    (
        "cpu filtered, sidecar: 2 workers / in process, none",
        "filtered CPU-bound pipeline, sidecar: 2 workers",
        "in process, no workers",
    ),
    (
        "cpu filtered, sidecar: 2 workers / sidecar, none",
        "filtered CPU-bound pipeline, sidecar: 2 workers",
        "sidecar, no workers",
    ),
    ("cpu, inprocess: 2 workers / none, the first", "CPU-bound pipeline, in process, 2 workers, first 120 steps", "no workers"),
    ("cpu, inprocess: none / 2 workers, time to batch 1200", "CPU-bound pipeline, in process, 2 workers: batch 1,200", "none"),
    ("light, inprocess: none / 2 workers, time to batch 400", "light pipeline, in process, 2 workers: batch 400", "no workers"),
    ("light, inprocess: none / 2 workers, time to batch 4000", "light pipeline, in process, 2 workers: batch 4,000", "none"),
    ("light, sidecar: none / 2 workers, time to batch 400", "light pipeline, sidecar, 2 workers: batch 400", "no workers"),
    ("light, sidecar: none / 2 workers, time to batch 4000", "light pipeline, sidecar, 2 workers: batch 4,000", "none"),
    ("cpu, sidecar, 2 workers: first batch", "CPU-bound pipeline, sidecar, 2 workers: first batch after `cd.Loader(...)`", ""),
    ("wait, inprocess: 16 workers / none", "records that wait 2 ms, in process: 16 workers allowed", "no workers"),
    ("wait, sidecar: 16 workers / none", "records that wait 2 ms, sidecar: 16 workers allowed", "no workers"),
    ("wait: default settings / Grain", "records that wait 2 ms: `cd.Loader(pipeline)`", "Grain's default iterator"),
    ("wait: default settings, first batch", "records that wait 2 ms, default settings: first batch", ""),
)


def key(pipeline: str, backend: str, workers: int | str) -> str:
    """The name of one configuration."""
    return f"{pipeline}, {backend}, workers={workers}"


def to_batch(n: int) -> str:
    """The name of the time to batch `n` from the loader made."""
    return f"to_batch_{n}_s"


def one_run(spec: dict[str, Any], env: dict[str, str], tree: Path = ROOT) -> harness.Measurement:
    """One configuration in a fresh process whose `colo_data` is `tree`'s: its window rates,
    steady rate, first batch, times to the batches of `SOONER`, and when its first worker
    began its first chunk (None where none did)."""
    _, _, out, _, left = run([sys.executable, "-c", CHILD, json.dumps(spec)], env, tree)
    got = json.loads(out.strip().splitlines()[-1])
    arrived = got["arrived"]
    reached = {to_batch(n): arrived[n - 1] - got["made"] for goals in SOONER.values() for n, _ in goals if n <= len(arrived)}
    began = got["worker_first_chunk"]
    size = WINDOW[spec["pipeline"]]
    windows = [size * BATCH / (arrived[end] - arrived[end - size]) for end in range(size, len(arrived), size)]
    since = [t - got["made"] for t in arrived]
    rated = sum(WAIT_RATED[0] < t <= WAIT_RATED[1] for t in since) * BATCH / (WAIT_RATED[1] - WAIT_RATED[0])
    half = len(arrived) // 2
    steady = (len(arrived) - 1 - half) * BATCH / (arrived[-1] - arrived[half])
    early = min(EARLY, len(arrived) - 1)
    return {
        "windows": windows,
        STEADY: steady,
        FIRST_STEPS: early * BATCH / (arrived[early] - arrived[0]),
        "first_steps_s": arrived[early] - arrived[0],
        "first_batch_s": arrived[0] - got["made"],
        "chosen": got["chosen"],
        "left_behind": left,
        RATED: rated,
        FIRST_CHUNK: None if began is None else began - got["made"],
        **reached,
    }


def first_chunk(side: list[harness.Measurement]) -> str:
    """The median time to the first worker's first chunk over the rounds that had one, and
    how many did where not all."""
    times = [m[FIRST_CHUNK] for m in side if m[FIRST_CHUNK] is not None]
    if not times:
        return "-"
    return f"{statistics.median(times):.2f}" + (f" ({len(times)}/{len(side)} rounds)" if len(times) < len(side) else "")


def show(m: harness.Measurement) -> str:
    """A progress line."""
    low = min(m["windows"]) if m["windows"] else float("nan")
    return f"first batch {m['first_batch_s']:.2f} s; steady {m[STEADY]:,.0f} records/s; lowest window {low:,.0f}"


def smoothed(windows: list[float]) -> list[float]:
    """Each window's rate as the median of it and its `NEIGHBOURS` on either side."""
    return [statistics.median(windows[max(0, i - NEIGHBOURS) : i + NEIGHBOURS + 1]) for i in range(len(windows))]


def window_medians(runs: list[harness.Measurement]) -> list[float]:
    """Per window, the median over the rounds of its smoothed rate."""
    return [statistics.median(rates) for rates in zip(*(smoothed(m["windows"]) for m in runs), strict=False)]


def rounds_of(pipeline: str, rounds: int) -> int:
    """The rounds of `pipeline`: `2 * rounds + 1` for the light one, whose window goals need them."""
    return 2 * rounds + 1 if pipeline == "light" else rounds


def start_ratios(runs: harness.Runs, pipelines: list[str], before: str | None) -> list[harness.Ratio]:
    """The start goals (`SOONER`, `SIDECAR_FIRST_BATCH`) of `pipelines` that ran long enough,
    and with a `before` tree, its start against this one's: the time to the first worker's
    first chunk, and to each batch of `SOONER`, with 2 workers (shown without goals)."""
    ratios = []
    for pipeline in (p for p in SOONER if p in pipelines):
        for backend in BACKENDS:
            none, two = runs[key(pipeline, backend, 0)], runs[key(pipeline, backend, 2)]
            for n, goal in SOONER[pipeline]:
                if to_batch(n) in two[0]:
                    took = harness.median(two, to_batch(n))
                    name = f"{pipeline}, {backend}: none / 2 workers, time to batch {n} ({took:.2f} s with 2 workers)"
                    goal = None if backend != "inprocess" and (pipeline, n) in IN_PROCESS_ONLY else goal
                    ratios.append(harness.ratio_of_medians(name, none, two, to_batch(n), goal))
            if backend == "sidecar":
                name = f"{pipeline}, sidecar, 2 workers: first batch after the Loader was made"
                value = harness.median(two, "first_batch_s")
                ratios.append(harness.Ratio(name, value, harness.Goal.of(SIDECAR_FIRST_BATCH), unit=" s"))
            if before is None:
                continue
            old = runs[key(pipeline, backend, 2) + before]
            olds, news = ([m[FIRST_CHUNK] for m in side if m[FIRST_CHUNK] is not None] for side in (old, two))
            if olds and news:
                name = f"{pipeline}, {backend}, 2 workers: before / now, time to the first worker's first chunk"
                ratios.append(harness.Ratio(name, statistics.median(olds) / statistics.median(news)))
            for n, _ in SOONER[pipeline]:
                if to_batch(n) in two[0]:
                    name = f"{pipeline}, {backend}, 2 workers: before / now, time to batch {n}"
                    ratios.append(harness.ratio_of_medians(name, old, two, to_batch(n)))
    return [r for r in ratios if not math.isnan(r.value)]


def wait_ratios(runs: harness.Runs) -> list[harness.Ratio]:
    """The `wait` pipeline's goals: 16 workers over none, default settings over Grain's
    default iterator (records a second over `WAIT_RATED`), and the default's first batch."""
    rated = f"{WAIT_RATED[0]:g} to {WAIT_RATED[1]:g} s after the loader was made"
    ratios = []
    for backend in BACKENDS:
        sixteen, none = runs[key("wait", backend, 16)], runs[key("wait", backend, 0)]
        name = f"wait, {backend}: 16 workers / none, {rated}"
        ratios.append(harness.ratio_of_medians(name, sixteen, none, RATED, ">= 10"))
    default, grain = runs[key("wait", "inprocess", "default")], runs[key("wait", "grain", "default")]
    name = f"wait: default settings / Grain's default iterator, {rated}"
    ratios.append(harness.ratio_of_medians(name, default, grain, RATED, ">= 1"))
    name = "wait: default settings, first batch after the Loader was made"
    ratios.append(harness.Ratio(name, harness.median(default, "first_batch_s"), harness.Goal.of("<= 0.5"), unit=" s"))
    return ratios


def main() -> None:
    """Run every configuration in interleaved rounds and write the window and steady tables."""
    options = harness.parser(__doc__, rounds=5)
    options.add_argument("--pipelines", default=",".join(PIPELINES), help=f"a subset of {','.join(PIPELINES)}")
    options.add_argument("--before", type=Path, default=None, help="a colo-data tree to compare the start with")
    args = harness.parse(options)
    if args.before:
        harness.compiled(args.before)
    pipelines = [p for p in PIPELINES if p in args.pipelines.split(",")]
    waits = "wait" in pipelines
    pipelines = [p for p in pipelines if p != "wait"]
    pythonpath = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath}
    corpus = Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data")) / "workers-bench"
    retried: list[str] = []
    runs: harness.Runs = {}
    for pipeline in pipelines:
        contenders = {}
        for backend in BACKENDS:
            for workers in (0, 2) if pipeline in SLICED else COUNTS:
                spec = {"pipeline": pipeline, "backend": backend, "workers": workers, "corpus": str(corpus)}
                spec["batches"] = 2 * WINDOW[pipeline] + 1 if args.quick else BATCHES[pipeline]
                contenders[key(pipeline, backend, workers)] = partial(one_run, spec, env)
                if args.before and pipeline in SOONER and workers in (0, 2):
                    contenders[key(pipeline, backend, workers) + BEFORE] = partial(one_run, spec, env, args.before.resolve())
            if pipeline == "light":  # the same as workers=0, for the noise floor of the window ratios
                contenders[key(pipeline, backend, AGAIN)] = contenders[key(pipeline, backend, 0)]
        runs |= harness.interleave(contenders, rounds_of(pipeline, args.rounds), show, retried)
    if waits:
        contenders = {}
        for backend, workers in WAIT_COUNTS:
            spec = {"pipeline": "wait", "backend": backend, "workers": workers, "corpus": str(corpus), "seconds": WAIT_S}
            contenders[key("wait", backend, workers)] = partial(one_run, spec, env)
        runs |= harness.interleave(contenders, args.rounds, show, retried)

    lines = [
        f"Light and CPU-bound pipelines (block shuffle, 64-token pad, batch {BATCH}; CPU-bound packed and filtered ones); "
        f"{', '.join(f'{BATCHES[p]}' for p in pipelines)} batches a run, each in a fresh process; windows of "
        f"{', '.join(f'{WINDOW[p]}' for p in pipelines)} batches after the first; "
        f"medians of {rounds_of('light', args.rounds)} and {args.rounds} interleaved rounds; {os.cpu_count()} CPUs"
        + (f"; {BEFORE.strip()}: colo_data of {args.before}." if args.before else "."),
        "",
        "| configuration | workers used (why) | first batch (s) | first worker's first chunk (s) | steady records/s | "
        "lowest window | first 3 windows |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, side in runs.items():
        medians = window_medians(side)
        chosen = "; ".join(f"{count}: {why}" for count, why in side[-1]["chosen"])
        lines.append(
            f"| {name} | {chosen} | {harness.median(side, 'first_batch_s'):.2f} | {first_chunk(side)} | "
            f"{harness.median(side, STEADY):,.0f} | "
            f"{min(medians, default=math.nan):,.0f} | {', '.join(f'{r:,.0f}' for r in medians[:3])} |"
        )
    ratios = start_ratios(runs, pipelines, BEFORE if args.before else None)
    for pipeline in (p for p in SLICED if p in pipelines):
        none = harness.median(runs[key(pipeline, "inprocess", 0)], STEADY)
        for backend in BACKENDS:
            two = harness.median(runs[key(pipeline, backend, 2)], STEADY)
            peer = "none" if backend == "inprocess" else "in process, none"
            ratios.append(
                harness.Ratio(f"{pipeline}, {backend}: 2 workers / {peer}, steady", two / none, harness.Goal.of(">= 1.5"))
            )
        name = f"{pipeline}, sidecar: 2 workers / sidecar, none, steady (a sidecar with none already computes beside the trainer)"
        two, none = (harness.median(runs[key(pipeline, "sidecar", n)], STEADY) for n in (2, 0))
        ratios.append(harness.Ratio(name, two / none, None))
    for pipeline in (p for p in ("light", "cpu") if p in pipelines):
        for backend in BACKENDS:
            two, none = (window_medians(runs[key(pipeline, backend, n)]) for n in (2, 0))
            per_window = [a / b for a, b in zip(two, none, strict=False)]
            worst = min(range(len(per_window)), key=per_window.__getitem__)
            ratios.append(
                harness.Ratio(
                    f"{pipeline}, {backend}: 2 workers / none, lowest window (window {worst + 1} of {len(per_window)})",
                    per_window[worst],
                    harness.Goal.of(">= 0.9") if pipeline == "light" else None,
                )
            )
            if pipeline == "light":
                again = [a / b for a, b in zip(window_medians(runs[key(pipeline, backend, AGAIN)]), none, strict=False)]
                name = f"{pipeline}, {backend}: none again / none, lowest window (the noise floor of the one above)"
                ratios.append(harness.Ratio(name, min(again), None))
            fixed = {n: harness.median(runs[key(pipeline, backend, n)], STEADY) for n in (0, 1, 2)}
            best = max(fixed, key=fixed.__getitem__)
            auto = runs[key(pipeline, backend, "auto")]
            at_work = sorted({m["chosen"][0][0] for m in auto})  # at the end of each round
            name = f"{pipeline}, {backend}: auto (at work at the end: {at_work}) / the best fixed count ({best}), steady"
            ratios.append(harness.Ratio(name, harness.median(auto, STEADY) / fixed[best], harness.Goal.of(">= 0.9")))
    for backend in BACKENDS if "cpu" in pipelines else ():
        two, none = runs[key("cpu", backend, 2)], runs[key("cpu", backend, 0)]
        name = (
            f"cpu, {backend}: 2 workers / none, the first {EARLY} steps after the first batch "
            f"({harness.median(two, 'first_steps_s'):.2f} s with 2 workers, which had their first batch "
            f"{harness.median(two, 'first_batch_s'):.2f} s after the loader was made)"
        )
        ratios.append(harness.ratio_of_medians(name, two, none, FIRST_STEPS, ">= 1.7"))
    if "cpu" in pipelines:
        ratios.append(
            harness.ratio_within_rounds(
                "cpu: sidecar, 2 workers / in process, none, steady (every round)",
                runs[key("cpu", "sidecar", 2)],
                runs[key("cpu", "inprocess", 0)],
                STEADY,
                ">= 1.85",
            )
        )
    if waits:
        ratios += wait_ratios(runs)
    lines += ["", *harness.ratio_table(ratios)]
    left = [f"{name}: {p}" for name, side in runs.items() for m in side for p in m["left_behind"]]
    lines += ["", "left behind: " + ("; ".join(left) if left else "nothing")]
    harness.write_results("workers", args, lines, runs, ratios, retried, headlines=harness.headlines(ratios, HEADLINES))


if __name__ == "__main__":
    main()
