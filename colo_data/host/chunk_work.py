"""Chunk work: host h of H's rows of a run of consecutive global batches, computed from the
pipeline and a position alone (order, read, transforms, batch). Being a pure
function of position is what lets the work run anywhere (on the host's own thread, in a
worker process, on another machine) and still come back in the one global order. A
worker process imports this module, not the machinery of `HostPipeline`."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from colo_data import defaults
from colo_data.errors import ColoDataError, TransformError
from colo_data.host.chunk import HostBatch, HostChunk
from colo_data.io.columns import Columns, list_lengths, table_to_columns
from colo_data.io.record_source import ReadAhead
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import host_rows
from colo_data.pipeline.stream import BoundStream
from colo_data.pipeline.transforms import draws, pad_or_truncate, random_map
from colo_data.telemetry.counters import BATCH, DECODE, IO_WAIT, ORDER, READ, TRANSFORM, StageTimes
from colo_data.telemetry.quality import PADDED, QualityCounts


class Share(NamedTuple):
    """Worker `worker` of `workers`: the `worker`-th of `workers` equal runs of a chunk's
    records taken in reading order (by their row groups' ranks in the epoch's reading
    order, `GlobalOrder.group_ranks`), so that the shares are balanced to a record and a row
    group is decoded by as few workers as that allows (one, but where a run starts or ends
    inside it, or where there are more workers than row groups)."""

    worker: int
    workers: int


class Resume(NamedTuple):
    """Where a worker's slice of a partitioned pipeline's host partitions is computed from:
    the pipeline's position `start` (`colo_data.pipeline.parts`), `skip` batches on, the
    host's partitions cut into `parts` slices (`slices.cut`; a worker computes the slice its
    `Share` numbers). A worker continues its slice's feed while the requests follow on;
    any other is computed from `start` again, the same batches."""

    start: np.ndarray
    skip: int
    parts: int


class PoolFeed(Protocol):
    """A feed: one host pipeline's chunks computed by a pool, asked for by position and
    handed back whole, in the order they were asked for."""

    def ready(self, workers: int) -> int:
        """How many of the pool's first `workers` workers have set the feed up (their
        chunks come without that wait), starting those not started yet."""
        ...

    def ask(self, position: int | Resume, count: int, workers: int) -> None:
        """Ask for the chunk of `count` global batches at `position` (a partitioned
        pipeline's: `Resume`), shared out to `workers` of the pool's workers."""
        ...

    def take(self) -> HostChunk:
        """The chunk asked for first of those not taken yet (waiting for it)."""
        ...


class ChunkPool(Protocol):
    """What computes chunk work away from the host pipeline's own thread (worker
    processes): every chunk shared out among `count` workers or fewer and handed back whole."""

    @property
    def count(self) -> int:
        """The workers a feed may use now, at most (a shared pool's share changes as hosts
        come and go)."""
        ...

    remote: bool  # its workers use CPUs that are not the host's (a cluster's): its feed opens at once

    budget: float  # the host's CPU budget (CPUs)

    def cpus_used(self) -> float | None:
        """CPUs of the host's budget that everything on it (the trainer, the host's thread,
        the workers) used since the last call; None at the first, and where the workers'
        CPUs are not the host's."""
        ...

    def feed(self, payload: bytes, host: int, hosts: int, position: int) -> PoolFeed:
        """A feed of host `host` of `hosts` of the pickled pipeline `payload`, set up in the
        background (and warmed at `position`, near where its first chunks will be
        asked). A pool serves one feed at a time: a new one ends the last."""
        ...

    def close(self) -> None:
        """Stop the workers (safe to call twice)."""
        ...


def check_batch(columns: Columns, rows: int) -> HostBatch:
    """`columns` as a host batch: fixed-shape numeric numpy arrays of `rows` rows each;
    anything else is a TransformError that names the column and the fix."""
    for name, col in columns.items():
        if not isinstance(col, np.ndarray):
            kind = getattr(col, "type", type(col).__name__)
            levels = list_lengths(col) if isinstance(col, pa.Array) else None
            if levels is not None:
                hint = _nested_hint(levels)
            elif "list" in str(kind) and "list" not in str(getattr(kind, "value_type", "")):
                hint = f"add cd.pad_or_truncate({name!r}, LENGTH)"
            else:
                hint = (
                    f"fill its nulls, encode it as numbers, or leave it out: add cd.drop({name!r}) (or cd.select(...) "
                    "with the columns to keep) after the transforms that need it"
                )
            raise TransformError(f"column {name!r} is {kind} after the transforms, not a fixed-shape array: {hint}")
        if col.dtype.kind not in "biuf":
            raise TransformError(
                f"column {name!r} has dtype {col.dtype} after the transforms; batches hold numbers and booleans: "
                f"encode it, or leave it out: add cd.drop({name!r}) after the transforms that need it"
            )
        if len(col) != rows:
            raise TransformError(
                f"column {name!r} has {len(col)} rows after the transforms, but {rows} records went in: "
                "transforms must keep one row per record"
            )
    return columns


