"""What every transport gives the `Loader`: one small protocol (`Transport`) and the global
batch it yields (`GlobalBatch`). The in-process and sidecar transports produce host pieces,
which `assembled` turns into global arrays on the mesh; the colocated transport's hosts
hand back global arrays themselves."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from time import monotonic, perf_counter
from typing import Any, Protocol

import jax
import numpy as np

from colo_data.backends.placement import Placement
from colo_data.errors import GrainError, TransformError
from colo_data.host.chunk import HostBatch, HostChunk, column_schema, schema_change
from colo_data.host.dtypes import jax_ready
from colo_data.host.pool_schedule import Downstream
from colo_data.pipeline.order import Position
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import close_iterator
from colo_data.telemetry.counters import HANDOFF, StageTimes
from colo_data.telemetry.report import HostCounters, HostInfo


@dataclass
class GlobalBatch:
    """One global batch on the mesh.

    Args:
        arrays: column name -> `jax.Array` with the global batch size as leading dimension.
        end: the position after it where the hosts say it (packed batches), or a
            partitioned pipeline's own positions after it (-1: partitions of other
            processes' hosts); None when the batch took exactly one global batch of records.
        states: a Grain pipeline's state of each host (host -> state) after it; None for a
            native pipeline.
    """

    arrays: dict[str, jax.Array]
    end: int | np.ndarray | None = None
    states: dict[int, Any] | None = None


class Transport(Protocol):
    """Where the hosts' pipelines run and how their rows reach this process: what a
    `BackendOptions` starts.

    `open(position, run)` starts the global batches at a position; every thread, process
    and socket it starts belongs to `run`, which the loader closes when the batches end or
    restart. The counters are cumulative over the loader's runs.
    `on_trainer_thread`: the hosts' work runs on the thread that calls `next()`."""

    name: str
    local_hosts: list[int]
    on_trainer_thread: bool

    def open(self, position: Position, run: Lifecycle) -> Iterator[GlobalBatch]: ...

    def counters(self) -> tuple[list[float], list[HostCounters]]: ...

    def infos(self) -> list[HostInfo]: ...

    def run_ended(self) -> None: ...


def assembled(
    feeds: Sequence[Iterator[HostChunk]], placement: Placement, handoff: StageTimes, wait_for_devices: bool
) -> Iterator[GlobalBatch]:
    """Global batches from the local hosts' feeds of pieces (one per host, in
    `placement.local_hosts` order), with the hand-off time in `handoff`. In JAX's 32-bit
    mode, 64-bit columns are cast to 32 bits when every value fits, else a TransformError
    (`jax_ready`); the mode is read at each batch, on the thread that makes the arrays
    (`jax.enable_x64` as a context holds for one thread only). With `wait_for_devices`,
    each batch is on the devices before the next pieces are asked for (their memory is
    reused then). The hosts' feeds end together, or it is a GrainError (only a Grain
    pipeline's hosts can end apart). Closes the feeds when done or closed."""
    local = placement.local_hosts
    rows = placement.global_batch_size * len(local) // placement.hosts
    nbytes = 0
    try:
        while True:
            got = [next(feed, None) for feed in feeds]
            if all(p is None for p in got):
                return
            pieces = [p for p in got if p is not None]
            if len(pieces) < len(got):
                if any(isinstance(p.end, np.ndarray) for p in pieces):  # a partitioned pipeline ends with a partition
                    return
                ended = [h for h, p in zip(local, got, strict=True) if p is None]
                raise ended_early(ended, [h for h in local if h not in ended])
            start = perf_counter()
            end = end_position(local, pieces, placement)
            same_columns(local, [p.columns for p in pieces])
            x64 = jax.enable_x64.value
            columns = {h: jax_ready(p.columns, x64, f"host {h}") for h, p in zip(local, pieces, strict=True)}
            arrays = placement.assemble(columns)
            if wait_for_devices:
                jax.block_until_ready(arrays)
            nbytes = nbytes or sum(a.nbytes for p in pieces for a in p.columns.values())  # the same for every batch
            handoff.add(HANDOFF, perf_counter() - start, rows, nbytes)
            states = {h: p.states[0] for h, p in zip(local, pieces, strict=True) if p.states}
            yield GlobalBatch(arrays, end, states or None)
    finally:
        for feed in feeds:
            close_iterator(feed)


def end_position(local: Sequence[int], pieces: Sequence[HostChunk], placement: Placement) -> int | np.ndarray | None:
    """Where the local hosts say a batch ends: a packed or filtered pipeline's position
    after it (the same on every host, or a TransformError), a
    partitioned one's own positions (-1: other processes' partitions), else None."""
    if any(isinstance(p.end, np.ndarray) for p in pieces):
        return placement.ends({h: p.end for h, p in zip(local, pieces, strict=True) if isinstance(p.end, np.ndarray)})
    ends = {p.end for p in pieces if p.end is not None}
    if len(ends) > 1:
        raise TransformError(f"the hosts {list(local)} planned different packed batches (ending at {sorted(ends)})")
    return ends.pop() if ends else None


def same_columns(hosts: Sequence[int], pieces: Sequence[HostBatch]) -> None:
    """The hosts' pieces of one batch have the same columns, dtypes and row shapes, or a
    TransformError names the hosts and columns that differ."""
    first = column_schema(pieces[0])
    for host, piece in zip(hosts[1:], pieces[1:], strict=True):
        schema = column_schema(piece)
        if schema != first:
            changed, theirs, its = schema_change(first, schema)
            raise TransformError(
                f"host {hosts[0]} and host {host} made different columns {changed}: {theirs} against {its}; every "
                "host's batch must have the same columns, dtypes and row shapes (pad to one fixed length, not to each "
                "batch's longest)"
            )


def ended_early(ended: Sequence[int], going: Sequence[int]) -> GrainError:
    """The error for hosts whose feeds ended while others' went on."""
    return GrainError(
        f"host(s) {list(ended)} came to the end of their data while host(s) {list(going)} had more: every host's "
        "dataset must give the same number of batches (shard with drop_remainder=True, or repeat the dataset and "
        "stop after the steps you want)"
    )


def plus(a: tuple[float, float] | None, b: tuple[float, float]) -> tuple[float, float]:
    """Two cumulative counter pairs added (a may be missing)."""
    return b if a is None else (a[0] + b[0], a[1] + b[1])


def told(chunks: Iterator[HostChunk], downstream: Downstream, on_trainer_thread: bool) -> Iterator[HostChunk]:
    """`chunks` as the trainer takes them, the records it took told to `downstream` (the
    host's worker policy reads them), and, where they are computed on the trainer's thread
    (or while the controller waits for a colocated call), the time each takes as its wait
    for input (else the host's prefetch thread tells it)."""
    try:
        while True:
            began = monotonic()
            chunk = next(chunks, None)
            if on_trainer_thread:
                downstream.trainer_waited(monotonic() - began)
            if chunk is None:
                return
            downstream.trainer_took(chunk.rows)
            yield chunk
    finally:
        close_iterator(chunks)
