"""The input-wait goal: with a training step longer than the pipeline's time per batch, the
trainer waits for input less than 1% of the wall time (steady state).

For each simulated step time, `colo-data bench configs/demo.toml --step-time MS --json` runs
one epoch of the demo pipeline (in process and with the sidecar), and the steady-state
input-wait share is read from its JSON. Next to it, the floor of this machine: the same
step (a sleep) followed by a bare `queue.Queue.get()` of an item that a producer thread
put there long before, i.e. what handing over one ready object between two Python threads
costs here, with no pipeline at all. Run: `.venv/bin/python benchmarks/input_wait.py
[--steps-ms 0,1,2,3,5,10,20] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLO = Path(sys.executable).parent / "colo-data"


def queue_floor(step_s: float, steps: int = 300) -> float:
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
    return statistics.mean(waits[10:])


def bench(backend: str, step_ms: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [str(COLO), "bench", "configs/demo.toml", "--backend", backend, "--step-time", str(step_ms), "--json", out.name],
            cwd=ROOT, check=True, capture_output=True,
        )
        return json.loads(Path(out.name).read_text())["colo-data"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-ms", default="0,1,2,3,5,10,20")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows, raw = [], {}
    for step_ms in (float(x) for x in args.steps_ms.split(",")):
        floor = queue_floor(step_ms / 1000) if step_ms else None
        cells = []
        for backend in ("inprocess", "sidecar"):
            t = bench(backend, step_ms)
            raw[f"{backend} {step_ms:g}"] = t
            s = t["steady"]
            cells.append(f"{s['input_wait_share']:.2%} (p50 {s['wait_p50_s'] * 1e3:.3f}, p99 {s['wait_p99_s'] * 1e3:.3f} ms)")
            cells.append(f"{s['records_per_s']:,.0f}")
        share = f"{floor / (step_ms / 1000 + floor):.2%} ({floor * 1e6:.0f} us)" if floor else "-"
        rows.append(f"| {step_ms:g} | {' | '.join(cells)} | {share} |")
        print(rows[-1], flush=True)
    table = "\n".join([
        "Demo pipeline (configs/demo.toml: pad to 1024, batch 32, block shuffle), one epoch, warm-up 10 steps; steady state.",
        "",
        "| step (ms) | in process: input wait | records/s | sidecar: input wait | records/s | floor: a bare queue.get after the step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ])
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "input_wait.md").write_text(table + "\n")
    (args.out / "input_wait.json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
