"""ArrowSource on object storage, against real servers started here on 127.0.0.1: an S3 API
(moto) and a GCS API (gcp-storage-emulator), each behind a TCP proxy that adds latency and
injects faults (`colo_data.testing.storage`). The batches are the local files' batches for
every shuffle; transient faults are retried with nothing lost or repeated; a lasting one
is a named error in bounded time; `cache_dir` serves later epochs and restarts without
fetching, and refetches a damaged entry; a file rewritten under a running job is refused."""

from __future__ import annotations

import gc
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.io.retry import transient
from colo_data.testing import assert_batches_equal, read_all
from colo_data.testing.storage import FaultProxy, ObjectStore, gcs_server, gcsfs_server, s3_server

FILES, ROWS, GROUP = 3, 100, 25  # 12 row groups of 25 records
BUCKET = "data"


def write_corpus(directory: Path) -> Path:
    """FILES Parquet files of ROWS records (id, tokens, text) in row groups of GROUP."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    for f in range(FILES):
        ids = np.arange(f * ROWS, (f + 1) * ROWS)
        tokens = pa.array([rng.integers(0, 1000, int(rng.integers(1, 9))).tolist() for _ in ids], pa.list_(pa.int32()))
        text = pa.array([f"record {i} " * int(rng.integers(1, 40)) for i in ids])
        pq.write_table(pa.table({"id": ids, "tokens": tokens, "text": text}), directory / f"part-{f}.parquet", row_group_size=GROUP)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


SERVERS = {"s3": s3_server, "gcs": gcs_server, "gcsfs": gcsfs_server}


@pytest.fixture(scope="module", params=list(SERVERS))
def store(request: pytest.FixtureRequest, corpus: Path) -> Iterator[ObjectStore]:
    with SERVERS[request.param]() as server:
        server.upload(corpus, BUCKET)
        yield server


@pytest.fixture(scope="module")
def proxy(store: ObjectStore) -> Iterator[FaultProxy]:
    with FaultProxy(store.endpoint) as p:
        yield p


@pytest.fixture(autouse=True)
def _healthy_proxy(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts and ends with a proxy that adds nothing."""
    yield
    if "proxy" in request.fixturenames:
        p = request.getfixturevalue("proxy")
        p.heal()
        p.delay_s = 0.0


def pipeline(source: cd.ArrowSource, shuffle: str) -> cd.Pipeline:
    return cd.Pipeline(
        source=source,
        order=cd.Order(shuffle=shuffle, seed=3, window=2),
        transforms=[cd.pad_or_truncate("tokens", 4)],
        global_batch_size=20,
        index_column="_index",
    )


def local(corpus: Path, **kw: object) -> cd.ArrowSource:
    return cd.ArrowSource(str(corpus), columns=["id", "tokens"], **kw)  # type: ignore[arg-type]


def remote(store: ObjectStore, proxy: FaultProxy, client_retries: bool = True, **kw: object) -> cd.ArrowSource:
    """The corpus on `store`, read through `proxy` (the client's own retries on or off)."""
    fs = store.filesystem(proxy.endpoint, retries=client_retries)
    return cd.ArrowSource(BUCKET, columns=["id", "tokens"], filesystem=fs, **kw)  # type: ignore[arg-type]


def all_records(source: cd.ArrowSource) -> pa.Table:
    return source.take(np.arange(len(source)))


@pytest.mark.parametrize("shuffle", ["none", "block", "global"])
def test_batches_are_the_local_files_batches(store: ObjectStore, proxy: FaultProxy, corpus: Path, shuffle: str) -> None:
    """Through 5 ms of added latency, a whole epoch from the store is the local files' epoch,
    batch for batch; the telemetry's read stage shows the I/O wait and the bytes fetched.
    Neighbouring row groups asked for together come in one request: the first chunk (one
    batch, so that it comes soon), and the read-ahead after it, ask for theirs file by file,
    in fewer requests than there are row groups."""
    proxy.delay_s = 0.005
    expected = read_all(cd.Loader(pipeline(local(corpus), shuffle)))
    source = remote(store, proxy)
    assert source.files == tuple(f"{BUCKET}/part-{f}.parquet" for f in range(FILES))
    with cd.Loader(pipeline(source, shuffle), warmup=0) as loader:
        got = [{k: np.asarray(v) for k, v in batch.items()} for batch in loader]
        stages = {s.name: s for s in loader.telemetry().stages}
    assert_batches_equal(expected, got, f"{store.kind}, {shuffle} shuffle")
    requests, groups = stages["io_wait"].items, FILES * 100 // GROUP
    assert FILES <= requests < groups, f"{requests} requests for the {groups} row groups of {FILES} files"
    assert stages["io_wait"].bytes > 0 and stages["decode"].items >= 12 and stages["decode"].bytes > 0


