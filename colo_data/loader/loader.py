"""`Loader`: the controller-side iterator. It drives one host pipeline per host, assembles
their pieces into global `jax.Array`s sharded over the mesh, prefetches, and keeps the
global position that `get_state()` saves and `set_state()` restores."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from time import perf_counter
from typing import Any, Literal

import jax
import numpy as np
import pathwaysutils
from jax.sharding import Mesh, PartitionSpec

from colo_data.backends.colocated import ColocatedHosts, colocated_hosts
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.backends.sidecar.local import LocalSidecar
from colo_data.errors import ConfigError, TransformError
from colo_data.host.packing import STREAM_END
from colo_data.host.pipeline import HostBatch, HostPipeline
from colo_data.loader.meters import LoaderMeters
from colo_data.loader.placement import Placement
from colo_data.runtime.prefetch import Prefetcher
from colo_data.spec.pipeline import Pipeline
from colo_data.spec.state import make_state, restore_position
from colo_data.telemetry.counters import HANDOFF, StepClock
from colo_data.telemetry.export import TelemetryExport
from colo_data.telemetry.export import start as start_exporters
from colo_data.telemetry.report import StepTrace, Telemetry

Backend = Literal["inprocess", "sidecar", "colocated", "auto"]
_BACKENDS = ("inprocess", "sidecar", "colocated", "auto")
SIDECAR_ENV = "COLO_DATA_SIDECAR"


def resolve_backend(backend: Backend, sidecar: str | Sequence[str] | None) -> Backend:
    """`auto`: `colocated` on Pathways, `sidecar` when a sidecar address is configured
    (`sidecar=` or `COLO_DATA_SIDECAR`), else `inprocess`; any other value as given."""
    if backend != "auto":
        return backend
    if bool(pathwaysutils.is_pathways_backend_used()):  # None when JAX_PLATFORMS is unset
        return "colocated"
    return "sidecar" if sidecar or os.environ.get(SIDECAR_ENV) else "inprocess"


class Loader:
    """Iterate global batches (`dict[str, jax.Array]`, leading dimension the global batch
    size) of `pipeline`. `hosts` is the host count (default: the JAX process count; in one
    process, a larger count simulates hosts); each process computes only the hosts whose
    rows its devices hold. `backend="inprocess"` runs those host pipelines here, with
    `workers` processes each (default 0); `backend="sidecar"` has a sidecar process per
    local host run them (`sidecar` or `COLO_DATA_SIDECAR`, comma-separated: one address per
    local host, else local sidecars are started, with `workers` each, default from their
    CPU budget) and reads batches from their shared-memory ring (`shm_dir`, `slots`);
    `backend="colocated"` runs them in the Pathways colocated-Python sidecars of the hosts
    (one host per CPU device colocated with the mesh); `backend="auto"` picks colocated on
    Pathways, sidecar when an address is configured, else inprocess. `mesh`/`partition_spec`
    place the batch (default: every device on one `"data"` axis, batch dimension sharded
    over it). `telemetry()` says how long the trainer waits for input and where the
    pipeline's time goes; its first `warmup` steps are kept apart from the steady state;
    `telemetry_export` also writes it as JSON lines and/or serves Prometheus metrics."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        backend: Backend = "inprocess",
        hosts: int | None = None,
        workers: int | None = None,
        sidecar: str | Sequence[str] | None = None,
        shm_dir: str = "/dev/shm",
        slots: int = 4,
        mesh: Mesh | None = None,
        partition_spec: PartitionSpec | None = None,
        state: dict[str, Any] | None = None,
        prefetch: int = 2,
        warmup: int = 3,
        telemetry_export: TelemetryExport | None = None,
    ) -> None:
        if not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"warmup={warmup!r}: must be an int >= 0 (first steps kept apart from the steady state)")
        clock = StepClock(warmup)  # first: the start-up is counted from here
        if backend not in _BACKENDS:
            raise ConfigError(f"backend={backend!r}: allowed values are {', '.join(_BACKENDS)}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch={prefetch!r}: must be an int >= 0 (global batches prepared ahead)")
        if telemetry_export is not None and not isinstance(telemetry_export, TelemetryExport):
            raise ConfigError(f"telemetry_export={telemetry_export!r}: give a cd.TelemetryExport(...) or None")
        self.pipeline = pipeline
        self.options: dict[str, Any] = {
            "backend": backend, "hosts": hosts, "workers": workers, "sidecar": sidecar, "shm_dir": shm_dir,
            "slots": slots, "partition_spec": partition_spec, "prefetch": prefetch, "warmup": warmup,
            "telemetry_export": telemetry_export,
        }  # what `colo_data.elastic.rebuild` passes on to the loader that replaces this one
        if sidecar is None and os.environ.get(SIDECAR_ENV) and backend in ("sidecar", "auto"):
            sidecar = os.environ[SIDECAR_ENV].split(",")
        self.backend = resolve_backend(backend, sidecar)
        if self.backend == "colocated":
            if pipeline.pack is not None:
                raise ConfigError("pack: packed pipelines run on the inprocess and sidecar backends, not yet colocated")
            pathwaysutils.initialize()  # a no-op off Pathways
        self.mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("data",))
        self.partition_spec = partition_spec if partition_spec is not None else PartitionSpec(self.mesh.axis_names[0])
        self.hosts = self._host_count(hosts)
        self.placement = Placement(self.mesh, self.partition_spec, pipeline.global_batch_size, self.hosts)
        local = self.placement.local_hosts
        self._host_pipelines = [HostPipeline(pipeline, h, self.hosts, workers or 0, ahead=prefetch > 0) for h in local]
        addresses = [sidecar] if isinstance(sidecar, str) else list(sidecar or [])
        if addresses and (self.backend != "sidecar" or len(addresses) != len(local)):
            raise ConfigError(
                f"sidecar={sidecar!r}: give backend='sidecar' and one address per host of this process "
                f"({len(local)}: hosts {local} of {self.hosts})"
            )
        self._addresses = addresses
        self._sidecar_settings = (shm_dir, workers, slots)
        self._local_sidecars: list[LocalSidecar] = []
        # JAX's CPU backend keeps page-aligned host memory instead of copying it (even with
        # may_alias=False), and a shared-memory slot is rewritten once released: there the
        # trainer copies each slot out (once per slot, not per batch) and releases it at once
        self._copy = self.backend == "sidecar" and any(d.platform == "cpu" for d in self.mesh.devices.flat)
        self._prefetch = prefetch
        self._position = 0 if state is None else restore_position(pipeline, state)
        self._iterator: Iterator[tuple[dict[str, jax.Array], int | None]] | None = None
        self._prefetcher: Prefetcher | None = None
        self._meters = LoaderMeters(clock, self.backend, self._host_pipelines, local, workers or 0, prefetch)
        self._export = telemetry_export
        self._exporters: list[Any] = []
        self._colocated = ColocatedHosts(pipeline, self.mesh, workers or 0) if self.backend == "colocated" else None
        if self.backend == "sidecar" and not addresses:  # started last and now: they load while the trainer compiles
            self._local_sidecars = [LocalSidecar(shm_dir, workers, slots) for _ in local]

    def _host_count(self, hosts: int | None) -> int:
        """The JAX process count (multi-controller), or for `colocated` the CPU devices
        colocated with the mesh, one per host; `hosts` overrides the former."""
        if self.backend != "colocated":
            return jax.process_count() if hosts is None else hosts
        found = len(colocated_hosts(self.mesh))
        if hosts is not None and hosts != found:
            raise ConfigError(
                f"hosts={hosts}: backend='colocated' has one host per CPU device colocated with the mesh "
                f"({found}); leave hosts unset"
            )
        return found

    def _global_batches(self, streams: list[Iterator[HostBatch]]) -> Iterator[tuple[dict[str, jax.Array], int | None]]:
        """Global batches, each with the stream position after it when the hosts say it
        (packed batches), else None."""
        local = self.placement.local_hosts
        cpu, handoff, nbytes = self._meters.cpu, self._meters.handoff, 0
        rows = self.pipeline.global_batch_size * len(local) // self.hosts
        try:
            if cpu is not None:
                cpu.take()
            for pieces in zip(*streams):
                start = perf_counter()
                ends = {int(p.pop(STREAM_END)[0]) for p in pieces if STREAM_END in p}
                if len(ends) > 1:
                    raise TransformError(f"the hosts {local} planned different packed batches (ending at {sorted(ends)})")
                batch = self.placement.assemble(dict(zip(local, pieces)))
                if self.backend == "sidecar" and not self._copy:  # slots are rewritten once the next pieces are asked for
                    jax.block_until_ready(batch)
                done = perf_counter()
                nbytes = nbytes or sum(a.nbytes for p in pieces for a in p.values())  # the same for every batch
                handoff.add(HANDOFF, done - start, rows, nbytes)
                if cpu is not None:
                    cpu.maybe_sample(done)
                yield batch, ends.pop() if ends else None
        finally:
            if cpu is not None:
                cpu.take()
            for it in streams:
                it.close()

    def _host_streams(self) -> list[Iterator[HostBatch]]:
        if self.backend == "inprocess":
            return [h.batches(self._position) for h in self._host_pipelines]
        if not self._addresses and not self._local_sidecars:  # closed, then iterated again
            self._local_sidecars = [LocalSidecar(*self._sidecar_settings) for _ in self.placement.local_hosts]
        targets = [(a, None) for a in self._addresses] or [(s.address, s.process.pid) for s in self._local_sidecars]
        clients = self._meters.clients = [SidecarClient(address, pid) for address, pid in targets]
        return [
            c.batches(self.pipeline, h, self.hosts, self._position, self._copy)
            for h, c in zip(self.placement.local_hosts, clients, strict=True)
        ]

    def _placed(self, batches: Iterator[dict[str, jax.Array]]) -> Iterator[tuple[dict[str, jax.Array], None]]:
        """Colocated batches, moved from the hosts' CPU devices onto the mesh."""
        rows = self.pipeline.global_batch_size
        try:
            for batch in batches:
                start = perf_counter()
                placed = jax.device_put(batch, {name: self.placement.sharding(a.ndim) for name, a in batch.items()})
                self._meters.handoff.add(HANDOFF, perf_counter() - start, rows, 0)
                yield placed, None
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _start(self) -> Iterator[tuple[dict[str, jax.Array], int | None]]:
        if self._export is not None and not self._exporters:
            self._exporters = start_exporters(self._export, self.telemetry)
        self._meters.start()
        if self._colocated is not None:
            batches = self._placed(self._colocated.batches(self._position))
        else:
            batches = self._global_batches(self._host_streams())
        self._prefetcher = Prefetcher(batches, self._prefetch) if self._prefetch else None
        return self._prefetcher or batches

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        start = perf_counter()
        if self._iterator is None:  # (re)starting counts as input wait: connecting to sidecars, starting workers
            self._iterator = self._start()
        depth = self._prefetcher.depth() if self._prefetcher is not None else 0
        batch, end = next(self._iterator)
        done = perf_counter()
        records = self.pipeline.global_batch_size if end is None else end - self._position
        self._position += records
        self._meters.step(start, done, records, depth, batch)
        return batch

    def telemetry(self) -> Telemetry:
        """Input wait, throughput, per-stage times, worker CPU, queue depth and a verdict
        naming the bottleneck (see `cd.Telemetry`); cheap enough to call every few seconds."""
        return self._meters.telemetry()

    def step_trace(self) -> StepTrace:
        """Each kept step's call time, input wait and records (for plots)."""
        return StepTrace.of(self._meters.clock)

    @property
    def prometheus_port(self) -> int | None:
        """The port the Prometheus exporter listens on, once started (first batch)."""
        ports = [e.port for e in self._exporters if hasattr(e, "port")]
        return ports[0] if ports else None

    def get_state(self) -> dict[str, Any]:
        """The global position as a small JSON-serialisable dict, the same for any host or
        worker count; give it to `set_state` or `Loader(..., state=)` to continue."""
        return make_state(self.pipeline, self._position)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the next batch is the one that followed it."""
        position = restore_position(self.pipeline, state)
        self._stop()
        self._position = position

    def _stop(self) -> None:
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
            self._prefetcher = None
            self._meters.fold()

    def close(self) -> None:
        """Stop prefetching, the worker processes and the sidecars this loader started.
        The loader can be restarted by iterating again or by `set_state`."""
        self._stop()
        if self._colocated is not None:
            self._colocated.close()
        for local in self._local_sidecars:
            local.stop()
        self._local_sidecars = []
        for exporter in self._exporters:
            exporter.close()
        self._exporters = []

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

