"""The sidecar transport: a sidecar process per local host runs that host's pipeline and
writes its batches into shared memory; this side maps them and assembles global batches.
The sidecars are given by address (a container beside the trainer) or started here, one
per local host, when the transport is made (so that they load while the trainer compiles)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from colo_data.backends.base import GlobalBatch, assembled, plus
from colo_data.backends.placement import Placement
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.backends.sidecar.local import LocalSidecar
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.telemetry.counters import StageTimes
from colo_data.telemetry.quality import QualityCounts
from colo_data.telemetry.report import HostCounters, HostInfo, added_by_worker
from colo_data.workers.settings import Workers


class SidecarTransport:
    """One sidecar session per local host of `placement` for each run.

    Args:
        pipeline: the dataset definition, sent to the sidecars with each session.
        placement: the mesh placement; one sidecar per local host.
        addresses: one socket address per local host, or empty to start local sidecars.
        local: the settings of local sidecars, `(shm_dir, workers, slots)`.
        timeout: seconds a sidecar may stay silent while the trainer waits before it is
            taken for frozen (it heartbeats while it works, however slow a batch is).
        copy: copy each slot out at once (JAX's CPU backend keeps page-aligned host memory
            instead of copying it, and a slot is rewritten once released).
        owner: stops the local sidecars when it closes.
    """

    name = "sidecar"
    on_trainer_thread = False

    def __init__(
        self,
        pipeline: AnyPipeline,
        placement: Placement,
        addresses: Sequence[str],
        local: tuple[str, Workers, int],
        timeout: float,
        copy: bool,
        owner: Lifecycle,
    ) -> None:
        self.pipeline, self.placement, self.copy, self.timeout = pipeline, placement, copy, timeout
        self.local_hosts = placement.local_hosts
        self.handoff = StageTimes()
        self._clients: list[SidecarClient] = []
        self._sessions: list[tuple[str, dict[str, Any]]] = []  # (address, open reply) of the last sessions
        self._base = [HostCounters(tuple(StageTimes().values), None, None) for _ in self.local_hosts]
        self._targets: list[tuple[str, int | None]] = [(a, None) for a in addresses]
        if not addresses:
            for _ in self.local_hosts:
                sidecar = LocalSidecar(*local)
                owner.add(f"local sidecar pid {sidecar.process.pid}", sidecar.stop)
                self._targets.append((sidecar.address, sidecar.process.pid))

    def open(self, position: Position, run: Lifecycle) -> Iterator[GlobalBatch]:
        self._clients = []
        for address, pid in self._targets:
            client = SidecarClient(address, pid, timeout=self.timeout)
            # first: a prefetch thread waiting on the sidecar wakes when the connection closes
            run.add(f"sidecar session at {address}", client.close, first=True)
            self._clients.append(client)
        hosts = self.placement.hosts
        feeds = [
            c.batches(self.pipeline, h, hosts, position, self.copy)
            for h, c in zip(self.local_hosts, self._clients, strict=True)
        ]
        return assembled(feeds, self.placement, self.handoff, wait_for_devices=not self.copy)

    def counters(self) -> tuple[list[float], list[HostCounters]]:
        handoff = StageTimes(self.handoff.values)
        out = []
        for i, base in enumerate(self._base):
            stages, quality = StageTimes(base.stages), QualityCounts(base.quality)
            cpu, ring, workers, at_work = base.cpu, base.ring, base.workers, base.at_work
            client = self._clients[i] if i < len(self._clients) else None
            if client is not None:
                handoff.merge(client.handoff.values)
                if client.stats is not None:
                    stages.merge(client.stats["stages"])
                    (t, c), (s, k) = client.stats["cpu"], client.stats["ring"]
                    cpu, ring = plus(cpu, (t, c)), plus(ring, (s, k))
                    workers = added_by_worker(workers, client.stats.get("workers", ()))
                    quality.merge(client.stats.get("quality", {}))
                    told = client.stats.get("at_work")  # (a sidecar of an earlier version does not tell)
                    at_work = (told[0], told[1]) if told else at_work
            out.append(HostCounters(tuple(stages.values), cpu, ring, workers, quality.values, at_work))
        return list(handoff.values), out

    def run_ended(self) -> None:
        handoff, self._base = self.counters()
        self.handoff = StageTimes(handoff)
        self._sessions = [(c.address, c.info) for c in self._clients] or self._sessions
        self._clients = []

    def infos(self) -> list[HostInfo]:
        infos = []
        sessions = [(c.address, c.info) for c in self._clients] or self._sessions
        for i, h in enumerate(self.local_hosts):
            address, info = sessions[i] if i < len(sessions) else ("(not started)", {})
            workers, budget = info.get("workers", 1), info.get("budget", {})
            shm = info.get("slots", 0) * info.get("slot_bytes", 0)
            infos.append(
                HostInfo(
                    h, f"sidecar {address}", max(1, workers), workers > 0, budget.get("cpus"), budget.get("source"),
                    info.get("slots"), shm, info.get("workers_chosen", ""), bool(info.get("remote_workers", False)),
                )
            )
        return infos
