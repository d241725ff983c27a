"""`cd.sources.ArrayRecordSource` (colo_data/io/array_record.py): real ArrayRecord files written
here, read many records at a time; every shuffle and worker processes give the records a
list of the same dicts gives; bad paths, files and parse results are named errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pyarrow as pa
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from pipelines import IdleHost, until_workers_made

import colo_data as cd
from colo_data.testing import assert_batches_equal, read_all, to_numpy

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers get its functions by value, not by importing it
COUNTS = (700, 1300, 37)  # records per file: uneven, one file smaller than a block-shuffle group


def record(i: int) -> dict:
    return {"id": i, "tokens": list(range(i % 11)), "text": f"record {i}"}


@pytest.fixture(scope="module")
def array_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 ArrayRecord files of JSON records (ids = global indices in file order)."""
    directory = tmp_path_factory.mktemp("array_record")
    start = 0
    for f, count in enumerate(COUNTS):
        writer = ArrayRecordWriter(str(directory / f"part-{f}.array_record"), "group_size:1")
        for i in range(start, start + count):
            writer.write(json.dumps(record(i)).encode())
        writer.close()
        start += count
    return directory


def pad(batch: dict) -> dict:
    """Tokens padded to 12; the text column left out (a batch holds fixed-shape arrays)."""
    return {k: v for k, v in cd.pad_or_truncate("tokens", 12)(batch).items() if k != "text"}


def pipeline(source: object, shuffle: str) -> cd.Pipeline:
    return cd.Pipeline(
        source=source, order=cd.Order(shuffle=shuffle, seed=3), transforms=[pad], global_batch_size=16, epochs=1,
        index_column="_index",
    )


def test_take_reads_any_indices_in_order(array_records: Path) -> None:
    source = cd.sources.ArrayRecordSource(str(array_records / "*.array_record"))
    assert len(source) == sum(COUNTS)
    assert source.row_group_sizes.tolist() == [700, 1024, 276, 37]
    indices = np.random.default_rng(0).permutation(len(source))[:300]
    table = source.take(indices)
    assert table.column("id").to_pylist() == indices.tolist()
    assert table.column("tokens").to_pylist() == [record(int(i))["tokens"] for i in indices]
    assert source.take([]).num_rows == 0


