"""`HostPipeline`: one host's share of every global batch, as a stream of chunks from a
stream position on. Its one door is `chunks` (and `kept`, for a tool that asks which records
the filters take). The work of each chunk (`ChunkWork`) is computed here, a chunk ahead on
a thread of its own, or shared out to a pool of worker processes, so only batches cross the
process boundary; packed pipelines are planned here in stream order."""

from __future__ import annotations

from collections.abc import Iterator

import cloudpickle
import numpy as np

from colo_data import defaults
from colo_data.errors import TransformError
from colo_data.host.chunk import HostChunk, column_schema, schema_change, split_rows
from colo_data.host.chunk_work import ChunkAt, ChunkPool, ChunkWork
from colo_data.host.filtering import filtered_batches, kept, with_index
from colo_data.host.packing import packed_batches
from colo_data.host.partitioned import partitioned_batches
from colo_data.host.pool_policy import PoolPolicy
from colo_data.host.pool_schedule import PooledChunks, SlicedChunks
from colo_data.io.columns import table_to_columns
from colo_data.io.record_source import ReadAhead
from colo_data.pipeline import parts
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import Prefetcher, close_iterator
from colo_data.telemetry.counters import POOL_WAIT, CpuMeter, StageTimes, metered
from colo_data.telemetry.quality import QualityCounts

_FOREVER = 2**62


