"""`SliceBalance` (colo_data/host/slice_balance.py), driven as `SlicedChunks`
(colo_data/host/pool_schedule.py) drives it, with a fake clock: the host's thread starts at half a worker's share, moves toward the
side that leaves the other waiting, keeps a step that makes the batches come faster or that
its waits for the workers call for, and settles back at the first that does neither. No processes, no sleeping."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from colo_data.host.pool_policy import DECIDE_CHUNKS, DECIDE_S
from colo_data.host.slice_balance import SliceBalance, first_share

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

BATCHES = 40  # batches a chunk


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(balance: SliceBalance, clock: Clock, seconds: Callable[[int], tuple[float, float]], chunks: int = 200) -> list[int]:
    """Hand on `chunks` chunks, each taking `seconds(here)` = (its seconds, of which waited
    for the workers); the shares cut to, in turn."""
    cuts = []
    for _ in range(chunks):
        took, waited = seconds(balance.here)
        clock.now += took
        share = balance.record(BATCHES, waited)
        if share is not None:
            cuts.append(share)
            balance.restart()
    return cuts


def pipeline_of(count: int, workers: int, host_s: float, worker_s: float, other_s: float) -> Callable[[int], tuple[float, float]]:
    """A chunk's seconds with `here` of `count` partitions on the host's thread: it computes
    them (`host_s` each) and hands the batches on (`other_s`), while each worker computes
    its even share of the rest (`worker_s` each); the slower side sets the pace, and the
    host waits for the workers where they are the slower."""

    def seconds(here: int) -> tuple[float, float]:
        host = here * host_s + other_s
        workers = (count - here) / workers_n * worker_s
        return max(host, workers), max(0.0, workers - host)

    workers_n = workers
    return seconds


def test_the_first_share_is_half_a_workers_and_leaves_each_worker_one() -> None:
    assert first_share(8, 1) == 3 and first_share(8, 2) == 2 and first_share(64, 1) == 21
    assert first_share(2, 1) == 1 and first_share(3, 2) == 1 and first_share(4, 3) == 1


def test_a_host_that_waits_for_the_workers_takes_partitions_until_the_two_sides_match() -> None:
    """Equal costs, nothing else on the host's thread: half the partitions each is best."""
    clock = Clock()
    balance = SliceBalance(8, 1, clock)
    cuts = run(balance, clock, pipeline_of(8, 1, host_s=0.1, worker_s=0.1, other_s=0.0))
    assert cuts[:1] == [4] and balance.here == 4 and balance.settled, cuts


def test_a_busy_host_thread_gives_partitions_to_the_workers() -> None:
    """The host's thread hands batches on for as long as a partition costs: it keeps fewer."""
    clock = Clock()
    balance = SliceBalance(8, 1, clock)
    cuts = run(balance, clock, pipeline_of(8, 1, host_s=0.1, worker_s=0.1, other_s=0.35))
    assert balance.here == 2 and balance.settled, cuts
    slow = SliceBalance(8, 1, clock)  # and where the worker is much slower, the host takes most
    run(slow, clock, pipeline_of(8, 1, host_s=0.05, worker_s=0.3, other_s=0.0))
    assert slow.here == 7 and slow.settled


def test_a_step_the_hosts_waits_call_for_is_kept_through_a_slower_spell() -> None:
    """The host waits for the worker longer than one of its partitions takes: the step to one
    more is taken and kept even where the machine ran slower while it was measured (its rate
    lower than the share before), where a comparison of rates alone went back."""
    clock = Clock()
    balance = SliceBalance(8, 1, clock)
    even = pipeline_of(8, 1, host_s=0.1, worker_s=0.1, other_s=0.0)

    def slower_from_four(here: int) -> tuple[float, float]:
        took, waited = even(here)
        return (2 * took, 2 * waited) if here >= 4 else (took, waited)

    cuts = run(balance, clock, slower_from_four)
    assert cuts == [4] and balance.here == 4 and balance.settled, cuts
    waits_once = SliceBalance(8, 1, clock)  # waits shorter than a partition: the rates decide, as before
    cuts = run(waits_once, clock, lambda here: (1.0, 0.1) if here == 3 else (1.0, 0.0))
    assert cuts == [4, 3] and waits_once.here == 3 and waits_once.settled, cuts


def test_a_settled_host_that_goes_on_waiting_takes_one_more_at_a_time() -> None:
    """Settled while the rates said nothing (the workers just started), the host's thread then
    waits for its slower workers: one more partition a measurement, until it no longer
    waits longer than one of its partitions takes; there it stays."""
    clock = Clock()
    balance = SliceBalance(8, 2, clock)
    assert run(balance, clock, lambda here: (1.0, 0.0)) == [1, 2] and balance.settled
    cuts = run(balance, clock, pipeline_of(8, 2, host_s=0.1, worker_s=0.3, other_s=0.0), chunks=400)
    assert cuts == [3, 4, 5] and balance.here == 5, cuts  # at 5: the host's 0.5 s against the workers' 0.45 s


def test_a_step_that_does_not_pay_goes_back_and_settles() -> None:
    """A rate that does not change with the share (a pipeline paced by something else):
    one step is tried, undone, and nothing more."""
    clock = Clock()
    balance = SliceBalance(8, 2, clock)
    cuts = run(balance, clock, lambda here: (1.0, 0.0))
    assert cuts == [1, 2] and balance.here == 2 and balance.settled


def test_it_waits_for_a_measurement_and_skips_the_chunk_after_a_cut() -> None:
    clock = Clock()
    balance = SliceBalance(8, 1, clock)
    for _ in range(DECIDE_CHUNKS - 1):  # too few chunks, however long
        clock.now += DECIDE_S
        assert balance.record(BATCHES, 1.0) is None
    clock.now += 0.01
    assert balance.record(BATCHES, 0.0) == 4  # the host waited: one more for it
    balance.restart()
    clock.now += 100.0  # the first chunk after the cut, however slow, is not measured
    assert balance.record(BATCHES, 0.0) is None
    got = []
    for _ in range(DECIDE_CHUNKS):
        clock.now += DECIDE_S / DECIDE_CHUNKS
        got.append(balance.record(BATCHES, 0.0))
    assert got == [None] * (DECIDE_CHUNKS - 1) + [5]  # the step paid (3x the first share's rate): the next one


def test_one_partition_a_worker_leaves_nothing_to_balance() -> None:
    balance = SliceBalance(2, 1, Clock())
    assert balance.here == 1 and balance.settled and balance.record(BATCHES, 5.0) is None
