"""The loader's checkpoint: a small JSON dict holding the global position and what the
pipeline must match to continue from it. It never depends on host or worker counts, so a
state saved on H hosts restores on any other."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from colo_data.errors import StateError
from colo_data.spec.grain_pipeline import GrainPipeline
from colo_data.spec.mix import DENOMINATOR, Mix, schedule
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


def make_state(
    pipeline: Pipeline | GrainPipeline, stream_position: int, hosts: int = 1, host_states: dict[int, Any] | None = None
) -> dict[str, Any]:
    """The state after `stream_position` records of the stream have been delivered.

    Args:
        pipeline: the pipeline the stream comes from; its identity is saved for the check.
        stream_position: records of the stream delivered so far, over all epochs.
        hosts: the host count (a Grain pipeline's state is one per host).
        host_states: a Grain pipeline's host states at the last batch delivered.
    """
    if isinstance(pipeline, GrainPipeline):  # the one place the two kinds' states part
        return {"format": FORMAT, **pipeline.state_at(stream_position, hosts, host_states or {})}
    if isinstance(pipeline.source, Mix):
        return _mix_state(pipeline, pipeline.source, stream_position)
    epoch, position = divmod(stream_position, pipeline.records_per_epoch)
    return {"format": FORMAT, "epoch": epoch, "position": position, **_identity(pipeline)}


def _weights_id(mix: Mix) -> str:
    return hashlib.sha256(repr(mix.shares).encode()).hexdigest()[:8]


def _mix_state(pipeline: Pipeline, mix: Mix, stream_position: int) -> dict[str, Any]:
    """A mixture's state: the stream position, where it falls in the schedule's period
    (`phase`), and each component's name, data fingerprint and own position there."""
    order = mix.bind(pipeline.order)
    start = mix.start[0] if mix.start is not None else 0
    at = order.component_positions(stream_position)
    return {
        "format": FORMAT,
        "position": stream_position,
        "phase": (stream_position - start) % DENOMINATOR,
        "seed": pipeline.order.seed,
        "order": pipeline.order.describe(),
        "global_batch_size": pipeline.global_batch_size,
        "weights": _weights_id(mix),
        "mix": [[n, f, q] for n, f, q in zip(mix.names, mix.component_fingerprints(), at, strict=True)],
    }


def restore(
    pipeline: Pipeline | GrainPipeline, state: dict[str, Any], hosts: int = 1
) -> tuple[Pipeline | GrainPipeline, int]:
    """The pipeline to continue with and the stream position a state points at. For a
    `cd.Mix` the pipeline is rebased so that every component continues where the state
    left it: in the same interleaving under the same weights, and from there on under new
    ones; a Grain pipeline carries each host's Grain state to continue from.

    Args:
        pipeline: the pipeline to continue.
        state: a dict that `make_state` returned.
        hosts: the host count it continues on.

    Raises:
        StateError: as `restore_position`; for a mixture also a component added, removed or
            whose data changed, named.
    """
    problem = format_of(state)
    if problem is not None:
        raise StateError(f"the loader state is {problem}. Pass the dict that Loader.get_state() returned.")
    if isinstance(pipeline, GrainPipeline):
        return pipeline.resumed(state, hosts)
    if not isinstance(pipeline.source, Mix):
        return pipeline, restore_position(pipeline, state)
    mix = pipeline.source
    if "mix" not in state:
        raise StateError("the loader state was saved from a pipeline without a cd.Mix; this pipeline's source is one")
    ours = {"seed": pipeline.order.seed, "order": pipeline.order.describe()}
    differences = [f"{k}: state has {state.get(k)!r}, pipeline has {v!r}" for k, v in ours.items() if state.get(k) != v]
    saved = {entry[0]: entry for entry in state["mix"]}
    fingerprints = dict(zip(mix.names, mix.component_fingerprints(), strict=True))
    differences += [f"component {n!r} is not in the state (added?)" for n in mix.names if n not in saved]
    differences += [f"component {n!r} of the state is not in the pipeline (removed?)" for n in saved if n not in fingerprints]
    differences += [
        f"component {n!r} has other data than when the state was saved"
        for n in mix.names
        if n in saved and saved[n][1] != fingerprints[n]
    ]
    if differences:
        raise StateError(
            "the loader state does not fit this mixture (" + "; ".join(differences) + "). Restore it into the pipeline "
            "that saved it (weights may change), or start without a state."
        )
    position, phase = state.get("position"), state.get("phase")
    at = [saved[n][2] for n in mix.names]
    if not (isinstance(position, int) and isinstance(phase, int) and position >= 0 and 0 <= phase < DENOMINATOR):
        raise StateError(f"loader state has position={position!r}, phase={phase!r}: not a position of a mixture")
    if not all(isinstance(q, int) and q >= 0 for q in at):
        raise StateError(f"loader state has component positions {at!r}: each must be an int >= 0")
    if state.get("weights") == _weights_id(mix):  # the same interleaving goes on
        comp, _ = schedule(mix.shares)
        before = np.bincount(comp[:phase], minlength=len(mix.names))
        begin = [q - int(b) for q, b in zip(at, before, strict=True)]
        return pipeline.with_source(mix.rebased(position - phase, begin)), position
    return pipeline.with_source(mix.rebased(position, at)), position


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
    if isinstance(pipeline.source, Mix):
        return restore(pipeline, state)[1]
    problem = format_of(state)
    if problem is not None:
        raise StateError(f"the loader state is {problem}. Pass the dict that Loader.get_state() returned.")
    if "mix" in state:
        raise StateError("the loader state was saved from a pipeline over a cd.Mix; this pipeline's source is not one")
    if "kind" in state:
        raise StateError(
            f"the loader state was saved from a cd.GrainPipeline (kind {state['kind']!r}); this is a native cd.Pipeline: "
            "restore it into the pipeline that saved it, or start without a state"
        )
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
