"""`ArrayRecordSource`: ArrayRecord files as a random-access record source, read many
records at a time and parsed in batches. Grain's `ArrayRecordDataSource` is read one record
per `__getitem__` in Python; ArrayRecord's own batched read
(`ArrayRecordReader.read(indices)`) fetches a list of records in parallel C++ with the GIL
released, and `parse` turns the whole list into columns at once. Worker processes and
sidecars that read it import ArrayRecord's reader only (no Grain, no JAX)."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from colo_data.errors import CorruptFileError, RecordIndexError, SourceError, TransformError
from colo_data.io.columns import to_arrow
from colo_data.io.content import file_digest
from colo_data.io.listing import is_glob
from colo_data.io.redact import redacted

Parse = Callable[[list[bytes]], Mapping[str, Any]]
GROUP = 1024  # records a block-shuffle group: ArrayRecord files have no row groups to permute
OPEN_FILES = 64  # readers kept open per process
_READER_OPTIONS = "readahead_buffer_size:0"  # random access: no read-ahead of the following records


def parse_json(records: list[bytes]) -> dict[str, Any]:
    """JSON objects (one a record, UTF-8) as columns: each key a column, in the order the
    keys first appear. The whole list is parsed at once by Arrow's JSON reader (C++, about
    10x `json.loads` a record), the types inferred from the list.

    Raises:
        TransformError: a record is not a JSON object, naming its place in the list.
    """
    if not records:
        return {}
    lines = b"\n".join(r.replace(b"\n", b" ").replace(b"\r", b" ") for r in records)  # JSON allows either as space
    try:
        table = pajson.read_json(io.BytesIO(lines), read_options=pajson.ReadOptions(block_size=max(1 << 20, 2 * len(lines))))
    except pa.ArrowInvalid as e:
        raise _first_bad(records) or TransformError(f"parse_json: {len(records)} records are not JSON objects: {e}") from e
    if table.num_rows != len(records):
        raise _first_bad(records) or TransformError(f"parse_json: {len(records)} records gave {table.num_rows} rows")
    return {name: table.column(name) for name in table.column_names}


def _first_bad(records: list[bytes]) -> TransformError | None:
    """The error naming the first record that is not a JSON object (None if every one is)."""
    for i, record in enumerate(records):
        try:
            row = json.loads(record)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return TransformError(f"parse_json: record {i} of {len(records)} is not JSON ({e}): {record[:60]!r}")
        if not isinstance(row, dict):
            return TransformError(f"parse_json: record {i} of {len(records)} is a JSON {type(row).__name__}, not an object")
    return None


class ArrayRecordSource:
    """ArrayRecord files read as one source: record i of the source is record i - (records
    of the files before) of its file, the files in sorted path order.

    Args:
        paths: a file, a glob (`data/*.array_record`), or a list of them.
        parse: a list of the records' bytes -> columns (name -> a numpy array, a pyarrow
            array or a list, one entry a record, in order); `parse_json` by default. It
            runs once per chunk of records, in whichever process computes the chunk, so it
            must be picklable (a module-level function, or a function defined in the script:
            it is sent by value).

    Raises:
        SourceError: no file matches, or a file cannot be opened as ArrayRecord (naming it).
    """

    def __init__(self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], parse: Parse = parse_json) -> None:
        patterns = [os.fspath(paths)] if isinstance(paths, str | os.PathLike) else [os.fspath(p) for p in paths]
        matched = {pattern: glob.glob(pattern) if is_glob(pattern) else [pattern] for pattern in patterns}  # data[1]: a name
        unmatched = [p for p, found in matched.items() if not found or not all(os.path.isfile(f) for f in found)]
        if unmatched:
            raise SourceError(
                f"ArrayRecordSource: no file matches {redacted(str(unmatched))} (of the paths given, "
                f"{redacted(str(patterns))}): a source reads every path it is given or none; fix these paths (the "
                "name, the glob) or leave them out"
            )
        files = sorted({f for found in matched.values() for f in found})
        if not callable(parse):
            raise SourceError(
                f"ArrayRecordSource(parse={parse!r}): give a function of a list of bytes, e.g. cd.sources.parse_json"
            )
        self.files = tuple(files)
        self.parse = parse
        self._counts = np.array([_count(f) for f in self.files], dtype=np.int64)
        self._sizes = tuple(os.path.getsize(f) for f in self.files)
        self._starts = np.concatenate([[0], np.cumsum(self._counts)])
        self._fingerprint: str | None = None
        self._readers: OrderedDict[int, Any] = OrderedDict()  # opened on first use, in each process, the last used last
        self._lock = threading.Lock()  # the host pipelines of one process share the source: one read at a time

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_readers": OrderedDict()}  # readers and the lock are per process
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def row_group_sizes(self) -> np.ndarray:
        """Groups of `GROUP` records within each file (the last of a file shorter)."""
        sizes = [min(GROUP, int(n) - s) for n in self._counts for s in range(0, int(n), GROUP)]
        return np.array(sizes, dtype=np.int64)

    def take(self, indices: np.ndarray | Sequence[int]) -> pa.Table:
        """The records at these global indices, in the order given, parsed into one table:
        one batched read per file.

        Raises:
            RecordIndexError: an index is outside `[0, len(self))`.
            CorruptFileError: a record cannot be read (its chunk is damaged), naming the file
                and the record.
            TransformError: `parse` did not give one value per record in every column.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx[(idx < 0) | (idx >= len(self))][0])
            raise RecordIndexError(f"record index {bad} is outside [0, {len(self)}) of {self}")
        which = np.searchsorted(self._starts, idx, side="right") - 1
        records: list[bytes] = [b""] * idx.size
        for f in np.unique(which).tolist():
            at = np.flatnonzero(which == f)
            with self._lock:
                got = self._read(f, (idx[at] - self._starts[f]).tolist())
            for place, record in zip(at.tolist(), got, strict=True):
                records[place] = record
        columns = self.parse(records)
        name = getattr(self.parse, "__name__", type(self.parse).__name__)
        for column, values in columns.items():
            if len(values) != idx.size:
                raise TransformError(
                    f"ArrayRecordSource parse={name}: column {column!r} has {len(values)} values for {idx.size} records: "
                    "give one value a record, in the order of the list"
                )
        return pa.table({column: to_arrow(values, column) for column, values in columns.items()})

    def fingerprint(self) -> str:
        """A hash of the files' names, record counts and content (`file_digest`: a few
        windows of each file's bytes), so that shards swapped or rewritten with records of
        the same size give another; taken once, when a state is first saved or restored."""
        if self._fingerprint is None:
            parts = [f"{os.path.basename(f)}:{n}:{file_digest(f)}" for f, n in zip(self.files, self._counts, strict=True)]
            self._fingerprint = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        return self._fingerprint

    def _read(self, f: int, local: list[int]) -> list[bytes]:
        """Records `local` of file `f`, in one batched read; a record that cannot be read is a
        CorruptFileError naming the file and the record (ArrayRecord's own error names
        neither, only the chunk's offset)."""
        reader = self._reader(f)
        try:
            return reader.read(local)
        except (RuntimeError, OSError, ValueError) as e:
            bad = next((i for i in sorted(set(local)) if not _readable(reader, i)), None)
            del self._readers[f]  # a reader that failed is not trusted with the next read
            reader.close()
            raise self._damaged(f, bad, e) from e

    def _damaged(self, f: int, bad: int | None, error: Exception) -> CorruptFileError:
        """The error for file `f`, whose record `bad` (None: one of those read) cannot be read."""
        path = self.files[f]
        where = "a record" if bad is None else f"record {bad} of the file (record {bad + int(self._starts[f])} of the source)"
        try:
            size = os.path.getsize(path)
        except OSError:
            size = None
        then = "" if size == self._sizes[f] else f" It had {self._sizes[f]} bytes when the source was made, {size} now."
        return CorruptFileError(
            f"{path}: {where} cannot be read ({error}).{then} The file is truncated or damaged: rewrite or remove it."
        )

    def _reader(self, f: int) -> Any:
        """File `f`'s reader in this process (opened on first use; at most `OPEN_FILES`
        stay open, the least recently used closed first, so that thousands of files fit a
        `ulimit -n` of 1024)."""
        reader = self._readers.get(f)
        if reader is None:
            reader = self._readers[f] = _open(self.files[f])
            if len(self._readers) > OPEN_FILES:
                self._readers.popitem(last=False)[1].close()
        self._readers.move_to_end(f)
        return reader

    def __repr__(self) -> str:
        return f"ArrayRecordSource({len(self.files)} files, {len(self)} records)"


def _open(path: str) -> Any:
    """An ArrayRecord reader of `path`; a file that is not one is a SourceError naming it."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        return ArrayRecordReader(path, _READER_OPTIONS)
    except (OSError, RuntimeError, ValueError) as e:
        raise _unreadable(path, e) from e


def _readable(reader: Any, record: int) -> bool:
    """Whether `reader` reads `record` alone (an error path: one read a record)."""
    try:
        reader.read([record])
    except (RuntimeError, OSError, ValueError):
        return False
    return True


def _count(path: str) -> int:
    """Records in `path` (its index only is read); checks that it is an ArrayRecord file."""
    reader = _open(path)
    try:
        count = int(reader.num_records())
        reader.close()
    except (OSError, RuntimeError, ValueError) as e:
        raise _unreadable(path, e) from e
    return count


def _unreadable(path: str, error: Exception) -> SourceError:
    return SourceError(f"{path}: cannot be read as an ArrayRecord file ({error}): check the path, or leave it out")
