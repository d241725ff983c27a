"""What a pipeline's source makes of its stream. A source read alone (`Single`) and a
`cd.Mix` answer the same questions, `Stream`'s: which record each position holds
(the bound order), the columns that name a record, the loader state, what a default verify
run reads and how it names a record, and the records of each component. The rest of
colo-data asks the pipeline's stream and never which kind of source it has; a new kind of
source with an order of its own (one that defines `bind`) implements `Stream` too."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from colo_data.errors import StateError
from colo_data.io.record_source import record_places
from colo_data.pipeline.order import GlobalOrder, Order, Partitioning, Position
from colo_data.pipeline.parts import decode_parts, encode_parts, saved_count
from colo_data.pipeline.state_format import FORMAT, MAX_POSITION

if TYPE_CHECKING:
    from colo_data.io.record_source import Source

# A loader state's fields that must match the pipeline's. The global batch size is recorded
# but not matched: the position counts records, so a loader with another batch size
# continues the same stream (each record still once).
_MATCHED = ("seed", "order", "records", "source")
_PARTS = re.compile(r"/(\d+)x(\d+) (\w+)$")  # an order name's partitions, their rows a batch and their kind


class PipelineView(Protocol):
    """What a stream reads of its pipeline (a `cd.Pipeline`)."""

    @property
    def source(self) -> Any: ...

    @property
    def order(self) -> Order: ...

    @property
    def epochs(self) -> int | None: ...

    @property
    def index_column(self) -> str | None: ...

    @property
    def global_batch_size(self) -> int: ...

    @property
    def records_per_epoch(self) -> int: ...

    @property
    def partitioning(self) -> Partitioning: ...

    @property
    def partitioned(self) -> bool: ...

    @property
    def variable_batches(self) -> bool: ...

    def at(self, position: int) -> Position: ...

    @property
    def plan_batches(self) -> int: ...

    @property
    def pack(self) -> Any: ...

    def with_source(self, source: Any) -> Any: ...

    @property
    def stream(self) -> Stream: ...


class BoundStream(Protocol):
    """A stream bound to the pipeline's order: global positions -> records. A record is
    (component, its index within the component); a single source has one component."""

    @property
    def locality(self) -> int: ...

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """The source's record index at each global position."""
        ...

    def group_ranks_at(self, positions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Each record's row group's rank in its epoch's reading order (worker shares)."""
        ...

    def components_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The component of each global position, and that component's own position."""
        ...

    def own_indices(self, components: np.ndarray, own: np.ndarray) -> np.ndarray:
        """The record index within its component at each (component, own position)."""
        ...

    def record_keys(self, positions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Each record's (component + 1, the component's epoch, index within the component)
        at global positions `positions` (the source's records `indices`): what seeds
        `cd.random_map`'s draws, the same on every host."""
        ...


@runtime_checkable
class Stream(Protocol):
    """A source's stream: what the loader, its state, telemetry and verify need to know of
    it beyond reading records."""

    @property
    def names(self) -> tuple[str, ...]:
        """The components' names."""
        ...

    @property
    def shares(self) -> tuple[int, ...] | None:
        """Each component's slots of a mixture's schedule; None for one source."""
        ...

    @property
    def component_column(self) -> str | None:
        """The column naming each row's component; None for one source."""
        ...

    @property
    def sizes(self) -> tuple[int, ...]:
        """Records in each component."""
        ...

    def bind(self, order: Order, partitioning: Partitioning | None = None) -> BoundStream:
        """This stream under `order`, over the stream's `partitioning` (one partition: None)."""
        ...

    def record_columns(self, indices: np.ndarray, index_column: str | None) -> dict[str, np.ndarray]:
        """The columns that name the records `indices` (the index column, a mixture's
        component column), added before the transforms run."""
        ...

    def record_origins(self, named: dict[str, np.ndarray], index_column: str) -> list[dict[str, Any]]:
        """Where each record that `named` names (`record_columns`' columns, the index column
        under `index_column`) comes from: its file, its row in that file and its index (a
        mixture's: first its component), for `cd.lineage`."""
        ...

    def check(self, pipeline: PipelineView) -> None:
        """Raise ConfigError for a pipeline setting this stream cannot run with."""
        ...

    def state(self, pipeline: PipelineView, position: Position) -> dict[str, Any]:
        """The loader state after `position` records of the stream (a partitioned pipeline:
        each partition's own records)."""
        ...

    def restore(self, pipeline: PipelineView, state: dict[str, Any]) -> tuple[Any, Position]:
        """The pipeline to continue with and the position `state` (of this format) points
        at; StateError when it does not belong to `pipeline`."""
        ...

    def continues(self, other: Stream) -> bool:
        """Whether `other` (this stream restored from a state) gives the same stream, so a
        running loader can jump in it."""
        ...

    def verify_end(self, pipeline: PipelineView) -> int:
        """The position a default verify run reads to."""
        ...

    def first_epochs(self) -> str:
        """What a default verify run reads, in words."""
        ...

    def record_label(self, component: int, index: int) -> str:
        """A record named in a message."""
        ...

    def component_records(self, pipeline: PipelineView, first: Position, position: Position) -> dict[str, int] | None:
        """Each component's records between two positions (None: one source)."""
        ...


def stream_of(source: Any) -> Stream:
    """The stream of a source: its own when it defines one (a `cd.Mix`), else `Single`."""
    return source if isinstance(source, Stream) else Single(source)


class SingleOrder(GlobalOrder):
    """One source's `GlobalOrder` as a `BoundStream`: one component, whose own position is
    the global position."""

    def components_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        return np.zeros(len(positions), np.int64), positions

    def own_indices(self, components: np.ndarray, own: np.ndarray) -> np.ndarray:
        return self.indices_at(own)

    def record_keys(self, positions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return np.stack([np.zeros_like(positions), self.epochs_at(positions), indices], axis=1)


@dataclass(frozen=True)
class Single:
    """A source read alone: epoch after epoch, each in the pipeline's order; its state is
    (epoch, position) with what the pipeline must match to continue."""

    source: Source
    names: tuple[str, ...] = ("",)
    shares: tuple[int, ...] | None = None
    component_column: str | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return (len(self.source),)

    def bind(self, order: Order, partitioning: Partitioning | None = None) -> SingleOrder:
        return SingleOrder(order, np.asarray(self.source.row_group_sizes, dtype=np.int64), partitioning)

    def record_columns(self, indices: np.ndarray, index_column: str | None) -> dict[str, np.ndarray]:
        return {} if index_column is None else {index_column: indices}

    def record_origins(self, named: dict[str, np.ndarray], index_column: str) -> list[dict[str, Any]]:
        indices = named[index_column]
        files, rows = record_places(self.source, indices)
        return [{"file": f, "row": r, "index": i} for f, r, i in zip(files, rows, indices.tolist(), strict=True)]

    def check(self, pipeline: PipelineView) -> None:
        return None

    def state(self, pipeline: PipelineView, position: Position) -> dict[str, Any]:
        if isinstance(position, np.ndarray):
            return {"format": FORMAT, "parts": encode_parts(position), **_identity(pipeline)}
        epoch, within = divmod(position, pipeline.records_per_epoch)
        return {"format": FORMAT, "epoch": epoch, "position": within, **_identity(pipeline)}

    def restore(self, pipeline: PipelineView, state: dict[str, Any]) -> tuple[Any, Position]:
        if "mix" in state:
            raise StateError("the loader state was saved from a pipeline over a cd.Mix; this pipeline's source is not one")
        if "kind" in state:
            raise StateError(
                f"the loader state was saved from a cd.GrainPipeline (kind {state['kind']!r}); this is a native "
                "cd.Pipeline: restore it into the pipeline that saved it, or start without a state"
            )
        ours = _identity(pipeline)
        differences = [
            f"{k}: state has {state.get(k)!r}, pipeline has {ours[k]!r}"
            for k in _MATCHED
            if not (same_order(pipeline, state.get(k), ours[k]) if k == "order" else state.get(k) == ours[k])
        ]
        check_older_order(state.get("order"), ours["order"])
        if differences:
            raise StateError(
                "the loader state was saved from a different pipeline ("
                + "; ".join(differences)
                + "). Restore it into the pipeline that saved it, or start without a state."
                + partitions_hint(state.get("order"), ours["order"])
            )
        if "parts" in state:
            return pipeline, parts_position(pipeline, state)
        epoch, within = state.get("epoch"), state.get("position")
        records = ours["records"]
        if not (isinstance(epoch, int) and isinstance(within, int) and epoch >= 0 and 0 <= within < records):
            raise StateError(f"loader state has epoch={epoch!r}, position={within!r}: not a position in {records} records")
        position = epoch * records + within
        if position > MAX_POSITION:
            raise StateError(
                f"loader state has epoch={epoch}, position={within}: record {position:,} of the stream, past the "
                "2**62 that a position may reach (a damaged or made-up state)"
            )
        return pipeline, pipeline.at(position)  # partitioned: each partition's records before it

    def continues(self, other: Stream) -> bool:
        return True

    def verify_end(self, pipeline: PipelineView) -> int:
        return pipeline.records_per_epoch

    def first_epochs(self) -> str:
        return "one epoch"

    def record_label(self, component: int, index: int) -> str:
        return f"record {index}"

    def component_records(self, pipeline: PipelineView, first: Position, position: Position) -> dict[str, int] | None:
        return None


def order_name(pipeline: PipelineView) -> str:
    """The pipeline's order as a state names it: with partitions that change it (the block
    and global orders, where each partition has epochs of its own; a mixture's schedule),
    `/P x rows own` after it, and `dealt` for the block order, whose windows keep each
    partition on the same row groups every epoch (`GlobalOrder`); `shared` for a filtered
    pipeline's partitions, which take turns of the one order (`Partitioning.shared`): the
    records' order is one partition's, but a partition's own position names other records
    at other rows a batch."""
    parts = pipeline.partitioning
    named = parts.partitions > 1 and (pipeline.order.shuffle != "none" or pipeline.stream.shares is not None)
    if not named:
        return pipeline.order.describe()
    kind = "shared" if parts.shared else "dealt" if pipeline.order.shuffle == "block" else "own"
    return f"{pipeline.order.describe()}/{parts.partitions}x{parts.rows} {kind}"


def saved_partitions(order: str) -> int:
    """The partitions a state's order name records (`/P x rows` after the order; 1 where
    it names none)."""
    named = _named_parts(order)
    return 1 if named is None else named[0]


def _named_parts(order: object) -> tuple[int, int] | None:
    """The partitions and their rows a batch that an order name records (`/P x rows` after
    the order), or None where it names none. StateError where it names 0 of either, or more
    digits than any batch has: no pipeline saves that (a damaged or made-up state, whose
    partitions would be divided by)."""
    named = _PARTS.search(str(order))
    if named is None:
        return None
    digits = named.group(1, 2)
    if any(len(d) > 18 or not int(d) for d in digits):  # 18: int() reads them all, and no batch is larger
        raise StateError(
            f"the loader state's order {str(order)[:80]!r} names {digits[0][:20]} partitions of {digits[1][:20]} rows "
            "a batch, which no pipeline has (each is from 1 to the global batch size): the state is damaged or made up; pass "
            "the dict that Loader.get_state() returned, unchanged, or start without a state"
        )
    return int(digits[0]), int(digits[1])


def same_order(pipeline: PipelineView, saved: object, ours: str) -> bool:
    """Whether a state's order name (`saved`) is the pipeline's (`ours`). A padded
    pipeline's partitions take their own records in turn whatever their rows a batch, so
    its rows (`x rows` in `/P x rows`) may differ: it resumes at any batch size its
    partitions divide (`Partitioning.origin`). Shared partitions over one source
    (`Partitioning.shared`) keep one partition's order of records, so a state of one global
    position (its order without partitions) is theirs too: each partition continues after
    its records before that position."""
    if saved == ours:
        return True
    if pipeline.partitioning.shared and pipeline.stream.shares is None and saved == pipeline.order.describe():
        return True
    if pipeline.variable_batches or not isinstance(saved, str):
        return False
    return bool(_PARTS.sub(r"/\1 \3", saved) == _PARTS.sub(r"/\1 \3", ours))


def partitions_hint(saved: object, ours: str) -> str:
    """Where a state's order name (`saved`) and the pipeline's (`ours`) differ in their
    partitions (`/P x rows`, part of the order), the settings that give the saved ones: the
    partitions and, since each partition's rows are part of it too, the global batch size
    (P x rows) it was saved at; where only their kind differs (`shared` or a slice of
    their own), what has the saved kind; "" where neither names partitions."""
    was, now = _named_parts(saved), _named_parts(ours)
    if was is None and now is None:
        return ""
    if was is None:
        return " The state was saved without partitions: give the pipeline partitions=1."
    count, rows = was
    shared = str(saved).endswith(" shared")  # the partitions' kind (`order_name`)
    if now == was and shared == ours.endswith(" shared"):  # the same partitions: another difference is the one
        return ""
    if now == was:
        return (
            " The state's partitions took turns of the one order, as a filtered pipeline's do (keep=), and this "
            "pipeline's would each read a slice of their own: give it the keep= it was saved with."
            if shared
            else " The state's partitions each read a slice of their own, as a padded or packed pipeline's do (and a "
            "filtered one's did before filtered partitions took turns of the one order), and this pipeline's take turns "
            "of the one order, as a filtered pipeline's do: restore the state into the pipeline that saved it, with the "
            "colo-data that saved it."
        )
    if now is not None and now[0] == count:
        return (
            f" The state was saved with the same {count} partitions, of {rows} rows a batch each: partitions and their rows "
            f"are part of the order, so it resumes only at the global batch size it was saved at, "
            f"global_batch_size={count * rows}."
        )
    return (
        f" The state was saved with {count} partitions of {rows} rows a batch each, and partitions are part of the order: "
        f"give the pipeline partitions={count} and global_batch_size={count * rows}."
    )


def check_older_order(saved: object, ours: str) -> None:
    """StateError when a state's order name (`saved`) is one an earlier colo-data gave a
    partitioned order whose positions name other records now: partitions that shared each
    window by global position (`block:W/PxR`, `global/PxR`), or block windows that put a
    partition on other row groups each epoch (`block:W/PxR own`)."""
    name = str(saved)
    if re.fullmatch(r"(block:\d+|global)/\d+x\d+", name):
        was = (
            "whose partitions shared each shuffle window by global position; this colo-data gives each partition "
            "epochs of its own"
        )
    elif re.fullmatch(r"block:\d+/\d+x\d+ own", name):
        was = (
            "whose windows put each partition on other row groups every epoch; this colo-data keeps each "
            "partition on the same row groups"
        )
    else:
        return
    raise StateError(
        f"the loader state was saved with partitions under an order ({name!r}) {was} ({ours!r}), so the state's "
        "position names other records here. Restore it with the colo-data that saved it, or start without a state."
    )


def parts_position(pipeline: PipelineView, state: dict[str, Any]) -> np.ndarray:
    """The partitions' own positions a state saved by a partitioned packed or filtered
    pipeline holds; StateError when this pipeline's partitions or packing differ."""
    count = saved_count(state["parts"])  # checked before the positions are inflated
    if count is not None and (not pipeline.partitioned or count != pipeline.partitioning.partitions):
        raise StateError(
            f"the loader state holds the positions of {count} partitions of a packed or filtered pipeline; "
            f"this pipeline is {_kind(pipeline)}: give it the partitions={count} and the pack= or keep= it "
            "was saved with"
        )
    position = decode_parts(state["parts"])  # no count: a StateError that names the entry damaged
    if position[0] >= pipeline.plan_batches:
        raise StateError(
            f"the loader state is {position[0]} batches into its partitions' packing plans, which span "
            f"{pipeline.plan_batches} here: it was saved from a pipeline of other batch rows or another "
            "packing; restore it into the pipeline that saved it"
        )
    return position


def _identity(pipeline: PipelineView) -> dict[str, Any]:
    return {
        "seed": pipeline.order.seed,
        "order": order_name(pipeline),
        "global_batch_size": pipeline.global_batch_size,
        "records": pipeline.records_per_epoch,
        "source": pipeline.source.fingerprint(),
    }


def _kind(pipeline: PipelineView) -> str:
    if pipeline.partitioned:
        return f"one of partitions={pipeline.partitioning.partitions}"
    if pipeline.partitioning.partitions > 1:
        return f"of partitions={pipeline.partitioning.partitions} but neither packed nor filtered"
    return "of one partition"
