"""`Pipeline`: the whole dataset definition (source, order, transforms, batch size, epochs)
as one frozen, picklable value that every host builds its share from. It answers what the
loader asks of a pipeline kind (`colo_data.pipeline.kinds.PipelineKind`) through its stream."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from colo_data import defaults
from colo_data.errors import ConfigError, StateError
from colo_data.io.columns import Columns
from colo_data.io.record_source import Source, as_source
from colo_data.pipeline import parts
from colo_data.pipeline.order import Order, Partitioning, Position
from colo_data.pipeline.pack import Pack
from colo_data.pipeline.stream import Stream, order_name, same_order, saved_partitions, stream_of
from colo_data.pipeline.transforms import BatchTransform
from colo_data.setting_checks import as_int


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A dataset definition, validated when it is made.

    Args:
        source: an `ArrowSource`, a `grain.MapDataset` or any random-access collection of
            dict records.
        global_batch_size: rows of each global batch, over all hosts.
        order: the order of records in each epoch.
        transforms: batch transforms, applied in order.
        epochs: epochs in the stream; None repeats forever with a new order each epoch.
        index_column: when set, the name of a column that holds each row's global record
            index (int64), added before the transforms run.
        pack: a `cd.Pack`: a global batch is then `global_batch_size` rows of packed
            records (and the transforms run on the packed batch).
        keep: a filter: a function of a chunk of the records' columns (as read, with the
            index column; with `pack`, as its `keep` sees them) returning one bool per record
            (a numpy bool array, a list of bools or a pyarrow boolean array without nulls;
            anything else is a TransformError, where truthiness would keep "False" and NaN).
            A global batch is then the next `global_batch_size` records it accepts, every
            column kept; the ones it rejects are consumed, never placed. With one
            partition every host evaluates it on the whole global batch's records; with
            several, each partition on its own records (its rows are its next accepted
            ones). It must give the same answer for a record wherever it runs.
        partitions: the stream's partitions (None: chosen from the pipeline, see
            `default_partitions`): partition k is rows
            `[k*B/partitions, (k+1)*B/partitions)` of every global batch, and the `block` and
            `global` orders give each partition its own slice of every window's (`global`:
            the epoch's) records in row-group order, shuffled, so that host h of H (H
            dividing `partitions`) reads only its partitions' row groups: about 1/H of them,
            where with one partition every host reads every row group its rows are in. It
            must divide `global_batch_size`; one per batch row is the most. The batches do
            not depend on the host count; they do on `partitions`, which a state records
            (docs/scaling.md). With `pack` or `keep`, each partition reads, filters and
            packs its own records at its own pace (a host only those its rows fall in), the
            state holds a position per partition, and a finite stream ends at the first
            batch that one partition cannot fill. With `keep` the partitions take turns of
            the one order instead of slices of their own (`Partitioning.shared`), so that a
            filter that follows the files accepts in each as in the whole stream; a host
            then reads the row groups its records fall in, as with one partition. A
            pipeline restored from a state takes the state's partitions where it names
            none.
        partition_origin: set by a restore, not by hand: the position from which a
            padded pipeline's partitions take rows of this batch size
            (`Partitioning.origin`, a multiple of `partitions` below
            `global_batch_size`), where a state saved at another batch size continues; 0
            otherwise. The stream before it is not the pipeline's: reading there (a
            loader or `cd.lineage` from the stream's start) is a ConfigError.
    """

    source: Source | Any
    global_batch_size: int
    order: Order = field(default_factory=Order)
    transforms: Sequence[BatchTransform] = ()
    epochs: int | None = 1
    index_column: str | None = None
    pack: Pack | None = None
    keep: Callable[[Columns], np.ndarray] | None = None
    partitions: int | None = None
    partition_origin: int = 0
    # every record a function of its position: skip, lineage, verify's record checks and worker pools apply
    positional: ClassVar[Literal[True]] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", as_source(self.source))
        object.__setattr__(self, "transforms", tuple(self.transforms))
        size = as_int(self.global_batch_size)
        if size is None or size < 1:
            raise ConfigError(f"global_batch_size={self.global_batch_size!r}: must be a positive int")
        object.__setattr__(self, "global_batch_size", size)
        if self.partitions is not None:
            partitions = as_int(self.partitions)
            if partitions is None or partitions < 1 or size % partitions:
                raise ConfigError(
                    f"partitions={self.partitions!r}: give a divisor of global_batch_size={size} (each partition is "
                    f"{size}/partitions rows of every batch), e.g. {size} (a partition a row) or 1; or None, to "
                    "let the pipeline choose"
                )
            object.__setattr__(self, "partitions", partitions)
        origin = as_int(self.partition_origin)
        if origin is None or origin < 0 or origin and (self.partitions is None or origin % self.partitions or origin >= size):
            raise ConfigError(
                f"partition_origin={self.partition_origin!r}: a restore sets it, with the partitions of the state it "
                "continues; leave it 0 (a restored pipeline goes to another batch size by "
                "pipeline.with_global_batch_size(n), which drops it for the next restore to derive)"
            )
        object.__setattr__(self, "partition_origin", origin)
        if self.epochs is not None:
            epochs = as_int(self.epochs)
            if epochs is None or epochs < 1:
                raise ConfigError(f"epochs={self.epochs!r}: must be a positive int, or None to repeat forever")
            object.__setattr__(self, "epochs", epochs)
        if self.pack is not None and not isinstance(self.pack, Pack):
            raise ConfigError(f"pack={self.pack!r}: give a cd.Pack(column, length, ...)")
        if self.keep is not None and not callable(self.keep):
            raise ConfigError(f"keep={self.keep!r}: give a function of the records' columns returning one bool per record")
        if not isinstance(self.order, Order):
            raise ConfigError(f"order={self.order!r}: give a cd.Order(shuffle=..., seed=...)")
        for t in self.transforms:
            if not callable(t):
                raise ConfigError(f"transforms: {t!r} is not callable; wrap per-record functions in cd.per_record")
        if len(self.source) == 0:
            raise ConfigError(f"the source {self.source!r} has no records")
        if len(self.source) < self.global_batch_size:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is larger than the source's "
                f"{len(self.source)} records: use a smaller batch"
            )
        columns = getattr(self.source, "columns", ())
        if self.index_column is not None and self.index_column in columns:
            raise ConfigError(
                f"index_column={self.index_column!r} is already a column of the source: choose another name"
            )
        self.stream.check(self)

    @functools.cached_property
    def stream(self) -> Stream:
        """What the source makes of the stream: its order, state and checks
        (`colo_data.pipeline.stream`)."""
        return stream_of(self.source)

    @functools.cached_property
    def partitioning(self) -> Partitioning:
        """The stream's partitions: `partitions` (or `default_partitions`) of
        `global_batch_size / partitions` rows; a filtered pipeline's `shared` under the
        `block` and `global` orders: a partition of its own slice of the records would
        starve wherever `keep` rejects that slice (a filter that follows the files), while
        each partition's turns of the one order accept as the whole stream does."""
        count = self.partitions if self.partitions is not None else default_partitions(self)
        shared = count > 1 and self.filtered and self.order.shuffle != "none"
        return Partitioning(count, self.global_batch_size // count, self.partition_origin, shared)

    @property
    def position_partitioning(self) -> Partitioning | None:
        """The partitions a position holds one entry for (`partitioned`); None when it is
        one position."""
        return self.partitioning if self.partitioned else None

    def with_source(self, source: Any) -> Pipeline:
        """This pipeline over another source (a rebased `cd.Mix`, say)."""
        return dataclasses.replace(self, source=source)

    def with_global_batch_size(self, size: int) -> Pipeline:
        """This pipeline at another global batch size, to restore a state into. Its
        `partition_origin` is a restore's for the batch size it restored at and means
        nothing at another (where it may be no position of a batch at all): it is dropped,
        and the restore derives it anew from the state, as for the pipeline as made.

        Raises:
            ConfigError: its `partitions` (a restored pipeline's are its state's) do not
                divide `size`.
        """
        whole = as_int(size)
        if self.partitions is not None and whole is not None and whole > 0 and whole % self.partitions:
            raise ConfigError(
                f"global_batch_size={size}: this pipeline's {self.partitions} partitions (a restored pipeline's are "
                f"its state's, which a state restored into it must have) do not divide it: give a batch size that "
                f"{self.partitions} divides"
            )
        return dataclasses.replace(self, global_batch_size=size, partition_origin=0)

    @property
    def records_per_epoch(self) -> int:
        """Records in one epoch: the source's length."""
        return len(self.source)

    @property
    def total_records(self) -> int | None:
        """Positions in the whole stream, or None when it repeats forever: `epochs`
        times the source's records; with partitions of their own epochs (`own_epochs`), the
        shortest partition's epochs, `epochs * (len // partitions)` positions of each (the
        longer partitions' last records are dropped, as a partial batch is)."""
        if self.epochs is None:
            return None
        if self.own_epochs:
            return self.epochs * self.partitioning.partitions * (len(self.source) // self.partitioning.partitions)
        return self.epochs * len(self.source)

    @property
    def own_epochs(self) -> bool:
        """Whether each partition runs through epochs of its own, its slice of each shuffle
        window (`colo_data.pipeline.order.GlobalOrder`): several partitions, not `shared`,
        under a `block` or `global` order."""
        parts = self.partitioning
        return parts.partitions > 1 and not parts.shared and self.order.shuffle != "none"

    def own_totals(self, partitions: np.ndarray) -> np.ndarray | None:
        """Own positions in each of these partitions' streams (None: endless): their
        epochs' records, or their positions before the stream's end in file order."""
        if self.epochs is None:
            return None
        if self.own_epochs:
            return self.epochs * self.partitioning.epoch_records(len(self.source), partitions)
        return self.partitioning.before(self.epochs * len(self.source), partitions)

    @property
    def filtered(self) -> bool:
        """Whether a `keep` (the pipeline's or its pack's) judges the records."""
        return self.keep is not None or self.pack is not None and self.pack.keep is not None

    @property
    def variable_batches(self) -> bool:
        """Whether a global batch takes other than `global_batch_size` records of the
        stream: packed (as many as fit) or filtered (rejected records consumed too)."""
        return self.pack is not None or self.keep is not None

    @property
    def partitioned(self) -> bool:
        """Whether each partition reads, filters and packs its own records at its own pace
        (a packed or filtered pipeline of several partitions): its position is then one per
        partition (`colo_data.host.partitioned`)."""
        return self.partitioning.partitions > 1 and self.variable_batches

    def at(self, position: int) -> Position:
        """Where the stream stands after `position` records: that position, or a
        partitioned pipeline's own positions there (each partition's records before it)."""
        return parts.start(self.partitioning.own(position)) if self.partitioned else position

    @property
    def plan_batches(self) -> int:
        """Global batches a partition of a partitioned packed pipeline plans at once: its
        rows of that many batches, `defaults.PACK_PLAN_ROWS` or the global batch's rows if
        fewer, packed together and handed out in turn (the fill of a plan grows with its
        rows; one partition's rows of one batch alone would fill less). 1 otherwise."""
        if not self.partitioned or self.pack is None:
            return 1
        return max(1, min(self.global_batch_size, defaults.PACK_PLAN_ROWS) // self.partitioning.rows)

    def check_run(self, hosts: int, processes: int) -> None:
        """Raise ConfigError when this pipeline cannot run in `processes` processes: a
        partitioned packed or filtered pipeline runs there only endlessly, since no process
        knows when another one's partitions run out (the stream's end). Any host count that
        divides the batch runs it (`Partitioning.owned`)."""
        if self.partitioned and self.epochs is not None and processes > 1:
            raise ConfigError(
                f"epochs={self.epochs} for a partitioned {'packed' if self.pack is not None else 'filtered'} "
                f"pipeline in a run of {processes} processes: its stream ends when one partition runs out, "
                "which only that partition's process sees. Give epochs=None and stop after the steps you want"
            )

    def state_at(self, position: Position, hosts: int, host_states: dict[int, Any]) -> dict[str, Any]:
        """The loader state after `position`, its stream's to say (and a packed
        pipeline's packing, which `cd.lineage` needs to name the rows of later steps); the
        same on every host, so `hosts` and `host_states` play no part."""
        state = self.stream.state(self, position)
        return state if self.pack is None else {**state, "pack": self.pack.describe()}

    def resumed(self, state: dict[str, Any], hosts: int) -> tuple[Pipeline, Position]:
        """This pipeline rebased to continue from `state` (a `cd.Mix` where its components
        left off; the state's partitions where it names none, counted from where the state
        stands in rows of this batch size), and the position it continues from, on
        any host count.

        Raises:
            StateError: the state is not one of this pipeline's (its stream says why), or
                its partitions do not divide this batch size.
        """
        pipeline, position = self.stream.restore(self.with_partitions_of(state), state)
        if isinstance(position, int) and pipeline.own_epochs and not pipeline.variable_batches:
            origin = resumed_origin(pipeline, position)
            if origin != pipeline.partition_origin:
                pipeline = dataclasses.replace(pipeline, partitions=pipeline.partitioning.partitions, partition_origin=origin)
        return pipeline, position

    def with_partitions_of(self, state: dict[str, Any]) -> Pipeline:
        """This pipeline with the partitions `state` was saved with, where it names none and
        they change the order: a pipeline that chooses its partitions continues the stream
        it saved (a state saved before it chose them continues with one partition, but
        under `none` and with `shared` partitions over one source, which keep one
        partition's order of records)."""
        if self.partitions is not None or not isinstance(state.get("order"), str):
            return self
        saved = saved_partitions(state["order"])
        plain = order_name(self) == self.order.describe() or same_order(self, state["order"], order_name(self))
        if saved == self.partitioning.partitions or saved == 1 and plain:
            return self  # the same partitions, or one where they would not change the order of records
        if self.global_batch_size % saved:
            raise StateError(
                f"the loader state was saved with {saved} partitions (part of its order, {state['order']!r}), "
                f"which do not divide global_batch_size={self.global_batch_size}: resume at a batch size that "
                f"{saved} divides, or start without a state"
            )
        return dataclasses.replace(self, partitions=saved)

    def continues(self, running: object) -> bool:
        """Whether this pipeline, restored from a state, gives the stream that `running`
        gives, so that a loader running it can jump to the state in place."""
        return (
            isinstance(running, Pipeline)
            and self.partitioning == running.partitioning
            and self.stream.continues(running.stream)
        )

    def host_states(self) -> dict[int, Any] | None:
        """None: a native pipeline's state is one global position, the same on every host."""
        return None

    def mixture_records(self, first: Position, position: Position) -> tuple[dict[str, int], tuple[int, ...]] | None:
        """A mixture's records of each component delivered from position `first` to
        `position`, and the weights' shares; None when the source is not a mixture."""
        counts = self.stream.component_records(self, first, position)
        return None if counts is None else (counts, self.stream.shares or ())

    def batches_from(self, position: int) -> int | None:
        """Full global batches left in the stream from a position (a trailing partial
        batch is dropped), or None when the stream repeats forever or its batches take a
        variable number of records (packed, filtered).

        Args:
            position: records of the stream already delivered.
        """
        total = self.total_records
        if total is None or self.variable_batches:
            return None
        return max(0, (total - position) // self.global_batch_size)


def default_partitions(pipeline: Pipeline) -> int:
    """The partitions of a pipeline that names none. An endless pipeline gets the largest
    divisor of its batch size B up to `max(defaults.PARTITIONS, B //
    defaults.PARTITION_ROWS)` (16 up to batches of 256, then a partition per 16 rows), and
    no more than its smallest weighted component's records: each host then reads (and
    filters and packs) about its share of every batch for up to that many hosts, and
    shares its edge partitions beyond (a filtered one reads the row groups its share falls
    in: its partitions are `shared`, so that they accept as the whole stream does). A
    finite one keeps one partition (a finite partitioned stream ends where one partition
    runs out, which a multi-controller run cannot agree on, and leaves records of each
    epoch out), and so does a padded `cd.Mix` (it resumes under other weights and at other
    batch sizes, which partitions would refuse). The count
    depends on the pipeline alone, never on the host or worker count, so the batches do
    not either (docs/scaling.md)."""
    if pipeline.epochs is not None or not pipeline.variable_batches and pipeline.stream.shares is not None:
        return 1
    size = pipeline.global_batch_size
    stream = pipeline.stream
    smallest = min(n for n, share in zip(stream.sizes, stream.shares or (1,) * len(stream.sizes), strict=True) if share)
    most = min(max(defaults.PARTITIONS, size // defaults.PARTITION_ROWS), smallest)
    return max(d for d in range(1, min(size, most) + 1) if size % d == 0)


def resumed_origin(pipeline: Pipeline, position: int) -> int:
    """Where a padded pipeline's partitions, each `position / P` records in at `position`,
    take rows of its batch size from (`Partitioning.origin`); StateError where its P
    partitions cannot have taken `position` records evenly (a state at no batch boundary of
    theirs)."""
    parts = pipeline.partitioning
    if position % parts.partitions:
        raise StateError(
            f"the loader state stands at position {position}, which its {parts.partitions} partitions cannot "
            f"have taken evenly (each partition takes its rows of every batch): it was not saved at a batch "
            "boundary; restore it at the batch size it was saved at"
        )
    return position % pipeline.global_batch_size
