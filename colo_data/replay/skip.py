"""`skip`: the loader state some global batches after a saved one, without producing them,
for the loss-spike recipe (go back to a checkpoint, leave out the batches around the spike,
go on). A padded pipeline's batches each take `global_batch_size` records of the stream, so
its skip is arithmetic; a packed or filtered pipeline's take as many records as fit or as
`keep` passes, so its skip plans those batches (reading and preparing their records, on
one host, in this process) and keeps only the position after them."""

from __future__ import annotations

from typing import Any

from colo_data.errors import ConfigError
from colo_data.host.host_pipeline import HostPipeline
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position
from colo_data.pipeline.state import make_state, restore, state_step
from colo_data.pipeline.state_format import MAX_POSITION
from colo_data.runtime.prefetch import close_iterator
from colo_data.setting_checks import int_setting


def skip(pipeline: Pipeline, state: dict[str, Any] | None, batches: int) -> dict[str, Any]:
    """The state `batches` global batches after `state` (None: the stream's start): a
    `cd.Loader(pipeline, state=skip(...))` yields what a loader from `state` would have
    yielded from its batch `batches` on, on any host count, and whose `step` counts the
    skipped batches (so `cd.lineage` numbers what follows as the original run would). A
    mixture's components are skipped in their schedule's order, so their shares stay exact.

    Raises:
        ConfigError: `batches` is negative, or more than the stream has left after `state`
            (a finite stream), or the pipeline is a `cd.GrainPipeline` (its position is its
            iterators' own).
        StateError: `state` is not one of `pipeline`'s (as `cd.Loader(state=)`).
    """
    if not isinstance(pipeline, AnyPipeline) or not pipeline.positional:
        raise ConfigError(
            f"cd.skip takes a cd.Pipeline, not {type(pipeline).__name__}: a Grain pipeline's position is its "
            "iterators' state; skip its batches by reading them (next(loader)) and save the state after them"
        )
    batches = int_setting("batches", batches, 0, "the global batches to skip")
    if state is None:
        position: Position = pipeline.at(0)
    else:
        pipeline, position = restore(pipeline, state)
    step = state_step(pipeline, state, position)
    if batches and pipeline.variable_batches:
        position = _variable_after(pipeline, position, batches)
    elif batches:
        position = _after(pipeline, position, batches)
    return make_state(pipeline, position, step=None if step is None else step + batches)


def _after(pipeline: Pipeline, position: Position, batches: int) -> int:
    """The position `batches` padded batches after `position`."""
    left = pipeline.batches_from(int(position))
    if left is not None and batches > left:
        raise _past_the_end(batches, left)
    return reachable(pipeline, int(position), batches, f"batches={batches}", "skip fewer")


def reachable(pipeline: Pipeline, position: int, batches: int, asked: str, instead: str) -> int:
    """The position `batches` padded global batches after `position`, which
    `cd.skip` gives a state at and `cd.lineage` names a step from: a ConfigError that names
    what was `asked` and says what to do `instead` where it passes `MAX_POSITION` (the
    int64 arithmetic of the records' positions past it wraps round to other records)."""
    after = position + batches * pipeline.global_batch_size
    if after > MAX_POSITION:
        raise ConfigError(
            f"{asked}: {batches:,} global batches of {pipeline.global_batch_size} records from position "
            f"{position:,} take the stream to record {after:,}, past the 2**62 that a position may reach; {instead}"
        )
    return after


def _variable_after(pipeline: Pipeline, position: Position, batches: int) -> Position:
    """The position after `batches` packed or filtered batches from `position`, planned
    here as one host plans them all (the position does not depend on the host count)."""
    chunks = HostPipeline(pipeline).chunks(position, batches=1)
    try:
        for made in range(batches):
            chunk = next(chunks, None)
            if chunk is None:
                raise _past_the_end(batches, made)
            assert chunk.end is not None
            position = chunk.end
    finally:
        close_iterator(chunks)
    return position


def _past_the_end(batches: int, left: int) -> ConfigError:
    return ConfigError(
        f"batches={batches}: the stream has only {left} more global batches after this state (epochs are finite); "
        "skip fewer, or give the pipeline more epochs (epochs=None repeats forever)"
    )
