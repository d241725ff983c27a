"""The loader's checkpoint: a small JSON dict holding the global position and what the
pipeline must match to continue from it. It never depends on host or worker counts, so a
state saved on H hosts restores on any other."""

from __future__ import annotations

from typing import Any

from colo_data.errors import StateError
from colo_data.spec.pipeline import Pipeline

FORMAT = "colo-data/1"
# The global batch size is recorded but not matched: the position counts records, so a
# loader with another batch size continues the same stream (each record still once).
_MATCHED = ("seed", "order", "records", "source")


def _identity(pipeline: Pipeline) -> dict[str, Any]:
    return {
        "seed": pipeline.order.seed,
        "order": pipeline.order.describe(),
        "global_batch_size": pipeline.global_batch_size,
        "records": pipeline.records_per_epoch,
        "source": pipeline.source.fingerprint(),
    }


def make_state(pipeline: Pipeline, stream_position: int) -> dict[str, Any]:
    """The state after `stream_position` records of the stream have been delivered.

    Args:
        pipeline: the pipeline the stream comes from; its identity is saved for the check.
        stream_position: records of the stream delivered so far, over all epochs.
    """
    epoch, position = divmod(stream_position, pipeline.records_per_epoch)
    return {"format": FORMAT, "epoch": epoch, "position": position, **_identity(pipeline)}


def format_of(state: object) -> str | None:
    """The problem with `state` as a loader state of this colo-data's format, or None when
    it is one: the one place the format is checked."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict of format {FORMAT!r}"
    if state.get("format") != FORMAT:
        return f"format {state.get('format')!r}; this colo-data reads {FORMAT!r}"
    return None


def restore_position(pipeline: Pipeline, state: dict[str, Any]) -> int:
    """The stream position a state points at, after checking that it belongs to `pipeline`.

    Args:
        pipeline: the pipeline to continue.
        state: a dict that `make_state` returned (through JSON or a checkpoint).

    Raises:
        StateError: the state has another format, another pipeline saved it, or its
            position is not one of this pipeline's.
    """
    problem = format_of(state)
    if problem is not None:
        raise StateError(f"the loader state is {problem}. Pass the dict that Loader.get_state() returned.")
    ours = _identity(pipeline)
    differences = [f"{k}: state has {state.get(k)!r}, pipeline has {ours[k]!r}" for k in _MATCHED if state.get(k) != ours[k]]
    if differences:
        raise StateError(
            "the loader state was saved from a different pipeline ("
            + "; ".join(differences)
            + "). Restore it into the pipeline that saved it, or start without a state."
        )
    epoch, position = state.get("epoch"), state.get("position")
    if not (isinstance(epoch, int) and isinstance(position, int) and epoch >= 0 and 0 <= position < ours["records"]):
        raise StateError(f"loader state has epoch={epoch!r}, position={position!r}: not a position in {ours['records']} records")
    return epoch * ours["records"] + position
