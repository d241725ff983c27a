"""A `keep` that rejects everything on an endless stream is a TransformError that names it,
once it has accepted none of the last `REJECTED_RECORDS` records (or two epochs' records,
if fewer): packed or not, with one partition or several. Not a read that goes on forever,
nor a packing window that grows without bound."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import colo_data as cd
from colo_data.host import filtering
from colo_data.testing import read_all

from pipelines import make_pipeline

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

LIMIT = 60  # REJECTED_RECORDS for these tests: under two epochs of the 120-record corpus
seen: list[int] = []  # records each call of the keep below was given


def reject_all(columns: dict) -> np.ndarray:
    """Rejects every record, counting them; stops a stream that reads on far past the limit."""
    seen.append(len(columns["id"]))
    if sum(seen) > 100 * LIMIT:
        raise RuntimeError(f"read on: {sum(seen)} records rejected and no error")
    return np.zeros(len(columns["id"]), bool)


PACK = dict(pack=cd.Pack("tokens", 16, max_segments=2))  # a batch of 12 rows looks 24 records ahead
CASES = {
    "filtered": dict(keep=reject_all),
    "packed": dict(PACK, keep=reject_all),
    "packed, the pack's keep": dict(pack=cd.Pack("tokens", 16, max_segments=2, keep=reject_all)),
    "filtered, 4 partitions": dict(keep=reject_all, partitions=4),
    "packed, 4 partitions": dict(PACK, keep=reject_all, partitions=4),
}


@pytest.mark.parametrize("case", CASES)
def test_an_endless_stream_that_rejects_every_record_is_named(token_corpus: Path, case: str) -> None:
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[], **CASES[case])
    seen.clear()
    with mock.patch.object(filtering, "REJECTED_RECORDS", LIMIT), pytest.raises(cd.errors.TransformError) as raised:
        read_all(cd.Loader(pipeline, hosts=2 if "partitions" in case else 1), 1)
    message = str(raised.value)
    assert "keep=reject_all) accepted none of the last" in message and "Check the filter" in message, message
    assert f"The limit is {LIMIT} records in a row, the smaller of colo_data.host.filtering.REJECTED_RECORDS ({LIMIT})" in message
    # a bounded read: the limit's records, and at most as many again in the read that passed it
    # (a packed window doubles its look-ahead), a read's worth for each partition
    partitions = pipeline.partitioning.partitions
    assert sum(seen) <= 2 * partitions * max(LIMIT, filtering.READ_RECORDS // partitions), seen


def test_two_epochs_rejected_are_enough(token_corpus: Path) -> None:
    """A source smaller than `REJECTED_RECORDS`: two epochs in a row hold every record."""
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[], **PACK, keep=reject_all, partitions=1)
    seen.clear()
    with pytest.raises(
        cd.errors.TransformError, match=r"keep=reject_all\) accepted none of the last \d+ records.*The limit is 240 records"
    ):
        read_all(cd.Loader(pipeline), 1)
    assert 240 <= sum(seen) <= 2 * 240, seen


def test_a_finite_stream_that_rejects_every_record_ends(token_corpus: Path) -> None:
    seen.clear()
    assert read_all(cd.Loader(make_pipeline(token_corpus, epochs=3, **PACK, keep=reject_all))) == []
