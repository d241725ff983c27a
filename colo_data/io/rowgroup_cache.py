"""`RowGroupCache`: decoded row groups kept in a byte-bounded LRU, decoded on one background
thread. `prefetch` asks for groups that upcoming positions need, so that decoding (Arrow
releases the GIL) overlaps the gather and transform work of the current batch. `close()`
stops the thread within a deadline; the cache starts a new one when used again."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import pyarrow as pa


class RowGroupCache:
    """Row groups by global row-group number. Decodes never overlap, so `load` may use
    readers that are not thread-safe.

    Args:
        load: decodes one row group, given its global number.
        max_bytes: once the decoded bytes pass this, the least recently used groups are
            dropped (the newest group always stays).
    """

    def __init__(self, load: Callable[[int], pa.Table], max_bytes: int) -> None:
        self._load = load
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._decoding = threading.Lock()
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        self._bytes = 0
        self._pending: dict[int, Future[pa.Table]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _submit(self, group: int) -> Future[pa.Table]:
        """Under the lock: the decode of `group`, scheduled once."""
        future = self._pending.get(group)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="colo-data-read")
            future = self._pending[group] = self._pool.submit(self._fill, group)
        return future

    def _fill(self, group: int) -> pa.Table:
        try:
            with self._decoding:
                table = self._load(group)
            with self._lock:
                self._tables[group] = table
                self._bytes += table.nbytes
                while self._bytes > self._max_bytes and len(self._tables) > 1:
                    _, dropped = self._tables.popitem(last=False)
                    self._bytes -= dropped.nbytes
            return table
        finally:
            with self._lock:
                self._pending.pop(group, None)

    def get(self, group: int) -> pa.Table:
        """Row group `group`, from the cache or decoded now (waiting for a decode under way)."""
        with self._lock:
            table = self._tables.get(group)
            if table is not None:
                self._tables.move_to_end(group)
                return table
            future = self._submit(group)
        try:
            return future.result()
        except CancelledError:  # closed meanwhile (by another loader sharing the source): decode here
            return self._fill(group)

    def prefetch(self, groups: Iterable[int]) -> None:
        """Start decoding the groups that are neither cached nor on their way."""
        with self._lock:
            for group in groups:
                if group not in self._tables:
                    self._submit(group)

    def close(self, timeout: float) -> None:
        """Cancel the decodes not started, wait up to `timeout` seconds for the one running,
        and end the thread; TimeoutError if it is still decoding then."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
        if pool is None:
            return
        threads = list(pool._threads)  # noqa: SLF001 - shutdown(wait=True) has no timeout
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError(f"row-group decode thread {thread.name} still running after {timeout:.1f} s")
