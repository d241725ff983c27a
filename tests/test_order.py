"""Property tests of the global order (`Order` / `GlobalOrder`) and of the host slices of a
global batch (`host_rows`): every mode is a bijection addressable position by position,
reshuffled per epoch, `block` keeps reads inside a window's row groups, bad settings are
errors that name the setting."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colo_data as cd
from colo_data import Order
from colo_data.errors import ConfigError
from colo_data.pipeline.order import host_rows

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

MODES = ("none", "global", "block")

seeds = st.integers(min_value=0, max_value=2**63 - 1)
windows = st.integers(min_value=1, max_value=10)
epochs = st.integers(min_value=0, max_value=5)
# Row-group layouts: sizes 0..50 (zeros included), up to 40 groups, at least one record.
layouts = st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=40).filter(lambda s: sum(s) > 0)
# Layouts big enough that two independent shuffles coincide only with negligible probability.
big_layouts = st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=40).filter(lambda s: sum(s) >= 20)

SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


def _full(order: Order, sizes: list[int], epoch: int) -> np.ndarray:
    n = sum(sizes)
    return order.bind(np.array(sizes)).indices(epoch, np.arange(n))


def _group_of(sizes: list[int], records: np.ndarray) -> np.ndarray:
    """Row group holding each record index (zero-size groups never match)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return np.searchsorted(starts, records, side="right") - 1


# --- bijection and per-position addressability -------------------------------------------


@SETTINGS
@given(st.sampled_from(MODES), seeds, layouts, windows, epochs, st.data())
def test_indices_is_a_bijection_addressable_per_position(mode, seed, sizes, window, epoch, data):
    order = Order(shuffle=mode, seed=seed, window=window)
    n = sum(sizes)
    bound = order.bind(np.array(sizes))
    assert len(bound) == n

    full = bound.indices(epoch, np.arange(n))
    assert full.shape == (n,)
    assert np.issubdtype(full.dtype, np.integer)
    assert np.array_equal(np.sort(full), np.arange(n)), "not a permutation of range(n)"

    # A random subset of positions in random order, on a fresh binding whose caches were
    # first filled by another epoch: each position is computable on its own.
    subset = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=min(n, 60)), label="subset")
    fresh = order.bind(np.array(sizes))
    fresh.indices(epoch + 1, np.arange(min(n, 7))[::-1])
    positions = np.array(subset, dtype=np.int64)
    assert np.array_equal(fresh.indices(epoch, positions), full[positions])
    assert np.array_equal(positions, np.array(subset, dtype=np.int64)), "indices() modified its input"
    for p in subset[:5]:
        assert int(fresh.indices(epoch, np.array([p]))[0]) == int(full[p])
    # The same binding still answers the earlier epoch the same way after another epoch.
    bound.indices(epoch + 2, np.arange(n))
    assert np.array_equal(bound.indices(epoch, np.arange(n)), full)


@SETTINGS
@given(seeds, layouts, windows, epochs)
def test_none_is_the_identity(seed, sizes, window, epoch):
    n = sum(sizes)
    assert np.array_equal(_full(Order("none", seed, window), sizes, epoch), np.arange(n))
    assert np.array_equal(_full(Order("none", seed, window), sizes, epoch + 1), np.arange(n))


# --- reseeded per epoch ---------------------------------------------------------------------


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(("global", "block")), seeds, big_layouts, windows, epochs, st.data())
def test_shuffled_modes_reshuffle_per_epoch_and_are_reproducible(mode, seed, sizes, window, epoch, data):
    n = sum(sizes)
    assert n >= 20
    order = Order(mode, seed, window)
    this_epoch = _full(order, sizes, epoch)
    assert not np.array_equal(this_epoch, np.arange(n)), "a shuffled epoch came out in file order"
    assert not np.array_equal(this_epoch, _full(order, sizes, epoch + 1)), "epoch e+1 repeats epoch e"
    # Same (seed, epoch) from a fresh bind and a fresh Order: the same order.
    assert np.array_equal(_full(Order(mode, seed, window), sizes, epoch), this_epoch)
    other = data.draw(seeds.filter(lambda s: s != seed), label="other seed")
    assert not np.array_equal(_full(Order(mode, other, window), sizes, epoch), this_epoch), "seed ignored"


@pytest.mark.parametrize(
    "mode, sizes, window, epochs",
    [("global", [3], 8, 600), ("block", [3], 8, 600), ("block", [1, 1, 1], 3, 600), ("block", [2, 0, 1], 3, 600)],
)
def test_small_shuffles_reach_every_permutation_evenly(mode, sizes, window, epochs):
    """Over many epochs all 3! orders of 3 records appear, each near epochs/6 times (fixed
    seed: deterministic, so not flaky). For `block` with several row groups in one window
    this fails if the window's record shuffle is correlated with the row-group permutation
    (composing a permutation with itself reaches only 3 of the 6 orders)."""
    bound = Order(mode, seed=1234, window=window).bind(np.array(sizes))
    counts = Counter(tuple(bound.indices(e, np.arange(3)).tolist()) for e in range(epochs))
    assert set(counts) == set(itertools.permutations(range(3)))
    expected = epochs / 6
    assert all(expected / 3 <= c <= expected * 2 for c in counts.values()), counts


@pytest.mark.parametrize("mode", ["global", "block"])
def test_seed_and_epoch_do_not_alias(mode):
    """(seed, epoch) pairs are kept apart: seed s at epoch e is not seed s + e * 2**32 at
    epoch 0 (an entropy list [seed, epoch] would make them equal)."""
    sizes = [7, 5, 9, 4]
    s, e = 7, 3
    assert not np.array_equal(_full(Order(mode, s, 2), sizes, e), _full(Order(mode, s + e * 2**32, 2), sizes, 0))


