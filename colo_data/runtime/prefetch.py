"""`Prefetcher`: runs an iterator on a background thread, a bounded number of items ahead,
so that input work overlaps the training step. Errors reach the consumer at the item
where they happened; `close()` stops the thread within a deadline and closes the iterator.
The thread is registered with the `Lifecycle` that owns it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from colo_data.runtime.lifecycle import DEFAULT_TIMEOUT_S, Lifecycle, join_thread

T = TypeVar("T")
_POLL_S = 0.1


class _End:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def close_iterator(iterator: object) -> None:
    """Close a generator or any iterator that has `close()` (others need nothing)."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


class Prefetcher(Generic[T]):
    """Up to `depth` items of `source`, produced on a daemon thread.

    Grain's ThreadPrefetchIterDataset does the same with per-element instrumentation that
    cost more CPU than it saved on the demo pipeline.

    Args:
        source: the iterator to run ahead; closed on the thread when it stops.
        depth: items kept ready.
        owner: the lifecycle that stops the thread when it closes.
        name: the thread's name.
        waited: told the seconds each `next` waited for an item (the consumer's wait for input).
    """

    def __init__(
        self,
        source: Iterator[T],
        depth: int,
        owner: Lifecycle,
        name: str = "colo-data-prefetch",
        waited: Callable[[float], None] | None = None,
    ) -> None:
        self._source, self._waited = source, waited
        self._queue: queue.Queue[T | _End] = queue.Queue(depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._owner = owner
        self._key = owner.add(name, self.close)
        self._thread.start()

    def _put(self, item: T | _End) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_End(e))
        finally:
            close_iterator(self._source)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        began = time.monotonic() if self._waited is not None else 0.0
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._stop.is_set():  # closed, maybe from another thread: the iteration ends here
                    self._done = True
                    raise StopIteration from None
        if self._waited is not None:
            self._waited(time.monotonic() - began)
        if isinstance(item, _End):
            self._done = True
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def depth(self) -> int:
        """Items ready in the queue now."""
        return self._queue.qsize()

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Stop producing, wait up to `timeout` seconds for the thread (which closes the
        source iterator), and leave the owner."""
        self._stop.set()
        self._owner.discard(self._key)
        join_thread(self._thread, timeout)
