"""Packing and filtering keep the exactly-once promise: every kept record lands in exactly
one row of one batch, whole (or its first `length` tokens), for any host count, across
save/restore into other host counts and batch sizes, in process and through the sidecar."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.host.packing import plan
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all, to_numpy

RECORDS = 120
LENGTH = 16
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the sidecar cannot import this test module


def packed(corpus: Path, shuffle: str = "block", rows: int = 4, **pack) -> cd.Pipeline:
    return cd.Pipeline(
        source=cd.ArrowSource(str(corpus), columns=["id", "tokens"]),
        order=cd.Order(shuffle=shuffle, seed=3, window=2),
        pack=cd.Pack("tokens", pack.pop("length", LENGTH), **pack),
        global_batch_size=rows,
        index_column="_index",
    )


def tokens_of(corpus: Path) -> list[np.ndarray]:
    table = pq.read_table(sorted(str(p) for p in corpus.glob("*.parquet")))
    return [np.array(t, np.int32) for t in table.column("tokens").to_pylist()]


def check_rows(batches: list[dict[str, np.ndarray]], corpus: Path, length: int = LENGTH) -> list[int]:
    """Every row holds its records' tokens in order, with segment ids and positions; returns
    the records in stream order."""
    tokens = tokens_of(corpus)
    seen = []
    for batch in batches:
        for row in range(len(batch["tokens"])):
            records = [int(i) for i in batch["_index"][row] if i >= 0]
            expected = np.concatenate([tokens[i][:length] for i in records] or [np.zeros(0, np.int32)])
            used = len(expected)
            np.testing.assert_array_equal(batch["tokens"][row, :used], expected)
            assert not batch["tokens"][row, used:].any() and not batch["segment_ids"][row, used:].any()
            ids = np.concatenate([np.full(min(len(tokens[i]), length), s + 1) for s, i in enumerate(records)] or [[]])
            np.testing.assert_array_equal(batch["segment_ids"][row, :used], ids)
            pos = np.concatenate([np.arange(min(len(tokens[i]), length)) for i in records] or [[]])
            np.testing.assert_array_equal(batch["positions"][row, :used], pos)
            seen += records
    return seen


def test_plan_next_fit() -> None:
    consumed, rows, offsets = plan(np.array([3, 4, -1, 2, 5, 2]), rows=2, length=8, max_segments=8, complete=True)
    assert consumed == 5 and rows.tolist() == [0, 0, -1, 1, 1] and offsets.tolist() == [0, 3, -1, 0, 2]
    assert plan(np.array([3, 4]), rows=2, length=8, max_segments=8, complete=False)[0] == 0  # not full: look further
    assert plan(np.array([1, 1, 1]), rows=2, length=8, max_segments=1, complete=True)[0] == 2  # one record a row


@pytest.mark.parametrize("shuffle", ["none", "global", "block"])
def test_every_record_once_and_the_same_batches_for_any_host_count(token_corpus: Path, shuffle: str) -> None:
    pipeline = packed(token_corpus, shuffle)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    seen = check_rows(reference, token_corpus)
    assert sorted(seen) == list(range(RECORDS)), "every record exactly once"
    np.testing.assert_array_equal(seen, cd.HostPipeline(pipeline).stream_indices(np.arange(RECORDS)), "in stream order")
    assert len(reference) < RECORDS // 4, "records share rows"
    for hosts in (2, 4):
        assert_batches_equal(reference, read_all(cd.Loader(pipeline, hosts=hosts)), f"{hosts} hosts, {shuffle}")


def test_resume_at_every_step_into_other_host_counts(token_corpus: Path) -> None:
    pipeline = packed(token_corpus, "global")
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=1), lambda k, state: cd.Loader(pipeline, hosts=[2, 4][k % 2], state=state), steps=20
    )


@pytest.mark.parametrize("rows", [8, 12])
def test_another_batch_size_after_restore_keeps_exactly_once(token_corpus: Path, rows: int) -> None:
    first = cd.Loader(packed(token_corpus, "global"), hosts=2)
    before = [{k: np.asarray(v) for k, v in next(first).items()} for _ in range(5)]
    state = first.get_state()
    first.close()
    after = read_all(cd.Loader(packed(token_corpus, "global", rows=rows), hosts=2, state=state))
    seen = check_rows(before + after, token_corpus)
    assert sorted(seen) == list(range(RECORDS))


def test_filter_and_one_record_a_row(token_corpus: Path) -> None:
    pipeline = packed(token_corpus, "block", keep=keep_odd_ids, max_segments=1, length=8)
    batches = read_all(cd.Loader(pipeline, hosts=2))
    seen = check_rows(batches, token_corpus, length=8)
    assert sorted(seen) == list(range(1, RECORDS, 2)), "the kept records, each once"
    assert all((b["segment_ids"] <= 1).all() for b in batches)
    assert len(batches) == RECORDS // 2 // 4 + (RECORDS // 2 % 4 > 0)
    state = None
    with cd.Loader(pipeline, hosts=1) as loader:
        for _ in range(3):
            next(loader)
        state = loader.get_state()
    assert_batches_equal(batches[3:], read_all(cd.Loader(pipeline, hosts=4, state=state)), "filtered, resumed")


def keep_odd_ids(columns: dict) -> np.ndarray:
    return np.asarray(columns["id"]) % 2 == 1


def drop_all(columns: dict) -> np.ndarray:
    return np.zeros(len(columns["id"]), bool)


def test_packed_through_the_sidecar(token_corpus: Path) -> None:
    pipeline = packed(token_corpus, "block", keep=keep_odd_ids)
    expected = read_all(cd.Loader(pipeline))
    assert_batches_equal(expected, read_all(cd.Loader(pipeline, backend=cd.Sidecar(workers=0), hosts=2)), "sidecar, packed")


def test_an_endless_packed_stream_crosses_epochs(token_corpus: Path) -> None:
    pipeline = dataclasses.replace(packed(token_corpus, "global"), epochs=None)
    with cd.Loader(pipeline, hosts=2) as loader:
        batches = [to_numpy(next(loader)) for _ in range(40)]
        state = loader.get_state()
    seen = check_rows(batches, token_corpus)
    assert sorted(seen[:RECORDS]) == list(range(RECORDS)) and len(seen) > RECORDS
    assert state["epoch"] * RECORDS + state["position"] == len(seen), "the state counts the records consumed"


def test_bad_packing(token_corpus: Path) -> None:
    with pytest.raises(cd.ConfigError, match=r"length=0 must be an int >= 1"):
        cd.Pack("tokens", 0)
    with pytest.raises(cd.ConfigError, match=r"no column 'words' in the source"):
        next(cd.Loader(dataclasses.replace(packed(token_corpus), pack=cd.Pack("words", 8))))
    with pytest.raises(cd.TransformError, match=r"column is int64, expected a list column"):
        next(cd.Loader(dataclasses.replace(packed(token_corpus), pack=cd.Pack("id", 8))))
    with pytest.raises(cd.ConfigError, match=r"not yet colocated"):
        cd.Loader(packed(token_corpus), backend="colocated")
    assert read_all(cd.Loader(packed(token_corpus, keep=drop_all))) == []
