"""What JAX will hold. In JAX's default 32-bit mode (`jax_enable_x64` off) JAX turns a
64-bit numpy column into its 32-bit dtype without a word: the id 10**10 + 5 arrives as
1410065413, 0.1 as the float32 nearest to it. `jax_ready` casts such a column itself, and
only when every value comes through exactly; a value that would change is a
`TransformError` that names the column and the fixes. `check_index_column` refuses, when
the loader is made, an index column whose record indices 32 bits cannot hold.

Pure numpy, like the rest of the host side (worker processes import it without JAX): the
caller reads the flag (`jax.enable_x64.value`) in the thread or process that makes the
arrays, since that is the mode JAX narrows by there."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from colo_data.errors import ConfigError, TransformError
from colo_data.host.chunk import HostBatch
from colo_data.pipeline.kinds import AnyPipeline

# (kind, itemsize) of a 64-bit column -> the dtype JAX's 32-bit mode makes of it. Complex
# columns cannot reach a batch (it holds numbers and booleans), so they have no entry.
_NARROW = {
    ("i", 8): np.dtype(np.int32),
    ("u", 8): np.dtype(np.uint32),
    ("f", 8): np.dtype(np.float32),
}
_X64_FIX = 'call jax.config.update("jax_enable_x64", True) before making the Loader'


def jax_column(name: str, column: np.ndarray, x64: bool, where: str) -> np.ndarray:
    """`column` as JAX will hold it: unchanged under x64 or when it is not 64-bit, else
    cast to the 32-bit dtype when every value survives the cast exactly.

    Args:
        name: the column's name, for the error.
        column: one host's rows of the column.
        x64: `jax.enable_x64.value` where the arrays are made.
        where: which rows these are (e.g. "host 2"), for the error.

    Raises:
        TransformError: under 32-bit mode, a value the 32-bit dtype does not hold (an
            integer out of its range, a float that float32 rounds; NaN and inf pass).
    """
    narrow = None if x64 else _NARROW.get((column.dtype.kind, column.dtype.itemsize))
    if narrow is None:
        return column
    if narrow.kind == "f":
        with np.errstate(over="ignore"):  # a too-large float becomes inf: caught by the comparison
            cast = column.astype(narrow)
        if not np.all(cast == column):  # one pass; NaNs (never equal) are looked at apart
            bad = (cast != column) & ~(np.isnan(column) & np.isnan(cast))
            if bad.any():
                at = np.unravel_index(np.argmax(bad), bad.shape)
                value = column[at].item()
                reason = f"which {narrow} cannot hold exactly (it would be {cast[at].item()!r})"
                raise TransformError(_message(name, column.dtype, narrow, value, reason, where, "rounds"))
        return cast
    if column.size:
        info = np.iinfo(narrow.name)
        low, high = column.min(), column.max()
        if low < info.min or high > info.max:
            value = (low if low < info.min else high).item()
            reason = f"outside {narrow}'s range [{info.min}, {info.max}]"
            raise TransformError(_message(name, column.dtype, narrow, value, reason, where, "wraps"))
    return column.astype(narrow)


def jax_ready(columns: Mapping[str, np.ndarray], x64: bool, where: str) -> HostBatch:
    """Every column of a host batch through `jax_column`."""
    return {name: jax_column(name, column, x64, where) for name, column in columns.items()}


def _message(name: str, dtype: np.dtype, narrow: np.dtype, value: object, reason: str, where: str, cast: str) -> str:
    return (
        f"column {name!r} is {dtype} and holds {value!r} ({where}), {reason}. In JAX's default 32-bit mode "
        f"(jax_enable_x64 off) JAX would make the column {narrow} and change such values without a word. Either "
        f"{_X64_FIX} (the batch then holds {dtype}), or make the column 32-bit in a transform, deciding what "
        f"becomes of such values, e.g. `lambda batch: {{**batch, {name!r}: batch[{name!r}].astype(np.{narrow})}}` "
        f"({cast} them)"
    )


def check_index_column(pipeline: AnyPipeline, x64: bool) -> None:
    """The index column holds every record index: under 32-bit mode it is int32, so a
    source of more than 2**31 records is refused before anything starts.

    Args:
        pipeline: the pipeline the loader is made for.
        x64: `jax.enable_x64.value`.

    Raises:
        ConfigError: the index column's int32 cannot hold the source's record indices.
    """
    if pipeline.index_column is None or x64:
        return
    records = len(pipeline.source)
    limit = int(np.iinfo(np.int32).max) + 1  # indices 0 .. 2**31 - 1
    if records <= limit:
        return
    raise ConfigError(
        f"index_column={pipeline.index_column!r}: the source has {records:,} records, but in JAX's default 32-bit "
        f"mode (jax_enable_x64 off) the index column is int32, which holds the indices of {limit:,} records at "
        f"most: {_X64_FIX} (the index column is then int64), or leave index_column unset"
    )
