"""The shared-memory ring a sidecar session creates, planned from the pipeline's first host
batch: slot size, batches per slot, and whether it fits the shm directory and memory limit.
`colo-data doctor` and `sidecar serve CONFIG` use the same plan before any trainer connects."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from colo_data.backends.sidecar.shm import check_capacity, ring_bytes, slot_bytes
from colo_data.host.chunk import HostBatch
from colo_data.host.pipeline import HostPipeline
from colo_data.host.resources import memory_limit, shm_capacity
from colo_data.spec.pipeline import Pipeline

SLOT_TARGET_BYTES = 4 * 2**20


def batches_per_slot(chunk: HostBatch, rows: int, most: int, target: float = SLOT_TARGET_BYTES) -> int:
    """Host batches of `rows` rows that one slot holds: as many as fit `target` bytes (at
    most `most`, a chunk's worth), at least one. Small batches then share a slot, its write
    and its two messages; large ones still take one slot each."""
    records = len(next(iter(chunk.values())))
    batch_bytes = rows * sum(column.nbytes for column in chunk.values()) / max(1, records)
    return max(1, min(most, int(target // max(1.0, batch_bytes))))


def slot_target(shm_dir: str, slots: int) -> tuple[float, int | None]:
    """The bytes one slot should hold and the cgroup memory limit: a shared slot takes at
    most half the room (shm dir, memory limit) over the ring, so a small /dev/shm still gets
    one batch a slot before it gets an error."""
    limit = memory_limit()
    room = min(shm_capacity(shm_dir), limit if limit is not None else math.inf)
    return min(SLOT_TARGET_BYTES, room / (2 * slots)), limit


@dataclass(frozen=True)
class RingPlan:
    """The ring a sidecar session creates: `slots` slots of `slot_size` bytes, each holding
    `per_slot` host batches, in `directory` (`free` bytes free, under `memory_limit`)."""

    directory: str
    slots: int
    per_slot: int
    slot_size: int
    free: int
    memory_limit: int | None

    @property
    def needed(self) -> int:
        return ring_bytes(self.slots, self.slot_size)

    def check(self) -> None:
        """Raise ShmError (bytes needed and free, and the fix) unless the ring fits: the
        check `ShmRing.create` makes when a session opens."""
        check_capacity(self.directory, self.slots, self.slot_size, self.memory_limit)


def plan_ring(pipeline: Pipeline, shm_dir: str, slots: int, hosts: int = 1, position: int = 0) -> RingPlan:
    """The ring a session of host 0 of `hosts` at `position` would create, sized as the
    session sizes it, from the pipeline's first host batch (computed here, one batch only).
    One host is the largest ring a pipeline can need: the sidecar checks a CONFIG with it
    at start, so a ring that cannot fit fails there, not at the first trainer's open."""
    host_pipeline = HostPipeline(pipeline, 0, hosts, 0)
    rows = host_pipeline.rows[1] - host_pipeline.rows[0]
    target, limit = slot_target(shm_dir, slots)
    total = pipeline.batches_from(position)
    if total == 0:
        first = None
    elif pipeline.pack is not None:
        chunk = next(host_pipeline.chunks(position), None)
        first = None if chunk is None else chunk.columns
    else:
        first = host_pipeline.batch(position)
    per_slot = 1 if first is None else batches_per_slot(first, rows, host_pipeline.chunk, target)
    in_first = per_slot if total is None else min(per_slot, total)  # a short stream's one slot holds it all
    size = 1 if first is None else slot_bytes(_rows_like(first, rows * in_first))
    return RingPlan(shm_dir, slots, per_slot, size, shm_capacity(shm_dir), limit)


def _rows_like(batch: HostBatch, rows: int) -> HostBatch:
    """Arrays shaped like `batch`'s columns with `rows` rows, for their sizes only: broadcast
    views of one element, so nothing of their size is allocated."""
    return {name: np.broadcast_to(np.zeros((), column.dtype), (rows, *column.shape[1:])) for name, column in batch.items()}
