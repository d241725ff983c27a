"""Row groups of files on object storage (GCS, S3: any pyarrow filesystem that is not the
local one). Row groups are fetched as the byte ranges of the wanted columns' chunks: the
ranges of neighbouring row groups asked for together in one request where they are near
each other (a store's request costs more than its bytes), retried on transient errors and
optionally kept in a `DiskCache`, a row group's ranges each under a key of their own; they
are decoded afterwards, from memory, by whoever holds the bytes. So the requests of many row
groups can be in flight at once on threads that only wait, while decoding stays on a pool
sized to the CPU. Each file is opened once per process, checked against what the source
indexed (size, version, row groups)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from colo_data.errors import SourceError
from colo_data.io.disk_cache import DiskCache
from colo_data.io.files import (
    DataFile,
    Kept,
    changed,
    layout,
    object_uri,
    object_version,
    open_object,
    out_of_resources,
    parquet_footer,
    reader_schema,
    row_group_count,
    schema_differs,
    undecodable,
)
from colo_data.io.range_file import range_file
from colo_data.io.retry import Exhausted, with_retries

HOLE = 1 << 20  # column chunks closer than this are fetched in one request (the gap is read too)
RUN_BYTES = 16 << 20  # at most this many bytes in one request of several ranges (S3's advice: 8-16 MB)


@dataclass(frozen=True)
class Fetched:
    """A row group's bytes as fetched: `(offset in the file, data)` per range."""

    ranges: tuple[tuple[int, bytes], ...]


@dataclass
class _Opened:
    handle: Any  # pyarrow RandomAccessFile: read_at is safe from many threads
    reader: pq.ParquetFile | ipc.RecordBatchFileReader
    leaves: tuple[int, ...]  # Parquet: the leaf columns of the wanted columns
    lock: threading.Lock  # IPC: one get_batch at a time per reader


