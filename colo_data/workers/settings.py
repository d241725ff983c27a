"""The `workers` setting: a count of worker processes, "auto" (from the CPU budget), or
workers of their own kind (`RemoteWorkers`: Ray actors), as code, configs and command lines
give it; how many a host pipeline uses and why (`choose_workers`); Grain's multiprocessing
options sized from the budget."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from colo_data.errors import ConfigError
from colo_data.io.integers import as_int
from colo_data.runtime.budget import CpuBudget, auto_workers, cpu_budget
from colo_data.workers.ray_options import SPEC_PREFIX, RayWorkers


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
    used = f"each started only while CPU goes unused beside {beside}, and kept only while it adds batches"
    if isinstance(requested, RemoteWorkers):
        return WorkerChoice(requested.actors, f"{requested.describe()}; each kept only while it adds batches", requested)
    if requested != "auto":
        if not int(requested):
            return WorkerChoice(0, "none configured (workers=0): the host's own thread computes every batch")
        return WorkerChoice(int(requested), f"up to {int(requested)}, as configured; {used}")
    count = auto_workers(budget.cpus)
    if not count:
        return WorkerChoice(0, f"auto: CPU budget {budget.cpus:g} ({budget.source}): the host's own thread only")
    return WorkerChoice(
        count, f"auto: up to {count}, the CPU budget {budget.cpus:g} ({budget.source}) less 1 for the host's own thread; {used}"
    )
