"""The in-process Loader end to end on real Parquet files: exactly once, topology
invariance, resume across host and worker counts, sharding, and its errors."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import grain
import jax
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh, PartitionSpec
from pipelines import BATCH, backend_of, idle_records, make_pipeline, until_workers_made

import colo_data as cd
from colo_data import defaults, demo
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all

SHUFFLES = ("none", "global", "block")


_epochs: dict[tuple[str, int, int], list[dict[str, np.ndarray]]] = {}


def epoch(corpus: Path, shuffle: str, hosts: int, workers: int) -> list[dict[str, np.ndarray]]:
    """One epoch's batches for a configuration, computed once per test session. Chunks are
    one global batch's records: with workers, the epoch is many chunks of theirs, not one
    that the host's own thread makes."""
    key = (shuffle, hosts, workers)
    if key not in _epochs:
        with mock.patch.object(defaults, "CHUNK_RECORDS", BATCH):
            _epochs[key] = read_all(cd.Loader(make_pipeline(corpus, shuffle), hosts=hosts, backend=cd.InProcess(workers=workers)))
    return _epochs[key]


def assert_exactly_once(batches: list[dict[str, np.ndarray]], records: int) -> None:
    seen = np.concatenate([b["_index"] for b in batches])
    assert len(seen) == records - records % BATCH, f"{len(seen)} records delivered"
    assert len(np.unique(seen)) == len(seen), f"repeated records: {np.unique(seen, return_counts=True)}"
    assert seen.min() >= 0 and seen.max() < records


# Every shuffle with every host count in process; with worker processes (seconds to start
# each), a pairwise design: every pair of (shuffle, hosts), (shuffle, workers) and
# (hosts, workers) occurs once or more.
WORKER_CASES = [
    ("none", 1, 2), ("none", 2, 1), ("none", 3, 2), ("none", 4, 1),
    ("global", 1, 1), ("global", 2, 2), ("global", 3, 1), ("global", 4, 2),
    ("block", 1, 2), ("block", 2, 1), ("block", 3, 2), ("block", 4, 2),
]  # fmt: skip


@pytest.mark.parametrize(
    "shuffle, hosts, workers", [(s, h, 0) for s in SHUFFLES for h in (1, 2, 3, 4)] + WORKER_CASES
)
def test_exactly_once(token_corpus: Path, shuffle: str, hosts: int, workers: int) -> None:
    batches = epoch(token_corpus, shuffle, hosts, workers)
    assert_exactly_once(batches, 120)
    for b in batches:  # the gathered rows are the records the order named
        np.testing.assert_array_equal(b["id"], b["_index"])


@pytest.mark.parametrize("hosts, workers", [(h, w) for h in (1, 2, 4) for w in (0, 1, 2) if (h, w) != (1, 0)])
@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_batches_do_not_depend_on_hosts_or_workers(token_corpus: Path, shuffle: str, hosts: int, workers: int) -> None:
    reference = epoch(token_corpus, shuffle, 1, 0)
    assert_batches_equal(reference, epoch(token_corpus, shuffle, hosts, workers), f"{shuffle}, {hosts} hosts, {workers} workers")


def test_shuffles_differ_from_file_order(token_corpus: Path) -> None:
    plain = np.concatenate([b["_index"] for b in epoch(token_corpus, "none", 1, 0)])
    np.testing.assert_array_equal(plain, np.arange(120))
    for shuffle in ("global", "block"):
        order = np.concatenate([b["_index"] for b in epoch(token_corpus, shuffle, 1, 0)])
        assert not np.array_equal(order, plain), shuffle


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_resume_at_every_step_with_other_hosts_and_workers(token_corpus: Path, shuffle: str) -> None:
    """Saved by 1 host with no workers after every step of a 6-step run; restored by 2 or 4
    hosts, with 1 worker per host at step 3 (worker pools take seconds to start)."""
    pipeline = make_pipeline(token_corpus, shuffle)
    reference = epoch(token_corpus, shuffle, 1, 0)[:6]
    restored_hosts = [2, 4]

    def resumed(k: int, state: dict) -> cd.Loader:
        workers = 1 if k == 3 else 0
        return cd.Loader(make_pipeline(token_corpus, shuffle), hosts=restored_hosts[k % 2], backend=cd.InProcess(workers=workers), state=state)

    assert_resumes_identically(lambda: cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=0)), resumed, steps=6)
    # and the state saved by a worker-backed loader is the same state
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=1)) as loader:
        for _ in range(3):
            next(loader)
        state = loader.get_state()
    rest = read_all(cd.Loader(pipeline, hosts=4, state=state), 3)
    assert_batches_equal(reference[3:6], rest, "resumed from a 1-worker loader's state")


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget")
def test_close_leaves_no_workers_or_shared_memory(token_corpus: Path) -> None:
    shm = Path("/dev/shm")
    before = set(shm.iterdir())
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[idle_records, cd.pad_or_truncate("tokens", 8)])
    with cd.Loader(pipeline, hosts=2, backend=cd.InProcess(workers=2)) as loader:
        until_workers_made(loader)  # a host's thread that waits: the hosts count workers
        deadline = time.monotonic() + 60
        while not _workers_started(2):  # an endless stream: both hosts' fork servers, workers at work
            assert time.monotonic() < deadline, f"fork servers and workers: {_workers()}"
            next(loader)
    gc.collect()
    deadline = time.monotonic() + 10  # Grain unlinks its segments on a background thread
    while (set(shm.iterdir()) - before or _workers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(shm.iterdir()) - before, "shared-memory segments left behind"
    assert not _workers(), "worker processes left behind"


def _workers_started(hosts: int) -> bool:
    """Whether `hosts` fork servers (one a host's pool) run, and a worker process of one at least."""
    servers = [c for c in psutil.Process().children() if "fork server" in " ".join(c.cmdline())]
    return len(servers) == hosts and any(s.children() for s in servers)


def _workers() -> list[psutil.Process]:
    """Live child processes other than multiprocessing's resource tracker."""
    return [
        c
        for c in psutil.Process().children(recursive=True)
        if c.is_running() and c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())
    ]


