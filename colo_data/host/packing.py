"""Sequence packing and record filtering with exactly-once across host counts.

A packed global batch is `rows` rows of `length` tokens. Records, in stream order from the
batch's first position, fill row 0 until the next one does not fit (its tokens or
the row's `max_segments`), then row 1, and so on; records that `keep` rejects are passed
over. The plan depends only on the records' lengths, so every host computes the same plan
for the whole global batch (reading the lengths of all its records) and builds only its own
rows. The batch's end is a position like any other: a state saved after it restores
on any host count, with any batch size, and every kept record lands in exactly one row."""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from colo_data.errors import ConfigError, TransformError
from colo_data.host.chunk_work import ChunkWork
from colo_data.host.filtering import check_accepting, count_verdicts, filters, kept, rejected_run, taken
from colo_data.io.columns import Columns, table_to_columns
from colo_data.pipeline.pack import Pack
from colo_data.pipeline.stream import Stream
from colo_data.pipeline.transforms import draws
from colo_data.telemetry.counters import BATCH, TRANSFORM
from colo_data.telemetry.quality import PACKED, QualityCounts


def plan(
    lengths: np.ndarray, rows: int, length: int, max_segments: int, complete: bool, method: str = "next_fit"
) -> tuple[int, np.ndarray, np.ndarray]:
    """Place records (their `lengths`, -1 for a dropped record) in order into `rows` rows by
    `method` (see `cd.Pack`): returns how many records the batch consumes and each consumed
    record's row and token offset (-1 for dropped ones); within a row, records lie in stream
    order. Stops at the first record that fits no more; with `complete` False (more records
    exist than `lengths` shows) it returns 0 consumed unless the batch filled up, so that
    the caller can look further ahead."""
    sizes = lengths.tolist()
    row_of = [-1] * len(sizes)
    if method == "next_fit":
        stop = _next_fit(sizes, row_of, rows, length, max_segments)
    else:
        stop = _fit(sizes, row_of, rows, length, max_segments, method == "best_fit")
    if stop is None:
        if not complete:
            return 0, np.zeros(0, np.int64), np.zeros(0, np.int64)
        stop = len(sizes)
    row_at = np.array(row_of[:stop], np.int64)
    return stop, row_at, _offsets(row_at, lengths[:stop])


def _next_fit(sizes: list[int], row_of: list[int], rows: int, length: int, max_segments: int) -> int | None:
    """One row after the other; the place of the first record that fits no more, or None."""
    row, used, segments = 0, 0, 0
    for i, n in enumerate(sizes):
        if n < 0:
            continue
        if used + n > length or segments == max_segments:
            row, used, segments = row + 1, 0, 0
            if row == rows:
                return i
        row_of[i] = row
        used, segments = used + n, segments + 1
    return None


def _fit(sizes: list[int], row_of: list[int], rows: int, length: int, max_segments: int, best: bool) -> int | None:
    """First fit (the first row with room) or best fit (the row it fills most; when it fits
    nowhere, the batch's records placed again longest first, each where it fits tightest);
    the place of the first record that fits no more, or None."""
    free, count = [length] * rows, [0] * rows
    placed: list[int] = []
    for i, n in enumerate(sizes):
        if n < 0:
            continue
        row = _row_for(n, free, count, max_segments, best)
        if row is None and best:
            again = _decreasing([*placed, i], sizes, rows, length, max_segments)
            if again is not None:
                for j, r in zip([*placed, i], again[0], strict=True):
                    row_of[j] = r
                free, count = again[1], again[2]
                placed.append(i)
                continue
        if row is None:
            return i
        row_of[i] = row
        free[row] -= n
        count[row] += 1
        placed.append(i)
    return None


def _row_for(n: int, free: list[int], count: list[int], max_segments: int, best: bool) -> int | None:
    """The row for a record of `n` tokens: the first with room, or (`best`) the one with the
    least room that fits it (the first of those); None if none has room."""
    chosen = None
    for row, room in enumerate(free):
        if room >= n and count[row] < max_segments:
            if not best:
                return row
            if chosen is None or room < free[chosen]:
                chosen = row
    return chosen


def _decreasing(
    records: list[int], sizes: list[int], rows: int, length: int, max_segments: int
) -> tuple[list[int], list[int], list[int]] | None:
    """`records` placed longest first (ties in stream order), each in the row it fits
    tightest: their rows (in the order given) and the rows' room and record counts; None if
    one fits nowhere."""
    free, count = [length] * rows, [0] * rows
    row_of = dict.fromkeys(records, -1)
    for j in sorted(records, key=lambda j: -sizes[j]):
        row = _row_for(sizes[j], free, count, max_segments, True)
        if row is None:
            return None
        row_of[j] = row
        free[row] -= sizes[j]
        count[row] += 1
    return [row_of[j] for j in records], free, count


