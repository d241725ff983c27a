"""One run of benchmarks/ray.py in a fresh process: startup.py's `cpu` pipeline or
workers.py's `light` one through `cd.Loader(backend=cd.InProcess(workers=...))`, with local
worker processes or `cd.RayWorkers`, every batch's arrival time and the records the pool made
printed as JSON."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import jax
import workers_pipeline
from absl import flags
from demo_pad import BATCH, SEQ_LEN
from startup_child import pipeline

import colo_data as cd
from colo_data.workers.settings import workers_from


def main(spec: dict[str, Any]) -> None:
    """Run `spec` (pipeline, workers: a count or a RayWorkers spec, batches) and print the readings."""
    flags.FLAGS.mark_as_parsed()
    cloudpickle.register_pickle_by_value(workers_pipeline)  # the actors get its function by value, not by import
    if spec["pipeline"] == "cpu":
        p = pipeline("cpu", SEQ_LEN, BATCH)
    else:
        p = workers_pipeline.pipeline("light", workers_pipeline.corpus(Path(spec["corpus"])))
    made = time.monotonic()
    arrived = []
    with cd.Loader(p, backend=cd.InProcess(workers=workers_from(spec["workers"], "workers"))) as loader:
        for batch in loader:
            jax.block_until_ready(batch)
            arrived.append(time.monotonic())
            if len(arrived) == spec["batches"]:
                break
        pool = next(s for s in loader.telemetry().stages if s.name == "pool_wait").items
    print(json.dumps({"made": made, "arrived": arrived, "pool_records": pool}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
