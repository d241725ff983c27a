"""`cd.GrainPipeline`: a user's MaxText-style Grain pipeline (ArrayRecord files, parse,
tokenize, filter, random_map, first-fit packing, batch; and with `mp_prefetch`), run
unchanged on every backend, gives the batches Grain itself gives host by host, for 1, 2 and
3 hosts; resuming after k batches is bit-identical; a state restores only on its own host
count, except through Grain's `ElasticIterator`; a state of other data or another kind is
refused; and a dataset that fails or gives what cannot be batched is a `GrainError` naming
the host, on every backend."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grain
import grain_pipelines as gp
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import colo_data as cd
from colo_data.testing import to_numpy

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5  # batches compared; the resume point is after RESUME_AT of them
RESUME_AT = 2


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return gp.write_records(tmp_path_factory.mktemp("grain"))


def loader_for(pipeline: cd.GrainPipeline, backend: str, hosts: int, **options: Any) -> cd.Loader:
    """A loader of `hosts` hosts: simulated in this process, or, colocated, one per CPU device
    of a mesh of `hosts` devices."""
    if backend == "colocated":
        return cd.Loader(pipeline, backend=backend, mesh=Mesh(np.array(jax.devices()[:hosts]), ("data",)), **options)
    return cd.Loader(pipeline, backend=backend, hosts=hosts, **options)


def read(loader: cd.Loader, steps: int) -> list[dict[str, np.ndarray]]:
    return [to_numpy(next(loader)) for _ in range(steps)]


def assert_host_by_host(expected: list[list[dict[str, np.ndarray]]], got: list[dict[str, np.ndarray]], what: str) -> None:
    """Global batch i holds host h's element i in rows `[h*B/H, (h+1)*B/H)`."""
    hosts = len(expected)
    rows = gp.BATCH // hosts
    for step, batch in enumerate(got):
        for h in range(hosts):
            want = expected[h][step]
            assert set(batch) == set(want), f"{what}: batch {step} has columns {sorted(batch)}, Grain's {sorted(want)}"
            for name, column in want.items():
                np.testing.assert_array_equal(
                    batch[name][h * rows : (h + 1) * rows], column, err_msg=f"{what}: batch {step}, host {h}, {name!r}"
                )


@pytest.mark.parametrize("hosts", [1, 2, 3])
@pytest.mark.parametrize("backend", ["inprocess", "sidecar", "colocated"])
def test_identical_to_grain_and_resumes_identically(paths: list[str], backend: str, hosts: int) -> None:
    make = functools.partial(gp.maxtext_like, paths=paths)
    expected = gp.grain_batches(make, hosts, STEPS)
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH)
    with loader_for(pipeline, backend, hosts) as loader:
        got = read(loader, RESUME_AT)
        state = loader.get_state()
        got += read(loader, STEPS - RESUME_AT)
    assert_host_by_host(expected, got, f"{backend}, {hosts} host(s)")
    assert got[0]["inputs_segment_ids"].max() > 1, "the rows are packed"

    assert state["kind"] == "grain" and len(state["hosts"]) == hosts
    assert len(json.dumps(state)) < 300 * hosts, "one small JSON item"
    restored = json.loads(json.dumps(state))
    with loader_for(pipeline, backend, hosts, state=restored) as loader:
        again = read(loader, STEPS - RESUME_AT)
        assert loader.get_state()["hosts"] != state["hosts"], "the state moves on with the batches"
    assert_host_by_host([e[RESUME_AT:] for e in expected], again, f"{backend}, {hosts} host(s), resumed")