def _offsets(row_of: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each placed record's token offset in its row: the lengths of the records before it
    in the same row (stream order); -1 for records not placed."""
    offsets = np.full(len(row_of), -1, np.int64)
    placed = np.flatnonzero(row_of >= 0)
    if len(placed):
        order = placed[np.argsort(row_of[placed], kind="stable")]  # by row, stream order within
        sizes = lengths[order]
        ends = np.cumsum(sizes)
        rows = row_of[order]
        first = np.r_[True, rows[1:] != rows[:-1]]
        row_start = np.maximum.accumulate(np.where(first, ends - sizes, 0))
        offsets[order] = ends - sizes - row_start
    return offsets


def _list_parts(column: pa.ChunkedArray | pa.Array | np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (one more than records) and values of a list column, as numpy (a 2-D numpy
    column: records of one length)."""
    if isinstance(column, np.ndarray):
        if column.ndim != 2:
            raise TransformError(f"cd.Pack({name!r}): column is {column.dtype}, expected a list column")
        return np.arange(len(column) + 1, dtype=np.int64) * column.shape[1], column.reshape(-1)
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise TransformError(f"cd.Pack({name!r}): column is {array.type}, expected a list column")
    if array.null_count:
        raise TransformError(f"cd.Pack({name!r}): the column has null records; fill or drop them first")
    offsets = np.asarray(array.offsets, dtype=np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]] if len(offsets) else values


class Window:
    """Records of a stream from `start` on, as read ahead: their global indices, each packed
    column's offsets and values, and the records' slot lengths (their longest packed column,
    at most the row length; -1: dropped by `keep`). A partition's window counts positions
    in the partition's own stream."""

    def __init__(self, pack: Pack, start: int) -> None:
        self.pack, self.start = pack, start
        self.indices = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.offsets = {name: np.zeros(1, np.int64) for name in pack.columns}
        self.values: dict[str, np.ndarray] = {}

    def append(self, records: Records, first: int, stop: int) -> None:
        """Add records `[first, stop)` of `records` (the next ones of this stream)."""
        self.indices = np.concatenate([self.indices, records.indices[first:stop]])
        self.lengths = np.concatenate([self.lengths, records.lengths[first:stop]])
        for name, offsets in records.offsets.items():
            piece = offsets[first : stop + 1]
            values = records.values[name][piece[0] : piece[-1]]
            self.offsets[name] = np.concatenate([self.offsets[name][:-1], piece - piece[0] + self.offsets[name][-1]])
            self.values[name] = np.concatenate([self.values[name], values]) if name in self.values else values

    def drop(self, count: int) -> None:
        """Forget the first `count` records: the stream has moved past them."""
        self.start += count
        self.indices, self.lengths = self.indices[count:], self.lengths[count:]
        for name, offsets in self.offsets.items():
            cut = offsets[count]
            self.values[name], self.offsets[name] = self.values[name][cut:], offsets[count:] - cut

    def rejected(self) -> int:
        """Records that `keep` rejected in a row at the window's end."""
        return rejected_run(self.lengths >= 0, 0)

    def planned(self, rows: int, complete: bool) -> tuple[int, np.ndarray, np.ndarray]:
        """`plan` over the window's records (`complete`: no more records come)."""
        pack = self.pack
        return plan(self.lengths, rows, pack.length, pack.max_segments, complete, pack.method)


class Records(NamedTuple):
    """Records read for packing, prepared: their global indices, slot lengths (-1: dropped
    by `keep`), and each packed column's offsets (one more than records) and values."""

    indices: np.ndarray
    lengths: np.ndarray
    offsets: dict[str, np.ndarray]
    values: dict[str, np.ndarray]


def read_records(work: ChunkWork, pack: Pack, positions: np.ndarray, ahead: np.ndarray) -> Records:
    """The records at positions `positions`, read, prepared (`pack.prepare`), measured
    and judged by `keep`; a source that reads ahead starts on `ahead`'s meanwhile."""
    indices, table = taken(work, positions, ahead)
    columns = table_to_columns(table)
    t2 = perf_counter()
    keys = work.order.record_keys(positions, indices) if draws(pack.prepare) else None
    first = int(positions[0]) if len(positions) else 0
    for transform in pack.prepare:  # e.g. cd.tokenize: the packed column's lengths come after it
        columns = work.prepared(transform, columns, first, keys)
    if pack.prepare:
        work.stages.add(TRANSFORM, perf_counter() - t2, len(indices), 0)
    lengths = np.zeros(len(indices), np.int64)
    offsets, values = {}, {}
    for name in pack.columns:
        if name not in columns:
            where = "after Pack(prepare=...)" if pack.prepare else "in the source"
            raise ConfigError(f"cd.Pack: no column {name!r} {where}; there are {sorted(columns)}")
        offsets[name], values[name] = _list_parts(columns[name], name)
        lengths = np.maximum(lengths, np.minimum(np.diff(offsets[name]), pack.length))
    verdict = kept(work, columns, len(indices))  # the pipeline's keep and the pack's
    if verdict is not None and not verdict.all():
        lengths = np.where(verdict, lengths, -1)
        for name in pack.columns:  # never placed: a window looking past many of them holds none of their tokens
            offsets[name], values[name] = _accepted_only(offsets[name], values[name], verdict)
    return Records(indices, lengths, offsets, values)


