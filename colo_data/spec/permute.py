"""`permute`: a keyed bijection of `[0, n)` computed for a whole array of positions at once
(a 4-round Feistel network on the smallest even number of bits that covers n, with cycle
walking back into range). A mixture's components use it for their global shuffle: Grain's
`index_shuffle` is one Python call per record, and costs more the smaller its range
(3.7 µs a record over 40,000 records, 5.8 µs over 10,000 here), while this costs a few
numpy passes per chunk."""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit mixing function of `x` under `key` (splitmix64's finaliser)."""
    z = (x + key) * _M1
    z = (z ^ (z >> np.uint64(30))) * _M2
    z = (z ^ (z >> np.uint64(27))) * _M3
    return z ^ (z >> np.uint64(31))


def _encrypt(x: np.ndarray, keys: np.ndarray, half: np.uint64, mask: np.uint64) -> np.ndarray:
    left, right = x >> half, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << half) | right


def permute(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The image of each position under the permutation of `[0, n)` that `seed` picks.

    Args:
        positions: positions in `[0, n)`.
        n: the size of the range, >= 1.
        seed: the permutation's key, an int in `[0, 2**64)`.
    """
    positions = np.asarray(positions, dtype=np.int64)
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = np.random.SeedSequence(seed).generate_state(_ROUNDS, dtype=np.uint64)
    with np.errstate(over="ignore"):
        out = _encrypt(positions.astype(np.uint64), keys, half, mask)
        outside = np.flatnonzero(out >= np.uint64(n))
        while len(outside):  # cycle walking: at most 4 on average, as 2**bits < 4 * n
            out[outside] = _encrypt(out[outside], keys, half, mask)
            outside = outside[out[outside] >= np.uint64(n)]
    return out.astype(np.int64)
