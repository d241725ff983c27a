"""The checks `colo-data verify` makes of a `cd.GrainPipeline`: with each host count, the
loader's batches on the in-process and sidecar backends are the batches Grain itself gives
host by host, and a state saved after some batches continues identically. A Grain
pipeline's batches depend on the host count (each host iterates its own shard), so each
host count is checked against Grain on its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from colo_data.errors import ConfigError, GrainError
from colo_data.loader.loader import Loader
from colo_data.ops.verify import Check
from colo_data.spec.grain_pipeline import GrainPipeline

Batch = dict[str, np.ndarray]
DEFAULT_STEPS = 8  # batches a run, where no --steps is given (a Grain dataset may be endless)
_END = object()  # the end of a Grain iterator (an element may be None: a GrainError, as in the loader)
BACKENDS = ("inprocess", "sidecar")


def verify_grain(
    pipeline: GrainPipeline, hosts: Sequence[int] = (1, 2), steps: int | None = None, resume_at: int | None = None
) -> list[Check]:
    """Read `steps` global batches (default `DEFAULT_STEPS`) with each host count on each of
    `BACKENDS` and compare them with Grain's own iteration of each host's dataset; restore
    the state after `resume_at` batches (default: half the run) on the in-process backend
    and compare the rest. A host count that does not divide the global batch size is a SKIP."""
    steps = DEFAULT_STEPS if steps is None else steps
    resume_at = steps // 2 if resume_at is None else resume_at
    if steps < 1 or not 0 <= resume_at < steps:
        raise ConfigError(f"steps={steps}, resume_at={resume_at}: give steps >= 1 and 0 <= resume_at < steps")
    checks = []
    for count in dict.fromkeys(hosts):
        name = f"identical to Grain, {count} host(s)"
        if pipeline.global_batch_size % count:
            checks.append(Check(name, "SKIP", f"global_batch_size={pipeline.global_batch_size} is not divisible by {count}"))
            continue
        expected = grain_batches(pipeline, count, steps)
        for backend in BACKENDS:
            with Loader(pipeline, backend=backend, hosts=count) as loader:
                got = [_numpy(batch) for _, batch in zip(range(steps), loader, strict=False)]  # (range first: no batch extra)
            problem = _difference(expected, got, pipeline.global_batch_size)
            detail = problem or f"{len(got)} batches equal Grain's host by host, row for row in every column"
            checks.append(Check(f"{name}, {backend}", "FAIL" if problem else "PASS", detail))
        checks.append(_resume(pipeline, count, expected, resume_at))
    return checks


def grain_batches(pipeline: GrainPipeline, hosts: int, steps: int) -> list[list[Batch]]:
    """Each host's first `steps` host batches as Grain itself gives them (records stacked
    `global_batch_size / hosts` at a time where the pipeline's elements are records)."""
    from grain.sharding import ShardOptions  # noqa: PLC0415 - only a Grain pipeline needs it

    rows = pipeline.global_batch_size // hosts
    out = []
    for host in range(hosts):
        iterator = iter(pipeline.make_dataset(ShardOptions(shard_index=host, shard_count=hosts)))
        batches: list[Batch] = []
        try:
            while len(batches) < steps:
                if pipeline.records:
                    records = [_numpy(r) for _, r in zip(range(rows), iterator, strict=False)]
                    if len(records) < rows:
                        break
                    batches.append({name: np.stack([r[name] for r in records]) for name in records[0]})
                else:
                    element = next(iterator, _END)
                    if element is _END:
                        break
                    batches.append(_numpy(element))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        out.append(batches)
    return out


def _numpy(batch: Any) -> Batch:
    if not isinstance(batch, dict):
        raise GrainError(
            f"the Grain dataset gave a {type(batch).__name__} element; colo-data batches dicts of arrays (name -> numpy "
            "array): end the dataset with a .map that returns one"
        )
    return {name: np.asarray(value) for name, value in batch.items()}


def _difference(expected: list[list[Batch]], got: list[Batch], size: int) -> str | None:
    """Where the loader's global batches first differ from the hosts' Grain batches."""
    hosts = len(expected)
    rows = size // hosts
    ends = [len(e) for e in expected]
    if len(got) != min(ends):
        return f"the loader gave {len(got)} batches, Grain's hosts {ends}"
    for step, batch in enumerate(got):
        for host in range(hosts):
            want = expected[host][step]
            if set(want) != set(batch):
                return f"batch {step}: columns {sorted(batch)}, Grain's host {host} gives {sorted(want)}"
            for name, column in want.items():
                piece = batch[name][host * rows : (host + 1) * rows]
                if piece.shape != column.shape or piece.dtype != column.dtype or not np.array_equal(piece, column):
                    return f"batch {step}, host {host}, column {name!r}: not the rows Grain gives that host"
    return None


def _resume(pipeline: GrainPipeline, hosts: int, expected: list[list[Batch]], resume_at: int) -> Check:
    name = f"resume, {hosts} host(s)"
    with Loader(pipeline, hosts=hosts) as loader:
        for _ in zip(range(resume_at), loader, strict=False):
            pass
        state = loader.get_state()
    left = min(len(e) for e in expected) - resume_at
    with Loader(pipeline, hosts=hosts, state=state) as loader:
        rest = [_numpy(batch) for _, batch in zip(range(left), loader, strict=False)]
    problem = _difference([e[resume_at:] for e in expected], rest, pipeline.global_batch_size)
    detail = problem or f"the {len(rest)} batches after it are Grain's"
    return Check(name, "FAIL" if problem else "PASS", f"the state after {resume_at} batches, restored: {detail}")
