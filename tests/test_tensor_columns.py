"""A column of a fixed-shape array per record, read from real files: Parquet's nested lists
(`list<list<int64>>`) and Arrow's `FixedShapeTensor` extension type (in Parquet and in an
Arrow IPC file) arrive as one numpy array of shape (rows, *record shape); nested lists of
other lengths are a TransformError that names the column and the lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.testing import read_all

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

RECORDS, BATCH = 40, 8


def arrays(shape: tuple[int, ...]) -> np.ndarray:
    """One array of `shape` per record, each different (int64 values that JAX's 32-bit mode holds)."""
    return np.random.default_rng(5).integers(-(2**31), 2**31, size=(RECORDS, *shape))


def nested_lists(records: list[list]) -> pa.Array:
    return pa.array(records, pa.list_(pa.list_(pa.int64())))


def tensors(values: np.ndarray) -> pa.Array:
    return pa.FixedShapeTensorArray.from_numpy_ndarray(values)


def read(path: Path, shuffle: str = "global") -> list[dict[str, np.ndarray]]:
    pipeline = cd.Pipeline(source=cd.ArrowSource(str(path)), order=cd.Order(shuffle=shuffle, seed=1), global_batch_size=BATCH)
    return read_all(cd.Loader(pipeline, hosts=2))


def assert_rows(batches: list[dict[str, np.ndarray]], values: np.ndarray) -> None:
    assert len(batches) == RECORDS // BATCH
    for batch in batches:
        assert batch["m"].shape == (BATCH, *values.shape[1:])
        np.testing.assert_array_equal(np.asarray(batch["m"]), values[np.asarray(batch["id"])])


@pytest.mark.parametrize("shape", [(3, 4), (1, 7), (2, 3, 2)])
def test_nested_lists_of_one_shape_are_a_column_of_arrays(tmp_path: Path, shape: tuple[int, ...]) -> None:
    values = arrays(shape)
    column = pa.array(values.tolist(), pa.list_(pa.list_(pa.int64())) if len(shape) == 2 else None)
    pq.write_table(pa.table({"id": np.arange(RECORDS), "m": column}), tmp_path / "m.parquet", row_group_size=7)
    assert_rows(read(tmp_path / "m.parquet"), values)


def test_fixed_shape_tensors_in_parquet_and_arrow_ipc(tmp_path: Path) -> None:
    values = arrays((3, 4))
    table = pa.table({"id": np.arange(RECORDS), "m": tensors(values)})
    pq.write_table(table, tmp_path / "m.parquet", row_group_size=7)
    assert isinstance(pq.read_schema(tmp_path / "m.parquet").field("m").type, pa.FixedShapeTensorType)
    assert_rows(read(tmp_path / "m.parquet"), values)
    feather.write_feather(table, tmp_path / "m.arrow", chunksize=7)
    assert_rows(read(tmp_path / "m.arrow"), values)


def test_nested_lists_of_other_lengths_are_named(tmp_path: Path) -> None:
    records = arrays((3, 4)).tolist()
    records[5][1] = records[5][1][:2]  # one inner list of 2
    records[6] = records[6][:2]  # one record of 2 lists
    pq.write_table(pa.table({"id": np.arange(RECORDS), "m": nested_lists(records)}), tmp_path / "m.parquet")
    with pytest.raises(cd.errors.TransformError) as raised:
        read(tmp_path / "m.parquet", shuffle="none")
    message = str(raised.value)
    assert "column 'm'" in message and "pad_or_truncate" not in message, message
    assert "lists of 2 and 3 lists" in message and "of 2 and 4 values" in message, message
