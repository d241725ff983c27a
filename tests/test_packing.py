"""Packing and filtering keep the exactly-once promise: every kept record lands in exactly
one row of one batch, whole (or its first `length` tokens), for any host count, across
save/restore into other host counts and batch sizes, in process and through the sidecar."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import grain
import jax
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh

import colo_data as cd
from colo_data.host.host_pipeline import HostPipeline
from colo_data.host.packing import plan
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all, to_numpy

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

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


@pytest.mark.parametrize("method", ["next_fit", "first_fit", "best_fit"])
def test_plan(method: str) -> None:
    consumed, rows, offsets = plan(np.array([3, 4, -1, 2, 5, 2]), 2, 8, 8, complete=True, method=method)
    if method == "best_fit":  # the last 2 fits nowhere; placed again longest first, all six fit
        assert consumed == 6 and rows.tolist() == [0, 1, -1, 1, 0, 1] and offsets.tolist() == [0, 0, -1, 4, 3, 6]
    else:
        assert consumed == 5 and rows.tolist() == [0, 0, -1, 1, 1] and offsets.tolist() == [0, 3, -1, 0, 2]
    assert plan(np.array([3, 4]), 2, 8, 8, complete=False, method=method)[0] == 0  # not full: look further
    assert plan(np.array([1, 1, 1]), 2, 8, 1, complete=True, method=method)[0] == 2  # one record a row
    # next fit closes row 0 at the 4, first and best fit put the 3 back in row 0
    consumed, rows, offsets = plan(np.array([5, 4, 3, 2]), 2, 8, 8, complete=True, method=method)
    expected = {"next_fit": (3, [0, 1, 1], [0, 0, 4])}.get(method, (4, [0, 1, 0, 1], [0, 0, 5, 4]))
    assert (consumed, rows.tolist(), offsets.tolist()) == expected, method
    # best fit: the 5 that fits nowhere goes in once the batch's records are placed again longest first
    consumed, rows, offsets = plan(np.array([3, 3, 5, 5]), 2, 8, 8, complete=True, method=method)
    if method == "best_fit":
        assert consumed == 4 and rows.tolist() == [0, 1, 0, 1] and offsets.tolist() == [0, 0, 3, 3]
    else:
        assert consumed == 3 and rows.tolist() == [0, 0, 1] and offsets.tolist() == [0, 3, 0]
    # best fit: the row it fills most, first fit: the first with room
    rows = plan(np.array([4, 5, 2]), 2, 8, 8, complete=True, method=method)[1]
    assert rows.tolist() == {"first_fit": [0, 1, 0]}.get(method, [0, 1, 1]), method


@pytest.mark.parametrize(
    "shuffle, method", [("none", "best_fit"), ("global", "best_fit"), ("block", "best_fit"), ("global", "first_fit"),
                        ("global", "next_fit")]
)
def test_every_record_once_and_the_same_batches_for_any_host_count(token_corpus: Path, shuffle: str, method: str) -> None:
    pipeline = packed(token_corpus, shuffle, method=method)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    seen = check_rows(reference, token_corpus)
    assert sorted(seen) == list(range(RECORDS)), "every record exactly once"
    stream = HostPipeline(pipeline).indices_at(np.arange(RECORDS)).tolist()
    place = {record: i for i, record in enumerate(stream)}
    taken = 0
    for batch in reference:  # each batch takes the next records of the stream, in its rows in stream order
        records = [[int(i) for i in row if i >= 0] for row in batch["_index"]]
        assert all(row == sorted(row, key=place.get) for row in records), f"{method}: a row out of stream order"
        count = sum(len(row) for row in records)
        assert sorted(sum(records, []), key=place.get) == stream[taken : taken + count], f"{method}: not the next records"
        taken += count
    assert len(reference) < RECORDS // 4, "records share rows"
    for hosts in (2, 4):
        assert_batches_equal(reference, read_all(cd.Loader(pipeline, hosts=hosts)), f"{hosts} hosts, {shuffle}")


def test_resume_at_every_step_into_other_host_counts(token_corpus: Path) -> None:
    pipeline = packed(token_corpus, "global")
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=1),
        lambda k, state: cd.Loader(pipeline, hosts=[2, 4][k % 2], state=state),
        steps=15,  # the whole stream: a stream that ends sooner fails
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


@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_packed_on_colocated_as_in_process_and_resumed(token_corpus: Path, hosts: int) -> None:
    """The colocated backend (one host per CPU device of the mesh) gives the in-process
    batches, its state after k batches is the in-process one, and it resumes from it."""
    pipeline = packed(token_corpus, "global", rows=6, keep=keep_odd_ids)
    mesh = Mesh(np.array(jax.devices()[:hosts]), ("data",))
    expected = read_all(cd.Loader(pipeline, hosts=hosts, mesh=mesh))
    assert_batches_equal(expected, read_all(cd.Loader(pipeline, backend="colocated", mesh=mesh)), f"colocated, {hosts} hosts")
    with cd.Loader(pipeline, backend="colocated", mesh=mesh) as loader, cd.Loader(pipeline, hosts=hosts, mesh=mesh) as here:
        for _ in range(3):
            next(loader), next(here)
        state = loader.get_state()
        assert state == here.get_state()
    resumed = read_all(cd.Loader(pipeline, backend="colocated", mesh=mesh, state=state))
    assert_batches_equal(expected[3:], resumed, f"colocated, {hosts} hosts, resumed after 3 batches")


def test_an_endless_packed_stream_crosses_epochs(token_corpus: Path) -> None:
    pipeline = dataclasses.replace(packed(token_corpus, "global"), epochs=None, partitions=1)  # one stream of epochs
    with cd.Loader(pipeline, hosts=2) as loader:
        batches = [to_numpy(next(loader)) for _ in range(40)]
        state = loader.get_state()
    seen = check_rows(batches, token_corpus)
    assert len(seen) > RECORDS and state["epoch"] * RECORDS + state["position"] == len(seen), "the state counts them"
    # Bins fill side by side, so rows need not hold records in stream order, but they hold
    # exactly the stream's first len(seen) records: all of epoch 0 and the start of epoch 1.
    stream = HostPipeline(pipeline).indices_at(np.arange(len(seen)))
    assert sorted(seen) == sorted(stream.tolist())


def inputs_and_targets(columns: dict) -> dict:
    """Two list columns of the same lengths: the tokens, and the tokens plus one."""
    tokens = columns["tokens"].combine_chunks() if hasattr(columns["tokens"], "combine_chunks") else columns["tokens"]
    targets = pa.ListArray.from_arrays(tokens.offsets, pc.add(tokens.values, 1))
    return {"inputs": tokens, "targets": targets}


def grain_first_fit(corpus: Path, pipeline: cd.Pipeline, rows: int) -> list[dict[str, np.ndarray]]:
    """Grain's FirstFitPackIterDataset (one bin a row, bins in order) over the pipeline's
    records in its stream order, batched by `rows`."""
    stream = HostPipeline(pipeline).indices_at(np.arange(RECORDS))
    tokens = tokens_of(corpus)
    records = grain.MapDataset.source([{"inputs": tokens[i], "targets": tokens[i] + 1} for i in stream]).to_iter_dataset()
    packed = grain.experimental.FirstFitPackIterDataset(
        records, length_struct={"inputs": LENGTH, "targets": LENGTH}, num_packing_bins=rows, shuffle_bins=False
    )
    return [{k: np.asarray(v) for k, v in b.items()} for b in packed.batch(rows)]


def test_several_columns_packed_as_grains_first_fit_with_its_names(token_corpus: Path) -> None:
    """Two columns, one layout, Grain's key names: first fit gives Grain's own
    FirstFitPackIterDataset's batches, key for key; best fit the same records, fuller."""
    def pipeline(method: str, names: str = "grain") -> cd.Pipeline:
        pack = cd.Pack(columns=("inputs", "targets"), length=LENGTH, method=method, names=names, prepare=[inputs_and_targets])
        return dataclasses.replace(packed(token_corpus, "global"), pack=pack, index_column=None)

    expected = grain_first_fit(token_corpus, pipeline("first_fit"), 4)
    for hosts in (1, 2):
        got = read_all(cd.Loader(pipeline("first_fit"), hosts=hosts))
        assert len(got) == len(expected) and all(set(g) == set(e) for g, e in zip(got, expected, strict=True)), sorted(got[0])
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            for name in e:
                np.testing.assert_array_equal(g[name], e[name], err_msg=f"{hosts} hosts, batch {i}, {name}")
    best = read_all(cd.Loader(pipeline("best_fit")))
    assert sum(int((b["inputs_segment_ids"] > 0).sum()) for b in best) == sum(len(t) for t in tokens_of(token_corpus))
    assert len(best) <= len(expected)
    shared = read_all(cd.Loader(pipeline("first_fit", names="colo-data")))
    for g, e in zip(shared, expected, strict=True):  # one segment_ids and positions for both columns
        assert set(g) == {"inputs", "targets", "segment_ids", "positions"}
        np.testing.assert_array_equal(g["segment_ids"], e["inputs_segment_ids"])
        np.testing.assert_array_equal(g["targets"], e["targets"])


