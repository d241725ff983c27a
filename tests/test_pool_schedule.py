"""`PooledChunks` and `SlicedChunks` (colo_data/host/pool_schedule.py), the mechanism that
follows the worker policy's count, with a fake clock, pool and feed, and a policy whose
count is scripted (the real `WorkerPolicy`'s chunk sizes; its counts are
tests/test_worker_policy.py's). Chunks by position: every batch once and in stream order
whoever made it; this thread's chunks small at first; the pool's requests shared out to the
workers asked for that are ready, at most `AHEAD` in its hands; back to this thread when the
count falls to none; the stream's end; what the policy is told. A partitioned pipeline's
slices: the batches put together are those of all partitions computed here, whatever the
count, which changes only once the workers asked for are all ready. No processes, no
sleeping: making a batch here moves the clock, and the pool's chunks are done when the
clock says so."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

from colo_data import defaults
from colo_data.host.chunk import HostChunk, WorkCost
from colo_data.host.chunk_work import Resume
from colo_data.host.pool_schedule import AHEAD, Downstream, PooledChunks, SlicedChunks
from colo_data.host.slices import cut
from colo_data.host.worker_policy import CHUNK_BYTES, WorkerLimits, WorkerPolicy
from colo_data.runtime.thread_time import ThreadTime

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

SIZE, ROWS = 16, 8  # records a global batch, host rows a batch
HERE, POOL = 0, 1  # who made a batch (its `by` column)


class Clock:
    """Seconds that pass only as the fakes say; this thread's time (`spent`) is on a CPU as
    it makes batches (`work`), off it while it waits."""

    def __init__(self) -> None:
        self.now, self.cpu = 100.0, 0.0

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds
        self.cpu += seconds

    def spent(self) -> ThreadTime:
        return ThreadTime(self.cpu, self.now)


class Pool:
    """A pool of `count` workers on a budget of 8 CPUs; `remote` like Ray's."""

    budget = 8.0

    def __init__(self, count: int = 4, remote: bool = False) -> None:
        self.count, self.remote = count, remote

    def cpus_used(self) -> float | None:
        return 1.0


class Scripted(WorkerPolicy):
    """The real policy's chunk sizes, with a count that `script` gives from the batches
    handed on so far; every observation kept."""

    def __init__(self, clock: Clock, script: Callable[[int], int]) -> None:
        super().__init__(WorkerLimits(8.0, 8), ROWS, clock)
        self.script, self.batches = script, 0
        self.seen: list[tuple[str, tuple]] = []

    def made(self, records: int, work_s: float, cpu_s: float, here: bool, nbytes: int = 0) -> None:
        self.seen.append(("made", (records, work_s, cpu_s, here)))
        super().made(records, work_s, cpu_s, here, nbytes)

    def handed(
        self, records: int, pooled: bool, pool_wait_s: float, room_wait_s: float, input_wait_s: float | None, taken: int | None
    ) -> None:
        self.seen.append(("handed", (records, pooled, pool_wait_s, room_wait_s, input_wait_s, taken)))
        self.batches += records // ROWS
        super().handed(records, pooled, pool_wait_s, room_wait_s, input_wait_s, taken)

    def decide(self) -> int:
        self.count = self.script(self.batches)
        return self.count


def batches(position: int, count: int, by: int) -> HostChunk:
    """`count` host batches from `position`: each row names its batch's position and who made it."""
    at = np.repeat(np.arange(position, position + count * SIZE, SIZE), ROWS)
    return HostChunk({"batch": at, "by": np.full(len(at), by)})


class Feed:
    """A pool feed whose first `ready_now` workers are ready (all, once `all_ready`), each
    request done `batch_s` a batch after the one before (or after it was asked, if later),
    shared out among its workers; `take` waits for it."""

    def __init__(self, clock: Clock, batch_s: float) -> None:
        self.clock, self.batch_s = clock, batch_s
        self.pending: deque[tuple[float, HostChunk]] = deque()
        self.asks: list[tuple[int, int, int]] = []  # (position, batches, workers)
        self.most_in_hand = 0
        self.ready_now: int | None = None  # None: all

    def ready(self, workers: int) -> int:
        return workers if self.ready_now is None else min(workers, self.ready_now)

    def ask(self, position: int, count: int, workers: int) -> None:
        begins = max(self.clock.now, self.pending[-1][0] if self.pending else 0.0)
        part = batches(position, count, POOL)
        part.cost = WorkCost(part.rows, count * self.batch_s, count * self.batch_s / 2)
        self.pending.append((begins + count * self.batch_s / workers, part))
        self.asks.append((position, count, workers))
        self.most_in_hand = max(self.most_in_hand, len(self.pending))

    def take(self) -> HostChunk:
        done, part = self.pending.popleft()
        self.clock.now = max(self.clock.now, done)
        return part


