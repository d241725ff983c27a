"""A dataset index: one file in a directory of data files (`_colo_data_index.json`) holding
what making a source otherwise reads from every file's metadata: the files, their sizes,
versions and times of last writing, their row groups' row counts and their schemas. A
source reads it in one or two requests instead of one or two per file, after checking it against the one
listing it makes anyway: a file added, removed or changed since the index was written is a
`StaleIndexError`, and nothing is read past it."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import posixpath
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from colo_data import defaults
from colo_data.errors import ConfigError, ResourceError, SourceError, StaleIndexError
from colo_data.io.files import MACHINE, DataFile, object_uri
from colo_data.io.fsspec_store import as_pyarrow, describe
from colo_data.io.listing import INDEX_NAME, Found, default_retries, inspect_all, listed, relative, select, split_uri
from colo_data.io.redact import redacted
from colo_data.io.retry import Exhausted, with_retries

FORMAT = 1  # the index's own format version
# The most bytes an index is read for: a little for the whole, and room for each data file listed beside it
# (its path, its row groups' counts: 64 KiB holds about 9,000 of them); a larger file is not one colo-data wrote
_MAX_BYTES, _MAX_BYTES_A_FILE = 16 * 2**20, 64 * 2**10
_SHOWN = 5  # files named in an error, per kind of difference


@dataclass(frozen=True)
class DatasetIndex:
    """An index as read: where it lies, when it was written, and each file's entry by its
    path under the index's directory (`DataFile`, schema, time of last writing as listed)."""

    uri: str
    written: str
    machine: str  # where it was written: a local file's time of last writing is compared only there
    entries: dict[str, tuple[DataFile, pa.Schema, int | None]]

    def checked(self, path: str, found: Found, local: bool) -> list[tuple[DataFile, pa.Schema]]:
        """The files that `path` names, from the index, after checking the index against
        the listing `found` of them: the same files, each of the same size and time of
        last writing.

        Raises:
            StaleIndexError: a file was added, removed or changed since the index was
                written (each named), so the index says other rows than the files hold.
        """
        assert found.base is not None  # an index is found only by listing a directory
        under = {posixpath.join(found.base, rel): rel for rel in self.entries}
        expected = {under[p] for p in select(path, list(under))}
        now = {relative(f.path, found.base): f for f in found.files}
        added = sorted(set(now) - expected)
        removed = sorted(expected - set(now))
        times = not local or self.machine == MACHINE  # a copy of local files on another machine has its own times
        changed = []
        for rel in sorted(expected & set(now)):
            file, _, then_ns = self.entries[rel]
            info = now[rel]
            if info.size != file.size:
                changed.append(f"{rel} ({file.size} bytes then, {info.size} now)")
            elif times and then_ns is not None and info.mtime_ns is not None and then_ns != info.mtime_ns:
                changed.append(f"{rel} (last written {_when(then_ns)} then, {_when(info.mtime_ns)} now)")
        if added or removed or changed:
            differences = [
                f"{what} ({len(names)}): {_few(names)}"
                for what, names in (("added since", added), ("removed", removed), ("changed", changed))
                if names
            ]
            directory = self.uri[: -len(INDEX_NAME) - 1]
            raise StaleIndexError(
                f"{self.uri} no longer matches the files it indexes (written {self.written}): "
                f"{'; '.join(differences)}. Nothing was read past it. Write it again once the files are final "
                f"(`colo-data index {directory}`, or cd.write_index), then start the job again."
            )
        out = []
        for rel in sorted(expected):
            file, schema, _ = self.entries[rel]
            info = now[rel]
            # a local file's reads check its time of last writing on this machine, as after inspecting it
            if local:
                indexed = replace(file, path=info.path, version=None, mtime_ns=info.mtime_ns, machine=MACHINE, index=self.uri)
            else:
                indexed = replace(file, path=info.path, mtime_ns=None, machine=None, index=self.uri)
            out.append((indexed, schema))
        return out


def _few(names: Sequence[str]) -> str:
    """The first `_SHOWN` names, and how many more there are."""
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def _when(mtime_ns: int) -> str:
    """A time of last writing as a user reads it (UTC)."""
    return datetime.fromtimestamp(mtime_ns / 1e9, tz=UTC).isoformat(timespec="microseconds")


