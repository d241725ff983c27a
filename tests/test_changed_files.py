"""Files rewritten in place after the pipeline was built (issue 12, finding 8): other
row-group sizes, more or fewer rows, a truncated or foreign file. Reading them is a
`SourceError` (a `CorruptFileError` when the file no longer parses) that names the file, the
row group and the rows expected and found, and says to rebuild the pipeline: never a raw
`IndexError`, a misleading `TransformError`, the wrong rows, or a crashed process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

import colo_data as cd

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

ROWS, GROUP, BATCH = 40, 10, 8  # per file; file b's first row group is global rows 40..49
SUFFIX = {"parquet": ".parquet", "ipc": ".arrow"}


def write(path: Path, ids: np.ndarray, group: int) -> None:
    """Rows `ids` (ids and short token lists) in row groups (IPC record batches) of `group`,
    written over `path` in place when it exists: same inode, truncated and rewritten."""
    inode = path.stat().st_ino if path.exists() else None
    tokens = pa.array([[int(i)] * (int(i) % 3 + 1) for i in ids], pa.list_(pa.int32()))
    table = pa.table({"id": pa.array(ids, pa.int64()), "tokens": tokens})
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=group)
    else:
        with ipc.new_file(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=group):
                writer.write_batch(batch)
    assert inode is None or path.stat().st_ino == inode, "the rewrite must be in place"


def truncate(path: Path) -> None:
    """Cut the file to half its size, in place."""
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def foreign(path: Path) -> None:
    """Replace the file's bytes with CSV text, in place (the inode that readers hold)."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(b"id,tokens\n1,2\n" * 20)


LAYOUT_CHANGES: dict[str, tuple[Callable[[Path], None], int]] = {
    # how file b is rewritten -> rows its first row group has then (10 expected)
    "regrouped": (lambda p: write(p, np.arange(ROWS, 2 * ROWS), 7), 7),
    "more rows": (lambda p: write(p, np.arange(ROWS, 2 * ROWS + 20), 13), 13),
    "fewer rows": (lambda p: write(p, np.arange(ROWS, ROWS + 20), 7), 7),
}
DAMAGE: dict[str, Callable[[Path], None]] = {"truncated": truncate, "not a data file": foreign}


