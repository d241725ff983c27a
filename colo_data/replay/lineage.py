"""`lineage`: which source records made each row of given global steps, for the question a
loss spike raises (what was in step 48,211?). A padded pipeline's step N is positions
`[N*B, (N+1)*B)` bound to the order, so its lineage is arithmetic and reads no record; a
packed or filtered pipeline's steps take as many records as fit or as `keep` passes, so its
lineage plans them (reading and preparing the records from the state's position on, as one
host plans a whole batch, in this process) and keeps only each row's record names."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from colo_data.errors import ConfigError, StateError
from colo_data.host.chunk import HostChunk
from colo_data.host.host_pipeline import HostPipeline
from colo_data.pipeline.grain_pipeline import GrainPipeline
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position
from colo_data.pipeline.state import restore, state_step
from colo_data.pipeline.transforms import select
from colo_data.replay.skip import reachable
from colo_data.runtime.prefetch import close_iterator

# The index column that lineage reads records' names from when the pipeline has none of its own.
_INDEX = "_lineage_index"


# A padded pipeline's steps are named this many records at a time, so that a long range needs bounded memory.
_BLOCK_RECORDS = 1 << 16


def lineage(pipeline: Pipeline | GrainPipeline, state: dict[str, Any] | None = None, *, steps: range) -> list[dict[str, Any]]:
    """`lineage_steps` as a list: see there."""
    return list(lineage_steps(pipeline, state, steps=steps))


def lineage_steps(
    pipeline: Pipeline | GrainPipeline, state: dict[str, Any] | None = None, *, steps: range
) -> Iterator[dict[str, Any]]:
    """Each global step's rows' source records, a step at a time (the arguments are checked
    at the call; a long range is named in bounded memory): one dict per step of `steps`,
    `{"step": N, "rows": [[{"file", "row", "index"}, ...], ...]}`, a row being the list of
    its records in order (a packed row's segments; one for a padded or filtered row), each
    named by its file, its row in that file (a source not of files: none, and its record
    index) and its global index, the value of the pipeline's `index_column` (a mixture's
    records also by their `"component"`; their index is within it). The pipeline's own
    transforms do not run: they cannot change which records a row holds.

    Args:
        pipeline: the pipeline the steps were read from.
        state: a state of it (`Loader.get_state()`, `cd.skip`); None: the stream's start.
            Steps count global batches from the stream's start (step 0 is the first); a
            state saved after step K-1 answers for steps K and later.
        steps: the steps, a `range` (any stride).

    Raises:
        ConfigError: `steps` is not a range of steps >= 0, it reaches past a finite
            stream's end or past the 2**62 records a position may reach (as
            `cd.skip`), or the pipeline is a `cd.GrainPipeline` (its records carry no
            index that colo-data can follow).
        StateError: `state` is not one of `pipeline`'s, it records no step (a packed or
            filtered pipeline's state saved before colo-data counted steps), or a step is
            earlier than the state.
    """
    if not isinstance(pipeline, AnyPipeline) or not pipeline.positional:
        raise ConfigError(
            f"cd.lineage takes a cd.Pipeline, not {type(pipeline).__name__}: a Grain pipeline's records carry no "
            "index colo-data can follow; add one to the records themselves (an id column) and read it from the batches"
        )
    if not isinstance(steps, range) or steps.step < 1 or steps.start < 0:
        raise ConfigError(f"steps={steps!r}: give a range of global steps, e.g. range(48_200, 48_220)")
    if state is None:
        position: Position = pipeline.at(0)
        first: int | None = 0
    else:
        packing = pipeline.pack.describe() if pipeline.pack is not None else None
        if "pack" in state and state["pack"] != packing:
            raise StateError(
                f"the loader state was saved by a pipeline packing {state['pack']!r} (columns/row length/method/"
                f"segments); this one packs {packing!r}, so its steps would name other records: give the pipeline the "
                "packing the run had (colo-data lineage: --arg for the config's setting of it)"
            )
        restored, position = restore(pipeline, state)
        pipeline = restored
        first = state_step(pipeline, state, position)
    if first is None:
        raise StateError(
            "the loader state records no step (saved before colo-data counted them, by a packed or filtered pipeline or "
            "at another global batch size), so which global step follows it is not known; use a state saved by this "
            "colo-data, or none (the stream's start)"
        )
    if not steps:
        return iter(())
    if steps.start < first:
        raise StateError(
            f"step {steps.start} is before this state, saved after step {first - 1} (it answers for steps {first} "
            "and later): give the state of an earlier checkpoint, or none (the stream's start)"
        )
    if pipeline.variable_batches:
        return _planned(pipeline, position, first, steps)
    left = pipeline.batches_from(int(position))
    if left is not None and steps[-1] - first >= left:
        raise _past_the_end(steps, first + left)
    reachable(pipeline, int(position), steps[-1] - first, f"steps {steps.start}..{steps[-1]}", "ask for earlier steps")
    return _counted(pipeline, int(position), first, steps)


def _counted(pipeline: Pipeline, position: int, first: int, steps: range) -> Iterator[dict[str, Any]]:
    """A padded pipeline's steps: their positions, bound to the order, named
    `_BLOCK_RECORDS` records at a time."""
    size = pipeline.global_batch_size
    order = pipeline.stream.bind(pipeline.order, pipeline.partitioning)
    per_block = max(1, _BLOCK_RECORDS // size)
    for at in range(0, len(steps), per_block):
        block = steps[at : at + per_block]
        starts = position + (np.asarray(block, dtype=np.int64) - first) * size
        positions = (starts[:, None] + np.arange(size, dtype=np.int64)).ravel()
        named = pipeline.stream.record_columns(order.indices_at(positions), _INDEX)
        origins = pipeline.stream.record_origins(named, _INDEX)
        for i, step in enumerate(block):
            yield {"step": step, "rows": [[origin] for origin in origins[i * size : (i + 1) * size]]}


def _planned(pipeline: Pipeline, position: Position, first: int, steps: range) -> Iterator[dict[str, Any]]:
    """A packed or filtered pipeline's steps: planned from the state's position on by one
    host covering the whole batch, keeping only the columns that name each row's records
    (the pipeline's transforms cannot change which records a row holds)."""
    index = pipeline.index_column or _INDEX
    naming = [name for name in (index, pipeline.stream.component_column) if name is not None]
    planning = dataclasses.replace(pipeline, transforms=(select(*naming),), index_column=index)
    chunks = HostPipeline(planning).chunks(position, batches=1)
    try:
        for step in range(first, steps[-1] + 1):
            chunk = next(chunks, None)
            if chunk is None:
                raise _past_the_end(steps, step)
            if step in steps:
                yield {"step": step, "rows": _rows(pipeline, chunk, index)}
    finally:
        close_iterator(chunks)


def _rows(pipeline: Pipeline, chunk: HostChunk, index: str) -> list[list[dict[str, Any]]]:
    """Each row's records, in order: a packed row's index column holds one per segment
    (-1: no segment), a filtered row's one."""
    named = {name: chunk.columns[name] for name in (index, pipeline.stream.component_column) if name is not None}
    indices = named[index].reshape(len(named[index]), -1)
    placed = indices >= 0
    origins = pipeline.stream.record_origins({k: v.reshape(indices.shape)[placed] for k, v in named.items()}, index)
    ends = np.cumsum(placed.sum(axis=1)).tolist()
    return [origins[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _past_the_end(steps: range, end: int) -> ConfigError:
    return ConfigError(
        f"steps {steps.start}..{steps[-1]}: the stream has {end} global batches (steps 0..{end - 1}); epochs are "
        "finite: ask for earlier steps"
    )
