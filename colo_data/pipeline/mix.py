"""`Mix`: several named sources read as one endless stream, interleaved by weight. Global
position p maps in O(1) to (component, the component's own position) through a periodic
schedule of `DENOMINATOR` slots, in which every prefix gives each component its weight's
share to within one record. Each component runs through its own epochs in the pipeline's
order (reseeded by the component's name), so the records a component yields, in their
order, do not depend on the weights: the weights only interleave them. `start` says where
the current weights took effect, so that a state restores under new weights with every
component continuing where it stopped. With partitions (`Pipeline(partitions=P)`), each
partition runs the schedule over its own positions, partition k from `k * rows` slots on
(so a global batch's rows are B slots in a row of it), and reads its own partition of each
component (its slice of every window): a host reads its own row groups of every component.
A filtered pipeline's partitions (`Partitioning.shared`) take turns of each component's one
order instead."""

from __future__ import annotations

import functools
import hashlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from colo_data.errors import ConfigError, SchemaError, StateError
from colo_data.io.arrow_source import ArrowSource
from colo_data.io.record_source import ReadAhead, Source, as_source, record_places
from colo_data.pipeline.order import GlobalOrder, Order, Partitioning, Position
from colo_data.pipeline.parts import encode_parts
from colo_data.pipeline.schedule import DENOMINATOR, component_seed, integer_shares, schedule
from colo_data.pipeline.state_format import FORMAT, MAX_POSITION
from colo_data.pipeline.stream import (
    PipelineView,
    Stream,
    check_older_order,
    order_name,
    partitions_hint,
    parts_position,
    saved_partitions,
)

__all__ = ["DENOMINATOR", "Mix", "MixOrder", "integer_shares", "schedule"]
_VERIFY_RECORDS = 1 << 20  # the longest default verify run (a component of tiny weight takes long)
_LARGEST = sys.float_info.max  # the largest weight: a float holds it


