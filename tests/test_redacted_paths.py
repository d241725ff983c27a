"""Secrets that a path carries (`s3://KEY:SECRET@bucket/...`, a query's `secret_key=`) never
appear in what colo-data says about the path: its errors, their causes and tracebacks. The
store is a real S3 server (moto) on 127.0.0.1, read with the URI's own credentials."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.io.redact import redacted
from colo_data.testing.storage import ObjectStore, s3_server

KEY, SECRET, TOKEN = "AKIAKEYSHOWN", "secretNEVERshown", "tokenNEVERshown"
BUCKET = "creds"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """A moto S3 server holding one Parquet file in BUCKET."""
    corpus = tmp_path_factory.mktemp("corpus")
    pq.write_table(pa.table({"id": list(range(10))}), corpus / "part-0.parquet")
    with s3_server() as server:
        server.upload(corpus, BUCKET)
        yield server


def uri(store: ObjectStore, path: str) -> str:
    """`path` in the store as a URI with credentials in it (the server takes any)."""
    return f"s3://{KEY}:{SECRET}@{path}?endpoint_override={store.endpoint}&scheme=http&region=us-east-1"


def told(error: BaseException) -> str:
    """Everything an error says: its message and its whole traceback, causes included."""
    return "".join(traceback.format_exception(error))


def assert_no_secret(error: BaseException) -> None:
    """Neither the key nor the secret is anywhere in what `error` says."""
    text = told(error)
    assert KEY not in text and SECRET not in text, text


def test_the_uri_credentials_read_the_store(store: ObjectStore) -> None:
    """The URI's credentials are used (the tests below would pass for a URI that is never read)."""
    source = cd.ArrowSource(uri(store, f"{BUCKET}/part-0.parquet"))
    assert source.take([3]).column("id").to_pylist() == [3]


def test_a_missing_object_is_named_without_its_credentials(store: ObjectStore) -> None:
    """The missing-file error names the object, its credentials replaced by `***`."""
    with pytest.raises(cd.errors.SourceError) as caught:
        cd.ArrowSource(uri(store, f"{BUCKET}/missing.parquet"))
    assert f"s3://***@{BUCKET}/missing.parquet" in str(caught.value), str(caught.value)
    assert_no_secret(caught.value)
    with pytest.raises(cd.errors.SourceError) as caught:
        cd.ArrowSource([uri(store, f"{BUCKET}/part-0.parquet"), uri(store, f"{BUCKET}/nothing/*.parquet")])
    assert "1 of the 2 paths given" in str(caught.value), str(caught.value)
    assert_no_secret(caught.value)


def test_other_messages_about_such_a_path_hold_no_secret(store: ObjectStore, tmp_path: Path) -> None:
    """A URI on another filesystem than the paths before it, a URI of another kind than the
    filesystem given, a URI that does not parse, an index written where no directory is, an
    ArrayRecord path that names no file, and a store that refuses the listing."""
    local = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1]}), local)
    bad = uri(store, f"{BUCKET}/x y%.parquet")  # a space: not a URI
    calls = {
        "two filesystems": lambda: cd.ArrowSource([str(local), uri(store, f"{BUCKET}/part-0.parquet")]),
        "filesystem given": lambda: cd.ArrowSource(uri(store, f"{BUCKET}/part-0.parquet"), filesystem=pafs.LocalFileSystem()),
        "not a URI": lambda: cd.ArrowSource(bad),
        "write_index": lambda: cd.write_index(uri(store, f"{BUCKET}/no-such-dir")),
        "ArrayRecord": lambda: cd.sources.ArrayRecordSource(uri(store, f"{BUCKET}/x.array_record")),
        "listing refused": lambda: cd.ArrowSource(uri(store, "no-such-bucket/x.parquet"), retries=0),
    }
    for what, call in calls.items():
        with pytest.raises(cd.ColoDataError) as caught:
            call()
        assert "***" in str(caught.value), (what, str(caught.value))
        assert_no_secret(caught.value)


def test_the_index_written_is_named_without_credentials(store: ObjectStore, tmp_path: Path) -> None:
    """`write_index` returns what `colo-data index` prints: the index's URI, without its secrets."""
    pq.write_table(pa.table({"id": [1]}), tmp_path / "part-0.parquet")
    store.upload(tmp_path, "indexed")
    written = cd.write_index(uri(store, "indexed"))
    assert len(written) == 1 and "s3://***@indexed" in written[0], written
    assert KEY not in written[0] and SECRET not in written[0], written


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        (f"s3://{KEY}:{SECRET}@b/k.parquet", "s3://***@b/k.parquet"),
        (f"gs://{TOKEN}@b/k", "gs://***@b/k"),
        (f"s3://b/k?region=r&secret_key={SECRET}&access_key={KEY}", "s3://b/k?region=r&secret_key=***&access_key=***"),
        (f"https://h/k?X-Amz-Signature={SECRET}&X-Amz-Security-Token={TOKEN}&sig={SECRET}&x=1", None),
        ("data/a@b.parquet?", "data/a@b.parquet?"),  # no URI: left as it is
        ("'s3://a:b@c/d', 's3://e@f/g'", "'s3://***@c/d', 's3://***@f/g'"),
    ],
)
def test_redacted(path: str, shown: str | None) -> None:
    """User info and secret query values go; the rest of the path, and paths that are not URIs, stay."""
    got = redacted(path)
    assert SECRET not in got and TOKEN not in got and KEY not in got, got
    if shown is not None:
        assert got == shown
