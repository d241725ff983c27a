"""`start_pool`: the worker pool a host pipeline's `WorkerChoice` asks for, local worker
processes or Ray actors; the one place that tells the kinds apart, so that a backend starts
either the same way."""

from __future__ import annotations

from collections.abc import Sequence

from colo_data.host.chunk_work import ChunkPool
from colo_data.runtime.budget import CpuBudget
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.workers.processes import WorkerPool
from colo_data.workers.ray_options import RayWorkers
from colo_data.workers.settings import WorkerChoice


def start_pool(
    choice: WorkerChoice, owner: Lifecycle, budget: CpuBudget | None = None, also: Sequence[int] = (), from_here: bool = False
) -> ChunkPool | None:
    """The pool of `choice` (None for no workers), owned by `owner`: `WorkerPool` processes
    on `budget` (shared with the processes `also`; with `from_here`, forked from a fork of
    this process), or `cd.RayWorkers`' actors."""
    if not choice.count:
        return None
    ray = RayWorkers.of(choice.ray)
    if ray is not None:
        from colo_data.workers.ray_pool import RayPool  # imports Ray: only for Ray workers

        return RayPool(ray, owner)
    return WorkerPool(choice.count, owner, budget, also, from_here)