class RemoteFiles:
    """The files of one source on object storage, as seen from one process.

    Args:
        fs: their filesystem.
        files: the files as the source indexed them.
        schema: the wanted columns.
        retries: retries of a transient failure of one request.
        disk: where fetched bytes are kept between epochs and runs, or None.
        kept: what making the source read (in this process), by file: used at the first read.
    """

    def __init__(
        self,
        fs: pafs.FileSystem,
        files: list[DataFile],
        schema: pa.Schema,
        retries: int,
        disk: DiskCache | None,
        kept: dict[int, Kept],
    ) -> None:
        self._fs = fs
        self._files = files
        self._schema = schema
        self._columns = list(schema.names)
        self._retries = retries
        self._disk = disk
        self._opened: dict[int, _Opened] = {}
        self._kept = kept
        self._opening: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self.requests = 0  # reads of row-group bytes that returned data, retries not counted
        self.fetched_bytes = 0  # bytes that came from storage

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def _call(self, call: Callable[[], Any], file: DataFile, group: int, what: str) -> Any:
        """`call()` with retries. A failure that lasts is the error for a changed file when
        the object is gone or has another size now, else a SourceError naming the object."""
        try:
            return with_retries(call, self._retries)
        except Exhausted as e:
            last = e.__cause__
            if not e.transient and not self._same(file):
                raise changed(self._fs, file, group) from last
            kind = "a transient error that lasted" if e.transient else "an error that is not transient"
            raise SourceError(
                f"{object_uri(self._fs, file.path)}: {what} failed after {e} ({kind}); "
                f"the last error: {type(last).__name__}: {last}. "
                "Check that the object store is reachable from this host and the credentials (taken from the "
                "environment as the filesystem reads them) allow reading it."
            ) from last

    def _same(self, file: DataFile) -> bool:
        """Whether the object is still the one indexed (same size and version); True when
        the store cannot say (then the read's own error is the message)."""
        try:
            handle = open_object(self._fs, file.path)
        except FileNotFoundError:
            return False
        except (OSError, pa.ArrowException):
            return True
        return handle.size() == file.size and object_version(self._fs, file.path, handle) == file.version

    def _open(self, index: int) -> _Opened:
        """File `index`, opened once (later calls wait for the first), checked against the index."""
        opened = self._opened.get(index)
        if opened is not None:
            return opened
        with self._lock:
            lock = self._opening.setdefault(index, threading.Lock())
        with lock:
            opened = self._opened.get(index)
            if opened is None:
                opened = self._opened[index] = self._open_now(index, self._files[index])
        return opened

    def _reuse(self, file: DataFile, kept: Kept) -> _Opened:
        """`file` through the handle that making the source opened (GCS: its reads name
        the generation opened), once a lookup says it is still the object indexed."""
        info = self._call(lambda: self._fs.get_file_info(file.path), file, 0, "looking up the object")
        if info.type != pafs.FileType.File or info.size != file.size or info.mtime != kept.written:
            raise changed(self._fs, file, 0)
        handle = kept.handle
        assert handle is not None
        if kept.footer is not None:
            reader: Any = pq.ParquetFile(range_file((), file.size, handle.read_at), metadata=kept.footer)
        else:
            reader = self._call(lambda: ipc.open_file(handle), file, 0, "reading the Arrow IPC footer")
        return self._adopt(file, handle, reader)

    def _adopt(self, file: DataFile, handle: Any, reader: Any) -> _Opened:
        """A file opened already, with the leaf columns (Parquet) of the wanted columns,
        once its schema is checked against the source's."""
        differs = schema_differs(file, reader_schema(reader), self._schema)
        if differs is not None:
            raise differs
        paths = reader.reader.column_paths if file.format == "parquet" else []
        leaves = tuple(j for j, path in enumerate(paths) if path[0] in self._columns)
        return _Opened(handle, reader, leaves, threading.Lock())

    def _open_now(self, index: int, file: DataFile) -> _Opened:
        """Open `file` and check that it is still the object indexed: same size and version,
        same row groups. (On GCS, pyarrow makes the first request of an opened object while
        holding the GIL: every thread of the process waits that round trip, once per file:
        where making the source kept the handle, it is used instead)."""
        kept = self._kept.pop(index, None)
        if kept is not None and kept.handle is not None:
            return self._reuse(file, kept)
        handle = self._call(lambda: open_object(self._fs, file.path), file, 0, "opening the object")
        if handle.size() != file.size or object_version(self._fs, file.path, handle) != file.version:
            raise changed(self._fs, file, 0)
        footer = kept.footer if kept is not None else None
        if footer is not None:  # read when the source was made, in this process: no request
            reader: Any = pq.ParquetFile(range_file((), file.size, handle.read_at), metadata=footer)
        elif file.format == "parquet":
            reader = self._call(lambda: parquet_footer(handle, file.size), file, 0, "reading the Parquet footer")
        else:
            reader = self._call(lambda: ipc.open_file(handle), file, 0, "reading the Arrow IPC footer")
        if row_group_count(reader) != len(file.row_groups) or (file.format == "parquet" and layout(reader) != file.row_groups):
            raise changed(self._fs, file, 0)
        return self._adopt(file, handle, reader)

    def _ranges(self, opened: _Opened, local: int) -> list[tuple[int, int]]:
        """`(offset, length)` of the wanted columns' chunks of row group `local`, merged
        where they are less than `HOLE` apart."""
        group = opened.reader.metadata.row_group(local)
        spans = []
        for j in opened.leaves:
            column = group.column(j)
            start = column.data_page_offset
            dictionary = column.dictionary_page_offset
            if column.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
                start = dictionary
            spans.append((start, column.total_compressed_size))
        return _merged(spans, HOLE)

    def _key(self, file: DataFile, what: str) -> str:
        return f"{self._fs.type_name}:{file.path}:{file.size}:{file.version}:{what}"

    def _read(self, index: int, opened: _Opened, group: int, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of file `index` (for its row group `group`), fetched."""
        file = self._files[index]
        what = f"reading bytes {offset}..{offset + length}"
        data = self._call(lambda: opened.handle.read_at(length, offset), file, group, what)
        if len(data) != length:
            raise changed(self._fs, file, group)
        self._count(requests=1, fetched_bytes=length)
        return data

    def _kept_or_read(self, index: int, opened: _Opened, group: int, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of file `index`: from the disk cache, else fetched (and kept)."""
        key = self._key(self._files[index], f"{offset}:{length}")
        data = self._disk.get(key) if self._disk is not None else None
        if data is None:
            data = self._read(index, opened, group, offset, length)
            if self._disk is not None:
                self._disk.put(key, data)
        return data

    def fetch(self, index: int, groups: Sequence[int]) -> list[Fetched]:
        """The bytes of row groups `groups` of file `index` (IPC: each record batch's wanted
        columns as an IPC stream): the ranges not in the disk cache, where they lie less
        than `HOLE` apart, in one request of at most `RUN_BYTES`; the requests of ranges
        far apart (other columns between them) at once."""
        opened = self._open(index)
        file = self._files[index]
        if file.format != "parquet":
            return [self._batch(index, opened, local) for local in groups]
        wanted = {local: self._ranges(opened, local) for local in groups}
        got: dict[tuple[int, int], bytes] = {}
        owner: dict[int, int] = {}  # a missing range's offset -> its row group, for messages
        for local, ranges in wanted.items():
            for offset, length in ranges:
                data = self._disk.get(self._key(file, f"{offset}:{length}")) if self._disk is not None else None
                if data is None:
                    owner[offset] = local
                else:
                    got[(offset, length)] = data
        missing = sorted({(o, n) for ranges in wanted.values() for o, n in ranges} - got.keys())
        spans = _merged(missing, HOLE, RUN_BYTES)

        def request(span: tuple[int, int]) -> None:
            start, length = span
            data = self._read(index, opened, owner[start], start, length)
            for offset, size in missing:
                if start <= offset < start + length:
                    piece = got[(offset, size)] = data[offset - start : offset - start + size]
                    if self._disk is not None:
                        self._disk.put(self._key(file, f"{offset}:{size}"), piece)

        if len(spans) > 1:
            with ThreadPoolExecutor(min(len(spans), 8), thread_name_prefix="colo-data-ranges") as requests:
                list(requests.map(request, spans))
        elif spans:
            request(spans[0])
        return [Fetched(tuple((offset, got[(offset, length)]) for offset, length in wanted[local])) for local in groups]

    def _batch(self, index: int, opened: _Opened, local: int) -> Fetched:
        """Record batch `local` of IPC file `index`, its wanted columns as an IPC stream."""
        file = self._files[index]
        key = self._key(file, f"batch{local}:{','.join(self._columns)}")
        data = self._disk.get(key) if self._disk is not None else None
        if data is not None:
            return Fetched(((0, data),))

        def batch() -> bytes:
            with opened.lock:
                wanted = opened.reader.get_batch(local).select(self._columns)
            sink = pa.BufferOutputStream()
            with ipc.new_stream(sink, wanted.schema) as writer:  # an IPC stream, so that dictionaries come along
                writer.write_batch(wanted)
            return sink.getvalue().to_pybytes()

        data = self._call(batch, file, local, f"reading record batch {local}")
        self._count(requests=1, fetched_bytes=len(data))
        if self._disk is not None:
            self._disk.put(key, data)
        return Fetched(((0, data),))

    def decode(self, index: int, local: int, fetched: Fetched) -> pa.Table:
        """Row group `local` of file `index`, decoded from its fetched bytes.

        Raises:
            CorruptFileError: the bytes do not decode (the file is damaged).
            SourceError: the row group has other rows than indexed (the file changed).
        """
        file = self._files[index]
        opened = self._open(index)
        try:
            if file.format == "parquet":
                more = lambda offset, length: self._kept_or_read(index, opened, local, offset, length)  # noqa: E731
                source = range_file(fetched.ranges, file.size, more)
                parquet = pq.ParquetFile(source, metadata=opened.reader.metadata)
                table = parquet.read_row_group(local, columns=self._columns, use_threads=False)
            else:
                batch = ipc.open_stream(pa.py_buffer(fetched.ranges[0][1])).read_next_batch()
                batch.validate(full=True)
                table = pa.Table.from_batches([batch])
        except (pa.ArrowException, OSError, MemoryError) as e:
            resources = out_of_resources(e, file.path)
            if resources is not None:
                raise resources from e
            if not self._same(file):
                raise changed(self._fs, file, local) from e
            raise undecodable(self._fs, file, local, e) from e
        if table.num_rows != file.row_groups[local]:
            raise changed(self._fs, file, local)
        return table.combine_chunks()


def _merged(ranges: Sequence[tuple[int, int]], hole: int, most: int | None = None) -> list[tuple[int, int]]:
    """`(offset, length)` ranges as the fewest ranges that cover them: ranges less than
    `hole` apart are joined (the gap is read too), while the joined range stays within
    `most` bytes."""
    merged: list[list[int]] = []
    for start, length in sorted(ranges):
        stop = start + length
        if merged and start - merged[-1][1] < hole and (most is None or max(stop, merged[-1][1]) - merged[-1][0] <= most):
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(start, stop - start) for start, stop in merged]
