"""Who makes which of a host's chunks, in stream order: its own thread, or its worker pool,
as `WorkerPolicy` counts the workers. This thread makes the chunks until the policy gives
workers (small ones at first: a costly record's first batch comes soon); from then on the
pool makes them, `AHEAD` requests in its hands, each shared out among the workers in use
and ready (the first as large as this thread's last chunk, then twice the last up to the
policy's size: the pool's first chunks come as soon as this thread's would have), and this
thread takes them in order, joins them and hands them on. Every chunk, this thread's and the
pool's, holds at most about `CHUNK_BYTES` of columns (the policy's sizes, a record's bytes
learned from the first chunk on). It tells the
policy what each chunk cost, how long it waited for the pool, and how long for room
downstream (the time it was away handing a chunk on, less the consumer's own work there,
`Downstream`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from colo_data.host.chunk import HostBatch, HostChunk
from colo_data.host.chunk_work import ChunkPool, PoolFeed, Resume
from colo_data.host.worker_policy import WorkerPolicy
from colo_data.runtime.prefetch import close_iterator
from colo_data.runtime.thread_time import ThreadTime

AHEAD = 3  # requests in the pool's hands: each is shared out to every worker in use, so each has its next share


class Downstream:
    """The consumer of a host's chunks, as the feed sees it: the seconds it spent
    working on them on the feed's own thread (a sidecar writes them into shared memory and
    announces them there), which are not time spent waiting for room; and, where the
    consumer tells them (None where it does not), the seconds the trainer waited for input
    and the records it took."""

    def __init__(self) -> None:
        self.work_s = 0.0
        self.input_wait_s: float | None = None
        self.taken: int | None = None

    def worked(self, seconds: float) -> None:
        self.work_s += seconds

    def trainer_waited(self, seconds: float) -> None:
        self.input_wait_s = (self.input_wait_s or 0.0) + seconds

    def trainer_took(self, records: int) -> None:
        self.taken = (self.taken or 0) + records

    def told_since(self, seen: Told) -> tuple[Told, Told]:
        """What the trainer's side told since a reading `seen` (None: not told), and the reading now."""
        now = Told(self.input_wait_s, self.taken)
        waited = None if now.waited is None else now.waited - (seen.waited or 0.0)
        taken = None if now.taken is None else now.taken - (seen.taken or 0)
        return Told(waited, taken), now


class Told(NamedTuple):
    """What the trainer's side told a host: seconds the trainer waited, records it took."""

    waited: float | None = None
    taken: int | None = None


def _due(pool: ChunkPool | None, policy: WorkerPolicy) -> int:
    """The policy's count now (0 without a pool), the CPUs in use told it first when it is
    about to decide."""
    if pool is None:
        return 0
    if policy.due():
        policy.cpus_used(pool.cpus_used())
    return policy.decide()