def read_index(fs: pafs.FileSystem, found: Found, retries: int) -> DatasetIndex:
    """The index that the listing `found` shows in its directory.

    Raises:
        StaleIndexError: the file is not an index of this format (damaged, or written by
            another version of colo-data).
        SourceError: it could not be read from the store.
    """
    assert found.index is not None and found.base is not None
    path, uri = found.index.path, object_uri(fs, found.index.path)

    most = _MAX_BYTES + _MAX_BYTES_A_FILE * len(found.files)

    def read() -> bytes:
        with fs.open_input_stream(path) as handle:
            return bytes(handle.read(most + 1))

    fix = f"Write it again (`colo-data index {uri[: -len(INDEX_NAME) - 1]}`, or cd.write_index), or remove it."
    if isinstance(fs, pafs.LocalFileSystem):
        _check_owner(path, uri, fix)
    try:
        data = read() if isinstance(fs, pafs.LocalFileSystem) else with_retries(read, retries)
    except Exhausted as e:
        raise SourceError(f"{uri}: reading the dataset index failed after {e}; the last error: {e.__cause__}") from e.__cause__
    if len(data) > most:
        raise StaleIndexError(
            f"{uri} holds more than the {most:,} bytes an index of the {len(found.files)} data files listed beside it "
            f"may take (it was not read further): not an index colo-data wrote for them. {fix}"
        )
    try:
        return _decode(json.loads(data), uri)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, pa.ArrowException) as e:
        raise StaleIndexError(
            f"{uri} is not a colo-data dataset index of format {FORMAT} ({type(e).__name__}: {e}). {fix}"
        ) from None


def _check_owner(path: str, uri: str, fix: str) -> None:
    """StaleIndexError for a local index that another user (not root) owns in a directory
    that its group or others may write (a shared or sticky one, /tmp's kind): anyone who
    can write there could have planted it, and a job reads the rows it names. An index of
    another user's in a directory only its owners may write (a data team's) is read."""
    index, directory = os.stat(path), os.stat(posixpath.dirname(path))
    if index.st_uid in (os.geteuid(), 0) or not directory.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return
    raise StaleIndexError(
        f"{uri} belongs to uid {index.st_uid}, not to this process's user (uid {os.geteuid()}) or root, in a directory "
        f"its group or others may write (mode {stat.S_IMODE(directory.st_mode):o}): whoever wrote it chooses the rows "
        f"a job reads, so it is not used. {fix}"
    )


def _decode(document: Any, uri: str) -> DatasetIndex:
    """The index a parsed JSON document holds; ValueError (or KeyError, TypeError) naming
    what is not as `_encode` writes it."""
    if not isinstance(document, dict):
        raise ValueError(f"a JSON {type(document).__name__}, not an object")
    if document.get("colo_data_index") != FORMAT:
        raise ValueError(f"format {document.get('colo_data_index')!r}")
    schemas = [pa.ipc.read_schema(pa.py_buffer(base64.b64decode(s))) for s in _listed(document, "schemas")]
    entries = {}
    for e in _listed(document, "files"):
        if not isinstance(e, dict) or not isinstance(e.get("path"), str):
            raise ValueError(f"a file entry {str(e)[:80]!r} without a path")
        where = f"{e['path']}: "
        rows = tuple(_count(n, where + "a row group's rows") for n in _listed(e, "row_groups"))
        number = _count(e["schema"], where + "schema")
        if number >= len(schemas):
            raise ValueError(f"{where}schema {number}, of {len(schemas)} schemas")
        stamp = e["mtime_ns"] if e["mtime_ns"] is None else _count(e["mtime_ns"], where + "mtime_ns")
        if e["format"] not in ("parquet", "ipc"):
            raise ValueError(f"{where}format {str(e['format'])[:40]!r}: neither 'parquet' nor 'ipc'")
        file = DataFile(e["path"], e["format"], rows, _count(e["size"], where + "size"), e["version"])
        entries[e["path"]] = (file, schemas[number], stamp)
    return DatasetIndex(uri, str(document["written"]), str(document["machine"]), entries)


def _listed(document: dict[str, Any], key: str) -> list[Any]:
    """`document[key]`, a JSON list; ValueError when it is not one."""
    value = document[key]
    if not isinstance(value, list):
        raise ValueError(f"{key}: a JSON {type(value).__name__}, not a list")
    return value


