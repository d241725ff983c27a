"""Integer settings (batch sizes, epoch counts, seeds, lengths): any integral number is
accepted, numpy's included (`np.int64(32)` from a config or an array), and stored as a
Python `int`; `True` and `False` are not numbers of records and are refused."""

from __future__ import annotations

import numbers
from typing import Any


def as_int(value: Any) -> int | None:
    """`value` as a Python int when it is an integral number other than a bool, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
