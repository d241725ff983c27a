"""fsspec filesystems (gcsfs, s3fs, ...) as the `pyarrow.fs` filesystem a source reads
through. Their requests run on their own event loop, without the GIL, where pyarrow's own
GCS client makes the first request of every file it opens while holding it (a round trip
during which no thread of the process runs). pyarrow's `FSSpecHandler` would do, but it
answers "not found" for any failure of the store (its `isfile`, `isdir` and `exists`
swallow errors) and its handles carry no object version: this handler lets the store's
errors through as `OSError`s that the retries can classify, and keeps the version (GCS
generation, S3 ETag) of every object it opens."""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

# URI scheme -> the type_name of pyarrow's own filesystem for it
NATIVE_SCHEMES = {"file": "local", "s3": "s3", "gs": "gcs", "gcs": "gcs", "hdfs": "hdfs"}
_VERSION_KEYS = ("generation", "ETag", "etag", "VersionId", "version_id")


def is_fsspec(filesystem: object) -> bool:
    """Whether `filesystem` is an fsspec filesystem (fsspec is imported once one exists)."""
    fsspec = sys.modules.get("fsspec")
    return fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem)


def as_pyarrow(filesystem: Any) -> pafs.FileSystem:
    """`filesystem` as a `pyarrow.fs` filesystem: an fsspec one wrapped in `StoreHandler`."""
    return pafs.PyFileSystem(StoreHandler(filesystem)) if is_fsspec(filesystem) else filesystem


def schemes(fs: pafs.FileSystem) -> tuple[str, ...]:
    """The URI schemes that name `fs`'s objects (`gs`, `s3`, ...), the first the usual one."""
    handler = getattr(fs, "handler", None)
    if isinstance(handler, StoreHandler):
        protocol = handler.fs.protocol
        return (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return tuple(scheme for scheme, name in NATIVE_SCHEMES.items() if name == fs.type_name)


def describe(fs: pafs.FileSystem) -> str:
    """The filesystem as its user made it: "GCSFileSystem (fsspec: gs, gcs)", "S3FileSystem (s3)"."""
    handler = getattr(fs, "handler", None)
    if isinstance(handler, StoreHandler):
        return f"{type(handler.fs).__name__} (fsspec: {', '.join(schemes(fs))})"
    return f"{type(fs).__name__} ({fs.type_name})"


def _store_error(error: Exception, path: str) -> OSError:
    """An error of the store as an `OSError` naming the object, with its HTTP status where
    it has one (so that the retries tell a 503 from a 403), and a `ConnectionError` where a
    connection failed or timed out underneath (the library's own error wraps it); a missing
    object or a refusal passes as it is."""
    if isinstance(error, FileNotFoundError | PermissionError):
        return error
    status = getattr(error, "code", None) or getattr(error, "status", None)
    http = f" (HTTP {status})" if isinstance(status, int) else ""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    kind = ConnectionError if any(isinstance(c, ConnectionError | TimeoutError) for c in chain) else OSError
    wrapped = kind(f"{path}: {type(error).__name__}{http}: {error}")
    wrapped.__cause__ = error
    return wrapped


class _StoreFile:
    """An fsspec file whose reads raise the store's errors as `_store_error` says."""

    def __init__(self, file: Any, path: str) -> None:
        self._file, self._path = file, path

    def read(self, size: int = -1) -> bytes:
        try:
            return self._file.read(size)
        except Exception as e:
            raise _store_error(e, self._path) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class StoreHandler(pafs.FSSpecHandler):
    """pyarrow's `FSSpecHandler` that asks the store instead of guessing: a lookup that
    fails is the store's error, not "not found"; `version(path)` is the version of the
    object as this process last opened it (None where the store says none)."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        self._versions: dict[str, str | None] = {}

    def _info(self, path: str) -> dict[str, Any]:
        try:
            return self.fs.info(path)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise _store_error(e, path) from e

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        infos = []
        for path in paths:
            try:
                infos.append(self._create_file_info(path, self._info(path)))
            except FileNotFoundError:
                infos.append(pafs.FileInfo(path, pafs.FileType.NotFound))
        return infos

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        base = selector.base_dir
        try:
            found = self.fs.find(base, maxdepth=None if selector.recursive else 1, withdirs=True, detail=True)
        except FileNotFoundError:
            found = {}
        except Exception as e:
            raise _store_error(e, base) from e
        infos = [self._create_file_info(p, info) for p, info in found.items() if p.strip("/") != base.strip("/")]
        if not infos:
            try:
                kind = self._info(base)["type"]
            except FileNotFoundError:
                if selector.allow_not_found:
                    return []
                raise
            if kind != "directory":
                raise NotADirectoryError(base)
        return infos

    def open_input_file(self, path: str) -> pa.NativeFile:
        try:
            self.fs.invalidate_cache(path)  # its version now, not as a listing found it
            file = self.fs.open(path, mode="rb", cache_type="none")
        except FileNotFoundError:
            raise
        except Exception as e:
            raise _store_error(e, path) from e
        details = getattr(file, "details", None) or {}
        self._versions[path] = next((str(details[k]) for k in _VERSION_KEYS if details.get(k)), None)
        return pa.PythonFile(_StoreFile(file, path), mode="r")

    def version(self, path: str) -> str | None:
        """The object's version when this process last opened it."""
        return self._versions.get(path)