@dataclass(frozen=True, eq=False)
class Mix:
    """Named sources mixed by weight into one endless stream (the pipeline's `epochs` must
    be None). The interleaving follows the weights; each component's own sequence does not.

    Args:
        components: name -> source (anything a `Pipeline` takes as a source); every
            component must have the same columns and types.
        weights: name -> a non-negative number, normalised (0 leaves a component out);
            their sum must be a finite float (about 1.8e308 at most).
        component_column: a column holding each row's component (its place in
            `components`, int32).
        start: where these weights took effect: the global position and each component's
            position there. Set when a state is restored (`rebased`), not by hand.
    """

    components: Mapping[str, Any]
    weights: Mapping[str, float]
    component_column: str = "_component"
    start: tuple[int, tuple[int, ...]] | None = None
    names: tuple[str, ...] = field(init=False)
    sources: tuple[Source, ...] = field(init=False)
    shares: tuple[int, ...] = field(init=False)
    _joined: ArrowSource | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.components, Mapping) or not self.components:
            raise ConfigError("Mix(components=...): give a dict of name -> source with at least one entry")
        names = tuple(self.components)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"Mix(components=...): component names must be non-empty strings, got {name!r}")
        if not isinstance(self.weights, Mapping) or set(self.weights) != set(names):
            given = sorted(self.weights) if isinstance(self.weights, Mapping) else self.weights
            raise ConfigError(f"Mix(weights={given!r}): give one weight for each component, {list(names)}")
        weights = []
        for name in names:
            w = self.weights[name]
            number = not isinstance(w, bool) and isinstance(w, int | float | np.integer | np.floating)
            # an int compared as one (float() of one past the largest float raises), the rest as a float (a
            # float32 would round the largest float to infinity): NaN, infinity and too large fail alike
            value = (int(w) if isinstance(w, int | np.integer) else float(w)) if number else math.nan
            if not 0 <= value <= _LARGEST:
                shown = f"an int of {w.bit_length()} bits" if isinstance(w, int) and w.bit_length() > 64 else repr(w)
                raise ConfigError(
                    f"Mix(weights=...): the weight of {name!r} is {shown}; give a number from 0 to the largest float "
                    "(weights are normalised: only their ratios count)"
                )
            weights.append(float(w))
        with np.errstate(over="ignore"):
            total = float(np.sum(weights))  # what `integer_shares` normalises by
        if total == math.inf:  # normalised by it, every share would round to 0 slots
            largest = max(zip(weights, names, strict=True))
            raise ConfigError(
                f"Mix(weights=...): the weights add up past the largest float (the weight of {largest[1]!r} is "
                f"{largest[0]!r}); they are normalised, so divide them all by the same number (by the largest, say)"
            )
        if total <= 0:
            raise ConfigError("Mix(weights=...): every weight is 0; give at least one component a weight above 0")
        weighted = sum(1 for w in weights if w > 0)
        if weighted > DENOMINATOR:  # each needs a slot of the schedule's period, or it would be left out
            raise ConfigError(
                f"Mix: {weighted:,} components have a weight above 0; a mixture's schedule has {DENOMINATOR:,} slots a "
                f"period, one at least for each: give at most {DENOMINATOR:,} components a weight (join small "
                "sources into one component)"
            )
        sources = tuple(as_source(self.components[n]) for n in names)
        for name, source in zip(names, sources, strict=True):
            if len(source) == 0:
                raise ConfigError(f"Mix: component {name!r} has no records")
        columns = [tuple(getattr(s, "columns", ())) for s in sources]
        for name, cols in zip(names[1:], columns[1:], strict=True):
            if cols != columns[0]:
                raise SchemaError(
                    f"Mix: component {name!r} has the columns {list(cols)}, component {names[0]!r} {list(columns[0])}: "
                    "every component must give the same columns (choose them with ArrowSource(columns=...))"
                )
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sources", sources)
        arrow = all(isinstance(s, ArrowSource) for s in sources)
        object.__setattr__(self, "_joined", ArrowSource.joined(sources) if arrow else None)  # type: ignore[arg-type]
        object.__setattr__(self, "shares", integer_shares(weights))
        if self.start is not None and len(self.start[1]) != len(names):
            raise ConfigError(f"Mix(start={self.start!r}): one position for each of the {len(names)} components")

    # -- the Source protocol: the components one after the other --

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Where each component's records begin among the mixture's record indices."""
        return np.concatenate([[0], np.cumsum([len(s) for s in self.sources])]).astype(np.int64)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(getattr(self.sources[0], "columns", ()))

    @property
    def row_group_sizes(self) -> np.ndarray:
        return np.concatenate([np.asarray(s.row_group_sizes, dtype=np.int64) for s in self.sources])

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The component of each mixture record index (int32), and the record's index
        within that component."""
        components = (np.searchsorted(self.offsets, indices, side="right") - 1).astype(np.int32)
        return components, indices - self.offsets[components]

    def take(self, indices: np.ndarray) -> pa.Table:
        indices = np.asarray(indices, dtype=np.int64)
        if self._joined is not None:  # the components' files as one source: one gather
            return self._joined.take(indices)
        comps, local = self.locate(indices)
        tables, places = [], []
        for c in np.unique(comps):
            where = np.flatnonzero(comps == c)
            tables.append(self.sources[c].take(local[where]))
            places.append(where)
        if len(tables) == 1:
            return tables[0]
        table = pa.concat_tables(tables, promote_options="none")
        return table.take(np.argsort(np.concatenate(places), kind="stable"))

    def fingerprint(self) -> str:
        return hashlib.sha256("|".join(self.component_fingerprints()).encode()).hexdigest()[:16]

    def component_fingerprints(self) -> list[str]:
        """A short hash of each component's name and data, in order."""
        pairs = zip(self.names, self.sources, strict=True)
        return [hashlib.sha256(f"{n}:{s.fingerprint()}".encode()).hexdigest()[:8] for n, s in pairs]

    def _read_ahead_sources(self) -> list[ReadAhead]:
        """The sources that load ahead: the joined one, else the components that do."""
        if self._joined is not None:
            return [self._joined]
        return [source for source in self.sources if isinstance(source, ReadAhead)]

    @property
    def lookahead(self) -> int:
        return max((source.lookahead for source in self._read_ahead_sources()), default=1)

    def read_stats(self) -> tuple[float, ...]:
        stats = [source.read_stats() for source in self._read_ahead_sources()]
        return tuple(float(sum(column)) for column in zip(*stats, strict=True)) if stats else (0.0,) * 6

    def prefetch(self, indices: np.ndarray) -> None:
        if self._joined is not None:
            self._joined.prefetch(indices)
            return
        comps, local = self.locate(np.asarray(indices, dtype=np.int64))
        for c in np.unique(comps):
            source = self.sources[c]
            if isinstance(source, ReadAhead):
                source.prefetch(local[comps == c])

    def stop_read_ahead(self, timeout: float) -> None:
        if self._joined is not None:
            self._joined.stop_read_ahead(timeout)
        for source in self.sources:
            if isinstance(source, ReadAhead):
                source.stop_read_ahead(timeout)

    # -- the order --

    def bind(self, order: Order, partitioning: Partitioning | None = None) -> MixOrder:
        """The stream order of this mixture under the pipeline's `order` and its stream's
        `partitioning`."""
        return MixOrder(self, order, partitioning)

    def rebased(self, position: int, component_positions: list[int]) -> Mix:
        """This mixture with its weights taking effect at global `position`, where each
        component has delivered `component_positions` records."""
        return Mix(
            dict(zip(self.names, self.sources, strict=True)),
            dict(self.weights),
            self.component_column,
            (int(position), tuple(int(q) for q in component_positions)),
        )

    # -- the Stream protocol (colo_data.pipeline.stream) --

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self.sources)

    def record_columns(self, indices: np.ndarray, index_column: str | None) -> dict[str, np.ndarray]:
        """The index within the component (as the index column) and the component."""
        components, local = self.locate(indices)
        named = {} if index_column is None else {index_column: local}
        return {**named, self.component_column: components}

    def record_origins(self, named: dict[str, np.ndarray], index_column: str) -> list[dict[str, Any]]:
        components, local = named[self.component_column], named[index_column]
        origins: list[dict[str, Any]] = [{} for _ in range(len(local))]
        for component in np.unique(components).tolist():
            at = np.flatnonzero(components == component)
            files, rows = record_places(self.sources[component], local[at])
            name = self.names[component]
            for i, f, r, index in zip(at.tolist(), files, rows, local[at].tolist(), strict=True):
                origins[i] = {"component": name, "file": f, "row": r, "index": index}
        return origins

    def check(self, pipeline: PipelineView) -> None:
        partitions = pipeline.partitioning.partitions
        for name, size, share in zip(self.names, self.sizes, self.shares, strict=True):
            if partitions > 1 and share and size < partitions:
                raise ConfigError(
                    f"Mix: component {name!r} has {size} records, fewer than partitions={partitions}: each partition "
                    "reads its own slice of every component; give fewer partitions, or more records"
                )
        if partitions > 1 and self.start is not None:
            raise ConfigError(
                f"partitions={pipeline.partitioning.partitions} over a cd.Mix rebased at position "
                f"{self.start[0]}: a partitioned mixture's weights are the ones it started with"
            )
        if pipeline.epochs is not None:
            raise ConfigError(
                f"epochs={pipeline.epochs!r}: a cd.Mix is endless (each component runs through its own epochs): "
                "give epochs=None and stop after the steps you want"
            )
        if self.component_column in self.columns or self.component_column == pipeline.index_column:
            raise ConfigError(
                f"Mix(component_column={self.component_column!r}) is already a column of the source or the "
                "index column: choose another name"
            )

    def state(self, pipeline: PipelineView, position: Position) -> dict[str, Any]:
        """The global position, where it falls in the schedule's period (`phase`), and each
        component's name, data fingerprint and records delivered there (a partitioned
        packed or filtered pipeline: its partitions' own positions, `parts`)."""
        start = self.start[0] if self.start is not None else 0
        at = self.bind(pipeline.order, pipeline.partitioning).component_positions(position)
        where: dict[str, Any]
        if isinstance(position, np.ndarray):
            where = {"parts": encode_parts(position)}
        else:
            where = {"position": position, "phase": (position - start) % DENOMINATOR}
        return {
            "format": FORMAT,
            **where,
            "seed": pipeline.order.seed,
            "order": order_name(pipeline),
            "global_batch_size": pipeline.global_batch_size,
            "weights": self._weights_id(),
            "mix": [[n, f, q] for n, f, q in zip(self.names, self.component_fingerprints(), at, strict=True)],
        }

    def _weights_id(self) -> str:
        return hashlib.sha256(repr(self.shares).encode()).hexdigest()[:8]

    def restore(self, pipeline: PipelineView, state: dict[str, Any]) -> tuple[Any, Position]:
        """`pipeline` over this mixture rebased at the state's position, so that every
        component continues where it stopped: in the same interleaving under the same
        weights, and from there on under new ones (a partitioned mixture: the same weights,
        from the same position).

        Raises:
            StateError: the state is not a mixture's, its seed or order differ, or a
                component was added, removed or has other data (each named).
        """
        if "mix" not in state:
            raise StateError("the loader state was saved from a pipeline without a cd.Mix; this pipeline's source is one")
        name = order_name(pipeline)
        check_older_order(state.get("order"), name)
        ours = {"seed": pipeline.order.seed, "order": name}
        differences = [f"{k}: state has {state.get(k)!r}, pipeline has {v!r}" for k, v in ours.items() if state.get(k) != v]
        saved = {entry[0]: entry for entry in state["mix"]}
        fingerprints = dict(zip(self.names, self.component_fingerprints(), strict=True))
        differences += [f"component {n!r} is not in the state (added?)" for n in self.names if n not in saved]
        differences += [
            f"component {n!r} of the state is not in the pipeline (removed?)" for n in saved if n not in fingerprints
        ]
        differences += [
            f"component {n!r} has other data than when the state was saved"
            for n in self.names
            if n in saved and saved[n][1] != fingerprints[n]
        ]
        if differences:
            where = (
                "the pipeline that saved it (weights may change), or start without a state."
                if saved_partitions(str(state.get("order"))) == 1
                else "the pipeline that saved it, under the weights and at the global batch size it was saved at, or "
                "start without a state: a mixture of partitions starts partition k's schedule k times its rows a batch "
                "slots on, so, padded or not, it continues neither under other weights nor at another batch size (one "
                "partition continues under both)."
            )
            listed = "; ".join(differences)
            raise StateError(
                f"the loader state does not fit this mixture ({listed}). Restore it into {where}"
                + partitions_hint(state.get("order"), name)
            )
        if pipeline.partitioning.partitions > 1:
            if state.get("weights") != self._weights_id():
                raise StateError(
                    f"the loader state was saved under other weights of this mixture; a mixture of "
                    f"partitions={pipeline.partitioning.partitions} continues under the weights it was saved with "
                    "(each partition's schedule would start anew): give those weights"
                )
            if "parts" in state:
                return pipeline, parts_position(pipeline, state)
        position, phase = state.get("position"), state.get("phase")
        at = [saved[n][2] for n in self.names]
        if not (isinstance(position, int) and isinstance(phase, int)) or not (
            0 <= position <= MAX_POSITION and 0 <= phase < DENOMINATOR
        ):
            raise StateError(
                f"loader state has position={position!r}, phase={phase!r}: not a position of a mixture (at most 2**62)"
            )
        if not all(isinstance(q, int) and 0 <= q <= MAX_POSITION for q in at):
            raise StateError(f"loader state has component positions {at!r}: each must be an int from 0 to 2**62")
        if pipeline.partitioning.partitions > 1:
            return pipeline, pipeline.at(position)
        if state.get("weights") == self._weights_id():  # the same interleaving goes on
            comp, _ = schedule(self.shares)
            before = np.bincount(comp[:phase], minlength=len(self.names))
            begin = [q - int(b) for q, b in zip(at, before, strict=True)]
            return pipeline.with_source(self.rebased(position - phase, begin)), position
        return pipeline.with_source(self.rebased(position, at)), position

    def continues(self, other: Stream) -> bool:
        """The same components and weights, and starts a whole number of schedule periods
        apart."""
        if not isinstance(other, Mix) or self.names != other.names or self.shares != other.shares:
            return False
        (sa, qa), (sb, qb) = (m.start or (0, (0,) * len(m.names)) for m in (self, other))
        periods, rest = divmod(sb - sa, DENOMINATOR)
        return rest == 0 and all(y == x + periods * s for x, y, s in zip(qa, qb, self.shares, strict=True))

    def verify_end(self, pipeline: PipelineView) -> int:
        """Until every component with a weight has run through its first epoch (its own
        epoch 0), but at most 2**20 records (a component of tiny weight would take long)."""
        components, ranks = schedule(self.shares)
        end = 0
        for c, (share, size) in enumerate(zip(self.shares, self.sizes, strict=True)):
            if share:  # its last record of epoch 0: the slot of rank (size - 1) % share, (size - 1) // share periods on
                periods, rank = divmod(size - 1, share)
                slot = int(np.flatnonzero((components == c) & (ranks == rank))[0])
                end = max(end, periods * DENOMINATOR + slot + 1)
        return min(end, _VERIFY_RECORDS)

    def first_epochs(self) -> str:
        return "one epoch of every component"

    def record_label(self, component: int, index: int) -> str:
        if 0 <= component < len(self.names):
            return f"{self.names[component]!r} record {index}"
        return f"record {index} of component {component} (no such component)"

    def component_records(self, pipeline: PipelineView, first: Position, position: Position) -> dict[str, int] | None:
        order = self.bind(pipeline.order, pipeline.partitioning)
        now, then = order.component_positions(position), order.component_positions(first)
        return {name: q - p for name, q, p in zip(self.names, now, then, strict=True)}


