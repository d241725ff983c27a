"""`DiskCache`: bytes fetched from object storage kept on local disk for later epochs and
restarts, shared by the processes and threads of a host (a sidecar's workers share one
directory). The cache holds data and is read as data: an entry is a file of a header
(magic, CRC-32, length) and the bytes, nothing in it is unpickled or run, and a damaged or
cut-short entry is dropped and fetched again, never decoded. An entry is written under a
temporary name and renamed into place, so a reader sees all of it or none of it. A ledger
(the bytes held, as text), updated under a file lock, keeps the directory within its
limit: past it the least recently used entries go (each use sets the entry's time).

Whoever can write the directory chooses what a job trains on, so it is used only when this
process's user (or root) owns it and neither its group nor others may write it, and each
file in it likewise; colo-data makes it (and any missing parent) 0700, whatever the umask,
and its files 0600. It works through a descriptor of the directory opened once per process
and checked then, so the directory cannot be swapped under it afterwards."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

from colo_data.errors import ConfigError
from colo_data.setting_checks import int_setting

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 and length of the payload
_MAGIC = b"CDC1"
_ENTRY = ".entry"  # an entry's file: the SHA-256 of its key, and this
_PARTIAL = ".partial"  # an entry being written
_LEDGER = "ledger"  # the bytes the entries hold, as decimal text; locked while it changes
_LOW_WATER = 0.9  # an eviction goes down to this share of the limit: it lists the directory, so not at every write
_STALE_PARTIAL_S = 3600.0  # a partial entry untouched this long belongs to a writer that died
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class DiskCache:
    """Byte strings by key in `directory`, at most `max_bytes` of them (least recently used
    go first). A failure of the cache itself (disk full, an I/O error) is logged once and
    turns it off for this process: the data is read from storage instead.

    Args:
        directory: where the entries live; created 0700 if missing.
        max_bytes: the cache's size limit in bytes.

    Raises:
        ConfigError: `directory` cannot be created or written; it or a file in it belongs
            to another user than this process's or root, or its group or others may write
            it; or `max_bytes` is not positive.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        max_bytes = int_setting("cache_dir_bytes", max_bytes, 1, "the disk cache's size limit in bytes")
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._closer: weakref.finalize[Any, Any] | None = None
        self._broken = False
        self._lock = threading.Lock()
        try:
            _make_private(self.directory)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(f"no write access to {self.directory}")
            with self._ledger() as ledger:
                ledger.total = self._swept()
        except OSError as e:
            raise ConfigError(
                f"cache_dir={self.directory!r} cannot be used as a cache ({e}): give a writable local directory, or no cache_dir"
            ) from e

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_fd": None, "_closer": None}  # each process opens and checks the directory itself
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def _dir(self) -> int:
        """A descriptor of the directory, opened and checked once in this process."""
        with self._lock:
            if self._fd is None:
                fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    self._check(os.fstat(fd), "the directory")
                except BaseException:
                    os.close(fd)
                    raise
                self._fd, self._closer = fd, weakref.finalize(self, os.close, fd)
            return self._fd

    def _check(self, info: os.stat_result, what: str) -> None:
        """Refuse `info` (of `what`: "the directory", or one of its files) unless it is a
        directory or a regular file as said, which this process's user or root owns and
        neither its group nor others may write."""
        kind = stat.S_ISDIR if what == "the directory" else stat.S_ISREG
        if not kind(info.st_mode):
            why = f"is not a {'directory' if kind is stat.S_ISDIR else 'regular file'}"
        elif info.st_uid not in (os.geteuid(), 0):
            why = f"belongs to uid {info.st_uid}, not to this process's user (uid {os.geteuid()}) or root"
        elif info.st_mode & _OTHERS_WRITE:
            who = {stat.S_IWOTH: "others", stat.S_IWGRP: "its group"}.get(info.st_mode & _OTHERS_WRITE, "its group and others")
            why = f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})"
        else:
            return
        raise ConfigError(
            f"cache_dir={self.directory!r}: {what} {why}. A job trains on what its cache holds, so whoever can write "
            "there chooses the data: give cache_dir a directory of this user's that its group and others cannot write "
            "(`chmod go-w DIR`, or a new path: colo-data makes it 0700), with no file of another user in it, or no cache_dir"
        )

    def _open(self, name: str, flags: int) -> int:
        """A descriptor of the file `name` in the directory (no symbolic link), checked."""
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir)
        try:
            self._check(os.fstat(fd), f"the file {name}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[_Ledger]:
        """The ledger, locked against every other process and thread until the block ends;
        what the block sets `total` to is written back."""
        fd = self._open(_LEDGER, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            text = os.pread(fd, 32, 0).strip()
            ledger = _Ledger(int(text) if text.isdigit() else 0)
            yield ledger
            data = str(ledger.total).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)  # and the lock with it

    def _entries(self) -> list[tuple[int, int, str]]:
        """`(time of last use, bytes, name)` of every entry, each checked; partial entries
        of writers that died are removed."""
        entries = []
        now = time.time()
        with os.scandir(self._dir) as found:
            for item in found:
                if item.name.endswith(_ENTRY):
                    info = item.stat(follow_symlinks=False)
                    self._check(info, f"the file {item.name}")
                    entries.append((info.st_mtime_ns, info.st_size, item.name))
                elif item.name.endswith(_PARTIAL) and now - item.stat(follow_symlinks=False).st_mtime > _STALE_PARTIAL_S:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.name, dir_fd=self._dir)
        return entries

    def _swept(self, keep: str = "") -> int:
        """The bytes the entries hold, after removing the least recently used (never
        `keep`) while they hold more than the limit, down to `_LOW_WATER` of it. Called
        with the ledger locked."""
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return total
        for _, size, name in sorted(entries):
            if total <= _LOW_WATER * self.max_bytes:
                break
            if name != keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._dir)
                total -= size
        return total

    def _fail(self, what: str, error: Exception) -> None:
        if not self._broken:
            log.warning("cache_dir %s: %s failed (%s); reading from storage without it", self.directory, what, error)
        self._broken = True

    def get(self, key: str) -> bytes | None:
        """The bytes stored under `key`; None when there are none, or the entry was damaged
        (then it is removed)."""
        if self._broken:
            return None
        name = _name(key)
        try:
            fd = self._open(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._fail("a read", e)
            return None
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                value = f.read()
            _used(fd)
        except OSError as e:
            self._fail("a read", e)
            return None
        finally:
            os.close(fd)
        if len(value) >= _HEADER.size:
            magic, crc, length = _HEADER.unpack_from(value)
            payload = memoryview(value)[_HEADER.size :]
            if magic == _MAGIC and len(payload) == length and zlib.crc32(payload) == crc:
                return value[_HEADER.size :]
        log.warning("cache_dir %s: entry %s is damaged; fetching it again", self.directory, key)
        try:
            os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._fail("removing a damaged entry", e)
        return None

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store `data` under `key` (nothing when it is larger than the whole cache)."""
        size = _HEADER.size + len(data)
        if self._broken or size > self.max_bytes:
            return
        name = _name(key)
        partial = f"{name}.{uuid.uuid4().hex}{_PARTIAL}"
        try:
            fd = self._open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(_HEADER.pack(_MAGIC, zlib.crc32(data), len(data)))
                    f.write(data)
                _used(fd)
            finally:
                os.close(fd)
            with self._ledger() as ledger:
                try:
                    replaced = os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_size
                except FileNotFoundError:
                    replaced = 0
                os.replace(partial, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
                ledger.total += size - replaced
                if ledger.total > self.max_bytes:
                    ledger.total = self._swept(keep=name)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=self._dir)
            self._fail("a write", e)

    def close(self) -> None:
        """Close this process's descriptor of the directory (the entries stay)."""
        with self._lock:
            if self._closer is not None:
                self._closer()
            self._fd = self._closer = None


class _Ledger:
    """The ledger's figure while it is locked."""

    def __init__(self, total: int) -> None:
        self.total = total


def _name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest() + _ENTRY


def _used(fd: int) -> None:
    """Mark the file as used now, to the nanosecond (the file system's own clock may tick
    only every few milliseconds, which would leave the order of uses to chance)."""
    now = time.time_ns()
    os.utime(fd, ns=(now, now))


def _make_private(directory: str) -> None:
    """Make `directory` and each missing parent with mode 0700 (`os.makedirs` would give
    the parents 0777 less the umask: under umask 000, writable by anyone)."""
    missing = []
    path = os.path.abspath(directory)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
