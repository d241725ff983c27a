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
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from colo_data.errors import ConfigError, StateError
from colo_data.loader.loader import Loader
from colo_data.spec.kinds import AnyPipeline
from colo_data.spec.state import restore
from colo_data.spec.state_format import format_of

STATE_FILE = "loader_state.json"
_ORBAX_JSON_FILE = "metadata"  # where a plain ocp.args.JsonSave item keeps its dict


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

    def restore(
        self, directory: epath.Path, item: Any = None, args: LoaderStateRestore | None = None
    ) -> dict[str, Any]:
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
    state = loader.get_state() if isinstance(loader, Loader) else loader
    if format_of(state) is not None:
        raise StateError(
            f"cd.checkpoint.save_args got {type(state).__name__} {state!r:.80}, not a colo-data loader state: "
            "pass the Loader, or the dict its get_state() returned"
        )
    return LoaderStateSave(dict(state))


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
