"""`HostPipeline`: one host's share of every global batch, as a stream of chunks from a
stream position on. Its one door is `chunks`. The work of each chunk (`ChunkWork`) is
computed here, a chunk ahead on a thread of its own, or shared out to a pool of worker
processes, so only batches cross the process boundary; packed pipelines are planned here
in stream order."""

from __future__ import annotations

from collections.abc import Iterator

import cloudpickle
import numpy as np

from colo_data import defaults
from colo_data.errors import TransformError
from colo_data.host.chunk import HostChunk, column_schema, split_rows
from colo_data.host.chunk_work import ChunkAt, ChunkPool, ChunkWork
from colo_data.host.packing import packed_batches
from colo_data.io.sources import ReadAhead
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import Prefetcher, close_iterator
from colo_data.spec.pipeline import Pipeline
from colo_data.telemetry.counters import CpuMeter, StageTimes, metered

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
        ahead: without a pool, compute the next chunk on a thread of its own while this
            one is handed out (else a consumer that prefetches a few batches runs dry while
            a chunk is computed: 5% input wait at a 2 ms step on the demo pipeline); `cpu`
            samples that thread's CPU time.

    `stages` adds up the time, records and bytes of each stage, per chunk, also of the
    chunks that worker processes made.
    """

    def __init__(
        self, pipeline: Pipeline, host: int = 0, hosts: int = 1, pool: ChunkPool | None = None, ahead: bool = False
    ) -> None:
        self.work = ChunkWork(pipeline, host, hosts)
        self.pipeline, self.host, self.hosts = pipeline, host, hosts
        self.rows = self.work.rows
        self.stages: StageTimes = self.work.stages
        self.pool = pool
        self.ahead = ahead and pool is None  # worker processes already run ahead
        self.cpu: CpuMeter | None = None

    @property
    def chunk(self) -> int:
        """Global batches computed per call (see `ChunkWork.chunk`)."""
        return self.work.chunk

    def stream_indices(self, stream: np.ndarray) -> np.ndarray:
        """Global record indices at stream positions `stream` (any epochs)."""
        return self.work.stream_indices(stream)

    def chunks(self, start_position: int, owner: Lifecycle | None = None, batches: int | None = None) -> Iterator[HostChunk]:
        """This host's batches from stream `start_position` on, stacked along the rows,
        `batches` host batches a chunk (the last may hold fewer; None: as computed, `chunk`
        batches or more). The threads and processes computing them belong to `owner`; with
        none, to the iterator, which stops them when it is exhausted or closed.

        A column whose dtype or row shape changes from one chunk to a later one is a
        TransformError (naming the column, the stream position and both), on every
        backend, not a batch that changes type.
        """
        run = Lifecycle(f"host {self.host} of {self.hosts} chunks") if owner is None else owner
        stream = _same_schema(self._computed(start_position, run), start_position, self)
        if self.ahead:
            self.cpu = CpuMeter("thread")
            stream = Prefetcher(metered(stream, self.cpu), 1, run, f"colo-data-host{self.host}")
        if batches is not None:
            stream = split_rows(stream, len(self.rows) * batches)
        return stream if owner is not None else _owning(stream, run)

    def _computed(self, start_position: int, owner: Lifecycle) -> Iterator[HostChunk]:
        """The chunks as computed: here, `chunk` batches at a time, or the first here and
        the others `defaults.WORKER_CHUNKS` chunks at a time by the pool. `owner` stops the
        source's read-ahead. Packed batches are planned in stream order, one at a time,
        here (the pool is not used for them)."""
        source = self.pipeline.source
        if isinstance(source, ReadAhead):
            owner.add("row-group read-ahead", source.stop_read_ahead)
        if self.pipeline.pack is not None:
            return self._packed(start_position)
        total = self.pipeline.batches_from(start_position)
        chunk = self.chunk
        if self.pool is None or (total is not None and total <= chunk):
            chunk_count = _FOREVER if total is None else -(-total // chunk)
            return map(ChunkAt(self.work, start_position, total, chunk), range(chunk_count))
        # The first chunk is computed here while the workers take the next ones: the first
        # batch does not wait for a worker process to open the files.
        first = ChunkAt(self.work, start_position, chunk, chunk, read_ahead=False)
        start = start_position + chunk * self.pipeline.global_batch_size
        shared = chunk * defaults.WORKER_CHUNKS
        rest_total = None if total is None else total - chunk
        indices = range(_FOREVER if rest_total is None else -(-rest_total // shared))
        payload = cloudpickle.dumps(self.pipeline)
        rest = self.pool.chunks(payload, self.host, self.hosts, start, rest_total, shared, indices)
        return _merge_stages(_head_start(first, rest), self.stages)

    def _packed(self, start_position: int) -> Iterator[HostChunk]:
        """Packed host batches, transformed, each with the stream position after it."""
        assert self.pipeline.pack is not None
        position = start_position
        for columns, end in packed_batches(self.work, self.pipeline.pack, start_position):
            yield HostChunk(self.work.transformed(columns, position), end)
            position = end


def _owning(chunks: Iterator[HostChunk], run: Lifecycle) -> Iterator[HostChunk]:
    """`chunks`, and when they end or are closed, what `run` started for them."""
    try:
        yield from chunks
    finally:
        close_iterator(chunks)
        run.close()


def _same_schema(chunks: Iterator[HostChunk], start: int, host: HostPipeline) -> Iterator[HostChunk]:
    """`chunks`, each with the columns, dtypes and row shapes of the first (the first
    batch fixes them); closes `chunks` when done or closed."""
    first: dict[str, str] | None = None
    position, size, rows = start, host.pipeline.global_batch_size, len(host.rows)
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
