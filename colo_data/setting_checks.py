"""The checks of settings: every integer a user gives (batch sizes, epoch counts, seeds,
lengths, host and worker counts) is checked here. Any integral number is accepted, numpy's
included (`np.int64(32)` from a config or an array), and stored as a Python `int`; `True`
and `False` are not numbers of records and are refused, as are floats (`2.0`) and strings
(`"2"`)."""

from __future__ import annotations

import numbers
from typing import Any

from colo_data.errors import ConfigError


def as_int(value: Any) -> int | None:
    """`value` as a Python int when it is an integral number other than a bool, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def int_setting(setting: str, value: Any, least: int, meaning: str) -> int:
    """The setting's `value` as a Python int of at least `least` (`as_int`).

    Args:
        setting: its name as the user writes it, e.g. `"prefetch"`.
        value: what the user gave.
        least: the smallest value allowed.
        meaning: what the number counts, for the message.

    Raises:
        ConfigError: naming the setting, the value given and what to give instead.
    """
    count = as_int(value)
    if count is None or count < least:
        raise ConfigError(f"{setting}={value!r}: give an int >= {least} ({meaning})")
    return count
