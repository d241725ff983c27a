"""The data position in Orbax's emergency (multi-tier) `CheckpointManager`: two real JAX
processes, a replica each, save the loader state as a leaf of the train state
(`cd.checkpoint.state_as_array`) every step; the replica outside the primary one writes it to
its local tier, the primary one to the persistent tier. A new manager restores the latest
step from the local tier and an older one from the persistent tier, and loaders built from
both continue with exactly the batches that followed. The JSON item that the manager keeps
beside them (`dataset`) restores too, at the persistent tier's steps only; a
`ReplicatorCheckpointManager` keeps both at every step."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
from orbax.checkpoint.experimental.emergency.replicator_checkpoint_manager import ReplicatorCheckpointManager
from pipelines import make_pipeline

import colo_data as cd
from colo_data.loader import checkpoint
from colo_data.testing import assert_batches_equal, read_all

STEPS = 5  # saved, one a batch; the latest is in the local tier only
LOCAL = emergency.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2)
PERSISTENT = emergency.PersistentCheckpointOptions(save_interval_steps=3)
PERSISTENT_ONLY = 3  # a persistent step the local tier has dropped (it keeps the last 2)


def replicas_mesh() -> Mesh:
    """The manager's global mesh: replica r is process r's devices, data-parallel inside."""
    return Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("replica", "data"))


def train_state(step: int, mesh: Mesh, loader: cd.Loader) -> dict[str, jax.Array]:
    """A weight that changes every step, sharded inside each replica, and the loader state."""
    w = np.arange(8, dtype=np.float32) + step
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    return {
        "w": jax.make_array_from_callback(w.shape, sharded, lambda index: w[index]),
        "data": checkpoint.state_as_array(loader, mesh),
    }


def manager(root: Path, mesh: Mesh, abstract: Any) -> emergency.CheckpointManager:
    """The emergency manager: each process's local directory (a host's RAM disk in a real
    job), the shared persistent one, and the loader's JSON item beside it as `dataset`."""
    local = root / f"local-{jax.process_index()}"
    local.mkdir(parents=True, exist_ok=True)
    (root / "persistent").mkdir(exist_ok=True)
    return emergency.CheckpointManager(
        local,
        root / "persistent",
        mesh,
        abstract,
        options=emergency.CheckpointManagerOptions(local=LOCAL, persistent=PERSISTENT),
        persistent_non_replicated_directory=root / "dataset",
    )


def replicator(root: Path, mesh: Mesh) -> ReplicatorCheckpointManager:
    """Orbax's other multi-tier manager: the local tier only (a replicator service copies it
    out in a real job), and the loader's JSON item in a persistent directory."""
    local = root / f"replicator-{jax.process_index()}"
    local.mkdir(parents=True, exist_ok=True)
    return ReplicatorCheckpointManager(local, global_mesh=mesh, persistent_directory=root / "replicator-dataset")


def save_and_restore(args: dict[str, Any]) -> dict[str, Any]:
    """One process of the two-process job: train STEPS steps saving every one, then restore
    the latest step and PERSISTENT_ONLY with a new manager, as a restarted job does; the
    same with a `ReplicatorCheckpointManager`, its latest step."""
    multihost.initialize_distributed_to_device_ids()  # the local tier's process metadata needs it
    root, pipeline, mesh = Path(args["directory"]), make_pipeline(Path(args["corpus"])), replicas_mesh()
    saved = {}
    with cd.Loader(pipeline) as loader:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, train_state(0, mesh, loader))
        with manager(root, mesh, abstract) as mngr, replicator(root, mesh) as replicated:
            for step in range(1, STEPS + 1):
                next(loader)
                saved[step] = loader.get_state()
                items = ocp.args.Composite(
                    state=ocp.args.PyTreeSave(train_state(step, mesh, loader)), dataset=checkpoint.save_args(loader)
                )
                mngr.save(step, args=items)
                # one manager's save at a time: both finish their saves with barriers of the
                # same name ("non_replicated_..."), and two of them in flight at once clash
                mngr.wait_until_finished()
                replicated.save(step, args=items)
                replicated.wait_until_finished()
    with replicator(root, mesh) as replicated:
        state = ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        got = replicated.restore(None, args=ocp.args.Composite(state=state, dataset=checkpoint.restore_args(pipeline)))
        replicated_state = {"state": checkpoint.state_from_array(got.state["data"]), "dataset": got.dataset}
    restored = {}
    with manager(root, mesh, abstract) as mngr:
        latest = mngr.latest_step()
        for step in (latest, PERSISTENT_ONLY):
            extra = {"dataset": checkpoint.restore_args(pipeline)} if step == PERSISTENT_ONLY else {}
            got = mngr.restore(step, args=ocp.args.Composite(**extra) if extra else None)
            leaf, w = got.state["data"], np.zeros(8, np.float32)
            for shard in got.state["w"].addressable_shards:  # this process's replica holds all of w
                w[shard.index] = shard.data
            restored[step] = {
                "state": checkpoint.state_from_array(leaf),
                "leaf": [str(leaf.dtype), list(leaf.shape)],
                "w": w.tolist(),
                "dataset": got["dataset"] if extra else None,
            }
    return {"batches": [], "info": {"saved": saved, "latest": latest, "restored": restored, "replicator": replicated_state}}


