"""What every transport gives the `Loader`: one small protocol (`Backend`) and the global
batch it yields (`GlobalBatch`). The in-process and sidecar backends produce host pieces,
which `assembled` turns into global arrays on the mesh; the colocated backend's hosts
hand back global arrays themselves."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

import jax

from colo_data.backends.placement import Placement
from colo_data.errors import TransformError
from colo_data.host.chunk import HostChunk
from colo_data.host.dtypes import jax_ready
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import close_iterator
from colo_data.telemetry.counters import HANDOFF, StageTimes
from colo_data.telemetry.report import HostCounters, HostInfo


@dataclass
class GlobalBatch:
    """One global batch on the mesh.

    Args:
        arrays: column name -> `jax.Array` with the global batch size as leading dimension.
        end: the stream position after it where the hosts say it (packed batches); None
            when the batch took exactly one global batch of records.
    """

    arrays: dict[str, jax.Array]
    end: int | None = None


class Backend(Protocol):
    """A transport: where the hosts' pipelines run and how their rows reach this process.

    `open(position, run)` starts a stream of global batches at a stream position; every
    thread, process and socket it starts belongs to `run`, which the loader closes when the
    stream ends or restarts. The counters are cumulative over the loader's runs.
    `on_trainer_thread`: the hosts' work runs on the thread that calls `next()`."""

    name: str
    local_hosts: list[int]
    on_trainer_thread: bool

    def open(self, position: int, run: Lifecycle) -> Iterator[GlobalBatch]: ...

    def counters(self) -> tuple[list[float], list[HostCounters]]: ...

    def infos(self) -> list[HostInfo]: ...

    def run_ended(self) -> None: ...


def assembled(
    streams: Sequence[Iterator[HostChunk]], placement: Placement, handoff: StageTimes, wait_for_devices: bool
) -> Iterator[GlobalBatch]:
    """Global batches from the local hosts' streams of pieces (one per host, in
    `placement.local_hosts` order), with the hand-off time in `handoff`. In JAX's 32-bit
    mode, 64-bit columns are cast to 32 bits when every value fits, else a TransformError
    (`jax_ready`); the mode is read at each batch, on the thread that makes the arrays
    (`jax.enable_x64` as a context holds for one thread only). With `wait_for_devices`,
    each batch is on the devices before the next pieces are asked for (their memory is
    reused then). Closes the streams when done or closed."""
    local = placement.local_hosts
    rows = placement.global_batch_size * len(local) // placement.hosts
    nbytes = 0
    try:
        for pieces in zip(*streams, strict=True):  # the hosts' streams end together
            start = perf_counter()
            ends = {p.end for p in pieces if p.end is not None}
            if len(ends) > 1:
                raise TransformError(f"the hosts {local} planned different packed batches (ending at {sorted(ends)})")
            x64 = jax.enable_x64.value
            columns = {h: jax_ready(p.columns, x64, f"host {h}") for h, p in zip(local, pieces, strict=True)}
            arrays = placement.assemble(columns)
            if wait_for_devices:
                jax.block_until_ready(arrays)
            nbytes = nbytes or sum(a.nbytes for p in pieces for a in p.columns.values())  # the same for every batch
            handoff.add(HANDOFF, perf_counter() - start, rows, nbytes)
            yield GlobalBatch(arrays, ends.pop() if ends else None)
    finally:
        for stream in streams:
            close_iterator(stream)


def plus(a: tuple[float, float] | None, b: tuple[float, float]) -> tuple[float, float]:
    """Two cumulative counter pairs added (a may be missing)."""
    return b if a is None else (a[0] + b[0], a[1] + b[1])
