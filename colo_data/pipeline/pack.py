"""`Pack`: how a pipeline packs list columns into fixed-length rows (sequence packing) and
filters records, as a declaration; `colo_data.host.packing` plans and builds the rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colo_data.errors import ConfigError
from colo_data.io.columns import Columns
from colo_data.setting_checks import as_int

SEGMENT_IDS = "segment_ids"
POSITIONS = "positions"
METHODS = ("best_fit", "first_fit", "next_fit")
NAMES = ("colo-data", "grain")


@dataclass(frozen=True)
class Pack:
    """Pack list columns into fixed-length rows of several records each, all the columns
    with one layout: each record takes a slot as long as its longest packed column. The
    packed batch has the columns and their segment ids (1, 2, ... per row; 0 is padding) and
    positions (within each record): with `names="colo-data"`, `segment_ids` and `positions`
    (of the slots); with `names="grain"`, `<column>_segment_ids` and `<column>_positions` of
    each column's own tokens, as Grain's packing names them (a MaxText model takes them as
    they are). With the pipeline's `index_column`, that column holds `(rows, max_segments)`
    record indices (-1: no record).

    Args:
        column: the list column to pack (or `columns`, several).
        length: tokens a row; a record longer than this keeps its first `length` tokens.
        max_segments: records a row at most (1: one record a row, padded: filtering
            without packing).
        keep: a function of the record columns returning one bool per record; records it
            rejects are dropped (consumed, never placed).
        pad_value: the token that fills the rest of a row.
        prepare: batch transforms run on the records as they are read, before they are
            packed (and before `keep`): what makes the packed column, e.g.
            `cd.tokenize("text", tokenizer, output="tokens")`. They must keep one row per
            record. The pipeline's own transforms run on the packed batch.
        columns: the list columns to pack together, e.g. `("inputs", "targets")`.
        method: how records find their rows. A batch takes records in stream order until
            one fits in none of its rows; `"next_fit"` fills one row after the other,
            `"first_fit"` puts each record in the first row with room (as Grain's
            `FirstFitPackIterDataset` with one bin a row), `"best_fit"` in the row it fills
            most, and when one fits nowhere it places the batch's records again, longest
            first, each where it fits tightest, and takes the record if they all fit (the
            fullest rows: the default).
        names: `"colo-data"` or `"grain"`: the segment-id and position columns' names.
    """

    column: str | None = None
    length: int = 0
    max_segments: int = 64
    keep: Callable[[Columns], np.ndarray] | None = None
    pad_value: int = 0
    prepare: Sequence[Callable[[Columns], Columns]] = ()
    columns: Sequence[str] = ()
    method: str = "best_fit"
    names: str = "colo-data"

    def describe(self) -> str:
        """What decides the rows, as a loader state records it: the packed columns, the row
        length, the method and the segments a row may hold (e.g. `tokens/2048/best_fit/64`)."""
        columns = "+".join(self.columns) if self.columns else str(self.column)
        return f"{columns}/{self.length}/{self.method}/{self.max_segments}"

    def __post_init__(self) -> None:
        column = (self.column,) if isinstance(self.column, str) else ()
        if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
            raise ConfigError(f"cd.Pack(columns={self.columns!r}): give a tuple of column names, e.g. ('inputs', 'targets')")
        columns = tuple(self.columns)
        if (column and columns and columns != column) or not (column or columns) or len(set(columns)) != len(columns):
            raise ConfigError(
                f"cd.Pack(column={self.column!r}, columns={columns!r}): name the list column to pack, or several "
                "distinct ones as columns=(...), not both"
            )
        object.__setattr__(self, "columns", columns or column)
        where = f"cd.Pack({', '.join(map(repr, self.columns))})"
        for name in ("length", "max_segments"):
            value = as_int(getattr(self, name))
            if value is None or value < 1:
                raise ConfigError(f"{where}: {name}={getattr(self, name)!r} must be an int >= 1")
            object.__setattr__(self, name, value)
        if self.method not in METHODS:
            raise ConfigError(f"{where}: method={self.method!r}; give one of {', '.join(METHODS)}")
        if self.names not in NAMES:
            raise ConfigError(f"{where}: names={self.names!r}; give 'colo-data' (segment_ids, positions) or 'grain'")
        object.__setattr__(self, "prepare", tuple(self.prepare))
        for t in self.prepare:
            if not callable(t):
                raise ConfigError(f"{where}: prepare={t!r} is not a batch transform (a callable)")
        if self.keep is not None and not callable(self.keep):
            raise ConfigError(f"{where}: keep={self.keep!r} must be a function of the record columns")

    def layout_columns(self, column: str) -> tuple[str, str]:
        """The names of `column`'s segment-id and position columns in a packed batch."""
        if self.names == "grain":
            return f"{column}_{SEGMENT_IDS}", f"{column}_{POSITIONS}"
        return SEGMENT_IDS, POSITIONS
