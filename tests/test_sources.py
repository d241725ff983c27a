"""ArrowSource on real Parquet and Arrow IPC files written by pyarrow: the global index,
random access and the vectorised gather against `pyarrow.parquet.read_table` / the IPC
reader, other `pyarrow.fs` filesystems, path forms, pickling, the row-group cache, every
error it raises, and the fingerprint."""

from __future__ import annotations

import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colo_data as cd
from colo_data.io.rowgroup_cache import RowGroupCache
from colo_data.io.record_source import Source

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("x", pa.float64()),
        ("flag", pa.bool_()),
        ("i_null", pa.int32()),
        ("s_null", pa.string()),
        ("cat", pa.dictionary(pa.int32(), pa.string())),
        ("tokens", pa.list_(pa.int32())),
        ("tok_null", pa.list_(pa.int64())),
        ("floats", pa.list_(pa.float32())),
        ("big", pa.large_list(pa.int16())),
        ("text", pa.large_string()),
    ]
)
CATEGORIES = ["red", "green", "blue", "", "ünïcode"]

# Row-group (record-batch) sizes of every file, uneven, with zero-row groups and files. The
# keys are in sorted path order, which is the global order: "part-10" sorts before "part-2".
PARQUET_LAYOUT = {
    "nested/part-1.parquet": [2, 11, 4, 1],
    "part-10.parquet": [5, 1, 9, 0, 3],
    "part-2.parquet": [7],
    "part-3.parquet": [0],  # one row group of zero rows
    "part-4.pq": [],  # no row groups at all
}
IPC_LAYOUT = {
    "a.arrow": [3, 12],
    "b.arrow": [4, 0, 6, 1, 8],
    "c.feather": [],  # an IPC file with no record batches
    "d.ipc": [5],
}


# --------------------------------------------------------------------------------------
# writing the fixtures


def make_table(start: int, n: int, rng: np.random.Generator) -> pa.Table:
    """`n` rows whose `id` runs from `start`; nulls, empty strings and empty lists included."""

    def maybe(p: float, value: Any) -> Any:
        return None if rng.random() < p else value

    ids = np.arange(start, start + n, dtype=np.int64)
    columns = {
        "id": ids,
        "x": rng.normal(size=n),
        "flag": rng.random(n) < 0.5,
        "i_null": [maybe(0.3, int(v)) for v in rng.integers(-(2**31), 2**31 - 1, n)],
        "s_null": [maybe(0.25, f"s{i}" + "é" * int(rng.integers(0, 4)) if i % 5 else "") for i in ids],
        "cat": pa.array(
            [maybe(0.2, CATEGORIES[rng.integers(len(CATEGORIES))]) for _ in ids], pa.string()
        ).dictionary_encode(),
        "tokens": [rng.integers(-1000, 1000, rng.integers(0, 10)).tolist() for _ in ids],
        "tok_null": [maybe(0.2, [maybe(0.2, int(v)) for v in rng.integers(0, 2**40, rng.integers(0, 5))]) for _ in ids],
        "floats": [(rng.integers(-64, 64, rng.integers(0, 6)) / 4).tolist() for _ in ids],
        "big": [rng.integers(-(2**15), 2**15, rng.integers(0, 7)).tolist() for _ in ids],
        "text": ["t" * int(k) + str(i) for i, k in zip(ids, rng.integers(0, 30, n))],
    }
    return pa.table(columns, schema=SCHEMA)


def write_parquet(path: Path, start: int, group_sizes: list[int], rng: np.random.Generator) -> int:
    """One row group per entry of `group_sizes` (each with its own string dictionary)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, SCHEMA) as writer:
        for n in group_sizes:
            writer.write_table(make_table(start, n, rng))
            start += n
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == group_sizes
    return start


def write_ipc(path: Path, start: int, batch_sizes: list[int], rng: np.random.Generator) -> int:
    """An IPC file of record batches of these sizes (IPC files allow one dictionary per column,
    so the batches are slices of one table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    total = sum(batch_sizes)
    batch = make_table(start, total, rng).combine_chunks().to_batches()[0] if total else None
    with ipc.new_file(path, SCHEMA) as writer:
        offset = 0
        for n in batch_sizes:
            writer.write_batch(batch.slice(offset, n) if batch is not None else SCHEMA.empty_table().to_batches()[0])
            offset += n
    reader = ipc.open_file(path)
    assert [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)] == batch_sizes
    return start + total


def read_parquet_files(paths: list[Path]) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in paths])


def read_ipc_files(paths: list[Path]) -> pa.Table:
    return pa.concat_tables([ipc.open_file(p).read_all() for p in paths])


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(1)
    start = 0
    for name, sizes in PARQUET_LAYOUT.items():  # keys are in global (sorted path) order
        start = write_parquet(root / name, start, sizes, rng)
    # Not data files: a directory source skips them (each would be a CorruptFileError).
    (root / "README.txt").write_text("not data")
    (root / "_SUCCESS").write_text("")
    (root / "_partial.parquet").write_text("hidden by the underscore")
    (root / ".hidden.parquet").write_text("hidden by the dot")
    return root


@pytest.fixture(scope="module")
def ipc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ipc")
    rng = np.random.default_rng(2)
    start = 0
    for name, sizes in IPC_LAYOUT.items():
        start = write_ipc(root / name, start, sizes, rng)
    return root


@pytest.fixture(scope="module")
def parquet_expected(parquet_dir: Path) -> pa.Table:
    table = read_parquet_files([parquet_dir / name for name in PARQUET_LAYOUT])
    assert table.column("id").to_pylist() == list(range(sum(map(sum, PARQUET_LAYOUT.values()))))
    return table


