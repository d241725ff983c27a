"""The in-process transport: each local host's pipeline runs in the trainer process, on a
thread of its own (one chunk ahead) or in worker processes. For tests, notebooks,
debugging, and single-host training where the trainer has CPU to spare."""

from __future__ import annotations

from collections.abc import Iterator

from colo_data.backends.base import GlobalBatch, assembled, plus, told
from colo_data.backends.placement import Placement
from colo_data.host.shares import host_pipeline
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.budget import cpu_budget
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.telemetry.counters import CpuMeter, StageTimes, metered
from colo_data.telemetry.report import HostCounters, HostInfo
from colo_data.workers.pools import start_pool
from colo_data.workers.settings import Workers, choose_workers


class InProcessTransport:
    """The local hosts of `placement`, each a host pipeline of `pipeline` with `workers`
    processes (0: a thread here; `ahead` computes a chunk ahead on it).

    Args:
        pipeline: the dataset definition.
        placement: the mesh placement; its local hosts are computed here.
        workers: worker processes per host (0: none; "auto": from the CPU budget).
        ahead: compute each host's next chunk on a thread while this one is handed out.
        owner: stops the worker processes when it closes.
    """

    name = "inprocess"

    def __init__(self, pipeline: AnyPipeline, placement: Placement, workers: Workers, ahead: bool, owner: Lifecycle) -> None:
        self.placement = placement
        self.local_hosts = placement.local_hosts
        self._budget = cpu_budget()
        self.choice = choose_workers(workers, self._budget)
        # worker processes start now, while the trainer compiles, and are kept across runs
        self._hosts = [
            host_pipeline(pipeline, h, placement.hosts, start_pool(self.choice, owner, self._budget), ahead)
            for h in self.local_hosts
        ]
        self.on_trainer_thread = not ahead
        self.handoff = StageTimes()
        self._cpu: CpuMeter | None = None  # the worker processes', all hosts together
        self._base_cpu: list[tuple[float, float] | None] = [None] * len(self._hosts)

    def open(self, position: Position, run: Lifecycle) -> Iterator[GlobalBatch]:
        feeds = [
            told(host.chunks(position, run, batches=1), host.downstream, self.on_trainer_thread) for host in self._hosts
        ]
        batches = assembled(feeds, self.placement, self.handoff, wait_for_devices=False)
        if not self.choice.count:
            return batches
        self._cpu = CpuMeter("children")
        return metered(batches, self._cpu)

    def counters(self) -> tuple[list[float], list[HostCounters]]:
        out = []
        for i, host in enumerate(self._hosts):
            run: tuple[float, float] | None = None  # this run's (seconds, CPU seconds)
            if self._cpu is not None:  # one meter for all hosts' worker processes: each host gets its share
                run = (self._cpu.sample[0], self._cpu.sample[1] / len(self._hosts))
            if host.cpu is not None:  # the thread making the host's chunks, over the same time
                seconds, used = host.cpu.sample
                run = (seconds, used) if run is None else (max(seconds, run[0]), run[1] + used)
            cpu = self._base_cpu[i] if run is None else plus(self._base_cpu[i], run)
            workers = tuple(tuple(w.values) for w in host.worker_stages)
            out.append(HostCounters(tuple(host.stages.values), cpu, None, workers, host.quality.snapshot(), host.workers_now()))
        return list(self.handoff.values), out

    def run_ended(self) -> None:
        self._base_cpu = [c.cpu for c in self.counters()[1]]
        self._cpu = None
        for host in self._hosts:
            host.cpu = None

    def infos(self) -> list[HostInfo]:
        b, w = self._budget, self.choice.count
        why, remote = self.choice.reason, self.choice.ray is not None
        return [
            HostInfo(h, "trainer process", max(1, w), w > 0, b.cpus, b.source, None, 0, why, remote) for h in self.local_hosts
        ]
