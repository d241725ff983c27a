"""Test helpers for pipelines: the checkpoint check every loader must pass, as Grain's
`assert_equal_output_after_checkpoint`, across host and worker counts."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from colo_data.loader.loader import Loader, to_numpy

__all__ = ["assert_batches_equal", "assert_resumes_identically", "read_all", "to_numpy"]


def read_all(loader: Loader, steps: int | None = None) -> list[dict[str, np.ndarray]]:
    """The loader's next batches as numpy; the loader is closed afterwards.

    Args:
        loader: the loader to read.
        steps: batches to read; None reads all that are left.
    """
    with loader:
        return [to_numpy(batch) for batch in itertools.islice(loader, steps)]


def assert_batches_equal(expected: list[dict[str, np.ndarray]], actual: list[dict[str, np.ndarray]], what: str) -> None:
    """Check that two lists of batches hold the same columns and values, batch by batch.

    Args:
        expected: the reference batches.
        actual: the batches to check.
        what: what is being compared, to start each failure message with.
    """
    assert len(actual) == len(expected), f"{what}: {len(actual)} batches, expected {len(expected)}"
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert want.keys() == got.keys(), f"{what}, batch {step}: columns {sorted(got)}, expected {sorted(want)}"
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{what}, batch {step}, column {name!r}")


def assert_resumes_identically(
    make_loader: Callable[[], Loader],
    make_resumed: Callable[[int, dict[str, Any]], Loader],
    steps: int | None = None,
) -> None:
    """Save the state after every step k of a loader's stream (through JSON, as a checkpoint
    would), restore it into another loader, and check that the rest of the stream is identical.

    Args:
        make_loader: makes a fresh loader of the reference stream.
        make_resumed: makes the loader to restore into, given k and the state (with another
            host or worker count, say).
        steps: steps of the reference stream to check, at least 1; None checks the whole
            stream.

    Raises:
        AssertionError: the reference stream gives fewer than `steps` batches, or none when
            `steps` is None (there would be nothing to compare), or a resumed loader's
            batches differ from the reference's.
    """
    reference = read_all(make_loader(), steps)
    # a stream that ends early, or never starts, would pass every comparison below with nothing compared
    if steps is None:
        assert reference, "the reference stream gave no batch: nothing to check"
    else:
        assert steps >= 1, f"steps={steps}: give at least 1 step to check"
        assert len(reference) == steps, f"the reference stream ended after {len(reference)} of the {steps} steps asked for"
    for k in range(len(reference) + 1):
        loader = make_loader()
        with loader:
            for _ in range(k):
                next(loader)
            state = json.loads(json.dumps(loader.get_state()))
        rest = read_all(make_resumed(k, state), None if steps is None else len(reference) - k)
        assert_batches_equal(reference[k:], rest, f"resumed after step {k} from state {state}")
