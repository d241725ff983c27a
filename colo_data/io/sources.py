"""Sources: record collections addressed by a global index. `ArrowSource` reads Parquet and
Arrow IPC files through any `pyarrow.fs` filesystem, indexing row groups from metadata
alone and gathering many records with one Arrow `take` per row group."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from colo_data.errors import (
    ConfigError,
    CorruptFileError,
    RecordIndexError,
    SchemaError,
    SourceError,
)
from colo_data.io.columns import table_to_columns, to_records
from colo_data.io.gather import gather
from colo_data.io.rowgroup_cache import RowGroupCache

_PARQUET_MAGIC = b"PAR1"
_IPC_FILE_MAGIC = b"ARROW1"
_IPC_STREAM_MAGIC = b"\xff\xff\xff\xff"
_DATA_SUFFIXES = (".parquet", ".pq", ".arrow", ".ipc", ".feather")
_GLOB_CHARS = "*?["


@runtime_checkable
class Source(Protocol):
    """What the pipeline needs of a record source: a length, a row-group layout for block
    shuffling, a vectorised gather, and a fingerprint that changes when the data does."""

    def __len__(self) -> int: ...

    @property
    def row_group_sizes(self) -> np.ndarray:
        """Records in each row group, in global order (what block shuffling permutes)."""

    def take(self, indices: np.ndarray) -> pa.Table:
        """The records at these global indices, in the order given, as one table."""

    def fingerprint(self) -> str:
        """A short hash that changes when the data does (checked when a state is restored)."""


@runtime_checkable
class ReadAhead(Protocol):
    """A source that decodes upcoming records on a thread of its own: the loader that uses
    it says what comes next and stops the thread when it closes."""

    def prefetch(self, indices: np.ndarray) -> None: ...

    def stop_read_ahead(self, timeout: float) -> None: ...


@dataclass(frozen=True)
class _File:
    path: str
    format: str  # "parquet" or "ipc"
    row_groups: tuple[int, ...]
    size: int  # bytes when the source was made: reads check that the file still has them


_SCHEMES = {"file": "local", "s3": "s3", "gs": "gcs", "gcs": "gcs", "hdfs": "hdfs"}  # URI scheme -> pyarrow type_name


def _split_uri(path: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path in it: `filesystem` when given (a URI of its kind loses
    its scheme), else the URI's, else the local one."""
    if filesystem is not None:
        if "://" not in path:
            return filesystem, path
        scheme, inner = path.split("://", 1)
        if _SCHEMES.get(scheme.lower()) != filesystem.type_name:
            raise ConfigError(
                f"{path!r} is a {scheme}:// URI but filesystem= is a {type(filesystem).__name__} "
                f"({filesystem.type_name}): give the path inside that filesystem (e.g. 'bucket/dir/*.parquet'), "
                "or the URI without filesystem= to use the URI's own"
            )
        return filesystem, inner if scheme.lower() != "file" else posixpath.abspath(inner)
    if "://" in path:
        fs, inner = pafs.FileSystem.from_uri(path)
        return fs, inner
    return pafs.LocalFileSystem(), posixpath.abspath(path)


def _expand(fs: pafs.FileSystem, path: str) -> list[str]:
    """Files named by one path: a file, a directory (its data files, recursively) or a glob."""
    if any(c in path for c in _GLOB_CHARS):
        parts = path.split("/")
        fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))]]
        base = "/".join(fixed) or "/"
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError:
            return []
        pattern = path.lstrip("/")  # filesystems differ on whether the paths they list start with "/"
        patterns = {pattern, pattern.replace("**/", "")}  # "**/" also matches no directory at all
        depth = pattern.count("/")
        return [
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and any(fnmatch.fnmatchcase(i.path.lstrip("/"), p) for p in patterns)
            and ("**" in path or i.path.lstrip("/").count("/") == depth)
        ]
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        return [
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and i.path.lower().endswith(_DATA_SUFFIXES)
            and not posixpath.basename(i.path).startswith((".", "_"))
        ]
    return []