def test_a_mixture_of_components_in_the_store_is_the_local_mixture(store: ObjectStore, proxy: FaultProxy, corpus: Path) -> None:
    """cd.Mix over components in the store reads ahead on the store's terms and gives the
    local components' mixture, batch for batch."""

    def mixture(files: dict[str, cd.ArrowSource]) -> cd.Pipeline:
        return cd.Pipeline(
            source=cd.Mix(files, {"a": 0.7, "b": 0.3}),
            order=cd.Order(shuffle="global", seed=1),
            transforms=[cd.pad_or_truncate("tokens", 4)],
            global_batch_size=20,
            epochs=None,
            index_column="_index",
        )

    fs = store.filesystem(proxy.endpoint)
    here = {n: cd.ArrowSource(str(corpus / f"part-{f}.parquet"), columns=["id", "tokens"]) for n, f in (("a", 0), ("b", 1))}
    there = {n: cd.ArrowSource(f"{BUCKET}/part-{f}.parquet", columns=["id", "tokens"], filesystem=fs) for n, f in (("a", 0), ("b", 1))}
    assert mixture(there).source.lookahead > 1
    assert_batches_equal(read_all(cd.Loader(mixture(here)), 12), read_all(cd.Loader(mixture(there)), 12), "mixture")


def test_columns_far_apart_are_fetched_without_the_gap(store: ObjectStore, proxy: FaultProxy, tmp_path: Path) -> None:
    """Wanted columns with over a megabyte of another column between them in every row
    group, all row groups asked for at once: the ranges near each other (one group's last
    wanted column and the next group's first) come in one request, the gaps are not read,
    and the records are the local file's."""
    rng = np.random.default_rng(7)
    rows, groups = 8, 3
    blob = [rng.bytes(150_000) for _ in range(rows * groups)]  # 1.2 MB a row group, between id and tokens
    table = pa.table({"id": np.arange(rows * groups), "blob": blob, "tokens": [[i, i + 1] for i in range(rows * groups)]})
    pq.write_table(table, tmp_path / "wide.parquet", row_group_size=rows, compression="none")
    store.upload(tmp_path, "wide")
    source = cd.ArrowSource("wide", columns=["id", "tokens"], filesystem=store.filesystem(proxy.endpoint))
    order = np.random.default_rng(8).permutation(rows * groups)
    got = source.take(order)
    assert got.equals(cd.ArrowSource(str(tmp_path / "wide.parquet"), columns=["id", "tokens"]).take(order))
    _, requests, fetched, *_ = source.read_stats()
    assert (requests, fetched < 100_000) == (groups + 1, True), (requests, fetched)  # id0 | tokens0 id1 | ... | tokens2


def test_worker_processes_read_the_store_and_share_cache_dir(
    store: ObjectStore, proxy: FaultProxy, corpus: Path, tmp_path: Path
) -> None:
    """Two worker processes, each with its own copy of the source, read the store through
    one cache_dir: the same batches, twice, and the second time no row group is fetched."""
    expected = read_all(cd.Loader(pipeline(local(corpus), "block")))
    for epoch in range(2):
        before = proxy.requests
        source = remote(store, proxy, cache_dir=tmp_path / "cache")
        got = read_all(cd.Loader(pipeline(source, "block"), backend=cd.InProcess(workers=2)))
        assert_batches_equal(expected, got, f"{store.kind}, 2 workers, run {epoch}")
        requests = proxy.requests - before
        if epoch == 0:
            fetched = requests
        else:  # only the metadata: listing, and each file's footer in each process (row groups: a request per file at least)
            assert requests <= fetched - FILES, (requests, fetched)


