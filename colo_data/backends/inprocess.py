"""The in-process transport: each local host's pipeline runs in the trainer process, on a
thread of its own (one chunk ahead) or in Grain worker processes. For tests, notebooks,
debugging, and single-host training where the trainer has CPU to spare."""

from __future__ import annotations

from collections.abc import Iterator

from colo_data.backends.base import GlobalBatch, assembled, jax_columns, plus
from colo_data.backends.placement import Placement
from colo_data.host.pipeline import HostPipeline
from colo_data.host.resources import CpuBudget, cpu_budget
from colo_data.host.workers import WorkerPool
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.spec.pipeline import Pipeline
from colo_data.telemetry.counters import CpuMeter, StageTimes, metered
from colo_data.telemetry.report import HostCounters, HostInfo


class InProcessBackend:
    """The local hosts of `placement`, each a `HostPipeline` of `pipeline` with `workers`
    processes (0: a thread here; `ahead` computes a chunk ahead on it).

    Args:
        pipeline: the dataset definition.
        placement: the mesh placement; its local hosts are computed here.
        workers: worker processes per host (0: none).
        ahead: compute each host's next chunk on a thread while this one is handed out.
        owner: stops the worker processes when it closes.
    """

    name = "inprocess"

    def __init__(self, pipeline: Pipeline, placement: Placement, workers: int, ahead: bool, owner: Lifecycle) -> None:
        self.placement = placement
        self.local_hosts = placement.local_hosts
        self.workers = workers
        self._hosts = [HostPipeline(pipeline, h, placement.hosts, workers, ahead) for h in self.local_hosts]
        for host in self._hosts if workers else ():  # started now, while the trainer compiles; kept across runs
            host.pool = WorkerPool(workers, owner)
        self.handoff = StageTimes()
        self._cpu: CpuMeter | None = None  # the worker processes', all hosts together
        self._base_cpu: list[tuple[float, float] | None] = [None] * len(self._hosts)
        self._budget: CpuBudget | None = None

    def open(self, position: int, run: Lifecycle) -> Iterator[GlobalBatch]:
        streams = [host.pieces(position, run, jax_columns(host.host)) for host in self._hosts]
        batches = assembled(streams, self.placement, self.handoff, wait_for_devices=False)
        if not self.workers:
            return batches
        self._cpu = CpuMeter("children")
        return metered(batches, self._cpu)

    def counters(self) -> tuple[list[float], list[HostCounters]]:
        out = []
        for i, host in enumerate(self._hosts):
            cpu = self._base_cpu[i]
            if self._cpu is not None:  # one meter for all hosts' worker processes: each host gets its share
                cpu = plus(cpu, (self._cpu.sample[0], self._cpu.sample[1] / len(self._hosts)))
            elif host.cpu is not None:  # the thread computing the host's chunks
                cpu = plus(cpu, host.cpu.sample)
            out.append(HostCounters(tuple(host.stages.values), cpu, None))
        return list(self.handoff.values), out

    def run_ended(self) -> None:
        self._base_cpu = [c.cpu for c in self.counters()[1]]
        self._cpu = None
        for host in self._hosts:
            host.cpu = None

    def infos(self) -> list[HostInfo]:
        if self._budget is None:
            self._budget = cpu_budget()
        b, w = self._budget, self.workers
        return [HostInfo(h, "trainer process", max(1, w), w > 0, b.cpus, b.source, None, 0) for h in self.local_hosts]

