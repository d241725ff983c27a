"""`RangeFile`: a read-only file made of byte ranges of a larger file already in memory,
so that pyarrow's Parquet reader decodes a row group, or parses a footer, fetched from
object storage with requests of our own."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa


class RangeFile:
    """A read-only file over the fetched ranges of a larger file, for `pa.PythonFile`: the
    Parquet reader reads the column chunks from memory. A read outside the ranges (a writer
    that put a chunk's header elsewhere) is fetched with `more(offset, length)`."""

    def __init__(self, ranges: tuple[tuple[int, bytes], ...], size: int, more: Callable[[int, int], bytes]) -> None:
        self._ranges = ranges
        self._size = size
        self._more = more
        self._pos = 0
        self.closed = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        start = self._pos
        stop = self._size if n is None or n < 0 else min(self._size, start + n)
        self._pos = stop
        for offset, data in self._ranges:
            if offset <= start and stop <= offset + len(data):
                return data[start - offset : stop - offset]
        return self._more(start, stop - start)

    def close(self) -> None:
        self.closed = True


def range_file(ranges: tuple[tuple[int, bytes], ...], size: int, more: Callable[[int, int], bytes]) -> pa.PythonFile:
    """A `RangeFile` as a pyarrow file."""
    return pa.PythonFile(RangeFile(ranges, size, more), mode="r")
