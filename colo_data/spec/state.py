"""The loader's checkpoint: a small JSON dict holding the global position and what the
pipeline must match to continue from it. It never depends on host or worker counts, so a
state saved on H hosts restores on any other. What a state holds is the pipeline's
stream's to say (`colo_data.spec.stream`); a Grain pipeline's is one per host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colo_data.errors import StateError
from colo_data.spec.grain_pipeline import GrainPipeline
from colo_data.spec.order import Position
from colo_data.spec.state_format import FORMAT, format_of

if TYPE_CHECKING:
    from colo_data.spec.pipeline import Pipeline

def make_state(
    pipeline: Pipeline | GrainPipeline, stream_position: Position, hosts: int = 1, host_states: dict[int, Any] | None = None
) -> dict[str, Any]:
    """The state after `stream_position` records of the stream have been delivered.

    Args:
        pipeline: the pipeline the stream comes from; its identity is saved for the check.
        stream_position: records of the stream delivered so far, over all epochs (a
            partitioned pipeline: each partition's own records).
        hosts: the host count (a Grain pipeline's state is one per host).
        host_states: a Grain pipeline's host states at the last batch delivered.
    """
    if isinstance(pipeline, GrainPipeline):  # the one place the two kinds' states part
        return {"format": FORMAT, **pipeline.state_at(int(stream_position), hosts, host_states or {})}
    return pipeline.stream.state(pipeline, stream_position)


def restore(
    pipeline: Pipeline | GrainPipeline, state: dict[str, Any], hosts: int = 1
) -> tuple[Pipeline | GrainPipeline, Position]:
    """The pipeline to continue with and the stream position a state points at. For a
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
    if isinstance(pipeline, GrainPipeline):
        return pipeline.resumed(state, hosts)
    return pipeline.stream.restore(pipeline, state)


def restore_position(pipeline: Pipeline, state: dict[str, Any]) -> Position:
    """The stream position a state points at, after checking that it belongs to `pipeline`
    (as `restore`)."""
    return restore(pipeline, state)[1]
