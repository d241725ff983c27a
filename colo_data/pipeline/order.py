"""The global order: which record sits at each position of each epoch, computable for any
position without materialising the epoch, and the host slices of a global batch."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

from colo_data.errors import ConfigError
from colo_data.pipeline.permute import partition_keys, permute, permute_within
from colo_data.setting_checks import as_int

Shuffle = Literal["none", "global", "block"]
_DEALT = 2**63  # the spawn key of a partitioned block order's dealing of row groups: no epoch's (those are < 2**63)
# Where the stream stands: records delivered (the global position), or for a partitioned
# packed or filtered pipeline each partition's own records consumed (`Partitioning.own`)
Position = int | np.ndarray
_SHUFFLES = ("none", "global", "block")


@dataclass(frozen=True)
class Order:
    """How records are ordered in each epoch. Every mode is a bijection reseeded per epoch.

    Args:
        shuffle: `none`: file order. `global`: a new permutation of all records per epoch
            (uniform up to 2**16 records, a keyed bijection with O(1) memory above;
            `colo_data.pipeline.permute`). `block`: row groups permuted per epoch,
            records shuffled inside windows of `window` row groups, so a batch reads at most
            `window` row groups (plus the next window's at a boundary).
        seed: the seed of every epoch's permutation, an int in `[0, 2**63)`.
        window: row groups per shuffle window in `block` mode.
    """

    shuffle: Shuffle = "none"
    seed: int = 0
    window: int = 8

    def __post_init__(self) -> None:
        if self.shuffle not in _SHUFFLES:
            raise ConfigError(f"Order(shuffle={self.shuffle!r}): allowed values are {', '.join(_SHUFFLES)}")
        seed, window = as_int(self.seed), as_int(self.window)
        if seed is None or not 0 <= seed < 2**63:
            raise ConfigError(f"Order(seed={self.seed!r}): must be an int in [0, 2**63)")
        if window is None or window < 1:
            raise ConfigError(f"Order(window={self.window!r}): must be a positive number of row groups")
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "window", window)

    def describe(self) -> str:
        """The order's identity without the seed, as saved in a loader state."""
        return f"block:{self.window}" if self.shuffle == "block" else self.shuffle

    def bind(self, row_group_sizes: np.ndarray, partitioning: Partitioning | None = None) -> GlobalOrder:
        """This order over a source whose row groups hold `row_group_sizes` records each
        (and the stream's `partitioning`, if it has one)."""
        return GlobalOrder(self, np.asarray(row_group_sizes, dtype=np.int64), partitioning)


@dataclass(frozen=True)
class Partitioning:
    """The stream cut into `partitions` partitions, `rows` consecutive positions at a time in
    turn: position p is partition `(p // rows) % partitions`'s. With `rows` a global batch's
    rows over `partitions`, partition k is rows `[k*rows, (k+1)*rows)` of every global batch,
    and host h of H (H dividing `partitions`) serves whole partitions. Under the `block` and
    `global` orders each partition runs through epochs of its own, its slice of every
    window's records (`GlobalOrder`), so that a host reads only its partitions' row
    groups. `origin` (a multiple of `partitions` below `rows * partitions`) is where the
    turns start: a padded stream resumed at another batch size, whose partitions have
    each taken `position / partitions` records at the state's position, turns from there
    in rows of the new size; the mapping holds for positions from `origin` on, and one
    before it is a ConfigError (`before`). `shared` partitions (a filtered pipeline's,
    `Pipeline.partitioning`) have no epochs of their own: they take their turns of the one
    order of the stream, as under `none`, so that each partition's records are a sample of
    every part of the stream."""

    partitions: int = 1
    rows: int = 1
    origin: int = 0
    shared: bool = False

    def of(self, positions: np.ndarray) -> np.ndarray:
        """The partition of each global position."""
        return ((positions - self.origin) // self.rows) % self.partitions

    def before(self, positions: np.ndarray | int, partition: np.ndarray) -> np.ndarray:
        """How many positions of `partition` come before global position `positions` (element
        by element). ConfigError for a position before `origin`: the turns before it were
        of another batch size, which a restored pipeline does not know, and read here they
        would fall on other records (negative positions of the partitions)."""
        if self.origin and np.any(np.asarray(positions) < self.origin):
            raise ConfigError(
                f"partition_origin={self.origin}: position {int(np.min(positions)):,} comes before it. A restore sets "
                "it where the partitions of a padded pipeline resumed at another batch size than its state's take rows "
                "of the new one from, and the stream before it is not that pipeline's to read: give partition_origin=0 "
                "(the pipeline as made) to read from the stream's start, or restore the state"
            )
        span, shifted = self.rows * self.partitions, positions - self.origin
        taken = (shifted // span) * self.rows + np.clip(shifted % span - partition * self.rows, 0, self.rows)
        return taken + self.origin // self.partitions

    def own(self, position: int) -> np.ndarray:
        """Each partition's own position at global position `position`: its positions before it."""
        return self.before(position, np.arange(self.partitions, dtype=np.int64))

    def global_positions(self, partition: np.ndarray | int, own: np.ndarray) -> np.ndarray:
        """The global positions of `partition`'s own positions `own` (its i-th position in
        the stream is its own position i)."""
        own = np.asarray(own, dtype=np.int64) - self.origin // self.partitions
        turns = (own // self.rows) * (self.rows * self.partitions)
        return turns + np.asarray(partition) * self.rows + own % self.rows + self.origin

    def bounds(self, records: np.ndarray | int, partition: np.ndarray | int) -> np.ndarray:
        """Where partition `partition`'s slice of `records` records begins when they are
        cut into P slices as evenly as integers allow (`partition` P: the end): its own
        records of each epoch (`GlobalOrder`) are its slice."""
        return np.asarray(partition, dtype=np.int64) * np.asarray(records, dtype=np.int64) // self.partitions

    def epoch_records(self, records: int, partition: np.ndarray | int) -> np.ndarray:
        """Records in each of partition `partition`'s own epochs, of an epoch of `records`:
        `records / P`, rounded down or up."""
        return self.bounds(records, np.asarray(partition) + 1) - self.bounds(records, partition)

    def owned(self, host: int, hosts: int) -> range:
        """The partitions that host `host` of `hosts` computes: those its rows of every batch
        fall in. Where `hosts` divides `partitions` they are its own alone; otherwise two
        hosts share a partition at their boundary (each computes it and keeps its rows)."""
        per_host = self.rows * self.partitions // hosts
        return range(host * per_host // self.rows, -(-(host + 1) * per_host // self.rows))

    def kept(self, host: int, hosts: int, partitions: range) -> range:
        """Host `host` of `hosts`'s rows of each batch among the rows of `partitions` (a
        slice of its own), counted from the first of those partitions' rows."""
        per_host, first = self.rows * self.partitions // hosts, partitions.start * self.rows
        start = min(max(host * per_host, first), partitions.stop * self.rows)
        return range(start - first, max(start, min((host + 1) * per_host, partitions.stop * self.rows)) - first)


def epoch_seed(seed: int, epoch: int, *more: int) -> np.random.SeedSequence:
    """The seed sequence of one epoch (and window) of an order's seed.

    Args:
        seed: the order's seed.
        epoch: the epoch.
        *more: further keys, e.g. a shuffle window.
    """
    # The seed is the entropy and (epoch, *more) the spawn key: an entropy list like
    # [seed, epoch, *more] is ambiguous (trailing zeros are ignored, so [s, e, 0] == [s, e],
    # and a seed >= 2**32 spans two words, so [s + e * 2**32] == [s, e]).
    return np.random.SeedSequence(seed, spawn_key=(epoch, *more))


class GlobalOrder:
    """`Order` bound to a source's row-group layout: maps global positions to record indices.

    Args:
        order: the order to apply.
        row_group_sizes: records in each of the source's row groups, in global order.
        partitioning: the stream's partitions, if it has more than one (and they are not
            `shared`, which take turns of the one order). Under `block` and `global` each
            partition then runs through epochs of its own (`_own_indices`):
            its own positions take, window after window, its slice of each window's records
            (`global`: of the epoch's) in row-group order, the P slices cut as evenly as
            integers allow, each shuffled apart. A host's partitions are neighbours, so it
            reads its own row groups, and where a window splits evenly at row-group
            boundaries no row group is read by two hosts; `block`'s windows are dealt so
            that those are the same row groups every epoch (`_dealt_windows`). A window of
            fewer records than partitions is joined to the one before. `none` is file
            order, partitions or not.
    """

    _WINDOW_CACHE = 4

    def __init__(self, order: Order, row_group_sizes: np.ndarray, partitioning: Partitioning | None = None) -> None:
        self.order = order
        many = partitioning is not None and partitioning.partitions > 1 and not partitioning.shared
        many = many and order.shuffle != "none"
        self._own = partitioning if many else None
        self._sizes = row_group_sizes
        self._rg_start = np.concatenate([[0], np.cumsum(row_group_sizes)]).astype(np.int64)
        self._len = int(self._rg_start[-1])
        self._epoch_layout: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self._len

    @property
    def locality(self) -> int:
        """Positions over which reads stay in the same few row groups: how far ahead it pays
        to start decoding (0 for `global`, where every batch reads anywhere)."""
        largest = int(self._sizes.max(initial=0))
        return {"none": largest, "block": self.order.window * largest, "global": 0}[self.order.shuffle]

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Record index at each position of `epoch`; with partitions of their own epochs,
        position `Partitioning.bounds(len, k) + j` is partition k's j-th record of its epoch.

        Args:
            epoch: the epoch; each has its own permutation.
            positions: positions in the epoch, in `[0, len)`.
        """
        positions = np.asarray(positions, dtype=np.int64)
        if self.order.shuffle == "none":
            return positions.copy()
        if self._own is not None:
            every = np.arange(self._own.partitions + 1, dtype=np.int64)
            partition = np.searchsorted(self._own.bounds(self._len, every), positions, side="right") - 1
            return self._own_indices(epoch, partition, positions - self._own.bounds(self._len, partition))
        if self.order.shuffle == "global":
            return permute(positions, self._len, self._global_seed(epoch))
        return self._block(epoch, positions)

    def _global_seed(self, epoch: int) -> int:
        return int(epoch_seed(self.order.seed, epoch).generate_state(1, dtype=np.uint64)[0])

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Record index at each global position (epoch after epoch, each in its own order;
        with partitions of their own epochs, each partition's).

        Args:
            positions: global positions, in the stream of epochs, `>= 0`.
        """
        positions = np.asarray(positions, dtype=np.int64)
        indices = np.empty_like(positions)
        if self._own is not None:
            partition = self._own.of(positions)
            epochs, within = np.divmod(self._own.before(positions, partition), self._own.epoch_records(self._len, partition))
            for epoch, mask in _by_epoch(epochs):
                indices[mask] = self._own_indices(epoch, partition[mask], within[mask])
            return indices
        epochs, within = np.divmod(positions, self._len)
        for epoch, mask in _by_epoch(epochs):
            indices[mask] = self.indices(epoch, within[mask])
        return indices

    def epochs_at(self, positions: np.ndarray) -> np.ndarray:
        """The epoch of each global position (with partitions of their own epochs, its
        partition's)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._own is None:
            return positions // self._len
        partition = self._own.of(positions)
        return self._own.before(positions, partition) // self._own.epoch_records(self._len, partition)

    def group_ranks_at(self, positions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """`group_ranks` of the records at global positions `positions` (any epochs)."""
        ranks = np.empty_like(indices)
        for epoch, mask in _by_epoch(self.epochs_at(positions)):
            ranks[mask] = self.group_ranks(epoch, indices[mask])
        return ranks

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This epoch's row-group permutation, the first position of each window (and the
        end), the first place in the permutation of each window's groups (and the end), and
        each group's place in the permutation."""
        if self._epoch_layout is None or self._epoch_layout[0] != epoch:
            if self._own is None:
                perm = np.random.default_rng(epoch_seed(self.order.seed, epoch)).permutation(len(self._sizes))
                firsts = np.arange(0, len(perm), self.order.window)
            else:
                perm, firsts = self._dealt_windows(epoch)
                firsts = self._joined(firsts, np.add.reduceat(self._sizes[perm], firsts))
            window_sizes = np.add.reduceat(self._sizes[perm], firsts)
            starts = np.concatenate([[0], np.cumsum(window_sizes)]).astype(np.int64)
            ranks = np.empty_like(perm)
            ranks[perm] = np.arange(len(perm))
            self._epoch_layout = (epoch, perm, starts, np.append(firsts, len(perm)), ranks)
        return self._epoch_layout[1:]

    def _dealt_windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """A partitioned epoch's row-group permutation and the first place of each window in
        it. The groups are dealt once (from the seed alone) into the W places of a window:
        each epoch's windows take one group of each place, a new one in a new window order,
        and the groups left over (fewer than W) make one window of the same groups every
        epoch, at a place of its own in each. So a partition's slice of every window falls
        on the same places, and a host's partitions on the same row groups, epoch after
        epoch (exactly where the groups hold equal records)."""
        window = self.order.window
        dealt = np.random.default_rng(np.random.SeedSequence(self.order.seed, spawn_key=(_DEALT,))).permutation(len(self._sizes))
        full = len(dealt) // window
        rng = np.random.default_rng(epoch_seed(self.order.seed, epoch))
        windows = list(rng.permuted(dealt[: full * window].reshape(full, window), axis=0))
        if len(dealt) > full * window:
            windows.append(dealt[full * window :])
        ordered = [windows[i] for i in rng.permutation(len(windows))]
        firsts = np.cumsum([0] + [len(w) for w in ordered[:-1]]).astype(np.int64)
        return np.concatenate(ordered), firsts

    def _joined(self, firsts: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Window firsts with every window of fewer records than partitions joined to the
        one before (the first to the next), so that each partition has records in each."""
        assert self._own is not None
        if (records >= self._own.partitions).all():
            return firsts
        kept: list[int] = []
        held = self._own.partitions  # records in the window being built
        for first, count in zip(firsts.tolist(), records.tolist(), strict=True):
            if held >= self._own.partitions:
                kept.append(first)
                held = 0
            held += count
        if held < self._own.partitions and len(kept) > 1:
            kept.pop()
        return np.array(kept, dtype=np.int64)

    def group_ranks(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """Where the row group of each record comes in `epoch`'s reading order: `block`
        reads the groups in a permuted order, window by window, the other modes in file
        order. Worker processes split a chunk by rank modulo their count, so each decodes
        its own row groups, and in `block` mode as many of each window as the others.

        Args:
            epoch: the epoch the records are read in.
            indices: record indices, in `[0, len)`.
        """
        groups = np.searchsorted(self._rg_start, indices, side="right") - 1
        if self.order.shuffle != "block":
            return groups
        return self._layout(epoch)[3][groups]

    def _window_perm(self, epoch: int, window: int, size: int, pieces: np.ndarray | None = None) -> np.ndarray:
        """The window's shuffle: a permutation of its records (in row-group order); with
        `pieces` (where the partitions' slices begin), grouped by slice, each slice's records
        in the permutation's order, so that the partition's i-th position in the window
        takes `perm[pieces[k] + i]`."""
        key = (epoch, window)
        perm = self._windows.get(key)
        if perm is None:
            perm = np.random.default_rng(epoch_seed(self.order.seed, epoch, window)).permutation(size)
            if pieces is not None:
                perm = perm[np.argsort(np.searchsorted(pieces, perm, side="right"), kind="stable")]
            self._windows[key] = perm
            if len(self._windows) > self._WINDOW_CACHE:
                self._windows.popitem(last=False)
        return perm

    def _in_window(self, epoch: int, window: int, local: np.ndarray) -> np.ndarray:
        """The record indices of positions `local` of a window's records in row-group order."""
        perm, _, firsts, _ = self._layout(epoch)
        groups = perm[firsts[window] : firsts[window + 1]]
        group_starts = np.concatenate([[0], np.cumsum(self._sizes[groups])])
        k = np.searchsorted(group_starts, local, side="right") - 1
        return self._rg_start[groups[k]] + local - group_starts[k]

    def _block(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        _, starts, _, _ = self._layout(epoch)
        windows = np.searchsorted(starts, positions, side="right") - 1
        out = np.empty_like(positions)
        for window in np.unique(windows):
            mask = windows == window
            size = int(starts[window + 1] - starts[window])
            perm = self._window_perm(epoch, int(window), size)
            out[mask] = self._in_window(epoch, int(window), perm[positions[mask] - starts[window]])
        return out

    def _own_indices(self, epoch: int, partition: np.ndarray, within: np.ndarray) -> np.ndarray:
        """The records of partitions' own positions `within` their epoch `epoch`: `global`
        permutes each partition's slice of the epoch by a keyed bijection of its own (O(1)
        memory); `block` gives it, window after window, its slice of the window
        (`Partitioning.bounds` of the window's records), shuffled."""
        parts = self._own
        assert parts is not None
        if self.order.shuffle == "global":
            size = parts.epoch_records(self._len, partition)
            keys = partition_keys(self._global_seed(epoch), partition)
            return parts.bounds(self._len, partition) + permute_within(within, size, keys)
        _, starts, _, _ = self._layout(epoch)

        def before(window: np.ndarray) -> np.ndarray:  # the partition's own positions in the windows before
            return parts.bounds(starts[window], partition + 1) - parts.bounds(starts[window], partition)

        # windows hold at least P records, so a partition's share of those before lies
        # within a record or two of (their records) / P: start there, step to the right one
        windows = np.clip(np.searchsorted(starts, within * parts.partitions, side="right") - 1, 0, len(starts) - 2)
        while True:
            low, high = within < before(windows), within >= before(windows + 1)
            if not (low.any() or high.any()):
                break
            windows += high.astype(np.int64) - low
        slice_start = parts.bounds(starts[windows + 1], partition) - parts.bounds(starts[windows], partition)
        offset = slice_start + within - before(windows)
        every = np.arange(parts.partitions + 1, dtype=np.int64)
        out = np.empty_like(within)
        for window in np.unique(windows):
            mask = windows == window
            pieces = parts.bounds(starts[window + 1], every) - parts.bounds(starts[window], every)
            perm = self._window_perm(epoch, int(window), int(starts[window + 1] - starts[window]), pieces)
            out[mask] = self._in_window(epoch, int(window), perm[offset[mask]])
        return out


def _by_epoch(epochs: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
    """The epochs among global positions' `epochs`, each with where its positions are."""
    if not len(epochs) or (epochs == epochs[0]).all():  # the usual case: one epoch
        return [(int(epochs[0]) if len(epochs) else 0, slice(None))]
    return [(int(e), epochs == e) for e in np.unique(epochs)]


def host_rows(global_batch_size: int, host: int, hosts: int) -> tuple[int, int]:
    """Row range `[start, stop)` of a global batch that host `host` of `hosts` serves.

    Args:
        global_batch_size: rows of the global batch; a multiple of `hosts`.
        host: this host's number, in `[0, hosts)`.
        hosts: the number of hosts that share the batch.

    Raises:
        ConfigError: the host is out of range or the batch does not split evenly.
    """
    if hosts < 1 or not 0 <= host < hosts:
        raise ConfigError(f"host {host} of {hosts}: need 0 <= host < hosts and hosts >= 1")
    if global_batch_size % hosts:
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not divisible by {hosts} hosts: "
            f"use a multiple of {hosts} (e.g. {global_batch_size - global_batch_size % hosts or hosts})."
        )
    per_host = global_batch_size // hosts
    return host * per_host, (host + 1) * per_host
