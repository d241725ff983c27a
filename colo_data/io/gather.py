"""Gather rows scattered over several cached row groups into one table, in the requested
order, with Arrow moving the data.

Numeric columns without nulls: a numpy take per row group into one output (Arrow's `take`
has a fixed cost a call that outweighs a small batch's rows). Other fixed-width columns: one Arrow `take`
per row group, then one `take` with the inverse permutation. Variable-width columns
(lists, strings, binary): zero-copy slices of each run of consecutive rows and a single
`concat_arrays`, which copies each row's values once.
Arrow's `take` kernel for lists copies value by value, several times slower than slicing
and concatenating, and a `take` on a chunked array first concatenates every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def _variable_width(kind: pa.DataType) -> bool:
    return (
        pa.types.is_list(kind)
        or pa.types.is_large_list(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _runs(group_of: np.ndarray, row_of: np.ndarray) -> list[tuple[int, int, int]]:
    """(group, first row, length) of each run of consecutive rows of one group."""
    breaks = np.flatnonzero((group_of[1:] != group_of[:-1]) | (row_of[1:] != row_of[:-1] + 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(row_of)]]))
    return list(zip(group_of[starts].tolist(), row_of[starts].tolist(), lengths.tolist(), strict=True))


def _numeric(array: pa.Array) -> bool:
    kind = array.type
    return array.null_count == 0 and (pa.types.is_integer(kind) or pa.types.is_floating(kind))


def _take_numeric(arrays: Sequence[pa.Array], group_of: np.ndarray, row_of: np.ndarray) -> pa.Array:
    out = np.empty(len(row_of), dtype=arrays[0].type.to_pandas_dtype())
    for g, array in enumerate(arrays):
        selected = group_of == g
        out[selected] = array.to_numpy()[row_of[selected]]
    return pa.array(out, type=arrays[0].type)


def _take_by_group(arrays: Sequence[pa.Array], group_of: np.ndarray, row_of: np.ndarray) -> pa.Array:
    by_group = np.argsort(group_of, kind="stable")
    cuts = np.flatnonzero(np.diff(group_of[by_group])) + 1
    pieces = [arrays[int(group_of[c[0]])].take(pa.array(row_of[c])) for c in np.split(by_group, cuts)]
    gathered = pa.concat_arrays(pieces) if len(pieces) > 1 else pieces[0]
    if np.all(by_group[:-1] < by_group[1:]):
        return gathered
    inverse = np.empty_like(by_group)
    inverse[by_group] = np.arange(len(by_group))
    return gathered.take(pa.array(inverse))


def gather(groups: Sequence[pa.Table], group_of: np.ndarray, row_of: np.ndarray) -> pa.Table:
    """A table whose row k is row `row_of[k]` of `groups[group_of[k]]`.

    Args:
        groups: decoded row groups that share a schema and hold one chunk per column.
        group_of: for each output row, the index of its group in `groups`.
        row_of: for each output row, its row within that group.
    """
    runs = None
    columns = []
    for name in groups[0].column_names:
        arrays = [g.column(name).chunk(0) for g in groups]
        if _variable_width(arrays[0].type):
            runs = _runs(group_of, row_of) if runs is None else runs
            slices = [arrays[g].slice(first, length) for g, first, length in runs]
            columns.append(pa.concat_arrays(slices) if len(slices) > 1 else slices[0])
        elif all(_numeric(a) for a in arrays):
            columns.append(_take_numeric(arrays, group_of, row_of))
        else:
            columns.append(_take_by_group(arrays, group_of, row_of))
    return pa.Table.from_arrays(columns, schema=groups[0].schema)