class Run:
    """A host's chunks from `start` to `end`: this thread makes a batch in `here_s`, the
    pool's workers in `pool_s` (shared out among them); the count as `script` says."""

    def __init__(
        self, script: Callable[[int], int], here_s: float = 0.01, pool_s: float = 0.004, start: int = 0,
        end: int | None = None, pool: Pool | None = None,
    ) -> None:  # fmt: skip
        self.clock, self.pool = Clock(), Pool() if pool is None else pool
        self.here_s, self.pool_s, self.feeds, self.opened_at = here_s, pool_s, [], []
        self.made_here: list[tuple[int, int, bool]] = []  # (position, batches, read ahead?)
        self.ready_at_open: int | None = None  # the workers ready when the feed opens (None: all)
        self.downstream = Downstream()
        self.policy = Scripted(self.clock, script)
        self.chunks = PooledChunks(
            self.pool, self.policy, self.open, self.make, lambda part: None, lambda seconds, rows: None, self.downstream,
            start=start, end=end, size=SIZE, rows=ROWS, clock=self.clock, spent=self.clock.spent,
        )  # fmt: skip

    def open(self, position: int) -> Feed:
        self.opened_at.append(position)
        self.feeds.append(Feed(self.clock, self.pool_s))
        self.feeds[-1].ready_now = self.ready_at_open
        return self.feeds[-1]

    def make(self, position: int, count: int, read_ahead: bool) -> HostChunk:
        self.clock.work(count * self.here_s)
        self.made_here.append((position, count, read_ahead))
        return batches(position, count, HERE)

    def take(self, count: int, each: Callable[[HostChunk], None] = lambda part: None) -> tuple[np.ndarray, np.ndarray]:
        """The positions and makers of the first `count` batches handed on (`each` sees every chunk)."""
        got: list[HostChunk] = []
        for part in self.chunks:
            got.append(part)
            each(part)
            if sum(p.rows for p in got) >= count * ROWS:
                break
        rows = {name: np.concatenate([p.columns[name] for p in got]) for name in ("batch", "by")}
        return rows["batch"][::ROWS][:count], rows["by"][::ROWS][:count]


def test_this_thread_makes_small_chunks_first_then_the_pool_every_batch_once_in_order() -> None:
    run = Run(lambda handed: 0 if handed < 60 else 3, here_s=0.0001)
    at, by = run.take(2000)
    assert (at == np.arange(0, 2000 * SIZE, SIZE)).all()
    first_pooled = int(np.argmax(by == POOL))
    assert (by[:first_pooled] == HERE).all() and (by[first_pooled:] == POOL).all(), np.bincount(by)
    sizes = [count for _, count, _ in run.made_here]
    most = defaults.CHUNK_RECORDS // ROWS
    assert sizes[:4] == [1, 2, 4, 8] and max(sizes) <= most, sizes  # a costly first batch comes soon
    # this thread reads ahead while it makes the chunks, not for the one it makes while the pool takes over
    assert [read_ahead for _, _, read_ahead in run.made_here] == [True] * (len(sizes) - 1) + [False]
    feed = run.feeds[0]
    assert run.opened_at == [0]  # opened once, at the start: the pool's fork server starts beside the first chunks
    assert {workers for _, _, workers in feed.asks} == {3}
    assert feed.most_in_hand == AHEAD
    positions = [position for position, _, _ in feed.asks]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