@pytest.mark.parametrize("fault", ["reset", "503"])
def test_transient_failures_are_retried_and_nothing_is_lost_or_repeated(
    store: ObjectStore, proxy: FaultProxy, corpus: Path, fault: str
) -> None:
    """Faults on 6 requests (with the client's own retries off, so colo-data's retries
    answer them; gcsfs's cannot be, and answer them instead): every record is read once,
    as it is in the local files."""
    source = remote(store, proxy, client_retries=False)
    faults = proxy.faults
    proxy.fail(fault, times=6, after=1)
    got = all_records(source)
    assert proxy.faults - faults == 6, "the faults were injected"
    assert got.equals(all_records(local(corpus)))


@pytest.mark.parametrize("store", ["s3", "gcs"], indirect=True)  # gcsfs: its own retries take 30 s a request
@pytest.mark.parametrize("fault", ["503", "reset"])
def test_a_lasting_failure_is_a_source_error_naming_the_object(store: ObjectStore, proxy: FaultProxy, fault: str) -> None:
    """Every request failing: a SourceError naming the object, the attempts and the last
    error, within a bounded time (the thread is given 120 s: it must not hang). (gcsfs,
    whose retries cannot be turned off: `test_a_gcsfs_store_that_went_away_is_named`.)"""
    source = remote(store, proxy, client_retries=False, retries=2)
    proxy.fail(fault, times=-1)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            source.take([0, 150])
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "a lasting failure hung the read"
    assert outcome and isinstance(outcome[0], cd.errors.SourceError), outcome
    message = str(outcome[0])
    scheme = "s3" if store.kind == "s3" else "gs"
    assert f"{scheme}://{BUCKET}/part-" in message and "3 attempt(s)" in message and "the last error" in message, message
    with pytest.raises(cd.errors.SourceError, match=rf"{scheme}://{BUCKET}: listing the files failed after 3 attempt"):
        remote(store, proxy, client_retries=False, retries=2)  # a source made while the store fails


def test_a_gcsfs_store_that_went_away_is_named(corpus: Path) -> None:
    """A store that stops answering under an fsspec filesystem (gcsfs) is a SourceError
    naming the object and the refused connection, once gcsfs's own retries (about 30 s) are
    done: not a file gone (pyarrow's FSSpecHandler reads any failure as "not found"), and
    colo-data adds no retries of its own on top."""
    with gcsfs_server() as store:
        store.upload(corpus, BUCKET)
        source = cd.ArrowSource(BUCKET, columns=["id"], filesystem=store.filesystem())
        assert source.take([0, 150]).column("id").to_pylist() == [0, 150]
        copy = pickle.loads(pickle.dumps(source))  # a process that opens the objects anew
    with pytest.raises(cd.errors.SourceError) as caught:
        copy.take([0])
    message = str(caught.value)
    assert f"gs://{BUCKET}/part-0.parquet: opening the object failed after 1 attempt(s)" in message, message
    assert "a transient error that lasted" in message and "ConnectionError" in message, message


def test_cache_dir_serves_later_epochs_and_restarts_without_fetching(store: ObjectStore, corpus: Path, tmp_path: Path) -> None:
    """With a decoded-row-group cache too small to hold anything, every epoch decodes again:
    from cache_dir, not from the store, also for a new source (a restart). Without
    cache_dir, the same second epoch fetches again. (A proxy of its own counts the
    requests: reads that earlier tests left retrying in the background do not.)"""
    proxy = FaultProxy(store.endpoint)
    expected = all_records(local(corpus))
    cached = remote(store, proxy, cache_bytes=1, cache_dir=tmp_path / "cache")
    assert all_records(cached).equals(expected)
    fetched = cached.read_stats()[1]
    assert fetched >= FILES
    before = proxy.requests
    assert all_records(cached).equals(expected)
    assert proxy.requests == before and cached.read_stats()[1] == fetched, "the second epoch came from cache_dir"
    restarted = remote(store, proxy, cache_bytes=1, cache_dir=tmp_path / "cache")
    assert all_records(restarted).equals(expected) and restarted.read_stats()[1] == 0
    uncached = remote(store, proxy, cache_bytes=1)
    all_records(uncached)
    first = uncached.read_stats()[1]
    all_records(uncached)
    assert uncached.read_stats()[1] >= 2 * first - 1, "without cache_dir the second epoch is fetched again (but the newest group)"
    proxy.close()