@pytest.fixture(scope="module")
def ipc_expected(ipc_dir: Path) -> pa.Table:
    table = read_ipc_files([ipc_dir / name for name in IPC_LAYOUT])
    assert table.column("id").to_pylist() == list(range(sum(map(sum, IPC_LAYOUT.values()))))
    return table


@pytest.fixture(scope="module")
def mock_fs(parquet_dir: Path, ipc_dir: Path) -> pafs.FileSystem:
    """pyarrow's in-memory filesystem holding byte-identical copies of both fixtures."""
    fs = pafs._MockFileSystem()
    for local_root, prefix, names in ((parquet_dir, "pq", PARQUET_LAYOUT), (ipc_dir, "ipc", IPC_LAYOUT)):
        for name in names:
            fs.create_dir(f"{prefix}/{name}".rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(f"{prefix}/{name}") as out:
                out.write((local_root / name).read_bytes())
    with fs.open_output_stream("pq/README.txt") as out:
        out.write(b"not data")
    with fs.open_output_stream("top.parquet") as out:  # a file at the root of the filesystem
        out.write((parquet_dir / "part-2.parquet").read_bytes())
    return fs


# --------------------------------------------------------------------------------------
# comparison helpers


def plain(table: pa.Table) -> pa.Table:
    """Dictionary columns decoded to their values (row groups carry different dictionaries,
    which `Table.equals` would compare), one chunk per column."""
    columns = [
        col.cast(f.type.value_type) if pa.types.is_dictionary(f.type) else col
        for f, col in zip(table.schema, table.columns)
    ]
    return pa.Table.from_arrays(columns, names=table.column_names).combine_chunks()


def assert_tables_equal(got: pa.Table, want: pa.Table) -> None:
    got_plain, want_plain = plain(got), plain(want)
    assert got_plain.schema.equals(want_plain.schema), f"{got_plain.schema}\n!=\n{want_plain.schema}"
    assert got.num_rows == want.num_rows
    for name in want.column_names:
        assert got_plain.column(name).equals(want_plain.column(name)), (
            f"column {name!r}: {got_plain.column(name).to_pylist()} != {want_plain.column(name).to_pylist()}"
        )
    assert got_plain.equals(want_plain)


def check_take(src: cd.ArrowSource, expected: pa.Table, indices: Any) -> None:
    got = src.take(indices)
    assert got.schema.equals(src.schema), f"{got.schema}\n!=\n{src.schema}"
    assert_tables_equal(got, expected.take(pa.array(np.asarray(indices, dtype=np.int64))))


def numeric_list(kind: pa.DataType) -> bool:
    """Lists of numbers: `src[i]` gives a numpy array for such a row unless it holds a null."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
    )


def assert_record_equal(record: dict[str, Any], want: dict[str, Any], schema: pa.Schema) -> None:
    assert list(record) == list(want)
    for name, value in want.items():
        got = record[name]
        if value is None:
            assert got is None, f"{name}: {got!r} is not None"
        elif numeric_list(schema.field(name).type) and None not in value:
            assert isinstance(got, np.ndarray), f"{name}: {type(got)} is not a numpy array"
            assert got.dtype == schema.field(name).type.value_type.to_pandas_dtype(), f"{name}: dtype {got.dtype}"
            assert got.tolist() == value, f"{name}: {got!r} != {value!r}"
        else:
            assert not isinstance(got, np.ndarray) or got.ndim == 0, f"{name}: {got!r} is an array"
            assert got == value, f"{name}: {got!r} != {value!r}"
            assert type(got) is type(value) or isinstance(got, np.generic), f"{name}: {type(got)} vs {type(value)}"


def check_records(src: cd.ArrowSource, expected: pa.Table) -> None:
    assert len(src) == expected.num_rows
    rows = expected.select(list(src.columns)).to_pylist()
    for i in range(len(src)):
        assert_record_equal(src[i], rows[i], src.schema)
    assert_record_equal(src[np.int64(len(src) - 1)], rows[-1], src.schema)  # numpy integers too


def index_arrays(n: int, seed: int = 0) -> list[np.ndarray]:
    """Index arrays of every shape that matters: repeats, unsorted, runs, reversed, all rows,
    one row, none."""
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, n, size) for size in (1, 2, 3, 7, 16, 33, 64, 150, 500)]
    arrays += [
        np.arange(n),
        np.arange(n)[::-1].copy(),
        rng.permutation(n),
        np.repeat(rng.integers(0, n, 5), 4),  # the same record several times in a row
        np.concatenate([np.arange(3, 12), np.arange(0, 4), np.arange(n - 6, n)]),  # runs across row groups
        np.array([n - 1, 0, n - 1, 0]),
        np.array([7]),
        np.array([], dtype=np.int64),
    ]
    return arrays


# --------------------------------------------------------------------------------------
# the global index, random access and take on local files


def test_parquet_layout_and_order(parquet_dir: Path) -> None:
    src = cd.ArrowSource(str(parquet_dir))
    assert isinstance(src, Source)
    assert src.files == tuple(str(parquet_dir / name) for name in PARQUET_LAYOUT)
    assert src.row_group_sizes.tolist() == [n for sizes in PARQUET_LAYOUT.values() for n in sizes]
    assert len(src) == sum(map(sum, PARQUET_LAYOUT.values())) == 43
    assert src.columns == tuple(SCHEMA.names)
    assert [numeric_list(t) for t in SCHEMA.types].count(True) == 4  # tokens, tok_null, floats, big
    assert repr(src) == f"ArrowSource(5 files, 43 records, columns={SCHEMA.names})"


def test_parquet_random_access_matches_read_table(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    check_records(cd.ArrowSource(str(parquet_dir)), parquet_expected)


def test_parquet_take_matches_read_table(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    src = cd.ArrowSource(str(parquet_dir))
    n = len(src)
    for indices in index_arrays(n):
        check_take(src, parquet_expected, indices)
    check_take(src, parquet_expected, [5, 1, 5, 40])  # a list
    check_take(src, parquet_expected, np.array([42, 3, 17], dtype=np.int32))  # other integer dtypes
    check_take(src, parquet_expected, np.array([9, 0], dtype=np.uint16))
    empty = src.take([])
    assert empty.num_rows == 0 and empty.schema.equals(src.schema)
    assert src.take(np.arange(n)).column("id").to_pylist() == list(range(n))


def test_take_one_row_group_at_a_time(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    """Every non-empty row group on its own (first row, last row, all rows shuffled)."""
    src = cd.ArrowSource(str(parquet_dir))
    starts = np.concatenate([[0], np.cumsum(src.row_group_sizes)])
    rng = np.random.default_rng(3)
    for lo, hi in zip(starts[:-1], starts[1:]):
        if hi > lo:
            check_take(src, parquet_expected, [lo])
            check_take(src, parquet_expected, [hi - 1])
            check_take(src, parquet_expected, rng.permutation(np.arange(lo, hi)))


@pytest.fixture(scope="module")
def parquet_source(parquet_dir: Path) -> cd.ArrowSource:
    return cd.ArrowSource(str(parquet_dir), cache_bytes=6000)


@settings(max_examples=60, deadline=None)
@given(indices=st.lists(st.integers(0, 42), max_size=80))
def test_take_property(indices: list[int], parquet_source: cd.ArrowSource, parquet_expected: pa.Table) -> None:
    assert len(parquet_source) == 43
    check_take(parquet_source, parquet_expected, np.array(indices, dtype=np.int64))


def test_column_subset(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    src = cd.ArrowSource(str(parquet_dir), columns=["tokens", "id", "cat"])
    assert src.columns == ("tokens", "id", "cat")
    assert src.schema.names == ["tokens", "id", "cat"]
    expected = parquet_expected.select(["tokens", "id", "cat"])
    for indices in index_arrays(len(src), seed=4):
        check_take(src, expected, indices)
    check_records(src, expected)


def test_ipc_layout_random_access_and_take(ipc_dir: Path, ipc_expected: pa.Table) -> None:
    src = cd.ArrowSource(str(ipc_dir))
    assert src.files == tuple(str(ipc_dir / name) for name in IPC_LAYOUT)
    assert src.row_group_sizes.tolist() == [n for sizes in IPC_LAYOUT.values() for n in sizes]
    assert len(src) == ipc_expected.num_rows == 39
    assert src.schema.field("cat").type == pa.dictionary(pa.int32(), pa.string())
    check_records(src, ipc_expected)
    for indices in index_arrays(len(src), seed=5):
        check_take(src, ipc_expected, indices)


def test_parquet_and_ipc_in_one_source(parquet_dir: Path, ipc_dir: Path) -> None:
    src = cd.ArrowSource([str(ipc_dir / "b.arrow"), str(parquet_dir / "part-10.parquet")])
    assert src.files == tuple(sorted([str(ipc_dir / "b.arrow"), str(parquet_dir / "part-10.parquet")]))
    parts = {
        str(ipc_dir / "b.arrow"): read_ipc_files([ipc_dir / "b.arrow"]),
        str(parquet_dir / "part-10.parquet"): read_parquet_files([parquet_dir / "part-10.parquet"]),
    }
    expected = pa.concat_tables([parts[f].cast(SCHEMA) for f in src.files])
    for indices in index_arrays(len(src), seed=6):
        check_take(src, expected, indices)


# --------------------------------------------------------------------------------------
# path forms and other filesystems


def test_local_path_forms(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    everything = tuple(str(parquet_dir / name) for name in PARQUET_LAYOUT)
    top_level = tuple(p for p in everything if "/nested/" not in p and p.endswith(".parquet"))
    assert cd.ArrowSource(str(parquet_dir) + "/").files == everything
    assert cd.ArrowSource(f"{parquet_dir}/part-*.parquet").files == top_level
    assert cd.ArrowSource(f"{parquet_dir}/part-?.parquet").files == top_level[1:]
    assert cd.ArrowSource(f"{parquet_dir}/**/part-*").files == everything  # "**/" matches no directory too
    assert cd.ArrowSource(f"{parquet_dir}/*/*.parquet").files == everything[:1]
    shuffled = [everything[3], everything[0], everything[1]]
    assert cd.ArrowSource(shuffled).files == (everything[0], everything[1], everything[3])
    assert cd.ArrowSource([str(parquet_dir), everything[2]]).files == everything  # duplicates count once
    src = cd.ArrowSource(everything[2])
    assert src.files == everything[2:3] and len(src) == 7
    check_take(src, parquet_expected.slice(36, 7), np.array([6, 0, 3, 3]))
    assert src.take([0]).column("id").to_pylist() == [36]


def test_relative_paths(parquet_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(parquet_dir)
    src = cd.ArrowSource("nested")
    assert src.files == (str(parquet_dir / "nested/part-1.parquet"),)
    assert src.take([17, 0]).column("id").to_pylist() == [17, 0]


MOCK_PATTERNS: list[Any] = [
    (
        "pq",
        [
            "pq/nested/part-1.parquet", "pq/part-10.parquet",
            "pq/part-2.parquet", "pq/part-3.parquet", "pq/part-4.pq",
        ],
    ),
    ("pq/**/*.parquet", ["pq/nested/part-1.parquet", "pq/part-10.parquet", "pq/part-2.parquet", "pq/part-3.parquet"]),
    ("pq/*.parquet", ["pq/part-10.parquet", "pq/part-2.parquet", "pq/part-3.parquet"]),
    (["pq/part-2.parquet", "pq/nested/part-1.parquet"], ["pq/nested/part-1.parquet", "pq/part-2.parquet"]),
    ("/pq/part-1*", ["/pq/part-10.parquet"]),
    ("*.parquet", ["/top.parquet"]),  # a glob at the filesystem's root
]


@pytest.mark.parametrize(("paths", "files"), MOCK_PATTERNS, ids=lambda v: repr(v) if isinstance(v, str) else None)
def test_mock_filesystem_path_forms(mock_fs: pafs.FileSystem, paths: Any, files: list[str]) -> None:
    assert list(cd.ArrowSource(paths, filesystem=mock_fs).files) == files


def test_mock_filesystem_parquet(mock_fs: pafs.FileSystem, parquet_expected: pa.Table) -> None:
    src = cd.ArrowSource("pq", filesystem=mock_fs)
    assert src.row_group_sizes.tolist() == [n for sizes in PARQUET_LAYOUT.values() for n in sizes]
    check_records(src, parquet_expected)
    for indices in index_arrays(len(src), seed=7):
        check_take(src, parquet_expected, indices)
    top = cd.ArrowSource("*.parquet", filesystem=mock_fs)
    check_take(top, parquet_expected.slice(36, 7), [6, 5, 0])


def test_mock_filesystem_ipc(mock_fs: pafs.FileSystem, ipc_expected: pa.Table) -> None:
    src = cd.ArrowSource("ipc", filesystem=mock_fs)
    assert list(src.files) == [f"ipc/{name}" for name in IPC_LAYOUT]
    check_records(src, ipc_expected)
    for indices in index_arrays(len(src), seed=8):
        check_take(src, ipc_expected, indices)


def test_subtree_filesystem(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    fs = pafs.SubTreeFileSystem(str(parquet_dir.parent), pafs.LocalFileSystem())
    name = parquet_dir.name
    src = cd.ArrowSource(name, filesystem=fs)
    assert list(src.files) == [f"{name}/{n}" for n in PARQUET_LAYOUT]
    check_records(src, parquet_expected)
    for indices in index_arrays(len(src), seed=9):
        check_take(src, parquet_expected, indices)
    top_level = cd.ArrowSource(f"{name}/part-*.parquet", filesystem=fs).files
    assert len(top_level) == 3
    assert cd.ArrowSource(f"/{name}/part-*.parquet", filesystem=fs).files == top_level  # a leading "/" too
    assert cd.ArrowSource(f"{name}/nested/part-1.parquet", filesystem=fs).take([3]).column("id").to_pylist() == [3]


def test_file_uri(parquet_dir: Path) -> None:
    src = cd.ArrowSource(f"file://{parquet_dir}/part-2.parquet")
    assert src.files == (str(parquet_dir / "part-2.parquet"),)
    assert src.take([6, 0]).column("id").to_pylist() == [42, 36]


# --------------------------------------------------------------------------------------
# pickling, prefetch, the cache, threads


@pytest.mark.parametrize("kind", ["local", "subtree", "ipc"])
def test_pickle_after_caching(kind: str, parquet_dir: Path, ipc_dir: Path) -> None:
    if kind == "local":
        src = cd.ArrowSource(str(parquet_dir))
    elif kind == "subtree":
        fs = pafs.SubTreeFileSystem(str(parquet_dir.parent), pafs.LocalFileSystem())
        src = cd.ArrowSource(parquet_dir.name, filesystem=fs)
    else:
        src = cd.ArrowSource(str(ipc_dir))
    fresh = len(pickle.dumps(src))
    indices = index_arrays(len(src), seed=10)
    before = [src.take(i) for i in indices]  # every row group decoded and cached
    src.prefetch(np.arange(len(src)))  # a live background thread
    blob = pickle.dumps(src)
    assert len(blob) == fresh  # neither the cache nor open readers travel
    copy = pickle.loads(blob)
    assert copy.files == src.files and len(copy) == len(src) and copy.fingerprint() == src.fingerprint()
    assert np.array_equal(copy.row_group_sizes, src.row_group_sizes)
    for table, i in zip(before, indices):
        assert copy.take(i).equals(table)
    assert pickle.loads(pickle.dumps(copy)).take(indices[5]).equals(before[5])  # pickled again, after use
    assert src.take(indices[6]).equals(before[6])  # the original still works


def test_prefetch_then_take(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    src = cd.ArrowSource(str(parquet_dir))
    for indices in index_arrays(len(src), seed=11):
        src.prefetch(indices)
        check_take(src, parquet_expected, indices)
    src.prefetch(np.array([-5, len(src), len(src) + 100, 3]))  # out-of-range positions are ignored
    src.prefetch([])
    check_take(src, parquet_expected, [3])


@pytest.mark.parametrize("cache_bytes", [1, 3000])
def test_small_cache_evicts_and_stays_correct(
    cache_bytes: int, parquet_dir: Path, ipc_dir: Path, parquet_expected: pa.Table, ipc_expected: pa.Table
) -> None:
    for path, expected in ((parquet_dir, parquet_expected), (ipc_dir, ipc_expected)):
        src = cd.ArrowSource(str(path), cache_bytes=cache_bytes)
        for indices in index_arrays(len(src), seed=12) * 2:
            src.prefetch(indices[::-1])
            check_take(src, expected, indices)
        cache = src._row_groups
        assert len(cache._tables) < int(np.count_nonzero(src.row_group_sizes))  # something was evicted
        assert cache._bytes == sum(t.nbytes for t in cache._tables.values())
        assert cache_bytes > 1 or len(cache._tables) == 1  # the newest group always stays


def test_concurrent_takes(parquet_dir: Path, parquet_expected: pa.Table) -> None:
    src = cd.ArrowSource(str(parquet_dir), cache_bytes=4000)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for indices in index_arrays(len(src), seed=seed):
                src.prefetch(indices)
                check_take(src, parquet_expected, indices)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def counting_loader(tables: dict[int, pa.Table]) -> tuple[Callable[[int, object], pa.Table], dict[int, int], set[int]]:
    calls: dict[int, int] = {}
    threads: set[int] = set()

    def load(group: int, _fetched: object) -> pa.Table:
        calls[group] = calls.get(group, 0) + 1
        threads.add(threading.get_ident())
        return tables[group]

    return load, calls, threads


def test_rowgroup_cache_lru() -> None:
    tables = {g: pa.table({"v": np.full(100, g, dtype=np.int64)}) for g in range(4)}  # 800 bytes each
    load, calls, threads = counting_loader(tables)
    cache = RowGroupCache(load, max_bytes=1600)  # room for two groups
    assert cache.get(0) is tables[0] and cache.get(1) is tables[1]
    assert cache.get(0) is tables[0]  # cached, and now the most recent
    assert calls == {0: 1, 1: 1}
    cache.get(2)  # evicts 1, the least recently used
    assert cache.get(0) is tables[0] and calls[0] == 1
    cache.get(1)
    assert calls == {0: 1, 1: 2, 2: 1}
    assert threads and threading.get_ident() not in threads and len(threads) == 1  # one loader thread


def test_rowgroup_cache_tiny_budget_keeps_newest() -> None:
    tables = {g: pa.table({"v": np.arange(10) + g}) for g in range(3)}
    load, calls, _ = counting_loader(tables)
    cache = RowGroupCache(load, max_bytes=1)
    for g in (0, 1, 0, 0, 2, 2):
        assert cache.get(g) is tables[g]
    assert calls == {0: 2, 1: 1, 2: 1}
    assert list(cache._tables) == [2]


def test_rowgroup_cache_prefetch_loads_once() -> None:
    tables = {g: pa.table({"v": [g]}) for g in range(5)}
    load, calls, _ = counting_loader(tables)
    cache = RowGroupCache(load, max_bytes=10**6)
    cache.prefetch([0, 1, 2, 1, 0])
    cache.prefetch([2, 3])
    assert [cache.get(g).column("v").to_pylist() for g in (3, 2, 1, 0)] == [[3], [2], [1], [0]]
    cache.prefetch(range(4))
    assert [cache.get(g) for g in range(4)] == [tables[g] for g in range(4)]
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1}


def test_rowgroup_cache_errors_propagate_and_are_not_cached() -> None:
    attempts = []
    broken = True

    def load(group: int, _fetched: object) -> pa.Table:
        attempts.append(group)
        if broken:
            raise cd.errors.CorruptFileError(f"group {group} is bad")
        return pa.table({"v": [group]})

    cache = RowGroupCache(load, max_bytes=10**6)
    cache.prefetch([4])  # fails in the background; nobody asks yet
    with pytest.raises(cd.errors.CorruptFileError, match="group 4 is bad"):
        cache.get(4)
    with pytest.raises(cd.errors.CorruptFileError, match="group 4 is bad"):
        cache.get(4)
    tried = len(attempts)
    broken = False
    assert cache.get(4).column("v").to_pylist() == [4]  # the failure was not cached
    assert cache.get(4).column("v").to_pylist() == [4]
    assert len(attempts) == tried + 1 and set(attempts) == {4}


def test_rowgroup_cache_two_stages_forget_a_failed_fetch_however_fast_it_fails() -> None:
    """Object storage's fetch then decode: a fetch that fails before its callback is even
    registered (the callback then runs at once, on the asking thread) is not left behind as
    a failure that every later read of the group gets again."""
    for round_ in range(300):
        broken = [True]

        def fetch(run: list[int], broken: list[bool] = broken) -> list[bytes]:
            if broken[0]:
                raise OSError(f"group {run[0]}: no such object")
            return [b"x"] * len(run)

        cache = RowGroupCache(lambda group, data: pa.table({"v": [group]}), 10**6, fetch=fetch, io_threads=4)
        with pytest.raises(OSError, match="no such object"):
            cache.get(round_)
        broken[0] = False
        assert cache.get(round_).column("v").to_pylist() == [round_]
        cache.close(5)


# --------------------------------------------------------------------------------------
# errors


def test_paths_matching_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "only_text").mkdir()
    (tmp_path / "only_text" / "notes.txt").write_text("hello")
    nothing = (f"{tmp_path}/missing.parquet", f"{tmp_path}/*.parquet", f"{tmp_path}/empty", f"{tmp_path}/only_text")
    for paths in (*nothing, [str(tmp_path / "gone")]):
        with pytest.raises(cd.errors.SourceError) as info:
            cd.ArrowSource(paths)
        assert not isinstance(info.value, cd.errors.CorruptFileError)
        shown = paths if isinstance(paths, str) else paths[0]
        assert shown in str(info.value)
    with pytest.raises(cd.errors.SourceError, match="empty list of paths"):
        cd.ArrowSource([])
    with pytest.raises(cd.errors.SourceError, match="_MockFileSystem"):
        cd.ArrowSource("nowhere", filesystem=pafs._MockFileSystem())


NAMES_NOTHING = {  # a path given beside a good file -> what the error says of it
    "a missing file": ("gone.parquet", "no such file or directory"),
    "a glob that matches nothing": ("*.arrow", "a glob that matches no file"),
    "a directory without data files": ("only_text", "a directory with no .parquet"),
}


@pytest.fixture
def nothing_there(tmp_path: Path) -> Path:
    """A directory holding only a text file (beside nothing else that is data)."""
    (tmp_path / "only_text").mkdir()
    (tmp_path / "only_text" / "notes.txt").write_text("hello")
    return tmp_path


@pytest.mark.parametrize("kind", sorted(NAMES_NOTHING))
def test_a_path_that_names_no_data_file_is_an_error_beside_good_ones(parquet_dir: Path, nothing_there: Path, kind: str) -> None:
    """Issue 26: `ArrowSource([a, missing])` read `a` alone, without a word; every path
    given must name a data file, and the error names the one that does not."""
    name, why = NAMES_NOTHING[kind]
    bad = str(nothing_there / name)
    with pytest.raises(cd.errors.SourceError) as info:
        cd.ArrowSource([str(parquet_dir / "part-2.parquet"), bad])
    message = str(info.value)
    assert f"{bad!r} ({why}" in message and "1 of the 2 paths given" in message, message
    assert "fix these paths" in message and str(parquet_dir) not in message, message


def test_every_path_that_names_no_data_file_is_named(parquet_dir: Path, nothing_there: Path) -> None:
    """Several such paths: one error that names each, not only the first."""
    bad = [str(nothing_there / name) for name, _ in NAMES_NOTHING.values()]
    with pytest.raises(cd.errors.SourceError) as info:
        cd.ArrowSource([str(parquet_dir), *bad])
    assert "3 of the 4 paths given" in str(info.value) and all(repr(b) in str(info.value) for b in bad), str(info.value)


@pytest.mark.parametrize(
    ("records", "at", "kind"),
    [([{"x": 1}, {"x": 2}, [3], {"x": 4}], 2, "list"), ([5, {"x": 1}], 0, "int"), ([{"x": 1}, "text"], 1, "str")],
)
def test_a_record_that_is_not_a_dict_is_named_with_its_index_and_type(records: list[Any], at: int, kind: str) -> None:
    """Issue 26: a record that is not a dict (after dict ones) was a raw AttributeError."""
    source = cd.sources.RecordSource(records)
    with pytest.raises(cd.errors.SourceError, match=rf"list: record {at} is of type {kind}, not dict; .*make every record a dict"):
        source.take(np.arange(len(records)))


@pytest.mark.parametrize("cache_bytes", [0, -1, 1.5, None, True])
def test_bad_cache_bytes(cache_bytes: Any, parquet_dir: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match=rf"cache_bytes={cache_bytes!r}: give an int >= 1"):
        cd.ArrowSource(str(parquet_dir), cache_bytes=cache_bytes)


def good_file(tmp_path: Path, name: str = "good.parquet", rows: int = 30, row_group_size: int = 10) -> Path:
    path = tmp_path / name
    pq.write_table(make_table(0, rows, np.random.default_rng(13)), path, row_group_size=row_group_size)
    return path


def test_truncated_parquet(tmp_path: Path) -> None:
    path = good_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(cd.errors.CorruptFileError, match="truncated or damaged") as info:
        cd.ArrowSource(str(path))
    assert str(path) in str(info.value) and "parquet" in str(info.value)


def test_truncated_ipc(tmp_path: Path) -> None:
    path = tmp_path / "t.arrow"
    write_ipc(path, 0, [10, 10], np.random.default_rng(14))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(cd.errors.CorruptFileError) as info:
        cd.ArrowSource(str(tmp_path))
    assert str(path) in str(info.value)


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def first_page(path: Path, group: int, column: str) -> tuple[int, int]:
    """(offset, size) of the pages of one column's (first leaf's) chunk."""
    row_group = pq.ParquetFile(path).metadata.row_group(group)
    leaf = next(j for j in range(row_group.num_columns) if row_group.column(j).path_in_schema.split(".")[0] == column)
    chunk = row_group.column(leaf)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    return start, chunk.total_compressed_size


@pytest.mark.parametrize("garbage", [b"\xff" * 16, b"\x00" * 16])
def test_corrupt_row_group(tmp_path: Path, garbage: bytes) -> None:
    """Metadata intact, the page header of row group 1's `tokens` chunk overwritten."""
    path = good_file(tmp_path)
    offset, size = first_page(path, 1, "tokens")
    assert size > len(garbage)
    overwrite(path, offset, garbage)
    src = cd.ArrowSource(str(path))  # the footer still parses
    assert src.row_group_sizes.tolist() == [10, 10, 10]
    for read in (lambda: src.take([25, 12]), lambda: src[15], lambda: (src.prefetch([19]), src.take([19]))):
        with pytest.raises(cd.errors.CorruptFileError) as info:
            read()
        assert str(path) in str(info.value) and "row group 1" in str(info.value)
    assert src.take([0, 29, 9, 20]).column("id").to_pylist() == [0, 29, 9, 20]  # the other groups still read
    narrow = cd.ArrowSource(str(path), columns=["id", "text"])  # the damaged column is not read
    assert narrow.take([12, 5]).column("id").to_pylist() == [12, 5]


