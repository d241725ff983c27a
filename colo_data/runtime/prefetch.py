"""`Prefetcher`: runs an iterator on a background thread, a bounded number of items ahead,
so that input work overlaps the training step. Errors reach the consumer at the item
where they happened; `close()` stops the thread promptly and closes the iterator."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_S = 0.1


class _End:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """Up to `depth` items of `source`, produced on a daemon thread. (Grain's
    ThreadPrefetchIterDataset does the same with per-element instrumentation that cost
    more CPU than it saved on the demo pipeline.)"""

    def __init__(self, source: Iterator[T], depth: int) -> None:
        self._source = source
        self._queue: queue.Queue[T | _End] = queue.Queue(depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="colo-data-prefetch", daemon=True)
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
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self._done = True
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def depth(self) -> int:
        """Items ready in the queue now."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop producing, wait for the thread, and close the source iterator."""
        self._stop.set()
        self._thread.join()