def test_mp_prefetch_runs_inside_the_sidecar_and_resumes(paths: list[str]) -> None:
    """Grain's own worker processes, started where the host's share runs (in the sidecar);
    their states travel with each batch as Grain's do. (In the trainer's process, the
    unclosed-script test below runs them.)"""
    make = functools.partial(gp.maxtext_like, paths=paths, workers=1)
    # Grain's one worker gives the stream of none (checked with Grain itself: two would each take every 2nd record)
    expected = gp.grain_batches(functools.partial(gp.maxtext_like, paths=paths), 1, STEPS)
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH)
    backend = "sidecar"
    with cd.Loader(pipeline, backend=backend, hosts=1) as loader:
        got = read(loader, RESUME_AT)
        state = loader.get_state()
        got += read(loader, STEPS - RESUME_AT)
    assert_host_by_host(expected, got, f"{backend} with mp_prefetch")
    assert "iterators_in_use_states" in json.dumps(state), "each host's state is mp_prefetch's"
    with cd.Loader(pipeline, backend=backend, hosts=1, state=state) as loader:
        again = read(loader, STEPS - RESUME_AT)
    assert_host_by_host([e[RESUME_AT:] for e in expected], again, f"{backend} with mp_prefetch, resumed")


def test_a_state_restores_only_with_the_grain_worker_count_that_saved_it(paths: list[str]) -> None:
    """mp_prefetch gives each of its workers a slice of the dataset, so a state saved with one
    worker count is a StateError naming both counts with another (a state of an earlier
    colo-data that does not record the count: a StateError saying Grain could not restore
    it, not Grain's IndexError)."""
    one, two = (
        cd.GrainPipeline(functools.partial(gp.maxtext_like, paths=paths, workers=w), global_batch_size=gp.BATCH) for w in (1, 2)
    )
    with cd.Loader(one, backend="sidecar", hosts=1) as loader:
        read(loader, 1)
        state = loader.get_state()
    saved_with_one = r"host 0 of 1: the loader state was saved with 1 Grain worker process\(es\).* has 2.*num_workers=1"
    with pytest.raises(cd.errors.StateError, match=saved_with_one):
        with cd.Loader(two, backend="sidecar", hosts=1, state=state) as loader:
            next(loader)
    unrecorded = json.loads(json.dumps(state))
    del unrecorded["hosts"][0]["workers"]
    with pytest.raises(cd.errors.StateError, match=r"host 0 of 1: Grain could not restore the saved iterator state \(IndexError"):
        with cd.Loader(two, backend="sidecar", hosts=1, state=unrecorded) as loader:
            next(loader)


