"""The global order: which record sits at each position of each epoch, computable for any
position without materialising the epoch, and the host slices of a global batch."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

from colo_data.errors import ConfigError
from colo_data.spec.integers import as_int
from colo_data.spec.permute import partition_keys, permute, permute_within

Shuffle = Literal["none", "global", "block"]
# Where a stream stands: records delivered (a stream position), or for a partitioned packed
# or filtered pipeline each partition's own records consumed (`Partitioning.stream`)
Position = int | np.ndarray
_SHUFFLES = ("none", "global", "block")


@dataclass(frozen=True)
class Order:
    """How records are ordered in each epoch. Every mode is a bijection reseeded per epoch.

    Args:
        shuffle: `none`: file order. `global`: a new permutation of all records per epoch
            (uniform up to 2**16 records, a keyed bijection with O(1) memory above;
            `colo_data.spec.permute`). `block`: row groups permuted per epoch,
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
    and host h of H (H dividing `partitions`) serves whole partitions. The `block` and
    `global` orders give each partition its own slice of the data (its own row groups), so
    that a host reads only its partitions' row groups."""

    partitions: int = 1
    rows: int = 1

    def of(self, stream: np.ndarray) -> np.ndarray:
        """The partition of each stream position."""
        return (stream // self.rows) % self.partitions

    def before(self, stream: np.ndarray | int, partition: np.ndarray) -> np.ndarray:
        """How many positions of `partition` come before stream position `stream` (element
        by element)."""
        span = self.rows * self.partitions
        return (stream // span) * self.rows + np.clip(stream % span - partition * self.rows, 0, self.rows)

    def counts(self, first: int, stop: int) -> np.ndarray:
        """Positions of each partition in the stream positions `[first, stop)`."""
        every = np.arange(self.partitions, dtype=np.int64)
        return self.before(stop, every) - self.before(first, every)

    def own(self, position: int) -> np.ndarray:
        """Each partition's own position at stream position `position`: its positions before it."""
        return self.before(position, np.arange(self.partitions, dtype=np.int64))

    def stream(self, partition: np.ndarray | int, own: np.ndarray) -> np.ndarray:
        """The stream positions of `partition`'s own positions `own` (its i-th position in
        the stream is its own position i)."""
        own = np.asarray(own, dtype=np.int64)
        return (own // self.rows) * (self.rows * self.partitions) + np.asarray(partition) * self.rows + own % self.rows

    def owned(self, host: int, hosts: int) -> range:
        """The partitions host `host` of `hosts` owns (`hosts` dividing `partitions`)."""
        share = self.partitions // hosts
        return range(host * share, (host + 1) * share)


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
    """`Order` bound to a source's row-group layout: maps (epoch, positions) to record indices.

    Args:
        order: the order to apply.
        row_group_sizes: records in each of the source's row groups, in global order.
        partitioning: the stream's partitions, if it has more than one: `block` and `global`
            then give each partition's positions in a window (`global`: the epoch) their own
            slice of the window's records in row-group order, shuffled, so that the
            partitions of one host read their own row groups. One partition is the plain
            order.
    """

    _WINDOW_CACHE = 4

    def __init__(self, order: Order, row_group_sizes: np.ndarray, partitioning: Partitioning | None = None) -> None:
        self.order = order
        self._parts = partitioning if partitioning is not None and partitioning.partitions > 1 else None
        self._sizes = row_group_sizes
        self._rg_start = np.concatenate([[0], np.cumsum(row_group_sizes)]).astype(np.int64)
        self._len = int(self._rg_start[-1])
        self._epoch_layout: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
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
        """Record index at each position of `epoch`.

        Args:
            epoch: the epoch; each has its own permutation.
            positions: positions in the epoch, in `[0, len)`.
        """
        positions = np.asarray(positions, dtype=np.int64)
        if self.order.shuffle == "none":
            return positions.copy()
        if self.order.shuffle == "global":
            seed = int(epoch_seed(self.order.seed, epoch).generate_state(1, dtype=np.uint64)[0])
            return permute(positions, self._len, seed) if self._parts is None else self._global_parts(seed, epoch, positions)
        return self._block(epoch, positions)

    def _slots(self, first: int, size: int, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For stream positions in a window of `size` records from stream position `first`:
        their partitions, each one's rank among its partition's positions in the window, and
        where each partition's slice of the window's records (in row-group order) begins (and
        the end)."""
        assert self._parts is not None
        partition = self._parts.of(stream)
        rank = self._parts.before(stream, partition) - self._parts.before(first, partition)
        pieces = np.concatenate([[0], np.cumsum(self._parts.counts(first, first + size))]).astype(np.int64)
        return partition, rank, pieces

    def _global_parts(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """`global` over partitions: each partition's positions in the epoch take a slice of
        the records in file order, permuted by a keyed bijection of its own (O(1) memory)."""
        first = epoch * self._len
        partition, rank, pieces = self._slots(first, self._len, first + positions)
        sizes = pieces[partition + 1] - pieces[partition]
        return pieces[partition] + permute_within(rank, sizes, partition_keys(seed, partition))

    def stream_indices(self, stream: np.ndarray) -> np.ndarray:
        """Record index at each stream position (epoch after epoch, each in its own order).

        Args:
            stream: positions in the stream of epochs, `>= 0`.
        """
        epochs, positions = np.divmod(np.asarray(stream, dtype=np.int64), self._len)
        if not len(epochs) or (epochs == epochs[0]).all():  # the usual case: one epoch (partitions' reads are not sorted)
            return self.indices(int(epochs[0]), positions)
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            indices[mask] = self.indices(int(epoch), positions[mask])
        return indices

    def stream_group_ranks(self, stream: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """`group_ranks` of the records at stream positions `stream` (any epochs)."""
        epochs = np.asarray(stream, dtype=np.int64) // self._len
        ranks = np.empty_like(indices)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ranks[mask] = self.group_ranks(int(epoch), indices[mask])
        return ranks

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This epoch's row-group permutation, the first position of each window, and each
        group's place in the permutation."""
        if self._epoch_layout is None or self._epoch_layout[0] != epoch:
            perm = np.random.default_rng(epoch_seed(self.order.seed, epoch)).permutation(len(self._sizes))
            window_sizes = np.add.reduceat(self._sizes[perm], np.arange(0, len(perm), self.order.window))
            starts = np.concatenate([[0], np.cumsum(window_sizes)]).astype(np.int64)
            ranks = np.empty_like(perm)
            ranks[perm] = np.arange(len(perm))
            self._epoch_layout = (epoch, perm, starts, ranks)
        return self._epoch_layout[1:]

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
        return self._layout(epoch)[2][groups]

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

    def _block(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        perm, starts, _ = self._layout(epoch)
        windows = np.searchsorted(starts, positions, side="right") - 1
        out = np.empty_like(positions)
        w_size = self.order.window
        for window in np.unique(windows):
            mask = windows == window
            groups = perm[window * w_size : (window + 1) * w_size]
            size = int(starts[window + 1] - starts[window])
            if self._parts is None:
                local = self._window_perm(epoch, int(window), size)[positions[mask] - starts[window]]
            else:
                first = epoch * self._len + int(starts[window])
                partition, rank, pieces = self._slots(first, size, epoch * self._len + positions[mask])
                local = self._window_perm(epoch, int(window), size, pieces)[pieces[partition] + rank]
            group_starts = np.concatenate([[0], np.cumsum(self._sizes[groups])])
            k = np.searchsorted(group_starts, local, side="right") - 1
            out[mask] = self._rg_start[groups[k]] + local - group_starts[k]
        return out


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
