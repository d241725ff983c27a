"""What a source's paths name: the filesystem of a path or URI, the data files a file,
directory or glob selects from one listing, and the metadata of each file read (on object
storage many at once, retried). A dataset index (`colo_data.io.dataset_index`) is checked
against the same listing and selected by the same rules."""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from colo_data import defaults
from colo_data.errors import ConfigError, SourceError
from colo_data.io.files import DataFile, Kept, inspect_file, object_uri
from colo_data.io.fsspec_store import describe, is_fsspec, schemes
from colo_data.io.local_tree import hidden, local_files
from colo_data.io.redact import redacted
from colo_data.io.retry import Exhausted, transient, with_retries

DATA_SUFFIXES = (".parquet", ".pq", ".arrow", ".ipc", ".feather")
GLOB_CHARS = "*?"  # what makes a path a glob; "[" alone does not (file names hold brackets: data[1].parquet)
INDEX_NAME = "_colo_data_index.json"  # a dataset index, in the directory it describes


def split_uri(path: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path in it: `filesystem` when given (a URI of its kind loses
    its scheme), else the URI's, else the local one."""
    if filesystem is not None:
        if "://" not in path:
            return filesystem, path
        scheme, inner = path.split("://", 1)
        if scheme.lower() not in schemes(filesystem):
            raise ConfigError(
                f"{redacted(repr(path))} is a {scheme}:// URI but filesystem= is a {describe(filesystem)}: "
                "give the path inside that filesystem (e.g. 'bucket/dir/*.parquet'), "
                "or the URI without filesystem= to use the URI's own"
            )
        return filesystem, inner if scheme.lower() != "file" else posixpath.abspath(inner)
    if "://" in path:
        try:
            fs, inner = pafs.FileSystem.from_uri(path)
        except (pa.ArrowException, OSError) as e:  # pyarrow's message repeats the URI, secrets and all
            raise SourceError(
                f"{redacted(repr(path))} names no filesystem that pyarrow can open ({redacted(str(e))}): check its "
                "scheme, its query and its characters, or give the filesystem as filesystem="
            ) from None
        return fs, inner
    return pafs.LocalFileSystem(), posixpath.abspath(path)


def default_retries(filesystem: object) -> int:
    """Retries of a transient failure when none are given: 0 for an fsspec filesystem,
    which retries by itself (gcsfs: 6 times over about 30 s; both would multiply)."""
    return 0 if is_fsspec(filesystem) else defaults.READ_RETRIES


def relative(path: str, base: str) -> str:
    """`path` inside the directory `base` (filesystems differ on whether paths start with "/")."""
    return path.lstrip("/")[len(base.lstrip("/")) :].lstrip("/")


def is_glob(path: str) -> bool:
    """Whether `path` is a glob: it has `*` or `?` (a bracket class counts only in a part
    after the first of those; elsewhere brackets are the file's name)."""
    return any(c in path for c in GLOB_CHARS)


def glob_base(path: str) -> str:
    """The directory a glob lists: its path up to the first part with a glob character."""
    parts = path.split("/")
    return "/".join(parts[: next(i for i, p in enumerate(parts) if any(c in p for c in GLOB_CHARS))]) or "/"


def data_file(path: str) -> bool:
    """Whether a directory's file is one of its data files: a data suffix, and a name that
    does not start with "." or "_" (hidden files, `_SUCCESS`, the dataset index)."""
    return path.lower().endswith(DATA_SUFFIXES) and not hidden(posixpath.basename(path))


def shown(rel: str, pattern: str | None) -> bool:
    """Whether the path `rel`, under the directory a source lists, is the dataset's: no
    part of it starts with "." or "_" (a Spark `_temporary`, a filer's `.snapshot`, as
    pyarrow.dataset, Spark and Hive skip them), unless the glob `pattern` (relative to the
    same directory) has a part that starts alike and matches it: a glob may name them."""
    wanted = [q for q in pattern.split("/") if hidden(q)] if pattern else []
    return all(not hidden(p) or any(q[0] == p[0] and fnmatch.fnmatchcase(p, q) for q in wanted) for p in rel.split("/"))


def selects(pattern: str, path: str) -> bool:
    """Whether the glob `pattern` selects the file `path` (never the dataset index): the
    directory it lists (`glob_base`) literally, the rest as a pattern."""
    if posixpath.basename(path) == INDEX_NAME:
        return False
    base = glob_base(pattern)
    if base.strip("/") and not path.lstrip("/").startswith(base.strip("/") + "/"):
        return False
    pattern, path = relative(pattern, base), relative(path, base)
    patterns = {pattern, pattern.replace("**/", "")}  # "**/" also matches no directory at all
    return (
        any(fnmatch.fnmatchcase(path, p) for p in patterns)
        and ("**" in pattern or path.count("/") == pattern.count("/"))
        and shown(path, pattern)
    )


@dataclass(frozen=True)
class Found:
    """What one path names: its data files as listed (size, time of last writing), the
    directory listed for them (None for a single file) and the dataset index in that
    directory, if the listing showed one."""

    files: list[pafs.FileInfo]
    base: str | None = None
    index: pafs.FileInfo | None = None


def select(path: str, paths: Sequence[str]) -> list[str]:
    """Of `paths` (files under the directory that `path` lists), those that `path` names:
    a glob's matches, a directory's data files."""
    if is_glob(path):
        return [p for p in paths if selects(path, p)]
    return [p for p in paths if data_file(p) and shown(relative(p, path), None)]


def expand(fs: pafs.FileSystem, path: str) -> Found:
    """The files named by one path: a file, a directory (its data files, recursively) or a
    glob, from one listing."""
    if is_glob(path):
        base = glob_base(path)
        try:
            infos = _tree(fs, base, relative(path, base), missing_ok=True)
        except OSError as e:
            if transient(e):  # the store did not answer: retried by the caller, not "no files"
                raise
            return Found([])
        return _found(infos, path, base)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return Found([info])
    if info.type == pafs.FileType.Directory:
        return _found(_tree(fs, path, None), path, path)
    return Found([])


def _tree(fs: pafs.FileSystem, base: str, pattern: str | None, missing_ok: bool = False) -> list[pafs.FileInfo]:
    """Every file under the directory `base`: a local tree as `local_files` walks it (never
    into a directory that `shown` refuses, each real file once), any other as `fs` lists it."""
    top = _local_top(fs)
    if top is None:
        return fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=missing_ok))
    root = posixpath.join(top, base.lstrip("/")) if top else base
    if missing_ok and not posixpath.isdir(root):
        return []
    infos = local_files(root, lambda rel: shown(rel, pattern))
    if not top:
        return infos
    return [pafs.FileInfo(relative(i.path, top), i.type, mtime_ns=i.mtime_ns, size=i.size) for i in infos]


