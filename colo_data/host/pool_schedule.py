"""The schedule of a host's work between its own thread and a pool of workers, as
`PoolPolicy` decides: `PooledChunks` (chunks by stream position: the chunks claimed, the
first position not yet claimed, the requests in the pool's hands, the growing request
size) and `SlicedChunks` (a partitioned pipeline's partitions cut into slices, joined
batch by batch), each one object with its bookkeeping, tested with a fake pool and clock."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from colo_data import defaults
from colo_data.host.chunk import HostBatch, HostChunk
from colo_data.host.chunk_work import ChunkPool, PoolStream, Resume
from colo_data.host.pool_policy import PoolPolicy
from colo_data.host.slice_balance import SliceBalance
from colo_data.host.slices import cut
from colo_data.runtime.prefetch import close_iterator

POOL_AHEAD = 3  # chunks in a pool's hands at once (each shared out to the workers in use)


class PooledChunks:
    """Chunks from stream position `start` to `end` (None: forever), made here and by as
    many of the pool's workers as pay; never slower than this thread alone. This thread
    makes the chunks while the workers start (two workers behind a host that waited for
    them ran at about 0.1x of none over the first 100 batches). When the pool is wanted and
    how many of its workers a request is shared out to, `policy` decides; while it is in use,
    `POOL_AHEAD` requests are in the pool's hands (the first ones smaller: 1, 2, 4 chunks),
    and whenever the next of them has not come, this thread makes chunks after them (as
    many batches as the pool has in hand), so it is never idle while there is work.

    Args:
        pool: the pool (`remote`: its stream is opened at once).
        policy: when to use the pool and how many of its workers.
        open_stream: the pool's stream from a position on (its workers start the first time).
        make: a chunk made here: (position, batches, read ahead?) -> chunk.
        took: what to do with a chunk the pool made before it is handed on (its counters).
        waited: the time (seconds) this thread waited for one of the pool's chunks, and its rows.
        start, end: stream positions (records).
        size: records a global batch.
        chunk: batches a chunk.
        rows: host rows a batch.
        clock: seconds, monotonic (the wait for the pool).
    """

    def __init__(
        self,
        pool: ChunkPool,
        policy: PoolPolicy,
        open_stream: Callable[[int], PoolStream],
        make: Callable[[int, int, bool], HostChunk],
        took: Callable[[HostChunk], None],
        waited: Callable[[float, int], None],
        *,
        start: int,
        end: int | None,
        size: int,
        chunk: int,
        rows: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy, self._open, self._make, self._took, self._waited = policy, open_stream, make, took, waited
        self._end, self._size, self._chunk, self._rows, self._clock = end, size, chunk, rows, clock
        self.stream: PoolStream | None = open_stream(start) if pool.remote else None
        self.position = start  # of the next chunk handed on
        self.frontier: int | None = None  # while the pool is in use: the first position not yet claimed
        # chunks claimed, in stream order: (position, the chunk if made here, else None for the pool's)
        self.claimed: deque[tuple[int, HostChunk | None]] = deque()
        self.asked = 0  # requests in the pool's hands
        self.in_pool = self.here = 0  # host batches claimed: in the pool's hands, and made here ahead
        self.batches = chunk  # of the next request: 1, 2, 4 chunks, quick at first

    def __iter__(self) -> Iterator[HostChunk]:
        while self._end is None or self.position < self._end:
            self._decide()
            got = self._next()
            if got is None:  # one made here ahead of the pool's: the policy's turn again
                continue
            part, at = got
            self.position += part.rows // self._rows * self._size
            self._policy.delivered(part.rows, at)
            if self.frontier is not None and not self._policy.level and not self.claimed:  # given up, its chunks all taken
                self.frontier = None
                self._policy.released()
            yield part

    def _decide(self) -> None:
        """The policy's turn, once a chunk: open the pool's stream, take it on (asked from
        the chunk after the one made here now), and keep `POOL_AHEAD` requests in its hands."""
        ready = None if self.stream is None else self.stream.ready
        if self.frontier is None and self._policy.wants_stream(ready):
            self.stream = self._open(self.position)
            ready = self.stream.ready
        if self._policy.adjust(self.frontier, ready):
            self.frontier, self.batches = self.position + self._chunk * self._size, self._chunk
        while self._policy.level and self.asked < POOL_AHEAD and self._left(self.frontier):
            assert self.stream is not None and self.frontier is not None  # asked only once the stream is ready
            count = self._count(self.frontier, self.batches)
            self.stream.ask(self.frontier, count, self._policy.level)
            self.claimed.append((self.frontier, None))
            self.asked, self.in_pool, self.frontier = self.asked + 1, self.in_pool + count, self.frontier + count * self._size
            self.batches = min(2 * self.batches, self._chunk * defaults.WORKER_CHUNKS)

    def _next(self) -> tuple[HostChunk, int | None] | None:
        """The chunk at `position`, and its position if the pool made it: made here where it
        is not claimed, the one made here ahead, or the pool's; None where the pool's has not
        come and this thread made the chunk after the claimed ones instead."""
        head = self.claimed[0][0] if self.claimed else self.frontier  # where the claimed chunks start
        if head is None or head > self.position:  # not claimed: made here
            stop = head if self._end is None else self._end if head is None else min(self._end, head)
            count = self._chunk if stop is None else min(self._chunk, (stop - self.position) // self._size)
            return self._make(self.position, count, self.frontier is None), None
        position, made = self.claimed[0]
        if made is not None:  # made here ahead, its turn now
            self.claimed.popleft()
            self.here -= made.rows // self._rows
            return made, None
        assert self.frontier is not None and self.stream is not None  # claimed only while the pool is in use
        if self._policy.level and self.here < self.in_pool and not self.stream.has_next() and self._left(self.frontier):
            # the pool's next chunk has not come: make the one after the last claimed, here
            count = self._count(self.frontier, self._chunk)
            self.claimed.append((self.frontier, self._make(self.frontier, count, False)))
            self.here, self.frontier = self.here + count, self.frontier + count * self._size
            return None
        self.claimed.popleft()
        began = self._clock()
        part = self.stream.take()
        self._waited(self._clock() - began, part.rows)
        self.asked, self.in_pool = self.asked - 1, self.in_pool - part.rows // self._rows
        self._took(part)
        return part, position

    def _left(self, position: int | None) -> bool:
        """Whether there is stream left at `position` (None: the pool is not in use)."""
        return position is not None and (self._end is None or position < self._end)

    def _count(self, position: int, batches: int) -> int:
        """`batches`, or fewer where the stream ends first."""
        return batches if self._end is None else min(batches, (self._end - position) // self._size)


class SlicedChunks:
    """A partitioned pipeline's host batches with a pool: the host's partitions `owned` cut
    into `level + 1` slices (`slices.cut`), the first computed here, the others by as many
    workers, each going on ahead on its own (`Resume`; `POOL_AHEAD` chunks asked of the pool),
    put together batch by batch (`joined`). `policy` decides the level, counting batches for
    positions, and a `SliceBalance` this thread's share. At a change of level the chunks
    asked are taken and dropped; at a change of share, the pool is asked for no more and the
    chunks asked are joined first. Either way the slices are cut again from where the stream
    stands: the batches do not depend on it.

    Args:
        pool, policy, took, waited: as `PooledChunks`'.
        open_stream: the pool's stream (its workers start the first time).
        batches: a slice's batches computed here from a position on, each with the slice's
            position after it (`partitioned_batches`; None: all of `owned`).
        kept_rows: the host's rows a batch of a slice of its partitions.
        start: the pipeline's position (`colo_data.pipeline.parts`).
        owned: the host's partitions.
        chunk: batches a request.
        rows: host rows a batch.
        clock: seconds, monotonic (the wait for the pool, the slice balance's measurements).
    """

    def __init__(
        self,
        pool: ChunkPool,
        policy: PoolPolicy,
        open_stream: Callable[[], PoolStream],
        batches: Callable[[np.ndarray, range | None], Iterator[tuple[HostBatch, np.ndarray]]],
        kept_rows: Callable[[range], int],
        took: Callable[[HostChunk], None],
        waited: Callable[[float, int], None],
        *,
        start: np.ndarray,
        owned: range,
        chunk: int,
        rows: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy, self._open, self._batches, self._kept_rows = policy, open_stream, batches, kept_rows
        self._took, self._waited, self._owned, self._chunk, self._rows, self._clock = took, waited, owned, chunk, rows, clock
        self.stream: PoolStream | None = open_stream() if pool.remote else None
        self.current = np.array(start, np.int64)  # the pipeline's position where the stream stands
        self.level = self.delivered = 0  # the workers that compute slices; batches handed on
        self.balance: SliceBalance | None = None  # this thread's share while the workers compute slices
        self.share: int | None = None  # a share to cut the slices to, once the chunks asked are joined
        self.mine_count = 0  # the partitions of this thread's slice as cut (the balance may have moved on)
        self.origin = self.frontier = 0  # the batch the slices were cut at; the next asked of the pool
        self.origin_position = self.current.copy()  # the position there
        self.asked: deque[int] = deque()  # the first batch of each chunk in the pool's hands
        self._here: Iterator[tuple[HostBatch, np.ndarray]] = batches(self.current, None)

    def __iter__(self) -> Iterator[HostChunk]:
        owned, policy = self._owned, self._policy
        try:
            while True:
                ready = None if self.stream is None else self.stream.ready
                if not self.level and policy.wants_stream(ready):
                    self.stream = self._open()
                    ready = self.stream.ready
                policy.adjust(self.frontier if self.level else None, ready)
                wanted = min(policy.level, len(owned) - 1)
                if wanted != self.level or (self.share is not None and not self.asked):
                    self._cut_again(wanted)
                if self.balance is None:
                    batch = next(self._here, None)
                    if batch is None:
                        return
                    made, at = [batch], None
                else:
                    made, at = self._joined_chunk(self.balance)
                for columns, end in made:
                    self.current[0], self.current[1 + owned.start : 1 + owned.stop] = end[0], end[1:]
                    self.delivered += 1
                    yield HostChunk(columns, end)
                policy.delivered(len(made) * self._rows, at)
                if self.level and len(made) < self._chunk:  # the stream ended
                    return
        finally:
            close_iterator(self._here)

    def _cut_again(self, wanted: int) -> None:
        """The slices cut again from where the stream stands, for `wanted` workers (the
        chunks in the pool's hands taken first: joined, or dropped at a change of level)."""
        while self.asked:
            assert self.stream is not None
            self.asked.popleft()
            self._took(self.stream.take())
        close_iterator(self._here)
        if self.level and not self._policy.level:
            self._policy.released()
        if wanted != self.level:
            self.level, self.balance = wanted, SliceBalance(len(self._owned), wanted, self._clock) if wanted else None
        elif self.balance is not None:
            self.balance.restart()
        self.share, self.origin, self.frontier = None, self.delivered, self.delivered
        self.origin_position, self.mine_count = self.current.copy(), self.balance.here if self.balance else 0
        mine = cut(self._owned, self.level, 0, self.mine_count) if self.balance else None
        self._here = self._batches(self.current, mine)

    def _joined_chunk(self, balance: SliceBalance) -> tuple[list[tuple[HostBatch, np.ndarray]], int]:
        """A chunk's batches, this thread's slice joined with the workers' (asked ahead,
        `POOL_AHEAD` requests, unless a new share waits for them to be joined), and the
        first batch's place in the stream."""
        assert self.stream is not None
        while self.share is None and len(self.asked) < POOL_AHEAD:
            resume = Resume(self.origin_position, self.frontier - self.origin, self.level, self.mine_count)
            self.stream.ask(resume, self._chunk, self.level)
            self.asked.append(self.frontier)
            self.frontier += self._chunk
        mine = list(itertools.islice(self._here, self._chunk))
        began = self._clock()
        part = self.stream.take()
        waited = self._clock() - began
        self._waited(waited, part.rows)
        self._took(part)
        at = self.asked.popleft()
        workers = range(cut(self._owned, self.level, 0, self.mine_count).stop, self._owned.stop)
        made = joined(mine, part, self._kept_rows(workers))
        self.share = balance.record(len(made), waited) if self.share is None else self.share
        return made, at


def joined(mine: list[tuple[HostBatch, np.ndarray]], part: HostChunk, rows: int) -> list[tuple[HostBatch, np.ndarray]]:
    """A chunk's batches put together from this thread's slice of the partitions (`mine`,
    the first) and the workers' (`part`: `rows` rows and a row of `end` a batch): their rows
    and positions in slice order. As many batches as both made (fewer at the stream's end)."""
    assert isinstance(part.end, np.ndarray)
    out = []
    for i in range(min(len(part.end), len(mine))):
        columns, end = mine[i]
        theirs = slice(i * rows, (i + 1) * rows)
        batch = {name: np.concatenate([column, part.columns[name][theirs]]) for name, column in columns.items()}
        out.append((batch, np.concatenate([end, part.end[i, 1:]])))
    return out
