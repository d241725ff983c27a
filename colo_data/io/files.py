"""Data files: Parquet and Arrow IPC format detection, opening a reader, the row-group
layout read from the metadata, and the errors for a file that cannot be read or changed
after a source indexed it."""

from __future__ import annotations

import errno
import os
import platform
import posixpath
import resource
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from colo_data.errors import CorruptFileError, ResourceError, SourceError, StaleIndexError
from colo_data.io.fsspec_store import StoreHandler, schemes
from colo_data.io.range_file import range_file
from colo_data.io.redact import redacted
from colo_data.io.retry import transient

_PARQUET_MAGIC = b"PAR1"
_IPC_FILE_MAGIC = b"ARROW1"
_IPC_STREAM_MAGIC = b"\xff\xff\xff\xff"
TAIL = 64 * 2**10  # bytes read from the end of a Parquet object for its footer, in one request
MACHINE = platform.node()  # this machine's name: a local file's time of last writing is compared only here


@dataclass(frozen=True)
class DataFile:
    """One data file as a source indexed it: what reads check it against."""

    path: str
    format: str  # "parquet" or "ipc"
    row_groups: tuple[int, ...]
    size: int  # bytes when the source was made: reads check that the file still has them
    version: str | None = None  # object storage: its generation (GCS) or ETag (S3): a rewrite changes it
    mtime_ns: int | None = None  # a local file: its time of last writing (os.stat): a rewrite changes it
    machine: str | None = None  # where `mtime_ns` was read: a copy on another machine has its own time
    index: str | None = None  # the dataset index that gave its format and row groups: a suspect where they differ


def detect_format(fs: pafs.FileSystem, path: str) -> str:
    """The format ("parquet" or "ipc"), from the file's first bytes."""
    with fs.open_input_file(path) as f:
        return format_of(f.read(6), path)


def format_of(head: bytes, path: str) -> str:
    """The format ("parquet" or "ipc"), from the first 6 bytes of the file at `path`."""
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    if head.startswith(_IPC_FILE_MAGIC):
        return "ipc"
    if head.startswith(_IPC_STREAM_MAGIC):
        raise SourceError(
            f"{path}: Arrow IPC stream format, which has no random access. "
            "Rewrite it as an IPC file (pyarrow.ipc.new_file) or as Parquet."
        )
    raise CorruptFileError(
        f"{path}: neither Parquet nor Arrow IPC (starts with {head!r}). Remove it from the paths or rewrite it."
    )