def test_state_is_small_json_and_host_independent(token_corpus: Path) -> None:
    states = []
    for hosts in (1, 2, 4):
        with cd.Loader(make_pipeline(token_corpus), hosts=hosts) as loader:
            for _ in range(3):
                next(loader)
            states.append(loader.get_state())
    assert states[0] == states[1] == states[2]
    encoded = json.dumps(states[0])
    assert len(encoded.encode()) < 512, encoded
    assert states[0]["position"] == 3 * BATCH and states[0]["epoch"] == 0


def test_set_state_rewinds_a_running_loader(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    with cd.Loader(pipeline) as loader:
        start = loader.get_state()
        first = [np.asarray(next(loader)["_index"]) for _ in range(4)]
        loader.set_state(start)
        again = [np.asarray(next(loader)["_index"]) for _ in range(4)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_epochs_reshuffle_and_each_epoch_is_exactly_once(token_corpus: Path) -> None:
    batches = read_all(cd.Loader(make_pipeline(token_corpus, "global", epochs=2)))
    seen = np.concatenate([b["_index"] for b in batches])
    assert len(seen) == 240
    first, second = seen[:120], seen[120:]
    assert sorted(first) == sorted(second) == list(range(120))
    assert not np.array_equal(first, second)


def test_forever_crosses_epochs_and_resumes(token_corpus: Path) -> None:
    """120 records in batches of 16, one partition: batch 7 straddles epochs 0 and 1. (With
    partitions, each runs through epochs of its own: tests/test_padded_partitions.py.)"""
    pipeline = make_pipeline(token_corpus, "block", epochs=None, global_batch_size=16, partitions=1)
    batches = read_all(cd.Loader(pipeline), 15)
    seen = np.concatenate([b["_index"] for b in batches])
    assert sorted(seen[:120]) == sorted(seen[120:240]) == list(range(120))
    with cd.Loader(pipeline) as loader:
        for _ in range(7):
            next(loader)
        state = loader.get_state()
    assert (state["epoch"], state["position"]) == (0, 112)
    assert_batches_equal(batches[7:], read_all(cd.Loader(pipeline, hosts=2, state=state), 8), "across the epoch boundary")
    with cd.Loader(pipeline) as loader:
        for _ in range(8):
            next(loader)
        assert loader.get_state()["epoch"] == 1 and loader.get_state()["position"] == 8


def test_partial_last_batch_is_dropped(token_corpus: Path) -> None:
    batches = read_all(cd.Loader(make_pipeline(token_corpus, global_batch_size=16)))
    assert len(batches) == 120 // 16
    assert all(b["tokens"].shape == (16, 8) for b in batches)


def test_batches_are_sharded_over_the_mesh(token_corpus: Path) -> None:
    assert jax.device_count() == 4
    with cd.Loader(make_pipeline(token_corpus), hosts=2) as loader:
        batch = next(loader)
    tokens = batch["tokens"]
    assert tokens.shape == (BATCH, 8) and tokens.dtype == np.int32
    assert len(tokens.sharding.device_set) == 4
    assert {s.data.shape for s in tokens.addressable_shards} == {(BATCH // 4, 8)}
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    with cd.Loader(make_pipeline(token_corpus), mesh=mesh, partition_spec=PartitionSpec("data")) as loader:
        other = next(loader)
    assert {s.data.shape for s in other["tokens"].addressable_shards} == {(BATCH // 2, 8)}
    np.testing.assert_array_equal(np.asarray(other["tokens"]), np.asarray(tokens))


def test_grain_map_dataset_source_and_per_record_transform() -> None:
    records = [{"x": np.arange(i % 5 + 1, dtype=np.int32), "y": float(i)} for i in range(48)]

    class Double(grain.transforms.Map):
        def map(self, record: dict) -> dict:
            return {**record, "y": record["y"] * 2}

    pipeline = cd.Pipeline(
        source=grain.MapDataset.source(records),
        order=cd.Order(shuffle="global", seed=1),
        transforms=[cd.per_record(Double()), cd.pad_or_truncate("x", 3)],
        global_batch_size=8,
        index_column="i",
    )
    batches = read_all(cd.Loader(pipeline, hosts=2))
    assert len(batches) == 6
    index = np.concatenate([b["i"] for b in batches])
    assert sorted(index) == list(range(48))
    for b in batches:
        np.testing.assert_array_equal(b["y"], 2.0 * b["i"])
        for row, i in zip(b["x"], b["i"]):
            n = min(i % 5 + 1, 3)
            np.testing.assert_array_equal(row, np.r_[np.arange(n), np.zeros(3 - n)])


# Errors: each is a named colo-data exception, raised before any batch or at the batch
# that hits it, never a hang.


def test_batch_not_divisible_by_hosts(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"global_batch_size=12 is not divisible by 5 hosts"):
        cd.Loader(make_pipeline(token_corpus), hosts=5)


def test_batch_not_divisible_by_mesh(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"global_batch_size=6 is not divisible by the 4 shards"):
        cd.Loader(make_pipeline(token_corpus, global_batch_size=6), hosts=1)


def test_unknown_backend(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match="backend='tpu'"):
        cd.Loader(make_pipeline(token_corpus), backend="tpu")


def test_state_from_another_pipeline_says_what_differs(token_corpus: Path) -> None:
    with cd.Loader(make_pipeline(token_corpus, "block")) as loader:
        next(loader)
        state = loader.get_state()
    with pytest.raises(cd.errors.StateError, match=r"order: state has 'block:2', pipeline has 'global'"):
        cd.Loader(make_pipeline(token_corpus, "global"), state=state)
    other = make_pipeline(token_corpus, order=cd.Order(shuffle="block", seed=8, window=2))
    with pytest.raises(cd.errors.StateError, match=r"seed: state has 7, pipeline has 8"):
        cd.Loader(other, state=state)


def test_state_of_another_format_version(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.StateError, match=r"format 'colo-data/1', from another colo-data version.*reads 'colo-data/2'"):
        cd.Loader(make_pipeline(token_corpus), state={"format": "colo-data/1", "position": 0})
    with pytest.raises(cd.errors.StateError, match=r"format 'tf.data'; this colo-data reads 'colo-data/2'"):
        cd.Loader(make_pipeline(token_corpus), state={"format": "tf.data", "position": 0})
    with pytest.raises(cd.errors.StateError, match="format"):
        cd.Loader(make_pipeline(token_corpus), state=[1, 2])


def test_state_from_other_files(token_corpus: Path, tmp_path: Path) -> None:
    with cd.Loader(make_pipeline(token_corpus)) as loader:
        state = loader.get_state()
    demo.write_corpus(tmp_path, files=3, rows_per_file=40, row_group_size=7, min_tokens=1, max_tokens=12, seed=1)
    demo.write_corpus(tmp_path / "more", files=1, rows_per_file=5, row_group_size=7, seed=1)
    other = make_pipeline(token_corpus, source=cd.ArrowSource(str(tmp_path), columns=["id", "tokens"]))
    with pytest.raises(cd.errors.StateError, match=r"records: state has 120, pipeline has 125.*source: state has"):
        cd.Loader(other, state=state)


def test_variable_length_column_left_unpadded(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[])
    with cd.Loader(pipeline) as loader, pytest.raises(cd.errors.TransformError, match=r"'tokens'.*pad_or_truncate\('tokens'"):
        next(loader)


def boom(batch: dict) -> dict:
    raise ValueError("bad record")


def test_failing_transform_names_itself_and_the_position(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 8), boom])
    with cd.Loader(pipeline) as loader, pytest.raises(cd.errors.TransformError) as raised:
        next(loader)
    message = str(raised.value)
    assert "boom" in message and "ValueError: bad record" in message and "position 0" in message
    assert type(raised.value.__cause__) is ValueError  # its traceback, printed once: the cause's


def test_transform_that_drops_rows(token_corpus: Path) -> None:
    def first_half(batch: dict) -> dict:
        return {k: v[: len(v) // 2] for k, v in batch.items()}

    pipeline = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 8), first_half])
    with cd.Loader(pipeline) as loader, pytest.raises(cd.errors.TransformError, match=r"(\d+) rows after the transforms, but (\d+) records went in"):
        next(loader)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(global_batch_size=0), "global_batch_size=0"),
        (dict(global_batch_size=1000), "larger than the source's 120 records"),
        (dict(epochs=0), "epochs=0"),
        (dict(index_column="id"), "index_column='id' is already a column"),
        (dict(transforms=["pad"]), "is not callable"),
    ],
)
def test_pipeline_settings(token_corpus: Path, overrides: dict, match: str) -> None:
    with pytest.raises(cd.errors.ConfigError, match=match):
        make_pipeline(token_corpus, **overrides)


