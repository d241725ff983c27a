"""Sequence packing and record filtering with exactly-once across host counts.

A packed global batch is `rows` rows of `length` tokens. Records, in stream order from the
batch's first stream position, fill row 0 until the next one does not fit (its tokens or
the row's `max_segments`), then row 1, and so on; records that `keep` rejects are passed
over. The plan depends only on the records' lengths, so every host computes the same plan
for the whole global batch (reading the lengths of all its records) and builds only its own
rows. The batch's end is a stream position like any other: a state saved after it restores
on any host count, with any batch size, and every kept record lands in exactly one row."""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter

import numpy as np
import pyarrow as pa

from colo_data.errors import ConfigError, TransformError
from colo_data.host.chunk_work import ChunkWork
from colo_data.io.columns import Columns, table_to_columns
from colo_data.io.sources import ReadAhead
from colo_data.spec.mix import Mix
from colo_data.spec.pack import POSITIONS, SEGMENT_IDS, Pack
from colo_data.telemetry.counters import BATCH, ORDER, READ, TRANSFORM


def plan(lengths: np.ndarray, rows: int, length: int, max_segments: int, complete: bool) -> tuple[int, np.ndarray, np.ndarray]:
    """Place records (their `lengths`, -1 for a dropped record) in order into `rows` rows:
    returns how many records the batch consumes and each consumed record's row and token
    offset (-1 for dropped ones). Stops at the first record that fits no more; with
    `complete` False (more records exist than `lengths` shows) it returns 0 consumed
    unless the batch filled up, so that the caller can look further ahead."""
    row_of = np.full(len(lengths), -1, np.int64)
    offset_of = np.full(len(lengths), -1, np.int64)
    row, used, segments = 0, 0, 0
    for i, n in enumerate(lengths.tolist()):
        if n < 0:
            continue
        if used + n > length or segments == max_segments:
            row, used, segments = row + 1, 0, 0
            if row == rows:
                return i, row_of[:i], offset_of[:i]
        row_of[i], offset_of[i] = row, used
        used, segments = used + n, segments + 1
    if not complete:
        return 0, row_of[:0], offset_of[:0]
    return len(lengths), row_of, offset_of


