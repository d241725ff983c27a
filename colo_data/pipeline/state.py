"""The loader's checkpoint: a small JSON dict holding the global position and what the
pipeline must match to continue from it. It never depends on host or worker counts, so a
state saved on H hosts restores on any other. What a state holds is the pipeline's
stream's to say (`colo_data.pipeline.stream`); a Grain pipeline's is one per host. Each kind
of pipeline answers for its own state (`colo_data.pipeline.kinds.PipelineKind`)."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from colo_data.errors import StateError
from colo_data.pipeline.kinds import PipelineKind
from colo_data.pipeline.order import Position
from colo_data.pipeline.state_format import format_of

Kind = TypeVar("Kind", bound=PipelineKind)


def make_state(
    pipeline: PipelineKind,
    position: Position,
    hosts: int = 1,
    host_states: dict[int, Any] | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """The state after `position` records of the stream have been delivered.

    Args:
        pipeline: the pipeline the stream comes from; its identity is saved for the check.
        position: records of the stream delivered so far, over all epochs (a
            partitioned pipeline: each partition's own records).
        hosts: the host count (a Grain pipeline's state is one per host).
        host_states: a Grain pipeline's host states at the last batch delivered.
        step: global batches delivered since the stream's start, which `cd.lineage`
            counts steps by; None when not known (left out).
    """
    state = pipeline.state_at(position, hosts, host_states or {})
    return state if step is None else {**state, "step": step}


def state_step(pipeline: PipelineKind, state: dict[str, Any] | None, position: Position) -> int | None:
    """Global batches delivered from the stream's start up to `state` (None: the start, 0),
    which restored to `position`. A state that records none (saved before colo-data
    counted steps): a padded or Grain pipeline's position over the batch size it was saved
    with, when it is this pipeline's; otherwise None (not known).

    Raises:
        StateError: the state's `step` is not a non-negative int.
    """
    if state is None:
        return 0
    if "step" in state:
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"the loader state has step={step!r}: not a count of global batches (an int >= 0)")
        return step
    size = pipeline.global_batch_size
    variable = pipeline.variable_batches
    if variable or isinstance(position, np.ndarray) or state.get("global_batch_size") != size or int(position) % size:
        return None
    return int(position) // size


def restore(pipeline: Kind, state: dict[str, Any], hosts: int = 1) -> tuple[Kind, Position]:
    """The pipeline to continue with and the position a state points at. For a
    `cd.Mix` the pipeline is rebased so that every component continues where the state
    left it: in the same interleaving under the same weights, and from there on under new
    ones; a Grain pipeline carries each host's Grain state to continue from.

    Args:
        pipeline: the pipeline to continue.
        state: a dict that `make_state` returned (through JSON or a checkpoint).
        hosts: the host count it continues on.

    Raises:
        StateError: the state has another format, another pipeline saved it, or its
            position is not one of this pipeline's; for a mixture also a component added,
            removed or whose data changed, named.
    """
    problem = format_of(state)
    if problem is not None:
        raise StateError(f"the loader state is {problem}. Pass the dict that Loader.get_state() returned.")
    return pipeline.resumed(state, hosts)


def restore_position(pipeline: PipelineKind, state: dict[str, Any]) -> Position:
    """The position a state points at, after checking that it belongs to `pipeline`
    (as `restore`)."""
    return restore(pipeline, state)[1]
