"""A loader state carries its data's fingerprint, made of the data's content: a restore over
other data of the same shape is a StateError, not a silent resume. The cases: a Grain
`MapDataset` as a native source over other records of the same length; ArrayRecord shards
of the same size swapped under their names, read by `cd.sources.ArrayRecordSource` and by a
`cd.GrainPipeline` (Grain's `ArrayRecordDataSource`); a shard rewritten in place with other
records of the same size, its time of last writing set back. A copy of the same files
elsewhere, with new times, restores."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import grain
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

import colo_data as cd
from colo_data.testing import assert_batches_equal, read_all, to_numpy

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

SHARDS, RECORDS, BATCH = 2, 40, 8


def write_shard(path: Path, first: int, text: str = "abc") -> None:
    """RECORDS JSON records of the same length each, stored uncompressed: every shard written
    here has the same size, whatever its ids and text."""
    writer = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
    for i in range(first, first + RECORDS):
        writer.write(json.dumps({"id": 1_000_000 + i, "text": text}).encode())
    writer.close()


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "data" / f"part-{s}.array_record" for s in range(SHARDS)]
    paths[0].parent.mkdir()
    for s, path in enumerate(paths):
        write_shard(path, s * RECORDS)
    assert len({p.stat().st_size for p in paths}) == 1, "the shards have the same size"
    return paths


def swap(a: Path, b: Path) -> None:
    """Swap two files under their names (each keeps its own time of last writing)."""
    a.rename(a.with_suffix(".swap"))
    b.rename(a)
    a.with_suffix(".swap").rename(b)


def native(source: object, transforms: tuple = ()) -> cd.Pipeline:
    return cd.Pipeline(
        source=source, order=cd.Order(shuffle="none"), transforms=list(transforms), global_batch_size=BATCH, epochs=1
    )


def saved_after_two_batches(pipeline: cd.Pipeline | cd.GrainPipeline, hosts: int = 1) -> dict:
    with cd.Loader(pipeline, hosts=hosts) as loader:
        next(loader)
        next(loader)
        return loader.get_state()


def array_record_pipeline(directory: Path) -> cd.Pipeline:
    return native(cd.sources.ArrayRecordSource(str(directory / "*.array_record")), [cd.drop("text")])


def test_array_record_shards_swapped_under_their_names_are_refused(shards: list[Path]) -> None:
    state = saved_after_two_batches(array_record_pipeline(shards[0].parent))
    swap(*shards)
    with pytest.raises(cd.errors.StateError, match="saved from a different pipeline .*source: state has"):
        cd.Loader(array_record_pipeline(shards[0].parent), state=state)


def test_an_array_record_shard_rewritten_in_place_is_refused(shards: list[Path]) -> None:
    state = saved_after_two_batches(array_record_pipeline(shards[0].parent))
    before = shards[0].stat()
    write_shard(shards[0], 5 * RECORDS, text="xyz")  # other ids and text, the same size
    os.utime(shards[0], ns=(before.st_atime_ns, before.st_mtime_ns))  # as `cp -p` or `touch -r` leaves it
    assert shards[0].stat().st_size == before.st_size
    with pytest.raises(cd.errors.StateError, match="source: state has"):
        cd.Loader(array_record_pipeline(shards[0].parent), state=state)


def test_a_copy_of_the_same_shards_restores(shards: list[Path], tmp_path: Path) -> None:
    """New times, another directory: the same content, the same fingerprint; the rest of the
    epoch is what the first loader would have read."""
    pipeline = array_record_pipeline(shards[0].parent)
    state = saved_after_two_batches(pipeline)
    copy = tmp_path / "copy"
    copy.mkdir()
    for shard in shards:
        shutil.copy(shard, copy / shard.name)  # contents only: new times
    with cd.Loader(array_record_pipeline(copy), state=state) as loader:
        rest = read_all(loader)
    assert_batches_equal(read_all(cd.Loader(pipeline))[2:], rest, "restored over a copy")


def records(first: int) -> list[dict]:
    return [{"id": np.int64(i), "x": np.full(3, i, np.float32)} for i in range(first, first + RECORDS)]


def test_a_map_dataset_over_other_records_of_the_same_length_is_refused() -> None:
    pipeline = native(grain.MapDataset.source(records(0)).map(dict))
    state = saved_after_two_batches(pipeline)
    with pytest.raises(cd.errors.StateError, match="source: state has"):
        cd.Loader(native(grain.MapDataset.source(records(100)).map(dict)), state=state)
    with cd.Loader(native(grain.MapDataset.source(records(0)).map(dict)), state=state) as loader:  # the same data, made again
        assert to_numpy(next(loader))["id"].tolist() == list(range(2 * BATCH, 3 * BATCH))


def grain_pipeline(paths: list[Path]) -> cd.GrainPipeline:
    make = functools.partial(grain_records, paths=[str(p) for p in paths])
    return cd.GrainPipeline(make_dataset=make, global_batch_size=BATCH, records=True)


def grain_records(shard: grain.sharding.ShardOptions, paths: list[str]) -> grain.MapDataset:
    """A host's share of the records, parsed, one an element."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))[shard.shard_index :: shard.shard_count]
    return ds.map(lambda record: {"id": np.int64(json.loads(record)["id"])})


def test_grain_array_record_shards_swapped_under_their_names_are_refused(shards: list[Path]) -> None:
    pipeline = grain_pipeline(shards)
    state = saved_after_two_batches(pipeline, hosts=2)
    swap(*shards)
    with cd.Loader(grain_pipeline(shards), hosts=2, state=state) as loader, pytest.raises(cd.errors.StateError, match="other data"):
        next(loader)


def test_a_grain_array_record_shard_rewritten_in_place_is_refused(shards: list[Path]) -> None:
    state = saved_after_two_batches(grain_pipeline(shards), hosts=2)
    write_shard(shards[1], 7 * RECORDS, text="xyz")
    with cd.Loader(grain_pipeline(shards), hosts=2, state=state) as loader, pytest.raises(cd.errors.StateError, match="other data"):
        next(loader)
