"""Start-up and workers, side by side in one run: import time, time to the first batch, and
steady throughput with 0, 1 and 2 workers, in process and in a sidecar, each in a fresh
process, for one or more colo-data trees (e.g. the commits before and after a change).

Per tree and round, each in a fresh interpreter of the tree's `.venv`: `import colo_data`
(the statement's wall time and the whole process's), `python -X importtime -c "import
colo_data"` (colo_data's cumulative figure), `colo-data --help` (the process's wall time), and
for two pipelines x {in process, sidecar started by the Loader} x {0, 1, 2} workers (and, for
the light pipeline, in process with 0 and 2 workers, the trainer started with the settings
that worker and sidecar processes get: `SETTINGS_ENV`) one process (benchmarks/startup_child.py)
that builds `cd.Loader(pipeline, backend=..., workers=...)`, takes its first batch, then
`WARMUP` batches, then the steady-state batches whose rate is reported; every batch
`jax.block_until_ready`. The warm-up is there because a sidecar fills its ring (4 slots of up
to 32 of these 128 KiB batches) during start-up, so the batches just after the first one
arrive without being made. Pipelines: `light`, the demo
pipeline (core.py's pipeline 1: block shuffle, pad to 1024, batch 32); `cpu`, the same with
a CPU-bound per-record Python function before the pad (workers_pipeline.token_passes: core.py's
per-record function costs a few microseconds, about what the pad does, so workers cannot pay
there). The steady rates here cover about a second after the start, before a host pipeline
has taken its workers on; benchmarks/workers.py measures what workers give, over longer runs.
Configurations and trees are interleaved within each round and medians reported;
ratios are taken within each round (both sides measured minutes apart at most) and shown
for every round. Run: `.venv/bin/python benchmarks/startup.py [--tree NAME=PATH ...]
[--rounds N] [--quick] [--out DIR]`; each PATH is a colo-data checkout with its own `.venv`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import harness
import psutil
from children import run
from demo_pad import BATCH, SEQ_LEN

from colo_data.runtime.child_env import process_settings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = "import json, sys, startup_child; startup_child.main(json.loads(sys.argv[1]))"
IMPORT = "import time; t = time.perf_counter(); import colo_data; print(time.perf_counter() - t)"
PIPELINES = ("light", "cpu")
WARMUP = 160  # batches: more than a sidecar ring holds (4 slots of 32 of these batches)
BATCHES = {"light": 800, "cpu": 480}  # the steady state: 25,600 and 15,360 records (an epoch is 1,250 batches)
QUICK_WARMUP = 2  # --quick: batches of warm-up (then harness.QUICK_BATCHES steady ones)
LOADERS = [(backend, workers) for backend in ("inprocess", "sidecar") for workers in (0, 1, 2)]
# In process, with the trainer started with the settings that worker and sidecar processes get
# (colo_data.runtime.child_env): how much of the workers' gain those settings are.
SETTINGS = "inprocess, trainer with the process settings"
SETTINGS_ENV = process_settings()
CONFIGS = [(p, b, w) for p in PIPELINES for b, w in LOADERS] + [("light", SETTINGS, 0), ("light", SETTINGS, 2)]
# (what, numerator, denominator, goal): ratios of steady records/s. The goals on what workers
# give are benchmarks/workers.py's: its runs last long enough for a host pipeline to take its
# workers on (it decides every half second whether they pay); these runs last about a second.
RATIOS = [
    (f"light: {SETTINGS}, 2 workers / 0 workers", ("light", SETTINGS, 2), ("light", SETTINGS, 0), None),
]
FIRST_BATCH_GOAL = (("light", "sidecar", 2), "<= 1.5")  # seconds from cd.Loader(...)
STEADY = "steady_records_per_s"  # after the first batch and the warm-up


def key(pipeline: str, backend: str, workers: int) -> str:
    """The name of one configuration."""
    return f"{pipeline}, {backend}, {workers} workers"


class Tree:
    """A colo-data checkout with its own `.venv`, measured by fresh processes of that venv."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path.resolve()
        self.python = self.path / ".venv" / "bin" / "python"
        if not self.python.exists():
            raise SystemExit(f"--tree {name}={path}: no {self.python}; make the tree's venv first (make test there)")

        def git(*command: str) -> str:
            return subprocess.run(["git", "-C", str(self.path), *command], check=True, capture_output=True, text=True).stdout

        changed = git("status", "--porcelain", "--untracked-files=no").strip()
        self.label = f"commit {git('rev-parse', '--short', 'HEAD').strip()}" + (" with uncommitted changes" if changed else "")
        pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath}

    def imports(self) -> dict[str, Any]:
        """`import colo_data` (statement and process), its -X importtime figure, `colo-data --help`."""
        start, end, out, _, _ = run([str(self.python), "-c", IMPORT], self.env, self.path)
        result: dict[str, Any] = {"import_s": float(out.strip()), "import_process_s": end - start}
        _, _, _, err, _ = run([str(self.python), "-X", "importtime", "-c", "import colo_data"], self.env, self.path)
        rows = [line.split("|") for line in err.splitlines() if line.startswith("import time:")]
        result["importtime_s"] = next(int(r[1]) for r in rows if r[2].strip() == "colo_data") / 1e6
        start, end, _, _, _ = run([str(self.python.parent / "colo-data"), "--help"], self.env, self.path)
        result["help_process_s"] = end - start
        return result

    def loader(self, pipeline: str, backend: str, workers: int, batches: int | None) -> harness.Measurement:
        """One fresh process: start-up, first batch and steady rate of one configuration (with
        `batches`, a --quick run's: its warm-up and steady state cut short)."""
        env = {**self.env, **SETTINGS_ENV} if backend == SETTINGS else self.env
        backend = "inprocess" if backend == SETTINGS else backend
        spec: dict[str, Any] = {"pipeline": pipeline, "backend": backend, "workers": workers, "seq_len": SEQ_LEN}
        spec |= {"batch": BATCH, "warmup": QUICK_WARMUP if batches else WARMUP}
        spec["batches"] = batches or BATCHES[pipeline]
        start, end, out, _, left = run([str(self.python), "-c", CHILD, json.dumps(spec)], env, self.path)
        t = json.loads(out.strip().splitlines()[-1])
        return {
            "first_batch_from_start_s": t["first_at"] - start,
            "first_batch_from_loader_s": t["first_at"] - t["loader_at"],
            STEADY: spec["batches"] * BATCH / (t["end_at"] - t["steady_at"]),
            "close_s": t["closed_at"] - t["end_at"],
            "process_s": end - start,
            "worker_processes": t["worker_processes"],
            "left_behind": left,
        }


