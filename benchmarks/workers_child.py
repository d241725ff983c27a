"""One run of benchmarks/workers.py in a fresh process: a pipeline through `cd.Loader` with
some worker count (or, for the `wait` pipeline, Grain's default iterator over the same
records with the same per-record function), every batch's arrival time printed as JSON
(time.monotonic, the clock the parent reads too), so that the parent can rate any window
of batches, the workers at work at the end and why, and when the first worker process
began its first chunk (workers_pipeline.note_start; None if none did)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
from absl import flags
from workers_pipeline import NOTES, corpus, grain_default, pipeline

import colo_data as cd


def enough(spec: dict[str, Any], arrived: list[float], made: float) -> bool:
    """Whether the run has its `batches`, or has lasted its `seconds` from `made`."""
    return len(arrived) == spec["batches"] if "batches" in spec else arrived[-1] - made >= spec["seconds"]


def main(spec: dict[str, Any]) -> None:
    """Run `spec` (pipeline, backend, workers, corpus, and `batches` or `seconds`) and print
    the readings."""
    flags.FLAGS.mark_as_parsed()
    directory = corpus(Path(spec["corpus"]))
    notes = Path(tempfile.mkdtemp(prefix="colo-data-bench-"))
    os.environ[NOTES] = str(notes)  # before the loader: its sidecar, fork server and workers inherit it
    arrived: list[float] = []
    if spec["backend"] == "grain":
        dataset = grain_default(directory)  # (its records read into memory before the clock starts)
        made = time.monotonic()
        for batch in dataset:
            jax.block_until_ready(jax.device_put(batch))
            arrived.append(time.monotonic())
            if enough(spec, arrived, made):
                break
        chosen = [(0, "Grain's default iterator: 16 read threads")]
    else:
        p = pipeline(spec["pipeline"], directory)
        workers = spec["workers"]
        backend = {"sidecar": cd.Sidecar, "inprocess": cd.InProcess}[spec["backend"]]
        made = time.monotonic()
        with cd.Loader(p, backend=backend() if workers == "default" else backend(workers=workers)) as loader:
            for batch in loader:
                jax.block_until_ready(batch)
                arrived.append(time.monotonic())
                if enough(spec, arrived, made):
                    break
            chosen = [(h.workers if h.worker_processes else 0, h.workers_why) for h in loader.telemetry().hosts]
    began = [f.read_text().split() for f in notes.iterdir()]
    first_chunk = min((float(times[1]) for times in began if len(times) == 2), default=None)
    shutil.rmtree(notes)
    out = {"made": made, "arrived": arrived, "chosen": chosen, "worker_first_chunk": first_chunk}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
