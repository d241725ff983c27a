"""`permute`, the `global` shuffle: a bijection of [0, n) for any n (small, odd, powers of
two and one past them), the same for the same seed, another for another seed, far from
the identity, and as random as a uniform permutation by two statistics."""

from __future__ import annotations

import numpy as np
import pytest

from colo_data.pipeline.order import Order
from colo_data.pipeline.permute import EXACT, partition_keys, permute, permute_within


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 255, 256, 257, 1000, 4097, 65536, 65537, 100_003])
def test_every_range_is_permuted(n: int) -> None:
    image = permute(np.arange(n), n, seed=12345)
    assert np.array_equal(np.sort(image), np.arange(n)), "a bijection of [0, n)"
    chunks = np.concatenate([permute(part, n, seed=12345) for part in np.array_split(np.arange(n), 7)])
    assert np.array_equal(chunks, image), "any position computed alone gives the same record"


def test_seeds_pick_different_permutations_far_from_the_identity() -> None:
    n = 10_000
    a, b, again = (permute(np.arange(n), n, seed=s) for s in (1, 2, 1))
    assert np.array_equal(a, again)
    assert (a == b).mean() < 0.01 and (a == np.arange(n)).mean() < 0.01
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05, "no trace of the original order"


@pytest.mark.parametrize("n, epochs", [(20, 3000), (EXACT + 1, 300), (1 << 18, 300)])
def test_epochs_look_like_uniform_permutations(n: int, epochs: int) -> None:
    """Over many epochs of one seed, the records left in place and the neighbours kept
    together (record i+1 right after record i) each have mean and variance 1, as in a
    uniform permutation (fixed seed: deterministic). Grain's 4-round `index_shuffle` fails
    the first at 20 records (variance 2.8: about 1 epoch in 1,000 is not shuffled at all),
    a 4-round Feistel fails the second at 2**18 records (mean 1.4, variance 2.4)."""
    bound = Order("global", seed=2024).bind(np.array([n // 3, n - n // 3]))
    everything = np.arange(n)
    fixed, kept = np.empty(epochs), np.empty(epochs)
    for epoch in range(epochs):
        image = bound.indices(epoch, everything)
        fixed[epoch] = np.count_nonzero(image == everything)
        kept[epoch] = np.count_nonzero(np.diff(image) == 1)
    for name, counts in (("records in place", fixed), ("neighbours kept", kept)):
        assert 0.85 < counts.mean() < 1.15 and 0.75 < counts.var() < 1.3, (name, counts.mean(), counts.var())


@pytest.mark.parametrize("n", [1, 2, 7, 20, 40, 257, EXACT + 1])
def test_each_partitions_range_is_permuted_apart(n: int) -> None:
    """`permute_within`: many partitions at once, each with a range and key of its own (here
    the ranges n and n + 3 in turn), every one a bijection of its range, the same whether
    its positions come together or mixed with the others'."""
    parts = np.arange(6)
    sizes = np.where(parts % 2 == 0, n, n + 3)
    positions = np.concatenate([np.arange(s) for s in sizes])
    owner = np.repeat(parts, sizes)
    image = permute_within(positions, sizes[owner], partition_keys(99, owner))
    for k in parts:
        assert np.array_equal(np.sort(image[owner == k]), np.arange(sizes[k])), f"partition {k}"
    shuffled = np.random.default_rng(0).permutation(len(positions))
    again = permute_within(positions[shuffled], sizes[owner][shuffled], partition_keys(99, owner[shuffled]))
    assert np.array_equal(again, image[shuffled])


@pytest.mark.parametrize("n", [20, 1 << 18])
def test_partitions_look_like_uniform_permutations(n: int) -> None:
    """Over 2,000 partitions' keys (20 records) or 300 (2**18), the records left in place and
    the neighbours kept together have mean and variance about 1, as in a uniform permutation."""
    count = 2000 if n == 20 else 300
    everything = np.arange(n)
    fixed, kept = np.empty(count), np.empty(count)
    for k in range(count):
        image = permute_within(everything, np.full(n, n), partition_keys(7, np.full(n, k)))
        fixed[k] = np.count_nonzero(image == everything)
        kept[k] = np.count_nonzero(np.diff(image) == 1)
    for name, counts in (("records in place", fixed), ("neighbours kept", kept)):
        assert 0.85 < counts.mean() < 1.15 and 0.75 < counts.var() < 1.3, (name, counts.mean(), counts.var())
