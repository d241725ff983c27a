"""Batch transforms: callables from a column dict to a column dict. Vectorised ones (numpy,
Arrow compute) are the fast path; `per_record` lifts a per-record function or a Grain
`MapTransform` into a batch transform for code that already exists."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from colo_data.errors import TransformError
from colo_data.io.columns import Column, Columns, from_records, to_records
from colo_data.setting_checks import as_int

BatchTransform = Callable[[Columns], Columns]


def _grain_map(fn: object) -> bool:
    """Whether `fn` is a Grain `MapTransform` (there is none unless Grain was imported, so
    this never imports it)."""
    grain = sys.modules.get("grain")
    return grain is not None and isinstance(fn, grain.transforms.Map)


def _padded(column: Column, length: int, pad_value: int | float, name: str) -> np.ndarray:
    if isinstance(column, np.ndarray):
        if column.ndim != 2:
            raise TransformError(f"pad_or_truncate({name!r}): column has shape {column.shape}, expected (rows, length)")
        out = np.full((len(column), length), pad_value, dtype=column.dtype)
        keep = min(length, column.shape[1])
        out[:, :keep] = column[:, :keep]
        return out
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise TransformError(f"pad_or_truncate({name!r}): column is {column.type}, expected a list column")
    if column.null_count or column.flatten().null_count:  # flatten(): only this slice's values
        raise TransformError(f"pad_or_truncate({name!r}): the column holds nulls; fill them first (pyarrow.compute.fill_null)")
    fixed = pc.list_slice(column, 0, length, return_fixed_size_list=True).flatten()  # short lists: null-padded
    if fixed.null_count:
        fixed = pc.fill_null(fixed, pa.scalar(pad_value).cast(fixed.type))  # cast: 0 pads a bool list
    return fixed.to_numpy(zero_copy_only=False).reshape(len(column), length)


@dataclass(frozen=True)
class pad_or_truncate:  # noqa: N801 - used like a function: cd.pad_or_truncate("tokens", 1024)
    """Make a variable-length list column a `(rows, length)` array: longer lists are cut,
    shorter ones padded. Vectorised over the whole batch.

    Args:
        column: the list column (or a 2-D numpy column) to reshape.
        length: items in each row of the result.
        pad_value: the value that fills short lists.
    """

    column: str
    length: int
    pad_value: int | float = 0

    def __post_init__(self) -> None:
        length = as_int(self.length)
        if length is None or length < 1:
            raise TransformError(f"pad_or_truncate({self.column!r}, length={self.length!r}): length must be an int >= 1")
        object.__setattr__(self, "length", length)

    def __call__(self, batch: Columns) -> Columns:
        """The batch with `column` padded or cut to `length`."""
        if self.column not in batch:
            raise TransformError(f"pad_or_truncate: no column {self.column!r} in the batch; it has {sorted(batch)}")
        return {**batch, self.column: _padded(batch[self.column], self.length, self.pad_value, self.column)}

    def lengths(self, batch: Columns) -> np.ndarray:
        """Each record's length in `column` before it is padded or cut (a batch this
        transform accepts): what the data-quality telemetry counts."""
        column = batch[self.column]
        if isinstance(column, np.ndarray):
            return np.full(len(column), column.shape[1], np.int64)
        return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass(frozen=True)
class random_map:  # noqa: N801 - used like a function: cd.random_map(crop)
    """Apply a per-record function that draws random numbers: `fn(record, rng)`, with
    `rng` a `numpy.random.Generator` seeded from the pipeline's seed, this `seed`, the
    record's epoch and its index (and a mixture's component). The draws differ from epoch
    to epoch and are the same for a record on any host count, backend or worker count, and
    after a resume (Grain's `random_map`, keyed by the stream). It runs on records: in a
    pipeline's `transforms`, or in `cd.Pack(prepare=...)` for a packed one.

    Args:
        fn: a function of a record dict and a generator, returning a record dict.
        seed: mixed into every record's seed, to tell several random transforms apart.
    """

    fn: Callable[[dict[str, Any], np.random.Generator], dict[str, Any]]
    seed: int = 0

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TransformError(f"cd.random_map({self.fn!r}): give a function of a record and a numpy Generator")
        if not isinstance(self.seed, int | np.integer) or isinstance(self.seed, bool) or self.seed < 0:
            raise TransformError(f"cd.random_map(seed={self.seed!r}): give an int >= 0")

    def __call__(self, batch: Columns) -> Columns:
        raise TransformError(
            f"{self!r} needs each record's epoch and index, which the loader gives it in a pipeline's transforms or "
            "cd.Pack(prepare=...); on a packed batch (rows of several records) put it in cd.Pack(prepare=...)"
        )

    def drawn(self, batch: Columns, keys: np.ndarray, pipeline_seed: int) -> Columns:
        """The batch with `fn` applied to each record, record i's generator seeded with
        `(pipeline_seed, seed, *keys[i])` (keys: component, epoch, index)."""
        records = to_records(batch)
        out = [
            self.fn(record, np.random.default_rng([pipeline_seed, self.seed, *key]))
            for record, key in zip(records, keys.tolist(), strict=True)
        ]
        return from_records(out)

    def __repr__(self) -> str:
        return f"cd.random_map({getattr(self.fn, '__name__', self.fn)!r}, seed={self.seed})"


def draws(transforms: Sequence[Callable[..., Any]]) -> bool:
    """Whether any of `transforms` draws random numbers (a `cd.random_map`), and so needs
    each record's keys (component, epoch, index)."""
    return any(isinstance(t, random_map) for t in transforms)


def _names(columns: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not columns or not all(isinstance(c, str) for c in columns):
        raise TransformError(f"{what}{columns!r}: give one or more column names, e.g. {what}('tokens')")
    return columns


def _present(columns: tuple[str, ...], batch: Columns, what: str) -> None:
    """A TransformError naming the first of `columns` that the batch lacks, and its columns."""
    missing = [c for c in columns if c not in batch]
    if missing:
        raise TransformError(f"{what}: no column {missing[0]!r} in the batch; it has {sorted(batch)}")


class select:  # noqa: N801 - used like a function: cd.select("tokens", "_index")
    """Keep only these columns of the batch (e.g. the token ids once a text column has been
    tokenized: the text itself cannot be a batch array).

    Args:
        *columns: the names of the columns to keep, in this order.
    """

    def __init__(self, *columns: str) -> None:
        self.columns = _names(columns, "cd.select")

    def __call__(self, batch: Columns) -> Columns:
        """The batch with only `columns`."""
        _present(self.columns, batch, "cd.select")
        return {name: batch[name] for name in self.columns}

    def __repr__(self) -> str:
        return f"cd.select({', '.join(map(repr, self.columns))})"


class drop:  # noqa: N801 - used like a function: cd.drop("text")
    """Leave these columns out of the batch (e.g. a text column once it is tokenized).

    Args:
        *columns: the names of the columns to leave out; a name the batch lacks is an error.
    """

    def __init__(self, *columns: str) -> None:
        self.columns = _names(columns, "cd.drop")

    def __call__(self, batch: Columns) -> Columns:
        """The batch without `columns`."""
        _present(self.columns, batch, "cd.drop")
        return {name: column for name, column in batch.items() if name not in self.columns}

    def __repr__(self) -> str:
        return f"cd.drop({', '.join(map(repr, self.columns))})"


@dataclass(frozen=True)
class per_record:  # noqa: N801 - used like a function: cd.per_record(fn)
    """Apply a per-record function to every record of the batch. The slow path: Python runs
    once per record.

    Args:
        fn: a function from a record dict to a record dict, or a Grain `MapTransform`.
    """

    fn: Callable[[dict[str, Any]], dict[str, Any]] | Any

    def __post_init__(self) -> None:
        if not callable(self.fn) and not _grain_map(self.fn):
            raise TransformError(f"per_record({self.fn!r}): give a callable or a grain.transforms.Map")

    def __call__(self, batch: Columns) -> Columns:
        """The batch with `fn` applied to each of its records."""
        fn: Any = self.fn
        apply = fn.map if _grain_map(fn) else fn
        return from_records([apply(record) for record in to_records(batch)])
