"""`HostPipeline`: one host's share of every global batch, as a feed of chunks from a
position on. Its one door is `chunks` (and `kept`, for a tool that asks which records
the filters take). The work of each chunk (`ChunkWork`) is computed here, a chunk ahead on
a thread of its own, or shared out to a pool of worker processes as many as
`WorkerPolicy` counts, so only batches cross the process boundary; packed pipelines are
planned here in stream order."""

from __future__ import annotations

from collections.abc import Iterator

import cloudpickle
import numpy as np

from colo_data.errors import TransformError
from colo_data.host.chunk import HostChunk, column_schema, schema_change, split_rows
from colo_data.host.chunk_work import ChunkPool, ChunkWork, PoolFeed
from colo_data.host.filtering import filtered_batches, kept, with_index
from colo_data.host.packing import packed_batches
from colo_data.host.partitioned import partitioned_batches
from colo_data.host.pool_schedule import Downstream, PooledChunks, SlicedChunks
from colo_data.host.worker_policy import WorkerLimits, WorkerPolicy
from colo_data.io.columns import table_to_columns
from colo_data.io.record_source import ReadAhead
from colo_data.pipeline import parts
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.input_wait import input_wait_target
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import Prefetcher, close_iterator
from colo_data.telemetry.counters import POOL_WAIT, CpuMeter, StageTimes, metered
from colo_data.telemetry.quality import QualityCounts