def _detect_format(fs: pafs.FileSystem, path: str) -> str:
    with fs.open_input_file(path) as f:
        head = f.read(6)
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


def _open(fs: pafs.FileSystem, path: str, fmt: str) -> tuple[pq.ParquetFile | ipc.RecordBatchFileReader, int]:
    """A reader of the file, and the file's size in bytes. A local IPC file is
    memory-mapped: its record batches are views of the file, read only where used (copying
    them cost the demo pipeline over half its throughput from IPC files). Parquet is
    decoded into memory anyway: reading it through a mapping saved about 1% of the decode,
    but a rewrite in place that cut the file short during a decode killed the process
    (SIGBUS, not an exception)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        handle = fs.open_input_file(path)
    else:
        handle = pa.memory_map(path) if fmt == "ipc" else pa.OSFile(path)
    reader = pq.ParquetFile(handle) if fmt == "parquet" else ipc.open_file(handle)
    return reader, handle.size()


def _layout(reader: pq.ParquetFile | ipc.RecordBatchFileReader) -> tuple[int, ...]:
    """Rows of each row group (IPC record batch): from the footer for Parquet, from every
    batch's header for IPC (which reads every batch of a file that is not memory-mapped)."""
    if isinstance(reader, pq.ParquetFile):
        meta = reader.metadata
        return tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return tuple(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def _groups(reader: pq.ParquetFile | ipc.RecordBatchFileReader) -> int:
    """Row groups (IPC record batches) of the file, from its footer."""
    return reader.num_row_groups if isinstance(reader, pq.ParquetFile) else reader.num_record_batches


def _unreadable(path: str, error: PermissionError) -> SourceError:
    return SourceError(
        f"{path}: permission denied ({error.strerror or error}). The file is fine as far as colo-data knows: give "
        "this process read access (its user or group), or leave the file out of the paths."
    )


def _inspect(fs: pafs.FileSystem, path: str) -> tuple[_File, pa.Schema]:
    try:
        fmt = _detect_format(fs, path)
    except PermissionError as e:
        raise _unreadable(path, e) from e
    try:
        reader, size = _open(fs, path, fmt)
        sizes = _layout(reader)
        schema = reader.schema_arrow if isinstance(reader, pq.ParquetFile) else reader.schema
        schema.names  # noqa: B018 - decoded lazily: damaged metadata can hold names that are not UTF-8
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise CorruptFileError(
            f"{path}: cannot read the {fmt} metadata ({e}). The file is truncated or damaged: rewrite or remove it."
        ) from e
    return _File(path, fmt, sizes, size), schema


_DO_NOT_REWRITE = (
    "Rebuild the pipeline (and its loader) to read the file as it is now, and do not rewrite files "
    "in place under a running job: write new files and point a new pipeline at them."
)


def _size_now(fs: pafs.FileSystem, path: str) -> int | None:
    """The file's size in bytes now; None when it is gone."""
    info = fs.get_file_info(path)
    return info.size if info.type == pafs.FileType.File else None


def _changed(fs: pafs.FileSystem, file: _File, group: int) -> SourceError:
    """The error for a file that is no longer the one indexed when the source was made,
    found while reading its row group `group`: what differs, from a fresh look at the file
    (an error path: its cost does not matter)."""
    then = f"{sum(file.row_groups)} rows in {len(file.row_groups)} row groups then"
    size = _size_now(fs, file.path)
    if size is None:
        return SourceError(
            f"{file.path} was removed after the pipeline was built ({then}; row group {group} was still to be "
            f"read). {_DO_NOT_REWRITE}"
        )
    try:
        now, _ = _inspect(fs, file.path)
    except CorruptFileError as e:
        reason = e.__cause__ if e.__cause__ is not None else e
        return CorruptFileError(
            f"{file.path} changed after the pipeline was built and is no longer a readable {file.format} file "
            f"({file.size} bytes then, {size} now: {reason}); row group {group} was still to be read. It was "
            f"truncated, replaced or is being written. {_DO_NOT_REWRITE}"
        )
    old, new = file.row_groups, now.row_groups
    differ = [g for g in range(max(len(old), len(new))) if old[g : g + 1] != new[g : g + 1]]
    g = group if group in differ else differ[0] if differ else -1
    if g < 0:
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
        f"{then}). Reading it would give {effect}. {_DO_NOT_REWRITE}"
    )