class MixOrder:
    """A `Mix` bound to the pipeline's order: global positions -> mixture record indices.
    With partitions, a component's own position is a global position of its partitioned
    order (`Partitioning(P, 1)`: partition k's i-th record of the component is `i * P + k`;
    of its one order where the partitions are `shared`)."""

    def __init__(self, mix: Mix, order: Order, partitioning: Partitioning | None = None) -> None:
        self.mix = mix
        self._parts = partitioning if partitioning is not None and partitioning.partitions > 1 else None
        # each partition's slice of every component; shared partitions take turns of its one order
        each = None if self._parts is None or self._parts.shared else Partitioning(self._parts.partitions, 1)
        self.orders: list[GlobalOrder] = [
            GlobalOrder(
                Order(order.shuffle, component_seed(order.seed, name), order.window),
                np.asarray(s.row_group_sizes, np.int64),
                each,
            )
            for name, s in zip(mix.names, mix.sources, strict=True)
        ]
        self._comp, self._rank = schedule(mix.shares)
        self._shares = np.asarray(mix.shares, dtype=np.int64)
        self._slots = [np.flatnonzero(self._comp == c) for c in range(len(mix.names))]
        start, positions = mix.start if mix.start is not None else (0, (0,) * len(mix.names))
        self._start, self._begin = start, np.asarray(positions, dtype=np.int64)

    @property
    def locality(self) -> int:
        return max(o.locality for o in self.orders)

    def _before(self, component: int, slot: np.ndarray) -> np.ndarray:
        """The component's slots before schedule positions `slot` (any periods)."""
        periods, within = np.divmod(slot, DENOMINATOR)
        return periods * self._shares[component] + np.searchsorted(self._slots[component], within)

    def components_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The component of each global position, and that component's own position."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._parts is None:
            periods, slots = np.divmod(positions - self._start, DENOMINATOR)
            comps = self._comp[slots]
            return comps, self._begin[comps] + periods * self._shares[comps] + self._rank[slots]
        partition = self._parts.of(positions)
        shift = partition * self._parts.rows  # partition k's schedule begins k * rows slots on
        periods, slots = np.divmod(self._parts.before(positions, partition) + shift, DENOMINATOR)
        comps = self._comp[slots]
        own = periods * self._shares[comps] + self._rank[slots]
        for c in np.unique(comps):
            mask = comps == c
            own[mask] -= self._before(int(c), shift[mask])
        return comps, own * self._parts.partitions + partition

    def component_positions(self, position: Position) -> list[int]:
        """Records each component has delivered before global `position` (a partitioned
        packed or filtered pipeline's position: before its partitions' own positions)."""
        if self._parts is None:
            periods, slot = divmod(int(position) - self._start, DENOMINATOR)
            counts = np.bincount(self._comp[:slot], minlength=len(self._shares))
            return [int(q) for q in self._begin + periods * self._shares + counts]
        every = np.arange(self._parts.partitions, dtype=np.int64)
        own = np.maximum(position[1:], 0) if isinstance(position, np.ndarray) else self._parts.before(position, every)
        shift = every * self._parts.rows
        return [int((self._before(c, shift + own) - self._before(c, shift)).sum()) for c in range(len(self._shares))]

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        comps, own = self.components_at(positions)
        out = np.empty(len(comps), dtype=np.int64)
        for c in np.unique(comps):
            mask = comps == c
            out[mask] = self.mix.offsets[c] + self.orders[c].indices_at(own[mask])
        return out

    def own_indices(self, components: np.ndarray, own: np.ndarray) -> np.ndarray:
        indices = np.empty(len(own), np.int64)
        for c in np.unique(components):
            mine = components == c
            indices[mine] = self.orders[c].indices_at(own[mine])
        return indices

    def record_keys(self, positions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        components, own = self.components_at(positions)
        epochs = np.empty_like(own)
        for c in np.unique(components):
            mask = components == c
            epochs[mask] = self.orders[c].epochs_at(own[mask])
        local = self.mix.locate(indices)[1]
        return np.stack([components.astype(np.int64) + 1, epochs, local], axis=1)

    def group_ranks_at(self, positions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        comps, own = self.components_at(positions)
        ranks = np.empty(len(comps), dtype=np.int64)
        count = len(self.orders)
        for c in np.unique(comps):
            mask = comps == c
            local = indices[mask] - self.mix.offsets[c]
            ranks[mask] = self.orders[c].group_ranks_at(own[mask], local) * count + c
        return ranks