def test_a_damaged_cache_entry_is_fetched_again(store: ObjectStore, proxy: FaultProxy, corpus: Path, tmp_path: Path) -> None:
    """Entries cut short or changed on disk are noticed (length and CRC), dropped and
    fetched again: the records are right and the cache is whole afterwards."""
    directory = tmp_path / "cache"
    expected = all_records(local(corpus))
    assert all_records(remote(store, proxy, cache_dir=directory)).equals(expected)
    entries = sorted(directory.glob("*.entry"))  # a file an entry: a header, then the bytes
    assert len(entries) >= 12, "an entry per row group's ranges"
    kept = sum(entry.stat().st_size for entry in entries)
    for n, entry in enumerate(entries):
        value = entry.read_bytes()
        entry.write_bytes(value[:-7] if n % 2 else value[:-7] + b"garbage")  # cut short, or the same length, other bytes
    again = remote(store, proxy, cache_dir=directory)
    assert all_records(again).equals(expected)
    _, requests, fetched, *_ = again.read_stats()
    assert requests >= FILES and fetched >= kept, "every damaged entry was fetched again"
    healed = remote(store, proxy, cache_dir=directory)
    assert all_records(healed).equals(expected) and healed.read_stats()[1] == 0


def test_an_object_rewritten_under_a_running_job_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    """An object written again after the source was made, with other row groups or only
    other values of the same size, is a SourceError naming it, not other records."""

    def write(name: str, ids: np.ndarray, group: int) -> None:  # uncompressed: other ids, the same size
        with fs.open_output_stream(f"{bucket}/{name}") as out:
            pq.write_table(pa.table({"id": ids}), out, row_group_size=group, compression="none", use_dictionary=False)

    fs, bucket = store.pyarrow_filesystem(), f"rewrite-{store.kind}-{store.client}"
    fs.create_dir(bucket)
    for f in range(FILES):
        write(f"part-{f}.parquet", np.arange(f * ROWS, (f + 1) * ROWS), GROUP)
    source = cd.ArrowSource(bucket, filesystem=store.filesystem())
    assert source.take([0, 2 * ROWS]).column("id").to_pylist() == [0, 2 * ROWS]  # part-0 and part-2 open
    write("part-1.parquet", np.arange(ROWS, 2 * ROWS), GROUP + 5)
    with pytest.raises(cd.errors.SourceError, match=rf"{bucket}/part-1.parquet changed after the pipeline was built: row group"):
        source.take([ROWS + 1])
    write("part-0.parquet", np.arange(ROWS) + 1000, GROUP)
    fresh = cd.ArrowSource(bucket, filesystem=store.filesystem())
    write("part-0.parquet", np.arange(ROWS) + 2000, GROUP)
    with pytest.raises(cd.errors.SourceError, match=r"part-0.parquet changed after the pipeline was built: written again"):
        fresh.take([0])


