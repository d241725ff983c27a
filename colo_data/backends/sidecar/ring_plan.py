"""The shared-memory ring a sidecar session creates, planned from the pipeline's first host
batch: batches per slot, slot size, and whether it fits the shm directory and memory
limit. The one place rings are sized: a session sizes its ring here, `colo-data doctor`
and `sidecar serve CONFIG` check it before any trainer connects, and `colo-data manifest`
sizes the shared-memory volume from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from colo_data.backends.sidecar.shm import check_capacity, ring_bytes, slot_bytes
from colo_data.errors import ConfigError
from colo_data.host.chunk import HostBatch
from colo_data.host.shares import HostShare, host_pipeline
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.runtime.budget import memory_limit, shm_capacity
from colo_data.runtime.prefetch import close_iterator

SLOT_TARGET_BYTES = 4 * 2**20


def batches_per_slot(first: HostBatch, rows: int, most: int, target: float = SLOT_TARGET_BYTES) -> int:
    """Host batches of `rows` rows that one slot holds: as many as fit `target` bytes (at
    most `most`, a chunk's worth), at least one. Small batches then share a slot, its write
    and its two messages; large ones still take one slot each."""
    records = len(next(iter(first.values())))
    batch_bytes = rows * sum(column.nbytes for column in first.values()) / max(1, records)
    return max(1, min(most, int(target // max(1.0, batch_bytes))))


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

    @classmethod
    def of(cls, first: HostBatch, rows: int, most: int, total: int | None, shm_dir: str, slots: int) -> RingPlan:
        """The ring for a session whose first chunk is `first`, host batches of `rows` rows,
        at most `most` batches a slot (a chunk's worth), `total` batches in all (None:
        endless). A shared slot takes at most half the room over the ring (the shm dir's
        free space, the cgroup memory limit), so a small /dev/shm still gets one batch a
        slot before it gets an error."""
        free, limit = shm_capacity(shm_dir), memory_limit()
        room = min(free, limit if limit is not None else math.inf)
        per_slot, size = _layout(first, rows, most, total, min(SLOT_TARGET_BYTES, room / (2 * slots)))
        return cls(shm_dir, slots, per_slot, size, free, limit)

    @property
    def needed(self) -> int:
        return ring_bytes(self.slots, self.slot_size)

    def check(self) -> None:
        """Raise ShmError (bytes needed and free, and the fix) unless the ring fits: the
        check `ShmRing.create` makes when a session opens."""
        check_capacity(self.directory, self.slots, self.slot_size, self.memory_limit)


def _layout(first: HostBatch, rows: int, most: int, total: int | None, target: float) -> tuple[int, int]:
    """Batches per slot and the slot size for slots of about `target` bytes."""
    per_slot = batches_per_slot(first, rows, most, target)
    in_first = per_slot if total is None else min(per_slot, total)  # a short session's one slot holds it all
    return per_slot, slot_bytes(_rows_like(first, rows * in_first))


def _first_chunk(pipeline: AnyPipeline, hosts: int) -> tuple[HostShare, HostBatch]:
    """Host 0 of `hosts` and its first chunk (computed here, nothing left running).

    Raises:
        ConfigError: the pipeline gives no batch (nothing to size a ring from).
    """
    host = host_pipeline(pipeline, 0, hosts)
    chunks = host.chunks(0)
    try:
        first = next(chunks, None)
    finally:
        close_iterator(chunks)
    if first is None:
        raise ConfigError(f"the pipeline gives no batch for {hosts} host(s): nothing to size a ring from")
    return host, first.columns


def plan_ring(pipeline: AnyPipeline, shm_dir: str, slots: int, hosts: int = 1) -> RingPlan:
    """The ring a session of host 0 of `hosts` would create, sized as the session sizes it.
    One host is the largest ring a pipeline can need: the sidecar checks a CONFIG with it
    at start, so a ring that cannot fit fails there, not at the first trainer's open."""
    host, first = _first_chunk(pipeline, hosts)
    return RingPlan.of(first, len(host.rows), host.chunk, pipeline.batches_from(0), shm_dir, slots)


def roomy_slot_size(pipeline: AnyPipeline, hosts: int) -> int:
    """The slot size of a session of host 0 of `hosts` whose shm dir has room for slots of
    `SLOT_TARGET_BYTES`: a volume of twice `slots` such slots gives every session its
    plan (how `colo-data manifest` sizes shared memory)."""
    host, first = _first_chunk(pipeline, hosts)
    return _layout(first, len(host.rows), host.chunk, pipeline.batches_from(0), SLOT_TARGET_BYTES)[1]


def _rows_like(batch: HostBatch, rows: int) -> HostBatch:
    """Arrays shaped like `batch`'s columns with `rows` rows, for their sizes only: broadcast
    views of one element, so nothing of their size is allocated."""
    return {name: np.broadcast_to(np.zeros((), column.dtype), (rows, *column.shape[1:])) for name, column in batch.items()}
