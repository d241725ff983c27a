"""`HostChunk`: what a host pipeline hands on, consecutive host batches stacked along the
rows, with the metadata that travels beside the columns (never inside them): where the
stream stands after it (packed batches) and a worker process's stage counters."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from colo_data.runtime.prefetch import close_iterator

HostBatch = dict[str, np.ndarray]


@dataclass
class HostChunk:
    """Host batches stacked along the rows.

    Args:
        columns: the batches' columns, equal lengths.
        end: the stream position after the chunk's last batch, where the batches do not
            each take a global batch of records (packed pipelines); None otherwise.
        stages: stage counters (`StageTimes.values`) a worker process measured for it.
    """

    columns: HostBatch
    end: int | None = None
    stages: list[float] | None = None

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


def split_rows(chunks: Iterator[HostChunk], rows: int) -> Iterator[HostChunk]:
    """Pieces of `rows` rows (the last of a chunk may hold fewer), cut from chunks as views;
    the last piece of a chunk keeps its `end`. Closes `chunks` when done or closed."""
    try:
        for chunk in chunks:
            height = chunk.rows
            for start in range(0, height, rows):
                last = start + rows >= height
                columns = {name: column[start : start + rows] for name, column in chunk.columns.items()}
                yield HostChunk(columns, chunk.end if last else None)
    finally:
        close_iterator(chunks)