def test_uris_with_and_without_a_filesystem(store: ObjectStore, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`s3://` and `gs://` URIs read the same records as the local files: with a filesystem
    of their kind (pyarrow's or fsspec's), and (S3) without one, credentials and endpoint as
    pyarrow reads them; a URI of another kind than an fsspec filesystem's is a ConfigError
    that names the filesystem as its user made it."""
    expected = all_records(local(corpus))
    fs = store.filesystem()
    with_fs = cd.ArrowSource(store.uri(BUCKET), columns=["id", "tokens"], filesystem=fs)
    assert with_fs.files == tuple(f"{BUCKET}/part-{f}.parquet" for f in range(FILES))
    assert all_records(with_fs).equals(expected)
    if store.client == "fsspec":
        with pytest.raises(cd.errors.ConfigError, match=r"s3:// URI but filesystem= is a GCSFileSystem \(fsspec: gs, gcs\)"):
            cd.ArrowSource(f"s3://{BUCKET}", filesystem=fs)
    if store.kind == "s3":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        uri = f"s3://{BUCKET}/part-*.parquet?endpoint_override={store.endpoint}&scheme=http&region=us-east-1"
        assert all_records(cd.ArrowSource(uri, columns=["id", "tokens"])).equals(expected)


def test_threads_end_when_a_loader_is_dropped_mid_epoch(store: ObjectStore, proxy: FaultProxy) -> None:
    """A loop that breaks and never closes: the loader's fetch and decode threads end with it."""

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(("colo-data-fetch", "colo-data-decode"))}

    before = readers()
    proxy.delay_s = 0.02
    loader = cd.Loader(pipeline(remote(store, proxy), "global"))
    for _ in zip(range(2), loader, strict=False):
        pass
    assert readers() - before, "the loader reads on threads of its own"
    del loader
    gc.collect()
    deadline = time.monotonic() + 30
    while readers() - before:
        assert time.monotonic() < deadline, [t.name for t in readers() - before]
        time.sleep(0.05)


def test_every_path_given_must_name_a_data_file_in_the_store(store: ObjectStore) -> None:
    """Issue 26: an object, a glob or a prefix that names no data file, given beside a good
    object, is an error naming each one (it was skipped without a word)."""
    writer, fs = store.pyarrow_filesystem(), store.filesystem()
    writer.create_dir("listing")
    with writer.open_output_stream("listing/notes/README.txt") as out:  # a "directory" with no data file
        out.write(b"not data")
    bad = {
        f"{BUCKET}/part-9.parquet": "no such file or directory",
        f"{BUCKET}/*.arrow": "a glob that matches no file",
        "listing/notes": "a directory with no .parquet",
        "listing/nothing/": "no such file or directory",
    }
    for path, why in bad.items():
        with pytest.raises(cd.errors.SourceError) as info:
            cd.ArrowSource([f"{BUCKET}/part-0.parquet", path], filesystem=fs)
        assert f"{path!r} ({why}" in str(info.value) and "1 of the 2 paths given" in str(info.value), str(info.value)
    with pytest.raises(cd.errors.SourceError, match="4 of the 5 paths given") as info:
        cd.ArrowSource([BUCKET, *bad], filesystem=fs)
    assert all(repr(path) in str(info.value) for path in bad), str(info.value)


def test_settings_are_checked(corpus: Path, tmp_path: Path) -> None:
    """Impossible settings are a ConfigError naming the setting."""
    with pytest.raises(cd.errors.ConfigError, match="io_concurrency=0"):
        local(corpus, io_concurrency=0)
    with pytest.raises(cd.errors.ConfigError, match="retries=-1"):
        local(corpus, retries=-1)
    for bad in (0, True):
        with pytest.raises(cd.errors.ConfigError, match=f"cache_dir_bytes={bad}"):
            local(corpus, cache_dir=tmp_path / "c", cache_dir_bytes=bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(cd.errors.ConfigError, match="cannot be used as a cache"):
        local(corpus, cache_dir=tmp_path / "file")


@pytest.mark.parametrize(
    ("message", "again"),
    [
        # pyarrow's wording of faults the proxy injected (see tests/test_storage_harness.py)
        ("When reading from 'b/k': AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.", True),
        ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data", True),
        ("google::cloud::Status(UNAVAILABLE: Retry policy exhausted ... HTTP status code 503)", True),
        ("google::cloud::Status(UNAVAILABLE: Permanent error ... Recv failure: Connection reset by peer)", True),
        ("When getting information for key 'a.parquet' in bucket 'b': AWS Error UNKNOWN (HTTP status 503) during HeadObject", True),
        ("AWS Error ACCESS_DENIED during GetObject operation: Access Denied", False),
        ("When reading 'bucket/part-500.parquet': AWS Error ACCESS_DENIED", False),
        ("google::cloud::Status(NOT_FOUND: Permanent error in ReadObject: No such object)", False),
        ("Parquet magic bytes not found in footer", False),
    ],
)
def test_transient_errors_are_told_apart(message: str, again: bool) -> None:
    assert transient(OSError(message)) is again
