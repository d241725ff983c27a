"""What this host can spend: the CPU budget (affinity mask, cgroup quotas of the whole
hierarchy, an override), the worker processes "auto" gives for it, the cgroup memory limit and
the shared-memory directory's free space. `os.cpu_count()` reports the machine's CPUs, not the
container's, so it is never used.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from colo_data.errors import ConfigError

CPUS_ENV = "COLO_DATA_CPUS"


# cgroup v1 reports "no memory limit" as a page-rounded LONG_MAX; anything this large is none.
_UNLIMITED_BYTES = 2**60


@dataclass(frozen=True)
class CpuBudget:
    """How many CPUs this process may use (`cpus`, fractional quotas kept), the worker
    processes that "auto" gives for them (`auto_workers`), and which limit decided it
    (`source`)."""

    cpus: float
    workers: int
    source: str
    affinity: int
    quota: float | None


@dataclass(frozen=True)
class _Limit:
    """One upper bound on the budget and a human-readable account of where it came from."""

    value: float
    source: str


@dataclass(frozen=True)
class _Mount:
    """A cgroup hierarchy mount from mountinfo: `root` is the cgroup the mount point shows;
    `options` are the super options, which for v1 name the hierarchy's controllers."""

    version: int
    root: str
    mount_point: str
    options: frozenset[str]


def cpu_budget(*, proc: str = "/proc/self", root: str = "/") -> CpuBudget:
    """The smallest of the affinity mask, every cgroup CPU quota from the process's own cgroup
    up to the hierarchy root (v1 and v2, both on hybrid hosts) and `COLO_DATA_CPUS`.

    Args:
        proc: the proc directory; a test points it at a fixture tree.
        root: the file system root that cgroup mount points are under; likewise.

    Raises:
        ConfigError: `COLO_DATA_CPUS` is not a positive number.
    """
    affinity = len(os.sched_getaffinity(0))
    quotas = [*_cpu_quotas(proc, root)]
    limits = [*quotas, _Limit(float(affinity), f"affinity mask: {affinity} CPUs")]
    override = os.environ.get(CPUS_ENV)
    if override is not None:
        limits.append(_Limit(_parse_cpus_override(override), f"{CPUS_ENV}={override}"))
    tightest = min(limits, key=lambda limit: limit.value)
    return CpuBudget(
        cpus=tightest.value,
        workers=auto_workers(tightest.value),
        source=tightest.source,
        affinity=affinity,
        quota=min((q.value for q in quotas), default=None),
    )


def auto_workers(cpus: float) -> int:
    """Worker processes that keep a budget of `cpus` CPUs busy beside the thread that
    iterates them: the CPUs, rounded up, less one (none on 1 CPU or less). Grain's
    multiprocessing gets this many (`grain_multiprocessing_options`); colo-data's own
    workers are counted by the worker policy (`colo_data.host.worker_policy`)."""
    return max(0, math.ceil(cpus) - 1)


def memory_limit(*, proc: str = "/proc/self", root: str = "/") -> int | None:
    """The smallest cgroup memory limit in bytes over the process's cgroup and its ancestors
    (v2 `memory.max`, v1 `memory.limit_in_bytes`); None when nothing is limited.

    Args:
        proc: the proc directory; a test points it at a fixture tree.
        root: the file system root that cgroup mount points are under; likewise.
    """
    limits = []
    for mount, directory in _cgroup_dirs("memory", proc, root):
        name = "memory.max" if mount.version == 2 else "memory.limit_in_bytes"
        text = _read(os.path.join(directory, name))
        if text is None or text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if value < _UNLIMITED_BYTES:
            limits.append(value)
    return min(limits, default=None)


def shm_capacity(directory: str) -> int:
    """Free bytes of the file system holding `directory` (for /dev/shm: what a ring may use).

    Raises:
        ConfigError: the directory cannot be inspected (missing or not mounted).
    """
    try:
        stat = os.statvfs(directory)
    except OSError as error:
        raise ConfigError(
            f"shared-memory directory {directory!r} cannot be inspected ({error}); "
            "mount a tmpfs there (docker: --shm-size, Kubernetes: an emptyDir with medium: Memory)"
        ) from error
    return stat.f_bavail * stat.f_frsize