class HostPipeline:
    """Host `host` of `hosts`: rows `rows` (`[host*B/hosts, (host+1)*B/hosts)`) of each
    global batch g of `pipeline`, transformed and batched.

    Args:
        pipeline: the dataset definition.
        host: this host's index along the mesh's data axis.
        hosts: the host count.
        pool: worker processes that compute the chunks (None: this process). A pool is
            started by its owner (a loader, a sidecar) and outlives the feeds.
        ahead: make the next chunk (here, or take it from the pool) on a thread of its own
            while this one is handed out (else a consumer that prefetches a few batches runs
            dry while a chunk is computed); `cpu` samples that thread's CPU time.

    `stages` adds up the time, records and bytes of each stage, per chunk, also of the
    chunks that worker processes made; `worker_stages` those of each worker's shares alone;
    `quality` the data-quality counts of all of them. `policy` is the last feed's worker
    count and its reason; `downstream` takes what the consumer of the chunks spends on
    them on the thread that computes them.
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
        self.downstream = Downstream()
        self.policy: WorkerPolicy | None = None

    @property
    def chunk(self) -> int:
        """Global batches computed per call, at most (see `ChunkWork.chunk`)."""
        return self.work.chunk

    def workers_now(self) -> tuple[int, str]:
        """The workers the last feed's policy counts now, and why in one sentence."""
        if self.pool is None or self.policy is None:
            return 0, "no workers: none configured (workers=0)" if self.pool is None else "no workers yet: no batch asked for"
        return self.policy.count, self.policy.reason

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Global record indices at positions `positions` (any epochs)."""
        return self.work.indices_at(positions)

    def kept(self, indices: np.ndarray) -> np.ndarray | None:
        """The filters' verdicts (the pipeline's `keep` and its pack's) on the records at
        global `indices`, read and given the index column as the filters see them; None
        without a filter."""
        table = with_index(self.work, self.pipeline.source.take(indices), indices)
        return kept(self.work, table_to_columns(table), len(indices))

    def chunks(self, start_position: Position, owner: Lifecycle | None = None, batches: int | None = None) -> Iterator[HostChunk]:
        """This host's batches from `start_position` on, stacked along the rows,
        `batches` host batches a chunk (the stream's last may hold fewer: a padded pipeline's
        chunks are then computed in multiples of it; None: as computed, from 1 to `chunk`
        batches, or more from a pool). The threads and processes computing them belong to `owner`; with
        none, to the iterator, which stops them when it is exhausted or closed.

        A column whose dtype or row shape changes from one chunk to a later one is a
        TransformError (naming the column, the position and both), on every
        backend, not a batch that changes type.
        """
        run = Lifecycle(f"host {self.host} of {self.hosts} chunks") if owner is None else owner
        size = self.pipeline.global_batch_size
        computed = self._computed(start_position, run, batches or 1)
        feed = same_schema(computed, start_position, self.host, self.hosts, len(self.rows), size)
        if self.ahead:
            self.cpu = CpuMeter("thread")
            feed = Prefetcher(metered(feed, self.cpu), 1, run, f"colo-data-host{self.host}", self.downstream.trainer_waited)
        if batches is not None:
            feed = split_rows(feed, len(self.rows) * batches)
        return feed if owner is not None else owning(feed, run)

    def _computed(self, start: Position, owner: Lifecycle, granule: int) -> Iterator[HostChunk]:
        """The chunks as computed: here (small at first, then up to `chunk` batches at a
        time), or with a pool as `_pooled` shares them out, in multiples of `granule`
        batches (but at the stream's end). `owner` stops the source's
        read-ahead. Packed batches are planned in stream order, one at a time, here (the pool
        is not used for them), and so are filtered ones; a partitioned pipeline's partitions
        each at their own pace, from their position `start` (`colo_data.pipeline.parts`; or
        theirs at a position)."""
        source = self.pipeline.source
        if isinstance(source, ReadAhead):
            owner.add("row-group read-ahead", source.stop_read_ahead)
        if self.pipeline.partitioned:
            at = start if isinstance(start, np.ndarray) else parts.start(self.pipeline.partitioning.own(start))
            if self.pool is not None and len(self.pipeline.partitioning.owned(self.host, self.hosts)) > 1:
                return self._sliced(self.pool, at)
            return (HostChunk(columns, ends) for columns, ends in partitioned_batches(self.work, at))
        start_position = int(start)  # one position: the pipeline is not partitioned
        if self.pipeline.pack is not None:
            return self._packed(start_position)
        if self.pipeline.keep is not None:
            return (HostChunk(columns, end) for columns, end in filtered_batches(self.work, start_position))
        total = self.pipeline.batches_from(start_position)
        return self._pooled(self.pool, start_position, total, granule)

    def _new_policy(self, most: int) -> WorkerPolicy:
        """The worker-count policy of a new feed, with `most` workers at most."""
        pool = self.pool
        limits = WorkerLimits(0.0, 0) if pool is None else WorkerLimits(pool.budget, most, pool.remote, input_wait_target())
        self.policy = WorkerPolicy(limits, len(self.rows))
        return self.policy

    def _pooled(self, pool: ChunkPool | None, start_position: int, total: int | None, granule: int) -> Iterator[HostChunk]:
        """Chunks made here, and by as many of the pool's workers as the policy counts
        (`PooledChunks`)."""
        size = self.pipeline.global_batch_size
        yield from PooledChunks(  # made at the first chunk asked for, as the feed's policy measures from then
            pool,
            self._new_policy(0 if pool is None else pool.count),
            lambda position: self._open_pool(position),
            lambda position, count, read_ahead: self.work.compute(position, count, read_ahead=read_ahead),
            self._took,
            lambda seconds, rows: self.stages.add(POOL_WAIT, seconds, rows, 0),
            self.downstream,
            start=start_position,
            end=None if total is None else start_position + total * size,
            size=size,
            rows=len(self.rows),
            granule=granule,
        )

    def _open_pool(self, position: int) -> PoolFeed:
        """The pool's feed of this host's chunks, near `position` (the workers start
        when they are asked for)."""
        assert self.pool is not None
        return self.pool.feed(cloudpickle.dumps(self.pipeline), self.host, self.hosts, position)

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
        """A partitioned pipeline's batches with a pool: its partitions made here, or cut into
        slices that the pool's workers compute (`SlicedChunks`), as the policy counts them."""
        owned = self.pipeline.partitioning.owned(self.host, self.hosts)
        yield from SlicedChunks(  # made at the first chunk asked for, as the feed's policy measures from then
            pool,
            self._new_policy(min(pool.count, len(owned))),
            lambda: self._open_pool(0),
            lambda position: partitioned_batches(self.work, position),
            self._took,
            lambda seconds, rows: self.stages.add(POOL_WAIT, seconds, rows, 0),
            self.downstream,
            start=start,
            owned=owned,
            rows=len(self.rows),
        )

    def _packed(self, start_position: int) -> Iterator[HostChunk]:
        """Packed host batches, transformed, each with the position after it."""
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
                where = f"position {position}" if isinstance(position, int) else f"batch {batches} of the run"
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