def test_corrupt_ipc_batch(tmp_path: Path) -> None:
    """An IPC file whose batch metadata is intact but whose list offsets point far outside the
    data: an error naming the file and the record batch, not garbage or a crash."""
    path = tmp_path / "bad.arrow"
    write_ipc(path, 0, [10, 10, 10], np.random.default_rng(15))
    reader = ipc.open_file(path)
    batch = reader.get_batch(1)
    offsets = batch.column(SCHEMA.get_field_index("tokens")).buffers()[1]
    raw = path.read_bytes()
    # the offsets buffer of batch 1's `tokens`: the bytes of its int32 offsets, found in the file
    needle = offsets.to_pybytes()
    at = raw.find(needle, raw.find(b"ARROW1") + 8)
    assert at > 0 and raw.count(needle) == 1
    overwrite(path, at + 4 * 5, np.int32(2**30).tobytes())  # offset 5 (of 11) jumps out of range
    src = cd.ArrowSource(str(path))
    with pytest.raises(cd.errors.CorruptFileError) as info:
        src.take([15])
    assert str(path) in str(info.value) and "row group 1" in str(info.value)
    assert src.take([0, 25]).column("id").to_pylist() == [0, 25]


def test_damaged_column_name_in_footer(tmp_path: Path) -> None:
    """A footer whose column name is no longer UTF-8 (found by fuzzing): a CorruptFileError
    naming the file, not a bare UnicodeDecodeError."""
    path = tmp_path / "names.parquet"
    pq.write_table(pa.table({"colname_xyz": [1, 2, 3]}), path)
    raw = path.read_bytes()
    assert raw.count(b"colname_xyz") >= 1
    path.write_bytes(raw.replace(b"colname_xyz", b"col\xffame_xyz"))  # same length, not UTF-8
    with pytest.raises(cd.errors.CorruptFileError) as info:
        cd.ArrowSource(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", [b"hello, this is text\n", b"", b"PAR"], ids=["text", "empty", "short"])
def test_not_parquet(tmp_path: Path, content: bytes) -> None:
    good_file(tmp_path, "a.parquet")
    path = tmp_path / "b.parquet"
    path.write_bytes(content)
    with pytest.raises(cd.errors.CorruptFileError, match="neither Parquet nor Arrow IPC") as info:
        cd.ArrowSource(str(tmp_path))
    assert str(path) in str(info.value)


def test_ipc_stream_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.arrow"
    table = make_table(0, 5, np.random.default_rng(16))
    with ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(cd.errors.SourceError, match="stream") as info:
        cd.ArrowSource(str(path))
    assert str(path) in str(info.value) and "ipc.new_file" in str(info.value)


def test_missing_column(parquet_dir: Path) -> None:
    with pytest.raises(cd.errors.SchemaError) as info:
        cd.ArrowSource(str(parquet_dir), columns=["id", "labels", "tokens", "mask"])
    message = str(info.value)
    assert "'labels'" in message and "'mask'" in message
    assert all(f"'{name}'" in message for name in SCHEMA.names)  # the columns that exist
    assert str(parquet_dir / "nested/part-1.parquet") in message


def test_missing_column_in_a_later_file(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1], "tokens": [[1]]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [2]}), tmp_path / "b.parquet")
    with pytest.raises(cd.errors.SchemaError) as info:
        cd.ArrowSource(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path / "b.parquet") in message and "'tokens'" in message and "'id'" in message
    assert cd.ArrowSource(str(tmp_path), columns=["id"]).take([1, 0]).column("id").to_pylist() == [2, 1]


