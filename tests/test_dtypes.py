"""No silent narrowing (issue 12, finding 6). In JAX's default 32-bit mode JAX makes an
int64 column int32, uint64 uint32 and float64 float32 without a word (10**10 + 5 arrived as
1410065413): a 64-bit column whose values the 32-bit dtype does not all hold exactly is now
a TransformError naming the column and the fixes, one whose values fit arrives exactly as
the 32-bit dtype, and under x64 everything arrives as it was, on every backend. The index
column holds any source's record indices: int64 under x64, and in 32-bit mode a source of
more than 2**31 records is a ConfigError when the loader is made.

x64 is switched on with `jax.config.update` for the length of a test (and switched off
after it): the loader makes its arrays on its own threads, and JAX's `jax.enable_x64`
context holds for the thread that enters it only."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.pipeline.state import make_state
from colo_data.testing import read_all

from pipelines import backend_of

BACKENDS = [("inprocess", 0), ("inprocess", 2), ("sidecar", 0), ("colocated", 0)]
BATCH = 12  # 3 rows for each of the 4 colocated hosts (the test session's 4 CPU devices)
RECORDS = 48
BAD_ROW = 29  # in the third batch: not only the first batch is looked at
INT32 = np.iinfo(np.int32)


def column_values() -> dict[str, np.ndarray]:
    """The corpus's columns, record by record: 64-bit columns whose values the 32-bit dtype
    holds (its limits included), and one of each kind holding a value it does not."""
    rows = np.arange(RECORDS)
    fits_int = rows - 24
    fits_int[[0, 1]] = INT32.min, INT32.max
    fits_uint = rows.astype(np.uint64)
    fits_uint[1] = np.iinfo(np.uint32).max
    fits_float = rows / 4  # quarters: exact in float32
    fits_float[[1, 2, 3, 4]] = np.nan, np.inf, -np.inf, -0.0
    big_int, big_uint, tenth = fits_int.copy(), fits_uint.copy(), fits_float.copy()
    big_int[BAD_ROW], big_uint[BAD_ROW], tenth[BAD_ROW] = 10**10 + 5, 2**40 + 3, 0.1
    return {
        "fits_int": fits_int, "fits_uint": fits_uint, "fits_float": fits_float,
        "big_int": big_int, "big_uint": big_uint, "tenth": tenth,
    }


@pytest.fixture(scope="module")
def wide_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Parquet files of 24 records (row groups of 10) with the columns of `column_values`."""
    root = tmp_path_factory.mktemp("wide")
    table = pa.table(column_values())
    assert table.schema.field("big_uint").type == pa.uint64() and table.schema.field("tenth").type == pa.float64()
    for part in range(2):
        pq.write_table(table.slice(part * 24, 24), root / f"part-{part}.parquet", row_group_size=10)
    return root


@pytest.fixture
def x64() -> Iterator[None]:
    """JAX's x64 mode for this test, for every thread, off again after it."""
    assert not jax.config.jax_enable_x64, "the tests run in JAX's default 32-bit mode"
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def pipeline_of(corpus: Path, columns: list[str]) -> cd.Pipeline:
    return cd.Pipeline(
        source=cd.ArrowSource(str(corpus), columns=columns),
        order=cd.Order(shuffle="none"),
        global_batch_size=BATCH,
        index_column="_index",
    )


def loader_of(pipeline: cd.Pipeline, backend: str, workers: int, tmp_path: Path, **options: object) -> cd.Loader:
    return cd.Loader(pipeline, backend=backend_of(backend, workers, tmp_path), **options)


def read_columns(corpus: Path, columns: list[str], backend: str, workers: int, tmp_path: Path) -> dict[str, np.ndarray]:
    """Every batch of the corpus's `columns` (and `_index`), concatenated, checking that the
    dtype is the same in every batch."""
    batches = read_all(loader_of(pipeline_of(corpus, columns), backend, workers, tmp_path))
    assert len(batches) == RECORDS // BATCH
    for batch in batches:
        assert {n: a.dtype for n, a in batch.items()} == {n: a.dtype for n, a in batches[0].items()}
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}


@pytest.mark.parametrize("backend, workers", BACKENDS)
@pytest.mark.parametrize(
    "column, dtype, shown, cast",
    [
        ("big_int", "int64", "10000000005", "np.int32"),
        ("big_uint", "uint64", str(2**40 + 3), "np.uint32"),
        ("tenth", "float64", "0.1", "np.float32"),
    ],
)
def test_a_64_bit_value_that_32_bits_do_not_hold_is_an_error_naming_the_column_and_the_fixes(
    wide_corpus: Path, tmp_path: Path, backend: str, workers: int, column: str, dtype: str, shown: str, cast: str
) -> None:
    with pytest.raises(cd.errors.TransformError) as raised:
        read_all(loader_of(pipeline_of(wide_corpus, ["fits_int", column]), backend, workers, tmp_path))
    message = str(raised.value)
    assert f"column {column!r} is {dtype} and holds {shown} (host " in message, message
    assert 'jax.config.update("jax_enable_x64", True) before making the Loader' in message, message
    assert f"batch[{column!r}].astype({cast})" in message, message


