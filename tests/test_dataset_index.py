"""Dataset indexes (`cd.write_index`, `colo-data index`): a source of an indexed directory
is the source made from every file's metadata, record for record, and starts from one
listing and the index (a few requests on object storage, where it was two or more per
file); an index that the files no longer match is a StaleIndexError naming each file added,
removed or changed, never read past. Real local files, and real S3 and GCS servers (moto,
the GCS emulator, through pyarrow's clients and gcsfs) behind a proxy that counts requests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pipelines import make_pipeline

import colo_data as cd
from colo_data.io.listing import INDEX_NAME
from colo_data.testing import assert_batches_equal, read_all
from colo_data.testing.storage import FaultProxy, ObjectStore, gcs_server, gcsfs_server, s3_server

OBJECTS = 200  # objects of the remote corpus: 2 row groups of 5 records each
BUCKET = "data"


def same_source(a: cd.ArrowSource, b: cd.ArrowSource) -> None:
    """The same files (by name), layout, schema and records."""
    assert [os.path.basename(f) for f in a.files] == [os.path.basename(f) for f in b.files]
    assert a.fingerprint() == b.fingerprint()
    assert a.schema == b.schema
    np.testing.assert_array_equal(a.row_group_sizes, b.row_group_sizes)
    every = np.arange(len(a))
    assert a.take(every).equals(b.take(every))


@pytest.fixture
def corpus(token_corpus: Path, tmp_path: Path) -> Path:
    """A copy of the token corpus (the session's stays unindexed), with a subdirectory."""
    copy = tmp_path / "corpus"
    shutil.copytree(token_corpus, copy)
    (copy / "more").mkdir()
    pq.write_table(pq.read_table(next(copy.glob("*.parquet"))), copy / "more" / "extra.parquet", row_group_size=7)
    return copy


def test_an_indexed_directory_is_the_same_source(corpus: Path) -> None:
    """The index describes every data file under the directory; a source of the directory,
    or of a glob in it, reads the index and is the source made without it, and so are its
    batches."""
    paths = ("", "*.parquet", "**/*.parquet", "part-0000[01]*.parquet")  # "": the directory itself
    without = {p: cd.ArrowSource(str(corpus / p), columns=["id", "tokens"]) for p in paths}
    assert cd.write_index(corpus) == [str(corpus / INDEX_NAME)]
    for path, expected in without.items():
        same_source(cd.ArrowSource(str(corpus / path), columns=["id", "tokens"]), expected)
    assert len(without[""].files) == len(list(corpus.rglob("*.parquet")))
    assert len(without["part-0000[01]*.parquet"].files) < len(without["*.parquet"].files)
    expected_batches = read_all(cd.Loader(make_pipeline(corpus / "*.parquet")))
    os.remove(corpus / INDEX_NAME)
    assert_batches_equal(expected_batches, read_all(cd.Loader(make_pipeline(corpus / "*.parquet"))), "with and without the index")


def _add(corpus: Path) -> str:
    shutil.copy(next(corpus.glob("*.parquet")), corpus / "late.parquet")
    return "late.parquet"


def _remove(corpus: Path) -> str:
    os.remove(next(corpus.glob("*.parquet")))
    return "removed"


def _rewrite(corpus: Path) -> str:
    path = sorted(corpus.glob("*.parquet"))[-1]
    pq.write_table(pq.read_table(path), path, row_group_size=3)  # the same records, in other row groups
    return f"{path.name} ("


def _rewrite_same_size(corpus: Path) -> str:
    path = sorted(corpus.glob("*.parquet"))[1]
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    return f"{path.name} (last written"


@pytest.mark.parametrize("change", [_add, _remove, _rewrite, _rewrite_same_size], ids=lambda f: f.__name__.strip("_"))
def test_an_index_the_files_no_longer_match_is_refused(corpus: Path, change) -> None:
    """A file added, removed, rewritten (another size) or written again (the same size, a
    new time of last writing) after the index
    was written: the source is a StaleIndexError that names it and says to index again."""
    cd.write_index(corpus)
    named = change(corpus)
    with pytest.raises(cd.errors.StaleIndexError) as raised:
        cd.ArrowSource(str(corpus))
    message = str(raised.value)
    assert str(corpus / INDEX_NAME) in message and f"colo-data index {corpus}" in message, message
    if named == "removed":
        assert "removed (1): " in message, message
    else:
        assert named in message, message
    cd.write_index(corpus)  # indexed again: the source starts
    assert len(cd.ArrowSource(str(corpus)).files) == len(list(corpus.rglob("*.parquet")))


def test_a_glob_that_leaves_a_changed_file_out_reads_the_index(corpus: Path) -> None:
    """The index is checked against the files the path names: a file outside the glob
    changing does not stop a source of the glob, and a file the glob names changing is a
    StaleIndexError that names it (the glob reads the index, not each file's metadata)."""
    cd.write_index(corpus)
    _add(corpus)
    os.remove(corpus / "more" / "extra.parquet")
    glob = str(corpus / "part-*.parquet")
    source = cd.ArrowSource(glob)
    assert [Path(f).name for f in source.files] == sorted(p.name for p in corpus.glob("part-*.parquet"))
    named = _rewrite(corpus)
    assert named.startswith("part-")
    with pytest.raises(cd.errors.StaleIndexError, match=re.escape(f"changed (1): {named}")):
        cd.ArrowSource(glob)


def test_a_damaged_index_is_named(corpus: Path) -> None:
    cd.write_index(corpus)
    (corpus / INDEX_NAME).write_text('{"colo_data_index": 1, "files": [')
    with pytest.raises(cd.errors.StaleIndexError, match=rf"{INDEX_NAME} is not a colo-data dataset index of format 1 .*colo-data index"):
        cd.ArrowSource(str(corpus))


def test_every_damaged_index_is_a_stale_index_error(corpus: Path) -> None:
    """An index that is a JSON list or string, nested 100,000 deep, names a schema that is
    not there, gives a size of 1e999, a negative row count or a format colo-data does not
    read, or is larger than an index of
    the files beside it can be, is a StaleIndexError naming it and what is wrong (they were
    AttributeError, RecursionError, IndexError, OverflowError, or accepted)."""
    import json

    cd.write_index(corpus)
    index = corpus / INDEX_NAME
    good = json.loads(index.read_text())

    def entry(**change: object) -> str:
        return json.dumps({**good, "files": [{**good["files"][0], **change}, *good["files"][1:]]})

    damaged = {
        "a list": ("[1, 2]", "a JSON list, not an object"),
        "a string": ('"index"', "a JSON str, not an object"),
        "nested": ("[" * 100_000 + "]" * 100_000, "RecursionError"),
        "files not a list": (json.dumps({**good, "files": {"a": 1}}), "files: a JSON dict, not a list"),
        "a schema not there": (entry(schema=5), "schema 5, of 1 schemas"),
        "a negative schema": (entry(schema=-1), "schema -1: not an int"),
        "a size of 1e999": (entry(size=1e999), "size inf: not an int"),
        "a negative row count": (entry(row_groups=[7, -7]), "a row group's rows -7: not an int"),
        "another format": (entry(format="csv"), "format 'csv': neither 'parquet' nor 'ipc'"),
        "too large": (json.dumps(good) + " " * (17 * 2**20), "holds more than the 17,039,360 bytes an index of the 4"),
    }
    for name, (text, match) in damaged.items():
        index.write_text(text)
        with pytest.raises(cd.errors.StaleIndexError, match=rf"{INDEX_NAME} .*{match}") as raised:
            cd.ArrowSource(str(corpus))
        assert "colo-data index" in str(raised.value), name


def lie(index: str, kind: str) -> str:
    """The JSON text of `index` with its entry for part-00001.parquet (or part-0001.parquet)
    lying about the file: a row moved from its first row group to its last (`rows`), its format (`format`);
    or every file's schema (`schema`: column "id" a string)."""
    import base64
    import json

    document = json.loads(index)
    entry = next(e for e in document["files"] if e["path"].startswith(("part-00001", "part-0001")))
    if kind == "rows":
        groups = entry["row_groups"]
        groups[0], groups[-1] = groups[0] - 1, groups[-1] + 1
    elif kind == "format":
        entry["format"] = "ipc"
    else:
        for i, text in enumerate(document["schemas"]):
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
            wrong = pa.schema([pa.field("id", pa.string()) if f.name == "id" else f for f in schema])
            document["schemas"][i] = base64.b64encode(wrong.serialize().to_pybytes()).decode()
    return json.dumps(document)


LIES = {
    "rows": r"says .*part-0+1\.parquet is parquet with \d+ rows in row groups of (\[4, 6\]|\[6, 7).*but the file, unchanged since \(\d+ bytes\), is parquet .*row groups of (\[5, 5\]|\[7, 7)",
    "format": r"says .*part-0+1\.parquet is ipc with .*but the file, unchanged since \(\d+ bytes\), is parquet",
    "schema": r"gives .*\.parquet a column 'id' of string, but the file has int64",
}


@pytest.mark.parametrize("kind", list(LIES))
def test_an_index_that_lies_about_a_file_is_blamed_not_the_file(corpus: Path, kind: str) -> None:
    """An index whose entry gives an intact file other row groups, another format or another
    schema is a StaleIndexError at the first read of that file, naming the index and what it
    says against what the file holds, and saying to write the index again (it blamed the
    file: "Rewrite or remove the file", or read the file's other rows or type unnoticed)."""
    cd.write_index(corpus)
    index = corpus / INDEX_NAME
    index.write_text(lie(index.read_text(), kind))
    source = cd.ArrowSource(str(corpus), columns=["id", "tokens"])
    with pytest.raises(cd.errors.StaleIndexError, match=LIES[kind]) as raised:
        source.take(np.arange(len(source)))
    message = str(raised.value)
    assert str(index) in message and f"colo-data index {corpus}" in message and "Rewrite or remove" not in message, message
    cd.write_index(corpus)  # written again: the same source as the files' own metadata makes
    files = sorted(map(str, corpus.rglob("*.parquet")))
    same_source(cd.ArrowSource(str(corpus), columns=["id", "tokens"]), cd.ArrowSource(files, columns=["id", "tokens"]))


def test_an_index_another_user_planted_in_a_shared_directory_is_refused(corpus: Path) -> None:
    """In a sticky directory that others may write (/tmp's kind), an index another user owns
    is a StaleIndexError naming the owner (whoever wrote it chooses the rows a job reads);
    this user's own there is read, and so is another user's where only its owners may
    write (a data team's directory)."""
    if os.geteuid() != 0:
        pytest.skip(f"giving the index to another user needs root (this is uid {os.geteuid()})")
    cd.write_index(corpus)
    corpus.chmod(0o1777)
    cd.ArrowSource(str(corpus))  # this user's own index
    os.chown(corpus / INDEX_NAME, 12345, 12345)
    with pytest.raises(cd.errors.StaleIndexError, match=rf"{INDEX_NAME} belongs to uid 12345.*mode 1777.*colo-data index"):
        cd.ArrowSource(str(corpus))
    corpus.chmod(0o755)
    same_source(cd.ArrowSource(str(corpus)), cd.ArrowSource([str(p) for p in sorted(corpus.rglob("*.parquet"))]))


def test_write_index_never_writes_through_a_planted_link(corpus: Path, tmp_path: Path) -> None:
    """Another user of a shared data directory plants links where the index's temporary file
    was named (`<index>.<pid>.partial`) and at the index itself: the indexer writes neither
    file they point to, and the index is a new regular file (an index readable by all)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not the indexer's to write")
    (corpus / f"{INDEX_NAME}.{os.getpid()}.partial").symlink_to(victim)
    (corpus / INDEX_NAME).symlink_to(victim)
    cd.write_index(corpus)
    assert victim.read_text() == "not the indexer's to write"
    index = corpus / INDEX_NAME
    assert index.is_file() and not index.is_symlink() and index.stat().st_mode & 0o777 == 0o644
    assert not [p.name for p in corpus.glob(f".{INDEX_NAME}*")], "a temporary file was left"
    same_source(cd.ArrowSource(str(corpus)), cd.ArrowSource([str(p) for p in sorted(corpus.rglob("*.parquet"))]))


def test_write_index_takes_directories_of_data(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match="not a directory.*give the directory that holds the files"):
        cd.write_index(next(corpus.glob("*.parquet")))
    with pytest.raises(cd.errors.ConfigError, match="not a directory"):
        cd.write_index(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(cd.errors.SourceError, match="holds no Parquet or Arrow IPC file"):
        cd.write_index(tmp_path / "empty")
    assert not (tmp_path / "empty" / INDEX_NAME).exists()


def test_the_index_command(corpus: Path) -> None:
    """`colo-data index DIR` writes the index and says what it holds; a path that is not a
    directory is a one-line error and exit status 1."""
    command = [sys.executable, "-m", "colo_data.cli", "index", str(corpus)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = len(list(corpus.rglob("*.parquet")))
    assert f"{corpus / INDEX_NAME}: {files} files, " in done.stdout, done.stdout
    source = cd.ArrowSource(str(corpus))
    assert f"{len(source):,} records in {len(source.row_group_sizes):,} row groups" in done.stdout, done.stdout
    failed = subprocess.run([*command[:-1], str(source.files[0])], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "Error: write_index(" in failed.stderr and "not a directory" in failed.stderr, failed


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 1 MiB (tmpfs), unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root, or CAP_SYS_ADMIN (mount said: {mounted.stderr.strip()})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_the_index_command_on_a_full_or_read_only_disk(small_disk: Path, token_corpus: Path) -> None:
    """On a full disk `colo-data index DIR` exited 1 with a 27-line ENOSPC traceback: it is
    one line that names the directory, the index's bytes and the bytes free, and leaves no
    partial file; a read-only one is one line too."""
    data = small_disk / "data"
    shutil.copytree(token_corpus, data)
    with open(small_disk / "filler", "wb") as filler:  # the rest of the disk
        with pytest.raises(OSError, match="No space left on device"):
            while True:
                filler.write(bytes(2**16))
                filler.flush()
    command = [sys.executable, "-m", "colo_data.cli", "index", str(data)]
    full = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert full.returncode == 1 and full.stderr.count("\n") == 1, full.stderr
    assert re.match(
        rf"Error: write_index\('{data}'\): cannot write the index \([\d,]+ bytes\) into {data}: No space left on device "
        r"\([\d,]+ bytes free on its filesystem\)\. Free at least [\d,]+ bytes there",
        full.stderr,
    ), full.stderr
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in token_corpus.iterdir()), "a partial file was left"
    (small_disk / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    read_only = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert read_only.returncode == 1 and read_only.stderr.count("\n") == 1, read_only.stderr
    assert f"into {data}: Read-only file system. Make the directory writable" in read_only.stderr, read_only.stderr


# --- object storage -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("many")
    for i in range(OBJECTS):
        ids = np.arange(i * 10, i * 10 + 10)
        table = pa.table({"id": ids, "tokens": pa.array([[int(j)] * (j % 7 + 1) for j in ids], pa.list_(pa.int32()))})
        pq.write_table(table, directory / f"part-{i:04d}.parquet", row_group_size=5)
    return directory


SERVERS = {"s3": s3_server, "gcs": gcs_server, "gcsfs": gcsfs_server}


@pytest.fixture(scope="module", params=list(SERVERS))
def store(request: pytest.FixtureRequest, many_files: Path) -> Iterator[ObjectStore]:
    with SERVERS[request.param]() as server:
        server.upload(many_files, BUCKET)
        yield server


@pytest.fixture(scope="module")
def proxy(store: ObjectStore) -> Iterator[FaultProxy]:
    with FaultProxy(store.endpoint) as p:
        yield p


def test_an_index_on_object_storage_starts_in_a_few_requests(store: ObjectStore, proxy: FaultProxy, many_files: Path) -> None:
    """Without an index a source of 200 objects asks the store about each (at least one
    request per object); with one, a listing and the index: at most 5 requests to make the
    source, and a read asks only about the objects it reads (at most 4 requests each: open,
    footer, row group, and on GCS a lookup); the records and a pipeline's batches are the local files'. An object
    rewritten afterwards (another size) is a StaleIndexError."""
    local = cd.ArrowSource(str(many_files), columns=["id", "tokens"])
    fs = store.filesystem(proxy.endpoint)
    before = proxy.requests
    same_source(cd.ArrowSource(BUCKET, columns=["id", "tokens"], filesystem=fs), local)
    assert proxy.requests - before >= OBJECTS, proxy.requests - before
    assert cd.write_index(f"{store.kind}://{BUCKET}", filesystem=fs) == [f"{store.kind}://{BUCKET}/{INDEX_NAME}"]
    fs = store.filesystem(proxy.endpoint)  # a new client: nothing cached from the listing above
    before = proxy.requests
    source = cd.ArrowSource(BUCKET, columns=["id", "tokens"], filesystem=fs)
    made = proxy.requests - before
    assert made <= 5, f"{made} requests to make the source from its index"
    wanted = np.array([3, 57, 1234, 1999])  # in 4 objects
    assert source.take(wanted).equals(local.take(wanted))
    assert proxy.requests - before - made <= 4 * len(wanted), f"{proxy.requests - before - made} requests to read 4 objects"
    expected = read_all(cd.Loader(make_pipeline(many_files, source=local)), 3)
    assert_batches_equal(expected, read_all(cd.Loader(make_pipeline(many_files, source=source)), 3), "local and indexed")
    same_source(source, local)
    writer = store.pyarrow_filesystem()
    with writer.open_output_stream(f"{BUCKET}/part-0003.parquet") as out:
        out.write((many_files / "part-0003.parquet").read_bytes() + b"\0")
    try:
        with pytest.raises(cd.errors.StaleIndexError, match=r"changed \(1\): part-0003.parquet \(\d+ bytes then, \d+ now\)"):
            cd.ArrowSource(BUCKET, columns=["id", "tokens"], filesystem=store.filesystem(proxy.endpoint))
    finally:
        with writer.open_output_stream(f"{BUCKET}/part-0003.parquet") as out:
            out.write((many_files / "part-0003.parquet").read_bytes())
        writer.delete_file(f"{BUCKET}/{INDEX_NAME}")



@pytest.mark.parametrize("kind", ["rows", "schema"])
def test_an_index_on_object_storage_that_lies_is_blamed(store: ObjectStore, kind: str) -> None:
    """On object storage too, an index that lies about an intact object's row groups or
    schema is a StaleIndexError naming the index, at the first read of the object."""
    fs = store.filesystem()
    cd.write_index(f"{store.kind}://{BUCKET}", filesystem=fs)
    writer = store.pyarrow_filesystem()
    try:
        with writer.open_input_stream(f"{BUCKET}/{INDEX_NAME}") as f:
            text = f.read().decode()
        with writer.open_output_stream(f"{BUCKET}/{INDEX_NAME}") as out:
            out.write(lie(text, kind).encode())
        source = cd.ArrowSource(BUCKET, columns=["id", "tokens"], filesystem=store.filesystem())
        with pytest.raises(cd.errors.StaleIndexError, match=LIES[kind]) as raised:
            source.take(np.arange(10, 20))  # part-0001.parquet
        assert f"://{BUCKET}/{INDEX_NAME}" in str(raised.value), str(raised.value)  # gcs: gs://
    finally:
        writer.delete_file(f"{BUCKET}/{INDEX_NAME}")

# --- a jax.distributed job without an index -------------------------------------------------


def make_source(args: dict) -> dict:
    """One process of a job: the S3 corpus's source, made through the counting proxy; what
    it found (or the error it got)."""
    import jax
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(
        access_key="testing", secret_key="testing", region="us-east-1", endpoint_override=args["endpoint"], scheme="http"
    )
    try:
        source = cd.ArrowSource(args["path"], columns=["id", "tokens"], filesystem=fs)
    except cd.ColoDataError as e:
        return {"batches": [], "info": {"error": type(e).__name__, "message": str(e)}}
    rows = source.take(np.arange(jax.process_index(), len(source), 500))["id"].to_pylist()
    return {"batches": [], "info": {"fingerprint": source.fingerprint(), "files": len(source.files), "rows": rows}}


def test_a_job_of_four_processes_reads_the_metadata_once(many_files: Path, tmp_path: Path) -> None:
    """Without an index, process 0 of a 4-process jax.distributed job lists the files and
    reads their metadata, and hands them to the others: the job's requests to make the
    source are a single process's. Every process then reads the same records as the local
    files hold. Process 0's error (a path that names nothing) is every process's."""
    from multihost import run

    with s3_server() as server, FaultProxy(server.endpoint) as counting:
        server.upload(many_files, BUCKET)
        fs = server.filesystem(counting.endpoint)
        before = counting.requests
        alone = cd.ArrowSource(BUCKET, columns=["id", "tokens"], filesystem=fs)
        single = counting.requests - before
        before = counting.requests
        args = dict(endpoint=counting.endpoint, path=BUCKET)
        results = run(make_source, 4, args, tmp_path, devices=1, timeout=180)
        # and each process's reads: 4 objects, at most 4 requests each
        assert counting.requests - before <= single + 4 * 4 * 4, (counting.requests - before, single)
        local = cd.ArrowSource(str(many_files), columns=["id", "tokens"])
        for r in results:
            assert r.info["fingerprint"] == alone.fingerprint() and r.info["files"] == OBJECTS, r.info
            assert r.info["rows"] == local.take(np.arange(r.process, len(local), 500))["id"].to_pylist()
        failed = run(make_source, 4, dict(args, path=f"{BUCKET}/nowhere/*.parquet"), tmp_path, devices=1, timeout=180)
    for r in failed:
        assert r.info["error"] == "SourceError" and "'data/nowhere/*.parquet' (a glob that matches no file)" in r.info["message"]
        assert ("raised in process 0 of the jax.distributed job" in r.info["message"]) == (r.process != 0), r.info