def _nested_hint(levels: list[list[int]]) -> str:
    """What to do about a column of nested lists whose lists of a level differ in length:
    the lengths found, level by level."""

    def lengths(found: list[int]) -> str:
        if len(found) > 3:
            return f"{found[0]} to {found[-1]} ({len(found)} lengths)"
        return " and ".join(map(str, found)) if len(found) < 3 else f"{found[0]}, {found[1]} and {found[2]}"

    inner = " lists of ".join(lengths(found) for found in levels[1:])
    return (
        f"its records are lists of {lengths(levels[0])} lists of {inner} values in this batch, and a column of a batch "
        "holds an array of one shape per record. Write the data with one shape per record (nested lists of one length "
        "at each level, or Arrow's fixed_shape_tensor type), or make them one shape in a transform"
    )


class ChunkWork:
    """Host `host` of `hosts` of `pipeline`: its rows `rows` of each global batch g (global
    positions `g*B + rows`), and the computation of any run of them. `stages` adds up the
    time, records and bytes of each stage, per chunk; `quality` the data-quality counts of
    the rows it builds (and of its share of a filter's verdicts)."""

    def __init__(self, pipeline: Pipeline, host: int = 0, hosts: int = 1) -> None:
        self.pipeline, self.host, self.hosts = pipeline, host, hosts
        self.rows = range(*host_rows(pipeline.global_batch_size, host, hosts))
        self.stages = StageTimes()
        self.quality = QualityCounts()
        self._order: BoundStream | None = None
        self._asked = (0, 0)  # positions of the last chunk read and the end of its read-ahead
        self._read_once = False  # a chunk was read: the read-ahead may start before the next one's reads
        self._read_seen: tuple[float, ...] | None = None  # the source's read_stats at the last count

    @property
    def order(self) -> BoundStream:
        """The pipeline's stream bound to its order: positions -> records."""
        if self._order is None:
            self._order = self.pipeline.stream.bind(self.pipeline.order, self.pipeline.partitioning)
        return self._order

    @property
    def chunk(self) -> int:
        """Global batches computed per call: enough that a call handles about
        `defaults.CHUNK_RECORDS` of this host's records, so per-call costs are shared (packed
        or filtered batches: one)."""
        if self.pipeline.variable_batches:
            return 1
        return max(1, defaults.CHUNK_RECORDS // len(self.rows))

    def positions(self, batch_position: int, count: int) -> np.ndarray:
        """Positions of this host's rows of `count` consecutive global batches, the
        first at position `batch_position`."""
        size = self.pipeline.global_batch_size
        starts = batch_position + self.rows.start + size * np.arange(count, dtype=np.int64)[:, None]
        return (starts + np.arange(len(self.rows))).ravel()

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Global record indices at positions `positions` (any epochs)."""
        return self.order.indices_at(positions)

    def _share_rows(self, positions: np.ndarray, indices: np.ndarray, share: Share) -> np.ndarray:
        """Places (in `positions`, ascending) of the records that are worker `share`'s."""
        ranks = self.order.group_ranks_at(positions, indices)
        in_order = np.argsort(ranks, kind="stable")
        n, k, w = len(in_order), share.workers, share.worker
        return np.sort(in_order[w * n // k : (w + 1) * n // k])

    def read_ahead(self, batch_position: int, count: int, share: Share | None) -> None:
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
        positions = self.positions(begin, (stop - begin) // size)
        indices = self.indices_at(positions)
        source.prefetch(indices if share is None else indices[self._share_rows(positions, indices, share)])

    @property
    def draws(self) -> bool:
        """Whether the pipeline's transforms draw random numbers (a `cd.random_map`), and so
        need each record's `record_keys`."""
        return draws(self.pipeline.transforms)

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

    def warmed(self, position: int) -> ChunkWork:
        """This work, with one global batch at `position` computed and dropped: a worker's
        first chunk paid for its lazy imports, file opens and first decodes (many times
        what a chunk costs after it) while the host waited for it. A worker warms before it
        says it is ready, with CPU that went unused. An error here is left to the chunk that
        meets it. A partitioned pipeline's slices are not known yet: nothing is warmed."""
        if self.pipeline.partitioned:
            return self
        with contextlib.suppress(Exception):
            self.compute(position, 1, StageTimes(), read_ahead=False, quality=QualityCounts())
        return self

    def compute(
        self,
        batch_position: int,
        count: int = 1,
        stages: StageTimes | None = None,
        share: Share | None = None,
        read_ahead: bool = True,
        quality: QualityCounts | None = None,
    ) -> HostChunk:
        """This host's rows of `count` consecutive global batches (one after the other), the
        first starting at `batch_position`, or with `share` those of them whose row
        groups are that worker's (the chunk's `places` say where they belong; it has no
        columns when there are none). The stage timings go to `stages`, the data-quality
        counts to `quality` (default: this work's). `read_ahead=False` leaves the decoding
        ahead to whoever computes the next chunks. A partitioned pipeline's slices are
        `slices.compute`'s."""
        stages = self.stages if stages is None else stages
        t0 = perf_counter()
        positions = self.positions(batch_position, count)
        indices = self.indices_at(positions)
        rows = None if share is None else self._share_rows(positions, indices, share)
        if rows is not None:
            indices = indices[rows]
        t1 = perf_counter()
        stages.add(ORDER, t1 - t0, len(indices), indices.nbytes)
        # The first chunk's reads go first, its read-ahead after them: on object storage the
        # read-ahead's requests would hold up the first batch's
        if read_ahead and self._read_once:
            self.read_ahead(batch_position, count, share)
        if not len(indices):
            return HostChunk({}, places=rows)
        table = self.pipeline.source.take(indices)
        if read_ahead and not self._read_once:
            self.read_ahead(batch_position, count, share)
        self._read_once = True
        columns = table_to_columns(table)
        stages.add(READ, perf_counter() - t1, len(indices), table.nbytes)
        self.count_reads(stages)
        columns.update(self.pipeline.stream.record_columns(indices, self.pipeline.index_column))
        keys = self.order.record_keys(positions if rows is None else positions[rows], indices) if self.draws else None
        return HostChunk(self.transformed(columns, batch_position, stages, keys, quality), places=rows)

    def transformed(
        self,
        columns: Columns,
        batch_position: int,
        stages: StageTimes | None = None,
        keys: np.ndarray | None = None,
        quality: QualityCounts | None = None,
    ) -> HostBatch:
        """The pipeline's transforms applied to a batch's columns, checked; `keys` (each
        row's `record_keys`, None for packed rows) seed a `cd.random_map`. The lengths that
        each `cd.pad_or_truncate` pads or cuts are counted in `quality` (default: this
        work's)."""
        stages = self.stages if stages is None else stages
        quality = self.quality if quality is None else quality
        rows = len(next(iter(columns.values())))
        t0 = perf_counter()
        for transform in self.pipeline.transforms:
            before = columns
            columns = self._apply(transform, columns, batch_position, keys)
            if isinstance(transform, pad_or_truncate):
                quality.column(PADDED, transform.column, transform.length, transform.lengths(before), rows)
        t1 = perf_counter()
        batch = check_batch(columns, rows)
        nbytes = sum(column.nbytes for column in batch.values())
        t2 = perf_counter()
        stages.add(TRANSFORM, t1 - t0, rows, nbytes)
        stages.add(BATCH, t2 - t1, rows, nbytes)
        return batch

    def _apply(
        self, transform: Callable[[Columns], Columns], columns: Columns, position: int, keys: np.ndarray | None = None
    ) -> Columns:
        """One transform on a batch's columns (a `cd.random_map` with the records' `keys`);
        its failure or a result that is not a dict of columns is a TransformError naming the
        transform, the host and the position."""
        try:
            if isinstance(transform, random_map) and keys is not None:
                out = transform.drawn(columns, keys, self.pipeline.order.seed)
            else:
                out = transform(columns)
        except ColoDataError:
            raise
        except SystemExit as e:  # would end the sidecar or the trainer: the transform's error, named
            raise TransformError(
                f"transform {transform!r} called sys.exit({e.code!r}) on host {self.host} of {self.hosts}, batch at "
                f"position {position}: a transform returns the batch or raises an exception; it must not "
                f"exit the process it runs in\n{traceback.format_exc()}"
            ) from None
        except Exception as e:
            raise TransformError(
                f"transform {transform!r} failed on host {self.host} of {self.hosts}, batch at position "
                f"{position}: {type(e).__name__}: {e}"
            ) from e  # its traceback is the cause's, printed once (across a boundary too: `errors.to_wire`)
        if not isinstance(out, Mapping):
            raise TransformError(
                f"transform {transform!r} returned {type(out).__name__}, not a dict of columns (batch at "
                f"position {position}): a transform returns the batch, e.g. `return {{**batch, 'x': ...}}`"
            )
        return out

    def prepared(
        self, transform: Callable[[Columns], Columns], columns: Columns, position: int, keys: np.ndarray | None
    ) -> Columns:
        """`cd.Pack(prepare=...)`'s transform on records read for packing, from
        `position` on (their `record_keys`): as `_apply`, and it must keep one row per record."""
        rows = len(next(iter(columns.values())))
        out = self._apply(transform, columns, position, keys)
        for name, column in out.items():
            if len(column) != rows:
                raise TransformError(
                    f"cd.Pack(prepare=...): {transform!r} made column {name!r} {len(column)} rows long from {rows} "
                    f"records (position {position}); a prepare transform keeps one row per record"
                )
        return out
