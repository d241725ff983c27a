"""Multi-controller JAX for real: 2 and 3 `jax.distributed` processes on this machine (CPU,
gloo, 2 CPU devices each), each process's Loader driving only its own host's pipeline. The
rows each process holds, merged, must be the single-process run's batches row for row, and
a checkpoint taken by 3 processes must resume with 2, every record delivered once.

Each group of processes runs under a time limit (`multihost.run`); JAX start-up costs a few
seconds per process, so the runs are few and short."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import psutil
import pytest
from jax.sharding import Mesh, PartitionSpec

import colo_data as cd
from colo_data.host.chunk import HostChunk
from colo_data.host.host_pipeline import HostPipeline
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.pipeline.state import make_state
from colo_data.testing import assert_batches_equal, read_all

from multihost import Result, merge, record, run
from pipelines import BATCH, backend_of, make_pipeline

RECORDS = 120
TIMEOUT_S = 120.0

_reference: dict[str, list[dict[str, np.ndarray]]] = {}


def reference(corpus: Path) -> list[dict[str, np.ndarray]]:
    """The epoch as one process (this one, 4 CPU devices) reads it."""
    if "epoch" not in _reference:
        _reference["epoch"] = read_all(cd.Loader(make_pipeline(corpus)))
        assert len(_reference["epoch"]) == RECORDS // BATCH
    return _reference["epoch"]


def _mesh(kind: str) -> tuple[Mesh | None, PartitionSpec | None]:
    devices = np.array(jax.devices())
    if kind == "data":
        return None, None  # the Loader's default: every device on one "data" axis
    if kind == "reversed":  # the last process's devices hold the first rows
        return Mesh(devices[::-1], ("data",)), None
    if kind == "data-model":  # both devices of a process on the model axis: they share a batch shard
        return Mesh(devices.reshape(-1, 2), ("data", "model")), PartitionSpec("data")
    raise ValueError(kind)


def read_loader(args: dict[str, Any]) -> dict[str, Any]:
    """The worker: one process's Loader over `make_pipeline(corpus)`, `steps` batches (all
    when None), optionally from a saved state; process 0 saves the state afterwards. It
    notes which host pipelines this process drove (in process or through sidecars)."""
    driven: list[list[int]] = []
    host_chunks, sidecar_batches = HostPipeline.chunks, SidecarClient.batches

    def spy_host(self: HostPipeline, start_position: int, *rest: Any, **named: Any) -> Iterator[HostChunk]:
        driven.append([self.host, self.hosts])
        return host_chunks(self, start_position, *rest, **named)

    def spy_sidecar(self: SidecarClient, pipeline: cd.Pipeline, host: int, hosts: int, *rest: Any) -> Iterator[HostChunk]:
        driven.append([host, hosts])
        return sidecar_batches(self, pipeline, host, hosts, *rest)

    HostPipeline.chunks, SidecarClient.batches = spy_host, spy_sidecar  # type: ignore[method-assign]
    mesh, spec = _mesh(args["mesh"])
    state = json.loads(Path(args["state"]).read_text()) if args.get("state") else None
    backend = backend_of(args["backend"], 0, args.get("shm_dir"))
    with cd.Loader(make_pipeline(Path(args["corpus"])), backend=backend, mesh=mesh, partition_spec=spec, state=state) as loader:
        batches = [record(b) for b in itertools.islice(loader, args.get("steps"))]
        state = loader.get_state()
        hosts = loader.hosts
    if args.get("save_state") and jax.process_index() == 0:
        Path(args["save_state"]).write_text(json.dumps(state))
    mesh_devices = [d.id for d in (mesh.devices.flat if mesh is not None else jax.devices())]
    return dict(batches=batches, info=dict(state=state, hosts=hosts, driven=driven, mesh_devices=mesh_devices))


def assert_own_host_only(results: list[Result], processes: int, mesh: str) -> None:
    """Each process drove one host pipeline, of `processes` hosts: the one whose place
    along the mesh's data axis its devices have."""
    for r in results:
        assert r.info["hosts"] == processes, f"process {r.process}: Loader.hosts == {r.info['hosts']}"
        order = r.info["mesh_devices"]  # the devices in mesh order; the data axis is the first
        per_host = len(order) // processes
        place = {order.index(d) // per_host for d in r.local_devices}
        assert len(place) == 1, f"process {r.process}: its devices {r.local_devices} span data-axis places {place}"
        assert r.info["driven"] == [[place.pop(), processes]], (
            f"process {r.process} (devices {r.local_devices}, mesh {mesh!r} device order {order}) drove host "
            f"pipelines [host, hosts] = {r.info['driven']}; it should drive its own host only"
        )


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private shared-memory directory for the sidecars; the test fails if a segment is left in it."""
    directory = Path(tempfile.mkdtemp(prefix="multihost-", dir="/dev/shm"))
    yield directory
    left = sorted(p.name for p in directory.iterdir())
    shutil.rmtree(directory, ignore_errors=True)
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.mark.parametrize(
    "processes, backend, mesh",
    [
        (2, "inprocess", "data"),
        (3, "inprocess", "data"),
        (2, "sidecar", "data"),
        (3, "inprocess", "data-model"),
        (2, "inprocess", "reversed"),
    ],
)
def test_global_batches_equal_single_process(
    token_corpus: Path, tmp_path: Path, shm_dir: Path, processes: int, backend: str, mesh: str
) -> None:
    expected = reference(token_corpus)
    args = dict(corpus=str(token_corpus), backend=backend, mesh=mesh, shm_dir=str(shm_dir))
    results = run(read_loader, processes, args, tmp_path, timeout=TIMEOUT_S)
    assert_batches_equal(expected, merge(results), f"{processes} processes, {backend}, mesh {mesh!r}")
    if mesh == "data-model":  # the two devices of each process hold the same rows
        for r in results:
            for step, batch in enumerate(r.batches):
                rows = {index[0] for index, _, _ in batch["_index"][2]}
                assert len(rows) == 1, f"process {r.process}, batch {step}: its devices hold rows {rows}"
    assert_own_host_only(results, processes, mesh)
    states = [r.info["state"] for r in results]
    assert all(s == states[0] for s in states), states
    assert states[0] == make_state(make_pipeline(token_corpus), len(expected) * BATCH, step=len(expected)), states[0]


def test_checkpoint_of_three_processes_resumes_with_two(token_corpus: Path, tmp_path: Path) -> None:
    expected = reference(token_corpus)
    steps = 4
    saved = tmp_path / "state.json"
    args = dict(corpus=str(token_corpus), backend="inprocess", mesh="data")
    first = run(read_loader, 3, dict(args, steps=steps, save_state=str(saved)), tmp_path, timeout=TIMEOUT_S)
    assert_own_host_only(first, 3, "data")
    before = merge(first)
    assert_batches_equal(expected[:steps], before, f"3 processes, first {steps} batches")
    state = json.loads(saved.read_text())
    assert all(r.info["state"] == state for r in first), [r.info["state"] for r in first]
    assert state["position"] == steps * BATCH, state
    assert state == cd.Loader(make_pipeline(token_corpus), state=state).get_state()

    rest = run(read_loader, 2, dict(args, state=str(saved)), tmp_path, timeout=TIMEOUT_S)
    assert_own_host_only(rest, 2, "data")
    after = merge(rest)
    assert_batches_equal(expected[steps:], after, f"2 processes resumed from the 3 processes' state {state}")
    seen = np.concatenate([b["_index"] for b in before + after])
    assert len(seen) == RECORDS - RECORDS % BATCH, f"{len(seen)} records delivered"
    values, counts = np.unique(seen, return_counts=True)
    assert values.tolist() == list(range(RECORDS)) and (counts == 1).all(), (
        f"not every record exactly once: repeated {values[counts > 1].tolist()}, "
        f"missing {sorted(set(range(RECORDS)) - set(values.tolist()))}"
    )


def loader_outside_the_mesh(args: dict[str, Any]) -> dict[str, Any]:
    """A mesh of process 0's devices only: process 1 must be told so, not get an empty stream."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    try:
        with cd.Loader(make_pipeline(Path(args["corpus"])), mesh=mesh, hosts=1) as loader:
            batches = [record(b) for b in loader]
        return dict(batches=batches, info=dict(error=None))
    except cd.errors.ConfigError as e:
        return dict(batches=[], info=dict(error=str(e)))


def test_a_process_outside_the_mesh_is_told(token_corpus: Path, tmp_path: Path) -> None:
    results = run(loader_outside_the_mesh, 2, dict(corpus=str(token_corpus)), tmp_path, timeout=TIMEOUT_S)
    by_process = {r.process: r for r in results}
    assert by_process[0].info["error"] is None and len(by_process[0].batches) == RECORDS // BATCH
    assert "process 1 holds no device of the mesh" in by_process[1].info["error"], by_process[1].info


def read_grain(args: dict[str, Any]) -> dict[str, Any]:
    """The worker: one process's Loader over the MaxText-style Grain pipeline, `steps`
    batches, the state, `more` batches; then a new Loader from that state, `more` batches."""
    import functools  # noqa: PLC0415

    import grain_pipelines as gp  # noqa: PLC0415 - Grain only in the processes of this test

    make = functools.partial(gp.maxtext_like, paths=args["paths"])
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH)
    with cd.Loader(pipeline) as loader:
        batches = [record(b) for b in itertools.islice(loader, args["steps"])]
        state = loader.get_state()
        batches += [record(b) for b in itertools.islice(loader, args["more"])]
    with cd.Loader(pipeline, state=state) as loader:
        batches += [record(b) for b in itertools.islice(loader, args["more"])]
    return dict(batches=batches, info=dict(state=state))


