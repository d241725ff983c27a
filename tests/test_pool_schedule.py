"""`PooledChunks` and `SlicedChunks` (colo_data/host/pool_schedule.py): a host's chunks made
here and by a pool, with a fake clock, pool and stream and the real `PoolPolicy`. Chunks by
position: every batch once and in stream order whoever made it (the pool's chunks, this
thread's, and those this thread made ahead while the pool's had not come), the requests
growing 1, 2, 4 chunks with at most `POOL_AHEAD` in the pool's hands, the stream's end, a
pool given up and a remote one. A partitioned pipeline's slices: the batches joined from
this thread's slice and the workers' are those of all partitions computed here, whatever
the level and the share, cut again as they change. No processes, no sleeping: making a
batch here moves the clock, and the pool's chunks are done when the clock says so."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from colo_data import defaults
from colo_data.host.chunk import HostChunk
from colo_data.host.chunk_work import Resume
from colo_data.host.pool_policy import PoolPolicy
from colo_data.host.pool_schedule import POOL_AHEAD, PooledChunks, SlicedChunks
from colo_data.host.slices import cut

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

SIZE, ROWS, CHUNK = 16, 8, 4  # records a global batch, host rows a batch, batches a chunk
HERE, POOL = 0, 1  # who made a batch (its `by` column)


class Clock:
    """Seconds that pass only as the fakes say (from 100, as the policy's tests)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """A pool of `count` workers, `idle` CPUs unused at every measurement; `remote` like Ray's."""

    def __init__(self, count: int = 2, idle: float | None = 1.0, remote: bool = False) -> None:
        self.count, self.idle, self.remote = count, idle, remote

    def idle_cpus(self) -> float | None:
        return self.idle


def batches(position: int, count: int, by: int) -> HostChunk:
    """`count` host batches from stream `position`: each row names its batch's position and who made it."""
    at = np.repeat(np.arange(position, position + count * SIZE, SIZE), ROWS)
    return HostChunk({"batch": at, "by": np.full(len(at), by)})


class Stream:
    """A pool stream whose workers are ready from the start, each request done `batch_s` a
    batch after the one before (or after it was asked, if later); `take` waits for it."""

    def __init__(self, clock: Clock, batch_s: float) -> None:
        self.clock, self.batch_s = clock, batch_s
        self.pending: deque[tuple[float, HostChunk]] = deque()
        self.asks: list[tuple[int, int, int]] = []  # (position, batches, workers)
        self.most_in_hand = 0

    def ready(self, workers: int) -> bool:
        return True

    def ask(self, position: int, count: int, workers: int) -> None:
        begins = max(self.clock.now, self.pending[-1][0] if self.pending else 0.0)
        self.pending.append((begins + count * self.batch_s / workers, batches(position, count, POOL)))
        self.asks.append((position, count, workers))
        self.most_in_hand = max(self.most_in_hand, len(self.pending))

    def has_next(self) -> bool:
        return bool(self.pending) and self.pending[0][0] <= self.clock.now

    def take(self) -> HostChunk:
        done, part = self.pending.popleft()
        self.clock.now = max(self.clock.now, done)
        return part


class Run:
    """A host's chunks from `start` to `end` with a pool: this thread makes a batch in
    `here_s`, the pool's workers in `pool_s` (shared out among them)."""

    def __init__(self, pool: Pool, here_s: float, pool_s: float, start: int = 0, end: int | None = None) -> None:
        self.clock, self.pool = Clock(), pool
        self.here_s, self.streams, self.opened_at = here_s, [], []
        self.pool_s, self.waited = pool_s, 0.0
        self.read_ahead: list[bool] = []
        self.chunks = PooledChunks(
            pool, PoolPolicy(pool, CHUNK * ROWS, self.clock), self.open, self.make, lambda part: None, self.wait,
            start=start, end=end, size=SIZE, chunk=CHUNK, rows=ROWS, clock=self.clock,
        )

    def open(self, position: int) -> Stream:
        self.opened_at.append(position)
        self.streams.append(Stream(self.clock, self.pool_s))
        return self.streams[-1]

    def make(self, position: int, count: int, read_ahead: bool) -> HostChunk:
        self.clock.now += count * self.here_s
        self.read_ahead.append(read_ahead)
        return batches(position, count, HERE)

    def wait(self, seconds: float, rows: int) -> None:
        self.waited += seconds

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions and makers of the first `count` batches handed on."""
        got: list[HostChunk] = []
        for part in self.chunks:
            got.append(part)
            if sum(p.rows for p in got) >= count * ROWS:
                break
        rows = {name: np.concatenate([p.columns[name] for p in got]) for name in ("batch", "by")}
        return rows["batch"][::ROWS][:count], rows["by"][::ROWS][:count]


def test_every_batch_comes_once_in_stream_order_from_both_makers() -> None:
    """A pool twice as fast as this thread is taken on; this thread makes chunks meanwhile
    (before it, and after the claimed ones while the pool's next has not come), and the
    batches still come in stream order, each once."""
    run = Run(Pool(count=2), here_s=0.01, pool_s=0.005)
    at, by = run.take(2000)
    assert (at == np.arange(0, 2000 * SIZE, SIZE)).all()
    assert (by == POOL).sum() > 1000 and (by == HERE).sum() > 100, np.bincount(by)
    stream = run.streams[0]
    assert run.opened_at == [run.opened_at[0]] and run.opened_at[0] > 0  # opened once, where CPU went unused
    assert max(workers for _, _, workers in stream.asks) == 2  # the second worker paid: both used
    first_pooled = int(np.argmax(by == POOL))
    assert (by[:first_pooled] == HERE).all() and first_pooled >= CHUNK  # this thread first, while the pool started


def test_requests_grow_to_worker_chunks_with_at_most_pool_ahead_in_its_hands() -> None:
    run = Run(Pool(count=1), here_s=0.01, pool_s=0.002)
    run.take(1000)
    stream = run.streams[0]
    counts = [count for _, count, _ in stream.asks]
    cap = CHUNK * defaults.WORKER_CHUNKS
    assert counts[:3] == [CHUNK, 2 * CHUNK, cap] and set(counts[3:]) == {cap}, counts
    assert stream.most_in_hand == POOL_AHEAD
    positions = [position for position, _, _ in stream.asks]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


def test_this_thread_makes_the_chunks_after_the_claimed_ones_while_the_pools_have_not_come() -> None:
    """A pool about as fast as this thread: whenever its next chunk has not come, this thread
    makes one after the last claimed (without read-ahead, which follows the stream here) and
    hands it on in its turn."""
    run = Run(Pool(count=1), here_s=0.01, pool_s=0.012)
    at, by = run.take(600)
    assert (at == np.arange(0, 600 * SIZE, SIZE)).all()
    pooled = np.flatnonzero(by == POOL)
    ahead = np.flatnonzero((by == HERE) & (np.arange(len(by)) > pooled[0]))
    assert len(ahead) > CHUNK and False in run.read_ahead, (len(ahead), run.read_ahead[:5])


def test_the_streams_end_cuts_the_last_requests() -> None:
    end = 301 * SIZE  # not a whole chunk, nor a whole request
    run = Run(Pool(count=2), here_s=0.01, pool_s=0.004, start=7 * SIZE, end=end)
    parts = list(run.chunks)
    at = np.concatenate([p.columns["batch"] for p in parts])[::ROWS]
    assert (at == np.arange(7 * SIZE, end, SIZE)).all()
    assert all(position + count * SIZE <= end for position, count, _ in run.streams[0].asks)
    assert run.chunks.asked == 0 and not run.chunks.claimed  # nothing left in the pool's hands


def test_a_pool_slower_than_this_thread_is_given_up_and_its_claimed_chunks_come_first() -> None:
    run = Run(Pool(count=1), here_s=0.01, pool_s=0.1)
    at, by = run.take(400)
    assert (at == np.arange(0, 400 * SIZE, SIZE)).all()
    last_pooled = int(np.flatnonzero(by == POOL)[-1])
    assert (by[last_pooled + 1 :] == HERE).all() and len(by) - last_pooled > 100  # given up, not asked again for a while
    assert run.chunks.frontier is None and run.chunks.asked == 0


def test_no_pool_where_no_cpu_goes_unused_and_a_remote_one_at_once() -> None:
    busy = Run(Pool(count=2, idle=0.0), here_s=0.01, pool_s=0.001)
    _, by = busy.take(500)
    assert (by == HERE).all() and not busy.streams  # never opened: its workers never started
    remote = Run(Pool(count=2, idle=None, remote=True), here_s=0.01, pool_s=0.001, start=5 * SIZE)
    at, by = remote.take(500)
    assert remote.opened_at == [5 * SIZE] and (by == POOL).sum() > 400
    assert (at == np.arange(5 * SIZE, 505 * SIZE, SIZE)).all()


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
            clock.now += here_s * len(parts)
        columns = {"part": np.array([p for p, _ in rows]), "record": np.array([r for _, r in rows])}
        yield columns, np.concatenate([position[:1], position[1 + parts.start : 1 + parts.stop]])


class SliceStream:
    """A pool stream that computes the workers' slices of each request (`Resume`) at once,
    done `part_s` a partition a batch after the one before (shared out among the workers)."""

    def __init__(self, clock: Clock, part_s: float) -> None:
        self.clock, self.part_s = clock, part_s
        self.pending: deque[tuple[float, HostChunk]] = deque()
        self.levels: list[int] = []

    def ready(self, workers: int) -> bool:
        return True

    def ask(self, resume: Resume, count: int, workers: int) -> None:
        owned = range(PARTS)
        theirs = range(cut(owned, resume.parts, 0, resume.here).stop, owned.stop)
        made = list(sliced(None, resume.start, theirs))[resume.skip : resume.skip + count]
        columns = {name: np.concatenate([c[name] for c, _ in made]) for name in ("part", "record")} if made else {}
        begins = max(self.clock.now, self.pending[-1][0] if self.pending else 0.0)
        done = begins + len(made) * len(theirs) * self.part_s / workers
        self.pending.append((done, HostChunk(columns, np.array([end for _, end in made]).reshape(len(made), 1 + len(theirs)))))
        self.levels.append(workers)

    def take(self) -> HostChunk:
        done, part = self.pending.popleft()
        self.clock.now = max(self.clock.now, done)
        return part


class SlicedRun:
    """A partitioned host's batches with a pool: this thread makes a partition's rows of a
    batch in `here_s`, the workers in `pool_s`."""

    def __init__(self, pool: Pool, here_s: float, pool_s: float, start: np.ndarray | None = None) -> None:
        self.clock, self.pool, self.pool_s = Clock(), pool, pool_s
        self.start = np.zeros(1 + PARTS, np.int64) if start is None else start
        self.streams: list[SliceStream] = []
        self.cuts: list[tuple[int, range | None]] = []  # (the level, this thread's slice) at each cut
        chunk, rows = 8, PARTS * PART_ROWS

        def batches(position: np.ndarray, owned: range | None):
            self.cuts.append((self.chunks.level if hasattr(self, "chunks") else 0, owned))
            return sliced(self.clock, position, owned, here_s)

        self.chunks = SlicedChunks(
            pool, PoolPolicy(pool, chunk * rows, self.clock), self.open, batches, lambda workers: PART_ROWS * len(workers),
            lambda part: None, lambda seconds, rows: None,
            start=self.start, owned=range(PARTS), chunk=chunk, rows=rows, clock=self.clock,
        )

    def open(self) -> SliceStream:
        self.streams.append(SliceStream(self.clock, self.pool_s))
        return self.streams[-1]


def rows_of(chunks: list[HostChunk]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's partition and record, in order; and each batch's position after it."""
    pairs = np.concatenate([np.stack([c.columns["part"], c.columns["record"]], 1) for c in chunks])
    return pairs, np.stack([np.asarray(c.end) for c in chunks])


def alone(start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batches of every partition computed here, with no pool: what any slicing gives."""
    return rows_of([HostChunk(columns, end) for columns, end in sliced(None, start, None)])


def test_slices_joined_are_the_batches_of_all_partitions_computed_here() -> None:
    """Workers twice as fast as this thread: the pool is taken on, a second worker pays, the
    share of this thread is cut again as the balance moves; the batches joined from the
    slices are, row by row and position by position, those of all partitions made here."""
    run = SlicedRun(Pool(count=2), here_s=0.002, pool_s=0.001)
    got = list(run.chunks)
    want = alone(run.start)
    assert len(got) == PART_BATCHES
    assert all((a == b).all() for a, b in zip(rows_of(got), want, strict=True))
    assert max(run.streams[0].levels) == 2, run.streams[0].levels  # both workers used
    shares = {len(mine) for level, mine in run.cuts if level == 2 and mine is not None}
    assert len(shares) > 1, run.cuts  # cut again at the same level: the balance moved this thread's share


def test_slices_from_a_position_in_the_stream_and_a_fall_of_the_pools_count() -> None:
    """From a position other than the start, with the pool's share of this host falling from 2
    workers to 1 on the way (the chunks asked are taken and dropped, the slices cut again):
    the same batches."""
    start = np.array([3, *[PART_ROWS * 3] * PARTS], np.int64)
    run = SlicedRun(Pool(count=2), here_s=0.002, pool_s=0.001, start=start)
    got = []
    for chunk in run.chunks:
        got.append(chunk)
        if len(got) == 250:
            assert run.chunks.level == 2, run.chunks.level
            run.pool.count = 1
    assert run.chunks.level == 1
    want = alone(start)
    assert len(got) == PART_BATCHES - 3
    assert all((a == b).all() for a, b in zip(rows_of(got), want, strict=True))


def test_no_slices_where_no_cpu_goes_unused() -> None:
    run = SlicedRun(Pool(count=2, idle=0.0), here_s=0.002, pool_s=0.001)
    got = list(run.chunks)
    assert run.cuts == [(0, None)] and not run.streams  # all partitions here, from the first batch to the last
    assert all((a == b).all() for a, b in zip(rows_of(got), alone(run.start), strict=True))
