"""Partitioned packed and filtered pipelines: each partition reads, filters and packs its
own records, at its own pace, into its own rows of every global batch. Partition k's own
stream is the global positions `Partitioning.global_positions(k, [0, 1, ...])` (its own row groups
under the block and global orders; a filtered pipeline's partitions take turns of the one
order instead, `Partitioning.shared`); its i-th batch is its next `rows` packed rows, or its
next `rows` records that `keep` accepts. A host computes only the partitions it owns, with
one read for all of them at a time, so its work is its share of the batch; the batch does
not depend on the host count, and the position is one per partition (its own records
consumed; `colo_data.pipeline.parts`). A packed partition plans its rows of several batches
at once (`Pipeline.plan_batches`), as a plan over the whole batch would fill them. A finite
stream ends before the first batch that a partition cannot make (no records left for its
rows, too few accepted to fill them)."""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter

import numpy as np
import pyarrow as pa

from colo_data.host.chunk import HostBatch
from colo_data.host.chunk_work import ChunkWork
from colo_data.host.filtering import READ_RECORDS, check_partitions_accepting, filters, read_at, rejected_run, verdict_of
from colo_data.host.packing import Window, packed_rows, read_records
from colo_data.io.columns import table_to_columns
from colo_data.pipeline import parts
from colo_data.pipeline.pack import Pack
from colo_data.telemetry.counters import BATCH

_BATCHES_AHEAD = 16  # a filtered partition reads its records of this many batches at most at once
class _Mine:
    """The partitions host `work.host` owns (or a slice of them), their own streams' lengths
    (None: endless), and the global positions of any of their own positions."""

    def __init__(self, work: ChunkWork, owned: range | None = None) -> None:
        pipeline = work.pipeline
        self.parts = pipeline.partitioning
        self.owned = self.parts.owned(work.host, work.hosts) if owned is None else owned
        self.partitions = np.arange(self.owned.start, self.owned.stop, dtype=np.int64)
        self.totals = pipeline.own_totals(self.partitions)
        self.rows = self.parts.rows
        # the host's rows among its partitions' (all of them, unless it shares one with a neighbour)
        kept = self.parts.kept(work.host, work.hosts, self.owned)
        self.kept = None if len(kept) == len(self.owned) * self.rows else slice(kept.start, kept.stop)

    def kept_rows(self) -> list[tuple[int, int]]:
        """The rows `[a, b)` of each of the host's partitions (of `rows`) that are its own."""
        kept = range(0, len(self.owned) * self.rows) if self.kept is None else range(self.kept.start, self.kept.stop)
        return [(max(0, kept.start - i * self.rows), min(self.rows, kept.stop - i * self.rows)) for i in range(len(self.owned))]

    def counted(self) -> list[bool]:
        """Whether this host counts each partition's filter verdicts: where two hosts share
        a partition, the one that keeps its first row does."""
        return [a == 0 for a, _ in self.kept_rows()]

    def stop(self, i: int, first: int, count: int) -> int:
        """The end of own positions `[first, first + count)` of the host's i-th partition, cut at its stream's end."""
        return first + count if self.totals is None else min(first + count, int(self.totals[i]))

    def positions(self, spans: list[tuple[int, int, int]]) -> np.ndarray:
        """The global positions of own positions `[first, stop)` of each (i, first, stop)."""
        pieces = [
            self.parts.global_positions(self.partitions[i], np.arange(first, stop, dtype=np.int64)) for i, first, stop in spans
        ]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def partitioned_batches(
    work: ChunkWork, start: np.ndarray, owned: range | None = None
) -> Iterator[tuple[HostBatch, np.ndarray]]:
    """Host `work.host`'s rows of each global batch from a partitioned pipeline's position
    `start` on (`colo_data.pipeline.parts`), transformed, each with the host's share of the
    position after it (`[phase, its partitions' own positions]`); with `owned`, those of
    that slice of its partitions."""
    mine = _Mine(work, owned)
    phase, own = parts.share(np.asarray(start, dtype=np.int64), mine.owned)
    pack = work.pipeline.pack
    return _packed(work, pack, mine, own, phase) if pack is not None else _filtered(work, mine, own)


