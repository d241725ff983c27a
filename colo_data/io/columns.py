"""Batches as a dict of column arrays, and the conversions between Arrow tables, column
dicts and per-record dicts. Fixed-width columns become numpy arrays (zero-copy where
Arrow allows); variable-width ones (lists, strings, columns with nulls) stay `pyarrow`
arrays until a transform turns them into fixed shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from colo_data.errors import TransformError

Column: TypeAlias = np.ndarray | pa.Array
Columns: TypeAlias = dict[str, Column]


def _numpy_or_arrow(array: pa.Array) -> Column:
    kind = array.type
    if array.null_count == 0:
        if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            return array.to_numpy(zero_copy_only=False)
        if isinstance(kind, pa.FixedShapeTensorType) and _fixed_shape(array.storage) is not None:
            return array.to_numpy_ndarray()  # its own shape (and dimension order)
        if pa.types.is_fixed_size_list(kind) or (_is_list(kind) and _is_list(kind.value_type)):
            fixed = _fixed_shape(array)
            if fixed is not None:
                return fixed
    return array


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _fixed_shape(array: pa.Array) -> np.ndarray | None:
    """Numbers, or lists of them (of lists ...), without nulls, as one numpy array of shape
    (rows, n, m, ...) when the lists of each level have one length; else None. A column of
    one variable-length list per record (tokens) is not one, however long its lists: its
    shape would change from batch to batch."""
    kind = array.type
    if array.null_count:
        return None
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    if not _is_list(kind) or not len(array):
        return None
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
    else:
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        size = int(lengths[0])
        if (lengths != size).any():
            return None
    inner = _fixed_shape(array.flatten())
    return None if inner is None else inner.reshape(len(array), size, *inner.shape[1:])


def list_lengths(column: pa.Array) -> list[list[int]] | None:
    """The lengths found at each level of a column of lists of lists (of lists ...) of
    numbers, for an error to name; None for another column, or one with nulls."""
    levels: list[list[int]] = []
    array = column
    while _is_list(array.type) and not array.null_count:
        levels.append(np.unique(pc.list_value_length(array).to_numpy(zero_copy_only=False)).tolist())
        array = array.flatten()
    return levels if len(levels) > 1 and not array.null_count else None


def table_to_columns(table: pa.Table) -> Columns:
    """One column array per table column, numpy where the column is fixed-width."""
    return {name: _numpy_or_arrow(table.column(name).combine_chunks()) for name in table.column_names}


def _row_values(column: Column) -> np.ndarray | Sequence[Any]:
    """The column's rows as Python-level values: numpy rows, or numpy arrays for lists."""
    if isinstance(column, np.ndarray):
        return column
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and column.null_count == 0:
        values = column.flatten()
        value_type = values.type
        if values.null_count == 0 and (
            pa.types.is_integer(value_type) or pa.types.is_floating(value_type) or pa.types.is_boolean(value_type)
        ):
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            if not len(lengths):  # np.split would give one empty row for zero rows
                return []
            return np.split(values.to_numpy(zero_copy_only=False), np.cumsum(lengths)[:-1])
    return column.to_pylist()


def to_records(columns: Mapping[str, Column]) -> list[dict[str, Any]]:
    """Split a column dict into one dict per row (the per-record transform path)."""
    rows = {name: _row_values(col) for name, col in columns.items()}
    count = len(next(iter(rows.values()))) if rows else 0
    return [{name: values[i] for name, values in rows.items()} for i in range(count)]


def _stack(name: str, values: list[Any]) -> Column:
    if all(isinstance(v, np.ndarray) for v in values):
        shapes = {v.shape for v in values}
        if len(shapes) == 1:
            return np.stack(values)
        if all(v.ndim == 1 for v in values):
            lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            flat = np.concatenate(values) if values else np.empty(0)
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        raise TransformError(
            f"column {name!r}: records hold arrays of shapes {sorted(shapes)[:3]}, which do not stack into a batch"
        )
    if all(isinstance(v, (bool, int, float, np.generic)) for v in values):
        return np.asarray(values)
    return pa.array(values)


def from_records(records: Sequence[Mapping[str, Any]]) -> Columns:
    """Stack per-record dicts back into a column dict (inverse of `to_records`)."""
    if not records:
        return {}
    return {name: _stack(name, [r[name] for r in records]) for name in records[0]}


def to_arrow(values: Any, name: str = "") -> pa.Array | pa.ChunkedArray:
    """A column as Arrow: Arrow as it is; a numpy array of 2 or more dimensions as nested
    fixed-size lists (`table_to_columns` gives it back with its shape); a list of
    per-record numpy arrays stacked first (`from_records`' rules); anything else through
    `pa.array`."""
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values
    if isinstance(values, list | tuple) and values and all(isinstance(v, np.ndarray) for v in values):
        values = _stack(name, list(values))
        if isinstance(values, pa.Array):
            return values
    if isinstance(values, np.ndarray) and values.ndim > 1:
        flat: pa.Array = pa.array(np.ascontiguousarray(values).reshape(-1))
        for size in reversed(values.shape[1:]):
            flat = pa.FixedSizeListArray.from_arrays(flat, size)
        return flat
    return pa.array(values)