class HostPipeline:
    """Host `host` of `hosts`: rows `rows` (`[host*B/hosts, (host+1)*B/hosts)`) of each
    global batch g of `pipeline`, transformed and batched.

    Args:
        pipeline: the dataset definition.
        host: this host's index along the mesh's data axis.
        hosts: the host count.
        pool: worker processes that compute the chunks (None: this process). A pool is
            started by its owner (a loader, a sidecar) and outlives the streams.
        ahead: make the next chunk (here, or take it from the pool) on a thread of its own
            while this one is handed out (else a consumer that prefetches a few batches runs
            dry while a chunk is computed: 5% input wait at a 2 ms step on the demo
            pipeline); `cpu` samples that thread's CPU time.

    `stages` adds up the time, records and bytes of each stage, per chunk, also of the
    chunks that worker processes made; `worker_stages` those of each worker's shares alone;
    `quality` the data-quality counts of all of them.
    """

    def __init__(
        self, pipeline: Pipeline, host: int = 0, hosts: int = 1, pool: ChunkPool | None = None, ahead: bool = False
    ) -> None:
        self.work = ChunkWork(pipeline, host, hosts)
        self.pipeline, self.host, self.hosts = pipeline, host, hosts
        self.rows = self.work.rows
        self.stages: StageTimes = self.work.stages
        self.quality: QualityCounts = self.work.quality
        self.worker_stages: list[StageTimes] = []  # by worker (process or Ray actor): the stages of its shares
        self.pool = pool
        self.ahead = ahead
        self.cpu: CpuMeter | None = None

    @property
    def chunk(self) -> int:
        """Global batches computed per call (see `ChunkWork.chunk`)."""
        return self.work.chunk

    def stream_indices(self, stream: np.ndarray) -> np.ndarray:
        """Global record indices at stream positions `stream` (any epochs)."""
        return self.work.stream_indices(stream)

    def kept(self, indices: np.ndarray) -> np.ndarray | None:
        """The filters' verdicts (the pipeline's `keep` and its pack's) on the records at
        global `indices`, read and given the index column as the filters see them; None
        without a filter."""
        table = with_index(self.work, self.pipeline.source.take(indices), indices)
        return kept(self.work, table_to_columns(table), len(indices))

    def chunks(self, start_position: Position, owner: Lifecycle | None = None, batches: int | None = None) -> Iterator[HostChunk]:
        """This host's batches from stream `start_position` on, stacked along the rows,
        `batches` host batches a chunk (the last may hold fewer; None: as computed, `chunk`
        batches or more). The threads and processes computing them belong to `owner`; with
        none, to the iterator, which stops them when it is exhausted or closed.

        A column whose dtype or row shape changes from one chunk to a later one is a
        TransformError (naming the column, the stream position and both), on every
        backend, not a batch that changes type.
        """
        run = Lifecycle(f"host {self.host} of {self.hosts} chunks") if owner is None else owner
        size = self.pipeline.global_batch_size
        stream = same_schema(self._computed(start_position, run), start_position, self.host, self.hosts, len(self.rows), size)
        if self.ahead:
            self.cpu = CpuMeter("thread")
            stream = Prefetcher(metered(stream, self.cpu), 1, run, f"colo-data-host{self.host}")
        if batches is not None:
            stream = split_rows(stream, len(self.rows) * batches)
        return stream if owner is not None else owning(stream, run)

    def _computed(self, start: Position, owner: Lifecycle) -> Iterator[HostChunk]:
        """The chunks as computed: here, `chunk` batches at a time, or with a pool as
        `_pooled` shares them out. `owner` stops the source's read-ahead. Packed batches are
        planned in stream order, one at a time, here (the pool is not used for them), and so
        are filtered ones; a partitioned pipeline's partitions each at their own pace, from
        their position `start` (`colo_data.pipeline.parts`; or theirs at a stream position)."""
        source = self.pipeline.source
        if isinstance(source, ReadAhead):
            owner.add("row-group read-ahead", source.stop_read_ahead)
        if self.pipeline.partitioned:
            at = start if isinstance(start, np.ndarray) else parts.start(self.pipeline.partitioning.own(start))
            if self.pool is not None and len(self.pipeline.partitioning.owned(self.host, self.hosts)) > 1:
                return self._sliced(self.pool, at)
            return (HostChunk(columns, ends) for columns, ends in partitioned_batches(self.work, at))
        start_position = int(start)  # one stream position: the pipeline is not partitioned
        if self.pipeline.pack is not None:
            return self._packed(start_position)
        if self.pipeline.keep is not None:
            return (HostChunk(columns, end) for columns, end in filtered_batches(self.work, start_position))
        total = self.pipeline.batches_from(start_position)
        chunk = self.chunk
        if self.pool is None or (total is not None and total <= chunk):
            chunk_count = _FOREVER if total is None else -(-total // chunk)
            return map(ChunkAt(self.work, start_position, total, chunk), range(chunk_count))
        return self._pooled(self.pool, start_position, total)

    def _pooled(self, pool: ChunkPool, start_position: int, total: int | None) -> Iterator[HostChunk]:
        """Chunks made here, and by as many of the pool's workers as pay (`PooledChunks`)."""
        size, chunk = self.pipeline.global_batch_size, self.chunk
        yield from PooledChunks(  # made at the first chunk asked for, as the stream's policy measures from then
            pool,
            PoolPolicy(pool, chunk * len(self.rows)),
            lambda position: pool.stream(cloudpickle.dumps(self.pipeline), self.host, self.hosts, position),
            lambda position, count, read_ahead: self.work.compute(position, count, read_ahead=read_ahead),
            self._took,
            lambda seconds, rows: self.stages.add(POOL_WAIT, seconds, rows, 0),
            start=start_position,
            end=None if total is None else start_position + total * size,
            size=size,
            chunk=chunk,
            rows=len(self.rows),
        )

    def _took(self, part: HostChunk) -> None:
        """The stage and data-quality counters a chunk from the pool carries, added to this host's."""
        if part.stages is not None:
            self.stages.merge(part.stages)
            part.stages = None
        if part.quality is not None:
            self.quality.merge(part.quality)
            part.quality = None
        for i, values in enumerate(part.worker_stages or ()):
            if i == len(self.worker_stages):
                self.worker_stages.append(StageTimes())
            if values is not None:
                self.worker_stages[i].merge(values)
        part.worker_stages = None

    def _sliced(self, pool: ChunkPool, start: np.ndarray) -> Iterator[HostChunk]:
        """A partitioned pipeline's batches with a pool: its partitions cut into slices, the
        first computed here, the others by the pool's workers (`SlicedChunks`)."""
        rows = len(self.rows)
        chunk = max(1, defaults.CHUNK_RECORDS // rows)  # batches a request
        partitioning = self.pipeline.partitioning
        yield from SlicedChunks(  # made at the first chunk asked for, as the stream's policy measures from then
            pool,
            PoolPolicy(pool, chunk * rows),
            lambda: pool.stream(cloudpickle.dumps(self.pipeline), self.host, self.hosts, 0),
            lambda position, owned: partitioned_batches(self.work, position, owned),
            lambda workers: len(partitioning.kept(self.host, self.hosts, workers)),
            self._took,
            lambda seconds, rows: self.stages.add(POOL_WAIT, seconds, rows, 0),
            start=start,
            owned=partitioning.owned(self.host, self.hosts),
            chunk=chunk,
            rows=rows,
        )

    def _packed(self, start_position: int) -> Iterator[HostChunk]:
        """Packed host batches, transformed, each with the stream position after it."""
        assert self.pipeline.pack is not None
        position = start_position
        for columns, end in packed_batches(self.work, self.pipeline.pack, start_position):
            yield HostChunk(self.work.transformed(columns, position), end)
            position = end


def owning(chunks: Iterator[HostChunk], run: Lifecycle) -> Iterator[HostChunk]:
    """`chunks`, and when they end or are closed, what `run` started for them."""
    try:
        yield from chunks
    finally:
        close_iterator(chunks)
        run.close()


def same_schema(
    chunks: Iterator[HostChunk], start: Position, host: int, hosts: int, rows: int, size: int
) -> Iterator[HostChunk]:
    """`chunks` of host `host` of `hosts` (`rows` rows of each global batch of `size`), each
    with the columns, dtypes and row shapes of the first (the first batch fixes them), for
    native and Grain pipelines alike; closes `chunks` when done or closed."""
    first: dict[str, str] | None = None
    position = start
    batches = 0
    try:
        for chunk in chunks:
            schema = column_schema(chunk.columns)
            if first is None:
                first = schema
            elif schema != first:
                changed, had, now = schema_change(first, schema)
                where = f"stream position {position}" if isinstance(position, int) else f"batch {batches} of the run"
                raise TransformError(
                    f"host {host} of {hosts}: at {where} the transforms gave column(s) "
                    f"{changed} as {now}, where the first batch had {had}. The first batch fixes every column's "
                    "dtype and row shape: cast to one dtype and pad to a fixed length in the transforms"
                )
            position = chunk.end if chunk.end is not None else position + size * (chunk.rows // rows)
            batches += chunk.rows // rows
            yield chunk
    finally:
        close_iterator(chunks)
