"""The shared-memory hand-off of benchmarks/sidecar.py (part 1), measured against
`numpy.copyto`: a `colo-data sidecar serve` process serves batches of a given size made
without work (a stub source, a preallocated batch), the trainer takes them as numpy views
without touching their bytes; the baselines copy the same bytes in this process.
"""

from __future__ import annotations

import time
from typing import Any

import harness
import numpy as np
import pyarrow as pa
from descendants import SHM_DIR

import colo_data as cd
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.backends.sidecar.local import LocalSidecar
from colo_data.backends.sidecar.server import copy_threads
from colo_data.backends.sidecar.shm import ShmRing

ROWS = 512  # >= CHUNK_RECORDS: one host batch per host-pipeline call
WARMUP = 6  # more than the ring's 4 slots: every slot written (pages faulted) once
MEASURED_BYTES = 2 * 2**30  # measured bytes per size and round (at least 20 batches)
SLOTS = 4


class StubSource:
    """A colo-data Source of `n` records whose `take` costs microseconds: one int8 column."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @property
    def row_group_sizes(self) -> np.ndarray:
        return np.array([self.n], dtype=np.int64)

    def take(self, indices: np.ndarray) -> pa.Table:
        return pa.table({"i": np.zeros(len(indices), np.int8)})

    def fingerprint(self) -> str:
        return f"stub-{self.n}"


class FixedBatch:
    """Batch transform that returns a preallocated (rows, nbytes/rows) uint8 array, filled with
    ones (real pages, not the shared zero page), made once in the process that runs it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "_array": None}

    def __call__(self, columns: dict[str, Any]) -> dict[str, np.ndarray]:
        rows = len(next(iter(columns.values())))
        if self._array is None or len(self._array) != rows:
            self._array = np.ones((rows, self.nbytes // rows), np.uint8)
        return {"x": self._array}


def handoff_pipeline(nbytes: int, batches: int) -> cd.Pipeline:
    """`batches` host batches of `nbytes` each, made without work."""
    return cd.Pipeline(
        source=StubSource(ROWS * batches),
        global_batch_size=ROWS,
        transforms=[FixedBatch(nbytes)],
        order=cd.Order(shuffle="none"),
    )


def measured_batches(nbytes: int, batches: int | None) -> int:
    """The batches measured: `batches`, else `MEASURED_BYTES` worth and at least 20."""
    return batches or max(20, MEASURED_BYTES // nbytes)


def _rate(nbytes: int, batches: int, seconds: float) -> harness.Measurement:
    total = nbytes * batches
    return {"bytes": total, "batches": batches, "seconds": seconds, "bytes_per_s": total / seconds}


def measure_handoff(sidecar: LocalSidecar, nbytes: int, batches: int | None = None) -> harness.Measurement:
    """Bytes/s of host batches arriving in the trainer as views, after the warm-up."""
    measured = measured_batches(nbytes, batches)
    pipeline = handoff_pipeline(nbytes, WARMUP + measured)
    client = SidecarClient(sidecar.address, sidecar.process.pid)
    try:
        arrivals, seen = [], 0
        for batch in client.batches(pipeline, 0, 1, 0):
            arrivals.append(time.perf_counter())
            seen += batch.columns["x"].nbytes
        assert seen == nbytes * (WARMUP + measured), (seen, nbytes)
    finally:
        client.close()
    seconds = arrivals[-1] - arrivals[WARMUP - 1]
    return _rate(nbytes, measured, seconds)


def measure_copyto(nbytes: int, destinations: int, batches: int | None = None) -> harness.Measurement:
    """Single-thread numpy.copyto of `nbytes`, cycling over `destinations` buffers."""
    measured = measured_batches(nbytes, batches)
    src = np.ones(nbytes, np.uint8)
    dsts = [np.full(nbytes, 2, np.uint8) for _ in range(destinations)]
    for i in range(WARMUP):
        np.copyto(dsts[i % destinations], src)
    t0 = time.perf_counter()
    for i in range(measured):
        np.copyto(dsts[i % destinations], src)
    seconds = time.perf_counter() - t0
    return _rate(nbytes, measured, seconds)


def measure_slot_write(nbytes: int, batches: int | None = None) -> harness.Measurement:
    """The sidecar's copy alone: ShmRing.write of the same batch into 4 rotating slots, here,
    with the sidecar's copy threads."""
    measured = measured_batches(nbytes, batches)
    batch = {"x": np.ones((ROWS, nbytes // ROWS), np.uint8)}
    with ShmRing.create(SHM_DIR, SLOTS, nbytes, copy_threads=copy_threads(cd.resources.cpu_budget())) as ring:
        for i in range(WARMUP):
            ring.write(i % SLOTS, batch)
        t0 = time.perf_counter()
        for i in range(measured):
            ring.write(i % SLOTS, batch)
    return _rate(nbytes, measured, time.perf_counter() - t0)


def serve() -> LocalSidecar:
    """The hand-off's sidecar: `colo-data sidecar serve` with 0 workers and `SLOTS` slots, so
    that the batches are made in it."""
    return LocalSidecar(SHM_DIR, 0, SLOTS)