def _list_parts(column: pa.ChunkedArray | pa.Array, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (one more than records) and values of a list column, as numpy."""
    if isinstance(column, np.ndarray):
        raise TransformError(f"cd.Pack({name!r}): column is {column.dtype}, expected a list column")
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise TransformError(f"cd.Pack({name!r}): column is {array.type}, expected a list column")
    if array.null_count:
        raise TransformError(f"cd.Pack({name!r}): the column has null records; fill or drop them first")
    offsets = np.asarray(array.offsets, dtype=np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]] if len(offsets) else values


class _Window:
    """Records of the stream from `start` on, read ahead as needed: their global indices,
    the packed column's offsets and values, and their lengths (-1: dropped by `keep`)."""

    def __init__(self, work: ChunkWork, pack: Pack, start: int) -> None:
        self.work, self.pack, self.start = work, pack, start
        self.indices = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.offsets = np.zeros(1, np.int64)
        self.values: np.ndarray | None = None

    def extend(self, count: int, total: int | None) -> bool:
        """Read `count` more records (fewer at the stream's end); False when none are left."""
        first = self.start + len(self.indices)
        stop = first + count if total is None else min(first + count, total)
        if stop <= first:
            return False
        source = self.work.pipeline.source
        ahead = stop + count if total is None else min(stop + count, total)
        t0 = perf_counter()
        indices = self.work.stream_indices(np.arange(first, stop, dtype=np.int64))
        t1 = perf_counter()
        if isinstance(source, ReadAhead) and ahead > stop:  # the next read's row groups decode meanwhile
            source.prefetch(self.work.stream_indices(np.arange(stop, ahead, dtype=np.int64)))
        table = source.take(indices)
        self.work.stages.add(ORDER, t1 - t0, len(indices), indices.nbytes)
        self.work.stages.add(READ, perf_counter() - t1, len(indices), table.nbytes)
        self.work.count_reads(self.work.stages)
        columns = table_to_columns(table)
        t2 = perf_counter()
        for transform in self.pack.prepare:  # e.g. cd.tokenize: the packed column's lengths come after it
            columns = self.work.prepared(transform, columns, first)
        if self.pack.prepare:
            self.work.stages.add(TRANSFORM, perf_counter() - t2, len(indices), 0)
        if self.pack.column not in columns:
            where = "after Pack(prepare=...)" if self.pack.prepare else "in the source"
            raise ConfigError(f"cd.Pack: no column {self.pack.column!r} {where}; there are {sorted(columns)}")
        offsets, values = _list_parts(columns[self.pack.column], self.pack.column)
        lengths = np.minimum(np.diff(offsets), self.pack.length)
        if self.pack.keep is not None:
            kept = np.asarray(self.pack.keep(columns), dtype=bool)
            if kept.shape != (len(indices),):
                raise TransformError(f"cd.Pack keep={self.pack.keep!r} returned shape {kept.shape}, expected ({len(indices)},)")
            lengths = np.where(kept, lengths, -1)
        self.indices = np.concatenate([self.indices, indices])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.offsets = np.concatenate([self.offsets[:-1], offsets + self.offsets[-1]])
        self.values = values if self.values is None else np.concatenate([self.values, values])
        return True

    def drop(self, count: int) -> None:
        """Forget the first `count` records: the stream has moved past them."""
        self.start += count
        self.indices, self.lengths = self.indices[count:], self.lengths[count:]
        cut = self.offsets[count]
        assert self.values is not None
        self.values, self.offsets = self.values[cut:], self.offsets[count:] - cut


def packed_batches(work: ChunkWork, pack: Pack, start_position: int) -> Iterator[tuple[Columns, int]]:
    """Host `work.host`'s rows of each packed global batch from stream `start_position` on,
    with the stream position after the batch. The stream ends with its last records, in a
    batch that may not be full."""
    pipeline = work.pipeline
    rows, first_row, stop_row = pipeline.global_batch_size, work.rows.start, work.rows.stop
    total = pipeline.total_records
    window = _Window(work, pack, start_position)
    mix = pipeline.source if isinstance(pipeline.source, Mix) else None
    ahead = rows * pack.max_segments  # a batch never holds more records than this
    while True:
        if len(window.indices) < ahead:  # read ahead a whole batch's worst case at once: fewer, larger reads
            window.extend(ahead, total)
        t0 = perf_counter()
        consumed, row_of, offset_of = plan(window.lengths, rows, pack.length, pack.max_segments, False)
        while not consumed:  # filtered records used up the look-ahead: look further
            if not window.extend(max(ahead, len(window.indices)), total):
                consumed, row_of, offset_of = plan(window.lengths, rows, pack.length, pack.max_segments, True)
                if not (row_of >= 0).any():  # the stream's last records were all dropped
                    return
                break
            consumed, row_of, offset_of = plan(window.lengths, rows, pack.length, pack.max_segments, False)
        batch = _host_rows(window, pack, row_of, offset_of, first_row, stop_row, pipeline.index_column, mix)
        work.stages.add(BATCH, perf_counter() - t0, consumed, sum(column.nbytes for column in batch.values()))
        end = window.start + consumed
        window.drop(consumed)
        yield batch, end


def _host_rows(
    window: _Window,
    pack: Pack,
    row_of: np.ndarray,
    offset_of: np.ndarray,
    first_row: int,
    stop_row: int,
    index_column: str | None,
    mix: Mix | None,
) -> Columns:
    """Rows `[first_row, stop_row)` of the plan, built from the window's values. From a
    `cd.Mix`, the index column holds each record's index within its component, and the
    mixture's component column each record's component (-1 where a row has no record)."""
    height, length = stop_row - first_row, pack.length
    mine = np.flatnonzero((row_of >= first_row) & (row_of < stop_row))
    rows = row_of[mine] - first_row
    sizes = window.lengths[mine]
    assert window.values is not None
    tokens = np.full((height, length), pack.pad_value, dtype=window.values.dtype)
    segment_ids = np.zeros((height, length), np.int32)
    positions = np.zeros((height, length), np.int32)
    # the segment number of each placed record within its row: 1, 2, ...
    new_row = np.r_[True, rows[1:] != rows[:-1]] if len(rows) else np.zeros(0, bool)
    starts_at = np.flatnonzero(new_row)
    segment = np.arange(len(rows)) - np.repeat(starts_at, np.diff(np.r_[starts_at, len(rows)])) + 1
    ramp = np.arange(length, dtype=np.int32)
    starts, values = window.offsets[mine], window.values
    placed = zip(rows.tolist(), offset_of[mine].tolist(), starts.tolist(), sizes.tolist(), segment.tolist(), strict=True)
    for row, offset, start, size, seg in placed:
        # one slice copy per record: a few dozen a batch, cheaper than a gather per token
        tokens[row, offset : offset + size] = values[start : start + size]
        segment_ids[row, offset : offset + size] = seg
        positions[row, offset : offset + size] = ramp[:size]
    batch: Columns = {pack.column: tokens, SEGMENT_IDS: segment_ids, POSITIONS: positions}
    indices = window.indices[mine]
    if mix is not None:
        components, indices = mix.locate(indices)
        placed_components = np.full((height, pack.max_segments), -1, np.int32)
        placed_components[rows, segment - 1] = components
        batch[mix.component_column] = placed_components
    if index_column is not None:
        records = np.full((height, pack.max_segments), -1, np.int64)
        records[rows, segment - 1] = indices
        batch[index_column] = records
    return batch