class PooledChunks:
    """Chunks from position `start` to `end` (None: forever), made here or by `pool`
    as `policy` says.

    Args:
        pool: the pool (None: every chunk is made here, sized by `policy`). Its feed
            opens at once: what its workers need (a fork server, Ray actors) starts beside
            this thread's first chunks.
        policy: the count of workers and the chunks' sizes.
        open_feed: the pool's feed from a position on (its workers start when asked).
        make: a chunk made here: (position, batches, read ahead?) -> chunk.
        took: what to do with a chunk the pool made before it is handed on (its counters).
        waited: the time (seconds) this thread waited for one of the pool's chunks, and its rows.
        downstream: the consumer's own work on this thread.
        start, end: positions (records).
        size: records a global batch.
        rows: host rows a batch.
        granule: every chunk's batches are a multiple of this (but at the stream's end),
            for a consumer that takes that many at a time (a colocated host's call).
        clock: seconds, monotonic (the waits).
        spent: this thread's time so far (what its own chunks cost).
    """

    def __init__(
        self,
        pool: ChunkPool | None,
        policy: WorkerPolicy,
        open_feed: Callable[[int], PoolFeed],
        make: Callable[[int, int, bool], HostChunk],
        took: Callable[[HostChunk], None],
        waited: Callable[[float, int], None],
        downstream: Downstream,
        *,
        start: int,
        end: int | None,
        size: int,
        rows: int,
        granule: int = 1,
        clock: Callable[[], float] = time.monotonic,
        spent: Callable[[], ThreadTime] = ThreadTime.now,
    ) -> None:
        self._pool, self._policy, self._make, self._took, self._waited = pool, policy, make, took, waited
        self._downstream, self._end, self._size, self._rows, self._clock = downstream, end, size, rows, clock
        self._granule, self._spent = granule, spent
        self.feed: PoolFeed | None = open_feed(start) if pool is not None else None
        if pool is not None:
            pool.cpus_used()  # measured from here: the first decision knows what else uses the budget
        self.position = start  # of the next chunk handed on
        self.frontier: int | None = None  # while the pool makes the chunks: the first position not asked of it
        self.asked: deque[tuple[int, int]] = deque()  # (position, batches) of each request in the pool's hands
        self.level = 0  # the workers each new request is shared out to
        self._here = 1  # batches of the last chunk made here
        self._request = 0  # batches of the last request (0: none since the pool took over)

    def __iter__(self) -> Iterator[HostChunk]:
        room, seen = 0.0, Told()
        while self._left(self.position):
            self._steer(_due(self._pool, self._policy))
            part, pooled, pool_wait = self._next()
            self.position += part.rows // self._rows * self._size
            told, seen = self._downstream.told_since(seen)
            self._policy.handed(part.rows, pooled, pool_wait, room, *told)
            began, worked = self._clock(), self._downstream.work_s
            yield part
            room = max(0.0, self._clock() - began - (self._downstream.work_s - worked))

    def _steer(self, count: int) -> None:
        """Follow the policy's count: share new requests out to the workers asked for that
        are ready, keep `AHEAD` requests in the pool's hands."""
        self.level = self.feed.ready(min(count, self._pool.count)) if count and self.feed and self._pool else 0
        if self.level and self.frontier is None:  # the pool takes over after one more chunk made here meanwhile
            self.frontier, self._request = self.position + self._here * self._size, 0
        while self.level and len(self.asked) < AHEAD and self._left(self.frontier):
            assert self.feed is not None and self.frontier is not None
            self._request = self._policy.request_batches(self.level, self._request or self._here)
            count = self._count(self.frontier, self._whole(self._request))
            if count < 1:
                break
            self.feed.ask(self.frontier, count, self.level)
            self.asked.append((self.frontier, count))
            self.frontier += count * self._size

    def _next(self) -> tuple[HostChunk, bool, float]:
        """The chunk at `position`: the pool's where it was asked for, else made here (up to
        where the pool's start); whether the pool made it, and how long this thread waited."""
        if not self.asked and not self.level:  # the pool is not in use: this thread makes the chunks
            self.frontier = None
        if self.asked and self.asked[0][0] == self.position:
            assert self.feed is not None
            self.asked.popleft()
            part, waited = _taken(self.feed, self._spent)
            self._waited(waited, part.rows)
            self._took(part)
            if part.cost is not None:
                self._policy.made(*part.cost, here=False, nbytes=_nbytes(part.columns))
            return part, True, waited
        count = self._whole(self._policy.host_batches())
        pools = self.asked[0][0] if self.asked else self.frontier  # where the pool's chunks start
        for stop in (self._end, pools):  # made here up to the stream's end, or to where the pool's start
            if stop is not None:
                count = min(count, (stop - self.position) // self._size)
        self._here = count
        before = self._spent()
        part = self._make(self.position, count, self.frontier is None)
        spent = self._spent().since(before)
        self._policy.made(part.rows, spent.work, spent.cpu, here=True, nbytes=_nbytes(part.columns))
        return part, False, 0.0

    def _whole(self, batches: int) -> int:
        """`batches` rounded up to a multiple of the granule."""
        return -(-batches // self._granule) * self._granule

    def _left(self, position: int | None) -> bool:
        """Whether there is stream left at `position`."""
        return position is not None and (self._end is None or position < self._end)

    def _count(self, position: int, batches: int) -> int:
        """`batches`, or fewer where the stream ends first."""
        return batches if self._end is None else min(batches, (self._end - position) // self._size)


class SlicedChunks:
    """A partitioned pipeline's host batches with a pool: made here, all of the host's
    partitions `owned`, while `policy` gives no workers; else the partitions cut into as
    many slices as workers (`slices.cut`, at most one a partition), each worker going on
    ahead with its own (`Resume`; `AHEAD` requests in the pool's hands), the slices put
    together batch by batch. The count changes once the workers asked for are all ready:
    the requests in the pool's hands are taken and dropped, and the slices cut again from
    where the stream stands (the batches do not depend on it).

    Args:
        pool, policy, took, waited, downstream: as `PooledChunks`'.
        open_feed: the pool's feed (its workers start when asked).
        batches: the host's batches computed here from a position on, each with the
            position after it (`partitioned_batches`).
        start: the pipeline's position (`colo_data.pipeline.parts`).
        owned: the host's partitions.
        rows: host rows a batch.
        clock: seconds, monotonic (the waits).
        spent: this thread's time so far (what its own batches cost).
    """

    def __init__(
        self,
        pool: ChunkPool,
        policy: WorkerPolicy,
        open_feed: Callable[[], PoolFeed],
        batches: Callable[[np.ndarray], Iterator[tuple[HostBatch, np.ndarray]]],
        took: Callable[[HostChunk], None],
        waited: Callable[[float, int], None],
        downstream: Downstream,
        *,
        start: np.ndarray,
        owned: range,
        rows: int,
        clock: Callable[[], float] = time.monotonic,
        spent: Callable[[], ThreadTime] = ThreadTime.now,
    ) -> None:
        self._pool, self._policy, self._batches, self._spent = pool, policy, batches, spent
        self._took, self._waited, self._downstream = took, waited, downstream
        self._owned, self._rows, self._clock = owned, rows, clock
        self.feed = open_feed()  # opened now, as `PooledChunks` opens its
        pool.cpus_used()  # measured from here: the first decision knows what else uses the budget
        self.current = np.array(start, np.int64)  # the pipeline's position where the stream stands
        self.level = self.delivered = 0  # the workers that compute slices; batches handed on
        self.origin = self.frontier = 0  # the batch the slices were cut at; the next asked of the pool
        self.origin_position = self.current.copy()  # the position there
        self.asked: deque[int] = deque()  # the batches of each request in the pool's hands
        self._request = 0  # batches of the last request since the slices were cut (the first: 1, then twice the last)
        self._here: Iterator[tuple[HostBatch, np.ndarray]] = batches(self.current)

    def __iter__(self) -> Iterator[HostChunk]:
        owned, room, seen = self._owned, 0.0, Told()
        try:
            while True:
                wanted = min(_due(self._pool, self._policy), len(owned), self._pool.count)
                if wanted != self.level and (not wanted or self.feed.ready(wanted) == wanted):
                    self._cut_again(wanted)
                made, pooled, pool_wait = self._here_batch() if not self.level else self._joined_chunk()
                for columns, end in made:
                    self.current[0], self.current[1 + owned.start : 1 + owned.stop] = end[0], end[1:]
                    self.delivered += 1
                    told, seen = self._downstream.told_since(seen)
                    self._policy.handed(self._rows, pooled, pool_wait, room, *told)
                    pool_wait, began, worked = 0.0, self._clock(), self._downstream.work_s
                    yield HostChunk(columns, end)
                    room = max(0.0, self._clock() - began - (self._downstream.work_s - worked))
                if not made:  # the stream ended
                    return
        finally:
            close_iterator(self._here)

    def _here_batch(self) -> tuple[list[tuple[HostBatch, np.ndarray]], bool, float]:
        """The next batch computed here (none at the stream's end), and what it cost."""
        before = self._spent()
        batch = next(self._here, None)
        spent = self._spent().since(before)
        if batch is None:
            return [], False, 0.0
        self._policy.made(self._rows, spent.work, spent.cpu, here=True, nbytes=_nbytes(batch[0]))
        return [batch], False, 0.0

    def _cut_again(self, level: int) -> None:
        """The slices cut again for `level` workers from where the stream stands, the
        requests in the pool's hands taken (their counters kept) and dropped."""
        while self.asked:
            self.asked.popleft()
            self._took(self.feed.take())
        close_iterator(self._here)
        self.level, self.origin, self._request = level, self.delivered, 0
        self.frontier, self.origin_position = self.delivered, self.current.copy()
        self._here = iter(()) if level else self._batches(self.current)

    def _joined_chunk(self) -> tuple[list[tuple[HostBatch, np.ndarray]], bool, float]:
        """A request's batches, the workers' slices put together (fewer at the stream's
        end), `AHEAD` requests kept in the pool's hands; and how long this thread waited."""
        while len(self.asked) < AHEAD:
            count = self._request = self._policy.request_batches(self.level, self._request or 1)
            self.feed.ask(Resume(self.origin_position, self.frontier - self.origin, self.level), count, self.level)
            self.asked.append(count)
            self.frontier += count
        self.asked.popleft()
        part, waited = _taken(self.feed, self._spent)
        self._waited(waited, part.rows if part.columns else 0)
        self._took(part)
        if part.cost is not None:
            self._policy.made(*part.cost, here=False, nbytes=_nbytes(part.columns))
        return batches_of(part, self._rows), True, waited


def batches_of(part: HostChunk, rows: int) -> list[tuple[HostBatch, np.ndarray]]:
    """A chunk of slices put together (`rows` rows and a row of `end` a batch) as its
    batches, each with the host's partitions' position after it."""
    assert isinstance(part.end, np.ndarray)
    count = len(part.end) if not part.columns else min(len(part.end), part.rows // rows)
    out = []
    for i in range(count):
        out.append(({name: column[i * rows : (i + 1) * rows] for name, column in part.columns.items()}, part.end[i]))
    return out


def _taken(feed: PoolFeed, spent: Callable[[], ThreadTime]) -> tuple[HostChunk, float]:
    """The pool's next chunk, and the seconds this thread waited for it: off its CPU (the
    workers' shares not there yet), not putting them together, which is its own work."""
    before = spent()
    part = feed.take()
    took = spent().since(before)
    return part, max(0.0, took.work - took.cpu)


def _nbytes(columns: HostBatch) -> int:
    return sum(column.nbytes for column in columns.values())