def test_requests_go_to_the_workers_that_are_ready_as_they_get_ready() -> None:
    run = Run(lambda handed: 0 if handed < 10 else 4)
    run.ready_at_open = 1
    ready = {0: 1, 60: 2, 120: 4}  # batches handed on -> workers ready from then

    def each(part: HostChunk) -> None:
        if run.feeds:
            handed = run.policy.batches
            run.feeds[0].ready_now = max(n for at, n in ready.items() if handed >= at)

    run.take(600, each)
    levels = [workers for _, _, workers in run.feeds[0].asks]
    assert levels == sorted(levels) and levels[0] == 1 and levels[-1] == 4, levels


def test_a_count_that_falls_to_none_hands_the_pools_chunks_on_first_then_this_thread_makes_them() -> None:
    run = Run(lambda handed: 2 if 40 <= handed < 400 else 0)
    at, by = run.take(1200)
    assert (at == np.arange(0, 1200 * SIZE, SIZE)).all()
    pooled = np.flatnonzero(by == POOL)
    assert len(pooled) and (by[pooled[0] : pooled[-1] + 1] == POOL).all()  # one run of the pool's batches
    assert (by[pooled[-1] + 1 :] == HERE).all() and len(by) - pooled[-1] > 500
    assert run.chunks.frontier is None and not run.chunks.asked


def test_the_streams_end_cuts_the_last_requests() -> None:
    end = 301 * SIZE  # not a whole chunk, nor a whole request
    run = Run(lambda handed: 2, start=7 * SIZE, end=end)
    parts = list(run.chunks)
    at = np.concatenate([p.columns["batch"] for p in parts])[::ROWS]
    assert (at == np.arange(7 * SIZE, end, SIZE)).all()
    assert run.feeds and all(position + count * SIZE <= end for position, count, _ in run.feeds[0].asks)
    assert not run.chunks.asked  # nothing left in the pool's hands


def test_the_policy_is_told_what_chunks_cost_and_where_the_time_went() -> None:
    """What each chunk cost (this thread's own measured, the pool's as its workers said),
    the wait for the pool, the time away for room downstream less the consumer's own work
    there, and the trainer's waits where the consumer tells them."""
    run = Run(lambda handed: 0 if handed < 20 else 2, pool_s=0.05)
    for i, part in enumerate(run.chunks):
        run.clock.now += 0.3  # away, handing the chunk on: 0.1 s of it the consumer's own work
        run.downstream.worked(0.1)
        run.downstream.trainer_waited(0.02)
        run.downstream.trainer_took(part.rows)
        if i == 40:
            break
    made = [args for kind, args in run.policy.seen if kind == "made"]
    handed = [args for kind, args in run.policy.seen if kind == "handed"]
    assert any(here for *_, here in made) and any(not here for *_, here in made)
    pooled = [(records, work, cpu) for records, work, cpu, here in made if not here]
    assert all(work == pytest.approx(records / ROWS * 0.05) and cpu == pytest.approx(work / 2) for records, work, cpu in pooled)
    assert handed[0][3:] == (0.0, None, None)  # before the first hand-off: no room waited, nothing told
    for (records, *_), (*_, room, waited, taken) in zip(handed, handed[1:], strict=False):  # told at the next one
        assert room == pytest.approx(0.2) and waited == pytest.approx(0.02) and taken == records
    assert any(pooled and wait > 0 for _, pooled, wait, *_ in handed)  # the pool's chunks were waited for


def test_without_a_pool_every_chunk_is_made_here_the_first_small_then_a_decisions_worth() -> None:
    """A first chunk of one batch, then twice the last up to `CHUNK_RECORDS` records and to
    about `DECIDE_S` of this thread's time: cheap records double to the most, 0.2 s batches
    stay at 2 (a decision comes between chunks, never a costly chunk later)."""
    for here_s, ramp in ((1e-5, [1, 2, 4, 8, 16, 32, 64]), (0.2, [1, 2, 2, 2, 2, 2, 2])):
        most = defaults.CHUNK_RECORDS // ROWS
        clock = Clock()
        made: list[int] = []

        def make(position: int, count: int, read_ahead: bool, here_s: float = here_s) -> HostChunk:
            clock.work(count * here_s)
            made.append(count)
            return batches(position, count, HERE)

        policy = WorkerPolicy(WorkerLimits(0.0, 0), ROWS, clock)
        chunks = PooledChunks(
            None, policy, lambda position: pytest.fail("no pool to open"), make, lambda part: None,
            lambda seconds, rows: None, Downstream(), start=0, end=3000 * SIZE, size=SIZE, rows=ROWS, clock=clock,
            spent=clock.spent,
        )  # fmt: skip
        at = np.concatenate([p.columns["batch"] for p in chunks])[::ROWS]
        assert (at == np.arange(0, 3000 * SIZE, SIZE)).all()
        most = ramp[-1] if here_s > 1e-3 else most
        assert made[:7] == ramp and set(made[7:-1]) == {most} and made[-1] <= most, (here_s, made[:12])