def test_cd_checkpoint_saves_and_restores_a_grain_state_through_orbax(paths: list[str], tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    from colo_data import checkpoint

    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)
    with ocp.CheckpointManager(tmp_path) as mngr, cd.Loader(pipeline, hosts=2) as loader:
        read(loader, 2)
        mngr.save(2, args=ocp.args.Composite(data=checkpoint.save_args(loader)))
        mngr.wait_until_finished()
        rest = read(loader, 2)
    with ocp.CheckpointManager(tmp_path) as mngr:
        state = mngr.restore(2, args=ocp.args.Composite(data=checkpoint.restore_args(pipeline)))["data"]
    with cd.Loader(pipeline, hosts=2, state=state) as loader:
        again = read(loader, 2)
    for a, b in zip(rest, again, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_set_state_on_an_open_loader_goes_back(paths: list[str]) -> None:
    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)
    with cd.Loader(pipeline, hosts=2) as loader:
        read(loader, 1)
        state = loader.get_state()
        ahead = read(loader, 3)
        loader.set_state(state)
        assert loader.get_state() == state
        again = read(loader, 3)
        # the new transport's counters start at zero: no stage went back in time
        assert all(stage.seconds >= 0 and stage.items >= 0 for stage in loader.telemetry().stages)
    for a, b in zip(ahead, again, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def counting(shard: grain.sharding.ShardOptions, timed: bool) -> grain.IterDataset:
    """Endless shuffled numbers batched per host; with `timed`, Grain's stage timing on."""
    ds = grain.MapDataset.range(10_000).shuffle(seed=1).repeat()[shard.shard_index :: shard.shard_count]
    out = ds.map(lambda i: {"x": np.full(16, i, np.int64)}).to_iter_dataset().batch(gp.BATCH // shard.shard_count)
    if not timed:
        return out
    timing = grain.experimental.DatasetOptions(execution_tracking_mode=grain.experimental.ExecutionTrackingMode.STAGE_TIMING)
    return grain.experimental.WithOptionsIterDataset(out, timing)


def test_grains_own_stage_times_are_the_hosts_stages() -> None:
    """With Grain's stage timing on, the telemetry's stages are Grain's nodes (source under
    read, shuffle and slice under order, map under transform, batch under batch), once Grain
    has folded them into its summary (every 5 s), here from the sidecars; without it,
    Grain's next() is one transform. (Grain's timing starts a reporting thread of its own
    that lives 2 minutes after the last element: in the sidecar, it ends with it.)"""

    def stages(timed: bool, deadline_s: float) -> dict[str, Any]:
        pipeline = cd.GrainPipeline(make_dataset=functools.partial(counting, timed=timed), global_batch_size=gp.BATCH)
        with cd.Loader(pipeline, hosts=2, backend="sidecar" if timed else "inprocess") as loader:
            until = time.monotonic() + deadline_s
            while True:
                next(loader)
                got = {s.name: s for s in loader.telemetry().stages}
                if time.monotonic() > until or all(got[n].seconds > 0 for n in ("order", "read", "transform", "batch")):
                    return got

    timed = stages(True, 60)
    assert all(timed[n].seconds > 0 and timed[n].items > 0 for n in ("order", "read", "transform", "batch")), timed
    plain = stages(False, 0.5)
    assert plain["transform"].seconds > 0 and plain["transform"].items > 0, plain
    assert all(plain[n].seconds == 0 for n in ("order", "read", "batch")), plain


def test_records_are_stacked_into_host_batches(paths: list[str]) -> None:
    make = functools.partial(gp.records_of, paths=paths)
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH, records=True)
    with cd.Loader(pipeline, hosts=3) as loader:
        got = read(loader, 2)
    rows = gp.BATCH // 3
    for h in range(3):
        records = list(make(grain.sharding.ShardOptions(h, 3)))[: 2 * rows]
        for step in range(2):
            for name in ("id", "tokens"):
                want = np.stack([r[name] for r in records[step * rows : (step + 1) * rows]])
                np.testing.assert_array_equal(got[step][name][h * rows : (h + 1) * rows], want, err_msg=f"{h} {name}")


def test_the_stream_ends_where_every_host_dataset_ends(paths: list[str]) -> None:
    """180 records, 3 hosts of 60, batches of 4 records a host: 15 batches, then the end."""
    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.records_of, paths=paths), global_batch_size=gp.BATCH, records=True)
    with cd.Loader(pipeline, hosts=3) as loader:
        batches = [to_numpy(b) for b in loader]
    assert len(batches) == 60 // (gp.BATCH // 3)
    assert sorted(np.concatenate([b["id"] for b in batches]).tolist()) == list(range(180))


def test_a_state_before_the_first_batch_starts_at_the_beginning_on_any_host_count(paths: list[str]) -> None:
    make = functools.partial(gp.maxtext_like, paths=paths)
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH)
    with cd.Loader(pipeline, hosts=2) as loader:
        state = loader.get_state()
    assert state["position"] == 0 and state["hosts"] == [None, None]
    with cd.Loader(pipeline, hosts=3, state=state) as loader:
        got = read(loader, 2)
    assert_host_by_host(gp.grain_batches(make, 3, 2), got, "started from the first state")


def test_a_state_restores_on_its_own_host_count_only(paths: list[str]) -> None:
    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)
    with cd.Loader(pipeline, hosts=2) as loader:
        read(loader, 1)
        state = loader.get_state()
    with pytest.raises(cd.errors.StateError, match=r"saved on 2 host\(s\); this loader has 3.*ElasticIterator"):
        cd.Loader(pipeline, hosts=3, state=state)


