"""Start-up and workers, side by side in one run: import time, time to the first batch, and
steady throughput with 0, 1 and 2 workers, in process and in a sidecar, each in a fresh
process, for one or more colo-data trees (e.g. the commits before and after a change).

Per tree and round, each in a fresh interpreter of the tree's `.venv`: `import colo_data`
(the statement's wall time and the whole process's), `python -X importtime -c "import
colo_data"` (colo_data's cumulative figure), `colo-data --help` (the process's wall time), and
for two pipelines x {in process, sidecar started by the Loader} x {0, 1, 2} workers (and, for
the light pipeline, in process with 0 and 2 workers, the trainer started with the settings
that worker and sidecar processes get: `SETTINGS_ENV`) one process (benchmarks/startup_child.py) that builds `cd.Loader(pipeline, backend=...,
workers=...)`, takes its first batch, then `WARMUP` batches, then the steady-state batches
whose rate is reported; every batch `jax.block_until_ready`. The warm-up is there because a
sidecar fills its ring (4 slots of up to 32 of these 128 KiB batches) during start-up, so the
batches just after the first one arrive without being made. Pipelines: `light`, the demo
pipeline (core.py's pipeline 1: block shuffle, pad to 1024, batch 32); `cpu`, the same with
a CPU-bound per-record Python function before the pad (startup_child.token_passes: core.py's
per-record function costs a few microseconds, about what the pad does, so workers cannot pay
there). Configurations and trees are interleaved within each round and medians reported;
ratios are taken within each round (both sides measured minutes apart at most) and shown
for every round. Run: `.venv/bin/python benchmarks/startup.py [--tree NAME=PATH ...]
[--rounds N] [--quick] [--out DIR]`; each PATH is a colo-data checkout with its own `.venv`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
from core import BATCH, SEQ_LEN  # the core benchmark's demo pipeline settings

from colo_data.runtime.child_env import process_settings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = "import json, sys, startup_child; startup_child.main(json.loads(sys.argv[1]))"
IMPORT = "import time; t = time.perf_counter(); import colo_data; print(time.perf_counter() - t)"
CHILD_TIMEOUT_S = 300
LEFT_GRACE_S = 10.0  # a sidecar notices that its trainer is gone within a second or two
PIPELINES = ("light", "cpu")
WARMUP = 160  # batches: more than a sidecar ring holds (4 slots of 32 of these batches)
BATCHES = {"light": 800, "cpu": 480}  # the steady state: 25,600 and 15,360 records (an epoch is 1,250 batches)
QUICK_WARMUP, QUICK_BATCHES = 2, 5
LOADERS = [(backend, workers) for backend in ("inprocess", "sidecar") for workers in (0, 1, 2)]
# In process, with the trainer started with the settings that worker and sidecar processes get
# (colo_data.runtime.child_env): how much of the workers' gain those settings are.
SETTINGS = "inprocess, trainer with the process settings"
SETTINGS_ENV = process_settings()
CONFIGS = [(p, b, w) for p in PIPELINES for b, w in LOADERS] + [("light", SETTINGS, 0), ("light", SETTINGS, 2)]
# (what, numerator, denominator, goal): ratios of steady records/s, from the issue
RATIOS = [
    ("cpu: sidecar, 2 workers / in process, 0 workers", ("cpu", "sidecar", 2), ("cpu", "inprocess", 0), ">= 1.7"),
    ("light: in process, 2 workers / 0 workers", ("light", "inprocess", 2), ("light", "inprocess", 0), ">= 0.9"),
    ("light: sidecar, 2 workers / 0 workers", ("light", "sidecar", 2), ("light", "sidecar", 0), ">= 0.9"),
    (f"light: {SETTINGS}, 2 workers / 0 workers", ("light", SETTINGS, 2), ("light", SETTINGS, 0), None),
]
FIRST_BATCH_GOAL = (("light", "sidecar", 2), "<= 1.5")  # seconds from cd.Loader(...)

Run = dict[str, Any]


def key(pipeline: str, backend: str, workers: int) -> str:
    """The name of one configuration."""
    return f"{pipeline}, {backend}, {workers} workers"


def session_processes(sid: int) -> list[psutil.Process]:
    """The processes of session `sid`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


def stop_session(sid: int, grace: float) -> list[str]:
    """Processes of a child's session still alive `grace` seconds after the child ended
    (its sidecar, workers): 'pid cmdline' of each, then killed."""
    deadline = time.monotonic() + grace
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    said = []
    for proc in left:
        try:
            said.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.Error:
            pass
    return said