def test_a_grain_pipelines_state_gathers_every_processs_host(tmp_path: Path) -> None:
    """Two processes, each driving its own host of a GrainPipeline: each one's get_state()
    holds both hosts' Grain states (gathered across the processes), and resuming from it in
    both gives Grain's own batches, host by host."""
    import functools  # noqa: PLC0415

    import grain  # noqa: PLC0415
    import grain_pipelines as gp  # noqa: PLC0415

    paths = gp.write_records(tmp_path)
    steps, more = 2, 2
    results = run(read_grain, 2, dict(paths=paths, steps=steps, more=more), tmp_path, timeout=TIMEOUT_S)
    states = [r.info["state"] for r in results]
    assert states[0] == states[1], states
    assert len(states[0]["hosts"]) == 2 and all(h is not None for h in states[0]["hosts"]), states[0]
    for h, host in enumerate(states[0]["hosts"]):
        iterator = iter(gp.maxtext_like(grain.sharding.ShardOptions(h, 2), paths))
        for _ in range(steps):
            next(iterator)
        assert host["state"] == iterator.get_state(), f"host {h}'s state is not Grain's after {steps} batches"
    expected = gp.grain_batches(functools.partial(gp.maxtext_like, paths=paths), 2, steps + more)
    got = merge(results)
    rows = gp.BATCH // 2
    for i, batch in enumerate(got):
        step = i if i < steps + more else i - more  # the resumed loader's batches follow the first ones
        for h in range(2):
            for name, want in expected[h][step].items():
                np.testing.assert_array_equal(batch[name][h * rows : (h + 1) * rows], want, err_msg=f"batch {i}, host {h}, {name}")