def test_schema_mismatch(tmp_path: Path) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": [1], "tokens": pa.array([[1, 2]], pa.list_(pa.int32()))}), a)
    pq.write_table(pa.table({"id": [2], "tokens": pa.array([[3]], pa.list_(pa.int64()))}), b)
    with pytest.raises(cd.errors.SchemaError) as info:
        cd.ArrowSource(str(tmp_path))
    message = str(info.value)
    assert str(a) in message and str(b) in message and "'tokens'" in message
    assert "int32" in message and "int64" in message
    assert cd.ArrowSource(str(tmp_path), columns=["id"]).take([0, 1]).column("id").to_pylist() == [1, 2]


def test_out_of_range_indices(parquet_dir: Path) -> None:
    src = cd.ArrowSource(str(parquet_dir))
    n = len(src)
    for indices in ([n], [-1], [0, 5, n + 7], np.array([3, -2, 1]), [2**40]):
        with pytest.raises(cd.errors.RecordIndexError) as info:
            src.take(indices)
        assert isinstance(info.value, IndexError)
        bad = next(int(i) for i in indices if i < 0 or i >= n)
        assert f"record index {bad} " in str(info.value) and f"[0, {n})" in str(info.value)
    for index in (n, n + 1, -1, -n):
        with pytest.raises(IndexError):
            src[index]
        with pytest.raises(cd.errors.RecordIndexError, match=f"record index {index} "):
            src[index]
    with pytest.raises(cd.errors.RecordIndexError, match="one-dimensional"):
        src.take(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError):
        src["3"]  # type: ignore[index]
    assert src.take([n - 1]).column("id").to_pylist() == [n - 1]