def steps_in(directory: Path) -> set[int]:
    """The steps an Orbax directory holds."""
    return {int(p.name) for p in directory.iterdir() if p.name.isdigit()}


def test_two_replicas_save_the_position_in_both_tiers_and_resume_from_each(token_corpus: Path, tmp_path: Path) -> None:
    """Both processes restore the states they saved, with the train state of the same step;
    a loader built from either restored state continues the uninterrupted stream."""
    from multihost import run

    results = run(save_and_restore, 2, dict(corpus=str(token_corpus), directory=str(tmp_path)), tmp_path, devices=2)
    info = [json.loads(json.dumps(r.info)) for r in results]  # one form for both: JSON keys are strings
    assert info[0]["saved"] == info[1]["saved"], "the processes' loader states differ"
    saved = info[0]["saved"]

    # which tier each restored step came from: the latest from process 1's local tier alone
    # (process 0 is the primary replica, which writes only the persistent one), the other
    # from the persistent tier alone; the JSON item is kept at the persistent steps only
    local, persistent = steps_in(tmp_path / "local-1"), steps_in(tmp_path / "persistent")
    assert info[0]["latest"] == STEPS and STEPS in local - persistent, (local, persistent)
    assert PERSISTENT_ONLY in persistent - local, (local, persistent)
    assert not steps_in(tmp_path / "local-0") and steps_in(tmp_path / "dataset") == persistent

    pipeline = make_pipeline(token_corpus)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    for step in (STEPS, PERSISTENT_ONLY):
        for process, got in enumerate(i["restored"][str(step)] for i in info):
            where = f"step {step}, process {process}"
            assert got["state"] == saved[str(step)], where
            assert got["leaf"] == ["int32", [checkpoint.STATE_ARRAY_LENGTH]], f"{where}: the leaf came back as {got['leaf']}"
            assert got["w"] == (np.arange(8, dtype=np.float32) + step).tolist(), f"{where}: the train state"
        rest = read_all(cd.Loader(pipeline, hosts=2, state=info[0]["restored"][str(step)]["state"]))
        assert_batches_equal(reference[step:], rest, f"restored from step {step}")
    assert info[0]["restored"][str(PERSISTENT_ONLY)]["dataset"] == saved[str(PERSISTENT_ONLY)]
    for i in info:  # the replicator keeps both at every step
        assert i["replicator"] == {"state": saved[str(STEPS)], "dataset": saved[str(STEPS)]}
    assert steps_in(tmp_path / "replicator-dataset") == steps_in(tmp_path / "replicator-0") == set(range(1, STEPS + 1))


def test_state_array_round_trip_and_errors(token_corpus: Path) -> None:
    """The leaf is the state, replicated; what cannot be one, or was not made by
    `state_as_array`, is a `StateError` that says what is wrong."""
    pipeline = make_pipeline(token_corpus)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replica", "data"))
    with cd.Loader(pipeline, hosts=2) as loader:
        next(loader)
        state = loader.get_state()
        array = checkpoint.state_as_array(loader, mesh)
    assert array.shape == (checkpoint.STATE_ARRAY_LENGTH,) and array.sharding.is_fully_replicated
    assert checkpoint.state_from_array(array) == checkpoint.state_from_array(checkpoint.state_as_array(state, mesh)) == state

    with pytest.raises(cd.errors.StateError, match=f"more than the {checkpoint.STATE_ARRAY_LENGTH} a state array holds"):
        checkpoint.state_as_array({**state, "padding": "x" * checkpoint.STATE_ARRAY_LENGTH}, mesh)
    with pytest.raises(cd.errors.StateError, match="state_as_array got dict .* not a colo-data loader state"):
        checkpoint.state_as_array({"learning_rate": 0.1}, mesh)

    def bad(values: np.ndarray, spec: PartitionSpec | None = None) -> jax.Array:
        sharding = NamedSharding(mesh, spec or PartitionSpec())
        return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])

    text = np.frombuffer(json.dumps({"learning_rate": 0.1}).encode(), np.uint8).astype(np.int32)
    cases = {
        "not replicated": bad(np.asarray(array), PartitionSpec("data")),
        f"float32 ({checkpoint.STATE_ARRAY_LENGTH},)": bad(np.asarray(array).astype(np.float32)),
        "values from -1": bad(np.full(8, -1, np.int32)),
        "not JSON": bad(np.arange(60, 70, dtype=np.int32)),
        "JSON is format None": bad(text),
    }
    for message, value in cases.items():
        with pytest.raises(cd.errors.StateError, match=re.escape(message)):
            checkpoint.state_from_array(value)
    with pytest.raises(cd.errors.StateError, match="got ndarray, not the jax.Array"):
        checkpoint.state_from_array(np.asarray(array))  # type: ignore[arg-type]
