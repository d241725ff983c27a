"""The input-wait goal: with a training step longer than the pipeline's time per batch, the
trainer waits for input less than 1% of the wall time (steady state).

For each simulated step time, `colo-data bench configs/demo.toml --step-time MS --json` runs
one epoch of the demo pipeline (in process and with the sidecar), and the steady-state
input-wait share is read from its JSON. Next to it, the floor of this machine: the same
step (a sleep) followed by a bare `queue.Queue.get()` of an item that a producer thread
put there long before, i.e. what handing over one ready object between two Python threads
costs here, with no pipeline at all. Step times and backends are interleaved within each
round; medians. Run: `.venv/bin/python benchmarks/input_wait.py [--steps-ms 0,1,2,3,5,10,20]
[--rounds N] [--quick] [--out DIR]` (`--quick`: each bench run reads its 10 warm-up steps and
`harness.QUICK_BATCHES` more, not an epoch).
"""

from __future__ import annotations

import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
COLO = Path(sys.executable).parent / "colo-data"
BACKENDS = ("inprocess", "sidecar")
WARMUP = 10  # colo-data bench's warm-up steps (its default), apart from the steady state


def queue_floor(step_s: float, steps: int = 300) -> harness.Measurement:
    """Mean seconds of a `get()` of a ready item after a `step_s` sleep (a producer thread
    keeps the 2-deep queue full, as the loader's prefetch thread does)."""
    items: queue.Queue[int] = queue.Queue(2)
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            try:
                items.put(1, timeout=0.1)
            except queue.Full:
                pass

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    time.sleep(0.1)
    waits = []
    for _ in range(steps):
        time.sleep(step_s)
        t0 = time.perf_counter()
        items.get()
        waits.append(time.perf_counter() - t0)
    stop.set()
    thread.join()
    return {"get_s": statistics.mean(waits[10:])}


def bench(backend: str, step_ms: float, steps: int | None) -> harness.Measurement:
    """`colo-data bench`'s report of one epoch (or `steps` steps) of the demo pipeline with a
    simulated step of `step_ms`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [str(COLO), "bench", "configs/demo.toml", "--backend", backend, "--step-time", str(step_ms)]
        command += ["--json", out.name, *(["--steps", str(steps)] if steps else [])]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        return json.loads(Path(out.name).read_text())["colo-data"]


def show(m: harness.Measurement) -> str:
    """A progress line: the steady input-wait share and rate, or the floor's get."""
    if "steady" not in m:
        return f"a ready queue.get: {m['get_s'] * 1e6:.0f} us"
    s = m["steady"]
    return f"input wait {s['input_wait_share']:.2%} of the steady state, {s['records_per_s']:,.0f} records/s"


def steady(runs: list[harness.Measurement], key: str) -> float:
    """The median of the steady state's `key` over the rounds."""
    return statistics.median(m["steady"][key] for m in runs)


def main() -> None:
    """Every step time, round by round; input_wait.md and input_wait.json."""
    options = harness.parser(__doc__, rounds=1)
    options.add_argument("--steps-ms", default="0,1,2,3,5,10,20", help="simulated step times, ms, comma-separated")
    args = harness.parse(options)
    step_times = [float(x) for x in args.steps_ms.split(",")]
    steps = WARMUP + args.batches if args.batches else None
    contenders: dict[str, Callable[[], harness.Measurement]] = {}
    for step_ms in step_times:
        if step_ms:
            contenders[f"floor {step_ms:g} ms"] = partial(queue_floor, step_ms / 1000)
        for backend in BACKENDS:
            contenders[f"{backend} {step_ms:g} ms"] = partial(bench, backend, step_ms, steps)
    runs = harness.interleave(contenders, args.rounds, show)

    rows = []
    for step_ms in step_times:
        cells = []
        for backend in BACKENDS:
            rs = runs[f"{backend} {step_ms:g} ms"]
            wait, p50, p99 = (steady(rs, k) for k in ("input_wait_share", "wait_p50_s", "wait_p99_s"))
            cells += [f"{wait:.2%} (p50 {p50 * 1e3:.3f}, p99 {p99 * 1e3:.3f} ms)", f"{steady(rs, 'records_per_s'):,.0f}"]
        floor = harness.median(runs[f"floor {step_ms:g} ms"], "get_s") if step_ms else None
        share = f"{floor / (step_ms / 1000 + floor):.2%} ({floor * 1e6:.0f} us)" if floor else "-"
        rows.append(f"| {step_ms:g} | {' | '.join(cells)} | {share} |")
    lines = [
        f"Demo pipeline (configs/demo.toml: pad to 1024, batch 32, block shuffle), one epoch, warm-up {WARMUP} steps; "
        f"steady state; median of {args.rounds} interleaved round(s).",
        "",
        "| step (ms) | in process: input wait | records/s | sidecar: input wait | records/s "
        "| floor: a bare queue.get after the step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    harness.write_results("input_wait", args, lines, runs, [])


if __name__ == "__main__":
    main()