def run(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str, str, list[str]]:
    """Run `command` in `cwd` (the tree: `python -c` imports from the working directory
    first), in a session of its own; returns the time.monotonic() readings at its start and
    end, its stdout and stderr, and the processes it left behind. Raises RuntimeError when it
    fails."""
    started = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True, cwd=cwd)
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
    ended = time.monotonic()
    left = stop_session(child.pid, LEFT_GRACE_S)
    if child.returncode:
        at = err.rfind("Traceback")
        why = err[at:] if at >= 0 else err[-3000:]
        raise RuntimeError(f"{' '.join(command)[:300]} failed (exit {child.returncode}):\n{why[-4000:]}")
    return started, ended, out, err, left


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

    def loader(self, pipeline: str, backend: str, workers: int, quick: bool) -> Run:
        """One fresh process: start-up, first batch and steady rate of one configuration."""
        env = {**self.env, **SETTINGS_ENV} if backend == SETTINGS else self.env
        backend = "inprocess" if backend == SETTINGS else backend
        spec: dict[str, Any] = {"pipeline": pipeline, "backend": backend, "workers": workers, "seq_len": SEQ_LEN}
        spec |= {"batch": BATCH, "warmup": QUICK_WARMUP if quick else WARMUP}
        spec["batches"] = QUICK_BATCHES if quick else BATCHES[pipeline]
        start, end, out, _, left = run([str(self.python), "-c", CHILD, json.dumps(spec)], env, self.path)
        t = json.loads(out.strip().splitlines()[-1])
        return {
            "first_batch_from_start_s": t["first_at"] - start,
            "first_batch_from_loader_s": t["first_at"] - t["loader_at"],
            "records_per_s": spec["batches"] * BATCH / (t["end_at"] - t["steady_at"]),
            "close_s": t["closed_at"] - t["end_at"],
            "process_s": end - start,
            "worker_processes": t["worker_processes"],
            "left_behind": left,
        }


def values(runs: list[Run], field: str) -> list[float]:
    """`field` of every round."""
    return [float(r[field]) for r in runs]


def span(xs: list[float], fmt: str) -> str:
    """'min..max' of `xs`."""
    return f"{min(xs):{fmt}}..{max(xs):{fmt}}"


def verdict(xs: list[float], goal: str) -> str:
    """Whether the median meets `goal` ('>= 1.7', '<= 1.5'), and in how many rounds each did."""
    op, bound = goal.split()

    def meets(x: float) -> bool:
        return x >= float(bound) if op == ">=" else x <= float(bound)

    return f"{'yes' if meets(statistics.median(xs)) else '**no**'} ({sum(map(meets, xs))}/{len(xs)} rounds)"


