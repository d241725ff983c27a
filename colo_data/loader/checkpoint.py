"""Orbax integration: the loader state as one item of an `orbax.checkpoint.CheckpointManager`
step, beside the train state.

    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), data=cd.checkpoint.save_args(loader)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=cd.checkpoint.restore_args(pipeline)))
    loader = cd.Loader(pipeline, state=restored["data"])

The item is Orbax's own `JsonCheckpointHandler` with a clearer file name and a check on
restore: one JSON file of a few hundred bytes, written by the primary process only (the
state is the same on every process), and read by every process of any later run, whatever
its host count. A state saved with plain `ocp.args.JsonSave(loader.get_state())` restores too.

Orbax's emergency (multi-tier) `CheckpointManager` keeps one item in its fast local tier, a
PyTree of arrays: there the state travels as a leaf of the train state,
`state_as_array(loader, mesh)`, read back with `state_from_array`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from colo_data.errors import ConfigError, StateError
from colo_data.loader.loader import Loader
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.state import restore
from colo_data.pipeline.state_format import format_of

STATE_FILE = "loader_state.json"
_ORBAX_JSON_FILE = "metadata"  # where a plain ocp.args.JsonSave item keeps its dict
# Bytes of JSON a state array holds. A native pipeline's state takes about 150 to 600, a Grain
# pipeline's about 100 more per host. Fixed, so that a restarted job's abstract train state
# (made before any state is restored) has the shape of the saved one.
STATE_ARRAY_LENGTH = 4096


class LoaderStateHandler(ocp.handlers.JsonCheckpointHandler):
    """Saves a loader state as one JSON file (`STATE_FILE`) on the primary process
    (`multiprocessing_options.primary_host`, process 0 by default) and restores it on every
    process, checked: a directory that holds no colo-data state, or a state of another
    pipeline, is a `StateError` naming the checkpoint item."""

    def __init__(
        self,
        filename: str = STATE_FILE,
        *,
        multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
    ) -> None:
        super().__init__(filename, multiprocessing_options=multiprocessing_options or ocp.options.MultiprocessingOptions())

    def restore(self, directory: epath.Path, item: Any = None, args: LoaderStateRestore | None = None) -> dict[str, Any]:
        del item
        path = directory / self._filename
        if not path.exists() and (directory / _ORBAX_JSON_FILE).exists():
            path = directory / _ORBAX_JSON_FILE
        if not path.exists():
            found = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
            raise StateError(
                f"checkpoint item {directory} holds no colo-data loader state (no {self._filename}; it has "
                f"{', '.join(found) or 'nothing'}). Restore this item with the args it was saved with "
                "(ocp.args.StandardRestore for a train state, say), and save loader states with "
                "cd.checkpoint.save_args(loader)."
            )
        try:
            state = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StateError(f"{path} is not JSON ({e}): it was not written by cd.checkpoint.save_args") from e
        problem = format_of(state)
        if problem is not None:
            raise StateError(
                f"checkpoint item {directory}: {path.name} is {problem}: not a colo-data loader state. Restore this "
                "item with the args it was saved with, and save loader states with cd.checkpoint.save_args(loader)."
            )
        pipeline = args.pipeline if args is not None else None
        if pipeline is not None:
            try:
                saved = state.get("hosts")  # a Grain pipeline's state is checked on the host count that saved it
                restore(pipeline, state, len(saved) if isinstance(saved, list) and saved else 1)
            except StateError as e:
                raise StateError(f"checkpoint item {directory}: {e}") from None
        return state


@ocp.args.register_with_handler(LoaderStateHandler, for_save=True)
@dataclasses.dataclass
class LoaderStateSave(ocp.args.CheckpointArgs):
    """Save args of a loader state item; build them with `save_args(loader)`."""

    item: dict[str, Any]


@ocp.args.register_with_handler(LoaderStateHandler, for_restore=True)
@dataclasses.dataclass
class LoaderStateRestore(ocp.args.CheckpointArgs):
    """Restore args of a loader state item; build them with `restore_args(pipeline)`.
    With a `pipeline` the restored state is also checked against it."""

    pipeline: AnyPipeline | None = None


def save_args(loader: Loader | dict[str, Any]) -> LoaderStateSave:
    """Orbax save args for the loader's state now (`loader.get_state()`, or a state dict),
    to put in an `ocp.args.Composite` beside the train state. The state is taken at this
    call, so the loader may run on while an async save is written."""
    return LoaderStateSave(_state_of(loader, "save_args"))


def _state_of(loader: Loader | dict[str, Any], caller: str) -> dict[str, Any]:
    """The loader's state now, or the state dict given, checked to be a loader state."""
    state = loader.get_state() if isinstance(loader, Loader) else loader
    if format_of(state) is not None:
        raise StateError(
            f"cd.checkpoint.{caller} got {type(state).__name__} {state!r:.80}, not a colo-data loader state: "
            "pass the Loader, or the dict its get_state() returned"
        )
    return dict(state)