def _accepted_only(offsets: np.ndarray, values: np.ndarray, verdict: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's offsets and values with the rejected records' lists emptied."""
    sizes = np.diff(offsets)
    return np.r_[0, np.cumsum(sizes * verdict)], values[np.repeat(verdict, sizes)]


def _extend(work: ChunkWork, window: Window, count: int, total: int | None) -> bool:
    """Read `count` more records into `window` (fewer at the stream's end), the next read's
    row groups started; False when none are left."""
    first = window.start + len(window.indices)
    stop = first + count if total is None else min(first + count, total)
    if stop <= first:
        return False
    ahead = stop + count if total is None else min(stop + count, total)
    records = read_records(work, window.pack, np.arange(first, stop, dtype=np.int64), np.arange(stop, ahead, dtype=np.int64))
    window.append(records, 0, stop - first)
    check_accepting(work, window.rejected(), f"the stream, up to position {stop}")
    return True


def packed_batches(work: ChunkWork, pack: Pack, start_position: int) -> Iterator[tuple[Columns, int]]:
    """Host `work.host`'s rows of each packed global batch from `start_position` on,
    with the position after the batch. The stream ends with its last records, in a
    batch that may not be full."""
    pipeline = work.pipeline
    rows, first_row, stop_row = pipeline.global_batch_size, work.rows.start, work.rows.stop
    total = pipeline.total_records
    window = Window(pack, start_position)
    ahead = rows * pack.max_segments  # a batch never holds more records than this
    while True:
        if len(window.indices) < ahead:  # read ahead a whole batch's worst case at once: fewer, larger reads
            _extend(work, window, ahead, total)
        t0 = perf_counter()
        consumed, row_of, offset_of = window.planned(rows, False)
        while not consumed:  # filtered records used up the look-ahead: look further
            if not _extend(work, window, max(ahead, len(window.indices)), total):
                consumed, row_of, offset_of = window.planned(rows, True)
                if not (row_of >= 0).any():  # the stream's last records were all dropped
                    return
                break
            consumed, row_of, offset_of = window.planned(rows, False)
        batch = packed_rows(window, row_of, offset_of, first_row, stop_row, pipeline.index_column, pipeline.stream, work.quality)
        work.stages.add(BATCH, perf_counter() - t0, consumed, sum(column.nbytes for column in batch.values()))
        if filters(work):
            count_verdicts(work, window.lengths[:consumed] >= 0)
        end = window.start + consumed
        window.drop(consumed)
        yield batch, end


def packed_rows(
    window: Window,
    row_of: np.ndarray,
    offset_of: np.ndarray,
    first_row: int,
    stop_row: int,
    index_column: str | None,
    stream: Stream,
    quality: QualityCounts,
) -> Columns:
    """Rows `[first_row, stop_row)` of the plan, built from the window's values, with the
    columns that name each row's records (`Stream.record_columns`: the index column, a
    mixture's component column), -1 where a row has no record. Each packed column's rows
    and its records' lengths are counted in `quality`."""
    pack = window.pack
    height, length = stop_row - first_row, pack.length
    mine = np.flatnonzero((row_of >= first_row) & (row_of < stop_row))
    mine = mine[np.lexsort((offset_of[mine], row_of[mine]))]  # by row, then place in the row
    rows = row_of[mine] - first_row
    # the segment number of each placed record within its row: 1, 2, ...
    new_row = np.r_[True, rows[1:] != rows[:-1]] if len(rows) else np.zeros(0, bool)
    starts_at = np.flatnonzero(new_row)
    segment = np.arange(len(rows)) - np.repeat(starts_at, np.diff(np.r_[starts_at, len(rows)])) + 1
    ramp = np.arange(length, dtype=np.int32)
    batch: Columns = {}
    for name in pack.columns:
        values, starts = window.values[name], window.offsets[name][mine]
        read = window.offsets[name][mine + 1] - starts  # the records' lengths as read
        quality.column(PACKED, name, length, read, height)
        sizes = np.minimum(read, length)
        tokens = np.full((height, length), pack.pad_value, dtype=values.dtype)
        ids_name, positions_name = pack.layout_columns(name)
        own = ids_name not in batch  # colo-data names: one pair for all the columns, of the slots
        segment_ids = np.zeros((height, length), np.int32) if own else batch[ids_name]
        positions = np.zeros((height, length), np.int32) if own else batch[positions_name]
        slots = window.lengths[mine] if pack.names == "colo-data" else sizes
        places = (rows, offset_of[mine], starts, sizes, slots, segment)
        placed = zip(*(p.tolist() for p in places), strict=True)
        for row, offset, start, size, slot, seg in placed:
            # one slice copy per record: a few dozen a batch, cheaper than a gather per token
            tokens[row, offset : offset + size] = values[start : start + size]
            if own:
                segment_ids[row, offset : offset + slot] = seg
                positions[row, offset : offset + slot] = ramp[:slot]
        batch[name], batch[ids_name], batch[positions_name] = tokens, segment_ids, positions
    for name, column in stream.record_columns(window.indices[mine], index_column).items():
        padded = np.full((height, pack.max_segments), -1, column.dtype)  # -1 where a row has no record
        padded[rows, segment - 1] = column
        batch[name] = padded
    return batch
