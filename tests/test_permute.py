"""`permute`, a mixture component's global shuffle: a bijection of [0, n) for any n (small,
odd, powers of two and one past them), the same for the same seed, another for another
seed, and far from the identity."""

from __future__ import annotations

import numpy as np
import pytest

from colo_data.spec.permute import permute


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
