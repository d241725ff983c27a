"""The child process of benchmarks/sidecar.py's part 3, and the loader runs it times. The
child is confined to a 1-CPU cgroup before it does anything timed: `run_in_cgroup` (the
parent's side) starts it, moves it into the cgroup and reads its one JSON line; `main` (the
child's side, `python sidecar_child.py KIND BATCHES`) reads the first batches of an epoch of
the demo corpus with colo-data's sidecar (`demo_loader`, which part 2 times in the parent
too) or with Grain's DataLoader (`grain_loader`).
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grain
import harness
import jax
import numpy as np
from absl import flags
from cgroup import CpuCgroup
from demo_pad import BATCH, SEQ_LEN, PadRecord
from descendants import DescendantCpu, Tracker

import colo_data as cd
from colo_data import demo
from colo_data.bench import grain_baseline

CHILD_TIMEOUT_S = 300
_SIDECAR_SAYS = re.compile(r"colo-data sidecar on .*?: (\d+) worker process\(es\); CPU budget (\S+) \((.*)\); workers: ")


def demo_loader(directory: Path, tracker: Tracker | None, batches: int | None = None, **kwargs: Any) -> harness.Measurement:
    """One epoch (or its first `batches`) of the demo pipeline through cd.Loader(**kwargs):
    `harness.measure`'s figures from creating the pipeline (start-up included), with CPU of this
    process and its descendants sampled, the worker processes seen and the loader's close
    apart. A new pipeline each time: no row groups cached from an earlier run."""
    cpu = DescendantCpu(tracker)
    with ExitStack() as opened:

        def run() -> Iterator[int]:
            pipeline = demo.pipeline(directory, seq_len=SEQ_LEN, global_batch_size=BATCH)
            loader = opened.enter_context(cd.Loader(pipeline, **kwargs))
            return (len(jax.block_until_ready(batch)["tokens"]) for batch in loader)

        result = harness.measure(run, batches, cpu)
        end = time.perf_counter()
    return result | {"close_s": time.perf_counter() - end, "worker_processes": cpu.workers}


def grain_loader(directory: Path, batches: int) -> harness.Measurement:
    """The first `batches` batches of Grain's DataLoader(worker_count=None) over the demo corpus
    (global shuffle, per-record pad, each batch put on the device), from creating its source:
    `harness.measure`'s figures, CPU sampled as in `demo_loader`, and the workers it chose."""
    cpu = DescendantCpu()
    made: list[grain.DataLoader] = []

    def run() -> Iterator[int]:
        source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
        loader = grain_baseline.data_loader(source, [PadRecord(), grain.transforms.Batch(BATCH, drop_remainder=True)])
        made.append(loader)
        return (len(jax.block_until_ready(jax.device_put(batch))["tokens"]) for batch in loader)

    result = harness.measure(run, batches, cpu)
    gc.collect()  # Grain stops its workers when its iterator is collected
    return result | {"grain_worker_count": made[0].multiprocessing_options.num_workers, "worker_processes": cpu.workers}


def main() -> None:
    """Runs inside the cgroup: says "ready" once imported and JAX is up, waits for "go", reads
    the first BATCHES batches of an epoch with KIND (colo or grain), prints one JSON line."""
    kind, batches = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # close the loader on the way out
    flags.FLAGS.mark_as_parsed()
    directory = demo.corpus()
    jax.block_until_ready(jax.device_put(np.zeros(1)))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    budget = cd.resources.cpu_budget()
    with open("/proc/self/cgroup") as f:
        cgroup = next(line.strip() for line in f if ":cpu:" in line or ":cpu," in line)
    result: dict[str, Any] = {
        "cgroup": cgroup,
        "cpu_budget": {"cpus": budget.cpus, "workers": budget.workers, "source": budget.source},
        "os_cpu_count": os.cpu_count(),
    }
    if kind == "colo":
        result |= demo_loader(directory, None, batches, backend="sidecar")
    else:
        result |= grain_loader(directory, batches)
    print(json.dumps(result), flush=True)


def run_in_cgroup(cgroup: CpuCgroup, kind: str, batches: int) -> harness.Measurement:
    """Start the child, confine it to the cgroup before it does anything timed, let it run;
    its figures, what its sidecar said of its CPU budget, and the time it was throttled."""
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), kind, str(batches)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            cgroup.add(child.pid)
            assert child.stdout is not None and child.stdin is not None
            ready = child.stdout.readline().strip()
            if ready != "ready":
                raise RuntimeError(f"child {kind} did not start: {ready!r}")
            stat0 = cgroup.stat()
            child.stdin.write("go\n")
            child.stdin.flush()
            out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
            stat1 = cgroup.stat()
            err.seek(0)
            log = err.read()
            if child.returncode:
                at = log.rfind("Traceback")
                why = log[at:][-6000:] if at >= 0 else log[-3000:]
                raise RuntimeError(f"child {kind} failed (exit {child.returncode}):\n{why}")
        finally:
            if child.poll() is None:  # interrupted: let it close its loader, then make sure
                child.terminate()
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
    result = json.loads(out.strip().splitlines()[-1])
    said = _SIDECAR_SAYS.search(log)
    if said:
        result["sidecar_says"] = {"workers": int(said.group(1)), "cpu_budget": said.group(2), "source": said.group(3)}
    result["throttled_s"] = (stat1.get("throttled_time", 0) - stat0.get("throttled_time", 0)) / 1e9
    result["nr_throttled"] = stat1.get("nr_throttled", 0) - stat0.get("nr_throttled", 0)
    return result


if __name__ == "__main__":
    main()
