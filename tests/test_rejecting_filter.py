"""A `keep` that rejects everything on an endless stream is a TransformError that names it,
once it has accepted none of the last `REJECTED_RECORDS` records (or two epochs' records,
if fewer): packed or not, with one partition or several (the records a host's partitions
read together, so about as many whatever their number). Not a read that goes on forever,
nor a packing window that grows without bound; and a filter that accepts rarely is not
refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import colo_data as cd
from colo_data import demo
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


@pytest.fixture(scope="module")
def corpus_of_5000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 files of 1,000 records: two epochs (the limit here) are 10,000 records."""
    return demo.write_corpus(tmp_path_factory.mktemp("tokens_5000"), files=5, rows_per_file=1000, row_group_size=100)


def rejected_before_the_error(pipeline: cd.Pipeline, hosts: int = 1, read_on_to: int = 10**9) -> tuple[int, str]:
    """The records that the last of `hosts` hosts, run alone, judged before the loader
    refused its `keep` (`reject_all` stops a read past `read_on_to`), and the message."""
    seen.clear()
    with (
        mock.patch.object(filtering, "REJECTED_RECORDS", 10**9),  # the limit: two epochs
        mock.patch.dict(globals(), LIMIT=read_on_to // 100),
        pytest.raises(cd.errors.TransformError) as raised,
    ):
        read_all(cd.Loader(pipeline, hosts=hosts, host=hosts - 1, backend=cd.InProcess(workers=0)), 1)
    return sum(seen), str(raised.value)


CHOSEN = {  # a pipeline that chooses many partitions: its batch size, the partitions
    "filtered": (dict(), 4096, 256),
    "packed": (PACK, 256, 16),  # a packed partition reads its rows' records of 16 batches at once
}


@pytest.mark.parametrize("hosts", [1, 4])
@pytest.mark.parametrize("case", CHOSEN)
def test_the_chosen_partitions_refuse_after_about_the_records_of_one(corpus_of_5000: Path, case: str, hosts: int) -> None:
    """A batch of 4,096 chooses 256 partitions. Each counted its own records in a row, so a
    filter that accepts nothing was refused after 256 times one partition's records (here
    2,560,000, 512 epochs); the count is of the records the partitions read together, so it
    is refused after about as many records as with one partition (at most twice), packed too
    (a batch of 256, 16 partitions), on every host count (a host of 4, its partitions), and
    the message says how many were read in all, over how many partitions."""
    overrides, batch, partitions = CHOSEN[case]
    pipeline = make_pipeline(corpus_of_5000, epochs=None, transforms=[], keep=reject_all, global_batch_size=batch, **overrides)
    assert pipeline.partitions is None and pipeline.partitioning.partitions == partitions
    one, _ = rejected_before_the_error(dataclasses.replace(pipeline, partitions=1))
    assert 10_000 <= one <= 2 * 10_000, one
    chosen, message = rejected_before_the_error(pipeline, hosts, read_on_to=4 * one)
    assert chosen <= 2 * one, (chosen, one)
    owned = partitions // hosts
    assert f"accepted none of the last {chosen:,} records read in all, over {owned} partitions" in message, message
    assert "The limit is 10,000 records in a row" in message and "Check the filter" in message, message


def one_in_500(columns: dict) -> np.ndarray:
    """Accepts the records whose id is a multiple of 500: 10 an epoch, spread evenly."""
    return np.asarray(columns["id"]) % 500 == 0


@pytest.mark.parametrize("hosts", [1, 4])
def test_a_filter_that_accepts_rarely_is_not_refused(corpus_of_5000: Path, hosts: int) -> None:
    """A filter that accepts one record in 500 reads 8,000 records a batch of 16, in runs of
    up to about a thousand rejected, under the limit (two epochs, 10,000): with the 16
    partitions chosen, read together, it is not refused either, on one host or one of 4."""
    pipeline = make_pipeline(corpus_of_5000, epochs=None, keep=one_in_500, global_batch_size=16)
    assert pipeline.partitioning.partitions == 16
    batches = read_all(cd.Loader(pipeline, hosts=hosts, host=hosts - 1, backend=cd.InProcess(workers=0)), 2)
    assert len(batches) == 2 and all((b["id"] % 500 == 0).all() for b in batches)