def _count(value: Any, what: str) -> int:
    """`value`, an int from 0 to 2**62 (sizes, rows, times); ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**62:
        raise ValueError(f"{what} {str(value)[:40]}: not an int from 0 to 2**62")
    return value


def _encode(base: str, inspected: list[tuple[DataFile, pa.Schema]], times: dict[str, int | None]) -> bytes:
    schemas: dict[bytes, int] = {}
    files = []
    for file, schema in inspected:
        key = schema.serialize().to_pybytes()
        files.append(
            {
                "path": relative(file.path, base),
                "format": file.format,
                "size": file.size,
                "mtime_ns": times[file.path],
                "version": file.version,
                "row_groups": list(file.row_groups),
                "schema": schemas.setdefault(key, len(schemas)),
            }
        )
    document = {
        "colo_data_index": FORMAT,
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": MACHINE,
        "files": files,
        "schemas": [base64.b64encode(key).decode() for key in schemas],
    }
    return json.dumps(document, separators=(",", ":")).encode()


def _replace_locally(target: str, data: bytes) -> None:
    """Write `data` to a new file beside `target` and rename it over `target`. The new file
    is created exclusively under a name no one can guess (`mkstemp`: never through a link
    that another user of a shared directory planted), and the rename replaces whatever
    `target` is, a link included, without following it."""
    fd, partial = tempfile.mkstemp(dir=posixpath.dirname(target), prefix=f".{INDEX_NAME}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o644)  # readable by every job that reads the data, as an index made by open() was
            out.write(data)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _unwritten(directory: str, size: int, error: OSError) -> SourceError | ResourceError:
    """The error for a local index that could not be written into `directory`: the
    directory, the index's bytes and, where the disk is full, the bytes free there."""
    what = f"write_index({directory!r}): cannot write the index ({size:,} bytes) into {directory}: {error.strerror}"
    optional = "the index is optional: a source of the directory reads every file's metadata without one"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        room = os.statvfs(directory)
        return ResourceError(
            f"{what} ({room.f_bavail * room.f_frsize:,} bytes free on its filesystem). Free at least {size:,} bytes "
            f"there (or raise the quota) and index it again; {optional}"
        )
    return SourceError(f"{what}. Make the directory writable by this user and index it again; {optional}")


def write_index(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], filesystem: pafs.FileSystem | Any | None = None
) -> list[str]:
    """Write a dataset index into each directory of `paths`, of every data file under it
    (as `cd.ArrowSource(directory)` reads them: recursively, `.parquet`, `.pq`, `.arrow`,
    `.ipc` and `.feather` files whose names do not start with "." or "_"). A source of
    that directory, or of a glob in it, then reads the index instead of every file's
    metadata. Write it again after any file changes: a source refuses an index that the
    files no longer match.

    Args:
        paths: a directory, a URI of one (`gs://bucket/dir`, `s3://...`), or a list of them.
        filesystem: the filesystem to find them in, as for `cd.ArrowSource`.

    Returns:
        The indexes written, one per directory, as a message shows them (a URI's credentials
        `redacted`: the command line prints them).

    Raises:
        ConfigError: a path is not a directory.
        SourceError, CorruptFileError: a directory holds no data file, a file's metadata
            cannot be read, or a local directory cannot take the index (read-only).
        ResourceError: a local directory's disk (or quota) has no room for the index.
    """
    patterns = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    retries = default_retries(filesystem)
    fs_given = as_pyarrow(filesystem)
    written = []
    for pattern in patterns:
        fs, directory = split_uri(pattern, fs_given)
        if fs.get_file_info(directory).type != pafs.FileType.Directory:
            raise ConfigError(
                f"write_index({redacted(repr(pattern))}): not a directory on {describe(fs)}. An index lives beside the "
                "data: give the directory that holds the files (a source of that directory, or of a glob in it, reads "
                "the index)."
            )
        found = listed(fs, directory, retries)
        if not found.files:
            shown = redacted(repr(pattern))
            raise SourceError(f"write_index({shown}): the directory holds no Parquet or Arrow IPC file to index")
        paths_found = sorted(f.path for f in found.files)
        inspected = inspect_all(fs, paths_found, retries, defaults.IO_CONCURRENCY, {})
        data = _encode(directory, inspected, {f.path: f.mtime_ns for f in found.files})
        target = posixpath.join(directory, INDEX_NAME)
        if isinstance(fs, pafs.LocalFileSystem):  # a reader never sees half an index (object stores: a PUT is whole)
            try:
                _replace_locally(target, data)
            except OSError as e:  # a full disk, a read-only mount: nothing of the index is left behind
                raise _unwritten(directory, len(data), e) from e
        else:
            with fs.open_output_stream(target) as out:
                out.write(data)
        written.append(redacted(pattern.rstrip("/") + "/" + INDEX_NAME) if "://" in pattern else target)
    return written
