"""Ray workers (`cd.RayWorkers`) against the host alone and against local worker processes,
side by side in one run, each contender in a fresh process, interleaved rounds.

A Ray cluster (`ray start --head`, one node) runs on CPU 1 of the machine (`taskset -c 1`: its
raylet, GCS and actors), at nice 19 as colo-data's worker processes run (on this machine
it shares the CPUs with the trainer; on a real cluster it has machines of its own), started
once for the run and stopped at its end. Contenders:

- `cpu` (benchmarks/startup.py's: the demo pipeline with a CPU-bound per-record Python
  function before the pad), the trainer and its host pipeline pinned to CPU 0
  (`taskset -c 0`), no workers: the host alone, on its one CPU;
- `cpu`, the same trainer on CPU 0 with one Ray actor (on CPU 1);
- `light` (benchmarks/workers.py's: small uneven row groups, a 64-token pad, batch 32), the
  trainer on both CPUs with one local worker process;
- `light`, the same with one Ray actor instead.

Each run reads `BATCHES` batches (every one `jax.block_until_ready`); its rate is that of the
second half (the steady state: the pool is taken on within the first second or two).
Goals: `cpu`, Ray / host alone at least 1.6x (an actor on the other CPU: the ideal is 2.0x);
`light`, Ray / local workers of the same count at least 0.8x (the cost of the object store).

Run: `.venv/bin/python benchmarks/ray.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import harness
from children import run
from demo_pad import BATCH

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RAY = str(Path(sys.executable).parent / "ray")
# This folder goes last on the child's path: its ray.py (this file) must not stand for the ray package.
CHILD = f"import json, sys; sys.path.append({str(HERE)!r}); import ray_child; ray_child.main(json.loads(sys.argv[1]))"
BATCHES = {"cpu": 1600, "light": 8000}  # 4 to 8 s each; the second half is the steady state
STEADY = "steady_records_per_s"
# the performance page's figures: (the start of a ratio's name, what, peer)
HEADLINES = (
    ("cpu: host + 1 Ray actor / host alone", "CPU-bound pipeline, host on 1 CPU + 1 Ray actor", "the host alone"),
    ("light: 1 Ray actor / 1 local worker", "light pipeline, 1 Ray actor", "1 local worker process"),
)
CPU_ALONE, CPU_RAY = "cpu, host alone on CPU 0", "cpu, host on CPU 0 + 1 Ray actor on CPU 1"
LIGHT_LOCAL, LIGHT_RAY = "light, 1 local worker process", "light, 1 Ray actor on CPU 1"


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(env: dict[str, str]) -> str:
    """`ray start --head` on CPU 1 (one logical CPU); its address: "auto", this machine's
    cluster (a driver given the GCS's host:port needs the cluster's auth token as well)."""
    port = free_port()
    command = ["taskset", "-c", "1", "nice", "-n", "19", RAY, "start", "--head", f"--port={port}", "--num-cpus=1"]
    command.append("--include-dashboard=false")
    started = subprocess.run(command, env=env, check=False, capture_output=True, text=True, timeout=120)
    if started.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{started.stdout[-2000:]}\n{started.stderr[-3000:]}")
    return "auto"


def stop_cluster(env: dict[str, str]) -> None:
    """`ray stop --force`: every process of the cluster."""
    subprocess.run([RAY, "stop", "--force"], env=env, check=False, capture_output=True, timeout=120)


def one_run(spec: dict[str, Any], cpus: str | None, env: dict[str, str]) -> harness.Measurement:
    """One contender in a fresh process (pinned to `cpus` if given): its steady rate and first batch."""
    command = [sys.executable, "-c", CHILD, json.dumps(spec)]
    _, _, out, _, left = run(["taskset", "-c", cpus, *command] if cpus else command, env, ROOT)
    got = json.loads(out.strip().splitlines()[-1])
    arrived = got["arrived"]
    half = len(arrived) // 2
    return {
        STEADY: (len(arrived) - 1 - half) * BATCH / (arrived[-1] - arrived[half]),
        "first_batch_s": arrived[0] - got["made"],
        "pool_records": got["pool_records"],
        "records": len(arrived) * BATCH,
        "left_behind": left,
    }


def show(m: harness.Measurement) -> str:
    """A progress line."""
    share = m["pool_records"] / m["records"]
    return f"first batch {m['first_batch_s']:.2f} s; steady {m[STEADY]:,.0f} records/s; pool made {share:.0%} of the records"


def main() -> None:
    """Start the cluster, run the contenders in interleaved rounds, stop it, write the tables."""
    options = harness.parser(__doc__, rounds=3)
    args = harness.parse(options)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("benchmarks/ray.py needs 2 CPUs: the trainer on one, the Ray cluster on the other")
    corpus = Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data")) / "workers-bench"
    address = start_cluster(env)
    try:
        ray = {"ray": address, "actors": 1}
        contenders = {}
        for name, kind, workers, cpus in [
            (CPU_ALONE, "cpu", 0, "0"),
            (CPU_RAY, "cpu", ray, "0"),
            (LIGHT_LOCAL, "light", 1, None),
            (LIGHT_RAY, "light", ray, None),
        ]:
            spec = {"pipeline": kind, "workers": workers, "batches": 200 if args.quick else BATCHES[kind], "corpus": str(corpus)}
            contenders[name] = partial(one_run, spec, cpus, env)
        retried: list[str] = []
        runs = harness.interleave(contenders, args.rounds, show, retried)
    finally:
        stop_cluster(env)
    lines = [
        f"cpu: startup.py's (demo corpus, pad to 1024, batch 32); light: workers.py's (pad to 64, batch 32); "
        f"a Ray cluster of one node on CPU 1 at nice 19; "
        f"steady = the second half of {BATCHES['cpu']} (cpu) and {BATCHES['light']} (light) batches; medians of "
        f"{args.rounds} interleaved rounds; {os.cpu_count()} CPUs.",
        "",
        "| configuration | first batch (s) | steady records/s | records made by the pool |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, side in runs.items():
        share = sum(m["pool_records"] for m in side) / sum(m["records"] for m in side)
        first, steady = harness.median(side, "first_batch_s"), harness.median(side, STEADY)
        lines.append(f"| {name} | {first:.2f} | {steady:,.0f} | {share:.0%} |")
    ratios = [
        harness.ratio_within_rounds("cpu: host + 1 Ray actor / host alone", runs[CPU_RAY], runs[CPU_ALONE], STEADY, ">= 1.6"),
        harness.ratio_within_rounds("light: 1 Ray actor / 1 local worker", runs[LIGHT_RAY], runs[LIGHT_LOCAL], STEADY, ">= 0.8"),
    ]
    lines += ["", *harness.ratio_table(ratios)]
    left = [f"{name}: {p}" for name, side in runs.items() for m in side for p in m["left_behind"]]
    lines += ["", "left behind: " + ("; ".join(left) if left else "nothing")]
    headlines = harness.headlines(ratios, HEADLINES)
    harness.write_results("ray", args, lines, runs, ratios, retried, {"ray_address": address}, headlines)


if __name__ == "__main__":
    main()