# --------------------------------------------------------------------------------------
# fingerprint


def test_fingerprint(parquet_dir: Path, ipc_dir: Path, tmp_path: Path) -> None:
    fp = cd.ArrowSource(str(parquet_dir)).fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert cd.ArrowSource(str(parquet_dir)).fingerprint() == fp
    assert cd.ArrowSource(f"{parquet_dir}/**/part-*").fingerprint() == fp  # same files, another spelling
    copy = shutil.copytree(parquet_dir, tmp_path / "elsewhere" / "copy")
    assert cd.ArrowSource(str(copy)).fingerprint() == fp  # another directory, same files
    fs = pafs.SubTreeFileSystem(str(tmp_path / "elsewhere"), pafs.LocalFileSystem())
    assert cd.ArrowSource("copy", filesystem=fs).fingerprint() == fp  # another filesystem
    assert cd.ArrowSource(str(parquet_dir), columns=["id", "tokens"]).fingerprint() != fp
    assert cd.ArrowSource(str(ipc_dir)).fingerprint() != fp

    # one more row in one file
    write_parquet(copy / "part-2.parquet", 36, [8], np.random.default_rng(17))
    assert cd.ArrowSource(str(copy)).fingerprint() != fp
    # the same rows, cut into other row groups (block shuffling depends on them)
    write_parquet(copy / "part-2.parquet", 36, [3, 4], np.random.default_rng(17))
    assert cd.ArrowSource(str(copy)).fingerprint() != fp
    # the original back; then a file renamed, or removed
    shutil.copy(parquet_dir / "part-2.parquet", copy / "part-2.parquet")
    assert cd.ArrowSource(str(copy)).fingerprint() == fp
    (copy / "part-2.parquet").rename(copy / "part-9.parquet")
    assert cd.ArrowSource(str(copy)).fingerprint() != fp
    (copy / "part-9.parquet").unlink()
    assert cd.ArrowSource(str(copy)).fingerprint() != fp


