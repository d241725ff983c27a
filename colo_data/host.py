"""`HostPipeline`: one host's share of every global batch. It maps stream positions to
records through the global order, gathers them from the source, runs the transforms and
returns numpy arrays; Grain's multiprocessing runs it in worker processes, one whole host
batch per element, so only batches cross the process boundary."""

from __future__ import annotations

import traceback

import grain
import numpy as np
from absl import flags

from colo_data.columns import Columns, table_to_columns
from colo_data.errors import ColoDataError, ConfigError, TransformError
from colo_data.order import GlobalOrder, host_rows
from colo_data.pipeline import Pipeline

HostBatch = dict[str, np.ndarray]
_FOREVER = 2**62


def _check_batch(columns: Columns, rows: int) -> HostBatch:
    for name, col in columns.items():
        if not isinstance(col, np.ndarray):
            kind = getattr(col, "type", type(col).__name__)
            hint = (
                f"add cd.pad_or_truncate({name!r}, LENGTH)"
                if "list" in str(kind)
                else "fill its nulls, encode it as numbers, or leave it out of the source's columns"
            )
            raise TransformError(f"column {name!r} is {kind} after the transforms, not a fixed-shape array: {hint}")
        if col.dtype.kind not in "biuf":
            raise TransformError(
                f"column {name!r} has dtype {col.dtype} after the transforms; batches hold numbers and booleans: "
                "encode it or leave it out of the source's columns"
            )
        if len(col) != rows:
            raise TransformError(
                f"column {name!r} has {len(col)} rows after the transforms, but the host batch has {rows} records: "
                "transforms must keep one row per record"
            )
    return columns  # type: ignore[return-value]


class HostPipeline:
    """Host `host` of `hosts`: rows `[g*B + host*B/hosts, g*B + (host+1)*B/hosts)` of each
    global batch g, transformed and batched, produced by `workers` processes (0: in this
    process)."""

    def __init__(self, pipeline: Pipeline, host: int = 0, hosts: int = 1, workers: int = 0) -> None:
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"workers={workers!r}: must be an int >= 0 (0 runs the pipeline in this process)")
        self.pipeline = pipeline
        self.host, self.hosts, self.workers = host, hosts, workers
        self.rows = host_rows(pipeline.global_batch_size, host, hosts)
        self._order: GlobalOrder | None = None

    @property
    def order(self) -> GlobalOrder:
        if self._order is None:
            self._order = self.pipeline.order.bind(self.pipeline.source.row_group_sizes)
        return self._order

    def record_indices(self, batch_position: int) -> np.ndarray:
        """Global record indices of this host's rows of the global batch that starts at
        stream position `batch_position` (a batch may straddle two epochs)."""
        first, stop = self.rows
        records = self.pipeline.records_per_epoch
        epoch, offset = divmod(batch_position + first, records)
        if offset + stop - first <= records:  # the usual case: one epoch
            return self.order.indices(epoch, np.arange(offset, offset + stop - first, dtype=np.int64))
        stream = np.arange(batch_position + first, batch_position + stop, dtype=np.int64)
        epochs, positions = np.divmod(stream, records)
        indices = np.empty_like(stream)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            indices[mask] = self.order.indices(int(epoch), positions[mask])
        return indices

    def _read_ahead(self, batch_position: int) -> None:
        """Ask the source to decode what the batch one locality span ahead will read; every
        eighth of that span is often enough not to miss a row group."""
        prefetch = getattr(self.pipeline.source, "prefetch", None)
        size = self.pipeline.global_batch_size
        ahead = -(-self.order.locality // size) * size
        total = self.pipeline.total_records
        if (
            prefetch is None
            or not ahead
            or (batch_position // size) % max(1, ahead // (8 * size))
            or (total is not None and batch_position + ahead + size > total)
        ):
            return
        prefetch(self.record_indices(batch_position + ahead))

    def batch(self, batch_position: int) -> HostBatch:
        """This host's piece of the global batch that starts at stream `batch_position`."""
        self._read_ahead(batch_position)
        indices = self.record_indices(batch_position)
        columns = table_to_columns(self.pipeline.source.take(indices))
        if self.pipeline.index_column is not None:
            columns[self.pipeline.index_column] = indices
        for transform in self.pipeline.transforms:
            try:
                columns = transform(columns)
            except ColoDataError:
                raise
            except Exception as e:
                raise TransformError(
                    f"transform {transform!r} failed on host {self.host} of {self.hosts}, batch at stream position "
                    f"{batch_position}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
                ) from e
        return _check_batch(columns, len(indices))

    def dataset(self, start_position: int) -> grain.IterDataset:
        """The host batches from stream `start_position` on, as a Grain dataset."""
        count = self.pipeline.batches_from(start_position)
        ds = (
            grain.MapDataset.range(0, _FOREVER if count is None else count)
            .map(_BatchAt(self, start_position))
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        )
        if self.workers:
            if not flags.FLAGS.is_parsed():  # Grain's multiprocessing reads absl flags
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        return ds


class _BatchAt:
    """Picklable map function: the k-th host batch after a start position."""

    def __init__(self, host: HostPipeline, start: int) -> None:
        self.host, self.start = host, start

    def __call__(self, k: int) -> HostBatch:
        return self.host.batch(self.start + k * self.host.pipeline.global_batch_size)