def test_an_elastic_iterator_restores_on_another_host_count(paths: list[str]) -> None:
    """Grain's ElasticIterator: after 2 global batches on 2 hosts, 3 hosts go on with records
    `[2B, 3B)`, each once (its hosts interleave the records, so rows differ by host count)."""
    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.elastic, paths=paths), global_batch_size=gp.BATCH)
    with cd.Loader(pipeline, hosts=2) as loader:
        first = read(loader, 2)
        state = loader.get_state()
    assert sorted(np.concatenate([b["id"] for b in first]).tolist()) == list(range(2 * gp.BATCH))
    with cd.Loader(pipeline, hosts=3, state=state) as loader:
        after = read(loader, 2)
    assert sorted(after[0]["id"].tolist()) == list(range(2 * gp.BATCH, 3 * gp.BATCH))
    assert sorted(after[1]["id"].tolist()) == list(range(3 * gp.BATCH, 4 * gp.BATCH))


def test_a_state_of_other_data_or_another_kind_is_refused(paths: list[str], token_corpus: Path) -> None:
    make = functools.partial(gp.maxtext_like, paths=paths)
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH)
    with cd.Loader(pipeline, hosts=2) as loader:
        read(loader, 1)
        state = loader.get_state()
    reordered = cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths[::-1]), global_batch_size=gp.BATCH)
    with cd.Loader(reordered, hosts=2, state=state) as loader, pytest.raises(cd.errors.StateError, match="other data"):
        next(loader)
    with pytest.raises(cd.errors.StateError, match="global_batch_size=12"):
        cd.Loader(cd.GrainPipeline(make_dataset=make, global_batch_size=6), hosts=2, state=state)

    from pipelines import make_pipeline

    native = make_pipeline(token_corpus)
    with pytest.raises(cd.errors.StateError, match="saved from a cd.GrainPipeline"):
        cd.Loader(native, state=state)
    with cd.Loader(native) as loader:
        next(loader)
        native_state = loader.get_state()
    with pytest.raises(cd.errors.StateError, match="saved from a native cd.Pipeline"):
        cd.Loader(pipeline, hosts=2, state=native_state)