def test_an_fsspec_filesystem_reads_the_same_records(tmp_path: Path) -> None:
    """An fsspec filesystem (its local one: any fsspec filesystem takes the same path, gcsfs
    is tested against a GCS server in test_object_storage.py) reads what the plain path
    reads, in this process and in a copy (pickled, as for a worker), with a path or a URI
    of its kind; a URI of another kind is a ConfigError naming the filesystem as made."""
    import fsspec

    for f in range(3):
        pq.write_table(pa.table({"x": list(range(f * 10, f * 10 + 10))}), tmp_path / f"{f}.parquet", row_group_size=4)
    plain = cd.ArrowSource(str(tmp_path))
    local = fsspec.filesystem("file")
    order = np.random.default_rng(3).permutation(30)
    for path in (str(tmp_path), f"file://{tmp_path}/*.parquet"):
        source = cd.ArrowSource(path, filesystem=local)
        assert source.files == plain.files, path
        assert source.take(order).equals(plain.take(order)), path
        assert pickle.loads(pickle.dumps(source)).take(order).equals(plain.take(order)), path
    with pytest.raises(cd.errors.ConfigError, match=r"s3:// URI but filesystem= is a LocalFileSystem \(fsspec: file, local\)"):
        cd.ArrowSource("s3://bucket/data", filesystem=local)
    with pytest.raises(cd.errors.SourceError, match=r"no-such-dir.*no such file or directory"):
        cd.ArrowSource(str(tmp_path / "no-such-dir"), filesystem=local)