# --- block locality ---------------------------------------------------------------------------


@SETTINGS
@given(seeds, layouts, windows, epochs)
def test_block_reads_stay_inside_a_window_of_row_groups(seed, sizes, window, epoch):
    n = sum(sizes)
    bound = Order("block", seed, window).bind(np.array(sizes))
    groups = _group_of(sizes, bound.indices(epoch, np.arange(n)))
    sizes_arr = np.array(sizes)

    # The first window: positions [0, k) read only whole row groups, at most `window` of them.
    window_starts = bound._layout(epoch)[1]  # internal: first position of each window
    assert window_starts[0] == 0 and window_starts[-1] == n
    assert np.all(np.diff(window_starts) >= 0)
    for w in range(len(window_starts) - 1):
        lo, hi = int(window_starts[w]), int(window_starts[w + 1])
        touched = set(groups[lo:hi].tolist())
        assert len(touched) <= window, f"window {w} reads {len(touched)} row groups > {window}"
        assert sum(sizes_arr[g] for g in touched) == hi - lo, f"window {w} reads part of a row group"
    k = int(window_starts[1])
    assert len(set(groups[:k].tolist())) <= window

    # Black-box form: cut the stream wherever every row group read so far is complete; each
    # piece then lies inside one window, so it reads at most `window` row groups.
    remaining = sizes_arr.copy()
    open_groups: set[int] = set()
    piece: set[int] = set()
    for g in groups.tolist():
        remaining[g] -= 1
        piece.add(g)
        open_groups.add(g)
        if remaining[g] == 0:
            open_groups.discard(g)
        if not open_groups:
            assert len(piece) <= window, f"{len(piece)} row groups read between complete points"
            piece = set()
    assert not piece and not open_groups and not remaining.any()


@SETTINGS
@given(seeds, st.integers(1, 50), st.integers(1, 40), windows, epochs)
def test_block_window_with_one_row_group_each_is_row_group_order(seed, size, count, window, epoch):
    """With window=1 each window is a single row group: position runs of `size` records
    each come from one row group, and the row groups are visited in a permuted order."""
    sizes = [size] * count
    bound = Order("block", seed, 1).bind(np.array(sizes))
    groups = _group_of(sizes, bound.indices(epoch, np.arange(size * count))).reshape(count, size)
    assert np.all(groups == groups[:, :1])
    assert sorted(groups[:, 0].tolist()) == list(range(count))


# --- validation, describe, locality ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"shuffle": "random"}, "shuffle"),
        ({"shuffle": "Global"}, "shuffle"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"shuffle": "block", "window": 0}, "window"),
        ({"window": -3}, "window"),
        ({"window": 2.0}, "window"),
    ],
)
def test_order_rejects_bad_settings_naming_them(kwargs, setting):
    with pytest.raises(ConfigError, match=setting) as info:
        Order(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, cd.ColoDataError)
    if setting == "shuffle":
        for allowed in MODES:
            assert allowed in str(info.value)


def test_order_accepts_the_edges_of_its_ranges():
    assert Order("global", seed=2**63 - 1, window=1).seed == 2**63 - 1
    assert Order("block", seed=0, window=1).window == 1


def test_describe_names_the_mode_and_window_without_the_seed():
    assert Order().describe() == "none"
    assert Order("none", seed=5, window=3).describe() == "none"
    assert Order("global", seed=5).describe() == "global"
    assert Order("global", seed=6).describe() == Order("global", seed=5).describe()
    assert Order("block", seed=5, window=3).describe() == "block:3"
    assert Order("block", seed=9, window=12).describe() == "block:12"


def test_locality_per_mode():
    sizes = np.array([4, 0, 9, 2])
    assert Order("none").bind(sizes).locality == 9
    assert Order("global").bind(sizes).locality == 0
    assert Order("block", window=3).bind(sizes).locality == 27


# --- host slices -------------------------------------------------------------------------------


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 16), st.integers(1, 64))
def test_host_rows_partition_the_batch_contiguously_in_order(hosts, per_host):
    batch = hosts * per_host
    ranges = [host_rows(batch, h, hosts) for h in range(hosts)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == batch
    for (start, stop), (next_start, _) in zip(ranges, ranges[1:]):
        assert stop == next_start
    assert all(stop - start == per_host for start, stop in ranges)
    covered = np.concatenate([np.arange(start, stop) for start, stop in ranges])
    assert np.array_equal(covered, np.arange(batch))


@settings(deadline=None, max_examples=100)
@given(st.integers(2, 16), st.integers(0, 64), st.data())
def test_host_rows_rejects_a_batch_not_divisible_by_hosts(hosts, multiple, data):
    remainder = data.draw(st.integers(1, hosts - 1), label="remainder")
    batch = hosts * multiple + remainder
    for h in (0, hosts - 1):
        with pytest.raises(ConfigError, match="global_batch_size") as info:
            host_rows(batch, h, hosts)
        assert str(batch) in str(info.value) and str(hosts) in str(info.value)


@pytest.mark.parametrize("host, hosts", [(2, 2), (-1, 2), (0, 0), (5, 4)])
def test_host_rows_rejects_a_host_outside_the_range(host, hosts):
    with pytest.raises(ConfigError, match="host"):
        host_rows(8, host, hosts)


def test_host_rows_examples():
    assert host_rows(8, 0, 1) == (0, 8)
    assert host_rows(8, 1, 4) == (2, 4)
    assert host_rows(12, 2, 3) == (8, 12)
