"""A dataset directory read as pyarrow.dataset, Spark and Hive read it: files under a part
that starts with "." or "_" (a Spark `_temporary`, a filer's `.snapshot`,
`.ipynb_checkpoints`) are not the dataset's, and every real file is read once however many
links name it, in a listing that ends on any tree. Real directories, real links, real
Parquet files; each record carries its own id, so a record read twice is seen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import colo_data as cd

pytestmark = pytest.mark.unit

ROWS = 100  # records a file


def write(path: Path, first: int) -> None:
    """One Parquet file of ROWS records, ids `first ...`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": np.arange(first, first + ROWS, dtype=np.int64)}), path, row_group_size=50)


def ids(source: cd.ArrowSource) -> list[int]:
    return sorted(source.take(np.arange(len(source))).column("id").to_pylist())


def committed(root: Path, files: int) -> list[int]:
    """The ids of `files` committed files under `root`: part-0000k.parquet."""
    for k in range(files):
        write(root / f"part-{k:05d}.parquet", k * ROWS)
    return list(range(files * ROWS))


def test_spark_temporary_snapshots_and_checkpoints_are_not_the_datasets(tmp_path: Path) -> None:
    """Copies of the committed files in a Spark job's `_temporary` tree, an NFS filer's
    `.snapshot` and Jupyter's `.ipynb_checkpoints` are not read, by a directory, by globs
    or by the dataset index; a glob that names such a directory reads it."""
    root = tmp_path / "data"
    expected = committed(root, 2)
    (root / "_SUCCESS").write_text("")
    write(root / "_temporary/0/task_202612071200_0001_m_000000/part-00000.parquet", 0)
    write(root / "_temporary/0/_temporary/attempt_202612071200_0001_m_000001_0/part-00001.parquet", ROWS)
    write(root / ".snapshot/hourly.2026-12-07_1200/part-00001.parquet", ROWS)
    write(root / ".ipynb_checkpoints/part-00000-checkpoint.parquet", 0)
    write(root / "sub/.hidden/part-00000.parquet", 0)
    for path in (str(root), f"{root}/**/*.parquet", f"{root}/**", f"{root}/*.parquet"):
        assert ids(cd.ArrowSource(path)) == expected, path
    with pytest.raises(cd.errors.SourceError, match="name no Parquet"):
        cd.ArrowSource(f"{root}/*/*/*/*.parquet")  # matches only under _temporary
    cd.write_index(str(root))
    indexed = cd.ArrowSource(str(root))
    assert ids(indexed) == expected
    assert [os.path.relpath(f, root) for f in indexed.files] == ["part-00000.parquet", "part-00001.parquet"]
    assert ids(cd.ArrowSource(f"{root}/_temporary/0/task_*/*.parquet")) == list(range(ROWS))  # named: read
    assert ids(cd.ArrowSource(f"{root}/.snapshot/*/*.parquet")) == list(range(ROWS, 2 * ROWS))


def test_a_link_to_a_sibling_directory_reads_its_files_once_under_their_own_paths(tmp_path: Path) -> None:
    root = tmp_path / "data"
    committed(root / "v1", 2)
    for k in range(2):
        write(root / "v2" / f"part-{k:05d}.parquet", (2 + k) * ROWS)
    (root / "latest").symlink_to("v2")
    source = cd.ArrowSource(str(root))
    assert ids(source) == list(range(4 * ROWS))
    assert not any("/latest/" in f for f in source.files)  # the path without a link names each file
    assert ids(cd.ArrowSource(f"{root}/latest")) == list(range(2 * ROWS, 4 * ROWS))  # given alone, it is read
    assert ids(cd.ArrowSource([str(root / "v2"), str(root / "latest"), str(root / "v2/part-00000.parquet")])) == list(
        range(2 * ROWS, 4 * ROWS)
    )


def test_links_to_files_and_hard_links_read_the_file_once(tmp_path: Path) -> None:
    root = tmp_path / "data"
    expected = committed(root, 2)
    (root / "alias.parquet").symlink_to("part-00000.parquet")
    os.link(root / "part-00001.parquet", root / "zz-hard.parquet")
    assert ids(cd.ArrowSource(str(root))) == expected


def list_in_a_child(path: str, filesystem: str = "local") -> subprocess.CompletedProcess[str]:
    """`cd.ArrowSource(path)` in a process of its own, which a listing that does not end
    cannot hang: it prints the sorted ids."""
    code = (
        "import sys, numpy as np, pyarrow.fs as pafs, colo_data as cd\n"
        "fs = None if sys.argv[2] == 'local' else pafs.SubTreeFileSystem(sys.argv[2], pafs.LocalFileSystem())\n"
        "s = cd.ArrowSource(sys.argv[1], filesystem=fs)\n"
        "print(sorted(s.take(np.arange(len(s))).column('id').to_pylist()) == list(range(len(s))), len(s))\n"
    )
    return subprocess.run([sys.executable, "-c", code, path, filesystem], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("loops", [["self"], ["a", "b"]])
def test_links_back_into_the_tree_end_and_add_nothing(tmp_path: Path, loops: list[str]) -> None:
    """A link to `.` read the files once per level of nested links, down to the kernel's
    limit (41 times); two of them did not end at all."""
    root = tmp_path / "data"
    committed(root, 2)
    for name in loops:
        (root / name).symlink_to(".")
    (root / "sub").mkdir()
    (root / "sub" / "back").symlink_to("..")  # back to the dataset's own directory: walked already
    for path, fs in ((str(root), "local"), ("data", str(tmp_path))):
        child = list_in_a_child(path, fs)
        assert child.returncode == 0, child.stderr[-2000:]
        assert child.stdout.split() == ["True", str(2 * ROWS)], (fs, child.stdout)


def test_a_link_to_a_directory_outside_the_tree_is_read_and_one_to_an_ancestor_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "data"
    committed(root, 1)
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "part-00009.parquet", ROWS)
    (root / "more").symlink_to(elsewhere)
    assert ids(cd.ArrowSource(str(root))) == list(range(2 * ROWS))
    (root / "up").symlink_to(tmp_path)
    with pytest.raises(cd.errors.SourceError, match=r"up is a link to .*Remove the link"):
        cd.ArrowSource(str(root))


def test_a_data_files_link_whose_target_is_gone_is_named(tmp_path: Path) -> None:
    root = tmp_path / "data"
    committed(root, 1)
    (root / "part-00001.parquet").symlink_to(tmp_path / "moved-away.parquet")
    (root / "notes.txt").symlink_to(tmp_path / "gone.txt")  # not a data file: not the source's concern
    with pytest.raises(cd.errors.SourceError, match=r"targets are gone: \S*/part-00001\.parquet\. Restore"):
        cd.ArrowSource(str(root))


def test_the_listing_skips_hidden_parts_on_any_filesystem(tmp_path: Path) -> None:
    """pyarrow's in-memory filesystem (an object store's listing): the same parts skipped."""
    fs = pafs._MockFileSystem()
    for name in ("d/part-0.parquet", "d/_temporary/0/part-0.parquet", "d/.snapshot/h/part-0.parquet"):
        fs.create_dir(name.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(name) as out:
            pq.write_table(pa.table({"id": np.arange(ROWS, dtype=np.int64)}), out)
    for path in ("d", "d/**/*.parquet"):
        assert ids(cd.ArrowSource(path, filesystem=fs)) == list(range(ROWS)), path