def test_a_uri_with_a_filesystem_of_its_kind_reads_and_of_another_kind_is_a_config_error(tmp_path: Path) -> None:
    """`ArrowSource("file:///...", filesystem=LocalFileSystem())` reads the same records as
    the plain path (it was a raw ArrowInvalid); a URI whose scheme is not the filesystem's
    kind is one ConfigError naming both, never a read from the wrong store."""
    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "a.parquet", row_group_size=4)
    plain = cd.ArrowSource(str(tmp_path))
    uri = cd.ArrowSource(f"file://{tmp_path}/*.parquet", filesystem=pafs.LocalFileSystem())
    assert uri.files == plain.files and uri.take(np.arange(10)).equals(plain.take(np.arange(10)))
    with pytest.raises(cd.errors.ConfigError, match=r"s3:// URI but filesystem= is a LocalFileSystem"):
        cd.ArrowSource("s3://bucket/data/*.parquet", filesystem=pafs.LocalFileSystem())
    with pytest.raises(cd.errors.ConfigError, match="give the path inside that filesystem"):
        cd.ArrowSource(f"file://{tmp_path}", filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()))


def test_brackets_in_a_path_are_its_name_not_a_pattern(tmp_path: Path) -> None:
    """`data[1].parquet` is that file, never `data1.parquet`; missing, it is the missing-file
    error. A glob under a directory with brackets lists that directory; `*` and `?` make a
    glob, and a bracket class counts after them."""
    table = pa.table({"id": np.arange(3)})
    for name in ("data[1].parquet", "data1.parquet", "run[1]/a.parquet", "run1/b.parquet", "run1/c.parquet"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        pq.write_table(table, tmp_path / name)
    assert cd.ArrowSource(str(tmp_path / "data[1].parquet")).files == (str(tmp_path / "data[1].parquet"),)
    assert cd.ArrowSource(str(tmp_path / "run[1]" / "*.parquet")).files == (str(tmp_path / "run[1]" / "a.parquet"),)
    assert cd.ArrowSource(str(tmp_path / "run1" / "[b]*.parquet")).files == (str(tmp_path / "run1" / "b.parquet"),)
    (tmp_path / "data[1].parquet").unlink()
    with pytest.raises(cd.errors.SourceError, match=r"data\[1\]\.parquet.*no such file"):
        cd.ArrowSource(str(tmp_path / "data[1].parquet"))
