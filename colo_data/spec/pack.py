"""`Pack`: how a pipeline packs a list column into fixed-length rows (sequence packing) and
filters records, as a declaration; `colo_data.host.packing` plans and builds the rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colo_data.errors import ConfigError
from colo_data.io.columns import Columns
from colo_data.spec.integers import as_int

SEGMENT_IDS = "segment_ids"
POSITIONS = "positions"


@dataclass(frozen=True)
class Pack:
    """Pack a list column into fixed-length rows of several records each. The packed batch
    has `column`, `segment_ids` (1, 2, ... per row; 0 is padding), `positions` (within each
    record) and, with the pipeline's `index_column`, that column as `(rows, max_segments)`
    record indices (-1: no record).

    Args:
        column: the list column to pack.
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
    """

    column: str
    length: int
    max_segments: int = 64
    keep: Callable[[Columns], np.ndarray] | None = None
    pad_value: int = 0
    prepare: Sequence[Callable[[Columns], Columns]] = ()

    def __post_init__(self) -> None:
        for name in ("length", "max_segments"):
            value = as_int(getattr(self, name))
            if value is None or value < 1:
                raise ConfigError(f"cd.Pack({self.column!r}): {name}={getattr(self, name)!r} must be an int >= 1")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "prepare", tuple(self.prepare))
        for t in self.prepare:
            if not callable(t):
                raise ConfigError(f"cd.Pack({self.column!r}): prepare={t!r} is not a batch transform (a callable)")
        if self.keep is not None and not callable(self.keep):
            raise ConfigError(f"cd.Pack({self.column!r}): keep={self.keep!r} must be a function of the record columns")