def restore_args(pipeline: AnyPipeline | Loader | None = None) -> LoaderStateRestore:
    """Orbax restore args for a loader state item; the restored value is the state dict,
    for `cd.Loader(pipeline, state=...)` or `loader.set_state(...)`. Given the pipeline (or
    the loader) it restores into, a state of another pipeline fails already at restore,
    with a message that names the checkpoint item."""
    if isinstance(pipeline, Loader):
        pipeline = pipeline.pipeline
    if pipeline is not None and not isinstance(pipeline, AnyPipeline):
        raise ConfigError(
            f"cd.checkpoint.restore_args: pipeline={pipeline!r:.80} is not a cd.Pipeline, cd.GrainPipeline or cd.Loader"
        )
    return LoaderStateRestore(pipeline)


def state_as_array(loader: Loader | dict[str, Any], mesh: Mesh) -> jax.Array:
    """The loader's state now (or a state dict) as a leaf for a train state: its JSON, a
    byte an element, zero-padded to `STATE_ARRAY_LENGTH`, replicated on `mesh` (the
    checkpoint manager's global mesh). For managers whose fast tier keeps only a PyTree of
    arrays, as Orbax's emergency `CheckpointManager` does: the state is then saved, and
    restored from whichever tier holds the step, with the train state. int32 and not uint8:
    that manager's restore broadcasts by summing over replicas, which widens smaller
    integers, and the restored train state would no longer match its abstract state.

    Raises:
        StateError: not a loader state, or one longer than `STATE_ARRAY_LENGTH` bytes.
    """
    state = _state_of(loader, "state_as_array")
    data = json.dumps(state, separators=(",", ":")).encode()  # ASCII: no byte is 0, the padding
    if len(data) > STATE_ARRAY_LENGTH:
        raise StateError(
            f"cd.checkpoint.state_as_array: the loader state is {len(data)} bytes of JSON, more than the "
            f"{STATE_ARRAY_LENGTH} a state array holds (a Grain pipeline's state grows with its hosts, a cd.Mix's with its "
            "components). Save it as "
            "an item of its own, cd.checkpoint.save_args(loader), in the manager's persistent tier instead."
        )
    padded = np.zeros(STATE_ARRAY_LENGTH, np.int32)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    return jax.make_array_from_callback(padded.shape, NamedSharding(mesh, PartitionSpec()), lambda index: padded[index])


def state_from_array(array: jax.Array) -> dict[str, Any]:
    """The loader state in an array that `state_as_array` made (restored from a checkpoint),
    for `cd.Loader(pipeline, state=...)` or `loader.set_state(...)`. It reads this process's
    copy, so it works where the array also spans other processes' devices.

    Raises:
        StateError: the array is not one that `state_as_array` made; the message says what
            is wrong with it.
    """
    what = "cd.checkpoint.state_from_array"
    if not isinstance(array, jax.Array):
        raise StateError(f"{what} got {type(array).__name__}, not the jax.Array that cd.checkpoint.state_as_array made")
    shards = array.addressable_shards
    if not shards or shards[0].data.shape != array.shape:
        raise StateError(
            f"{what}: the array {array.shape} is not replicated on this process's devices ({array.sharding}); "
            "cd.checkpoint.state_as_array makes a replicated one: restore it with the sharding it was saved with"
        )
    values = np.asarray(shards[0].data)
    if values.ndim != 1 or values.dtype.kind not in "iu" or (values.size and (values.min() < 0 or values.max() > 255)):
        raise StateError(
            f"{what}: the array is {values.dtype} {values.shape} with values from {values.min(initial=0)} to "
            f"{values.max(initial=0)}, not the 1-D array of bytes cd.checkpoint.state_as_array makes: restore the "
            "train state's leaf that holds the loader state"
        )
    data = values.astype(np.uint8).tobytes().rstrip(b"\0")
    try:
        state = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"{what}: the array's bytes are not JSON ({e}): it was not made by cd.checkpoint.state_as_array") from e
    problem = format_of(state)
    if problem is not None:
        raise StateError(f"{what}: the array's JSON is {problem}: not a colo-data loader state")
    return state