@pytest.mark.parametrize("backend", ["inprocess", "sidecar", "colocated"])
def test_a_dataset_of_fewer_files_than_hosts(token_corpus: Path, tmp_path: Path, backend: str) -> None:
    """One file read by 4 hosts (loaders that shard by file give some hosts nothing, and
    jobs crash or hang): hosts take rows of each global batch, not files, so the batches
    are the one-host batches, on every backend."""
    single = tmp_path / "one.parquet"
    pq.write_table(pa.concat_tables(pq.read_table(p) for p in sorted(token_corpus.glob("*.parquet"))), single, row_group_size=50)
    pipeline = make_pipeline(single)
    assert len(pipeline.source.files) == 1
    expected = read_all(cd.Loader(pipeline))
    assert len(expected) == 120 // BATCH
    assert_batches_equal(expected, read_all(cd.Loader(pipeline, hosts=4, backend=backend_of(backend))), f"1 file, 4 hosts, {backend}")


def test_a_keyword_the_loader_does_not_take_is_pythons_type_error(token_corpus: Path) -> None:
    """The transport's settings are the backend's (`cd.InProcess(workers=2)`), not the loader's."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'workers'"):
        cd.Loader(make_pipeline(token_corpus), workers=2)


# A loader over records of `width` bytes each (a transform makes them from the record's id),
# batches of `batch` records, in a process of its own: its peak memory over what it held before
# the loader (JAX started), in bytes.
_PEAK_SCRIPT = """
import resource, sys
import jax, numpy as np, psutil
import colo_data as cd

