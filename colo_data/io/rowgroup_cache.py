"""`RowGroupCache`: decoded row groups kept in a byte-bounded LRU, decoded on one background
thread. `prefetch` asks for groups that upcoming positions need, so that decoding (Arrow
releases the GIL) overlaps the gather and transform work of the current batch."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa


class RowGroupCache:
    """Row groups by global row-group number. Every decode runs on the one loader thread,
    so readers are never used from two threads.

    Args:
        load: decodes one row group, given its global number.
        max_bytes: once the decoded bytes pass this, the least recently used groups are
            dropped (the newest group always stays).
    """

    def __init__(self, load: Callable[[int], pa.Table], max_bytes: int) -> None:
        self._load = load
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
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
        return future.result()

    def prefetch(self, groups: Iterable[int]) -> None:
        """Start decoding the groups that are neither cached nor on their way."""
        with self._lock:
            for group in groups:
                if group not in self._tables:
                    self._submit(group)
