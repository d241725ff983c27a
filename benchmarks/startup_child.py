"""The timed process of benchmarks/startup.py: a fresh interpreter that builds a `cd.Loader`,
takes its first batch, a warm-up and then the steady-state batches, and prints its clock readings as one JSON
line. Its CPU-bound per-record transform is benchmarks/workers_pipeline.py's, which worker
processes and sidecars import by name (startup.py puts this folder on their PYTHONPATH). It
runs against the layout of any colo-data commit, so that one run can compare commits.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from typing import Any

import jax
from absl import flags
from descendants import worker_processes
from workers_pipeline import token_passes

import colo_data as cd

try:
    from colo_data import demo
except ImportError:  # the layout before the subpackages (commit b709df7 and earlier)
    from colo_data import demo  # type: ignore[attr-defined, no-redef]



def pipeline(kind: str, seq_len: int, batch: int) -> cd.Pipeline:
    """`light`: the demo pipeline; `cpu`: the same with `token_passes` before the pad."""
    light = demo.pipeline(seq_len=seq_len, global_batch_size=batch)
    if kind == "light":
        return light
    return dataclasses.replace(light, transforms=[cd.per_record(token_passes), *light.transforms])


def make_loader(p: cd.Pipeline, backend: str, workers: int) -> cd.Loader:
    """`cd.Loader` on `backend` with `workers`, in this tree's API: backend option objects,
    or (trees before them) the loader's flat `workers=` keyword."""
    if hasattr(cd, "InProcess"):
        return cd.Loader(p, backend=cd.Sidecar(workers=workers) if backend == "sidecar" else cd.InProcess(workers=workers))
    return cd.Loader(p, backend=backend, workers=workers)  # type: ignore[call-arg]


def main(spec: dict[str, Any]) -> None:
    """Run `spec` (pipeline, backend, workers, seq_len, batch, warmup, batches) and print
    time.monotonic() readings (the system-wide clock that the parent reads too)."""
    flags.FLAGS.mark_as_parsed()  # Grain's worker processes need parsed absl flags
    p = pipeline(spec["pipeline"], spec["seq_len"], spec["batch"])
    made = time.monotonic()
    loader = make_loader(p, spec["backend"], spec["workers"])
    try:
        batches = iter(loader)
        jax.block_until_ready(next(batches))
        first = time.monotonic()
        for batch in itertools.islice(batches, spec["warmup"]):
            jax.block_until_ready(batch)
        steady = time.monotonic()
        for batch in itertools.islice(batches, spec["batches"]):
            jax.block_until_ready(batch)
        end = time.monotonic()
        seen = worker_processes()
    finally:
        loader.close()
    readings = {"loader_at": made, "first_at": first, "steady_at": steady, "end_at": end, "closed_at": time.monotonic()}
    print(json.dumps({**readings, "worker_processes": seen}), flush=True)