def render(tree: Tree, imports: list[dict[str, Any]], runs: dict[str, list[Run]]) -> tuple[list[str], dict[str, Any]]:
    """One tree's Markdown tables and its ratios (medians and every round's value)."""
    lines = [
        "", f"### {tree.name}: {tree.label} ({tree.path})", "",
        "| start-up, fresh process | median s | all rounds s |", "| --- | ---: | ---: |",
    ]
    for field, what in (
        ("import_s", "`import colo_data` (the statement)"),
        ("import_process_s", '`python -c "import colo_data"` (whole process)'),
        ("importtime_s", "`python -X importtime`: colo_data cumulative"),
        ("help_process_s", "`colo-data --help` (whole process)"),
    ):
        xs = values(imports, field)
        lines.append(f"| {what} | {statistics.median(xs):.2f} | {span(xs, '.2f')} |")
    lines += [
        "",
        "| pipeline | backend | workers | worker processes seen | first batch from process start s "
        "| first batch from `cd.Loader(...)` s | close s | steady records/s | all rounds records/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pipeline, backend, workers in CONFIGS:
        rs = runs[key(pipeline, backend, workers)]
        m = {field: statistics.median(values(rs, field)) for field in rs[0] if field != "left_behind"}
        lines.append(
            f"| {pipeline} | {backend} | {workers} | {m['worker_processes']:.0f} "
            f"| {m['first_batch_from_start_s']:.2f} | {m['first_batch_from_loader_s']:.2f} | {m['close_s']:.2f} "
            f"| {m['records_per_s']:,.0f} | {span(values(rs, 'records_per_s'), ',.0f')} |"
        )
    lines += ["", "| goal | median | all rounds | met (median) |", "| --- | ---: | ---: | --- |"]
    ratios: dict[str, Any] = {}
    for what, a, b, goal in RATIOS:
        pairs = zip(values(runs[key(*a)], "records_per_s"), values(runs[key(*b)], "records_per_s"), strict=True)
        xs = [x / y for x, y in pairs]
        ratios[what] = {"rounds": xs, "median": statistics.median(xs), "goal": goal}
        median = statistics.median(xs)
        if goal is None:
            lines.append(f"| {what} (steady records/s; no goal) | {median:.2f}x | {span(xs, '.2f')} | - |")
            continue
        lines.append(f"| {what} (steady records/s, {goal}x) | {median:.2f}x | {span(xs, '.2f')} | {verdict(xs, goal)} |")
    config, goal = FIRST_BATCH_GOAL
    xs = values(runs[key(*config)], "first_batch_from_loader_s")
    what = f"{key(*config)}: first batch from `cd.Loader(...)`"
    ratios[what] = {"rounds": xs, "median": statistics.median(xs), "goal": goal}
    lines.append(f"| {what} ({goal} s) | {statistics.median(xs):.2f} s | {span(xs, '.2f')} | {verdict(xs, goal)} |")
    left = [p for rs in runs.values() for r in rs for p in r["left_behind"]]
    lines += ["", f"Processes left behind after their trainer exited (killed by the benchmark): {left or 'none'}."]
    return lines, ratios


def main() -> None:
    """Measure every tree, round by round, and write startup.md and startup.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree", action="append", metavar="NAME=PATH", help="a colo-data checkout with a .venv (repeatable; default: this one)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=f"1 round, {QUICK_BATCHES} steady batches: a smoke run")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    trees = []
    for spec in args.tree or [f"this tree={ROOT}"]:
        name, _, path = spec.partition("=")
        if not path:
            parser.error(f"--tree {spec}: give NAME=PATH, e.g. before=../colo-data-old")
        trees.append(Tree(name, Path(path)))
    started = time.perf_counter()
    imports: dict[str, list[dict[str, Any]]] = {t.name: [] for t in trees}
    runs: dict[str, dict[str, list[Run]]] = {t.name: {key(*c): [] for c in CONFIGS} for t in trees}
    failures: list[str] = []
    for r in range(rounds):
        for tree in trees:
            imports[tree.name].append(tree.imports())
            print(f"round {r + 1}/{rounds}  {tree.name}: {imports[tree.name][-1]}", flush=True)
        for config in CONFIGS:
            for tree in trees:
                tag = f"round {r + 1}/{rounds}  {tree.name}  {key(*config)}"
                try:
                    m = tree.loader(*config, args.quick)
                except RuntimeError as e:  # once: report it and try again
                    failures.append(f"{tag}: {e}")
                    print(f"{tag} failed, retrying once:\n{e}", flush=True)
                    m = tree.loader(*config, args.quick)
                runs[tree.name][key(*config)].append(m)
                print(
                    f"{tag}: first batch {m['first_batch_from_start_s']:.2f} s from start, "
                    f"{m['first_batch_from_loader_s']:.2f} s from Loader; {m['records_per_s']:,.0f} records/s; "
                    f"close {m['close_s']:.2f} s",
                    flush=True,
                )
    wall = time.perf_counter() - started
    steady = f"{QUICK_BATCHES}" if args.quick else f"{BATCHES['light']} (light) / {BATCHES['cpu']} (cpu)"
    lines = [
        (
            f"Start-up and workers: median of {rounds} interleaved round(s); {psutil.cpu_count()} CPUs, shared with "
            "other agents running tests at the same time, so single figures are noisy: read the medians and the "
            f"ranges. Run took {wall:.0f} s. `light`: the demo pipeline (block shuffle, pad to {SEQ_LEN}, batch "
            f"{BATCH}); `cpu`: the same with a CPU-bound per-record Python function before the pad "
            "(benchmarks/startup_child.py `token_passes`). Steady records/s: "
            f"{steady} batches after the first batch and a warm-up of {QUICK_WARMUP if args.quick else WARMUP} "
            "batches. 'worker processes seen': spawned processes among the trainer's descendants (its sidecar's "
            "too) before it closed the loader. Each goal's ratio is taken within each round."
        ),
    ]
    goals = {}
    for tree in trees:
        tree_lines, goals[tree.name] = render(tree, imports[tree.name], runs[tree.name])
        lines += tree_lines
    if args.quick:
        lines += ["", "A --quick run: a smoke run of the machinery; its figures and verdicts measure nothing."]
    if failures:
        lines += ["", f"Failed and retried once: {len(failures)} run(s); see startup.json `failures_retried`."]
    table = "\n".join(lines)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.md").write_text(table + "\n")
    trees_json = {
        t.name: {"path": str(t.path), "label": t.label, "imports": imports[t.name], "runs": runs[t.name], "goals": goals[t.name]}
        for t in trees
    }
    result = {"rounds": rounds, "wall_s": wall, "quick": args.quick, "trees": trees_json, "failures_retried": failures}
    (args.out / "startup.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'startup.md'} and {args.out / 'startup.json'}")


if __name__ == "__main__":
    main()
