"""The `workers` setting: the most worker processes a host pipeline may use (a count, or
"auto": from the CPU budget and the memory), or workers of their own kind (`RemoteWorkers`:
Ray actors), as code, configs and command lines give it; that bound and why
(`choose_workers`; how many of them work at a time, `WorkerPolicy` counts); Grain's
multiprocessing options sized from the budget."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import psutil

from colo_data.errors import ConfigError
from colo_data.runtime.budget import CpuBudget, auto_workers, cpu_budget, memory_limit
from colo_data.setting_checks import as_int
from colo_data.workers.ray_options import SPEC_PREFIX, RayWorkers

# "auto"'s bound: a record that waits (a fetch, a remote call) more than it computes makes
# workers pay beyond the CPUs, so "auto" allows `WAITING_PER_CPU` a CPU of the budget, at
# most `MOST_WORKERS` processes, and leaves each `WORKER_MEMORY` of half the memory limit
# (or of half the machine's memory); for work on the CPU the policy counts about one a CPU
WAITING_PER_CPU = 16
MOST_WORKERS = 256
WORKER_MEMORY = 128 * 2**20


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


# the most worker processes per host, "auto" (`choose_workers`' bound), or workers of their own kind (Ray actors) per host
Workers = int | Literal["auto"] | RemoteWorkers


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
    """`workers` as written in a config or on a command line: a count (an int or its ASCII
    digits), "auto", or Ray workers ("ray", `RayWorkers.to_spec()`'s "ray:{...}", or a table
    `{ ray = "auto", actors = 4 }`); anything else is a ConfigError naming `where`."""
    if isinstance(value, Mapping) or isinstance(value, str) and (value == "ray" or value.startswith(SPEC_PREFIX)):
        return RayWorkers.from_spec(value, where)
    if isinstance(value, str) and value.isascii() and value.isdigit():  # not "²", "①" nor "٣": str.isdigit() takes them
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
    """The most worker processes a host pipeline uses (0: its own thread computes its
    chunks), and why, in words for the report."""

    count: int
    reason: str
    ray: RemoteWorkers | None = None  # the count is of these workers (Ray actors), not of local processes


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


def auto_most(budget: CpuBudget, memory: int | None = None) -> int:
    """The most worker processes "auto" allows on `budget` (see `WAITING_PER_CPU`), within
    `memory` bytes (default: the cgroup memory limit, else the machine's memory)."""
    memory = memory or memory_limit() or psutil.virtual_memory().total
    return max(1, min(WAITING_PER_CPU * math.ceil(budget.cpus), MOST_WORKERS, memory // (2 * WORKER_MEMORY)))


def choose_workers(requested: Workers, budget: CpuBudget) -> WorkerChoice:
    """The most workers `requested` allows (for "auto", `auto_most` of `budget`), with the
    reason in words; how many of them work at a time is the host pipeline's
    `WorkerPolicy`'s to count."""
    if isinstance(requested, RemoteWorkers):
        return WorkerChoice(requested.actors, f"{requested.describe()}, as many at work as the worker policy counts", requested)
    if requested != "auto":
        if not int(requested):
            return WorkerChoice(0, "none configured (workers=0): the host's own thread computes every batch")
        return WorkerChoice(int(requested), f"up to {int(requested)}, as configured; as many at work as the worker policy counts")
    most = auto_most(budget)
    return WorkerChoice(
        most,
        f"auto: up to {most} ({WAITING_PER_CPU} a CPU of the budget of {budget.cpus:g} ({budget.source}), at most "
        f"{MOST_WORKERS}, within the memory); as many at work as the worker policy counts: about one a CPU for work "
        "on the CPU, more for records that wait",
    )
