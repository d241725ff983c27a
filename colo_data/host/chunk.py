"""`HostChunk`: what a host pipeline hands on, consecutive host batches stacked along the
rows, with the metadata that travels beside the columns (never inside them): where the
stream stands after it (packed batches), a Grain pipeline's state after each batch, a
worker process's stage and data-quality counters, and where a worker's share of a chunk
goes in it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from colo_data.errors import TransformError
from colo_data.runtime.prefetch import close_iterator
from colo_data.telemetry.quality import QualityCounts

HostBatch = dict[str, np.ndarray]


class WorkCost(NamedTuple):
    """What computing a chunk, or a worker's share of one, cost where it was computed: its
    records, its seconds of work (on a CPU or waiting, not waiting for a CPU) and its
    seconds on a CPU (`colo_data.runtime.thread_time`). The worker-count policy's model
    is made of these."""

    records: int
    work_s: float
    cpu_s: float

    def __add__(self, other: object) -> WorkCost:
        assert isinstance(other, WorkCost)
        return WorkCost(self.records + other.records, self.work_s + other.work_s, self.cpu_s + other.cpu_s)


@dataclass
class HostChunk:
    """Host batches stacked along the rows.

    Args:
        columns: the batches' columns, equal lengths.
        end: the position after the chunk's last batch, where the batches do not
            each take a global batch of records (packed pipelines), or a partitioned one's
            own positions of the host's partitions after it; None otherwise.
        stages: stage counters (`StageTimes.values`) a worker process measured for it.
        worker_stages: for a chunk put together from workers' shares, each worker's own
            `stages` (by worker); None otherwise.
        places: for a worker's share of a chunk, the row of the chunk that each of its rows
            is (it has no columns when the share is empty); None for a whole chunk.
        states: a Grain pipeline's host state after each of the chunk's batches (JSON
            values, one a batch); None for a native pipeline.
        quality: data-quality counts (`QualityCounts.values`) a worker process made for it.
        cost: what a worker process (or Ray actor) spent computing it; for a chunk put
            together from shares, what they all spent.
    """

    columns: HostBatch
    end: int | np.ndarray | None = None
    stages: list[float] | None = None
    worker_stages: list[list[float] | None] | None = None
    places: np.ndarray | None = None
    states: list[Any] | None = None
    quality: dict[str, np.ndarray] | None = None
    cost: WorkCost | None = None

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


def column_schema(columns: HostBatch) -> dict[str, str]:
    """Each column's dtype and row shape, e.g. `{"tokens": "int32[1024]"}`: what must stay
    the same from batch to batch and from host to host."""
    return {name: f"{column.dtype}{list(column.shape[1:])}" for name, column in columns.items()}


def schema_change(first: dict[str, str], other: dict[str, str]) -> tuple[list[str], str, str]:
    """The columns whose dtype or row shape differ between two `column_schema`s, and each
    schema's entries for them as text (`{tokens: int32[8]}`), for an error message."""
    changed = sorted(n for n in first.keys() | other.keys() if first.get(n) != other.get(n))

    def text(schema: dict[str, str]) -> str:
        return "{" + ", ".join(f"{n}: {schema.get(n)}" for n in changed) + "}"

    return changed, text(first), text(other)


def merge_shares(shares: list[HostChunk]) -> HostChunk:
    """One chunk from the shares of it that worker processes computed: each share's rows go
    to their `places`, the stage counters add up (and are kept by worker), and slices of a
    partitioned pipeline's partitions say where they stand together; so do their
    data-quality counts and their costs.

    Raises:
        TransformError: the shares disagree on a column's name, dtype or row shape (a
            transform whose output depends on which records it is given).
    """
    stages = [sum(values) for values in zip(*(s.stages for s in shares if s.stages is not None), strict=True)]
    by_worker = [s.stages for s in shares]
    quality = QualityCounts()
    for share in shares:
        quality.merge(share.quality or {})
    end = _slices_end(shares)
    costs = [s.cost for s in shares if s.cost is not None]
    cost = sum(costs[1:], costs[0]) if costs else None
    filled = [s for s in shares if s.columns]
    if not filled:  # no rows in any share (slices of partitions that ended)
        return HostChunk({}, end, stages or None, by_worker, quality=quality.values, cost=cost)
    if len(filled) == 1:  # one share holds every row, in order (places are ascending)
        return HostChunk(filled[0].columns, end, stages or None, by_worker, quality=quality.values, cost=cost)
    # (slices of partitions that made fewer batches at the stream's end leave rows unfilled: cut off after)
    height = max(int(s.places.max()) + 1 for s in filled if s.places is not None)
    first = filled[0].columns
    columns: HostBatch = {}
    for name, model in first.items():
        out = np.empty((height, *model.shape[1:]), model.dtype)
        for share in filled:
            column = share.columns.get(name)
            if column is None or column.dtype != model.dtype or column.shape[1:] != model.shape[1:]:
                got = "no such column" if column is None else f"{column.dtype} rows of shape {column.shape[1:]}"
                raise TransformError(
                    f"column {name!r} came out as {model.dtype} rows of shape {model.shape[1:]} for some records and "
                    f"as {got} for others: transforms must give every record the same columns, dtypes and shapes "
                    "(e.g. pad to a fixed length, not to the longest record of the batch)"
                )
            out[share.places] = column
        columns[name] = out
    extra = {name for share in filled for name in share.columns} - set(first)
    if extra:
        raise TransformError(
            f"columns {sorted(extra)} came out of the transforms for some records and not for others: "
            "transforms must give every record the same columns"
        )
    return HostChunk(columns, end, stages or None, by_worker, quality=quality.values, cost=cost)


def _slices_end(shares: list[HostChunk]) -> np.ndarray | None:
    """Where the slices of a partitioned pipeline's partitions that the shares computed
    stand after each batch, put together in slice order (a row a batch, `[phase, own
    positions...]`; the fewest batches any share made); None for other pipelines' shares."""
    ends = [s.end for s in shares if isinstance(s.end, np.ndarray)]
    if not ends:
        return None
    count = min(len(e) for e in ends)
    return np.concatenate([ends[0][:count, :1], *(e[:count, 1:] for e in ends)], axis=1)


def split_rows(
    chunks: Iterator[HostChunk], rows: int, check: Callable[[HostBatch], HostBatch] | None = None
) -> Iterator[HostChunk]:
    """Pieces of `rows` rows (the last of a chunk may hold fewer), cut from chunks as views;
    the last piece of a chunk keeps its `end`, each piece the `states` of its batches.
    `check`, if given, sees (and may replace) each chunk's columns first: once a chunk, not
    once a piece. Closes `chunks` when done or closed."""
    try:
        for chunk in chunks:
            height = chunk.rows
            whole = chunk.columns if check is None else check(chunk.columns)
            states, per_batch = chunk.states, height // len(chunk.states) if chunk.states else 1
            for start in range(0, height, rows):
                last = start + rows >= height
                columns = {name: column[start : start + rows] for name, column in whole.items()}
                piece = None if states is None else states[start // per_batch : -(-(start + rows) // per_batch)]
                yield HostChunk(columns, chunk.end if last else None, states=piece)
    finally:
        close_iterator(chunks)
