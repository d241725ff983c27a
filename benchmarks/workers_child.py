"""One run of benchmarks/workers.py in a fresh process: a pipeline through `cd.Loader` with
some worker count, every batch's arrival time printed as JSON (time.monotonic, the clock
the parent reads too), so that the parent can rate any window of batches."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
from absl import flags
from workers_pipeline import corpus, pipeline

import colo_data as cd


def main(spec: dict[str, Any]) -> None:
    """Run `spec` (pipeline, backend, workers, batches, corpus) and print the readings."""
    flags.FLAGS.mark_as_parsed()
    p = pipeline(spec["pipeline"], corpus(Path(spec["corpus"])))
    workers = spec["workers"]
    backend = cd.Sidecar(workers=workers) if spec["backend"] == "sidecar" else cd.InProcess(workers=workers)
    made = time.monotonic()
    arrived = []
    with cd.Loader(p, backend=backend) as loader:
        for batch in loader:
            jax.block_until_ready(batch)
            arrived.append(time.monotonic())
            if len(arrived) == spec["batches"]:
                break
        chosen = [(h.workers if h.worker_processes else 0, h.workers_chosen) for h in loader.telemetry().hosts]
    print(json.dumps({"made": made, "arrived": arrived, "chosen": chosen}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