def _parse_cpus_override(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{CPUS_ENV}={text!r}: must be a positive number of CPUs (e.g. 3 or 0.5), or unset")
    return value


def _cpu_quotas(proc: str, root: str) -> Iterator[_Limit]:
    """Every finite CPU quota (in CPUs) on the path from the process's cgroups to the roots."""
    for mount, directory in _cgroup_dirs("cpu", proc, root):
        quota: str | None
        period: str | None
        if mount.version == 2:
            fields = (_read(os.path.join(directory, "cpu.max")) or "").split()
            quota, period = fields if len(fields) == 2 else ("max", None)
            source = f"cgroup v2 cpu.max {quota} {period} at {directory}"
        else:
            quota = _read(os.path.join(directory, "cpu.cfs_quota_us"))
            period = _read(os.path.join(directory, "cpu.cfs_period_us"))
            source = f"cgroup v1 cpu quota {quota}/{period} at {directory}"
        if quota is None or period is None:  # a file is missing: no limit
            continue
        try:
            cpus = int(quota) / int(period)  # "max" (v2) fails here: no limit
        except (ValueError, ZeroDivisionError):
            continue
        if cpus > 0:  # v1 writes -1 for "no limit"
            yield _Limit(cpus, source)


def _cgroup_dirs(controller: str, proc: str, root: str) -> Iterator[tuple[_Mount, str]]:
    """The directories of the process's cgroup and each ancestor up to the mount point, in
    every mounted hierarchy (v1 with `controller`, and v2) that the process belongs to."""
    mounts = _mounts(os.path.join(proc, "mountinfo"))
    for hierarchy, controllers, path in _memberships(os.path.join(proc, "cgroup")):
        version = 2 if hierarchy == "0" and not controllers else 1
        if version == 1 and controller not in controllers:
            continue
        for mount in mounts:
            if mount.version != version or not controllers <= mount.options:
                continue
            relative = _relative_to(path, mount.root)
            if relative is None:
                continue
            top = os.path.join(root, mount.mount_point.lstrip("/"))
            yield from ((mount, d) for d in _ancestors(os.path.join(top, relative), top))
            break


def _memberships(path: str) -> Iterator[tuple[str, frozenset[str], str]]:
    """(hierarchy id, controllers, cgroup path) for each line of /proc/<pid>/cgroup."""
    for line in (_read(path) or "").splitlines():
        hierarchy, controllers, cgroup = line.split(":", 2)
        yield hierarchy, frozenset(filter(None, controllers.split(","))), cgroup


def _mounts(path: str) -> list[_Mount]:
    """The cgroup and cgroup2 mounts listed in a mountinfo file."""
    mounts = []
    for line in (_read(path) or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, (fs_type, _source, options) = left.split(), right.split()
        if fs_type not in ("cgroup", "cgroup2"):
            continue
        version = 2 if fs_type == "cgroup2" else 1
        mounts.append(_Mount(version, _unescape(fields[3]), _unescape(fields[4]), frozenset(options.split(","))))
    return mounts


def _relative_to(path: str, mount_root: str) -> str | None:
    """`path` relative to the mount's root, or None if the mount does not show that cgroup."""
    if ".." in path.split("/"):  # a cgroup outside this namespace's root
        return None
    relative = os.path.relpath(path, mount_root)
    if relative == ".." or relative.startswith("../"):
        return None
    return "" if relative == "." else relative


def _ancestors(directory: str, top: str) -> Iterator[str]:
    """`directory`, its parent, ... up to and including `top`."""
    directory = os.path.normpath(directory)
    top = os.path.normpath(top)
    while True:
        yield directory
        if directory == top:
            return
        directory = os.path.dirname(directory)


def _read(path: str) -> str | None:
    """A kernel file's stripped text, or None where it is missing or unreadable."""
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return None


def _unescape(field: str) -> str:
    r"""Undo mountinfo's octal escapes (a space is written as \040)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)
