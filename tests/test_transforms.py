"""Batch transforms (`pad_or_truncate`, `per_record`) and the column conversions they rest on
(`table_to_columns`, `to_records`, `from_records`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colo_data as cd
from colo_data.errors import TransformError
from colo_data.io.columns import from_records, table_to_columns, to_records

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)


def reference_pad(rows, length, pad_value, dtype) -> np.ndarray:
    """Straightforward per-row loop: cut at `length`, pad with `pad_value`."""
    out = np.empty((len(rows), length), dtype=dtype)
    for i, row in enumerate(rows):
        row = list(row)
        for j in range(length):
            out[i, j] = row[j] if j < len(row) else pad_value
    return out


ROWS = [[], [1, 2, 3], list(range(10, 20)), [7, 7, 7, 7], [5], [], [-3, 4]]


# --- pad_or_truncate -------------------------------------------------------------------------


@pytest.mark.parametrize("pad_value", [0, -1, 99])
def test_pad_list_int32(pad_value):
    column = pa.array(ROWS, pa.list_(pa.int32()))
    ids = np.arange(len(ROWS))
    batch = {"tokens": column, "id": ids}
    out = cd.pad_or_truncate("tokens", 4, pad_value=pad_value)(batch)
    tokens = out["tokens"]
    assert isinstance(tokens, np.ndarray)
    assert tokens.shape == (len(ROWS), 4)
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, reference_pad(ROWS, 4, pad_value, np.int32))
    assert out["id"] is ids, "other columns are passed through"
    assert batch["tokens"] is column, "the input batch is not modified"


def test_pad_default_pad_value_is_zero():
    out = cd.pad_or_truncate("t", 3)({"t": pa.array([[5], [1, 2, 3, 4]], pa.list_(pa.int32()))})
    np.testing.assert_array_equal(out["t"], np.array([[5, 0, 0], [1, 2, 3]], np.int32))


def test_pad_sliced_list_array():
    parent = pa.array(ROWS + [[8, 9]] * 3, pa.list_(pa.int32()))
    column = parent.slice(3, 5)
    out = cd.pad_or_truncate("t", 3, pad_value=-1)({"t": column})["t"]
    assert out.shape == (5, 3) and out.dtype == np.int32
    np.testing.assert_array_equal(out, reference_pad(column.to_pylist(), 3, -1, np.int32))


def test_pad_sliced_list_array_ignores_nulls_outside_the_slice():
    parent = pa.array([[1, None], [2, 3], [4], [None]], pa.list_(pa.int32()))
    column = parent.slice(1, 2)
    out = cd.pad_or_truncate("t", 2)({"t": column})["t"]
    np.testing.assert_array_equal(out, np.array([[2, 3], [4, 0]], np.int32))


def test_pad_large_list():
    column = pa.array(ROWS, pa.large_list(pa.int64()))
    out = cd.pad_or_truncate("t", 6, pad_value=-7)({"t": column})["t"]
    assert out.shape == (len(ROWS), 6) and out.dtype == np.int64
    np.testing.assert_array_equal(out, reference_pad(ROWS, 6, -7, np.int64))


def test_pad_chunked_list_and_float_values():
    rows = [[0.5, 1.5], [], [2.5, 3.5, 4.5]]
    column = pa.chunked_array([pa.array(rows[:1], pa.list_(pa.float32())), pa.array(rows[1:], pa.list_(pa.float32()))])
    out = cd.pad_or_truncate("t", 2, pad_value=-0.25)({"t": column})["t"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, reference_pad(rows, 2, -0.25, np.float32))


def test_pad_all_empty_lists():
    out = cd.pad_or_truncate("t", 3, pad_value=4)({"t": pa.array([[], []], pa.list_(pa.int16()))})["t"]
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out, np.full((2, 3), 4, np.int16))


def test_pad_list_of_bool():
    rows = [[True], [], [False, True, True]]
    out = cd.pad_or_truncate("m", 2)({"m": pa.array(rows, pa.list_(pa.bool_()))})["m"]
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, reference_pad(rows, 2, False, np.bool_))


@pytest.mark.parametrize("width, length", [(2, 5), (7, 3), (4, 4)])
@pytest.mark.parametrize("dtype, pad_value", [(np.int16, -2), (np.float32, 0.5)])
def test_pad_2d_numpy(width, length, dtype, pad_value):
    column = (np.arange(3 * width).reshape(3, width) + 1).astype(dtype)
    out = cd.pad_or_truncate("x", length, pad_value=pad_value)({"x": column})["x"]
    assert out.shape == (3, length)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, reference_pad(column.tolist(), length, pad_value, dtype))
    assert np.array_equal(column, (np.arange(3 * width).reshape(3, width) + 1).astype(dtype)), "input modified"


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12), min_size=1, max_size=20),
    st.integers(1, 12),
    st.integers(-5, 5),
    st.data(),
)
def test_pad_matches_reference_on_random_slices(rows, length, pad_value, data):
    parent = pa.array(rows, pa.list_(pa.int32()))
    start = data.draw(st.integers(0, len(rows)), label="start")
    count = data.draw(st.integers(0, len(rows) - start), label="count")
    column = parent.slice(start, count)
    out = cd.pad_or_truncate("t", length, pad_value=pad_value)({"t": column})["t"]
    assert out.shape == (count, length) and out.dtype == np.int32
    np.testing.assert_array_equal(out, reference_pad(rows[start : start + count], length, pad_value, np.int32))


def test_pad_missing_column_lists_the_columns():
    with pytest.raises(TransformError) as info:
        cd.pad_or_truncate("tokens", 4)({"ids": np.arange(2), "text": pa.array(["a", "b"])})
    message = str(info.value)
    assert "tokens" in message and "ids" in message and "text" in message


@pytest.mark.parametrize(
    "column, words",
    [
        (pa.array(["a", "bc"]), ["'t'", "string"]),
        (pa.array([1, 2], pa.int32()), ["'t'", "int32"]),
        (np.arange(4), ["'t'", "(4,)"]),
        (np.zeros((2, 2, 2)), ["'t'", "(2, 2, 2)"]),
    ],
)
def test_pad_rejects_a_non_list_column(column, words):
    with pytest.raises(TransformError) as info:
        cd.pad_or_truncate("t", 4)({"t": column})
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "column",
    [pa.array([[1, None], [2]], pa.list_(pa.int32())), pa.array([[1], None, [2]], pa.list_(pa.int32()))],
    ids=["null item", "null list"],
)
def test_pad_rejects_nulls(column):
    with pytest.raises(TransformError, match="null"):
        cd.pad_or_truncate("t", 4)({"t": column})


@pytest.mark.parametrize("length", [0, -1, 2.5, "4"])
def test_pad_rejects_a_length_below_one(length):
    with pytest.raises(TransformError, match="length"):
        cd.pad_or_truncate("t", length)


# --- per_record ------------------------------------------------------------------------------


def _batch():
    return {
        "id": np.array([10, 11, 12, 13], dtype=np.int64),
        "tokens": pa.array([[1, 2], [], [3, 4, 5], [6]], pa.list_(pa.int32())),
        "text": pa.array(["a", "bb", "", "dddd"]),
    }


def _check_record(record, i):
    batch = _batch()
    assert set(record) == {"id", "tokens", "text"}
    assert isinstance(record["id"], (int, np.integer)) and record["id"] == batch["id"][i]
    assert isinstance(record["tokens"], np.ndarray)
    assert record["tokens"].dtype == np.int32
    assert record["tokens"].tolist() == batch["tokens"][i].as_py()
    assert type(record["text"]) is str and record["text"] == batch["text"][i].as_py()


def _expand(record):
    tokens = record["tokens"]
    return {
        "id": record["id"] * 2,
        "length": len(tokens),
        "reversed": tokens[::-1],
        "pair": np.array([record["id"], record["id"] + 1]),
        "text": record["text"].upper(),
        "flag": bool(len(tokens) % 2),
    }


class Expand(grain.transforms.Map):
    """A Grain MapTransform: per_record must call its `map`."""

    def __init__(self):
        self.seen = []

    def map(self, element):
        self.seen.append(element)
        return _expand(element)


def _check_expanded(out):
    assert set(out) == {"id", "length", "reversed", "pair", "text", "flag"}
    assert isinstance(out["id"], np.ndarray) and out["id"].tolist() == [20, 22, 24, 26]
    assert isinstance(out["length"], np.ndarray) and out["length"].tolist() == [2, 0, 3, 1]
    assert isinstance(out["flag"], np.ndarray) and out["flag"].dtype == np.bool_
    assert out["flag"].tolist() == [False, False, True, True]
    # Equal-shape arrays stack into a 2-D numpy array.
    assert isinstance(out["pair"], np.ndarray) and out["pair"].shape == (4, 2)
    assert out["pair"].tolist() == [[10, 11], [11, 12], [12, 13], [13, 14]]
    # Variable-length arrays become an Arrow list array, values' dtype kept.
    assert isinstance(out["reversed"], pa.Array) and pa.types.is_list(out["reversed"].type)
    assert out["reversed"].type.value_type == pa.int32()
    assert out["reversed"].to_pylist() == [[2, 1], [], [5, 4, 3], [6]]
    # Strings stay an Arrow string array.
    assert isinstance(out["text"], pa.Array) and pa.types.is_string(out["text"].type)
    assert out["text"].to_pylist() == ["A", "BB", "", "DDDD"]


def test_per_record_with_a_function():
    seen = []

    def fn(record):
        seen.append(record)
        return _expand(record)

    out = cd.per_record(fn)(_batch())
    assert len(seen) == 4
    for i, record in enumerate(seen):
        _check_record(record, i)
    _check_expanded(out)


def test_per_record_with_a_grain_map():
    transform = Expand()
    out = cd.per_record(transform)(_batch())
    assert len(transform.seen) == 4
    for i, record in enumerate(transform.seen):
        _check_record(record, i)
    _check_expanded(out)


def test_per_record_identity_stacks_equal_lengths_to_2d_and_keeps_ragged_as_lists():
    batch = {
        "ragged": pa.array([[1], [2, 3]], pa.list_(pa.int64())),
        "square": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int32())),
        "x": np.array([0.5, 1.5], np.float32),
    }
    out = cd.per_record(lambda r: r)(batch)
    assert isinstance(out["ragged"], pa.Array) and out["ragged"].to_pylist() == [[1], [2, 3]]
    assert isinstance(out["square"], np.ndarray) and out["square"].dtype == np.int32
    assert out["square"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert isinstance(out["x"], np.ndarray) and out["x"].dtype == np.float32 and out["x"].tolist() == [0.5, 1.5]


@pytest.mark.parametrize("fn", [42, "not a function", None])
def test_per_record_rejects_a_non_callable(fn):
    with pytest.raises(TransformError, match="callable"):
        cd.per_record(fn)


# --- columns -----------------------------------------------------------------------------------


def _table():
    return pa.table(
        {
            "i": pa.array([1, 2, 3], pa.int64()),
            "f": pa.array([0.5, -1.0, 2.25], pa.float64()),
            "b": pa.array([True, False, True]),
            "t": pa.array([[1, 2], [], [3, 4, 5]], pa.list_(pa.int32())),
            "s": pa.array(["x", "", "zz"]),
            "n": pa.array([1, None, 3], pa.int32()),
        }
    )


def test_table_to_columns_numpy_for_fixed_width_without_nulls():
    table = _table()
    columns = table_to_columns(pa.concat_tables([table.slice(0, 1), table.slice(1)]))  # chunked columns
    assert list(columns) == table.column_names
    for name, dtype in [("i", np.int64), ("f", np.float64), ("b", np.bool_)]:
        assert isinstance(columns[name], np.ndarray), name
        assert columns[name].dtype == dtype
        assert columns[name].tolist() == table.column(name).to_pylist()
    for name in ("t", "s", "n"):
        assert isinstance(columns[name], pa.Array), name
        assert columns[name].to_pylist() == table.column(name).to_pylist()


def test_table_to_columns_fixed_size_list_becomes_2d_numpy():
    table = pa.table({"v": pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int16(), 2))})
    column = table_to_columns(table)["v"]
    assert isinstance(column, np.ndarray) and column.dtype == np.int16
    assert column.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_records_round_trip():
    table = _table()
    columns = table_to_columns(table)
    records = to_records(columns)
    assert len(records) == 3
    assert isinstance(records[0]["t"], np.ndarray) and records[2]["t"].tolist() == [3, 4, 5]
    assert records[1]["t"].tolist() == []
    assert records[1]["n"] is None and records[2]["n"] == 3
    assert type(records[0]["s"]) is str and records[2]["s"] == "zz"
    assert records[1]["b"] == False  # noqa: E712 - numpy bool
    assert records[2]["f"] == 2.25

    back = from_records(records)
    assert list(back) == table.column_names
    for name in ("i", "f", "b"):
        assert isinstance(back[name], np.ndarray) and back[name].dtype == columns[name].dtype
        np.testing.assert_array_equal(back[name], columns[name])
    for name in ("t", "s", "n"):
        assert isinstance(back[name], pa.Array), name
        assert back[name].to_pylist() == table.column(name).to_pylist()
    assert back["t"].type.value_type == pa.int32()
    assert pa.types.is_string(back["s"].type)
    assert back["n"].null_count == 1


def test_to_records_of_an_empty_batch_is_empty():
    table = _table().slice(0, 0)
    columns = table_to_columns(table)
    assert to_records(columns) == []
    assert to_records({"t": pa.array([], pa.list_(pa.int32()))}) == []
    assert to_records({}) == []
    assert from_records([]) == {}


def test_select_and_drop_keep_and_leave_out_columns() -> None:
    batch = {"text": pa.array(["a", "b"]), "tokens": np.arange(4).reshape(2, 2), "_index": np.arange(2)}
    assert list(cd.select("_index", "tokens")(batch)) == ["_index", "tokens"]
    assert list(cd.drop("text")(batch)) == ["tokens", "_index"]
    for make in (cd.select, cd.drop):
        with pytest.raises(TransformError, match=r"no column 'words' in the batch; it has \['_index', 'text', 'tokens'\]"):
            make("words")(batch)
        with pytest.raises(TransformError, match=r"give one or more column names"):
            make()


def test_a_text_column_left_in_the_batch_names_drop_as_the_fix(token_corpus: Path) -> None:
    def with_text(batch: dict) -> dict:
        return {**batch, "text": pa.array([f"record {i}" for i in batch["id"].tolist()])}

    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus), columns=["id", "tokens"]),
        transforms=[with_text, cd.pad_or_truncate("tokens", 4)],
        global_batch_size=4,
    )
    with pytest.raises(TransformError, match=r"column 'text' is string .*add cd.drop\('text'\)"):
        next(cd.Loader(pipeline))
    fixed = dataclasses.replace(pipeline, transforms=[*pipeline.transforms, cd.drop("text")])
    assert set(next(cd.Loader(fixed))) == {"id", "tokens"}


def grid_of(record: dict) -> dict:
    """A per-record field of shape (2, 3)."""
    return {**record, "grid": np.full((2, 3), record["id"], np.float32)}


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_fields_of_two_dimensions_become_batch_dimensions(tmp_path: Path, backend: str) -> None:
    """A per-record field of shape (2, 3), from a record source, a Parquet file or a
    per-record transform, is a (B, 2, 3) batch column."""
    grids = np.arange(16 * 6, dtype=np.float32).reshape(16, 2, 3)
    records = grain.MapDataset.source([{"id": i, "grid": grids[i]} for i in range(16)])
    nested = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(grids.reshape(-1)), 3), 2)
    pq.write_table(pa.table({"id": np.arange(16), "grid": nested}), tmp_path / "grids.parquet")
    sources = {"record source": records, "Parquet": cd.ArrowSource(str(tmp_path / "grids.parquet"))}
    if backend == "sidecar":  # the record source (whose rows are stacked where the source is read) travels there
        del sources["Parquet"]
    for what, source in sources.items():
        with cd.Loader(cd.Pipeline(source=source, global_batch_size=4), backend=backend) as loader:
            batch = next(loader)
        np.testing.assert_array_equal(np.asarray(batch["grid"]), grids[np.asarray(batch["id"])], err_msg=what)
    if backend == "sidecar":
        return
    made = cd.Pipeline(source=cd.ArrowSource(str(tmp_path / "grids.parquet"), columns=["id"]),
                       transforms=[cd.per_record(grid_of)], global_batch_size=4)
    with cd.Loader(made, backend=backend) as loader:
        batch = next(loader)
    assert np.asarray(batch["grid"]).shape == (4, 2, 3)
    np.testing.assert_array_equal(np.asarray(batch["grid"])[:, 1, 2], np.asarray(batch["id"]))