class ArrowSource:
    """Parquet / Arrow IPC files as one table of records with a global index (files sorted by
    path, rows in file order). Random access (`len`, `[i]`) makes it a Grain data source;
    `take` is the fast path. Picklable: files re-open lazily in the new process.

    Args:
        paths: a file, a directory (its data files, recursively), a glob, or a list of
            them; a URI (`gs://...`, `s3://...`) picks its `pyarrow.fs` filesystem.
        columns: the columns to read; None reads every column of the first file.
        filesystem: the `pyarrow.fs` filesystem to read the paths from, instead of the
            local one or the URI's.
        cache_bytes: decoded row groups are cached up to this many bytes.

    Raises:
        SourceError: no file matches, the paths span filesystems, or `cache_bytes` is not positive.
        CorruptFileError: a file's metadata cannot be read.
        SchemaError: a column is missing from a file, or files disagree on its type.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        columns: Sequence[str] | None = None,
        filesystem: pafs.FileSystem | None = None,
        cache_bytes: int = 512 * 2**20,
    ) -> None:
        if not isinstance(cache_bytes, int) or cache_bytes < 1:
            raise SourceError(f"cache_bytes={cache_bytes!r}: must be a positive number of bytes of decoded row groups")
        patterns = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if not patterns:
            raise SourceError("ArrowSource got an empty list of paths: pass a file, a directory or a glob.")
        found: set[str] = set()
        fs: pafs.FileSystem | None = None
        for pattern in patterns:
            pattern_fs, inner = _split_uri(pattern, filesystem)
            if fs is not None and pattern_fs.type_name != fs.type_name:
                raise SourceError(
                    f"{pattern!r} is on {pattern_fs.type_name}, the paths before it on {fs.type_name}: "
                    "one ArrowSource reads from one filesystem; make one source per filesystem."
                )
            fs = pattern_fs
            found.update(_expand(fs, inner))
        if not found:
            raise SourceError(
                f"no Parquet or Arrow IPC files match {patterns!r} on {type(fs).__name__}: "
                "check the path, the glob, or the filesystem argument."
            )
        inspected = [_inspect(fs, p) for p in sorted(found)]
        self._setup(fs, [f for f, _ in inspected], self._check_schemas(inspected, columns), cache_bytes)

    @classmethod
    def joined(cls, sources: Sequence[ArrowSource]) -> ArrowSource | None:
        """One source over the files of `sources`, in the order given (each keeping its own
        order), reading no metadata again; None when they are on different filesystems or
        have different schemas. A `cd.Mix` reads through it: one gather per batch."""
        first = sources[0]
        if any(s._fs.type_name != first._fs.type_name or s.schema != first.schema for s in sources):
            return None
        joined = cls.__new__(cls)
        joined._setup(first._fs, [f for s in sources for f in s._files], first.schema, max(s._cache_bytes for s in sources))
        return joined

    def _setup(self, fs: pafs.FileSystem, files: list[_File], schema: pa.Schema, cache_bytes: int) -> None:
        self._fs = fs
        self._local = isinstance(fs, pafs.LocalFileSystem)
        self._files = files
        self.schema = schema
        self.columns = tuple(self.schema.names)
        self._cache_bytes = cache_bytes
        sizes = [(i, g, n) for i, f in enumerate(self._files) for g, n in enumerate(f.row_groups)]
        self._rg_file = np.array([i for i, _, _ in sizes], dtype=np.int64)
        self._rg_local = np.array([g for _, g, _ in sizes], dtype=np.int64)
        self._rg_sizes = np.array([n for _, _, n in sizes], dtype=np.int64)
        self._rg_start = np.concatenate([[0], np.cumsum(self._rg_sizes)]).astype(np.int64)
        self._readers: dict[int, Any] = {}
        self._cache: RowGroupCache | None = None

    @staticmethod
    def _check_schemas(inspected: list[tuple[_File, pa.Schema]], columns: Sequence[str] | None) -> pa.Schema:
        first_file, first = inspected[0]
        wanted = list(columns) if columns is not None else first.names
        for file, schema in inspected:
            missing = [c for c in wanted if c not in schema.names]
            if missing:
                raise SchemaError(
                    f"{file.path}: no column {', '.join(map(repr, missing))}; it has {schema.names}. "
                    "Fix the columns argument or the file."
                )
            for name in wanted:
                ref, got = first.field(name).type, schema.field(name).type
                if ref != got:
                    raise SchemaError(
                        f"column {name!r} is {ref} in {first_file.path} but {got} in {file.path}: "
                        "rewrite one of them with the same type, or leave the column out."
                    )
        return pa.schema([first.field(c) for c in wanted])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"], state["_cache"] = {}, None
        return state

    def __len__(self) -> int:
        return int(self._rg_start[-1])

    @property
    def files(self) -> tuple[str, ...]:
        """The data files, in global order."""
        return tuple(f.path for f in self._files)

    @property
    def row_group_sizes(self) -> np.ndarray:
        """Rows of every row group (IPC record batch), in global order; zeros included."""
        return self._rg_sizes

    def fingerprint(self) -> str:
        """A hash of file names, formats, row-group sizes and the schema: stable across
        machines and mount points, different when files, their row counts or the schema
        change (not when values are rewritten in place)."""
        h = hashlib.sha256()
        for f in self._files:
            h.update(f"{posixpath.basename(f.path)}:{f.format}:{f.row_groups}\n".encode())
        h.update(self.schema.to_string().encode())
        return h.hexdigest()[:16]

    def _decode(self, group: int) -> pa.Table:
        """Row group `group`, decoded from its file, which must still be the file indexed
        when the source was made: same size before each decode (a stat, local files only:
        on object storage it would be a request), same size and row groups when the file is
        opened, same rows in the group decoded. A file replaced by a rename keeps being read
        from the file that was opened, as it was. Not noticed: new values written in place
        in the same layout and size (as by `fingerprint`), and a rewrite in place of an IPC
        file whose batches are cached (views of the file: they show the new bytes, or the
        process gets SIGBUS where the file was cut short) until the next decode from it."""
        file_index, local = int(self._rg_file[group]), int(self._rg_local[group])
        file = self._files[file_index]
        try:
            if self._local and os.stat(file.path).st_size != file.size:  # before a mapping is read past its end
                raise _changed(self._fs, file, local)
            reader = self._readers.get(file_index)
            if reader is None:
                reader, size = _open(self._fs, file.path, file.format)
                if size != file.size or _groups(reader) != len(file.row_groups):
                    raise _changed(self._fs, file, local)
                if file.format == "parquet" and _layout(reader) != file.row_groups:  # from the footer: free
                    raise _changed(self._fs, file, local)
                self._readers[file_index] = reader
            if file.format == "parquet":
                table = reader.read_row_group(local, columns=list(self.columns), use_threads=False)
            else:
                batch = reader.get_batch(local).select(list(self.columns))
                batch.validate(full=True)  # IPC buffers are used as they lie: damaged ones crash later
                table = pa.Table.from_batches([batch])
            if table.num_rows != file.row_groups[local]:  # rewritten while it was open
                raise _changed(self._fs, file, local)
        except PermissionError as e:  # its permissions changed since the source was opened
            raise _unreadable(file.path, e) from e
        except (pa.ArrowException, OSError) as e:
            if _size_now(self._fs, file.path) != file.size:
                raise _changed(self._fs, file, local) from e
            raise CorruptFileError(
                f"{file.path}: row group {local} cannot be decoded ({e}). Rewrite or remove the file."
            ) from e
        return table.combine_chunks()

    @property
    def _row_groups(self) -> RowGroupCache:
        if self._cache is None:
            self._cache = RowGroupCache(self._decode, self._cache_bytes)
        return self._cache

    def prefetch(self, indices: np.ndarray) -> None:
        """Start decoding, in the background, the row groups that these records live in."""
        idx = np.asarray(indices, dtype=np.int64)
        idx = idx[(idx >= 0) & (idx < len(self))]
        self._row_groups.prefetch(np.unique(np.searchsorted(self._rg_start, idx, side="right") - 1).tolist())

    def stop_read_ahead(self, timeout: float) -> None:
        """Stop the decode thread within `timeout` seconds (decoded row groups stay cached;
        the next read starts a new thread)."""
        if self._cache is not None:
            self._cache.close(timeout)

    def take(self, indices: np.ndarray | Sequence[int]) -> pa.Table:
        """The records at these global indices, in the order given: each needed row group is
        read once (LRU cache) and gathered with Arrow's `take` (see `colo_data.io.gather`).

        Raises:
            RecordIndexError: an index is outside `[0, len(self))`.
            SourceError: a needed file changed after the source was made (other row groups,
                another size) or was removed.
            CorruptFileError: a needed row group cannot be decoded, or its file changed and
                no longer parses.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise RecordIndexError(f"indices must be one-dimensional, got shape {idx.shape}")
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise RecordIndexError(f"record index {bad} is outside [0, {n}) of {len(self._files)} file(s)")
        if idx.size == 0:
            return self.schema.empty_table()
        groups = np.searchsorted(self._rg_start, idx, side="right") - 1
        needed, group_of = np.unique(groups, return_inverse=True)
        tables = [self._row_groups.get(int(g)) for g in needed]
        return gather(tables, group_of, idx - self._rg_start[groups])

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One record as a dict: numpy arrays for numeric lists, Python values otherwise."""
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"ArrowSource indices are integers, got {type(index).__name__}")
        return to_records(table_to_columns(self.take([int(index)])))[0]

    def __repr__(self) -> str:
        return f"ArrowSource({len(self._files)} files, {len(self)} records, columns={list(self.columns)})"


class RecordSource:
    """Adapts any random-access record collection to the `Source` protocol. It has no row
    groups: block shuffling treats every `CHUNK` consecutive records as one.

    Args:
        records: a `grain.MapDataset`, a Grain data source, a list of dicts: anything with
            `len` and `[i]` that returns dict records.
    """

    CHUNK = 1024

    def __init__(self, records: Any) -> None:
        self._records = records
        self._len = len(records)

    def __len__(self) -> int:
        return self._len

    @property
    def row_group_sizes(self) -> np.ndarray:
        """`CHUNK` records a group, the last one shorter."""
        full, rest = divmod(self._len, self.CHUNK)
        return np.array([self.CHUNK] * full + ([rest] if rest else []), dtype=np.int64)

    def take(self, indices: np.ndarray | Sequence[int]) -> pa.Table:
        """The records at these indices, in the order given, as one table.

        Raises:
            RecordIndexError: an index is outside `[0, len(self))`.
            SourceError: the collection's records are not dicts.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            bad = int(idx[(idx < 0) | (idx >= self._len)][0])
            raise RecordIndexError(f"record index {bad} is outside [0, {self._len}) of {type(self._records).__name__}")
        rows = [self._records[int(i)] for i in idx]
        if rows and not isinstance(rows[0], dict):
            raise SourceError(
                f"{type(self._records).__name__} yields {type(rows[0]).__name__} records; "
                "colo-data needs dict records (column name -> value)."
            )
        return pa.Table.from_pylist(rows)

    def fingerprint(self) -> str:
        """A hash of the collection's type name and length: its values are not read."""
        return hashlib.sha256(f"{type(self._records).__name__}:{self._len}".encode()).hexdigest()[:16]


def as_source(source: Any) -> Source:
    """Accept an `ArrowSource`, any `Source`, or a random-access record collection."""
    if isinstance(source, Source):
        return source
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return RecordSource(source)
    raise SourceError(
        f"{type(source).__name__} is not a source: give a cd.ArrowSource, a grain.MapDataset "
        "or any object with __len__ and __getitem__ returning dict records."
    )