def test_chunks_stop_growing_once_their_bytes_reach_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of 1 MiB, 8 MiB a batch: this thread's chunks and the pool's requests grow to
    8 batches (`CHUNK_BYTES`, 64 MiB), not to `CHUNK_RECORDS`, a record's bytes learned from
    the chunks made; the batches are the same."""
    light = batches

    def heavy(position: int, count: int, by: int) -> HostChunk:  # 1 MiB a record, nothing allocated
        part = light(position, count, by)
        part.columns["payload"] = np.broadcast_to(np.zeros((), np.uint8), (part.rows, 2**20))
        return part

    monkeypatch.setattr(sys.modules[__name__], "batches", heavy)
    cap = CHUNK_BYTES // (ROWS * 2**20)
    run = Run(lambda handed: 0 if handed < 60 else 3)
    at, by = run.take(600)
    assert (at == np.arange(0, 600 * SIZE, SIZE)).all() and (by == POOL).any()
    assert [count for _, count, _ in run.made_here][:6] == [1, 2, 4, cap, cap, cap] and cap == 8
    assert {count for _, count, _ in run.feeds[0].asks} == {cap}


def test_a_remote_pool_opens_its_feed_at_once() -> None:
    run = Run(lambda handed: 2 if handed >= 5 else 0, start=5 * SIZE, pool=Pool(remote=True))
    assert run.opened_at == [5 * SIZE]
    at, by = run.take(500)
    assert (at == np.arange(5 * SIZE, 505 * SIZE, SIZE)).all() and (by == POOL).sum() > 400


PARTS, PART_ROWS, PART_BATCHES = 6, 2, 400  # a host's partitions, the rows of each a batch, its batches


def sliced(clock: Clock | None, start: np.ndarray, owned: range | None, here_s: float = 0.0):
    """A partitioned host's batches from `start` (`[phase, each partition's position]`) for
    the slice `owned` (None: all its partitions), each with the slice's position after it;
    each batch moves `clock` by `here_s` a partition (None: made elsewhere)."""
    parts = range(PARTS) if owned is None else owned
    position = np.array(start, np.int64)
    while position[1 + parts.start] < PART_ROWS * PART_BATCHES:
        rows = [(p, position[1 + p] + i) for p in parts for i in range(PART_ROWS)]
        position[1 + parts.start : 1 + parts.stop] += PART_ROWS
        position[0] += 1
        if clock is not None:
            clock.work(here_s * len(parts))
        columns = {"part": np.array([p for p, _ in rows]), "record": np.array([r for _, r in rows])}
        yield columns, np.concatenate([position[:1], position[1 + parts.start : 1 + parts.stop]])


class SliceFeed:
    """A pool feed that computes the workers' slices of each request (`Resume`) at once,
    done `part_s` a partition a batch after the one before (shared out among the workers);
    its first `ready_now` workers ready (None: all)."""

    def __init__(self, clock: Clock, part_s: float) -> None:
        self.clock, self.part_s = clock, part_s
        self.pending: deque[tuple[float, HostChunk]] = deque()
        self.levels: list[int] = []
        self.ready_now: int | None = None

    def ready(self, workers: int) -> int:
        return workers if self.ready_now is None else min(workers, self.ready_now)

    def ask(self, resume: Resume, count: int, workers: int) -> None:
        slices = [list(sliced(None, resume.start, cut(range(PARTS), resume.parts, i))) for i in range(resume.parts)]
        made = min(len(s) for s in slices[:workers])
        made = max(0, min(count, made - resume.skip))
        rows, ends = [], []
        for b in range(resume.skip, resume.skip + made):
            rows.append({name: np.concatenate([s[b][0][name] for s in slices]) for name in ("part", "record")})
            ends.append(np.concatenate([slices[0][b][1][:1], *(s[b][1][1:] for s in slices)]))
        columns = {name: np.concatenate([r[name] for r in rows]) for name in ("part", "record")} if rows else {}
        begins = max(self.clock.now, self.pending[-1][0] if self.pending else 0.0)
        done = begins + made * PARTS * self.part_s / workers
        part = HostChunk(columns, np.array(ends).reshape(made, 1 + PARTS))
        part.cost = WorkCost(made * PARTS * PART_ROWS, made * PARTS * self.part_s, made * PARTS * self.part_s)
        self.pending.append((done, part))
        self.levels.append(workers)

    def take(self) -> HostChunk:
        done, part = self.pending.popleft()
        self.clock.now = max(self.clock.now, done)
        return part


class SlicedRun:
    """A partitioned host's batches with a pool: this thread makes a partition's rows of a
    batch in `here_s`, the workers in `pool_s`; the count as `script` says."""

    def __init__(self, script: Callable[[int], int], start: np.ndarray | None = None, pool: Pool | None = None) -> None:
        self.clock, self.pool = Clock(), Pool() if pool is None else pool
        self.start = np.zeros(1 + PARTS, np.int64) if start is None else start
        self.feeds: list[SliceFeed] = []
        self.cuts = 0  # times the batches were computed here from a position
        rows = PARTS * PART_ROWS

        def batches(position: np.ndarray):
            self.cuts += 1
            return sliced(self.clock, position, None, 0.002)

        self.policy = Scripted(self.clock, lambda handed: script(handed))
        self.policy.rows = rows
        self.chunks = SlicedChunks(
            self.pool, self.policy, self.open, batches, lambda part: None, lambda seconds, rows: None, Downstream(),
            start=self.start, owned=range(PARTS), rows=rows, clock=self.clock, spent=self.clock.spent,
        )  # fmt: skip

    def open(self) -> SliceFeed:
        self.feeds.append(SliceFeed(self.clock, 0.001))
        return self.feeds[-1]


def rows_of(chunks: list[HostChunk]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's partition and record, in order; and each batch's position after it."""
    pairs = np.concatenate([np.stack([c.columns["part"], c.columns["record"]], 1) for c in chunks])
    return pairs, np.stack([np.asarray(c.end) for c in chunks])


def alone(start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batches of every partition computed here, with no pool: what any slicing gives."""
    return rows_of([HostChunk(columns, end) for columns, end in sliced(None, start, None)])


def test_slices_put_together_are_the_batches_of_all_partitions_computed_here() -> None:
    """Here first, then 2 workers, 4, 1 and none again: the batches, row by row and position
    by position, are those of all partitions computed here."""
    run = SlicedRun(lambda handed: 0 if handed < 30 else 2 if handed < 100 else 4 if handed < 200 else 1 if handed < 300 else 0)
    got = list(run.chunks)
    assert len(got) == PART_BATCHES
    assert all((a == b).all() for a, b in zip(rows_of(got), alone(run.start), strict=True))
    levels = run.feeds[0].levels
    assert {1, 2, 4} <= set(levels), levels
    assert run.cuts == 2  # here from the start, and again after the count fell to none


def test_slices_from_a_position_and_at_most_one_worker_a_partition() -> None:
    start = np.array([3, *[PART_ROWS * 3] * PARTS], np.int64)
    run = SlicedRun(lambda handed: 0 if handed < 10 else 16, start=start, pool=Pool(count=16))
    got = list(run.chunks)
    assert len(got) == PART_BATCHES - 3
    assert all((a == b).all() for a, b in zip(rows_of(got), alone(start), strict=True))
    assert set(run.feeds[0].levels) == {PARTS}  # as many workers as partitions, not 16


def test_a_new_count_of_slices_waits_for_all_its_workers_to_be_ready() -> None:
    run = SlicedRun(lambda handed: 0 if handed < 10 else 4)
    got = []
    for chunk in run.chunks:
        if run.feeds and len(got) < 60:
            run.feeds[0].ready_now = 3  # one of the four is not ready yet: the batches are made here meanwhile
        elif run.feeds:
            run.feeds[0].ready_now = None
        got.append(chunk)
    assert set(run.feeds[0].levels) == {4}
    assert all((a == b).all() for a, b in zip(rows_of(got), alone(run.start), strict=True))
