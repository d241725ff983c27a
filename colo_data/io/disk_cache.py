"""`DiskCache`: bytes fetched from object storage kept on local disk for later epochs and
restarts. It is `diskcache` (SQLite index, one file per large entry) with a byte limit and
least-recently-used eviction, safe with several processes and threads on one host (a
sidecar's workers share one directory). Each entry carries a CRC-32 and its length: a
damaged or cut-short entry is dropped and fetched again, never decoded."""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
import zlib
from typing import Any

import diskcache

from colo_data.errors import ConfigError
from colo_data.spec.integers import int_setting

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IQ")  # CRC-32 and length of the payload


class DiskCache:
    """Byte strings by key in `directory`, at most `max_bytes` of them (least recently used
    go first). A failure of the cache itself (disk full, a damaged index) is logged once and
    turns it off for this process: the data is read from storage instead.

    Args:
        directory: where the entries live; created if missing.
        max_bytes: the cache's size limit in bytes, its index included.

    Raises:
        ConfigError: `directory` cannot be created or written, or `max_bytes` is not positive.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        max_bytes = int_setting("cache_dir_bytes", max_bytes, 1, "the disk cache's size limit in bytes")
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        try:
            os.makedirs(self.directory, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(f"no write access to {self.directory}")
            self._open().close()
        except (OSError, sqlite3.Error) as e:
            raise ConfigError(
                f"cache_dir={self.directory!r} cannot be used as a cache ({e}): give a writable local directory, or no cache_dir"
            ) from e
        self._cache: diskcache.Cache | None = None
        self._broken = False

    def _open(self) -> diskcache.Cache:
        return diskcache.Cache(self.directory, size_limit=self.max_bytes, eviction_policy="least-recently-used")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}  # reopened in the new process

    @property
    def _store(self) -> diskcache.Cache | None:
        if self._cache is None and not self._broken:
            self._cache = self._open()
        return self._cache

    def _fail(self, what: str, error: Exception) -> None:
        if not self._broken:
            log.warning("cache_dir %s: %s failed (%s); reading from storage without it", self.directory, what, error)
        self._broken = True
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def get(self, key: str) -> bytes | None:
        """The bytes stored under `key`; None when there are none, or the entry was damaged
        (then it is removed)."""
        store = self._store
        if store is None:
            return None
        try:
            value = store.get(key, retry=True)
        except (OSError, sqlite3.Error) as e:
            self._fail("a read", e)
            return None
        if value is None:
            return None
        if isinstance(value, bytes) and len(value) >= _HEADER.size:
            crc, length = _HEADER.unpack_from(value)
            payload = memoryview(value)[_HEADER.size :]
            if len(payload) == length and zlib.crc32(payload) == crc:
                return value[_HEADER.size :]
        log.warning("cache_dir %s: entry %s is damaged; fetching it again", self.directory, key)
        try:
            store.delete(key, retry=True)
        except (OSError, sqlite3.Error) as e:
            self._fail("removing a damaged entry", e)
        return None

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store `data` under `key` (nothing when it is larger than the whole cache)."""
        store = self._store
        if store is None or len(data) + _HEADER.size > self.max_bytes:
            return
        try:
            store.set(key, _HEADER.pack(zlib.crc32(data), len(data)) + bytes(data), retry=True)
        except (OSError, sqlite3.Error) as e:
            self._fail("a write", e)

    def close(self) -> None:
        """Close this process's handle (the entries stay)."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None