def documented_maxtext_layout() -> Callable[..., dict]:
    """`maxtext_layout` as docs/packing.md defines it."""
    page = (Path(__file__).parent.parent / "docs" / "packing.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "def maxtext_layout" in block)
    scope: dict = {"np": np}
    exec(code, scope)
    return scope["maxtext_layout"]


def maxtext_steps(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """What MaxText's Grain pipeline does to a batch of Grain's packed rows (its `Rekey` of
    the packer's keys, then `ShiftData(ignored_ids=[pad_id])`: `shift_left` of the targets
    and their segmentation set to 0 where the shifted target is pad_id), written as it is."""
    renamed = {"inputs_segmentation": "inputs_segment_ids", "targets_segmentation": "targets_segment_ids",
               "inputs_position": "inputs_positions", "targets_position": "targets_positions"}  # fmt: skip
    element = dict(packed)
    for new, old in renamed.items():
        element[new] = element.pop(old)
    padded = np.pad(element["targets"], [(0, 0), (0, 1)], mode="constant", constant_values=pad_id)
    element["targets"] = padded[:, 1:]
    element["targets_segmentation"] = np.where(element["targets"] != pad_id, element["targets_segmentation"], 0)
    return element


@pytest.mark.parametrize("pad_id", [0, -1])
def test_the_documented_transform_gives_maxtexts_layout(token_corpus: Path, pad_id: int) -> None:
    """docs/packing.md's `maxtext_layout` after a first-fit pack with Grain's names gives,
    key for key, what MaxText's pipeline makes of Grain's packer's rows of the same records."""
    pack = cd.Pack(columns=("inputs", "targets"), length=LENGTH, method="first_fit", names="grain", prepare=[inputs_and_targets])
    pipeline = dataclasses.replace(packed(token_corpus, "global"), pack=pack, index_column=None)
    expected = [maxtext_steps(b, pad_id) for b in grain_first_fit(token_corpus, pipeline, 4)]
    layout = functools.partial(documented_maxtext_layout(), pad_id=pad_id)
    for hosts in (1, 2):
        got = read_all(cd.Loader(dataclasses.replace(pipeline, transforms=[layout]), hosts=hosts))
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert set(g) == set(e), sorted(g)
            for name in e:
                np.testing.assert_array_equal(g[name], e[name], err_msg=f"{hosts} hosts, batch {i}, {name}")


def test_columns_of_other_lengths_share_the_slots(token_corpus: Path) -> None:
    """A record's slot is as long as its longest packed column: the shorter column is padded
    within it; with Grain's names its segment ids mark its own tokens only."""
    def shorter_targets(columns: dict) -> dict:
        out = inputs_and_targets(columns)
        return {**out, "targets": pc.list_slice(out["targets"], 0, 2)}  # at most 2 tokens

    pack = cd.Pack(columns=("inputs", "targets"), length=LENGTH, names="grain", prepare=[shorter_targets])
    batches = read_all(cd.Loader(dataclasses.replace(packed(token_corpus, "global"), pack=pack), hosts=2))
    tokens = tokens_of(token_corpus)
    for batch in batches:
        for row in range(len(batch["inputs"])):
            offset = 0
            for segment, i in enumerate(int(i) for i in batch["_index"][row] if i >= 0):
                n, m = len(tokens[i]), min(len(tokens[i]), 2)
                np.testing.assert_array_equal(batch["inputs"][row, offset : offset + n], tokens[i])
                np.testing.assert_array_equal(batch["targets"][row, offset : offset + m], tokens[i][:m] + 1)
                assert (batch["targets_segment_ids"][row, offset : offset + n] == [segment + 1] * m + [0] * (n - m)).all()
                assert (batch["inputs_segment_ids"][row, offset : offset + n] == segment + 1).all()
                offset += n


def test_bad_packing(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"length=0 must be an int >= 1"):
        cd.Pack("tokens", 0)
    with pytest.raises(cd.errors.ConfigError, match=r"method='worst_fit'; give one of best_fit, first_fit, next_fit"):
        cd.Pack("tokens", 8, method="worst_fit")
    with pytest.raises(cd.errors.ConfigError, match=r"names='maxtext'; give 'colo-data'"):
        cd.Pack("tokens", 8, names="maxtext")
    with pytest.raises(cd.errors.ConfigError, match=r"name the list column to pack, or several distinct ones"):
        cd.Pack("tokens", 8, columns=("inputs", "targets"))
    with pytest.raises(cd.errors.ConfigError, match=r"give a tuple of column names"):
        cd.Pack(columns="inputs", length=8)
    with pytest.raises(cd.errors.ConfigError, match=r"no column 'words' in the source"):
        next(cd.Loader(dataclasses.replace(packed(token_corpus), pack=cd.Pack("words", 8))))
    with pytest.raises(cd.errors.TransformError, match=r"column is int64, expected a list column"):
        next(cd.Loader(dataclasses.replace(packed(token_corpus), pack=cd.Pack("id", 8))))
    assert read_all(cd.Loader(packed(token_corpus, keep=drop_all))) == []
