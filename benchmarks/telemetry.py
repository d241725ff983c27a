"""What telemetry costs on the demo pipeline (goal: under 2% of throughput), measured three ways.

1. Cost accounting (the precise number). Telemetry is always on; its work is a fixed set of
   operations per batch, per chunk and per slot (perf_counter pairs, `LoaderMeters.step`,
   `StageTimes.add`, byte counts, a CPU-meter check, the counters a slot announcement
   carries). Each operation is timed here in a tight loop (best of 5 repeats), multiplied
   by how often the demo pipeline does it, and divided by the time per batch measured in
   part 2. The sum over all threads is an upper bound of the direct cost.
2. Paired end-to-end runs in one process (the indirect costs too: caches, the GIL shared
   by the loader's threads). Epochs of the demo pipeline through `cd.Loader` (in process,
   0 workers, no training step: where telemetry's share is largest) alternate between `on`
   and `stubbed`: the same code with the timing calls and counters replaced by no-ops (the
   byte counts stay). Each pair gives a ratio of records/s and one of CPU seconds per
   record (the process's CPU time: less disturbed by other tenants than wall time); the
   mean ratios and their 95% intervals are reported. Pairs cancel most of a shared
   machine's drift, single runs do not.
3. With `--ref REV`: separate processes running one epoch with this tree and with the
   package at git revision REV, in process and with the sidecar, medians: the total change
   against REV (before telemetry, REV also lacks the loader's chunk-ahead thread).

Run: `.venv/bin/python benchmarks/telemetry.py [--pairs 20] [--ref HEAD --rounds 5] [--quick] [--out DIR]`
(`--quick`: 2 pairs, 1 round).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import timeit
from collections.abc import Callable
from functools import partial
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import harness
from demo_pad import BATCH, SEQ_LEN

ROOT = Path(__file__).resolve().parents[1]
QUICK_PAIRS = 2  # --quick: the fewest pairs that give an interval
BACKENDS = ("inprocess", "sidecar")  # part 3

PATCH = r"""
from colo_data.telemetry import counters as telemetry
from colo_data.host import chunk_work, packing
from colo_data.loader import loader
noop = lambda *a, **k: None
STUBS = [(telemetry.StepClock, "record", noop), (telemetry.StageTimes, "add", noop), (telemetry.StageTimes, "merge", noop),
         (telemetry.CpuMeter, "maybe_sample", noop), (telemetry.CpuMeter, "take", noop),
         (chunk_work, "perf_counter", int), (loader, "perf_counter", int), (packing, "perf_counter", int)]
ORIGINALS = [(owner, name, getattr(owner, name)) for owner, name, _ in STUBS]

def stubbed(yes):
    for owner, name, value in STUBS if yes else ORIGINALS:
        setattr(owner, name, value)
"""

EPOCH = (
    f"SEQ_LEN, BATCH = {SEQ_LEN}, {BATCH}\n"
    + r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from absl import flags
flags.FLAGS.mark_as_parsed()
import jax, numpy as np
import colo_data as cd
from colo_data import demo
jax.block_until_ready(jax.device_put(np.zeros(1)))

def epoch(backend):
    pipeline = demo.pipeline(demo.corpus(), seq_len=SEQ_LEN, global_batch_size=BATCH)
    records, first = 0, None
    t0 = time.perf_counter()
    with cd.Loader(pipeline, backend=backend) as loader:
        for batch in loader:
            jax.block_until_ready(batch)
            records += len(batch["tokens"])
            if first is None:
                first, first_records, cpu0 = time.perf_counter(), records, time.process_time()
        end, cpu = time.perf_counter(), time.process_time() - cpu0
    return {"records_per_s": records / (end - t0), "after_first_per_s": (records - first_records) / (end - first),
            "first_batch_s": first - t0, "cpu_s_per_1k": 1000 * cpu / (records - first_records)}
"""
)

PAIRS = (
    EPOCH
    + PATCH
    + r"""
out = {"on": [], "stubbed": [], "on_cpu": [], "stubbed_cpu": []}
for i in range(int(sys.argv[1])):
    for variant in ("on", "stubbed") if i % 2 == 0 else ("stubbed", "on"):
        stubbed(variant == "stubbed")
        result = epoch("inprocess")
        out[variant].append(result["after_first_per_s"])
        out[variant + "_cpu"].append(result["cpu_s_per_1k"])
print(json.dumps(out))
"""
)

