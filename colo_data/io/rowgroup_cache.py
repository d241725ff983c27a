"""`RowGroupCache`: decoded row groups kept in a byte-bounded LRU and loaded in the
background. Local files are decoded on one thread. Files on object storage go through two
stages: `fetch` (the bytes; many requests in flight on threads that mostly wait) and
`decode` (from memory, on a pool sized to the CPU); the groups asked for at once are
fetched in the runs that `together` makes (a store's request costs more than its bytes:
neighbouring groups of one file come in one). `prefetch` asks for the groups that
upcoming positions need, nearest first, as far as the byte budget allows, so that the
reads overlap the gather and transform work of the current batch. `close()` stops the
threads within a deadline; the cache starts new ones when used again."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import pyarrow as pa


@dataclass
class ReadStats:
    """What loading row groups cost so far. `io_wait_s`: time readers were blocked on a
    group still being fetched; `decode_s`: time decoding took (mostly on the decode
    threads, summed); `decoded`, `decoded_bytes`, `decoded_rows`: what came out of it."""

    io_wait_s: float = 0.0
    decode_s: float = 0.0
    decoded: int = 0
    decoded_bytes: int = 0
    decoded_rows: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: float) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)


@dataclass
class _Pending:
    result: Future[pa.Table]
    fetch: Future[Any] | None  # object storage: the fetch stage (done before `result` starts)
    reserved: int  # bytes held back for it from the budget until it is cached


class RowGroupCache:
    """Row groups by global row-group number.

    Args:
        decode: loads one row group given its global number and, on object storage, what
            `fetch` returned for it (None for local files, where decodes never overlap, so
            it may use readers that are not thread-safe).
        max_bytes: once the decoded bytes pass this, the least recently used groups are
            dropped (the newest group always stays); read-ahead stops short of it.
        fetch: object storage: fetches the bytes of a run of row groups, one item per group
            (safe from many threads).
        together: object storage: the groups asked for at once, as the runs that `fetch`
            takes (default: each group alone).
        io_threads: fetches in flight at most.
        decode_threads: decodes at once at most (object storage).
        estimate: a guess of a row group's decoded bytes, for the read-ahead's budget.
    """

    def __init__(
        self,
        decode: Callable[[int, Any], pa.Table],
        max_bytes: int,
        fetch: Callable[[list[int]], Sequence[Any]] | None = None,
        together: Callable[[list[int]], list[list[int]]] | None = None,
        io_threads: int = 1,
        decode_threads: int = 1,
        estimate: Callable[[int], int] | None = None,
    ) -> None:
        self._decode = decode
        self._fetch = fetch
        self._together = together or (lambda groups: [[group] for group in groups])
        self._max_bytes = max_bytes
        self._io_threads = io_threads
        self._decode_threads = decode_threads
        self._estimate = estimate
        self._lock = threading.RLock()  # a fetch that is done at once calls back under it
        self._decoding = threading.Lock()
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        self._bytes = 0
        self._reserved = 0
        self._pending: dict[int, _Pending] = {}
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self.stats = ReadStats()

    def _pool(self, name: str, threads: int) -> ThreadPoolExecutor:
        """Under the lock: the pool `name`, started on first use."""
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"colo-data-{name}")
        return pool

    def _submit(self, groups: list[int], reserves: list[int] | None = None) -> dict[int, _Pending]:
        """Under the lock: the loads of `groups` (neither cached nor pending), scheduled once
        each: local ones one by one, on object storage one fetch per run of `together`."""
        pending = {}
        for group, reserve in zip(groups, reserves or [0] * len(groups), strict=True):
            self._reserved += reserve
            pending[group] = self._pending[group] = _Pending(Future(), None, reserve)
        if self._fetch is None:  # a failure is forgotten on the pool's thread, after the lock is let go
            for group in groups:
                pending[group].result = self._pool("read", 1).submit(self._load_local, group)
            return pending
        for run in self._together(groups):
            fetch = self._pool("fetch", self._io_threads).submit(self._fetch, run)
            for group in run:
                pending[group].fetch = fetch
            # (a fetch that has ended already calls back here at once, and a failure forgets the run)
            fetch.add_done_callback(partial(self._fetched, run, results=[pending[group].result for group in run]))
        return pending

    def _fetched(self, run: list[int], fetch: Future[Sequence[Any]], *, results: list[Future[pa.Table]]) -> None:
        """The fetch of `run` ended: decode each group on the decode pool, or pass on its failure."""
        if fetch.cancelled() or fetch.exception() is not None:
            for group, result in zip(run, results, strict=True):
                self._forget(group)
                if fetch.cancelled():
                    result.cancel()
                else:
                    result.set_exception(cast(BaseException, fetch.exception()))
            return
        try:
            with self._lock:
                pool = self._pool("decode", self._decode_threads) if self._pools else None
            if pool is None:
                raise RuntimeError("closed")
            for group, data, result in zip(run, fetch.result(), results, strict=True):
                pool.submit(self._decode_into, group, data, result)
        except RuntimeError:  # closed meanwhile
            for group, result in zip(run, results, strict=True):
                self._forget(group)
                result.cancel()

    def _decode_into(self, group: int, data: Any, result: Future[pa.Table]) -> None:
        if not result.set_running_or_notify_cancel():
            self._forget(group)
            return
        try:
            table = self._timed_decode(group, data)
        except BaseException as e:
            self._forget(group)
            result.set_exception(e)
            return
        self._insert(group, table)
        result.set_result(table)

    def _timed_decode(self, group: int, data: Any) -> pa.Table:
        t0 = time.perf_counter()
        table = self._decode(group, data)
        self.stats.add(decode_s=time.perf_counter() - t0, decoded=1, decoded_bytes=table.nbytes, decoded_rows=table.num_rows)
        return table

    def _load_local(self, group: int) -> pa.Table:
        try:
            with self._decoding:
                table = self._timed_decode(group, None)
        except BaseException:
            self._forget(group)
            raise
        self._insert(group, table)
        return table

    def _forget(self, group: int) -> None:
        with self._lock:
            pending = self._pending.pop(group, None)
            if pending is not None:
                self._reserved -= pending.reserved

    def _insert(self, group: int, table: pa.Table) -> None:
        with self._lock:
            pending = self._pending.pop(group, None)
            if pending is not None:
                self._reserved -= pending.reserved
            if group not in self._tables:
                self._tables[group] = table
                self._bytes += table.nbytes
            while self._bytes > self._max_bytes and len(self._tables) > 1:
                _, dropped = self._tables.popitem(last=False)
                self._bytes -= dropped.nbytes

    def get(self, group: int) -> pa.Table:
        """Row group `group`, from the cache or loaded now (waiting for a load under way)."""
        return self.get_many([group])[0]

    def get_many(self, groups: Sequence[int]) -> list[pa.Table]:
        """Row groups `groups`, in that order: the missing ones are all asked for at once
        (on object storage, fetched concurrently, in runs), then waited for."""
        out: list[pa.Table | None] = []
        with self._lock:
            missing: dict[int, None] = {}  # (in the order asked)
            for group in groups:
                table = self._tables.get(group)
                if table is not None:
                    self._tables.move_to_end(group)
                elif group not in self._pending:
                    missing[group] = None
                out.append(table)
            loads = self._pending | self._submit(list(missing))
            waits = [(place, group, loads[group]) for place, group in enumerate(groups) if out[place] is None]
        for place, group, pending in waits:
            out[place] = self._wait(group, pending)
        return cast(list[pa.Table], out)

    def _wait(self, group: int, pending: _Pending) -> pa.Table:
        if pending.fetch is not None and not pending.fetch.done():
            t0 = time.perf_counter()
            try:
                pending.fetch.result()
            except Exception:
                pass  # the result says what happened
            self.stats.add(io_wait_s=time.perf_counter() - t0)
        try:
            return pending.result.result()
        except CancelledError:  # closed meanwhile (by another loader sharing the source): load it here
            if self._fetch is None:
                with self._decoding:
                    table = self._timed_decode(group, None)
            else:
                table = self._timed_decode(group, self._fetch([group])[0])
            self._insert(group, table)
            return table

    def prefetch(self, groups: Iterable[int]) -> None:
        """Start loading the groups that are neither cached nor on their way, in the order
        given, while the cached and reserved bytes stay within the budget."""
        with self._lock:
            wanted: dict[int, int] = {}  # group -> the bytes reserved for it, in the order given
            held = self._bytes + self._reserved
            for group in groups:
                if group in self._tables or group in self._pending or group in wanted:
                    continue
                reserve = self._estimate(group) if self._estimate is not None else 0
                if (self._pending or wanted) and held + reserve > self._max_bytes:
                    break
                wanted[group] = reserve
                held += reserve
            self._submit(list(wanted), list(wanted.values()))

    def close(self, timeout: float) -> None:
        """Cancel the loads not started, wait up to `timeout` seconds for those running,
        and end the threads; TimeoutError if one is still running then."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            self._pending.clear()  # a reader waiting on one of them loads it itself if it is cancelled
            self._reserved = 0
        threads = [t for pool in pools for t in pool._threads]  # noqa: SLF001 - shutdown(wait=True) has no timeout
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError(f"row-group read thread {thread.name} still running after {timeout:.1f} s")
