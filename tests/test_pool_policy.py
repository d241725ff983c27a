"""`PoolPolicy` (colo_data/host/pool_policy.py), driven as `PooledChunks` (pool_schedule.py) drives it,
with a fake clock, pool and stream: when the pool is wanted, when a worker is given up and
tried again, when one more starts, when a count goes back or follows the pool's share. No
processes, no sleeping."""

from __future__ import annotations

import math

import pytest

from colo_data.host.pool_policy import DECIDE_CHUNKS, DECIDE_S, _FIRST_S, PoolPolicy

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

CHUNK = 512  # host records a chunk
ALONE_S = DECIDE_S  # the host's thread alone makes a measurement's chunks in this long: 4096 records/s
FRONTIER = 10_000  # the pool's next request, while it is in use


class Clock:
    """Seconds that pass only when a test says so (from 100: a trial that starts at 0.0
    would read as one not started)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """A `ChunkPool` as the policy reads it: `count` workers, `idle` CPUs reported unused at
    every `idle_cpus` call (each call counted: it starts the pool's next measurement)."""

    def __init__(self, count: int = 2, remote: bool = False, idle: float | None = 1.0) -> None:
        self.count, self.remote, self.idle, self.idle_calls = count, remote, idle, 0

    def idle_cpus(self) -> float | None:
        self.idle_calls += 1
        return self.idle


class Stream:
    """A pool stream's `ready`: its first `up` workers are ready; `asked` records each call
    (a call starts the workers asked for)."""

    def __init__(self, up: int = 1) -> None:
        self.up = up
        self.asked: list[int] = []

    def ready(self, workers: int) -> bool:
        self.asked.append(workers)
        return workers <= self.up


def alone(
    policy: PoolPolicy, clock: Clock, seconds: float = ALONE_S, chunks: int = DECIDE_CHUNKS, stream: Stream | None = None
) -> bool:
    """The host's thread alone makes `chunks` chunks in `seconds`; then, as `PooledChunks` at each
    chunk, asks whether the pool's stream is to be opened (`stream`: the one already open)."""
    for _ in range(chunks):
        policy.delivered(CHUNK)
    clock.now += seconds
    return policy.wants_stream(None if stream is None else stream.ready)


def trial(policy: PoolPolicy, clock: Clock, stream: Stream, seconds: float, chunks: int = DECIDE_CHUNKS) -> None:
    """The count of workers on trial makes its first chunk, then `chunks` more in `seconds`;
    then the policy judges it, as `PooledChunks` does at the next chunk."""
    policy.delivered(CHUNK, at=FRONTIER)
    for _ in range(chunks):
        policy.delivered(CHUNK)
    clock.now += seconds
    assert not policy.adjust(FRONTIER, stream.ready)


def taken_on(pool: Pool, clock: Clock, stream: Stream) -> PoolPolicy:
    """A policy whose host's thread alone made 4096 records/s, with the pool taken on (one worker)."""
    policy = PoolPolicy(pool, CHUNK, clock)
    assert alone(policy, clock), "CPU went unused: the stream opens"
    assert policy.adjust(None, stream.ready), "its first worker is ready: the pool is taken on"
    assert policy.level == 1
    return policy


def taken_on_again(policy: PoolPolicy, clock: Clock, stream: Stream) -> float:
    """Seconds from the pool's last chunk after it was given up until it is taken on again,
    the host's thread alone measured every `DECIDE_S` meanwhile."""
    policy.released()
    since = clock.now
    while clock.now - since < 100:
        alone(policy, clock, stream=stream)
        if policy.adjust(None, stream.ready):
            return clock.now - since
    raise AssertionError("the pool was not taken on again in 100 s")


def test_the_pool_is_not_wanted_while_no_cpu_goes_unused() -> None:
    """Under half a CPU unused at every measurement (or none read yet): the stream is never opened."""
    for idle in (None, 0.0, 0.49):
        clock, pool = Clock(), Pool(idle=idle)
        policy = PoolPolicy(pool, CHUNK, clock)
        for _ in range(20):
            assert not alone(policy, clock), f"{idle} CPUs unused"
            assert not policy.adjust(None, None)
        assert policy.level == 0
        assert pool.idle_calls == 1 + 20, "the idle CPUs are read once at the start and once a measurement"


def test_the_pool_is_wanted_once_half_a_cpu_goes_unused_over_the_first_short_measurement() -> None:
    """Half a CPU unused over the first `_FIRST_S` and one chunk: the stream opens (its first
    worker is forked); the pool is taken on once that worker is ready."""
    clock, pool = Clock(), Pool(idle=0.5)
    policy = PoolPolicy(pool, CHUNK, clock)
    assert not alone(policy, clock, seconds=_FIRST_S / 2, chunks=1), "the first measurement's time, not its chunk"
    assert pool.idle_calls == 1, "no measurement yet"
    assert alone(policy, clock, seconds=_FIRST_S / 2, chunks=0)
    assert pool.idle_calls == 2

    clock, pool = Clock(), Pool(idle=0.5)
    policy = PoolPolicy(pool, CHUNK, clock)
    assert not alone(policy, clock, seconds=2.0, chunks=0), "its chunk, not its time"
    assert pool.idle_calls == 1, "no measurement yet"
    assert alone(policy, clock, seconds=0.0, chunks=1)

    stream = Stream(up=0)
    assert not policy.adjust(None, stream.ready), "its first worker is not ready: not taken on"
    assert policy.level == 0
    stream.up = 1
    assert policy.adjust(None, stream.ready), "its first worker is ready: taken on"
    assert policy.level == 1 and stream.asked == [1, 1]


def test_after_the_first_a_measurement_takes_a_whole_half_second_and_its_chunks() -> None:
    """Under half a CPU unused at the first measurement: the next one comes after `DECIDE_S`
    and `DECIDE_CHUNKS` chunks, both."""
    for short_of in ("time", "chunks"):
        clock, pool = Clock(), Pool(idle=0.4)
        policy = PoolPolicy(pool, CHUNK, clock)
        assert not alone(policy, clock, seconds=_FIRST_S, chunks=1)
        assert pool.idle_calls == 2, "the first measurement"
        pool.idle = 0.5
        if short_of == "time":
            assert not alone(policy, clock, seconds=DECIDE_S - 0.125), "its chunks, not its half second"
            assert pool.idle_calls == 2, "no measurement yet"
            assert alone(policy, clock, seconds=0.125, chunks=0)
        else:
            assert not alone(policy, clock, seconds=2.0, chunks=DECIDE_CHUNKS - 1), "its half second, not its chunks"
            assert pool.idle_calls == 2, "no measurement yet"
            assert alone(policy, clock, seconds=0.0, chunks=1)
        assert pool.idle_calls == 3


def test_the_first_trial_is_judged_against_the_host_alone_while_its_worker_started() -> None:
    """The host's rate alone that the first worker's trial is judged against is the one from
    the first measurement until the worker is ready, where chunks came meanwhile (the first
    measurement's one chunk made faster than that does not count)."""
    clock, pool, stream = Clock(), Pool(), Stream(up=0)
    policy = PoolPolicy(pool, CHUNK, clock)
    assert alone(policy, clock, seconds=_FIRST_S, chunks=1), "5120 records/s over the first measurement"
    assert not alone(policy, clock, seconds=ALONE_S, stream=stream), "4096 records/s while its worker started"
    stream.up = 1
    assert policy.adjust(None, stream.ready)
    trial(policy, clock, stream, seconds=DECIDE_S * 1.0625)  # 3855 records/s: 0.94 x 4096, 0.75 x 5120
    assert policy.level == 1, "kept: judged against the host's rate while its worker started"


def test_a_first_worker_slower_than_the_host_alone_is_given_up_and_tried_again_after_10_then_20_s() -> None:
    """One worker under 0.9x the host's thread alone is given up, and taken on again 10 s
    later, then 20 s; one at 0.94x is kept."""
    clock, pool, stream = Clock(), Pool(), Stream()
    policy = taken_on(pool, clock, stream)
    trial(policy, clock, stream, seconds=0.5625)  # 3641 records/s: 0.89 x 4096
    assert policy.level == 0, "given up"
    assert taken_on_again(policy, clock, stream) == 10.0
    trial(policy, clock, stream, seconds=0.5625)
    assert policy.level == 0
    assert taken_on_again(policy, clock, stream) == 20.0, "the wait doubles"

    clock, pool, stream = Clock(), Pool(), Stream()
    policy = taken_on(pool, clock, stream)
    trial(policy, clock, stream, seconds=0.53125)  # 3855 records/s: 0.94 x 4096
    assert policy.level == 1, "kept"


def test_a_remote_pool_is_tried_again_without_doubling() -> None:
    """A remote pool is asked for from the start, and tried again 10 s after each time it is given up."""
    clock, pool, stream = Clock(), Pool(remote=True, idle=math.inf), Stream(up=0)
    policy = PoolPolicy(pool, CHUNK, clock)
    assert not policy.adjust(None, stream.ready), "wanted from the start, once its first actor is ready"
    assert not alone(policy, clock, stream=stream), "its stream is open from the start"  # the host alone: 4096 records/s
    stream.up = 1
    assert policy.adjust(None, stream.ready)
    for _ in range(3):
        trial(policy, clock, stream, seconds=0.75)
        assert policy.level == 0, "given up"
        assert taken_on_again(policy, clock, stream) == 10.0, "a remote pool's trial costs the host no CPU"


def test_one_more_worker_starts_only_where_the_last_paid_and_left_cpu_unused() -> None:
    """One more worker is asked for only after a trial that left half a CPU unused and paid, and is used once it is ready."""
    clock, pool, stream = Clock(), Pool(count=3), Stream()
    policy = taken_on(pool, clock, stream)
    pool.idle = 0.4
    trial(policy, clock, stream, seconds=DECIDE_S)
    assert policy.level == 1 and stream.asked == [1], "0.4 CPUs went unused: no second worker"
    trial(policy, clock, stream, seconds=DECIDE_S)
    assert policy.level == 1 and stream.asked == [1], "settled: no more trials"

    clock, pool, stream = Clock(), Pool(count=3), Stream()
    policy = taken_on(pool, clock, stream)
    pool.idle = 0.5
    calls = pool.idle_calls
    trial(policy, clock, stream, seconds=DECIDE_S)
    assert pool.idle_calls == calls + 2, "the CPU left unused is measured from the trial's first chunk to its end"
    assert policy.level == 1 and stream.asked == [1, 2], "a second worker is asked for (it starts)..."
    for _ in range(3):
        assert not policy.adjust(FRONTIER, stream.ready)
    assert policy.level == 1, "...and shares the chunks only once it is ready"
    stream.up = 2
    assert not policy.adjust(FRONTIER, stream.ready)
    assert policy.level == 2

    trial(policy, clock, stream, seconds=DECIDE_S, chunks=5)  # 5120 records/s: 1.25 x one worker
    assert policy.level == 2 and stream.asked[-1] == 3, "faster by more than 5%: a third is asked for"


def test_a_count_that_did_not_pay_goes_back_one_and_settles() -> None:
    """A third worker that made the stream less than 5% faster is dropped, and no more are tried."""
    clock, pool, stream = Clock(), Pool(count=3), Stream(up=3)
    policy = taken_on(pool, clock, stream)
    trial(policy, clock, stream, seconds=DECIDE_S)
    assert not policy.adjust(FRONTIER, stream.ready)
    assert policy.level == 2
    trial(policy, clock, stream, seconds=DECIDE_S, chunks=DECIDE_CHUNKS + 1)
    assert policy.level == 2, "two workers made the stream faster by 25%"  # a third is starting
    assert not policy.adjust(FRONTIER, stream.ready)
    assert policy.level == 3
    trial(policy, clock, stream, seconds=DECIDE_S, chunks=DECIDE_CHUNKS + 1)
    assert policy.level == 2, "the third added nothing: back to two"
    asked = len(stream.asked)
    for _ in range(3):
        trial(policy, clock, stream, seconds=DECIDE_S, chunks=2 * DECIDE_CHUNKS)
    assert policy.level == 2 and len(stream.asked) == asked, "settled: no more workers tried"


def test_the_level_follows_a_fall_of_the_pools_count() -> None:
    """A shared pool's share that falls lowers the level, and the count settles there."""
    clock, pool, stream = Clock(), Pool(count=3), Stream(up=3)
    policy = taken_on(pool, clock, stream)
    trial(policy, clock, stream, seconds=DECIDE_S)
    assert not policy.adjust(FRONTIER, stream.ready)
    assert policy.level == 2
    pool.count = 1
    assert not policy.adjust(FRONTIER, stream.ready)
    assert policy.level == 1, "the pool's share of this host fell"
    pool.count = 3
    for _ in range(3):
        trial(policy, clock, stream, seconds=DECIDE_S, chunks=2 * DECIDE_CHUNKS)
    assert policy.level == 1, "settled: its trial was dropped, and no more are made"