def _partitioned(corpus: Path, epochs: int | None) -> cd.Pipeline:
    return make_pipeline(corpus, transforms=[], pack=cd.Pack("tokens", 16), partitions=4, epochs=epochs)


def read_partitioned(args: dict[str, Any]) -> dict[str, Any]:
    """A partitioned packed pipeline: `steps` batches from `state` (if given), the state
    after them (gathered from every process), and the error a finite stream gets."""
    corpus = Path(args["corpus"])
    try:
        cd.Loader(_partitioned(corpus, 2))
        refused = None
    except cd.errors.ConfigError as e:
        refused = str(e)
    with cd.Loader(_partitioned(corpus, None), state=args.get("state")) as loader:
        batches = [record(b) for b in itertools.islice(loader, args["steps"])]
        state = loader.get_state()
    return dict(batches=batches, info=dict(state=state, refused=refused))


def test_a_partitioned_pipelines_state_gathers_every_processs_partitions(token_corpus: Path, tmp_path: Path) -> None:
    """Two processes, each computing its host's 2 of 4 partitions of a packed pipeline: the
    batches are the one-process batches, each process's get_state() holds every partition's
    position (gathered), the same as one process's, and resuming from it in both continues
    exactly. A finite stream is refused: no process can know when another's partitions end."""
    pipeline = _partitioned(token_corpus, None)
    expected = read_all(cd.Loader(pipeline), 6)
    with cd.Loader(pipeline) as loader:
        for _ in range(3):
            next(loader)
        one = loader.get_state()
    first = run(read_partitioned, 2, dict(corpus=str(token_corpus), steps=3), tmp_path, timeout=TIMEOUT_S)
    assert_batches_equal(expected[:3], merge(first), "2 processes")
    assert [r.info["state"] for r in first] == [one, one]
    assert all("epochs=2 for a partitioned packed pipeline in a run of 2 processes" in r.info["refused"] for r in first)
    rest = run(read_partitioned, 2, dict(corpus=str(token_corpus), steps=3, state=one), tmp_path, timeout=TIMEOUT_S)
    assert_batches_equal(expected[3:], merge(rest), "2 processes, resumed")