def open_reader(
    fs: pafs.FileSystem, path: str, fmt: str, footer: pq.FileMetaData | None = None
) -> tuple[pq.ParquetFile | ipc.RecordBatchFileReader, pa.NativeFile]:
    """A reader of the file (with a Parquet `footer` read before: not read again), and its
    handle, which the caller closes. A local IPC file is memory-mapped: its record batches
    are views of the file, read only where used (copying them cost the demo pipeline over
    half its throughput from IPC files), and they outlive the handle's closing. Parquet is
    decoded into memory anyway: reading it through a mapping saved about 1% of the decode,
    but a rewrite in place that cut the file short during a decode killed the process
    (SIGBUS, not an exception)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        handle = fs.open_input_file(path)
    else:
        handle = pa.memory_map(path) if fmt == "ipc" else pa.OSFile(path)
    try:
        reader = pq.ParquetFile(handle, metadata=footer) if fmt == "parquet" else ipc.open_file(handle)
    except BaseException:
        handle.close()
        raise
    return reader, handle


def _unreadable_metadata(error: BaseException, path: str, fmt: str) -> ResourceError | CorruptFileError:
    """The error for `fmt` metadata at `path` that could not be read: the process ran out of
    resources (`out_of_resources`), or else the file is damaged."""
    resources = out_of_resources(error, path)
    if resources is not None:
        return resources
    return CorruptFileError(
        f"{path}: cannot read the {fmt} metadata ({error}). The file is truncated or damaged: rewrite or remove it."
    )


def out_of_resources(error: BaseException, path: str) -> ResourceError | None:
    """The error for a read that failed because the process ran out of file descriptors or
    memory (not because of the file), or None for any other failure."""
    text = str(error)
    if isinstance(error, MemoryError | pa.ArrowMemoryError) or getattr(error, "errno", None) == errno.ENOMEM:
        return ResourceError(f"{path}: out of memory while reading it ({text}); the file is fine: give the process more memory")
    if getattr(error, "errno", None) in (errno.EMFILE, errno.ENFILE) or "Too many open files" in text:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return ResourceError(
            f"{path}: the process has too many open files ({text}; its limit, RLIMIT_NOFILE, is {soft}); the file is "
            "fine: colo-data holds no data file open between reads, so something else in the process holds them: "
            "close them, or raise the limit (ulimit -n)"
        )
    return None


def layout(reader: pq.ParquetFile | ipc.RecordBatchFileReader) -> tuple[int, ...]:
    """Rows of each row group (IPC record batch): from the footer for Parquet, from every
    batch's header for IPC (which reads every batch of a file that is not memory-mapped)."""
    if isinstance(reader, pq.ParquetFile):
        meta = reader.metadata
        return tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return tuple(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def reader_schema(reader: pq.ParquetFile | ipc.RecordBatchFileReader) -> pa.Schema:
    """The file's Arrow schema, from its footer."""
    return reader.schema_arrow if isinstance(reader, pq.ParquetFile) else reader.schema


def row_group_count(reader: pq.ParquetFile | ipc.RecordBatchFileReader) -> int:
    """Row groups (IPC record batches) of the file, from its footer."""
    return reader.num_row_groups if isinstance(reader, pq.ParquetFile) else reader.num_record_batches


def unreadable(path: str, error: PermissionError) -> SourceError:
    """The error for a file this process may not read."""
    return SourceError(
        f"{path}: permission denied ({error.strerror or error}). The file is fine as far as colo-data knows: give "
        "this process read access (its user or group), or leave the file out of the paths."
    )


@dataclass
class Kept:
    """What the process that made a source keeps of an object it inspected: its Parquet
    footer (not read again), and on GCS the open handle with the object's time of writing,
    checked with a lookup at the first read instead of opening the object again (pyarrow
    makes the first request of a GCS handle while holding the GIL: a round trip during
    which no other thread runs)."""

    footer: pq.FileMetaData | None
    handle: pa.NativeFile | None = None
    written: datetime | None = None


def _written(handle: pa.NativeFile) -> datetime | None:
    """A GCS object's time of writing, from what opening it returned (None if not said)."""
    try:
        value = dict(handle.metadata()).get("updated")
        return datetime.fromisoformat(value.decode()) if value else None
    except (pa.ArrowException, OSError, NotImplementedError, ValueError):
        return None


def object_version(fs: pafs.FileSystem, path: str, handle: pa.NativeFile) -> str | None:
    """An object's generation (GCS) or ETag (S3), from what opening it (`handle`) returned;
    None where the filesystem says neither."""
    handler = getattr(fs, "handler", None)
    if isinstance(handler, StoreHandler):  # an fsspec filesystem: its handles carry no metadata
        return handler.version(path)
    try:
        meta = {key.decode() if isinstance(key, bytes) else key: value for key, value in handle.metadata().items()}
    except (pa.ArrowException, OSError, NotImplementedError):
        return None
    for key in ("generation", "ETag", "etag", "Last-Modified", "updated"):
        value = meta.get(key)
        if value:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def object_uri(fs: pafs.FileSystem, path: str) -> str:
    """An object's name as a user writes it (`gs://bucket/key`, `s3://bucket/key`), for a
    message: `redacted`."""
    known = [scheme for scheme in schemes(fs) if scheme != "file"]
    return redacted(f"{known[0]}://{path}" if known else path)


def open_object(fs: pafs.FileSystem, path: str) -> pa.NativeFile:
    """The object at `path` opened for reading. A handle that comes back closed (GCS, after
    a connection reset while opening) is a ConnectionError: transient, worth a retry."""
    handle = fs.open_input_file(path)
    if handle.closed:
        raise ConnectionError(f"{path}: opening it returned a closed file (the connection was lost)")
    return handle


def _tail(handle: pa.NativeFile, size: int) -> bytes:
    """The last `TAIL` bytes of the object (all of a smaller one), in one request."""
    return handle.read_at(min(size, TAIL), size - min(size, TAIL))


def parquet_footer(handle: pa.NativeFile, size: int, tail: bytes | None = None) -> pq.ParquetFile:
    """A Parquet reader of the object `handle` (of `size` bytes) that has parsed its footer
    from `tail`, its last bytes (read now when not given; a longer footer is read as
    needed); it reads nothing else from `handle` by itself."""
    tail = _tail(handle, size) if tail is None else tail
    more = lambda offset, length: handle.read_at(length, offset)  # noqa: E731
    return pq.ParquetFile(range_file(((size - len(tail), tail),), size, more))


def _remote_reader(handle: pa.NativeFile, size: int, path: str) -> tuple[str, pq.ParquetFile | ipc.RecordBatchFileReader]:
    """The format and a reader of an object: Parquet is told by its footer's magic bytes
    (one request for the footer and its magic); otherwise the first bytes say what it is."""
    tail = _tail(handle, size)
    if size >= 12 and tail.endswith(_PARQUET_MAGIC):
        return "parquet", parquet_footer(handle, size, tail)
    fmt = format_of(handle.read_at(6, 0), path)
    return fmt, pq.ParquetFile(handle) if fmt == "parquet" else ipc.open_file(handle)


def inspect_file(fs: pafs.FileSystem, path: str, kept: dict[str, Kept] | None = None) -> tuple[DataFile, pa.Schema]:
    """The file's format, row groups, size (on object storage its version, locally its time
    of last writing) and schema, from its metadata. On object storage the file is opened
    once, its footer read through that handle, and what a later read can use is kept in
    `kept[path]`; a transient error is raised as it is, for the caller to retry.

    Raises:
        SourceError: the file is an IPC stream, or may not be read.
        CorruptFileError: it is not Parquet or Arrow IPC, or its metadata cannot be read.
    """
    remote = not isinstance(fs, pafs.LocalFileSystem)
    version, mtime_ns, fmt = None, None, "data"
    try:
        if remote:
            handle = open_object(fs, path)
            version, size = object_version(fs, path, handle), handle.size()
            fmt, reader = _remote_reader(handle, size, path)
        else:
            mtime_ns = os.stat(path).st_mtime_ns  # before the metadata is read: a write after it is noticed
            fmt = detect_format(fs, path)
    except PermissionError as e:
        raise unreadable(path, e) from e
    except (pa.ArrowException, OSError) as e:
        if transient(e) or isinstance(e, SourceError):
            raise
        raise _unreadable_metadata(e, path, fmt) from e
    local_handle: pa.NativeFile | None = None
    try:
        if not remote:
            reader, local_handle = open_reader(fs, path, fmt)
            size = local_handle.size()
        sizes = layout(reader)
        schema = reader_schema(reader)
        schema.names  # noqa: B018 - decoded lazily: damaged metadata can hold names that are not UTF-8
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        if remote and transient(e):
            raise
        raise _unreadable_metadata(e, path, fmt) from e
    finally:
        if local_handle is not None:  # the metadata is read: no local file stays open
            local_handle.close()
    if remote and kept is not None:
        footer = reader.metadata if isinstance(reader, pq.ParquetFile) else None
        written = _written(handle) if fs.type_name == "gcs" else None
        kept[path] = Kept(footer, handle if written is not None else None, written)
    return DataFile(path, fmt, sizes, size, version, mtime_ns, None if remote else MACHINE), schema


DO_NOT_REWRITE = (
    "Rebuild the pipeline (and its loader) to read the file as it is now, and do not rewrite files "
    "in place under a running job: write new files and point a new pipeline at them."
)


def size_now(fs: pafs.FileSystem, path: str) -> int | None:
    """The file's size in bytes now; None when it is gone."""
    info = fs.get_file_info(path)
    return info.size if info.type == pafs.FileType.File else None


def _when(mtime_ns: int | None) -> str:
    """A file's time of last writing as a user reads it (UTC, to the microsecond)."""
    if mtime_ns is None:
        return "unknown"
    return datetime.fromtimestamp(mtime_ns / 1e9, tz=UTC).isoformat(timespec="microseconds")


def changed(fs: pafs.FileSystem, file: DataFile, group: int) -> SourceError:
    """The error for a file that is no longer the one indexed when the source was made,
    found while reading its row group `group`: what differs, from a fresh look at the file
    (an error path: its cost does not matter)."""
    then = f"{sum(file.row_groups)} rows in {len(file.row_groups)} row groups then"
    size = size_now(fs, file.path)
    if size is None:
        return SourceError(
            f"{file.path} was removed after the pipeline was built ({then}; row group {group} was still to be "
            f"read). {DO_NOT_REWRITE}"
        )
    try:
        now, _ = inspect_file(fs, file.path)
    except CorruptFileError as e:
        reason = e.__cause__ if e.__cause__ is not None else e
        return CorruptFileError(
            f"{file.path} changed after the pipeline was built and is no longer a readable {file.format} file "
            f"({file.size} bytes then, {size} now: {reason}); row group {group} was still to be read. It was "
            f"truncated, replaced or is being written. {DO_NOT_REWRITE}"
        )
    lies = index_lies(file, now)
    if lies is not None:
        return lies
    old, new = file.row_groups, now.row_groups
    differ = [g for g in range(max(len(old), len(new))) if old[g : g + 1] != new[g : g + 1]]
    g = group if group in differ else differ[0] if differ else -1
    if g < 0 and now.size == file.size:
        if file.mtime_ns is not None:
            then_now = f"last written {_when(file.mtime_ns)} then, {_when(now.mtime_ns)} now"
        else:
            then_now = f"version {file.version} then, {now.version} now"
        what = f"written again ({then_now}), the same size and row groups"
    elif g < 0:
        what = f"{file.size} bytes then, {now.size} now, in the same row groups"
    elif g >= len(old):
        what = f"{len(new)} row groups found, {len(old)} expected"
    elif g >= len(new):
        what = f"row group {g}: {old[g]} rows expected, but the file has only {len(new)} row groups now"
    else:
        what = f"row group {g}: {old[g]} rows expected, {new[g]} found"
    effect = "other values than the rows read before" if g < 0 else "other rows than the pipeline's index says"
    return SourceError(
        f"{file.path} changed after the pipeline was built: {what} ({sum(new)} rows in {len(new)} row groups now, "
        f"{then}). Reading it would give {effect}. {DO_NOT_REWRITE}"
    )


def _rewrite_index(uri: str) -> str:
    """What to do about a wrong index at `uri`."""
    return (
        f"The index is wrong (damaged, or not written by colo-data for these files): write it again "
        f"(`colo-data index {posixpath.dirname(uri)}`, or cd.write_index), then rebuild the pipeline."
    )


def index_lies(file: DataFile, now: DataFile) -> StaleIndexError | None:
    """The error for a file whose dataset index gave it another format or other row groups
    than `now`, a fresh look at it, shows, while the file is the one indexed (same size,
    and same time of last writing or version): the index, not the file, is wrong. None
    where no index described it, it was rewritten, or the index was right."""
    same = now.size == file.size and now.version == file.version
    if file.index is None or not same or (file.machine == MACHINE and now.mtime_ns != file.mtime_ns):
        return None
    said, found = (file.format, file.row_groups), (now.format, now.row_groups)
    if said == found:
        return None
    return StaleIndexError(
        f"{file.index} says {file.path} is {file.format} with {sum(file.row_groups)} rows in row groups of "
        f"{_few_counts(file.row_groups)}, but the file, unchanged since ({file.size} bytes), is {now.format} with "
        f"{sum(now.row_groups)} rows in row groups of {_few_counts(now.row_groups)}. {_rewrite_index(file.index)}"
    )


def undecodable(fs: pafs.FileSystem, file: DataFile, group: int, error: BaseException) -> SourceError:
    """The error for row group `group` of `file` that cannot be decoded, though the file is
    the one indexed: its dataset index where it lies about the file, else the file."""
    if file.index is not None:
        try:
            now, _ = inspect_file(fs, file.path)
        except (SourceError, pa.ArrowException, OSError):  # a transient error too: the decode's is the one to give
            now = None
        lies = index_lies(file, now) if now is not None else None
        if lies is not None:
            return lies
    return CorruptFileError(f"{file.path}: row group {group} cannot be decoded ({error}). Rewrite or remove the file.")


def schema_differs(file: DataFile, have: pa.Schema, wanted: pa.Schema) -> SourceError | None:
    """The error for a file, opened for its first read, whose schema `have` lacks one of
    the `wanted` columns or gives it another type than the source's schema: the index's
    fault where one described the file, else the file's, rewritten since."""
    for field in wanted:
        index = have.get_field_index(field.name)
        if index >= 0 and have.field(index).type == field.type:
            continue
        found = f"has {have.field(index).type}" if index >= 0 else f"has no such column (it has {have.names})"
        if file.index is not None:
            return StaleIndexError(
                f"{file.index} gives {file.path} a column {field.name!r} of {field.type}, but the file {found}. "
                f"{_rewrite_index(file.index)}"
            )
        return SourceError(
            f"{file.path} changed after the pipeline was built: its column {field.name!r} was {field.type}, the file "
            f"{found} now. {DO_NOT_REWRITE}"
        )
    return None


def _few_counts(counts: tuple[int, ...], shown: int = 8) -> str:
    """Row-group row counts as an error shows them: the first `shown`, and how many more."""
    head = ", ".join(map(str, counts[:shown]))
    return f"[{head}]" if len(counts) <= shown else f"[{head}, and {len(counts) - shown} more]"
