"""`ArrowSource`: Parquet and Arrow IPC files through any `pyarrow.fs` or fsspec filesystem
as one record collection with a global index, its row groups indexed from metadata alone
and many records gathered with one Arrow `take` per row group."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from colo_data import defaults
from colo_data.errors import (
    RecordIndexError,
    SchemaError,
    SourceError,
)
from colo_data.io.columns import table_to_columns, to_records
from colo_data.io.dataset_index import DatasetIndex, read_index
from colo_data.io.disk_cache import DiskCache
from colo_data.io.files import (
    MACHINE,
    DataFile,
    Kept,
    changed,
    layout,
    open_reader,
    out_of_resources,
    reader_schema,
    row_group_count,
    schema_differs,
    size_now,
    undecodable,
    unreadable,
)
from colo_data.io.fsspec_store import as_pyarrow, describe
from colo_data.io.gather import gather
from colo_data.io.listing import default_retries, inspect_all, listed, split_uri, why_nothing
from colo_data.io.local_tree import distinct
from colo_data.io.redact import redacted
from colo_data.io.remote import RUN_BYTES, RemoteFiles
from colo_data.io.rowgroup_cache import RowGroupCache
from colo_data.io.shared_metadata import read_once
from colo_data.setting_checks import int_setting


@dataclass(frozen=True)
class _Reading:
    """An ArrowSource's read settings (see its arguments)."""

    cache_bytes: int
    io_concurrency: int
    retries: int
    disk: DiskCache | None