@pytest.mark.parametrize("shuffle", ["none", "global", "block"])
def test_every_record_once_per_epoch_as_from_a_list(array_records: Path, shuffle: str) -> None:
    source = cd.sources.ArrayRecordSource([str(p) for p in sorted(array_records.glob("*.array_record"))])
    got = read_all(cd.Loader(pipeline(source, shuffle)))
    ids = np.concatenate([b["id"] for b in got])
    assert len(set(ids.tolist())) == len(ids) == 16 * (sum(COUNTS) // 16)  # once each; the last partial batch dropped
    assert set(ids.tolist()) <= set(range(sum(COUNTS)))
    assert all((b["id"] == b["_index"]).all() for b in got)
    assert_batches_equal(read_all(cd.Loader(pipeline(source, shuffle), hosts=2)), got, f"{shuffle}: 2 hosts sharing it")
    if shuffle != "block":  # a list has other block-shuffle groups; the other orders depend on the length only
        records = [record(i) for i in range(sum(COUNTS))]
        assert_batches_equal(read_all(cd.Loader(pipeline(records, shuffle))), got, f"{shuffle}: ArrayRecord vs a list")


@pytest.mark.usefixtures("own_cpu_budget")
def test_worker_processes_read_it_without_jax(array_records: Path) -> None:
    source = cd.sources.ArrayRecordSource(str(array_records / "*.array_record"))
    endless = cd.Pipeline(
        source=source, order=cd.Order(shuffle="global", seed=3), transforms=[IdleHost(0.1), pad], global_batch_size=16, epochs=None,
        index_column="_index",
    )
    with cd.Loader(endless, backend=cd.InProcess(workers=1)) as loader:
        got = until_workers_made(loader)
        got += [to_numpy(next(loader)) for _ in range(20)]
        for worker in psutil.Process().children(recursive=True):
            if "colo_data.workers.processes" in " ".join(worker.cmdline()):
                maps = Path(f"/proc/{worker.pid}/maps").read_text()
                assert "array_record" in maps and "jaxlib" not in maps, f"worker {worker.pid}"
    assert_batches_equal(read_all(cd.Loader(endless), len(got)), got, "workers vs none")


def test_the_fingerprint_follows_the_files(array_records: Path, tmp_path: Path) -> None:
    first = cd.sources.ArrayRecordSource(str(array_records / "*.array_record"))
    assert cd.sources.ArrayRecordSource(str(array_records / "*.array_record")).fingerprint() == first.fingerprint()
    writer = ArrayRecordWriter(str(tmp_path / "part-0.array_record"), "group_size:1")
    writer.write(b"{}")
    writer.close()
    assert cd.sources.ArrayRecordSource(str(tmp_path / "*.array_record")).fingerprint() != first.fingerprint()


def test_parse_gets_the_bytes_and_may_return_numpy(array_records: Path) -> None:
    def lengths(records: list[bytes]) -> dict:
        return {"n": np.array([len(r) for r in records]), "grid": np.zeros((len(records), 2, 3), np.float32)}

    table = cd.sources.ArrayRecordSource(str(array_records / "part-2.array_record"), parse=lengths).take([0, 5])
    assert table.column("n").to_pylist() == [len(json.dumps(record(1300 + 700 + i))) for i in (0, 5)]
    assert pa.types.is_fixed_size_list(table.column("grid").type)


def test_bad_input_is_a_named_error(array_records: Path, tmp_path: Path) -> None:
    with pytest.raises(cd.errors.SourceError, match="no file matches"):
        cd.sources.ArrayRecordSource(str(tmp_path / "*.array_record"))
    good = str(sorted(array_records.glob("*.array_record"))[0])
    for bad in (tmp_path / "gone.array_record", tmp_path / "*.array_record", tmp_path):  # beside a good file
        with pytest.raises(cd.errors.SourceError, match=re.escape(f"no file matches ['{bad}']")):
            cd.sources.ArrayRecordSource([good, str(bad)])
    (tmp_path / "junk.array_record").write_bytes(b"not an array record file")
    with pytest.raises(cd.errors.SourceError, match="junk.array_record: cannot be read as an ArrayRecord file"):
        cd.sources.ArrayRecordSource(str(tmp_path / "junk.array_record"))
    source = cd.sources.ArrayRecordSource(str(array_records / "*.array_record"), parse=lambda records: {"x": [1]})
    with pytest.raises(cd.errors.TransformError, match="column 'x' has 1 values for 3 records"):
        source.take([0, 1, 2])
    with pytest.raises(cd.errors.RecordIndexError, match="record index 2037 is outside"):
        source.take([0, 2037])
    with pytest.raises(cd.errors.TransformError, match="record 0 of 1 is a JSON list"):
        cd.sources.parse_json([b"[1, 2]"])


def test_a_damaged_chunk_is_a_corrupt_file_error_naming_file_and_record(array_records: Path, tmp_path: Path) -> None:
    """A record whose chunk no longer matches its hash (bytes of the file changed after it
    was written) is a CorruptFileError naming the file and the record, from `take` and from a
    loader reading the source; the records of other chunks still read."""
    damaged = tmp_path / "part-1.array_record"
    writer = ArrayRecordWriter(str(damaged), "group_size:1,uncompressed")  # a chunk a record, stored as it is
    for i in range(700, 800):
        writer.write(json.dumps(record(i)).encode())
    writer.close()
    data = bytearray(damaged.read_bytes())
    at = data.find(json.dumps(record(750)).encode())
    assert at > 0
    data[at + 8 : at + 12] = b"XXXX"  # the record's own bytes: its chunk's hash no longer matches
    damaged.write_bytes(bytes(data))
    source = cd.sources.ArrayRecordSource([str(array_records / "part-0.array_record"), str(damaged)])
    assert source.take([3, 749, 751]).column("id").to_pylist() == [3, 749, 751]
    with pytest.raises(cd.errors.CorruptFileError) as caught:
        source.take([3, 700 + 50, 760])
    message = str(caught.value)
    assert str(damaged) in message and "record 50 of the file (record 750 of the source)" in message, message
    with pytest.raises(cd.errors.CorruptFileError, match=re.escape(str(damaged))):
        read_all(cd.Loader(pipeline(source, "none")))


def test_a_thousand_files_read_under_ulimit_256(tmp_path: Path) -> None:
    """More files than the process may open at once: the source keeps a bounded set of
    readers open (here under `ulimit -n 256`, in a child process)."""
    for f in range(1000):
        writer = ArrayRecordWriter(str(tmp_path / f"part-{f:04d}.array_record"), "group_size:1")
        writer.write(json.dumps({"id": f}).encode())
        writer.close()
    script = (
        "import resource, sys, numpy as np, colo_data as cd\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        f"source = cd.sources.ArrayRecordSource({str(tmp_path / '*.array_record')!r})\n"
        "order = np.random.default_rng(1).permutation(len(source))\n"
        "assert source.take(order)['id'].to_pylist() == order.tolist()\n"
        "print('read', len(source))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "read 1000"


def tf_example_bytes(i: int) -> bytes:
    """A tf.train.Example as TensorFlow serializes it, written out by hand from the wire format
    (no protobuf class of ours): {"id": int64_list [i], "text": bytes_list [b"r<i>"],
    "score": float_list [0.5], "tokens": int64_list [0 .. i % 3]} (ids and tokens < 128)."""

    def field(number: int, payload: bytes) -> bytes:  # a length-delimited field
        return bytes([number << 3 | 2, len(payload)]) + payload

    def feature(name: str, kind: int, value: bytes) -> bytes:  # one entry of Features' map
        return field(1, field(1, name.encode()) + field(2, field(kind, field(1, value))))

    tokens = bytes(range(i % 3 + 1))
    entries = (
        feature("id", 3, bytes([i]))
        + feature("text", 1, f"r{i}".encode())
        + feature("score", 2, np.float32(0.5).tobytes())
        + feature("tokens", 3, tokens)
    )
    return field(1, entries)


def numeric_features(records: list[bytes]) -> dict:
    return {name: column for name, column in cd.sources.parse_tf_example(records).items() if name != "text"}


def test_tf_examples_parse_without_tensorflow(tmp_path: Path) -> None:
    path = tmp_path / "examples.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(40):
        writer.write(tf_example_bytes(i))
    writer.close()
    columns = cd.sources.parse_tf_example([tf_example_bytes(i) for i in (5, 7)])
    assert list(columns) == ["id", "score", "text", "tokens"]
    assert columns["id"].tolist() == [5, 7] and columns["id"].dtype == np.int64
    assert columns["score"].tolist() == [0.5, 0.5] and columns["score"].dtype == np.float32
    assert columns["text"] == [b"r5", b"r7"]
    assert [t.tolist() for t in columns["tokens"]] == [[0, 1, 2], [0, 1]]

    pipeline = cd.Pipeline(
        source=cd.sources.ArrayRecordSource(str(path), parse=numeric_features),
        order=cd.Order(shuffle="global", seed=1),
        global_batch_size=8,
        transforms=[cd.pad_or_truncate("tokens", 3)],
    )
    ids = np.concatenate([b["id"] for b in read_all(cd.Loader(pipeline, hosts=2))])
    assert sorted(ids.tolist()) == list(range(40))
    with pytest.raises(cd.errors.SourceError, match="record 1 of the chunk is not a tf.train.Example"):
        cd.sources.parse_tf_example([tf_example_bytes(1), b"\xff\xff\xff"])


def test_brackets_in_a_file_name_are_its_name(tmp_path: Path) -> None:
    """`data[1].array_record` is that file, never `data1.array_record`; missing, it is the
    missing-file error."""
    for name, count in (("data[1].array_record", 2), ("data1.array_record", 5)):
        writer = ArrayRecordWriter(str(tmp_path / name), "group_size:1")
        for i in range(count):
            writer.write(json.dumps(record(i)).encode())
        writer.close()
    assert len(cd.sources.ArrayRecordSource(str(tmp_path / "data[1].array_record"))) == 2
    (tmp_path / "data[1].array_record").unlink()
    with pytest.raises(cd.errors.SourceError, match=r"no file matches \['.*data\[1\]\.array_record'\]"):
        cd.sources.ArrayRecordSource(str(tmp_path / "data[1].array_record"))