@pytest.mark.parametrize("backend, workers", BACKENDS)
def test_64_bit_values_that_fit_arrive_exactly_as_their_32_bit_dtype(
    wide_corpus: Path, tmp_path: Path, backend: str, workers: int
) -> None:
    got = read_columns(wide_corpus, ["fits_int", "fits_uint", "fits_float"], backend, workers, tmp_path)
    want = column_values()
    assert {n: str(a.dtype) for n, a in got.items()} == {
        "fits_int": "int32", "fits_uint": "uint32", "fits_float": "float32", "_index": "int32",
    }
    for name in ("fits_int", "fits_uint", "fits_float"):
        assert np.array_equal(got[name].astype(want[name].dtype), want[name], equal_nan=True), name
    assert np.signbit(got["fits_float"][4]), "-0.0 keeps its sign"
    assert np.array_equal(got["_index"], np.arange(RECORDS))


@pytest.mark.parametrize("backend, workers", BACKENDS)
def test_under_x64_64_bit_values_and_the_index_arrive_as_they_are(
    wide_corpus: Path, tmp_path: Path, backend: str, workers: int, x64: None
) -> None:
    columns = ["big_int", "big_uint", "tenth"]
    got = read_columns(wide_corpus, columns, backend, workers, tmp_path)
    want = column_values()
    assert {n: str(a.dtype) for n, a in got.items()} == {
        "big_int": "int64", "big_uint": "uint64", "tenth": "float64", "_index": "int64",
    }
    for name in columns:
        assert np.array_equal(got[name], want[name], equal_nan=True), name
    assert got["big_int"][BAD_ROW] == 10**10 + 5 and got["tenth"][BAD_ROW] == 0.1


def test_packed_index_column_is_32_bit_with_its_padding_or_64_bit_under_x64(tmp_path: Path) -> None:
    """Packing's index column (int64 on the host, -1 where a row has no record) follows the
    same rules: it fits int32, so it arrives as int32, and as int64 under x64."""
    lists = pa.array([list(range(n)) for n in (3, 5, 2, 6, 1, 4, 7, 2)] * 6, pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": lists}), tmp_path / "tokens.parquet")
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(tmp_path / "tokens.parquet")),
        pack=cd.Pack("tokens", 8, max_segments=4),
        global_batch_size=4,
        index_column="_index",
    )
    narrow = read_all(cd.Loader(pipeline))
    jax.config.update("jax_enable_x64", True)
    try:
        wide = read_all(cd.Loader(pipeline))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert len(narrow) == len(wide) > 1
    for a, b in zip(narrow, wide, strict=True):
        assert (a["_index"].dtype, b["_index"].dtype) == (np.int32, np.int64)
        assert np.array_equal(a["_index"], b["_index"]) and (a["_index"] == -1).any()


def huge_corpus(root: Path, files: int) -> Path:
    """A real Parquet corpus of `files` * 2**24 records (an int8 column of zeros) without
    encoding billions of rows: one file of 2**24 records (54 KB: zeros compress) and
    `files - 1` copies of its bytes (links would not do: a source reads a file once, however
    many names it has)."""
    root.mkdir()
    pq.write_table(pa.table({"x": pa.array(np.zeros(2**24, np.int8))}), root / "part-000.parquet", row_group_size=2**24)
    for i in range(1, files):
        shutil.copyfile(root / "part-000.parquet", root / f"part-{i:03d}.parquet")
    return root


@pytest.fixture(scope="module")
def over_2_31(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """129 * 2**24 = 2,164,260,864 records: more than an int32 index holds."""
    return huge_corpus(tmp_path_factory.mktemp("huge") / "over", 129)


def huge_pipeline(corpus: Path) -> cd.Pipeline:
    return cd.Pipeline(
        source=cd.ArrowSource(str(corpus)), order=cd.Order(shuffle="none"), global_batch_size=BATCH, index_column="_index"
    )


@pytest.mark.parametrize("backend, workers", BACKENDS)
def test_an_index_column_that_int32_cannot_hold_is_a_config_error_when_the_loader_is_made(
    over_2_31: Path, tmp_path: Path, backend: str, workers: int
) -> None:
    pipeline = huge_pipeline(over_2_31)
    assert len(pipeline.source) == 129 * 2**24 > 2**31
    with pytest.raises(cd.errors.ConfigError) as raised:
        loader_of(pipeline, backend, workers, tmp_path)
    message = str(raised.value)
    assert "index_column='_index': the source has 2,164,260,864 records" in message, message
    assert 'jax.config.update("jax_enable_x64", True) before making the Loader' in message, message


def test_a_source_of_exactly_2_31_records_fits_an_int32_index(tmp_path: Path) -> None:
    """The last record's index is 2**31 - 1, int32's largest: the loader is made."""
    pipeline = huge_pipeline(huge_corpus(tmp_path / "exact", 128))
    assert len(pipeline.source) == 2**31
    cd.Loader(pipeline).close()


@pytest.mark.parametrize("backend, workers", BACKENDS)
def test_under_x64_the_index_column_holds_indices_beyond_2_31(
    over_2_31: Path, tmp_path: Path, backend: str, workers: int, x64: None
) -> None:
    pipeline = huge_pipeline(over_2_31)
    start = 2**31 + 5 * BATCH
    (batch,) = read_all(loader_of(pipeline, backend, workers, tmp_path, state=make_state(pipeline, start)), steps=1)
    assert batch["_index"].dtype == np.int64
    assert np.array_equal(batch["_index"], start + np.arange(BATCH))
