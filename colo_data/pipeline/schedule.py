"""A mixture's schedule: weights as whole slots of a period of `DENOMINATOR`
positions, and the periodic order of the components' slots, in which every prefix gives
each component its share to within one record."""

from __future__ import annotations

import functools
import hashlib
import heapq

import numpy as np

DENOMINATOR = 1 << 16  # weights are rounded to multiples of 1/DENOMINATOR: one schedule period


def integer_shares(weights: list[float]) -> tuple[int, ...]:
    """Weights as whole slots of a period of `DENOMINATOR`, by largest remainder (a weight
    above zero keeps at least one slot, so no component that was asked for is dropped)."""
    w = np.asarray(weights, dtype=np.float64)
    scaled = w / w.sum() * DENOMINATOR
    shares = np.floor(scaled).astype(np.int64)
    shares[(w > 0) & (shares == 0)] = 1
    rest = DENOMINATOR - int(shares.sum())
    order = np.argsort(-(scaled - shares), kind="stable")
    if rest >= 0:
        shares[order[:rest]] += 1
    else:  # the slots given to tiny weights come out of the largest shares
        for i in np.argsort(-shares, kind="stable")[: -rest]:
            shares[i] -= 1
    return tuple(int(s) for s in shares)


@functools.lru_cache(maxsize=8)
def schedule(shares: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One period: the component of each slot, and the slot's rank among its component's.

    Earliest deadline first over each component's n-th record of the period, released at
    floor((n - 1) * D / share) and due by ceil(n * D / share) (proportionate-fair windows):
    with the shares summing to D, every record lands in its window, so in every prefix each
    component's count is within one record of its exact share (the tests check it).
    """
    comp = np.empty(DENOMINATOR, np.int32)
    rank = np.empty(DENOMINATOR, np.int64)
    done = [0] * len(shares)
    ready: list[tuple[int, int]] = []  # (deadline, component) of each component's next record
    waiting = [(0, c) for c, s in enumerate(shares) if s]  # (release, component)
    heapq.heapify(waiting)
    for t in range(DENOMINATOR):
        while waiting and waiting[0][0] <= t:
            _, c = heapq.heappop(waiting)
            heapq.heappush(ready, (-(-(done[c] + 1) * DENOMINATOR // shares[c]), c))
        _, c = heapq.heappop(ready)
        comp[t], rank[t] = c, done[c]
        done[c] += 1
        if done[c] < shares[c]:
            heapq.heappush(waiting, (done[c] * DENOMINATOR // shares[c], c))
    return comp, rank


def component_seed(seed: int, name: str) -> int:
    """The seed of a component's own order: from the pipeline's seed and the name alone."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # in [0, 2**63)
