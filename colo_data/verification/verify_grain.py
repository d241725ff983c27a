"""The checks `verify` makes of a `cd.GrainPipeline`: with each host count, the loader's
batches on the in-process and sidecar backends are the batches Grain itself gives host by
host (so the hosts' pieces make the global batches, row for row), and a state saved after
some batches continues identically. A Grain pipeline's batches depend on the host count
(each host iterates its own shard), so each host count is checked against Grain on its
own; its state restores on the host count that saved it (Grain's rule)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from colo_data.errors import ConfigError, GrainError
from colo_data.host.dtypes import jax_column
from colo_data.loader.loader import Loader
from colo_data.pipeline.grain_pipeline import GrainPipeline
from colo_data.verification.checks import Batch, Check, differing_rows, one_device

DEFAULT_STEPS = 8  # batches a run, where no --steps is given (a Grain dataset may be endless)
_END = object()  # the end of a Grain iterator (an element may be None: a GrainError, as in the loader)
BACKENDS = ("inprocess", "sidecar")


def verify_grain(
    pipeline: GrainPipeline,
    hosts: Sequence[int] = (1, 2),
    steps: int | None = None,
    resume_at: int | None = None,
    resume_hosts: int | None = None,
) -> list[Check]:
    """Read `steps` global batches (default `DEFAULT_STEPS`) with each host count on each of
    `BACKENDS` and compare them with Grain's own iteration of each host's dataset; restore
    the state after `resume_at` batches (default: half the run) on the in-process backend
    and compare the rest. A host count that does not divide the global batch size is a SKIP.

    Raises:
        ConfigError: no host count, or one that is not a positive int; impossible `steps`
            or `resume_at`; a `resume_hosts` (a Grain state restores on its own host count).
    """
    steps = DEFAULT_STEPS if steps is None else steps
    resume_at = steps // 2 if resume_at is None else resume_at
    _check_settings(hosts, steps, resume_at, resume_hosts)
    checks = []
    for count in dict.fromkeys(hosts):
        name = f"identical to Grain, {count} host(s)"
        if pipeline.global_batch_size % count:
            checks.append(Check(name, "SKIP", f"global_batch_size={pipeline.global_batch_size} is not divisible by {count}"))
            continue
        expected = _as_jax_holds(grain_batches(pipeline, count, steps))
        for backend in BACKENDS:
            got = _read(pipeline, count, steps, backend=backend)
            problem = _difference(expected, got, pipeline.global_batch_size)
            detail = problem or f"{len(got)} batches equal Grain's host by host, row for row in every column"
            checks.append(Check(f"{name}, {backend}", "FAIL" if problem else "PASS", detail))
        checks.append(_resume(pipeline, count, expected, resume_at))
    return checks


def _check_settings(hosts: Sequence[int], steps: int, resume_at: int, resume_hosts: int | None) -> None:
    if not hosts or any(not isinstance(h, int) or h < 1 for h in hosts):
        raise ConfigError(f"hosts={tuple(hosts)!r}: give one or more positive host counts, e.g. (1, 2)")
    if not (isinstance(steps, int) and isinstance(resume_at, int) and steps >= 1 and 0 <= resume_at < steps):
        raise ConfigError(f"steps={steps!r}, resume_at={resume_at!r}: give steps >= 1 and 0 <= resume_at < steps")
    if resume_hosts is not None:
        raise ConfigError(
            f"resume_hosts={resume_hosts!r}: a cd.GrainPipeline's state restores on the host count that saved it "
            "(Grain's rule), so verify restores each host count's state on that count: leave resume_hosts out"
        )


def _read(pipeline: GrainPipeline, hosts: int, steps: int, **options: Any) -> list[Batch]:
    """The first `steps` global batches (fewer where the stream ends) of a loader of `hosts`
    simulated hosts on one device, as numpy."""
    with Loader(pipeline, hosts=hosts, mesh=one_device(), **options) as loader:
        return [_numpy(batch) for _, batch in zip(range(steps), loader, strict=False)]  # (range first: no batch extra)


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


def _as_jax_holds(batches: list[list[Batch]]) -> list[list[Batch]]:
    """Grain's host batches as the loader's arrays hold them: in JAX's 32-bit mode a 64-bit
    column arrives as its 32-bit dtype (the loader refuses a value that would change)."""
    x64 = jax.enable_x64.value  # the mode of this thread, where the loader makes its arrays
    return [
        [{name: jax_column(name, column, x64, f"host {host}") for name, column in batch.items()} for batch in host_batches]
        for host, host_batches in enumerate(batches)
    ]


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
                where = f"batch {step}, host {host}, column {name!r}"
                if piece.shape != column.shape or piece.dtype != column.dtype:
                    return f"{where}: {piece.dtype} {piece.shape}, Grain gives that host {column.dtype} {column.shape}"
                differing = differing_rows(piece, column)
                if len(differing):
                    row = int(differing[0])
                    return (
                        f"{where}: row {row} (global row {host * rows + row}) is not the row Grain gives that host "
                        f"({len(differing)} of its {rows} rows differ)"
                    )
    return None


def _resume(pipeline: GrainPipeline, hosts: int, expected: list[list[Batch]], resume_at: int) -> Check:
    """The state after `resume_at` batches, restored on the same host count, continues with
    the batches Grain gives after them."""
    name = f"resume, {hosts} host(s)"
    with Loader(pipeline, hosts=hosts, mesh=one_device()) as loader:
        for _ in zip(range(resume_at), loader, strict=False):
            pass
        state = loader.get_state()
    rest = _read(pipeline, hosts, min(len(e) for e in expected) - resume_at, state=state)
    problem = _difference([e[resume_at:] for e in expected], rest, pipeline.global_batch_size)
    detail = problem or f"the {len(rest)} batches after it are Grain's"
    return Check(name, "FAIL" if problem else "PASS", f"the state after {resume_at} batches, restored: {detail}")
