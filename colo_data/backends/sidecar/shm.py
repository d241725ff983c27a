"""The shared-memory ring: a sidecar writes host batches into fixed-size slots, the trainer
maps the same files and reads them as numpy views, so a batch is copied once, not sent.

Each slot is a file `colo-data-<pid>-<token>-<slot>` in a memory-backed directory (/dev/shm,
a tmpfs, a Kubernetes memory emptyDir). Its space is reserved at creation, so a full
directory fails there with a clear error, not with SIGBUS at the first write. The writer
locks every slot file while it lives; an unlocked one belongs to a dead writer and is
swept at the next start. Unlike pids, locks stay right across pid reuse and pid namespaces
(a restarted container's writer is pid 1 again; another container sees other pids).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from colo_data.errors import ConfigError, ShmError
from colo_data.runtime import process
from colo_data.runtime.budget import shm_capacity

ALIGN = 64
COPY_PIECE = 2**20
_MIB = 2**20
_NAME = re.compile(r"colo-data-\d+-[0-9a-f]{8}-\d+")
_FIX = (
    "mount a larger shared-memory dir (docker/podman --shm-size=..., Kubernetes emptyDir "
    "medium: Memory with sizeLimit), point shm_dir at one, use fewer slots or a smaller batch"
)
_SETTING = "the shm dir (cd.Sidecar(shm_dir=...), --shm-dir, COLO_DATA_SHM_DIR or the config's [sidecar] shm_dir)"


@dataclass(frozen=True)
class ArraySpec:
    """Where one array of a batch lies in its slot: what the writer tells the reader."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def to_wire(self) -> tuple[str, str, list[int], int]:
        """Plain values that survive JSON or pickle."""
        return self.name, self.dtype, list(self.shape), self.offset

    @classmethod
    def from_wire(cls, wire: Sequence) -> ArraySpec:
        """The spec `to_wire` gave, also after JSON turned its tuples into lists."""
        name, dtype, shape, offset = wire
        return cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset))


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[list[ArraySpec], int]:
    """Each array's place in a slot, at `ALIGN`-byte aligned offsets, and the bytes used."""
    specs, end = [], 0
    for name, array in arrays.items():
        offset = -(-end // ALIGN) * ALIGN
        specs.append(ArraySpec(name, array.dtype.str, tuple(array.shape), offset))
        end = offset + array.nbytes
    return specs, end


def slot_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The slot size a batch like `arrays` needs."""
    return _layout(arrays)[1]


def ring_bytes(slots: int, slot_size: int) -> int:
    """Shared memory a ring of `slots` slots of `slot_size` bytes takes."""
    if slots < 1 or slot_size < 1:
        raise ConfigError(f"slots={slots}, slot_size={slot_size}: a ring needs at least 1 slot of at least 1 byte")
    return slots * slot_size


def check_capacity(directory: str, slots: int, slot_size: int, memory_limit: int | None = None) -> None:
    """Raise ShmError unless the ring fits both the free space of `directory` and
    `memory_limit` (bytes the ring may take, e.g. the cgroup limit; shared-memory pages
    count against it)."""
    needed = ring_bytes(slots, slot_size)
    free = shm_capacity(directory)
    want = f"a ring of {slots} slots x {slot_size} bytes needs {needed} bytes ({needed / _MIB:.1f} MiB)"
    if needed > free:
        raise ShmError(f"{want}, but {directory} has {free} bytes ({free / _MIB:.1f} MiB) free: {_FIX}")
    if memory_limit is not None and needed > memory_limit:
        raise ShmError(
            f"{want}, but the memory limit is {memory_limit} bytes ({memory_limit / _MIB:.1f} MiB) "
            f"({directory} has {free} bytes free): raise the memory limit, use fewer slots or a smaller batch"
        )


def check_directory(directory: str) -> None:
    """Raise ShmError unless slot files can be made in `directory`: a directory this process
    may write (a missing one is `shm_capacity`'s to name)."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise ShmError(
            f"{_SETTING} is {directory}, which is {'a regular file' if stat.S_ISREG(info.st_mode) else 'a special file'}, "
            "not a directory: point it at a memory-backed directory "
            "(/dev/shm, a tmpfs, a Kubernetes emptyDir with medium: Memory)"
        )
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        mount = ", on a read-only mount" if os.statvfs(directory).f_flag & os.ST_RDONLY else ""
        raise ShmError(
            f"{_SETTING} {directory} is not writable by this process (uid {os.geteuid()}; the directory belongs to "
            f"uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}{mount}): mount it read-write, give this user "
            "write permission, or point the setting at another memory-backed directory"
        )


def sweep_stale(directory: str) -> list[str]:
    """Remove the ring segments in `directory` that no live writer holds; return their names.
    Only this user's regular files named like segments are segments: in a shared /dev/shm
    another user's file, a directory, a FIFO or a link of that name is someone else's, left
    as it is, and nothing is opened in a way that could block."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:  # nothing to sweep; the capacity check says what to do
        return []
    return [name for name in names if _NAME.fullmatch(name) and _remove_if_stale(os.path.join(directory, name))]


def _remove_if_stale(path: str) -> bool:
    """Remove `path` if it is a segment of this user's that no live writer locks."""
    fd = _open_segment(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink:  # not already removed by a concurrent sweep
            os.unlink(path)
            return True
    except OSError:  # its writer is alive (BlockingIOError), or another sweep removed it meanwhile
        pass
    finally:
        os.close(fd)
    return False


def _open_segment(path: str) -> int | None:
    """`path` opened read-only, without following a link and without blocking (a FIFO's
    open waits for a writer), if it is a regular file of this user's; else None."""
    try:
        if not _ours(os.lstat(path)):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:  # removed meanwhile, replaced by a link, or closed to this user
        return None
    if _ours(os.fstat(fd)):  # the same kind of file still (it may have been replaced since the lstat)
        return fd
    os.close(fd)
    return None


def _ours(info: os.stat_result) -> bool:
    """Whether a file is what a segment of this user's is: a regular file it owns."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def _remove(directory: str, names: Sequence[str]) -> None:
    """Remove the files `names` in `directory`, those that are still there."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _unmap(segment: mmap.mmap) -> None:
    """Unmap now, or, while numpy views still use the mapping, when the last one is gone."""
    try:
        segment.close()
    except BufferError:
        pass


def _view(segment: mmap.mmap, spec: ArraySpec) -> np.ndarray:
    # np.frombuffer holds a buffer export, so the mapping cannot be unmapped under the view.
    return np.frombuffer(segment, np.dtype(spec.dtype), math.prod(spec.shape), spec.offset).reshape(spec.shape)


class ShmRing:
    """The writer's side: `slots` slot files of `slot_size` bytes, mapped read-write and
    locked until `close()` (or interpreter exit) unmaps and removes them."""

    def __init__(
        self, directory: str, run_id: str, slot_size: int, fds: list[int], maps: list[mmap.mmap], copy_threads: int = 1
    ) -> None:
        self.directory, self.run_id, self.slot_size = directory, run_id, slot_size
        self.names = [f"colo-data-{run_id}-{slot}" for slot in range(len(fds))]
        self._fds, self._maps = fds, maps
        self._pid = os.getpid()
        self._removed = False
        self._threads = max(1, copy_threads)
        self._pool = ThreadPoolExecutor(self._threads - 1, "colo-data-shm-copy") if self._threads > 1 else None
        self._at_exit = process.at_exit(self.close)

    @classmethod
    def create(
        cls, directory: str, slots: int, slot_size: int, memory_limit: int | None = None, copy_threads: int = 1
    ) -> ShmRing:
        """Sweep stale segments, check the capacity, then create, reserve and map every slot.
        A failure part-way removes what was made. Arrays of several MiB are copied in by up
        to `copy_threads` threads (numpy releases the GIL while copying): one thread's copy
        is slower than the memory allows."""
        check_directory(directory)
        sweep_stale(directory)
        check_capacity(directory, slots, slot_size, memory_limit)
        run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        paths = [os.path.join(directory, f"colo-data-{run_id}-{slot}") for slot in range(slots)]
        fds: list[int] = []
        maps: list[mmap.mmap] = []
        try:
            for slot, path in enumerate(paths):
                try:
                    fds.append(_create_locked(path))
                except OSError as error:  # what `check_directory` could not foresee (an immutable directory, say)
                    raise ShmError(
                        f"cannot create slot file {path} in {_SETTING}: {error.strerror}; make {directory} writable "
                        "by this user or point the setting at another memory-backed directory"
                    ) from error
                try:
                    os.posix_fallocate(fds[-1], 0, slot_size)
                except OSError as error:  # ENOSPC: something filled it after the capacity check
                    raise ShmError(
                        f"cannot reserve slot {slot} of {slots} ({slot_size} bytes each) in {directory}: "
                        f"{error.strerror}; {_FIX}"
                    ) from error
                maps.append(mmap.mmap(fds[-1], slot_size))
        except BaseException:
            for segment in maps:
                _unmap(segment)
            for path, fd in zip(paths, fds, strict=False):  # fds stops at the slot that failed
                os.unlink(path)
                os.close(fd)
            raise
        return cls(directory, run_id, slot_size, fds, maps, copy_threads)

    def write(self, slot: int, arrays: Mapping[str, np.ndarray]) -> list[ArraySpec]:
        """Copy each array once into `slot`, at 64-byte aligned offsets, and return the layout
        the reader needs. Nothing is written unless the whole batch fits."""
        if not 0 <= slot < len(self._maps):
            raise IndexError(f"slot {slot}: ring {self.run_id} has {len(self._maps)} open slots")
        specs, end = _layout(arrays)
        if end > self.slot_size:
            sizes = ", ".join(f"{name!r}: {array.nbytes}" for name, array in arrays.items())
            raise ShmError(
                f"the batch needs {end} bytes of slot space (array bytes {sizes}; offsets aligned to {ALIGN}), "
                f"but a slot holds {self.slot_size} bytes: create the ring with slot_size >= {end}"
            )
        for spec, array in zip(specs, arrays.values(), strict=True):
            self._copy(_view(self._maps[slot], spec), array)
        return specs

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """`np.copyto`, split along the rows over the copy threads into pieces of at least
        `COPY_PIECE` bytes."""
        pieces = min(self._threads, src.nbytes // COPY_PIECE, len(src) if src.ndim else 1)
        if pieces <= 1 or self._pool is None:
            np.copyto(dst, src)
            return
        bounds = [len(src) * i // pieces for i in range(pieces + 1)]
        others = [self._pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
        np.copyto(dst[: bounds[1]], src[: bounds[1]])
        for piece in others:
            piece.result()

    def close(self) -> None:
        """Remove every slot file, then unmap and close them; idempotent. The files go first,
        and are marked gone only once all are: a signal that interrupts this (a sidecar's
        SIGTERM raises SystemExit wherever its main thread is) leaves them to the next call,
        which the exit hook makes. In a forked child it only unmaps: the segments are the
        parent's."""
        if os.getpid() == self._pid and not self._removed:
            _remove(self.directory, self.names)  # some may be gone: the trainer's unlink_all, an interrupted call
            self._removed = True
        fds, maps = self._fds, self._maps
        self._fds, self._maps = [], []  # before closing them: a call that interrupted this one cannot close them twice
        if self._pool is not None:
            self._pool.shutdown()
        for segment in maps:
            _unmap(segment)
        for fd in fds:
            os.close(fd)
        process.forget(self._at_exit)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _create_locked(path: str) -> int:
    """A new file at `path`, opened read-write and share-locked. A sweep that caught it in
    the instant before the lock removes it; then it is made again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)


def _owner(path: str) -> str:
    """Whose `path` is, for an error message."""
    try:
        return f"it belongs to uid {os.stat(path).st_uid}"
    except OSError as error:  # a directory this user cannot search
        return f"its directory {os.path.dirname(path)} is closed to this user ({error.strerror})"


class ShmReader:
    """The trainer's side: maps a ring's slot files read-only, one map per slot on first
    use, and hands out numpy views into them."""

    def __init__(self, directory: str, names: Sequence[str]) -> None:
        self.directory, self.names = directory, list(names)
        self._maps: dict[int, mmap.mmap] = {}

    def _map(self, slot: int) -> mmap.mmap:
        if slot not in self._maps:
            path = os.path.join(self.directory, self.names[slot])
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as error:
                pid = self.names[slot].split("-")[2]
                raise ShmError(
                    f"shared-memory segment {path} is missing: its writer (pid {pid}) removed it or "
                    "died and it was swept; restart the sidecar"
                ) from error
            except PermissionError as error:
                raise ShmError(
                    f"cannot read shared-memory segment {path} ({error.strerror}): {_owner(path)} and this process "
                    f"runs as uid {os.geteuid()}. The sidecar makes its slot files readable by its own user only: run "
                    "the trainer and the sidecar as the same user (uid)"
                ) from error
            try:
                self._maps[slot] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        return self._maps[slot]

    def view(self, slot: int, layout: Sequence[ArraySpec]) -> dict[str, np.ndarray]:
        """The batch in `slot` as read-only numpy views (no copy). They show the slot's
        current bytes, so use them before releasing the slot to the writer."""
        segment = self._map(slot)
        return {spec.name: _view(segment, spec) for spec in layout}

    def close(self) -> None:
        """Unmap every slot (a slot still used by views is unmapped when they are gone)."""
        for segment in self._maps.values():
            _unmap(segment)
        self._maps = {}

    def unlink_all(self) -> None:
        """Remove the ring's files: for the trainer, once it knows the writer died."""
        _remove(self.directory, self.names)