def imports_name(tree: Tree) -> str:
    """The contender that measures `tree`'s start-up."""
    return f"{tree.name}: imports"


def loader_name(tree: Tree, config: tuple[str, str, int]) -> str:
    """The contender that measures one configuration of `tree`."""
    return f"{tree.name}: {key(*config)}"


def show(m: harness.Measurement) -> str:
    """A progress line: a configuration's first batch, steady rate and close, or the imports."""
    if STEADY not in m:
        return ", ".join(f"{field} {value:.2f}" for field, value in m.items())
    return (
        f"first batch {m['first_batch_from_start_s']:.2f} s from start, {m['first_batch_from_loader_s']:.2f} s from Loader; "
        f"{m[STEADY]:,.0f} records/s; close {m['close_s']:.2f} s"
    )


def render(tree: Tree, runs: harness.Runs) -> tuple[list[str], list[harness.Ratio]]:
    """One tree's Markdown tables and its goals (ratios taken within each round)."""
    imports = runs[imports_name(tree)]
    lines = [
        "",
        f"### {tree.name}: {tree.label} ({tree.path})",
        "",
        "| start-up, fresh process | median s | all rounds s |",
        "| --- | ---: | ---: |",
    ]
    for field, what in (
        ("import_s", "`import colo_data` (the statement)"),
        ("import_process_s", '`python -c "import colo_data"` (whole process)'),
        ("importtime_s", "`python -X importtime`: colo_data cumulative"),
        ("help_process_s", "`colo-data --help` (whole process)"),
    ):
        xs = harness.values(imports, field)
        lines.append(f"| {what} | {statistics.median(xs):.2f} | {harness.span(xs, '.2f')} |")
    lines += [
        "",
        "| pipeline | backend | workers | worker processes seen | first batch from process start s "
        "| first batch from `cd.Loader(...)` s | close s | steady records/s | all rounds records/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config in CONFIGS:
        rs = runs[loader_name(tree, config)]
        m = {field: harness.median(rs, field) for field in rs[0] if field != "left_behind"}
        lines.append(
            f"| {' | '.join(map(str, config))} | {m['worker_processes']:.0f} "
            f"| {m['first_batch_from_start_s']:.2f} | {m['first_batch_from_loader_s']:.2f} | {m['close_s']:.2f} "
            f"| {m[STEADY]:,.0f} | {harness.span(harness.values(rs, STEADY), ',.0f')} |"
        )
    ratios = [
        harness.ratio_within_rounds(
            f"{what} (steady records/s)", runs[loader_name(tree, a)], runs[loader_name(tree, b)], STEADY, goal
        )
        for what, a, b, goal in RATIOS
    ]
    config, goal = FIRST_BATCH_GOAL
    xs = harness.values(runs[loader_name(tree, config)], "first_batch_from_loader_s")
    what = f"{key(*config)}: first batch from `cd.Loader(...)`"
    ratios.append(harness.Ratio(what, statistics.median(xs), harness.Goal.of(goal), tuple(xs), " s"))
    lines += ["", *harness.ratio_table(ratios)]
    left = [p for config in CONFIGS for r in runs[loader_name(tree, config)] for p in r["left_behind"]]
    lines += ["", f"Processes left behind after their trainer exited (killed by the benchmark): {left or 'none'}."]
    return lines, ratios


def main() -> None:
    """Measure every tree, round by round; startup.md and startup.json."""
    options = harness.parser(__doc__)
    options.add_argument(
        "--tree", action="append", metavar="NAME=PATH", help="a colo-data checkout with a .venv (repeatable; default: this one)"
    )
    args = harness.parse(options)
    trees = []
    for spec in args.tree or [f"this tree={ROOT}"]:
        name, _, path = spec.partition("=")
        if not path:
            options.error(f"--tree {spec}: give NAME=PATH, e.g. before=../colo-data-old")
        trees.append(Tree(name, Path(path)))
    contenders: dict[str, Callable[[], harness.Measurement]] = {imports_name(tree): tree.imports for tree in trees}
    for config in CONFIGS:
        for tree in trees:
            contenders[loader_name(tree, config)] = partial(tree.loader, *config, args.batches)
    retried: list[str] = []
    runs = harness.interleave(contenders, args.rounds, show, retried)

    steady = f"{args.batches}" if args.quick else f"{BATCHES['light']} (light) / {BATCHES['cpu']} (cpu)"
    lines = [
        (
            f"Start-up and workers: median of {args.rounds} interleaved round(s); {psutil.cpu_count()} CPUs, shared with "
            "other agents running tests at the same time, so single figures are noisy: read the medians and the "
            f"ranges. Run took {harness.elapsed(args):.0f} s. `light`: the demo pipeline (block shuffle, pad to {SEQ_LEN}, "
            f"batch {BATCH}); `cpu`: the same with a CPU-bound per-record Python function before the pad "
            "(benchmarks/startup_child.py `token_passes`). Steady records/s: "
            f"{steady} batches after the first batch and a warm-up of {QUICK_WARMUP if args.quick else WARMUP} "
            "batches. 'worker processes seen': spawned processes among the trainer's descendants (its sidecar's "
            "too) before it closed the loader. Each goal's ratio is taken within each round."
        ),
    ]
    ratios: list[harness.Ratio] = []
    for tree in trees:
        tree_lines, tree_ratios = render(tree, runs)
        lines += tree_lines
        ratios += [dataclasses.replace(r, name=f"{tree.name}: {r.name}") for r in tree_ratios]
    details = {"trees": {t.name: {"path": str(t.path), "label": t.label} for t in trees}}
    headlines = [] if args.tree else start_up_headlines(trees[0], runs, ratios)  # another tree's figures are not ours
    harness.write_results("startup", args, lines, runs, ratios, retried, details, headlines)


def start_up_headlines(tree: Tree, runs: harness.Runs, ratios: list[harness.Ratio]) -> list[harness.Headline]:
    """The performance page's figures: the import, and the first batch in process and through a sidecar."""
    first = harness.median(runs[loader_name(tree, ("light", "inprocess", 0))], "first_batch_from_loader_s")
    return [
        harness.Headline("`import colo_data`", harness.median(runs[imports_name(tree)], "import_s"), "s"),
        harness.Headline("first batch from `cd.Loader(...)`, demo pipeline, in process", first, "s"),
        *harness.headlines(
            ratios, [(f"{tree.name}: light, sidecar, 2 workers: first batch", "the same through a sidecar, 2 workers", "")]
        ),
    ]


if __name__ == "__main__":
    main()
