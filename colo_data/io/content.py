"""Digests of a source's content for its fingerprint, which a loader state carries and a
restore checks: cheap to take (a few reads a file, a few records a collection), and made of
the bytes themselves, not of sizes and times, which a copy keeps or resets and an object
store rounds. So a shard rewritten in place with other records of the same size, or two
shards of the same size swapped under their names, give another fingerprint, and a copy of
the same files anywhere gives the same one."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow as pa

from colo_data.io.columns import table_to_columns

WINDOW = 4096  # bytes of a file read at each place
WINDOWS = 8  # places a file, evenly spread from its start to its end
RECORDS = 16  # records of a collection, evenly spread from its first to its last


def file_digest(path: str) -> str:
    """A hash of a local file's size and of `WINDOWS` windows of `WINDOW` bytes spread
    evenly over it, the first at its start (an ArrayRecord file's first chunk and its
    hash) and the last at its end. A change that lies wholly between the windows is not
    seen: a file rewritten with other records, or another file, is (its first chunk differs)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(str(size).encode())
        last = max(0, size - WINDOW)
        for offset in sorted({last * k // (WINDOWS - 1) for k in range(WINDOWS)}):
            h.update(os.pread(f.fileno(), WINDOW, offset))
    return h.hexdigest()[:16]


def sampled_records(length: int) -> np.ndarray:
    """The indices of the records `records_digest` reads of a collection of `length`."""
    return np.unique(np.linspace(0, max(0, length - 1), min(RECORDS, length)).astype(np.int64))


def records_digest(table: pa.Table) -> str:
    """A hash of records as a table (`sampled_records` of a collection): each column's
    name, and its values (numpy columns: dtype, shape and bytes; others: as Python values)."""
    h = hashlib.sha256()
    for name, column in table_to_columns(table).items():
        h.update(f"\n{name}:".encode())
        if isinstance(column, np.ndarray):
            h.update(f"{column.dtype.str}{column.shape}".encode())
            h.update(np.ascontiguousarray(column).tobytes())
        else:
            h.update(repr(column.to_pylist()).encode())
    return h.hexdigest()[:16]