@pytest.fixture(params=sorted(SUFFIX))
def files(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    """Files a and b of one format, 40 rows each in row groups of 10, ids = global indices."""
    a, b = (tmp_path / f"{name}{SUFFIX[request.param]}" for name in "ab")
    write(a, np.arange(ROWS), GROUP)
    write(b, np.arange(ROWS, 2 * ROWS), GROUP)
    return a, b


def make_pipeline(path: Path) -> cd.Pipeline:
    """Batches of 8 in file order, the token lists padded: the transform that used to report
    a short row group as "transforms must keep one row per record"."""
    return cd.Pipeline(
        source=cd.ArrowSource(str(path), columns=["id", "tokens"]),
        order=cd.Order(shuffle="none"),
        transforms=[cd.pad_or_truncate("tokens", 4)],
        global_batch_size=BATCH,
    )


def read_until_error(loader: cd.Loader, error: type[Exception] = cd.errors.SourceError) -> tuple[np.ndarray, Exception]:
    """The ids of the batches read before the loader raised `error`, and the error."""
    ids = []
    with loader, pytest.raises(error) as info:
        for batch in loader:
            ids.append(np.asarray(batch["id"]))
    return np.concatenate(ids) if ids else np.zeros(0, np.int64), info.value


def assert_changed_message(error: Exception, path: Path) -> None:
    """The error names the file, says it changed, and what to do."""
    message = str(error)
    assert f"{path} changed after the pipeline was built" in message, message
    assert "rebuild the pipeline" in message.lower() and "in place" in message, message


def assert_layout_message(error: Exception, path: Path, found: int | None = None) -> None:
    """A `SourceError` (not a damaged file) that also names the row group and its rows
    expected and found (`found` rows in row group 0, when given)."""
    assert type(error) is cd.errors.SourceError, f"{type(error).__name__}: {error}"
    assert_changed_message(error, path)
    rows = r"\d+" if found is None else str(found)
    group = r"\d+" if found is None else "0"
    pattern = rf"row group {group}: \d+ rows expected, ({rows} found|but the file has only \d+ row groups now)"
    assert re.search(pattern, str(error)), str(error)


@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_source_take_after_a_rewrite_with_another_layout(files: tuple[Path, Path], change: str) -> None:
    """`ArrowSource.take` directly: the unchanged file still reads, the changed one is refused."""
    a, b = files
    source = cd.ArrowSource(str(a.parent), columns=["id", "tokens"])
    rewrite, found = LAYOUT_CHANGES[change]
    rewrite(b)
    assert source.take(np.arange(ROWS)).column("id").to_pylist() == list(range(ROWS))  # file a is unchanged
    with pytest.raises(cd.errors.SourceError) as info:
        source.take(np.arange(ROWS, ROWS + 5))
    assert_layout_message(info.value, b, found)
    assert f"row group 0: {GROUP} rows expected" in str(info.value)


@pytest.mark.parametrize("change", sorted(DAMAGE))
def test_source_take_after_a_rewrite_that_damaged_the_file(files: tuple[Path, Path], change: str) -> None:
    """A file that no longer parses is a `CorruptFileError`, as at build time, that says it changed."""
    a, b = files
    source = cd.ArrowSource(str(a.parent), columns=["id", "tokens"])
    DAMAGE[change](b)
    with pytest.raises(cd.errors.CorruptFileError) as info:
        source.take([ROWS + 3])
    assert_changed_message(info.value, b)
    assert "row group 0" in str(info.value) and "bytes" in str(info.value), str(info.value)


def test_a_file_rewritten_with_the_same_row_groups_and_another_size(files: tuple[Path, Path]) -> None:
    """Other values in the same row groups: the size tells (one that keeps the size too:
    the time of last writing, below)."""
    a, b = files
    source = cd.ArrowSource(str(a.parent), columns=["id", "tokens"])
    size = b.stat().st_size
    write(b, np.arange(ROWS, 2 * ROWS) * 3, GROUP)  # every token list one item long
    assert b.stat().st_size != size
    with pytest.raises(cd.errors.SourceError) as info:
        source.take([ROWS])
    assert_changed_message(info.value, b)
    assert f"{size} bytes then" in str(info.value) and "in the same row groups" in str(info.value), str(info.value)


def test_a_local_file_rewritten_in_place_with_the_same_size_and_row_groups(files: tuple[Path, Path]) -> None:
    """Issue 26: other values in the same size and layout went unnoticed; the time of last
    writing tells, from the stat that each decode already makes (a rewrite within the
    filesystem's clock tick of the indexing is not noticed: the loop waits one out)."""
    a, b = files
    source = cd.ArrowSource(str(a.parent), columns=["id", "tokens"])
    size, written = b.stat().st_size, b.stat().st_mtime_ns
    deadline = time.monotonic() + 2
    while b.stat().st_mtime_ns == written:
        assert time.monotonic() < deadline, "the file's time of last writing does not change"
        write(b, np.arange(ROWS, 2 * ROWS) + 300, GROUP)  # other ids, the same token lengths
    assert b.stat().st_size == size
    assert source.take(np.arange(ROWS)).column("id").to_pylist() == list(range(ROWS))  # file a is unchanged
    with pytest.raises(cd.errors.SourceError) as info:
        source.take([ROWS])
    assert type(info.value) is cd.errors.SourceError
    assert_changed_message(info.value, b)
    said = r"written again \(last written \S+ then, \S+ now\), the same size and row groups"
    assert re.search(said, str(info.value)), str(info.value)


def test_a_removed_file(files: tuple[Path, Path]) -> None:
    """A file removed after the pipeline was built is said to be removed, not damaged."""
    a, b = files
    source = cd.ArrowSource(str(a.parent), columns=["id", "tokens"])
    b.unlink()
    with pytest.raises(cd.errors.SourceError) as info:
        source.take([ROWS + 3])
    assert not isinstance(info.value, cd.errors.CorruptFileError), "the file is gone, not damaged"
    assert f"{b} was removed after the pipeline was built" in str(info.value), str(info.value)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_a_loader_over_a_file_rewritten_after_the_pipeline_was_built(
    files: tuple[Path, Path], change: str, workers: int
) -> None:
    """The pipeline (and its row-group index) is made before the rewrite; the rows are read
    after it, here or in worker processes that get the pickled pipeline."""
    a, b = files
    pipeline = make_pipeline(a.parent)
    rewrite, found = LAYOUT_CHANGES[change]
    rewrite(b)
    ids, error = read_until_error(cd.Loader(pipeline, backend=cd.InProcess(workers=workers)))
    assert_layout_message(error, b, found if workers == 0 else None)
    np.testing.assert_array_equal(ids, np.arange(len(ids)), err_msg="a batch before the error has the wrong rows")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("change", sorted(DAMAGE))
def test_a_loader_over_a_file_damaged_after_the_pipeline_was_built(
    files: tuple[Path, Path], change: str, workers: int
) -> None:
    """Truncated or replaced by another kind of file, read here or in worker processes."""
    a, b = files
    pipeline = make_pipeline(a.parent)
    DAMAGE[change](b)
    ids, error = read_until_error(cd.Loader(pipeline, backend=cd.InProcess(workers=workers)), cd.errors.CorruptFileError)
    assert_changed_message(error, b)
    np.testing.assert_array_equal(ids, np.arange(len(ids)))


BIG = 4000  # rows of a file that a loader is still reading long after its first batch (chunks of 512)
REWRITES = {"regrouped": (np.arange(BIG), 70), "fewer rows": (np.arange(BIG // 2), 70), "more rows": (np.arange(BIG * 2), 130)}


@pytest.mark.parametrize("change", sorted(REWRITES))
def test_a_parquet_file_rewritten_while_the_loader_reads_it(tmp_path: Path, change: str) -> None:
    """The file is open (its reader kept, row groups decoded and cached) when it is
    rewritten: a row group decoded from it afterwards is refused, and no batch holds other
    rows than its positions'. A file replaced by a rename instead would keep being read
    from the file that was opened, as it was. Cached IPC batches are views of the file,
    which show the new bytes after a rewrite in place: the IPC test below reads a batch
    that was not cached before the rewrite."""
    path = tmp_path / "a.parquet"
    write(path, np.arange(BIG), 100)
    ids = []
    with cd.Loader(make_pipeline(path), prefetch=0) as loader:
        ids.append(np.asarray(next(loader)["id"]))
        write(path, *REWRITES[change])
        with pytest.raises(cd.errors.SourceError) as info:
            for batch in loader:
                ids.append(np.asarray(batch["id"]))
    if type(info.value) is cd.errors.SourceError:
        assert_layout_message(info.value, path)
    else:  # found by a decode that overlapped the rewrite, and looked at while it was half written
        assert isinstance(info.value, cd.errors.CorruptFileError), info.value
        assert_changed_message(info.value, path)
    got = np.concatenate(ids)
    assert BATCH < len(got) < BIG
    np.testing.assert_array_equal(got, np.arange(len(got)), err_msg="a batch holds other rows than its positions'")


@pytest.mark.parametrize("change", sorted(REWRITES))
def test_an_open_ipc_file_rewritten_in_place(tmp_path: Path, change: str) -> None:
    """The next record batch decoded from an open (memory-mapped) IPC file after it was
    rewritten in place is refused, before the mapping is read."""
    path = tmp_path / "a.arrow"
    write(path, np.arange(BIG), 100)
    source = cd.ArrowSource(str(path), columns=["id", "tokens"])
    assert source.take([0, 1]).column("id").to_pylist() == [0, 1]
    write(path, *REWRITES[change])
    with pytest.raises(cd.errors.SourceError) as info:
        source.take([BIG - 1])
    assert_layout_message(info.value, path)


SHRINK = """
import sys, numpy as np, pyarrow as pa, pyarrow.ipc as ipc, pyarrow.parquet as pq
import colo_data as cd
path, fmt = sys.argv[1], sys.argv[2]
def write(n):
    table = pa.table({"id": np.arange(n), "x": np.random.default_rng(0).random(n)})
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=20_000, compression="none")
    else:
        with ipc.new_file(path, table.schema) as w:
            for batch in table.to_batches(max_chunksize=20_000):
                w.write_batch(batch)
write(200_000)
source = cd.ArrowSource(path)
first = source.take(np.arange(0, 20_000, 7))  # decoded and cached: the file is open
write(1_000)  # in place: most of the old file's pages are gone
try:
    source.take(np.arange(190_000, 190_010))
except cd.errors.SourceError as e:
    print("refused:", type(e).__name__, e)
np.testing.assert_array_equal(first.column("id").to_numpy(), np.arange(0, 20_000, 7))
if fmt == "parquet":  # decoded into memory; cached IPC batches are views of the (mapped) file
    print("cached rows intact:", source.take(np.arange(0, 20_000, 7)).column("id").to_numpy()[:3])
"""


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_a_file_that_shrinks_under_an_open_reader_does_not_crash_the_process(tmp_path: Path, fmt: str) -> None:
    """Pages of a memory-mapped file past its new end are a SIGBUS, not an exception: the
    next decode from a file that was cut short is refused before it reads the file, and
    Parquet row groups decoded before stay as they were."""
    path = tmp_path / f"big{SUFFIX[fmt]}"
    result = subprocess.run(
        [sys.executable, "-c", SHRINK, str(path), fmt], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    assert "refused: SourceError" in result.stdout and "changed after the pipeline was built" in result.stdout
    assert ("cached rows intact" in result.stdout) == (fmt == "parquet")


def test_other_filesystems_check_the_layout_when_a_file_is_opened_or_fails(tmp_path: Path) -> None:
    """A filesystem other than the local one (here a subtree of it) is not asked for the
    file's size at every row group (a request each on object storage): the layout and size
    are compared when a file is opened for reading, and after a decode that fails."""
    names = {"a.parquet": 0, "b.arrow": ROWS}
    for name, first in names.items():
        write(tmp_path / name, np.arange(first, first + ROWS), GROUP)
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    fresh = cd.ArrowSource(sorted(names), filesystem=fs, columns=["id"])
    opened = cd.ArrowSource(sorted(names), filesystem=fs, columns=["id"])
    assert opened.take([0, ROWS]).column("id").to_pylist() == [0, ROWS]  # both files open, group 0 cached
    for name, first in names.items():
        write(tmp_path / name, np.arange(first, first + ROWS), 7)
        for source, row in ((fresh, first + 1), (opened, first + 25)):
            with pytest.raises(cd.errors.SourceError) as info:
                source.take([row])
            message = str(info.value)
            assert f"{name} changed after the pipeline was built" in message, message
            assert f"row group {(row - first) // GROUP}: 10 rows expected, 7 found" in message, message
    truncate(tmp_path / "a.parquet")
    with pytest.raises(cd.errors.CorruptFileError, match="changed after the pipeline was built"):
        fresh.take([0])
