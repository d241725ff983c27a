"""The first batch fixes every column's dtype and row shape (issue 12, finding 7): a later
batch that differs is a TransformError naming the column, the position and both
shapes, on every backend, not a batch that changes type silently (in process) or a ring
error the user cannot act on (sidecar)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import colo_data as cd
from colo_data.testing import read_all

from pipelines import BATCH, backend_of, make_pipeline

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # sidecars cannot import this test module


def width_by_rows(batch: dict) -> dict:
    """Pads to 8 tokens for a call of more than 100 rows, to 9 for a smaller one: the shape
    depends on how many records the call got, as a pad-to-the-longest transform's does."""
    rows = len(batch["tokens"])
    return {**batch, "tokens": cd.pad_or_truncate("tokens", 8 if rows > 100 else 9)(batch)["tokens"]}


# One host (in process, sidecar): 5 epochs of 120 records are 50 batches of 12, made in
# chunks of 1, 2, 4, 8 batches and then more (the first small, so that a costly record's
# first batch comes soon): the first chunk of more than 100 rows comes out 8 wide where the
# ones before came 9 wide. Colocated, one host per CPU device (4): calls of 170 batches of
# 3 rows, so 20 epochs (200 batches) end with one of 30 batches (90 rows).
CASES = [("inprocess", 0, 5), ("inprocess", 2, 5), ("sidecar", 0, 5), ("colocated", 0, 20)]


@pytest.mark.parametrize("backend, workers, epochs", CASES)
def test_a_column_whose_shape_changes_after_the_first_batch_is_an_error(
    token_corpus: Path, tmp_path: Path, backend: str, workers: int, epochs: int
) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[width_by_rows], epochs=epochs)
    got: list[dict] = []
    loader = cd.Loader(pipeline, backend=backend_of(backend, workers, tmp_path))
    with pytest.raises(cd.errors.TransformError) as raised:
        got.extend(loader)
    message = str(raised.value)
    at = re.search(r"at position (\d+)", message)
    assert at and "['tokens']" in message, message
    size = pipeline.global_batch_size
    assert int(at.group(1)) == len(got) * size > 0, (message, len(got))  # where the last batch handed on ended
    assert "int32[9]" in message and "int32[8]" in message, message


def float_width(batch: dict) -> dict:
    rows = len(batch["tokens"])
    tokens = cd.pad_or_truncate("tokens", 8)(batch)["tokens"]
    return {**batch, "tokens": tokens.astype(np.float32 if rows > 100 else np.float64)}


def test_a_column_whose_dtype_changes_is_an_error_in_process(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[float_width], epochs=5)
    with pytest.raises(cd.errors.TransformError, match=r"float\d\d\[8\].*first batch had \{tokens: float\d\d\[8\]\}"):
        read_all(cd.Loader(pipeline))