ONE = (
    EPOCH
    + r"""
print(json.dumps({**epoch(sys.argv[1]), "package": cd.__file__}))
"""
)


def best(stmt: str, number: int, setup_globals: dict[str, Any]) -> float:
    """Seconds per call of `stmt`: the best of 5 repeats of `number` calls."""
    return min(timeit.repeat(stmt, number=number, repeat=5, globals=setup_globals)) / number


def cost_accounting() -> dict[str, float]:
    """Seconds per call of every telemetry operation, on real objects of the demo pipeline."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    import numpy as np

    from colo_data import demo
    from colo_data.host.host_pipeline import HostPipeline
    from colo_data.io.columns import table_to_columns
    from colo_data.loader.meters import LoaderMeters
    from colo_data.runtime.lifecycle import Lifecycle
    from colo_data.runtime.prefetch import Prefetcher
    from colo_data.telemetry.counters import READ, CpuMeter, StageTimes, StepClock, metered

    pipeline = demo.pipeline(demo.corpus(), seq_len=SEQ_LEN, global_batch_size=BATCH)
    host = HostPipeline(pipeline)
    indices = host.indices_at(host.work.positions(0, host.chunk))
    table = pipeline.source.take(indices)
    chunk = host.work.compute(0, host.chunk).columns
    clock, stages, meter = StepClock(3), StageTimes(), CpuMeter("thread")
    meter.take()
    owner = Lifecycle("telemetry cost accounting")
    prefetcher = Prefetcher(iter(range(10**9)), 2, owner)
    time.sleep(0.2)  # let its queue fill
    g = {
        "time": time,
        "clock": clock,
        "stages": stages,
        "meter": meter,
        "prefetcher": prefetcher,
        "indices": indices,
        "table": table,
        "chunk": chunk,
        "READ": READ,
        "np": np,
        "metered": metered,
        "table_to_columns": table_to_columns,
    }
    # a backend with no hosts: the counters it is asked for at the end of the warm-up
    backend = SimpleNamespace(name="inprocess", on_trainer_thread=False, counters=lambda: ([], []), infos=lambda: [])
    meters = LoaderMeters(clock, backend, 2)  # type: ignore[arg-type]
    batch = {"tokens": np.zeros((32, SEQ_LEN), np.int32)}
    meters.step(0.0, 0.001, 32, 2, batch)  # the first step counts the batch's bytes, once
    g |= {"meters": meters, "batch": batch}
    costs = {
        "perf_counter": best("time.perf_counter()", 200_000, g),
        "LoaderMeters.step (StepClock.record inside)": best("meters.step(1.0, 1.001, 32, 2, batch)", 200_000, g),
        "Prefetcher.depth": best("prefetcher.depth()", 200_000, g),
        "StageTimes.add": best("stages.add(READ, 0.001, 512, 1000)", 200_000, g),
        "CpuMeter.maybe_sample, not due": best("meter.maybe_sample(0.0)", 200_000, g),
        "CpuMeter.take (thread)": best("meter.take()", 20_000, g),
        "indices.nbytes": best("indices.nbytes", 200_000, g),
        "table.nbytes (a chunk's Arrow table)": best("table.nbytes", 20_000, g),
        "sum of a chunk's column nbytes": best("sum(c.nbytes for c in chunk.values())", 100_000, g),
        "metered generator, per chunk": best("for _ in metered(iter(range(1000)), meter): pass", 200, g) / 1000
        - best("for _ in iter(range(1000)): pass", 200, g) / 1000,
    }
    owner.close()
    # the sidecar: what the counters add to an announcement's pickle, and the client's timing
    layout = [("tokens", "<i4", [32, 1024], 0), ("id", "<i8", [32], 131072), ("_index", "<i8", [32], 131328)]
    plain = {"slot": 1, "layout": layout}
    stats = {**plain, "stats": {"stages": list(StageTimes().values), "cpu": (1.0, 0.5), "ring": (10.0, 4.0)}}
    costs["announcement pickle: the stats' extra"] = best(
        "pickle.dumps(stats, 5)", 200_000, {**g, "pickle": pickle, "stats": stats}
    ) - best("pickle.dumps(plain, 5)", 200_000, {**g, "pickle": pickle, "plain": plain})
    costs["announcement unpickle: the stats' extra"] = best(
        "pickle.loads(b)", 200_000, {"pickle": pickle, "b": pickle.dumps(stats, 5)}
    ) - best("pickle.loads(b)", 200_000, {"pickle": pickle, "b": pickle.dumps(plain, 5)})
    costs["chunk_batches"] = float(host.chunk)
    return costs


def per_batch(costs: dict[str, float]) -> dict[str, float]:
    """Telemetry seconds per global batch on each thread of the demo pipeline (in process,
    0 workers; sidecar: per slot of `chunk` batches)."""
    c, chunk = costs, costs["chunk_batches"]
    trainer = 2 * c["perf_counter"] + c["Prefetcher.depth"] + c["LoaderMeters.step (StepClock.record inside)"]
    handoff = 2 * c["perf_counter"] + c["StageTimes.add"] + c["CpuMeter.maybe_sample, not due"]
    per_chunk = (
        6 * c["perf_counter"]
        + 4 * c["StageTimes.add"]
        + c["indices.nbytes"]
        + c["table.nbytes (a chunk's Arrow table)"]
        + c["sum of a chunk's column nbytes"]
        + c["metered generator, per chunk"]
        + c["CpuMeter.maybe_sample, not due"]
    )
    sampling = c["CpuMeter.take (thread)"] * 2  # twice a second; per batch at ~1,000 batches/s
    per_slot = (
        2 * c["perf_counter"]
        + c["StageTimes.add"]
        + c["sum of a chunk's column nbytes"]
        + c["CpuMeter.maybe_sample, not due"]
        + c["announcement pickle: the stats' extra"]
        + c["announcement unpickle: the stats' extra"]
        + 2 * c["perf_counter"]
        + c["StageTimes.add"]  # the client's hand-off timing
    )
    return {
        "trainer thread (next)": trainer,
        "hand-off thread": handoff,
        "host pipeline thread (per chunk / chunk)": per_chunk / chunk,
        "CPU sampling (2 per second, per batch at 1,000 batches/s)": sampling / 1000,
        "sidecar only: slot announcement and its timing (per slot / batches per slot)": per_slot / chunk,
    }


def ref_package(ref: str) -> Path:
    """The `colo_data` package at git revision `ref`, extracted into a temp dir."""
    target = Path(tempfile.mkdtemp(prefix="colo-data-ref-"))
    archive = subprocess.run(["git", "archive", ref, "colo_data"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def paired(pairs: int) -> dict[str, list[float]]:
    """Part 2: `pairs` pairs of epochs in one fresh process, telemetry on and stubbed, their
    order alternating; records/s and CPU s per 1k records of each."""
    out = subprocess.run(
        [sys.executable, "-c", PAIRS, str(pairs)], capture_output=True, text=True, cwd=tempfile.gettempdir(), check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_epoch(backend: str, package_dir: Path | None) -> harness.Measurement:
    """Part 3: one epoch in a fresh process, of this tree's package or of the one in `package_dir`."""
    env = dict(os.environ)
    if package_dir is not None:
        env["PYTHONPATH"] = str(package_dir)
    out = subprocess.run(
        [sys.executable, "-c", ONE, backend], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def interval(ratios: list[float]) -> tuple[float, float]:
    """The mean of paired ratios and the half-width of its 95% interval."""
    return statistics.mean(ratios), 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5


def against_ref(args: argparse.Namespace) -> tuple[list[str], harness.Runs, list[harness.Ratio]]:
    """Part 3: this tree and the package at `args.ref` in separate processes, interleaved; the
    table, the runs and the ratios (this tree / ref, medians after the first batch)."""
    ref_dir = ref_package(args.ref)
    sides = {"this tree": None, args.ref: ref_dir}
    contenders: dict[str, Callable[[], harness.Measurement]] = {
        f"{backend}, {side}": partial(one_epoch, backend, package) for backend in BACKENDS for side, package in sides.items()
    }
    runs = harness.interleave(contenders, args.rounds)
    rev = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        "",
        f"3. Separate processes, {args.rounds} rounds, records/s after the first batch (median; min-max), "
        f"against {args.ref} ({rev})",
        "",
        f"| backend | this tree | {args.ref} | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    ratios = []
    for backend in BACKENDS:
        a, b = runs[f"{backend}, this tree"], runs[f"{backend}, {args.ref}"]
        ratio = harness.ratio_of_medians(f"{backend}: this tree / {args.ref}", a, b, harness.AFTER_FIRST)
        ratios.append(ratio)
        xs, ys = harness.values(a, harness.AFTER_FIRST), harness.values(b, harness.AFTER_FIRST)
        lines.append(
            f"| {backend} | {statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f}) | {statistics.median(ys):,.0f} "
            f"({min(ys):,.0f}-{max(ys):,.0f}) | {ratio.value:.3f} |"
        )
    return lines, runs, ratios


def main() -> None:
    """Parts 1 and 2, and part 3 with `--ref`; telemetry.md and telemetry.json."""
    options = harness.parser(__doc__, rounds=5)
    options.add_argument("--pairs", type=int, default=20, help="paired epochs (on, stubbed) for part 2")
    options.add_argument("--ref", default="", help="git revision for part 3 (e.g. HEAD); empty: skip part 3")
    args = harness.parse(options)
    pairs = QUICK_PAIRS if args.quick else args.pairs

    costs = cost_accounting()
    shares = per_batch(costs)
    runs = paired(pairs)
    ratios = [on / off for on, off in zip(runs["on"], runs["stubbed"], strict=True)]
    mean, half = interval(ratios)
    cpu_ratios = [on / off for on, off in zip(runs["on_cpu"], runs["stubbed_cpu"], strict=True)]
    cpu_mean, cpu_half = interval(cpu_ratios)
    batch_s = BATCH / statistics.median(runs["on"])
    in_process = sum(v for k, v in shares.items() if not k.startswith("sidecar"))
    on_cpu, stubbed_cpu = statistics.median(runs["on_cpu"]), statistics.median(runs["stubbed_cpu"])
    lines = [
        f"Demo pipeline (pad to {SEQ_LEN}, batch {BATCH}, block shuffle), one epoch per run, in process, 0 workers, "
        f"no training step; {os.cpu_count()} CPUs.",
        "",
        f"1. Cost accounting: telemetry time per global batch against the median time per batch ({batch_s * 1e3:.3f} ms)",
        "",
        "| where | us per batch | share of a batch's time |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {s * 1e6:.2f} | {s / batch_s:.2%} |" for name, s in shares.items()),
        f"| in process, all threads added up (upper bound) | {in_process * 1e6:.2f} | {in_process / batch_s:.2%} |",
        "",
        "| operation | ns per call |",
        "| --- | ---: |",
        *(f"| {name} | {value * 1e9:,.0f} |" for name, value in costs.items() if name != "chunk_batches"),
        "",
        f"2. Paired epochs in one process, {len(ratios)} pairs, after the first batch of each",
        "",
        "| measure | telemetry on (median) | stubbed (median) | on / stubbed, mean of pairs | 95% interval | cost |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| records/s | {statistics.median(runs['on']):,.0f} | {statistics.median(runs['stubbed']):,.0f} | {mean:.4f} | "
        f"{mean - half:.4f} .. {mean + half:.4f} | {1 - mean:.2%} |",
        f"| CPU s per 1k records (this process) | {on_cpu:.4f} | {stubbed_cpu:.4f} "
        f"| {cpu_mean:.4f} | {cpu_mean - cpu_half:.4f} .. {cpu_mean + cpu_half:.4f} | {cpu_mean - 1:.2%} |",
    ]
    results = [
        harness.Ratio("records/s, telemetry on / stubbed (mean of pairs)", mean),
        harness.Ratio("CPU s per 1k records, telemetry on / stubbed (mean of pairs)", cpu_mean),
    ]
    details: dict[str, object] = {
        "costs_s": costs,
        "per_batch_s": shares,
        "pairs": runs,
        "ratio_ci95": [mean - half, mean + half],
        "cpu_ratio_ci95": [cpu_mean - cpu_half, cpu_mean + cpu_half],
    }
    cross: harness.Runs = {}
    if args.ref:
        ref_lines, cross, ref_ratios = against_ref(args)
        lines += ref_lines
        results += ref_ratios
    harness.write_results("telemetry", args, lines, cross, results, details=details)


if __name__ == "__main__":
    main()