def _local_top(fs: pafs.FileSystem) -> str | None:
    """Where `fs`'s paths lie on the local disk: "" for the local filesystem itself, its
    directory for a `SubTreeFileSystem` of it; None for any other filesystem."""
    if isinstance(fs, pafs.LocalFileSystem):
        return ""
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return fs.base_path
    return None


def _found(infos: list[pafs.FileInfo], path: str, base: str) -> Found:
    files = {i.path: i for i in infos if i.type == pafs.FileType.File}
    index = next((i for p, i in files.items() if relative(p, base) == INDEX_NAME), None)
    gone = select(path, [i.path for i in infos if i.type == pafs.FileType.NotFound])  # links whose target is gone
    if gone:
        raise SourceError(
            f"{len(gone)} data file(s) under {base} are links whose targets are gone: {', '.join(gone[:5])}. "
            "Restore their targets or remove the links (a source never skips a data file it lists)."
        )
    return Found([files[p] for p in select(path, list(files))], base, index)


def why_nothing(fs: pafs.FileSystem, path: str) -> str:
    """Why `path` names no data file, in a few words (an error path: a lookup more is fine)."""
    if is_glob(path):
        return "a glob that matches no file"
    try:
        directory = fs.get_file_info(path).type == pafs.FileType.Directory
    except OSError:  # the store did not answer this time: the listing's answer stands
        return "no data file found"
    if directory:
        return f"a directory with no {', '.join(DATA_SUFFIXES)} file"
    return "no such file or directory"


def listed(fs: pafs.FileSystem, path: str, retries: int) -> Found:
    """`expand`, on object storage retried on transient errors.

    Raises:
        SourceError: the listing failed for good: names the place and the last error.
    """
    if isinstance(fs, pafs.LocalFileSystem):
        return expand(fs, path)
    try:
        return with_retries(lambda: expand(fs, path), retries)
    except Exhausted as e:
        raise SourceError(
            f"{object_uri(fs, path)}: listing the files failed after {e}; the last error: {e.__cause__}. "
            "Check that the object store is reachable from this host and the credentials (taken from the "
            "environment as the filesystem reads them) allow listing it."
        ) from e.__cause__


def inspect_all(
    fs: pafs.FileSystem, paths: list[str], retries: int, io_concurrency: int, kept: dict[str, Kept]
) -> list[tuple[DataFile, pa.Schema]]:
    """`inspect_file` of every path: one after the other for local files; on object storage
    `io_concurrency` at a time, each retried on transient errors, what later reads can use
    kept in `kept`."""
    if isinstance(fs, pafs.LocalFileSystem):
        return [inspect_file(fs, p) for p in paths]

    def one(path: str) -> tuple[DataFile, pa.Schema]:
        try:
            return with_retries(lambda: inspect_file(fs, path, kept), retries)
        except Exhausted as e:
            raise SourceError(
                f"{object_uri(fs, path)}: reading its metadata failed after {e}; the last error: {e.__cause__}. "
                "Check that the object store is reachable from this host and the credentials (taken from the "
                "environment as the filesystem reads them) allow reading it."
            ) from e.__cause__

    if not paths:
        return []
    with ThreadPoolExecutor(min(io_concurrency, len(paths)), thread_name_prefix="colo-data-inspect") as pool:
        return list(pool.map(one, paths))
