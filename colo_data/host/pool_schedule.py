"""`PooledChunks`: a host's chunks, in stream order, made here and by a pool of workers as
`PoolPolicy` decides, with the bookkeeping of who makes which (the chunks claimed, the
first position not yet claimed, the requests in the pool's hands, the growing request
size) in one object, so that it can be tested with a fake pool and clock."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from colo_data import defaults
from colo_data.host.chunk import HostChunk
from colo_data.host.chunk_work import ChunkPool, PoolStream
from colo_data.host.pool_policy import PoolPolicy

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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._pool, self._policy, self._open, self._make, self._took, self._waited = pool, policy, open_stream, make, took, waited
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