width, batch, batches, backend, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]

def payload(columns):
    ids = columns["id"]
    return {"id": ids, "payload": np.repeat((ids % 251).astype(np.uint8)[:, None], width, axis=1)}

pipeline = cd.Pipeline(source=cd.ArrowSource(path, columns=["id"]), transforms=[payload], global_batch_size=batch, epochs=None)
options = cd.InProcess(workers=0) if backend == "inprocess" else cd.Colocated()
jax.device_put(np.zeros(1)).block_until_ready()
held = psutil.Process().memory_info().rss
with cd.Loader(pipeline, backend=options) as loader:
    for _ in range(batches):
        last = next(loader)
    assert (np.asarray(last["payload"])[:, -1] == np.asarray(last["id"]) % 251).all()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - held)
"""


def _peak_growth(tmp_path: Path, width: int, batch: int, backend: str) -> int:
    path = tmp_path / "ids.parquet"
    if not path.exists():
        pq.write_table(pa.table({"id": np.arange(20_000, dtype=np.int64)}), path, row_group_size=2_000)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device: one host, batches of 2
    args = [sys.executable, "-c", _PEAK_SCRIPT, str(width), str(batch), "100", backend, str(path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


@pytest.mark.parametrize("backend", ["inprocess", "colocated"])
def test_memory_follows_the_bytes_of_the_batches_not_the_records_of_a_chunk(tmp_path: Path, backend: str) -> None:
    """The same 8 MiB host batches, as 128 records of 64 KiB or 2 of 4 MiB, 100 of them: a
    chunk (a colocated call) stops growing once its bytes reach the cap, so both peak alike.
    Chunks of up to 512 records whatever they weigh took 1.7 to 4 GiB more here with records of
    4 MiB, and 3.7 GiB in all further on (a colocated call at once: 4 GiB); 0.2 to 0.3 GiB of 64 KiB."""
    small = _peak_growth(tmp_path, 64 * 2**10, 128, backend)
    big = _peak_growth(tmp_path, 4 * 2**20, 2, backend)
    peaks = f"{big / 2**20:.0f} MiB, {small / 2**20:.0f} MiB with records of 64 KiB"
    assert big <= 2 * small + 128 * 2**20, f"peak memory over the loader's start: {peaks}"
