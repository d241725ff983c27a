"""What this host can spend: the CPU budget (affinity mask, cgroup quotas of the whole
hierarchy, an override), the cgroup memory limit and the shared-memory directory's free
space. `os.cpu_count()` reports the machine's CPUs, not the container's, so it is never used.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from colo_data.errors import ConfigError
from colo_data.host.ray_workers import SPEC_PREFIX, RayWorkers
from colo_data.io.integers import as_int

CPUS_ENV = "COLO_DATA_CPUS"


@runtime_checkable
class RemoteWorkers(Protocol):
    """Workers of a kind of their own rather than this host's processes (`cd.RayWorkers`'
    actors), as the host side asks of them; their pool is the workers package's
    (`colo_data.workers.pools`)."""

    @property
    def actors(self) -> int:
        """Workers per host pipeline."""
        ...

    def describe(self) -> str:
        """The workers in words, for reports."""
        ...

    def to_spec(self) -> str:
        """The workers as one `--workers` string, which `workers_from` reads back."""
        ...


# worker processes per host, "auto" (`choose_workers` picks), or workers of their own kind (Ray actors) per host
Workers = int | Literal["auto"] | RemoteWorkers
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


def check_workers(owner: str, workers: Any) -> Workers:
    """`workers` as a count of worker processes (numpy integers too), "auto", or workers of
    their own kind (`RemoteWorkers`); anything else is a ConfigError naming `owner`'s setting."""
    if isinstance(workers, str) and workers == "auto":
        return "auto"
    if isinstance(workers, RemoteWorkers):
        return workers
    count = as_int(workers)
    if count is None or count < 0:
        raise ConfigError(
            f"{owner}(workers={workers!r}): give an int >= 0 (0: the host's own thread computes its batches), "
            "'auto' (from the CPU budget) or cd.RayWorkers(...) (actors on a Ray cluster)"
        )
    return count


def workers_from(value: Any, where: str) -> Workers:
    """`workers` as written in a config or on a command line: a count (an int or its digits),
    "auto", or Ray workers ("ray", `RayWorkers.to_spec()`'s "ray:{...}", or a table
    `{ ray = "auto", actors = 4 }`); anything else is a ConfigError naming `where`."""
    if isinstance(value, Mapping) or isinstance(value, str) and (value == "ray" or value.startswith(SPEC_PREFIX)):
        return RayWorkers.from_spec(value, where)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if value == "auto" or as_int(value) is not None and value >= 0:
        return check_workers(where, value)
    raise ConfigError(
        f"{where} = {value!r}: give a number >= 0, \"auto\", or Ray workers: \"ray\", "
        '\'ray:{"address": "auto", "actors": 4}\' (a config: workers = { ray = "auto", actors = 4 })'
    )


def workers_text(workers: Workers) -> str:
    """`workers` as `workers_from` reads it back (a sidecar's `--workers`)."""
    return workers.to_spec() if isinstance(workers, RemoteWorkers) else str(workers)


@dataclass(frozen=True)
class WorkerChoice:
    """How many worker processes a host pipeline uses (0: its own thread computes its
    chunks), and why, in words for the report."""

    count: int
    reason: str
    ray: RemoteWorkers | None = None  # the count is of these workers (Ray actors), not of local processes


def auto_workers(cpus: float) -> int:
    """Worker processes for a budget of `cpus` CPUs: the CPUs, rounded up, less one for the
    host's own thread, which computes chunks beside them (none on 1 CPU or less). The count
    is a ceiling, not a load: a host pipeline starts and hands work to its workers only
    while CPU goes unused, and uses as many as deliver more than fewer did
    (`HostPipeline`); they run below the trainer's priority."""
    return max(0, math.ceil(cpus) - 1)


def grain_multiprocessing_options(per_worker_buffer_size: int = 1) -> Any:
    """Grain's `MultiprocessingOptions` for `mp_prefetch` inside a `GrainPipeline`, with one
    worker process per CPU of this process's budget (cgroup quota, affinity mask,
    `COLO_DATA_CPUS`) less one for the process that iterates the dataset, where Grain's
    default is 10 and `os.cpu_count()` oversubscribes a container. Call it in
    `make_dataset`: it runs where the host's share runs (the sidecar), on its budget."""
    import grain  # noqa: PLC0415 - only a Grain pipeline needs it

    return grain.MultiprocessingOptions(
        num_workers=auto_workers(cpu_budget().cpus), per_worker_buffer_size=per_worker_buffer_size
    )


def choose_workers(requested: Workers, budget: CpuBudget, beside: str) -> WorkerChoice:
    """`requested` worker processes as given, or for "auto" `auto_workers` of `budget`,
    with the reason in words.

    Args:
        requested: a count, or "auto".
        budget: this process's CPU budget.
        beside: what else spends the budget first (the host's own thread, a trainer), for
            the reason.
    """
    used = f"used while CPU goes unused (beside {beside}) and while each one more pays"
    if isinstance(requested, RemoteWorkers):
        return WorkerChoice(requested.actors, f"{requested.describe()}; each one more used while it pays", requested)
    if requested != "auto":
        return WorkerChoice(int(requested), f"as configured; {used}")
    count = auto_workers(budget.cpus)
    if not count:
        return WorkerChoice(0, f"auto: CPU budget {budget.cpus:g} ({budget.source}): the host's own thread only")
    return WorkerChoice(count, f"auto: CPU budget {budget.cpus:g} ({budget.source}) less 1 for the host's own thread; {used}")


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
