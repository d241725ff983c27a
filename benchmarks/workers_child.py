"""One run of benchmarks/workers.py in a fresh process: a pipeline through `cd.Loader` with
some worker count, every batch's arrival time printed as JSON (time.monotonic, the clock
the parent reads too), so that the parent can rate any window of batches, and when the
first worker process began its first chunk (workers_pipeline.note_start; None if none did)."""

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
from workers_pipeline import NOTES, corpus, pipeline

import colo_data as cd


def main(spec: dict[str, Any]) -> None:
    """Run `spec` (pipeline, backend, workers, batches, corpus) and print the readings."""
    flags.FLAGS.mark_as_parsed()
    p = pipeline(spec["pipeline"], corpus(Path(spec["corpus"])))
    workers = spec["workers"]
    backend = cd.Sidecar(workers=workers) if spec["backend"] == "sidecar" else cd.InProcess(workers=workers)
    notes = Path(tempfile.mkdtemp(prefix="colo-data-bench-"))
    os.environ[NOTES] = str(notes)  # before the loader: its sidecar, fork server and workers inherit it
    made = time.monotonic()
    arrived = []
    with cd.Loader(p, backend=backend) as loader:
        for batch in loader:
            jax.block_until_ready(batch)
            arrived.append(time.monotonic())
            if len(arrived) == spec["batches"]:
                break
        chosen = [(h.workers if h.worker_processes else 0, h.workers_chosen) for h in loader.telemetry().hosts]
    began = [f.read_text().split() for f in notes.iterdir()]
    first_chunk = min((float(times[1]) for times in began if len(times) == 2), default=None)
    shutil.rmtree(notes)
    out = {"made": made, "arrived": arrived, "chosen": chosen, "worker_first_chunk": first_chunk}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
