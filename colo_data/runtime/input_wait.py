"""The trainer's input wait that the worker policy counts a host's workers for, as a
share of the time: `COLO_DATA_INPUT_WAIT`, read in the process that runs the host pipeline."""

from __future__ import annotations

import math
import os

from colo_data import defaults
from colo_data.errors import ConfigError

INPUT_WAIT_ENV = "COLO_DATA_INPUT_WAIT"


def input_wait_target() -> float:
    """The trainer's input wait that the worker policy counts workers for, a share of the
    time: `COLO_DATA_INPUT_WAIT` ("0.5%" or 0.005), read where the host pipeline runs (the
    trainer's process, each sidecar, each colocated host), else `defaults.INPUT_WAIT`.

    Raises:
        ConfigError: it is not a share of the time above 0 and under 100%.
    """
    text = os.environ.get(INPUT_WAIT_ENV)
    if text is None:
        return defaults.INPUT_WAIT
    spoken = text.strip()
    try:
        value = float(spoken[:-1]) / 100 if spoken.endswith("%") else float(spoken)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise ConfigError(
            f"{INPUT_WAIT_ENV}={text!r}: give the trainer's input wait that the workers are counted for as a share of "
            f"the time above 0 and under 1, as 0.005 or 0.5% (the default, {defaults.INPUT_WAIT:.1%}), or unset it"
        )
    return value
