"""`LoaderMeters`: a Loader's telemetry bookkeeping. It owns the step clock, the trainer's
hand-off counters and the worker processes' CPU meter, reads the host pipelines' counters
(in this process, or the latest ones each sidecar sent with its slots), folds a finished
run's counters in when the loader restarts, and snapshots them all at the end of the
warm-up so that `telemetry()` reports the steady state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from colo_data.backends.sidecar.client import SidecarClient
from colo_data.host.pipeline import HostPipeline
from colo_data.host.resources import CpuBudget, cpu_budget
from colo_data.telemetry.counters import CpuMeter, StageTimes, StepClock
from colo_data.telemetry.report import HostCounters, HostInfo, Telemetry, summarize


def _plus(a: tuple[float, ...] | None, b: tuple[float, ...]) -> tuple[float, ...]:
    return b if a is None else tuple(x + y for x, y in zip(a, b, strict=True))


class LoaderMeters:
    """Telemetry state of one Loader: its step clock (made first, when the loader is
    created), `backend` as resolved, its local host pipelines and their host numbers,
    workers per host and prefetch depth."""

    def __init__(
        self, clock: StepClock, backend: str, hosts: Sequence[HostPipeline], local_hosts: Sequence[int], workers: int, prefetch: int
    ) -> None:
        self.clock = clock
        self.backend, self.workers, self.prefetch = backend, workers, prefetch
        self.handoff = StageTimes()
        self.cpu: CpuMeter | None = None  # the worker processes', in process
        self.clients: list[SidecarClient] = []  # this run's sidecar sessions
        self._hosts, self._local = list(hosts), list(local_hosts)
        self._sessions: list[tuple[str, dict[str, Any]]] = []  # (address, open reply) of the last sessions
        self._base = [HostCounters(tuple(StageTimes().values), None, None) for _ in self._local]
        self._at_warmup: tuple[list[float], list[HostCounters]] | None = None
        self._budget: CpuBudget | None = None

    def start(self) -> None:
        """A run starts: meter the worker processes (in process)."""
        if self.backend == "inprocess" and self.workers:
            self.cpu = CpuMeter("children")
        if self.clock.count == 0 and self.clock.warmup == 0:
            self._at_warmup = self.counters()

    def step(self, start: float, done: float, records: int, depth: int, batch: dict[str, jax.Array]) -> None:
        """One `next()`: called at `start`, returned `batch` of `records` records at `done`."""
        clock = self.clock
        if not clock.batch_bytes:
            clock.batch_bytes = sum(a.nbytes for a in batch.values())
        clock.record(start, done, records, depth)
        if clock.count == clock.warmup:
            self._at_warmup = self.counters()

    def counters(self) -> tuple[list[float], list[HostCounters]]:
        """The trainer's hand-off values and each local host's counters now (cumulative over
        the loader's runs)."""
        handoff = StageTimes(self.handoff.values)
        for client in self.clients:
            handoff.merge(client.handoff.values)
        out: list[HostCounters] = []
        for i, base in enumerate(self._base if self.backend != "colocated" else []):
            stages = StageTimes(base.stages)
            cpu, ring = base.cpu, base.ring
            if self.backend == "inprocess":
                host = self._hosts[i]
                stages.merge(host.stages.values)
                if self.cpu is not None:  # one meter for all hosts' worker processes: each host gets its share
                    cpu = _plus(cpu, (self.cpu.sample[0], self.cpu.sample[1] / len(self._base)))
                elif host.cpu is not None:  # the thread computing the host's chunks
                    cpu = _plus(cpu, host.cpu.sample)
            elif i < len(self.clients) and self.clients[i].stats is not None:
                stats = self.clients[i].stats
                stages.merge(stats["stages"])
                cpu, ring = _plus(cpu, tuple(stats["cpu"])), _plus(ring, tuple(stats["ring"]))
            out.append(HostCounters(tuple(stages.values), cpu, ring))
        return handoff.values, out

    def fold(self) -> None:
        """A run ended (the loader stopped): keep what its meters and sidecar sessions
        counted, for the next run."""
        handoff, now = self.counters()
        self.handoff = StageTimes(handoff)
        self._sessions = [(c.address, c.info) for c in self.clients] or self._sessions
        self.clients = []
        self.cpu = None
        for host in self._hosts:
            host.cpu = None
        if self.backend == "inprocess":  # the host pipelines keep their own stage counters
            now = [HostCounters(base.stages, counted.cpu, None) for base, counted in zip(self._base, now, strict=True)]
        self._base = now or self._base

    def infos(self) -> list[HostInfo]:
        """Where each local host runs and its resources."""
        if self.backend == "colocated":
            return []
        if self.backend == "inprocess":
            if self._budget is None:
                self._budget = cpu_budget()
            b = self._budget
            return [HostInfo(h, "trainer process", max(1, self.workers), self.workers > 0, b.cpus, b.source, None, 0) for h in self._local]
        infos = []
        sessions = [(c.address, c.info) for c in self.clients] or self._sessions
        for i, h in enumerate(self._local):
            address, info = sessions[i] if i < len(sessions) else ("(not started)", {})
            workers, budget = info.get("workers", 1), info.get("budget", {})
            shm = info.get("slots", 0) * info.get("slot_bytes", 0)
            infos.append(
                HostInfo(h, f"sidecar {address}", max(1, workers), workers > 1, budget.get("cpus"), budget.get("source"), info.get("slots"), shm)
            )
        return infos

    def telemetry(self) -> Telemetry:
        handoff, now = self.counters()
        at = self._at_warmup
        return summarize(
            backend=self.backend,
            clock=self.clock,
            prefetch=self.prefetch,
            queue_depth_known=self.prefetch > 0,
            handoff=handoff,
            handoff_at_warmup=at[0] if at else None,
            infos=self.infos(),
            now=now,
            at_warmup_hosts=at[1] if at else None,
            shared_thread=self.backend == "inprocess" and not self.workers and not self.prefetch,
        )
