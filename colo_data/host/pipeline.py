"""`HostPipeline`: one host's share of every global batch. It maps stream positions to
records through the global order, gathers them from the source, runs the transforms and
returns numpy arrays. It works a chunk of consecutive batches at a time (per-call costs
are shared) and Grain's multiprocessing can run it in worker processes, one chunk per
element, so only batches cross the process boundary."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, NamedTuple

import cloudpickle
import numpy as np

from colo_data import defaults
from colo_data.errors import ColoDataError, ConfigError, TransformError
from colo_data.host.chunk import HostBatch, HostChunk, column_schema, split_rows
from colo_data.host.packing import packed_batches
from colo_data.io.columns import Columns, table_to_columns
from colo_data.io.sources import ReadAhead
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import Prefetcher, close_iterator
from colo_data.spec.mix import Mix, MixOrder
from colo_data.spec.order import GlobalOrder, host_rows
from colo_data.spec.pack import Pack
from colo_data.spec.pipeline import Pipeline
from colo_data.telemetry.counters import (
    BATCH,
    DECODE,
    IO_WAIT,
    ORDER,
    READ,
    TRANSFORM,
    CpuMeter,
    StageTimes,
    metered,
)

if TYPE_CHECKING:
    from colo_data.host.workers import WorkerPool

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
                f"column {name!r} has {len(col)} rows after the transforms, but {rows} records went in: "
                "transforms must keep one row per record"
            )
    return columns


class HostPipeline:
    """Host `host` of `hosts`: rows `[g*B + host*B/hosts, g*B + (host+1)*B/hosts)` of each
    global batch g, transformed and batched, produced by `workers` processes (0: in this
    process). With `ahead` (and no workers), `batches` computes the chunks one ahead on a
    thread of its own, whose CPU time `cpu` samples. `stages` adds up the time, records and
    bytes of each stage, per chunk, also of the chunks that worker processes made."""

    def __init__(self, pipeline: Pipeline, host: int = 0, hosts: int = 1, workers: int = 0, ahead: bool = False) -> None:
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"workers={workers!r}: must be an int >= 0 (0 runs the pipeline in this process)")
        self.pipeline = pipeline
        self.host, self.hosts, self.workers = host, hosts, workers
        self.ahead = ahead and not workers  # worker processes already run ahead
        self.rows = host_rows(pipeline.global_batch_size, host, hosts)
        self._order: GlobalOrder | MixOrder | None = None
        self.stages = StageTimes()
        self.cpu: CpuMeter | None = None
        self.pool: WorkerPool | None = None  # given by whoever keeps workers across streams
        self._asked = (0, 0)  # stream positions of the last chunk read and the end of its read-ahead
        self._read_seen: tuple[float, ...] | None = None  # the source's read_stats at the last count

    @property
    def order(self) -> GlobalOrder | MixOrder:
        if self._order is None:
            source = self.pipeline.source
            if isinstance(source, Mix):
                self._order = source.bind(self.pipeline.order)
            else:
                self._order = self.pipeline.order.bind(source.row_group_sizes)
        return self._order

    @property
    def chunk(self) -> int:
        """Global batches computed per call: enough that a call handles about
        `defaults.CHUNK_RECORDS` of this host's records, so per-call costs are shared (packed
        batches: one)."""
        if self.pipeline.pack is not None:
            return 1
        return max(1, defaults.CHUNK_RECORDS // (self.rows[1] - self.rows[0]))

    def _stream(self, batch_position: int, count: int) -> np.ndarray:
        """Stream positions of this host's rows of `count` consecutive global batches, the
        first at stream position `batch_position`."""
        first, stop = self.rows
        size = self.pipeline.global_batch_size
        return (batch_position + first + size * np.arange(count, dtype=np.int64)[:, None] + np.arange(stop - first)).ravel()

    def record_indices(self, batch_position: int, count: int = 1) -> np.ndarray:
        """Global record indices of this host's rows of `count` consecutive global batches,
        the first at stream position `batch_position` (they may straddle epochs)."""
        return self.stream_indices(self._stream(batch_position, count))

    def stream_indices(self, stream: np.ndarray) -> np.ndarray:
        """Global record indices at stream positions `stream` (any epochs)."""
        return self.order.stream_indices(stream)

    def _share_rows(self, stream: np.ndarray, indices: np.ndarray, share: Share) -> np.ndarray:
        """Places (in `stream`) of the records whose row groups are worker `share`'s."""
        ranks = self.order.stream_group_ranks(stream, indices)
        return np.flatnonzero(ranks % share.workers == share.worker)

    def _read_ahead(self, batch_position: int, count: int, share: Share | None) -> None:
        """Ask the source to start loading what the stream reads after this chunk, as far
        as the order lets it see: one locality (the block order's window) ahead for local
        files; on object storage, `source.lookahead` localities or chunks, whichever is
        longer (the global order's next chunks). Only the span not asked for by the chunk
        before is new (of it, the row groups that are `share`'s)."""
        source = self.pipeline.source
        if not isinstance(source, ReadAhead):
            return
        size = self.pipeline.global_batch_size
        span = count * size
        locality = -(-self.order.locality // size) * size
        reach = (locality if source.lookahead == 1 else max(locality, span)) * source.lookahead
        first, stop = batch_position + span, batch_position + span + reach
        total = self.pipeline.total_records
        if total is not None:
            stop = min(stop, total // size * size)
        last, asked = self._asked
        begin = max(first, asked) if last <= batch_position <= asked else first
        self._asked = (batch_position, max(stop, begin))
        if begin >= stop:
            return
        stream = self._stream(begin, (stop - begin) // size)
        indices = self.stream_indices(stream)
        source.prefetch(indices if share is None else indices[self._share_rows(stream, indices, share)])

    def count_reads(self, stages: StageTimes) -> None:
        """Add what loading row groups cost the source since the last count (I/O wait and
        bytes fetched, decode time and bytes) to `stages`."""
        source = self.pipeline.source
        if not isinstance(source, ReadAhead):
            return
        now = source.read_stats()
        seen = self._read_seen or (0.0,) * len(now)
        self._read_seen = now
        wait, requests, fetched, decode, decoded, decoded_bytes = (a - b for a, b in zip(now, seen, strict=True))
        stages.add(IO_WAIT, wait, int(requests), int(fetched))
        stages.add(DECODE, decode, int(decoded), int(decoded_bytes))

    def batch(self, batch_position: int, count: int = 1, stages: StageTimes | None = None) -> HostBatch:
        """This host's rows of `count` consecutive global batches (one after the other), the
        first starting at stream `batch_position`; the stage timings go to `stages`
        (default: this pipeline's)."""
        return self.part(batch_position, count, stages).columns

    def part(
        self,
        batch_position: int,
        count: int = 1,
        stages: StageTimes | None = None,
        share: Share | None = None,
        read_ahead: bool = True,
    ) -> HostChunk:
        """`batch`'s rows, or with `share` those of them whose row groups are that worker's
        (the chunk's `places` say where they belong; it has no columns when there are none).
        `read_ahead=False` leaves the decoding ahead to whoever computes the next chunks."""
        stages = self.stages if stages is None else stages
        t0 = perf_counter()
        stream = self._stream(batch_position, count)
        indices = self.stream_indices(stream)
        rows = None if share is None else self._share_rows(stream, indices, share)
        if rows is not None:
            indices = indices[rows]
        t1 = perf_counter()
        stages.add(ORDER, t1 - t0, len(indices), indices.nbytes)
        if read_ahead:
            self._read_ahead(batch_position, count, share)
        if not len(indices):
            return HostChunk({}, places=rows)
        table = self.pipeline.source.take(indices)
        columns = table_to_columns(table)
        stages.add(READ, perf_counter() - t1, len(indices), table.nbytes)
        self.count_reads(stages)
        source = self.pipeline.source
        if isinstance(source, Mix):  # the index within the component, and the component
            components, local = source.locate(indices)
            if self.pipeline.index_column is not None:
                columns[self.pipeline.index_column] = local
            columns[source.component_column] = components
        elif self.pipeline.index_column is not None:
            columns[self.pipeline.index_column] = indices
        return HostChunk(self._transformed(columns, batch_position, stages), places=rows)

    def _transformed(self, columns: Columns, batch_position: int, stages: StageTimes | None = None) -> HostBatch:
        """The pipeline's transforms applied to a batch's columns, checked."""
        stages = self.stages if stages is None else stages
        rows = len(next(iter(columns.values())))
        t0 = perf_counter()
        for transform in self.pipeline.transforms:
            columns = self._apply(transform, columns, batch_position)
        t1 = perf_counter()
        batch = _check_batch(columns, rows)
        nbytes = sum(column.nbytes for column in batch.values())
        t2 = perf_counter()
        stages.add(TRANSFORM, t1 - t0, rows, nbytes)
        stages.add(BATCH, t2 - t1, rows, nbytes)
        return batch

    def _apply(self, transform: Callable[[Columns], Columns], columns: Columns, position: int) -> Columns:
        """One transform on a batch's columns; its failure or a result that is not a dict
        of columns is a TransformError naming the transform, the host and the position."""
        try:
            out = transform(columns)
        except ColoDataError:
            raise
        except Exception as e:
            raise TransformError(
                f"transform {transform!r} failed on host {self.host} of {self.hosts}, batch at stream position "
                f"{position}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            ) from e
        if not isinstance(out, Mapping):
            raise TransformError(
                f"transform {transform!r} returned {type(out).__name__}, not a dict of columns (batch at stream "
                f"position {position}): a transform returns the batch, e.g. `return {{**batch, 'x': ...}}`"
            )
        return out

    def prepared(self, transform: Callable[[Columns], Columns], columns: Columns, position: int) -> Columns:
        """`cd.Pack(prepare=...)`'s transform on records read for packing, from stream
        `position` on: as `_apply`, and it must keep one row per record."""
        rows = len(next(iter(columns.values())))
        out = self._apply(transform, columns, position)
        for name, column in out.items():
            if len(column) != rows:
                raise TransformError(
                    f"cd.Pack(prepare=...): {transform!r} made column {name!r} {len(column)} rows long from {rows} "
                    f"records (stream position {position}); a prepare transform keeps one row per record"
                )
        return out

    def _packed(self, pack: Pack, start_position: int) -> Iterator[HostChunk]:
        """Packed host batches, transformed, each with the stream position after it."""
        position = start_position
        for columns, end in packed_batches(self, pack, start_position):
            yield HostChunk(self._transformed(columns, position), end)
            position = end

    def chunks(self, start_position: int, owner: Lifecycle | None = None) -> Iterator[HostChunk]:
        """`_chunks`, each checked against the first: a column whose dtype or row shape
        changes from one chunk to a later one is a TransformError (naming the column, the
        stream position and both), on every backend, not a batch that changes type."""
        return _same_schema(self._chunks(start_position, owner), start_position, self)

    def _chunks(self, start_position: int, owner: Lifecycle | None = None) -> Iterator[HostChunk]:
        """This host's batches from stream `start_position` on, `chunk` batches at a time
        (one after the other along the rows; the last chunk may hold fewer): computed here
        when `workers` is 0, else the first here and the others `defaults.WORKER_CHUNKS`
        chunks at a time by the worker processes of `pool` (started now, owned by `owner`,
        when no pool was given). `owner` also stops the source's read-ahead thread. Packed
        batches are planned in stream order, one at a time, here (`workers` is not used for
        them)."""
        source = self.pipeline.source
        if owner is not None and isinstance(source, ReadAhead):
            owner.add("row-group read-ahead", source.stop_read_ahead)
        if self.pipeline.pack is not None:
            return self._packed(self.pipeline.pack, start_position)
        total = self.pipeline.batches_from(start_position)
        chunk = self.chunk
        if not self.workers or (total is not None and total <= chunk):
            chunk_count = _FOREVER if total is None else -(-total // chunk)
            return map(ChunkAt(self, start_position, total, chunk), range(chunk_count))
        if self.pool is None:
            from colo_data.host.workers import WorkerPool

            self.pool = WorkerPool(self.workers, owner or Lifecycle(f"host {self.host} workers"))
        # The first chunk is computed here while the workers start up and take the next ones:
        # the first batch does not wait for a worker process to import and open the files.
        first = ChunkAt(self, start_position, chunk, chunk, read_ahead=False)
        start = start_position + chunk * self.pipeline.global_batch_size
        shared = chunk * defaults.WORKER_CHUNKS
        rest_total = None if total is None else total - chunk
        indices = range(_FOREVER if rest_total is None else -(-rest_total // shared))
        payload = cloudpickle.dumps(self.pipeline)
        rest = self.pool.chunks(payload, self.host, self.hosts, start, rest_total, shared, indices)
        return _merge_stages(_head_start(first, rest), self.stages)

    def pieces(
        self, start_position: int, owner: Lifecycle, check: Callable[[HostBatch], HostBatch] | None = None
    ) -> Iterator[HostChunk]:
        """This host's batches from stream `start_position` on, one at a time, with their
        metadata; the threads and processes computing them belong to `owner`; `check` sees
        each chunk's columns on the consumer's thread (`split_rows`). With `ahead`,
        the next chunk is computed while this one's batches are handed out (else a consumer
        that prefetches a few batches runs dry while a chunk is computed: 5% input wait at
        a 2 ms step on the demo pipeline)."""
        chunks = self.chunks(start_position, owner)
        if self.ahead:
            self.cpu = CpuMeter("thread")
            chunks = Prefetcher(metered(chunks, self.cpu), 1, owner, f"colo-data-host{self.host}")
        return split_rows(chunks, self.rows[1] - self.rows[0], check)

    def batches(self, start_position: int) -> Iterator[HostBatch]:
        """This host's batches from stream `start_position` on, one at a time, as column
        dicts; whatever computes them stops when the iterator is exhausted or closed."""
        owner = Lifecycle(f"host {self.host} of {self.hosts} batches")
        pieces = self.pieces(start_position, owner)
        try:
            for piece in pieces:
                yield piece.columns
        finally:
            close_iterator(pieces)
            owner.close()


def _same_schema(chunks: Iterator[HostChunk], start: int, host: HostPipeline) -> Iterator[HostChunk]:
    """`chunks`, each with the columns, dtypes and row shapes of the first (the first
    batch fixes them); closes `chunks` when done or closed."""
    first: dict[str, str] | None = None
    position, size, rows = start, host.pipeline.global_batch_size, host.rows[1] - host.rows[0]
    try:
        for chunk in chunks:
            schema = column_schema(chunk.columns)
            if first is None:
                first = schema
            elif schema != first:
                changed = sorted(n for n in first.keys() | schema.keys() if first.get(n) != schema.get(n))
                raise TransformError(
                    f"host {host.host} of {host.hosts}: at stream position {position} the transforms gave column(s) "
                    f"{changed} as {{{', '.join(f'{n}: {schema.get(n)}' for n in changed)}}}, where the first batch had "
                    f"{{{', '.join(f'{n}: {first.get(n)}' for n in changed)}}}. The first batch fixes every column's "
                    "dtype and row shape: cast to one dtype and pad to a fixed length in the transforms"
                )
            position = chunk.end if chunk.end is not None else position + size * (chunk.rows // rows)
            yield chunk
    finally:
        close_iterator(chunks)


def _head_start(first: ChunkAt, rest: Iterator[HostChunk]) -> Iterator[HostChunk]:
    """Chunk 0 computed on this thread, then the workers' chunks; closes `rest` when done or
    closed."""
    try:
        yield first(0)
        yield from rest
    finally:
        close_iterator(rest)


def _merge_stages(chunks: Iterator[HostChunk], stages: StageTimes) -> Iterator[HostChunk]:
    """Worker processes' chunks, whose stage counters are added to `stages`; closes `chunks`
    when done or closed."""
    try:
        for chunk in chunks:
            if chunk.stages is not None:
                stages.merge(chunk.stages)
                chunk.stages = None
            yield chunk
    finally:
        close_iterator(chunks)


class Share(NamedTuple):
    """Worker `worker` of `workers`: the records whose row groups come at a rank `worker`
    modulo `workers` in the epoch's reading order (`GlobalOrder.group_ranks`) are its to
    compute, so that no two workers decode the same row group."""

    worker: int
    workers: int


class ChunkAt:
    """Chunk i of the host's batches after stream position `start` (`total` batches in the
    stream from there, None: endless), `batches` global batches a chunk. With `share` (in a
    worker process), that worker's share of the chunk, carrying its stage counters back with
    it; `read_ahead=False`: no decoding ahead (worker processes do it for the chunks after
    this one)."""

    def __init__(
        self,
        host: HostPipeline,
        start: int,
        total: int | None,
        batches: int,
        share: Share | None = None,
        read_ahead: bool = True,
    ) -> None:
        self.host, self.start, self.total, self.batches = host, start, total, batches
        self.share, self.read_ahead = share, read_ahead

    def __call__(self, i: int) -> HostChunk:
        chunk, size = self.batches, self.host.pipeline.global_batch_size
        count = chunk if self.total is None else min(chunk, self.total - i * chunk)
        position = self.start + i * chunk * size
        if self.share is None:
            return self.host.part(position, count, read_ahead=self.read_ahead)
        stages = StageTimes()
        part = self.host.part(position, count, stages, self.share, self.read_ahead)
        part.stages = stages.values
        return part