class ArrowSource:
    """Parquet / Arrow IPC files as one table of records with a global index (files sorted by
    path, rows in file order). Random access (`len`, `[i]`) makes it a Grain data source;
    `take` is the fast path. Picklable: files re-open lazily in the new process.

    Args:
        paths: a file, a directory (its data files, recursively), a glob, or a list of
            them; a URI (`gs://...`, `s3://...`) picks its `pyarrow.fs` filesystem. Each
            must name at least one data file: a missing one is an error, never skipped.
        columns: the columns to read; None reads every column of the first file.
        filesystem: the filesystem to read the paths from, instead of the local one or
            the URI's: a `pyarrow.fs` one, or an fsspec one (gcsfs, s3fs, ...), whose
            requests wait without holding the GIL (pyarrow's GCS client holds it for the
            first request of every file it opens).
        cache_bytes: decoded row groups are cached up to this many bytes; read-ahead
            stops short of it.
        io_concurrency: object storage: row-group reads in flight at once in each process
            that reads (the trainer, a sidecar, each worker); also the files whose metadata
            is read at once when the source is made. Not used for local files.
        cache_dir: object storage: a local directory where fetched row groups are kept for
            later epochs and runs, shared by the processes of a host; None keeps none.
        cache_dir_bytes: the most `cache_dir` holds; least recently used entries go first.
        retries: object storage: how often a read that fails with a transient error (HTTP
            5xx or 429, a reset connection, a timeout) is tried again, with exponential
            backoff and jitter, before it is a `SourceError`. By default 5 for a `pyarrow.fs`
            filesystem and 0 for an fsspec one, which retries by itself (gcsfs: 6 times
            over about 30 s): retries of both would multiply.

    Raises:
        SourceError: a path names no data file (a file that does not exist, a directory or
            glob with no data files: each is named), the paths span filesystems, or an
            object cannot be read.
        ConfigError: a setting is out of range, or `cache_dir` is not a writable directory.
        CorruptFileError: a file's metadata cannot be read.
        SchemaError: a column is missing from a file, or files disagree on its type.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        columns: Sequence[str] | None = None,
        filesystem: pafs.FileSystem | Any | None = None,
        cache_bytes: int = 512 * 2**20,
        io_concurrency: int = defaults.IO_CONCURRENCY,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_dir_bytes: int = defaults.CACHE_DIR_BYTES,
        retries: int | None = None,
    ) -> None:
        cache_bytes = int_setting("cache_bytes", cache_bytes, 1, "bytes of decoded row groups kept")
        io_concurrency = int_setting("io_concurrency", io_concurrency, 1, "reads in flight at once")
        if retries is None:
            retries = default_retries(filesystem)
        retries = int_setting("retries", retries, 0, "retries of a transient read failure")
        disk = DiskCache(cache_dir, cache_dir_bytes) if cache_dir is not None else None
        reading = _Reading(cache_bytes, io_concurrency, retries, disk)
        patterns = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if not patterns:
            raise SourceError("ArrowSource got an empty list of paths: pass a file, a directory or a glob.")
        filesystem = as_pyarrow(filesystem)
        fs: pafs.FileSystem | None = None
        targets: list[str] = []
        for pattern in patterns:
            pattern_fs, inner = split_uri(pattern, filesystem)
            if fs is not None and pattern_fs.type_name != fs.type_name:
                raise SourceError(
                    f"{redacted(repr(pattern))} is on {describe(pattern_fs)}, the paths before it on {describe(fs)}: "
                    "one ArrowSource reads from one filesystem; make one source per filesystem."
                )
            fs = pattern_fs
            targets.append(inner)
        assert fs is not None
        kept: dict[str, Kept] = {}
        key = json.dumps([fs.type_name, targets, None if columns is None else list(columns)])
        what = "the source of " + redacted(", ".join(map(repr, patterns[:3]))) + (" ..." if len(patterns) > 3 else "")
        files, schema = read_once(what, key, lambda: self._discover(fs, patterns, targets, columns, reading, kept))
        by_index = {i: kept[f.path] for i, f in enumerate(files) if f.path in kept}
        self._setup(fs, files, schema, reading, by_index)

    @classmethod
    def _discover(
        cls,
        fs: pafs.FileSystem,
        patterns: list[str],
        targets: list[str],
        columns: Sequence[str] | None,
        reading: _Reading,
        kept: dict[str, Kept],
    ) -> tuple[list[DataFile], pa.Schema]:
        """The data files that the paths name and the schema of the wanted columns: from
        one listing per path, and from the dataset index where the listing shows one (else
        from every file's metadata, what later reads can use kept in `kept`)."""
        local = isinstance(fs, pafs.LocalFileSystem)
        unmatched: list[str] = []
        chosen: dict[str, tuple[DataFile, pa.Schema] | None] = {}  # by path; None: its metadata is to be read
        indexes: dict[str, DatasetIndex] = {}
        for pattern, inner in zip(patterns, targets, strict=True):
            found = listed(fs, inner, reading.retries)
            if not found.files:
                unmatched.append(f"{redacted(repr(pattern))} ({why_nothing(fs, inner)})")
            elif found.index is not None:
                index = indexes.get(found.index.path)
                if index is None:
                    index = indexes[found.index.path] = read_index(fs, found, reading.retries)
                chosen.update((file.path, (file, schema)) for file, schema in index.checked(inner, found, local))
            else:
                chosen.update((info.path, chosen.get(info.path)) for info in found.files)
        if unmatched:
            raise SourceError(
                f"{len(unmatched)} of the {len(patterns)} paths given name no Parquet or Arrow IPC file on "
                f"{describe(fs)}: {'; '.join(unmatched)}. A source reads every path it is given or none: "
                "fix these paths (the name, the glob, the filesystem argument) or leave them out."
            )
        if local and len(patterns) > 1:  # two paths may name one file (a link, a directory and a glob in it)
            chosen = {path: chosen[path] for path in distinct(chosen)}
        unread = sorted(path for path, known in chosen.items() if known is None)
        read = dict(zip(unread, inspect_all(fs, unread, reading.retries, reading.io_concurrency, kept), strict=True))
        inspected = [known or read[path] for path, known in sorted(chosen.items())]
        return [file for file, _ in inspected], cls._check_schemas(inspected, columns)

    @classmethod
    def joined(cls, sources: Sequence[ArrowSource]) -> ArrowSource | None:
        """One source over the files of `sources`, in the order given (each keeping its own
        order), reading no metadata again; None when they are on different filesystems or
        have different schemas. A `cd.Mix` reads through it: one gather per batch."""
        first = sources[0]
        if any(s._fs.type_name != first._fs.type_name or s.schema != first.schema for s in sources):
            return None
        joined = cls.__new__(cls)
        reading = replace(first._reading, cache_bytes=max(s._reading.cache_bytes for s in sources))
        starts = np.cumsum([0] + [len(s._files) for s in sources])
        kept = {int(at) + i: k for s, at in zip(sources, starts, strict=False) for i, k in s._kept.items()}
        joined._setup(first._fs, [f for s in sources for f in s._files], first.schema, reading, kept)
        return joined

    def _setup(
        self,
        fs: pafs.FileSystem,
        files: list[DataFile],
        schema: pa.Schema,
        reading: _Reading,
        kept: dict[int, Kept],
    ) -> None:
        self._fs = fs
        self._local = isinstance(fs, pafs.LocalFileSystem)
        self._files = files
        self.schema = schema
        self.columns = tuple(self.schema.names)
        self._reading = reading
        sizes = [(i, g, n) for i, f in enumerate(self._files) for g, n in enumerate(f.row_groups)]
        self._rg_file = np.array([i for i, _, _ in sizes], dtype=np.int64)
        self._rg_local = np.array([g for _, g, _ in sizes], dtype=np.int64)
        self._rg_sizes = np.array([n for _, _, n in sizes], dtype=np.int64)
        rows = [max(1, sum(f.row_groups)) for f in self._files]
        self._rg_stored = np.array([self._files[i].size * n // rows[i] for i, _, n in sizes], dtype=np.int64)  # about
        self._rg_start = np.concatenate([[0], np.cumsum(self._rg_sizes)]).astype(np.int64)
        # local files checked against the index once, with their Parquet footers (None: IPC):
        # a read opens its file, decodes and closes it, so no file stays open between reads
        self._footers: dict[int, pq.FileMetaData | None] = {}
        self._remote: RemoteFiles | None = None
        self._kept = kept  # object storage: what making the source read, for this process only
        self._cache: RowGroupCache | None = None

    @staticmethod
    def _check_schemas(inspected: list[tuple[DataFile, pa.Schema]], columns: Sequence[str] | None) -> pa.Schema:
        first_file, first = inspected[0]
        wanted = list(columns) if columns is not None else first.names
        for file, schema in inspected:
            missing = [c for c in wanted if c not in schema.names]
            if missing:
                raise SchemaError(
                    f"{file.path}: no column {', '.join(map(repr, missing))}; it has {schema.names}{_as_indexed(file)}. "
                    "Fix the columns argument or the file."
                )
            for name in wanted:
                ref, got = first.field(name).type, schema.field(name).type
                if ref != got:
                    raise SchemaError(
                        f"column {name!r} is {ref} in {first_file.path} but {got} in {file.path}{_as_indexed(file)}: "
                        "rewrite one of them with the same type, or leave the column out."
                    )
        return pa.schema([first.field(c) for c in wanted])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_footers"], state["_remote"], state["_kept"], state["_cache"] = {}, None, {}, None
        return state

    def __len__(self) -> int:
        return int(self._rg_start[-1])

    @property
    def files(self) -> tuple[str, ...]:
        """The data files, in global order."""
        return tuple(f.path for f in self._files)

    def file_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The file (its place in `files`) and the row within that file of each record."""
        groups = np.searchsorted(self._rg_start, indices, side="right") - 1
        files = self._rg_file[groups]
        first_group = np.searchsorted(self._rg_file, files, side="left")  # each file's first row group
        return files, np.asarray(indices, dtype=np.int64) - self._rg_start[first_group]

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

    def _decode_local(self, group: int, _: None) -> pa.Table:
        """Row group `group`, decoded from its local file, which must still be the file
        indexed when the source was made: same size and time of last writing before each
        decode (one stat, which a rewrite in place of the same size and layout changes; the
        time only on the machine that made the source, as a host's own copy of the file has
        its own), same size and row groups when the file is opened, same rows in the group decoded
        (object storage: `RemoteFiles`). A file replaced by a rename keeps being read
        from the file that was opened, as it was. Not noticed: a rewrite of the same size
        and layout within the filesystem's clock tick (a few milliseconds) of the indexing
        stat, one whose writer sets the old time back (`touch -d`, `cp -p`), and a rewrite
        in place of an IPC file whose batches are cached (views of the file: they show the
        new bytes, or the process gets SIGBUS where the file was cut short) until the next
        decode from it."""
        file_index, local = int(self._rg_file[group]), int(self._rg_local[group])
        file = self._files[file_index]
        try:
            now = os.stat(file.path)
            rewritten = now.st_mtime_ns != file.mtime_ns and file.machine == MACHINE  # copies elsewhere: their own times
            if now.st_size != file.size or rewritten:  # before a mapping is read past its end
                raise changed(self._fs, file, local)
            checked = file_index in self._footers
            reader, handle = open_reader(self._fs, file.path, file.format, self._footers.get(file_index))
            try:
                if not checked:
                    if handle.size() != file.size or row_group_count(reader) != len(file.row_groups):
                        raise changed(self._fs, file, local)
                    if file.format == "parquet" and layout(reader) != file.row_groups:  # from the footer: free
                        raise changed(self._fs, file, local)
                    differs = schema_differs(file, reader_schema(reader), self.schema)
                    if differs is not None:
                        raise differs
                    self._footers[file_index] = reader.metadata if file.format == "parquet" else None
                if file.format == "parquet":
                    table = reader.read_row_group(local, columns=list(self.columns), use_threads=False)
                else:
                    batch = reader.get_batch(local).select(list(self.columns))
                    batch.validate(full=True)  # IPC buffers are used as they lie: damaged ones crash later
                    table = pa.Table.from_batches([batch])
            finally:
                handle.close()  # an IPC batch's views keep its mapping, not the file
            if table.num_rows != file.row_groups[local]:  # rewritten while it was open
                raise changed(self._fs, file, local)
        except PermissionError as e:  # its permissions changed since the source was opened
            raise unreadable(file.path, e) from e
        except (pa.ArrowException, OSError, MemoryError) as e:
            resources = out_of_resources(e, file.path)
            if resources is not None:
                raise resources from e
            if size_now(self._fs, file.path) != file.size:
                raise changed(self._fs, file, local) from e
            raise undecodable(self._fs, file, local, e) from e
        return table.combine_chunks()

    @property
    def _row_groups(self) -> RowGroupCache:
        if self._cache is None:
            reading = self._reading
            if self._local:
                self._cache = RowGroupCache(self._decode_local, reading.cache_bytes)
            else:
                remote = self._remote = RemoteFiles(self._fs, self._files, self.schema, reading.retries, reading.disk, self._kept)
                self._cache = RowGroupCache(
                    lambda group, fetched: remote.decode(int(self._rg_file[group]), int(self._rg_local[group]), fetched),
                    reading.cache_bytes,
                    fetch=lambda run: remote.fetch(int(self._rg_file[run[0]]), [int(self._rg_local[g]) for g in run]),
                    together=self._runs,
                    io_threads=reading.io_concurrency,
                    decode_threads=defaults.DECODE_THREADS,
                    estimate=self._estimate,
                )
        return self._cache

    def _runs(self, groups: list[int]) -> list[list[int]]:
        """`groups` (object storage) as the runs fetched in one call each: neighbouring row
        groups of one Parquet file, at most `RUN_BYTES` of it a run (its bytes per row times
        the rows), the run of the group asked for first first."""
        runs: list[list[int]] = []
        stored = 0
        for group in sorted(groups):
            size = int(self._rg_stored[group])
            last = runs[-1][-1] if runs else -2
            neighbour = group == last + 1 and self._rg_file[last] == self._rg_file[group]
            if neighbour and self._files[int(self._rg_file[group])].format == "parquet" and stored + size <= RUN_BYTES:
                runs[-1].append(group)
                stored += size
            else:
                runs.append([group])
                stored = size
        first = {group: place for place, group in enumerate(groups)}
        return sorted(runs, key=lambda run: min(first[group] for group in run))

    def _estimate(self, group: int) -> int:
        """A guess of row group `group`'s decoded bytes: its rows times the bytes per row
        decoded so far (before the first decode, four times its file's bytes per row)."""
        rows = int(self._rg_sizes[group])
        stats = self._row_groups.stats
        if stats.decoded:
            per_row = stats.decoded_bytes / max(1, stats.decoded_rows)
        else:
            file = self._files[int(self._rg_file[group])]
            per_row = 4 * file.size / max(1, sum(file.row_groups))
        return int(rows * per_row)

    @property
    def lookahead(self) -> int:
        return 1 if self._local else defaults.REMOTE_LOOKAHEAD

    def prefetch(self, indices: np.ndarray) -> None:
        """Start loading, in the background, the row groups that these records live in,
        in the order the records need them (as far as `cache_bytes` allows)."""
        idx = np.asarray(indices, dtype=np.int64)
        idx = idx[(idx >= 0) & (idx < len(self))]
        groups = np.searchsorted(self._rg_start, idx, side="right") - 1
        _, first = np.unique(groups, return_index=True)
        self._row_groups.prefetch(groups[np.sort(first)].tolist())

    def stop_read_ahead(self, timeout: float) -> None:
        """Stop the read threads within `timeout` seconds (loaded row groups stay cached;
        the next read starts new threads)."""
        if self._cache is not None:
            self._cache.close(timeout)

    def read_stats(self) -> tuple[float, ...]:
        """What loading row groups cost this source in this process so far: seconds readers
        waited for I/O, requests and bytes fetched (object storage), seconds spent decoding,
        row groups and bytes decoded."""
        if self._cache is None:
            return (0.0,) * 6
        stats, remote = self._cache.stats, self._remote
        requests, fetched = (remote.requests, remote.fetched_bytes) if remote is not None else (0, 0)
        return (stats.io_wait_s, requests, fetched, stats.decode_s, stats.decoded, stats.decoded_bytes)

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
        tables = self._row_groups.get_many(needed.tolist())
        return gather(tables, group_of, idx - self._rg_start[groups])

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One record as a dict: numpy arrays for numeric lists, Python values otherwise."""
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"ArrowSource indices are integers, got {type(index).__name__}")
        return to_records(table_to_columns(self.take([int(index)])))[0]

    def __repr__(self) -> str:
        return f"ArrowSource({len(self._files)} files, {len(self)} records, columns={list(self.columns)})"


def _as_indexed(file: DataFile) -> str:
    """Where a dataset index gave `file`'s schema, words that name it as a suspect."""
    if file.index is None:
        return ""
    return f" (as {file.index} says: if the files say otherwise, write the index again with `colo-data index`)"
