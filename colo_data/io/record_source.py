"""Sources as the pipeline sees them: the `Source` protocol (a length, row groups, a gather,
a fingerprint) and the protocols a source may add (`ReadAhead`, `StoredInFiles`),
`RecordSource` for any random-access record collection, and `as_source`, which accepts
either."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from colo_data.errors import (
    ConfigError,
    RecordIndexError,
    SourceError,
)
from colo_data.io.columns import from_records, to_arrow
from colo_data.io.content import records_digest, sampled_records


@runtime_checkable
class Source(Protocol):
    """What the pipeline needs of a record source: a length, a row-group layout for block
    shuffling, a vectorised gather, and a fingerprint that changes when the data does."""

    def __len__(self) -> int: ...

    @property
    def row_group_sizes(self) -> np.ndarray:
        """Records in each row group, in global order (what block shuffling permutes)."""

    def take(self, indices: np.ndarray) -> pa.Table:
        """The records at these global indices, in the order given, as one table."""

    def fingerprint(self) -> str:
        """A short hash that changes when the data does (checked when a state is restored)."""


@runtime_checkable
class ReadAhead(Protocol):
    """A source that loads upcoming records on threads of its own: the loader that uses it
    says what comes next, reads its costs and stops the threads when it closes."""

    @property
    def lookahead(self) -> int:
        """How many spans of records ahead it pays to say (1 for local files; more on object
        storage, where a read takes tens of milliseconds before its first byte)."""

    def prefetch(self, indices: np.ndarray) -> None: ...

    def stop_read_ahead(self, timeout: float) -> None: ...

    def read_stats(self) -> tuple[float, ...]: ...


@runtime_checkable
class StoredInFiles(Protocol):
    """A source whose records lie in files: which file and row hold each one (lineage)."""

    @property
    def files(self) -> tuple[str, ...]: ...

    def file_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def record_places(source: Any, indices: np.ndarray) -> tuple[list[str | None], list[int]]:
    """The file and the row within it of each record `indices` of `source`; a source not
    of files (records in memory, a Grain data source) names none, and its row is the
    record's index."""
    indices = np.asarray(indices, dtype=np.int64)
    if not isinstance(source, StoredInFiles):
        return [None] * len(indices), indices.tolist()
    files, rows = source.file_rows(indices)
    names = source.files
    return [names[f] for f in files.tolist()], rows.tolist()


class RecordSource:
    """Adapts any random-access record collection to the `Source` protocol. It has no row
    groups: block shuffling treats every `CHUNK` consecutive records as one.

    Args:
        records: a `grain.MapDataset`, a Grain data source, a list of dicts: anything with
            `len` and `[i]` that returns dict records.
    """

    CHUNK = 1024

    def __init__(self, records: Any) -> None:
        filtered = _filter_in(records)
        if filtered is not None:
            raise ConfigError(
                f"the source {type(records).__name__} filters records (its Grain graph has a {filtered}), and a "
                "random-access source must give a record at every index. Run the Grain pipeline as it is with "
                "cd.GrainPipeline(make_dataset=..., global_batch_size=...), or give the source unfiltered and the "
                "filter as cd.Pipeline(keep=...) (docs/grain.md, 'MapDataset.filter')"
            )
        self._records = records
        self._len = len(records)
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return self._len

    @property
    def row_group_sizes(self) -> np.ndarray:
        """`CHUNK` records a group, the last one shorter."""
        full, rest = divmod(self._len, self.CHUNK)
        return np.array([self.CHUNK] * full + ([rest] if rest else []), dtype=np.int64)

    def take(self, indices: np.ndarray | Sequence[int]) -> pa.Table:
        """The records at these indices, in the order given, as one table.

        Raises:
            RecordIndexError: an index is outside `[0, len(self))`.
            SourceError: a record is not a dict (the error names its index and type), or
                records differ in their keys.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            bad = int(idx[(idx < 0) | (idx >= self._len)][0])
            raise RecordIndexError(f"record index {bad} is outside [0, {self._len}) of {type(self._records).__name__}")
        rows = [self._records[int(i)] for i in idx]
        if any(row is None for row in rows):
            at = int(idx[[row is None for row in rows].index(True)])
            raise ConfigError(
                f"{type(self._records).__name__} gave None for record {at} (a filter): a random-access source must give "
                "a record at every index; run the Grain pipeline with cd.GrainPipeline(make_dataset=..., ...) instead "
                "(docs/grain.md, 'MapDataset.filter')"
            )
        odd = next(((i, row) for i, row in zip(idx.tolist(), rows, strict=True) if not isinstance(row, dict)), None)
        if odd is not None:
            raise SourceError(
                f"{type(self._records).__name__}: record {odd[0]} is of type {type(odd[1]).__name__}, not dict; "
                "colo-data needs dict records (column name -> value): make every record a dict."
            )
        if not rows:
            return pa.table({})
        names = rows[0].keys()
        for i, row in zip(idx.tolist(), rows, strict=True):
            if row.keys() != names:
                raise SourceError(
                    f"{type(self._records).__name__}: record {i} has the keys {sorted(row)}, record {int(idx[0])} "
                    f"{sorted(names)}: every record must have the same keys"
                )
        # per column, so that a record's array of 2 or more dimensions stays one (B, a, b, ...) column
        return pa.table({name: to_arrow(column, name) for name, column in from_records(rows).items()})

    def fingerprint(self) -> str:
        """A hash of the collection's type name, length and content (`records_digest` of a
        few records spread over it), so that a collection of other records of the same
        length gives another; taken once, when a state is first saved or restored. A
        collection whose records differ from read to read gives another at each restore."""
        if self._fingerprint is None:
            sampled = records_digest(self.take(sampled_records(self._len)))
            self._fingerprint = hashlib.sha256(f"{type(self._records).__name__}:{self._len}:{sampled}".encode()).hexdigest()[:16]
        return self._fingerprint


def grain_stages(dataset: Any) -> Iterator[Any]:
    """Each stage of a Grain dataset's graph once, from the output to the sources (the
    `parents` of each, and the dataset that a `grain.experimental.ElasticIterator` wraps)."""
    pending, seen = [dataset], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        inner = getattr(node, "_ds", None)  # where ElasticIterator keeps its dataset
        pending.extend([*getattr(node, "parents", ()), *([inner] if inner is not None else [])])


def _filter_in(records: Any) -> str | None:
    """The name of a Grain filter stage in a `grain.MapDataset`'s graph, if it has one."""
    return next((type(n).__name__ for n in grain_stages(records) if "Filter" in type(n).__name__), None)


def as_source(source: Any) -> Source:
    """Accept an `ArrowSource`, any `Source`, or a random-access record collection."""
    if isinstance(source, Source):
        return source
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return RecordSource(source)
    if hasattr(source, "parents") and hasattr(source, "__iter__"):  # a grain.IterDataset: packing, filter, prefetch
        raise SourceError(
            f"{type(source).__name__} is a Grain IterDataset, not a random-access source: run it as it is with "
            "cd.GrainPipeline(make_dataset=..., global_batch_size=...), where make_dataset(shard) builds a host's share "
            "(see docs/grain.md)"
        )
    raise SourceError(
        f"{type(source).__name__} is not a source: give a cd.ArrowSource, a grain.MapDataset "
        "or any object with __len__ and __getitem__ returning dict records."
    )