# The harness itself: a failing or hanging group ends within its bounds, with every child's
# output in the message and no process left behind.


def fail_in_process_one(args: dict[str, Any]) -> dict[str, Any]:
    """Process 1 raises; the others wait for it forever (as on a collective it never joins)."""
    Path(args["pids"], str(jax.process_index())).write_text(str(os.getpid()))
    if jax.process_index() == 1:
        raise ValueError("boom from process 1")
    print("process 0 waits", flush=True)
    time.sleep(3600)
    return dict(batches=[])


def hang(args: dict[str, Any]) -> dict[str, Any]:
    """Every process waits forever."""
    Path(args["pids"], str(jax.process_index())).write_text(str(os.getpid()))
    time.sleep(3600)
    return dict(batches=[])


@pytest.mark.parametrize(
    "worker, timeout, expected",
    [(fail_in_process_one, 60, "ValueError: boom from process 1"), (hang, 8, "timed out after 8 s")],
)
def test_harness_reports_failures_and_leaves_no_process(
    tmp_path: Path, worker: Callable[[dict[str, Any]], dict[str, Any]], timeout: float, expected: str
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    started = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run(worker, 2, dict(pids=str(pids)), tmp_path, timeout=timeout, grace=1)
    message = str(raised.value)
    assert time.monotonic() - started < timeout + 10, message  # + stopping: SIGTERM, then SIGKILL
    assert expected in message and "----- process 0: exit code" in message and "----- process 1: exit code" in message, message
    if worker is fail_in_process_one:
        assert "a process failed and the others were still running" in message and "process 0 waits" in message, message
    for pid in (int(p.read_text()) for p in pids.iterdir()):
        assert not psutil.pid_exists(pid), f"process {pid} left behind"


def test_merge_finds_missing_and_disagreeing_rows() -> None:
    def held(*shards: tuple[int, int, list[int]]) -> Result:
        """A process that held `values` at global rows [start, stop) of a 4-row column."""
        return Result(0, None, [{"x": ((4,), "int32", [(((a, b),), 0, np.array(v, np.int32)) for a, b, v in shards])}], [0])

    whole = merge([held((0, 2, [5, 6])), held((2, 4, [7, 8]), (0, 2, [5, 6]))])
    np.testing.assert_array_equal(whole[0]["x"], [5, 6, 7, 8])
    with pytest.raises(AssertionError, match=r"global rows \[2, 3\] held by no device"):
        merge([held((0, 2, [5, 6]))])
    with pytest.raises(AssertionError, match=r"holds other values .* for rows \[1\]"):
        merge([held((0, 2, [5, 6]), (2, 4, [7, 8])), held((0, 2, [5, 9]))])
