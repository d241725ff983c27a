"""Orbax integration: the loader state saved beside a train state in a real
`CheckpointManager` and restored into another host count and mesh; one small file, written
by the primary process only (also with two real JAX processes); clear errors for items
that are not loader states."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import colo_data as cd
from colo_data.loader import checkpoint
from colo_data.testing import assert_batches_equal, read_all, to_numpy

from pipelines import make_pipeline

SAVED_STEPS = (1, 2, 3)


def train_state(step: int, mesh: Mesh) -> dict[str, jax.Array]:
    """A small train state that changes every step: a weight sharded over the mesh's data
    axis, a replicated bias and the step counter."""
    w = np.arange(16, dtype=np.float32).reshape(8, 2) + step
    b = np.full(3, step / 10, dtype=np.float32)
    sharded, replicated = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
    return {
        "params": {
            "w": jax.make_array_from_callback(w.shape, sharded, lambda index: w[index]),
            "b": jax.make_array_from_callback(b.shape, replicated, lambda index: b[index]),
        },
        "step": jax.make_array_from_callback((), replicated, lambda index: np.int32(step)),
    }


def abstract_train_state(mesh: Mesh) -> dict:
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)),
        train_state(0, mesh),
    )


def mesh_of(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("data",))


def save_run(directory: Path, pipeline: cd.Pipeline, hosts: int | None = None, mesh: Mesh | None = None) -> list[dict]:
    """Train for SAVED_STEPS[-1] steps, saving train and loader state after each (async, as
    a trainer would: the loader runs on while a step is written). Returns the states saved."""
    states = []
    with ocp.CheckpointManager(directory) as mngr, cd.Loader(pipeline, hosts=hosts, mesh=mesh) as loader:
        for step in SAVED_STEPS:
            next(loader)
            args = checkpoint.save_args(loader)
            states.append(args.item)
            state = train_state(step, loader.mesh)
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=args))
        mngr.wait_until_finished()
    return states


def restore_into(directory: Path, step: int | None, pipeline: cd.Pipeline, mesh: Mesh) -> tuple[dict, dict]:
    """Restore a step (the latest when None) with a new manager, as a restarted job does."""
    with ocp.CheckpointManager(directory) as mngr:
        step = mngr.latest_step() if step is None else step
        restored = mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_train_state(mesh)), data=checkpoint.restore_args(pipeline)
            ),
        )
    return restored["state"], restored["data"]


def assert_train_state(restored: dict, step: int, mesh: Mesh) -> None:
    want = train_state(step, mesh)
    for path, got in jax.tree_util.tree_leaves_with_path(restored):
        expected = dict(jax.tree_util.tree_leaves_with_path(want))[path]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=f"train state {path}")
        assert got.sharding.mesh.devices.size == mesh.devices.size, f"{path} restored onto {got.sharding}"


def assert_one_small_file(item: Path, state: dict) -> None:
    """The loader item is one JSON file (beside Orbax's commit marker), the saved state,
    well under 512 bytes: no per-process files."""
    files = sorted(p.name for p in item.rglob("*"))
    assert set(files) - {"commit_success.txt"} == {checkpoint.STATE_FILE}, files
    written = item / checkpoint.STATE_FILE
    assert written.stat().st_size < 512, written.stat().st_size
    assert json.loads(written.read_text()) == state


@pytest.mark.parametrize(
    "saved_hosts, saved_devices, restored_hosts, restored_devices", [(1, 4, 4, 2), (4, 4, 2, 2), (2, 2, 3, 4)]
)
def test_round_trip_into_another_host_count(
    token_corpus: Path, tmp_path: Path, saved_hosts: int, saved_devices: int, restored_hosts: int, restored_devices: int
) -> None:
    pipeline = make_pipeline(token_corpus)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    saved_mesh, restored_mesh = mesh_of(saved_devices), mesh_of(restored_devices)
    states = save_run(tmp_path, pipeline, saved_hosts, saved_mesh)

    for step, state in zip(SAVED_STEPS, states):
        assert_one_small_file(tmp_path / str(step) / "data", state)

    for step in (None, 2):  # the latest, and an earlier step that a later save must not have touched
        state, loader_state = restore_into(tmp_path, step, make_pipeline(token_corpus), restored_mesh)
        at = SAVED_STEPS[-1] if step is None else step
        assert_train_state(state, at, restored_mesh)
        assert loader_state == states[at - 1]
        rest = read_all(cd.Loader(make_pipeline(token_corpus), hosts=restored_hosts, mesh=restored_mesh, state=loader_state))
        assert_batches_equal(reference[at:], rest, f"saved on {saved_hosts} hosts at step {at}, restored on {restored_hosts}")

    # set_state on a running loader continues the same way
    with cd.Loader(pipeline, hosts=restored_hosts, mesh=restored_mesh) as loader:
        next(loader)
        loader.set_state(loader_state)
        assert_batches_equal(reference[2:4], [to_numpy(next(loader)) for _ in range(2)], "set_state")


def test_restore_without_args_finds_the_loader_state(token_corpus: Path, tmp_path: Path) -> None:
    """A new manager restoring everything knows the item's handler from the checkpoint."""
    pipeline = make_pipeline(token_corpus)
    states = save_run(tmp_path, pipeline, 2, mesh_of(4))
    with ocp.CheckpointManager(tmp_path) as mngr:
        assert mngr.restore(mngr.latest_step())["data"] == states[-1]


def test_only_the_primary_process_writes(token_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with cd.Loader(make_pipeline(token_corpus), hosts=2) as loader:
        next(loader)
        args = checkpoint.save_args(loader)
    for process, directory in ((1, tmp_path / "other"), (0, tmp_path / "primary")):
        directory.mkdir()
        monkeypatch.setattr(jax, "process_index", lambda: process)
        checkpoint.LoaderStateHandler().save(directory, args=args)
    assert not list((tmp_path / "other").iterdir()), "a non-primary process wrote the loader state"
    assert json.loads((tmp_path / "primary" / checkpoint.STATE_FILE).read_text()) == args.item


def test_items_that_are_not_this_pipelines_loader_state_are_refused(token_corpus: Path, tmp_path: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    save_run(tmp_path, pipeline, 1, mesh_of(4))
    with ocp.CheckpointManager(tmp_path / "json") as mngr:
        mngr.save(1, args=ocp.args.Composite(data=ocp.args.JsonSave({"learning_rate": 0.1})))

    with ocp.CheckpointManager(tmp_path) as mngr, pytest.raises(cd.errors.StateError) as e:
        mngr.restore(3, args=ocp.args.Composite(state=checkpoint.restore_args(pipeline)))
    message = str(e.value)
    assert str(tmp_path / "3" / "state") in message and "no colo-data loader state" in message
    assert "StandardRestore" in message and "cd.checkpoint.save_args(loader)" in message

    with ocp.CheckpointManager(tmp_path / "json") as mngr, pytest.raises(cd.errors.StateError) as e:
        mngr.restore(1, args=ocp.args.Composite(data=checkpoint.restore_args()))
    assert str(tmp_path / "json" / "1" / "data") in str(e.value) and "not a colo-data loader state" in str(e.value)

    other = make_pipeline(token_corpus, shuffle="global")
    with ocp.CheckpointManager(tmp_path) as mngr, pytest.raises(cd.errors.StateError) as e:
        mngr.restore(3, args=ocp.args.Composite(data=checkpoint.restore_args(cd.Loader(other))))
    message = str(e.value)
    assert str(tmp_path / "3" / "data") in message and "different pipeline" in message and "order" in message

    (tmp_path / "3" / "data" / checkpoint.STATE_FILE).write_text("{not json")
    with ocp.CheckpointManager(tmp_path) as mngr, pytest.raises(cd.errors.StateError, match="is not JSON"):
        mngr.restore(3, args=ocp.args.Composite(data=checkpoint.restore_args()))


def test_a_damaged_state_in_an_item_is_a_state_error_that_names_the_item(token_corpus: Path, tmp_path: Path) -> None:
    """A loader state item whose order names 0 partitions, or whose partition positions hold
    a float count, restored with the pipeline: a StateError that names the checkpoint item
    and the state's field, where a raw ZeroDivisionError or OverflowError came through."""
    padded = make_pipeline(token_corpus, epochs=None)  # it chooses its partitions: 12
    packed = make_pipeline(token_corpus, "none", transforms=[], pack=cd.Pack("tokens", 16), partitions=4, epochs=None)
    with cd.Loader(padded) as loader:
        next(loader)
        zero = {**loader.get_state(), "order": "block:2/0x1 dealt"}
    with cd.Loader(packed) as loader:
        next(loader)
        state = loader.get_state()
        floating = {**state, "parts": {**state["parts"], "count": 1e30}}
    for step, (pipeline, damaged, match) in enumerate(
        [(padded, zero, r"order 'block:2/0x1 dealt' names 0 partitions"), (packed, floating, r"count=1e\+30: not an int")]
    ):
        with ocp.CheckpointManager(tmp_path) as mngr:
            mngr.save(step, args=ocp.args.Composite(data=checkpoint.save_args(damaged)))
        with ocp.CheckpointManager(tmp_path) as mngr, pytest.raises(cd.errors.StateError, match=match) as e:
            mngr.restore(step, args=ocp.args.Composite(data=checkpoint.restore_args(pipeline)))
        assert str(e.value).startswith(f"checkpoint item {tmp_path / str(step) / 'data'}: "), e.value


def test_a_state_saved_as_plain_json_restores(token_corpus: Path, tmp_path: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    with ocp.CheckpointManager(tmp_path) as mngr, cd.Loader(pipeline, hosts=4) as loader:
        for _ in range(2):
            next(loader)
        state = loader.get_state()
        mngr.save(2, args=ocp.args.Composite(data=ocp.args.JsonSave(state)))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(2, args=ocp.args.Composite(data=checkpoint.restore_args(pipeline)))["data"]
    assert restored == state
    rest = read_all(cd.Loader(pipeline, hosts=1, state=restored), 2)
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=2))[2:4], rest, "restored from ocp.args.JsonSave")


def test_bad_arguments() -> None:
    with pytest.raises(cd.errors.StateError, match="not a colo-data loader state"):
        checkpoint.save_args({"learning_rate": 0.1})
    with pytest.raises(cd.errors.ConfigError, match="not a cd.Pipeline, cd.GrainPipeline or cd.Loader"):
        checkpoint.restore_args("pipeline.toml")


def test_two_processes_save_one_restores(token_corpus: Path, tmp_path: Path) -> None:
    """Two real JAX processes (gloo collectives, 2 CPU devices each) train and save with
    one CheckpointManager; this single process restores the latest step on 3 hosts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, __file__, str(port), str(token_corpus), str(tmp_path)]
    processes = [
        subprocess.Popen([*command, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = []
    try:
        for p in processes:
            outputs.append(p.communicate(timeout=60)[0])
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    states = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert states[0] == states[1], "the processes' loader states differ"

    assert_one_small_file(tmp_path / str(SAVED_STEPS[-1]) / "data", states[0])
    assert len(list((tmp_path / str(SAVED_STEPS[-1]) / "state").glob("ocdbt.process_*"))) == 2  # unlike the train state

    pipeline = make_pipeline(token_corpus)
    mesh = mesh_of(4)
    state, loader_state = restore_into(tmp_path, None, pipeline, mesh)
    assert_train_state(state, SAVED_STEPS[-1], mesh)
    rest = read_all(cd.Loader(pipeline, hosts=3, mesh=mesh, state=loader_state))
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1))[SAVED_STEPS[-1] :], rest, "saved by 2 processes")


def _save_from_process(port: str, corpus: str, directory: str, process_id: str) -> None:
    """One process of the two-process run: 2 hosts (one per process), the global mesh."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id), initialization_timeout=30)
    assert jax.process_count() == 2 and jax.device_count() == 4
    states = save_run(Path(directory), make_pipeline(Path(corpus)))  # 2 hosts, all 4 devices: the defaults
    print(json.dumps(states[-1]), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _save_from_process(*sys.argv[1:])