def raising(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    if shard.shard_index == 1:
        raise FileNotFoundError("no such file: /data/missing.array_record")
    return grain.MapDataset.range(60).map(lambda i: {"x": np.int32(i)}).batch(6)


def not_arrays(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    return grain.MapDataset.range(100).map(lambda i: {"text": f"record {i}"}).batch(6)


def wrong_size(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    return grain.MapDataset.range(100).map(lambda i: {"x": np.int32(i)}).batch(4)


def uneven(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    """Host 0 has 3 batches, host 1 has 2."""
    return grain.MapDataset.range(18 - 6 * shard.shard_index).map(lambda i: {"x": np.int32(i)}).batch(6)


def none_element(shard: grain.sharding.ShardOptions) -> grain.IterDataset:
    """The second element of each host is None (a map that returns None on an IterDataset
    yields it): an error, not the end of the stream."""
    batches = grain.MapDataset.range(60).map(lambda i: {"x": np.int32(i)}).batch(6).to_iter_dataset()
    return batches.map(lambda b: None if b["x"][0] in (6, 36) else b)


def ragged(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    """Host 1's rows are longer than host 0's."""
    return grain.MapDataset.range(60).map(lambda i: {"x": np.zeros(4 + shard.shard_index, np.int32)}).batch(6)


def drifting(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    """Rows of 4 for the first 4 batches of each host, then rows of 8 (position 48 on)."""
    return grain.MapDataset.range(60).map(lambda i: {"x": np.zeros(4 if i < 24 else 8, np.int32)}).batch(6)


BAD = {
    "raises": (raising, cd.errors.GrainError, r"host 1 of 2: make_dataset\(.*FileNotFoundError: no such file: /data/missing"),
    "not-arrays": (not_arrays, cd.errors.GrainError, r"host 0 of 2: the Grain dataset's element has 'text'.*numeric"),
    "wrong-size": (wrong_size, cd.errors.GrainError, r"host 0 of 2: .*'x' with leading size 4; a host's batch is .* 6 rows.*\.batch\(6"),
    "uneven": (uneven, cd.errors.GrainError, r"host\(s\) \[1\] came to the end of their data while host\(s\) \[0\] had more"),
    "ragged": (ragged, cd.errors.TransformError, r"host 0 and host 1 made different columns \['x'\]"),
    "none-element": (none_element, cd.errors.GrainError, r"host [01] of 2: the Grain dataset gave a NoneType element"),
    "drifting": (
        drifting,
        cd.errors.TransformError,
        r"host [01] of 2: at position 48 .* column\(s\) \['x'\] as \{x: int32\[8\]\}, where the first batch had "
        r"\{x: int32\[4\]\}",
    ),
}
# every case on the in-process and colocated backends; through sidecars (4 s each to import Grain), those whose
# error crosses the socket differently: a host's traceback, the hosts' feeds ending apart, a batch that no
# longer fits the ring's slots
CASES = [(b, c) for b in ("inprocess", "colocated") for c in BAD] + [("sidecar", c) for c in ("raises", "uneven", "drifting")]


@pytest.mark.parametrize("backend, case", CASES, ids=[f"{c}-{b}" for b, c in CASES])
def test_bad_datasets_are_named_errors_on_every_backend(backend: str, case: str) -> None:
    make, error, match = BAD[case]
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=12)
    with loader_for(pipeline, backend, 2) as loader, pytest.raises(error, match=match):
        for _ in range(5):
            next(loader)


def malformed_41(i: int) -> dict[str, np.ndarray]:
    """A user's map that fails on one record."""
    if i == 41:
        raise ValueError("record 41 is malformed")
    return {"x": np.int32(i)}


def failing_map(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    """Host 1 of 2 holds the odd records: record 41 is in its batch 3, at position 36."""
    return grain.MapDataset.range(60)[shard.shard_index :: shard.shard_count].map(malformed_41).batch(6)


@pytest.mark.parametrize("backend", ["inprocess", "sidecar", "colocated"])
def test_an_error_in_a_users_map_is_a_grain_error_naming_the_host_and_position(backend: str) -> None:
    """The same type on every backend, naming the host and the batch, and the user's exception
    type and message; the exception itself is its cause, whose traceback is printed once."""
    pipeline = cd.GrainPipeline(failing_map, global_batch_size=12)
    with loader_for(pipeline, backend, 2) as loader, pytest.raises(cd.errors.GrainError) as raised:
        for _ in range(5):
            next(loader)
    message = str(raised.value)
    where = r"^host 1 of 2: .*global batch 3 \(position 36\).*ValueError: record 41 is malformed"
    assert re.search(where, message), message
    cause = raised.value.__cause__
    assert type(cause) is ValueError and str(cause) == "record 41 is malformed", repr(cause)
    printed = "".join(traceback.format_exception(raised.value))
    assert printed.count(", in malformed_41\n") == 1, printed


def test_a_none_element_is_an_error_in_verifys_own_reading_too() -> None:
    """`colo-data verify` reads each host's Grain dataset itself, as the reference: a None
    element there is the same named error, not the end of the reference."""
    from colo_data.verification.verify_grain import grain_batches

    with pytest.raises(cd.errors.GrainError, match="gave a NoneType element"):
        grain_batches(cd.GrainPipeline(make_dataset=none_element, global_batch_size=6), 1, 4)


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(cd.errors.ConfigError, match="make_dataset="):
        cd.GrainPipeline(make_dataset="pkg.module:function", global_batch_size=8)
    with pytest.raises(cd.errors.ConfigError, match="global_batch_size=0"):
        cd.GrainPipeline(make_dataset=raising, global_batch_size=0)
    with pytest.raises(cd.errors.ConfigError, match="records="):
        cd.GrainPipeline(make_dataset=raising, global_batch_size=8, records="yes")


def test_grain_datasets_as_native_sources_say_what_to_use() -> None:
    """A filtered MapDataset (None records) and an IterDataset are not random-access sources."""
    filtered = grain.MapDataset.range(100).map(lambda i: {"x": i}).filter(lambda r: r["x"] % 2 == 0)
    with pytest.raises(cd.errors.ConfigError, match="filters records.*FilterMapDataset.*cd.GrainPipeline"):
        cd.Pipeline(source=filtered, global_batch_size=4)
    packed = grain.MapDataset.range(100).map(lambda i: {"x": i}).to_iter_dataset().batch(4)
    with pytest.raises(cd.errors.SourceError, match="Grain IterDataset.*cd.GrainPipeline"):
        cd.Pipeline(source=packed, global_batch_size=4)


def test_served_sidecars_of_a_config_give_grain_batches_for_1_2_and_3_hosts(paths: list[str], tmp_path: Path) -> None:
    """`colo-data sidecar serve CONFIG` (3 of them) with a config whose function returns a
    GrainPipeline; trainers of 1, 2 and 3 hosts read through the first 1, 2 or 3 sockets, get
    Grain's batches host by host, and resume through the same sidecars."""
    (tmp_path / "grain_config_pipeline.py").write_text(
        "import functools, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import colo_data as cd\nimport grain_pipelines as gp\n\n"
        "def pipeline(paths):\n"
        "    return cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)\n"
    )
    config = tmp_path / "grain.toml"
    config.write_text(f'pipeline = "grain_config_pipeline:pipeline"\n[args]\npaths = {json.dumps(paths)}\n')
    sockets = [tmp_path / f"host{h}.sock" for h in range(3)]
    command = [sys.executable, "-m", "colo_data.cli", "sidecar", "serve", str(config), "--workers", "0", "--socket"]
    servers = [subprocess.Popen([*command, str(s)], cwd=tmp_path, stderr=subprocess.PIPE, text=True) for s in sockets]
    try:
        deadline = time.monotonic() + 120
        for server, socket in zip(servers, sockets, strict=True):
            while not socket.exists():
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "the sidecar did not start"
                time.sleep(0.1)
        sys.path.insert(0, str(tmp_path))
        from grain_config_pipeline import pipeline as build

        pipeline = build(paths)
        make = functools.partial(gp.maxtext_like, paths=paths)
        for hosts in (1, 2, 3):
            served = cd.Sidecar(address=[str(s) for s in sockets[:hosts]])
            expected = gp.grain_batches(make, hosts, STEPS)
            with cd.Loader(pipeline, backend=served, hosts=hosts) as loader:
                got = read(loader, RESUME_AT)
                state = loader.get_state()
                got += read(loader, STEPS - RESUME_AT)
            assert_host_by_host(expected, got, f"{hosts} served sidecar(s)")
            with cd.Loader(pipeline, backend=served, hosts=hosts, state=state) as loader:
                again = read(loader, STEPS - RESUME_AT)
            assert_host_by_host([e[RESUME_AT:] for e in expected], again, f"{hosts} served sidecar(s), resumed")
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(30)


def unseeded(shard: grain.sharding.ShardOptions) -> grain.MapDataset:
    """A dataset that gives other rows each time it is made (a random source without a seed)."""
    start = int.from_bytes(os.urandom(2), "little")
    return grain.MapDataset.range(start, start + 120).map(lambda i: {"x": np.int64(i)}).batch(12 // shard.shard_count)


def test_colo_data_verify_and_bench_take_a_grain_config(paths: list[str], tmp_path: Path) -> None:
    """verify passes a deterministic Grain config and fails one that is not; bench reads a
    Grain config to its end and reports its steps and its hosts' stages."""
    (tmp_path / "grain_verify.py").write_text(
        "import functools, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import colo_data as cd\nimport grain_pipelines as gp\nimport test_grain_pipeline as t\n\n"
        "def good(paths):\n"
        "    return cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)\n\n"
        "def bad():\n"
        "    return cd.GrainPipeline(make_dataset=t.unseeded, global_batch_size=12)\n"
    )
    (tmp_path / "good.toml").write_text(f'pipeline = "grain_verify:good"\n[args]\npaths = {json.dumps(paths)}\n')
    (tmp_path / "bad.toml").write_text('pipeline = "grain_verify:bad"\n')

    def colo_data(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "colo_data.cli", *args]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    # the three commands side by side: each spends most of its time importing Grain and JAX on one CPU
    bench_args = ["bench", "good.toml", "--backend", "inprocess", "--hosts", "2", "--warmup", "2", "--json", "bench.json"]
    with ThreadPoolExecutor(3) as pool:
        verifies = (("good.toml", "1,5"), ("bad.toml", "1"))
        runs = [pool.submit(colo_data, "verify", config, "--hosts", hosts, "--steps", "4") for config, hosts in verifies]
        runs.append(pool.submit(colo_data, *bench_args))
        good, bad, bench = (run.result() for run in runs)
    assert good.returncode == 0, good.stdout + good.stderr[-3000:]
    for line in ("PASS  identical to Grain, 1 host(s), sidecar", "PASS  identical to Grain, 1 host(s), inprocess",
                 "PASS  resume, 1 host(s)", "SKIP  identical to Grain, 5 host(s)"):
        assert line in good.stdout, good.stdout
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    assert "FAIL  identical to Grain, 1 host(s), inprocess: batch 0, host 0, column 'x'" in bad.stdout, bad.stdout

    assert bench.returncode == 0, bench.stdout + bench.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())["colo-data"]
    ends = [sum(1 for _ in gp.maxtext_like(grain.sharding.ShardOptions(h, 2), paths)) for h in range(2)]
    assert report["steps"] == ends[0] == ends[1] > report["warmup_steps"], "bench reads the Grain dataset to its end"
    assert report["steady"]["records"] == (report["steps"] - report["warmup_steps"]) * gp.BATCH
    for host in report["hosts"]:
        transform = next(s for s in host["stages"] if s["name"] == "transform")
        assert transform["seconds"] > 0 and transform["items"] > 0, host


UNCLOSED = """
import functools, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, {tests!r})
import colo_data as cd
import grain_pipelines as gp

if __name__ == "__main__":
    make = functools.partial(gp.maxtext_like, paths={paths!r}, workers=1)
    loader = cd.Loader(cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH), backend=sys.argv[1], hosts=1)
    for i, batch in enumerate(loader):
        if i >= 3:
            break
"""


@pytest.mark.serial
@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_a_script_that_breaks_out_of_an_unclosed_grain_loader_exits_cleanly(
    paths: list[str], backend: str, tmp_path: Path
) -> None:
    """Grain's worker processes (mp_prefetch) and the sidecars stop with the script: nothing
    left running, nothing left in /dev/shm, no traceback."""
    import os

    import psutil
    from leftovers import left_behind

    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED.format(tests=str(ROOT / "tests"), paths=paths))
    before = set(os.listdir("/dev/shm"))
    process = psutil.Popen([sys.executable, str(script), backend], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    descendants: set[int] = set()
    while process.poll() is None:
        try:
            descendants |= {c.pid for c in process.children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert descendants, "the script started Grain's workers (and sidecars)"
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in descendants):
        assert time.monotonic() < deadline, f"still running: {[p for p in descendants if psutil.pid_exists(p)]}"
        time.sleep(0.1)
    left = left_behind(before, set(os.listdir("/dev/shm")))
    assert not left, f"left in /dev/shm: {sorted(left)}"


def test_make_dataset_may_be_given_positionally(paths: list[str]) -> None:
    """The dataset function is the first argument, as a native pipeline's source is."""
    make = functools.partial(gp.records_of, paths=paths)
    positional = cd.GrainPipeline(make, global_batch_size=gp.BATCH, records=True)
    assert positional == cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH, records=True)
    with cd.Loader(positional, hosts=2) as loader:
        assert to_numpy(next(loader))["tokens"].shape == (gp.BATCH, gp.LENGTH)