def _packed(
    work: ChunkWork, pack: Pack, mine: _Mine, own: np.ndarray, phase: int
) -> Iterator[tuple[HostBatch, np.ndarray]]:
    """Each partition plans its rows of `plan_batches` batches at once and hands them out in
    turn; the position is where the plans start, and how many batches of them are out."""
    pipeline, rows, batches = work.pipeline, mine.rows, work.pipeline.plan_batches
    windows = [Window(pack, int(j)) for j in own]
    # records each partition reads for its next plan: a record a row at first, then a fifth
    # more than its last plan took (a plan that needs more reads as many again)
    wanted = [rows * batches] * len(windows)
    rejected = 0  # records the partitions' keep rejected in a row, read together (`check_partitions_accepting`)

    def fill(chosen: list[int], counts: list[int]) -> set[int]:
        """Read `counts` more records into the chosen partitions' windows, in one read (fewer
        at a partition's stream end); the partitions that had some left."""
        nonlocal rejected
        spans, later = [], []
        for i, count in zip(chosen, counts, strict=True):
            first = windows[i].start + len(windows[i].indices)
            stop = mine.stop(i, first, count)
            if stop > first:
                spans.append((i, first, stop))
                later.append((i, stop, mine.stop(i, stop, count)))
        if spans:
            records = read_records(work, pack, mine.positions(spans), mine.positions(later))
            at = 0
            for i, first, stop in spans:
                windows[i].append(records, at, at + stop - first)
                at += stop - first
            rejected = rejected_run(records.lengths >= 0, rejected)
            check_partitions_accepting(work, rejected, mine.partitions, own_read())
        return {i for i, _, _ in spans}

    def own_read() -> np.ndarray:
        """Each partition's first own position not read yet."""
        return np.array([w.start + len(w.indices) for w in windows])

    def planned() -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Every partition's next plan; those whose records read do not fill theirs read as
        many again, together, until they do (or their streams end)."""
        short = [i for i, w in enumerate(windows) if len(w.indices) < wanted[i]]
        fill(short, [wanted[i] - len(windows[i].indices) for i in short])
        plans: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        pending, ended = list(range(len(windows))), set()
        while pending:
            for i in pending:
                plans[i] = windows[i].planned(rows * batches, i in ended)
            pending = [i for i in pending if not plans[i][0] and i not in ended]
            grew = fill(pending, [max(wanted[i], len(windows[i].indices)) for i in pending])
            ended.update(set(pending) - grew)
        for i, (consumed, _, _) in plans.items():
            wanted[i] = consumed + consumed // 5 + 1
        return [plans[i] for i in range(len(windows))]

    plans: list[tuple[int, np.ndarray, np.ndarray]] = []
    while True:
        if not plans:
            plans = planned()
        t0 = perf_counter()
        first, stop = phase * rows, (phase + 1) * rows
        if any(not ((row_of >= first) & (row_of < stop)).any() for _, row_of, _ in plans):
            return  # a partition has no records left for its rows: the stream ends
        pieces = [  # each partition's rows of this batch that the host keeps (all but where it shares one)
            packed_rows(window, row_of, offset_of, first + a, first + b, pipeline.index_column, pipeline.stream, work.quality)
            for window, (_, row_of, offset_of), (a, b) in zip(windows, plans, mine.kept_rows(), strict=True)
        ]
        batch = {name: np.concatenate([piece[name] for piece in pieces]) for name in pieces[0]}
        work.stages.add(BATCH, perf_counter() - t0, len(batch[pack.columns[0]]), sum(c.nbytes for c in batch.values()))
        phase = (phase + 1) % batches
        if not phase:  # the plans are handed out: the partitions move on (the filter's verdicts on their records counted)
            for window, (consumed, _, _), counts in zip(windows, plans, mine.counted(), strict=True):
                if filters(work) and counts:
                    work.quality.judged(consumed, int((window.lengths[:consumed] >= 0).sum()))
                window.drop(consumed)
            plans = []
        first_record = mine.positions([(0, windows[0].start, windows[0].start + 1)])
        yield work.transformed(batch, int(first_record[0])), parts.start([w.start for w in windows], phase)


def _filtered(work: ChunkWork, mine: _Mine, own: np.ndarray) -> Iterator[tuple[HostBatch, np.ndarray]]:
    """Each partition's next `rows` accepted records a batch; the position is where each
    partition's next batch starts."""
    rows, count = mine.rows, len(own)
    per_read = min(max(2 * rows, -(-READ_RECORDS // count)), _BATCHES_AHEAD * rows)  # records a read, of a partition
    read = own.copy()  # each partition's first own position not read yet
    tables: list[list[pa.Table]] = [[] for _ in range(count)]  # its accepted records read, in its own order
    places: list[list[np.ndarray]] = [[] for _ in range(count)]  # their own positions
    rejected = 0  # records the partitions' keep rejected in a row, read together (`check_partitions_accepting`)
    while True:
        short = [i for i in range(count) if sum(len(p) for p in places[i]) < rows]
        while short:
            spans = [(i, int(read[i]), mine.stop(i, int(read[i]), per_read)) for i in short]
            spans = [s for s in spans if s[2] > s[1]]
            if len(spans) < len(short):  # a partition's stream has ended short of a batch: so has the stream
                return
            later = [(i, stop, mine.stop(i, stop, per_read)) for i, _, stop in spans]
            table = read_at(work, mine.positions(spans), mine.positions(later))
            verdict = verdict_of(work, table)
            at = 0
            for i, first, stop in spans:
                accepted = verdict[at : at + stop - first]
                tables[i].append(table.slice(at, stop - first).filter(pa.array(accepted)))
                places[i].append(first + np.flatnonzero(accepted))
                at, read[i] = at + stop - first, stop
            rejected = rejected_run(verdict, rejected)
            check_partitions_accepting(work, rejected, mine.partitions, read)
            short = [i for i in short if sum(len(p) for p in places[i]) < rows]
        batch, pieces, ends = [], [], []
        for i in range(count):
            window, accepted_at = pa.concat_tables(tables[i]), np.concatenate(places[i])
            batch.append(window.slice(0, rows))
            pieces.append(mine.parts.global_positions(mine.partitions[i], accepted_at[:rows]))
            ends.append(int(accepted_at[rows - 1]) + 1)
            tables[i], places[i] = [window.slice(rows)], [accepted_at[rows:]]
        positions = np.concatenate(pieces)
        counted = mine.counted()  # the partitions' records this batch consumed (a shared one's by one host only)
        consumed = sum(end - start for end, start, count in zip(ends, own.tolist(), counted, strict=True) if count)
        work.quality.judged(int(consumed), rows * sum(counted))
        table = pa.concat_tables(batch)
        if mine.kept is not None:  # a partition shared with a neighbouring host: this host's rows of it
            positions, table = positions[mine.kept], table.slice(mine.kept.start, mine.kept.stop - mine.kept.start)
        keys = work.order.record_keys(positions, work.indices_at(positions)) if work.draws else None
        columns = table_to_columns(table)
        yield work.transformed(columns, int(positions[0]), keys=keys), parts.start(ends)
        own = np.array(ends)

