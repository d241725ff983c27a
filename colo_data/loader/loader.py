"""`Loader`: the controller-side iterator. A thin façade over a `_Runner`: it picks one
backend (in-process, sidecar, colocated), prefetches its global batches, keeps the global
position that `get_state()` saves and `set_state()` restores, and owns, through one
`Lifecycle`, every thread, process and socket it starts: they stop on `close()`, when the
loader becomes unreachable, and at interpreter exit."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from time import monotonic, perf_counter
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from colo_data.backends.base import GlobalBatch, Transport
from colo_data.backends.options import BackendOptions, resolve
from colo_data.backends.placement import Placement
from colo_data.errors import ConfigError, LoaderBusyError, LoaderClosedError, StateError
from colo_data.host.dtypes import check_index_column
from colo_data.loader.meters import LoaderMeters
from colo_data.loader.picklable import check_picklable
from colo_data.pipeline import parts
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.order import Position
from colo_data.pipeline.state import make_state, restore, state_step
from colo_data.runtime.lifecycle import DEFAULT_TIMEOUT_S, Lifecycle
from colo_data.runtime.prefetch import Prefetcher, close_iterator
from colo_data.setting_checks import int_setting
from colo_data.telemetry.counters import StepClock
from colo_data.telemetry.export import TelemetryExport
from colo_data.telemetry.export import start as start_exporters
from colo_data.telemetry.report import StepTrace, Telemetry, with_mixture


def _end_batches(batches: Iterator[GlobalBatch], timeout: float) -> None:
    """End the batches read on the consumer's thread (no prefetch), running their
    `finally` blocks now; when the consumer is inside them (a close from another thread),
    the run's other parts end them."""
    try:
        close_iterator(batches)
    except ValueError:
        pass


def all_host_states(local: dict[int, Any], pipeline: AnyPipeline) -> dict[int, Any]:
    """Every host's Grain state: this process's hosts' (`local`) with, in a
    multi-controller run, every other process's (gathered from all of them: each calls
    `get_state` at the same step, as it saves a checkpoint). Native pipelines have none."""
    if pipeline.host_states() is None or jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-controller runs only

    data = np.frombuffer(json.dumps({str(h): s for h, s in local.items()}).encode(), np.uint8)
    longest = int(np.max(multihost_utils.process_allgather(np.array([len(data)], np.int64))))
    padded = np.zeros(longest, np.uint8)
    padded[: len(data)] = data
    everyone: dict[int, Any] = {}
    for row in np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, longest):
        everyone.update({int(h): s for h, s in json.loads(row.tobytes().rstrip(b"\0")).items()})
    return everyone


def all_parts(position: Position, local: np.ndarray | None) -> Position:
    """A partitioned pipeline's own positions of every partition: in a multi-controller run
    each process knows its own hosts' partitions (`local`), so they are gathered from all of
    them (each calls `get_state` at the same step, as it saves a checkpoint). Other
    positions are returned as they are."""
    if not isinstance(position, np.ndarray) or local is None or jax.process_count() == 1:
        return position
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-controller runs only

    known = np.where(local, position, -1)  # the others' partitions: theirs to say (all know the phase)
    return np.asarray(multihost_utils.process_allgather(known)).reshape(-1, len(position)).max(axis=0)


def _closer(part: Any) -> Callable[[float], None]:
    """A lifecycle stop for a part whose `close()` takes no timeout (it stops at once)."""
    return lambda timeout: part.close()


class _Runner:
    """The loader's state, apart from the `Loader` object so that nothing it starts (the
    prefetch thread, exporters) keeps the `Loader` reachable: when the user drops the
    loader, its finalizer closes this."""

    def __init__(
        self,
        pipeline: AnyPipeline,
        transport: Transport,
        owner: Lifecycle,
        meters: LoaderMeters,
        prefetch: int,
        position: Position,
        step: int | None,
    ) -> None:
        self.pipeline, self.transport, self.owner, self.meters = pipeline, transport, owner, meters
        self.prefetch = prefetch
        self.position = position
        self.step = step  # global batches delivered since the stream's start (None: not known)
        # a Grain pipeline's host states at the last batch delivered (where it starts, at first)
        self.host_states: dict[int, Any] = pipeline.host_states() or {}
        self.first = position  # where this loader (or its last set_state) started
        self.run: Lifecycle | None = None
        self.batches: Iterator[GlobalBatch] | None = None
        self.prefetcher: Prefetcher[GlobalBatch] | None = None
        self.export: TelemetryExport | None = None
        self.exporters: list[Any] = []
        self._reading = threading.Lock()  # held by the thread inside `next()` or `set_state()`
        self._holder = "next()"  # which of the two holds it
        self.closing = False  # `close()` has begun, maybe on another thread than a waiting `next()`

    def start(self) -> None:
        """Start a run at the current position: the transport's batches, prefetched."""
        if self.export is not None and not self.exporters:
            self.exporters = start_exporters(self.export, self.telemetry)
            for exporter in self.exporters:
                self.owner.add(f"telemetry exporter {type(exporter).__name__}", _closer(exporter))
        self.meters.start()
        self.run = self.owner.child("run")
        batches = self.transport.open(self.position, self.run)
        if self.prefetch:
            self.prefetcher = Prefetcher(batches, self.prefetch, self.run)
        else:  # read on the consumer's thread: the run ends it (also at exit, not at the interpreter's teardown)
            self.run.add("the batches", functools.partial(_end_batches, batches))
        self.batches = self.prefetcher or batches

    def telemetry(self) -> Telemetry:
        """The meters' telemetry, with a mixture's records per component since `first` and
        their shares against the weights."""
        telemetry = self.meters.telemetry()
        mixture = self.pipeline.mixture_records(self.first, self.position)
        return telemetry if mixture is None else with_mixture(telemetry, *mixture)

    def next(self) -> GlobalBatch:
        """The next batch. Another thread's `next()` in progress is a LoaderBusyError; a
        `set_state()` in progress is waited for (the batch then follows the new state)."""
        if not self._reading.acquire(blocking=False) and not (self._holder == "set_state()" and self._reading.acquire()):
            raise LoaderBusyError(
                "another thread is in next() on this Loader: a loader feeds one consumer; read it from one "
                "thread and hand the batches on (a queue.Queue) to the others"
            )
        try:
            return self._next()
        finally:
            self._reading.release()

    @contextlib.contextmanager
    def jumping(self) -> Iterator[None]:
        """Hold the loader for `set_state`: a LoaderBusyError while another thread is in
        `next()`, whose batches a jump would end under it."""
        if not self._reading.acquire(blocking=False):
            raise LoaderBusyError(
                "set_state while another thread is in next() on this Loader: the waiting batch belongs to the old "
                "position. Call set_state from the thread that reads the loader, between batches (or after that "
                "next() returns); the next batch is then the one after the state"
            )
        self._holder = "set_state()"
        try:
            yield
        finally:
            self._holder = "next()"
            self._reading.release()

    def _next(self) -> GlobalBatch:
        start = perf_counter()
        if self.batches is None:  # (re)starting counts as input wait: connecting to sidecars, starting workers
            # (closing: a close from another thread has ended the run and not yet its sessions, which a restart
            # would reach for: a batch taken just before the close must not start another run)
            if self.owner.state == "closed" or self.closing:
                raise LoaderClosedError(
                    "this Loader was closed: make a new one to go on, e.g. "
                    "cd.Loader(pipeline, state=loader.get_state(), ...)"
                )
            self.start()
        assert self.batches is not None
        depth = self.prefetcher.depth() if self.prefetcher is not None else 0
        try:
            batch = next(self.batches)
        except BaseException as e:
            if self.closing:  # what stopped the batches was the close, whatever their own error says
                raise LoaderClosedError(
                    "the Loader was closed (by another thread) while next() waited for a batch"
                ) from e
            raise
        done = perf_counter()
        end, records = batch.end, self.pipeline.global_batch_size
        if isinstance(end, np.ndarray):  # a partitioned pipeline's position (-1: partitions of other processes)
            assert isinstance(self.position, np.ndarray)
            self.position, records = parts.advance(self.position, end)
        elif end is not None:
            records = end - int(self.position)
            self.position = end
        else:
            self.position = int(self.position) + records
        if self.step is not None:
            self.step += 1
        if batch.states is not None:
            self.host_states.update(batch.states)
        self.meters.step(start, done, records, depth, batch.arrays)
        return batch

    def stop(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
        """End the current run (its threads, processes and sessions); the loader can start
        another. Returns what did not stop within `timeout` seconds."""
        late: list[str] = []
        if self.run is not None:
            late = self.run.close(timeout)
            self.transport.run_ended()
        self.run, self.batches, self.prefetcher = None, None, None
        return late

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
        """Stop the run and everything else the loader started, within `timeout` seconds in
        all; final."""
        self.closing = True
        deadline = monotonic() + timeout
        late = self.stop(timeout)
        return late + self.owner.close(max(0.0, deadline - monotonic()))


class Loader:
    """Iterate global batches (`dict[str, jax.Array]`, leading dimension the global batch
    size) of a pipeline, each host's share computed where the backend runs it.

    `next()` after `close()` raises `LoaderClosedError`: a closed loader's threads,
    processes and sidecar sessions are gone; make a new loader from its `get_state()` to
    go on (`set_state` restarts a loader that is still open).

    Args:
        pipeline: the dataset definition.
        backend: where the hosts' pipelines run: `cd.InProcess(...)` (in this process),
            `cd.Sidecar(...)` (a sidecar process per local host, batches in shared memory)
            or `cd.Colocated(...)` (the Pathways colocated-Python sidecars of the hosts),
            or one of their names, "inprocess", "sidecar", "colocated", for their default
            settings; "auto" picks colocated on Pathways, sidecar when sidecar addresses
            are configured (`COLO_DATA_SIDECAR`), else inprocess.
        hosts: the host count (default: the JAX process count; in one process, a larger
            count simulates hosts; colocated: one host per CPU device colocated with the
            mesh). Each process computes only the hosts whose rows its devices hold.
        host: run host `host` of `hosts` alone in this process: each batch is that host's
            rows of the global batch (`global_batch_size / hosts` of them) on the mesh, and
            this process does that host's work only (one host of a large job, to measure or
            debug it). None: the hosts of the mesh, as above. Not with the colocated backend;
            `get_state()` of a partitioned packed or filtered pipeline needs every host's
            positions, so it is a `StateError` there.
        mesh: where batches are placed (default: every device on one `"data"` axis).
        partition_spec: how the batch is sharded (default: the batch dimension over the
            mesh's first axis).
        state: a `get_state()` to continue from.
        prefetch: global batches prepared ahead on a background thread (0: none).
        warmup: first steps kept apart from the steady state in `telemetry()`.
        telemetry_export: also write telemetry as JSON lines and/or serve Prometheus metrics.
    """

    def __init__(
        self,
        pipeline: AnyPipeline,
        *,
        backend: str | BackendOptions = "inprocess",
        hosts: int | None = None,
        host: int | None = None,
        mesh: Mesh | None = None,
        partition_spec: PartitionSpec | None = None,
        state: dict[str, Any] | None = None,
        prefetch: int = 2,
        warmup: int = 3,
        telemetry_export: TelemetryExport | None = None,
    ) -> None:
        warmup = int_setting("warmup", warmup, 0, "first steps kept apart from the steady state")
        clock = StepClock(warmup)  # first: the start-up is counted from here
        prefetch = int_setting("prefetch", prefetch, 0, "global batches prepared ahead")
        if hosts is not None:
            hosts = int_setting("hosts", hosts, 1, "host pipelines that share each global batch; None: the backend's own")
        if telemetry_export is not None and not isinstance(telemetry_export, TelemetryExport):
            raise ConfigError(f"telemetry_export={telemetry_export!r}: give a cd.telemetry.TelemetryExport(...) or None")
        if not isinstance(pipeline, AnyPipeline):
            raise ConfigError(f"pipeline={pipeline!r}: give a cd.Pipeline or a cd.GrainPipeline")
        self.backend: BackendOptions = resolve(backend)
        self.options: dict[str, Any] = {
            "backend": self.backend, "hosts": hosts, "host": host, "partition_spec": partition_spec, "prefetch": prefetch,
            "warmup": warmup, "telemetry_export": telemetry_export,
        }  # what `colo_data.elastic.rebuild` passes on to the loader that replaces this one
        self.mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("data",))
        self.partition_spec = partition_spec if partition_spec is not None else PartitionSpec(self.mesh.axis_names[0])
        self.hosts = self.backend.host_count(self.mesh, hosts)
        if host is not None:
            host = int_setting("host", host, 0, "the one host this process runs alone")
            if host >= self.hosts:
                raise ConfigError(f"host={host}: there are {self.hosts} hosts (0 to {self.hosts - 1}); give hosts= too")
        pipeline, position = (pipeline, pipeline.at(0)) if state is None else restore(pipeline, state, self.hosts)
        step = state_step(pipeline, state, position)
        self.pipeline = pipeline
        check_index_column(pipeline, x64=jax.enable_x64.value)
        self.backend = check_picklable(pipeline, self.backend)
        pipeline.check_run(self.hosts, jax.process_count())
        self.placement = Placement(
            self.mesh, self.partition_spec, pipeline.global_batch_size, self.hosts, pipeline.position_partitioning, host
        )
        owner = Lifecycle(f"Loader(backend={self.backend.name!r})")
        parts = owner.child("transport")  # what the transport starts: replaced with it (set_state of a Grain pipeline)
        try:
            transport = self.backend.start(pipeline, self.placement, prefetch, parts)
        except BaseException:
            owner.close()
            raise
        meters = LoaderMeters(clock, transport, prefetch)
        self._runner = _Runner(pipeline, transport, owner, meters, prefetch, position, step)
        self._runner.export = telemetry_export
        self._transport_parts = parts
        # Not a method of self: the finalizer must not keep the loader alive. `atexit=False`:
        # the lifecycle's own exit hook runs first, before JAX's.
        self._finalizer = weakref.finalize(self, self._runner.close)
        self._finalizer.atexit = False

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return self._runner.next().arrays

    def telemetry(self) -> Telemetry:
        """Input wait, throughput, per-stage times, worker CPU, queue depth and a verdict
        naming the bottleneck (see `cd.telemetry.Telemetry`); cheap enough to call every few seconds."""
        return self._runner.telemetry()

    def step_trace(self) -> StepTrace:
        """Each kept step's call time, input wait and records (for plots)."""
        return StepTrace.of(self._runner.meters.clock)

    @property
    def prometheus_port(self) -> int | None:
        """The port the Prometheus exporter listens on, once started (first batch)."""
        ports = [e.port for e in self._runner.exporters if hasattr(e, "port")]
        return ports[0] if ports else None

    def get_state(self) -> dict[str, Any]:
        """The global position as a small JSON-serialisable dict, the same for any host or
        worker count, with the global batches delivered since the stream's start (`step`,
        which `cd.lineage` counts by); give it to `set_state` or `Loader(..., state=)` to
        continue. For a
        `cd.GrainPipeline`, every host's Grain state at the last batch delivered (in a
        multi-controller run every process must call it at the same step: the states are
        gathered from all of them; so for a partitioned packed or filtered pipeline, whose
        position is one per partition, each process knowing its own hosts')."""
        runner = self._runner
        if self.placement.only is not None and self.placement.partitioning is not None:
            raise StateError(
                f"get_state of a loader of host {self.placement.only} alone (Loader(host=...)) of a partitioned packed or "
                "filtered pipeline: its state is a position per partition, and this loader knows only its own "
                "partitions'. Save the state from a loader of every host"
            )
        position = all_parts(runner.position, self.placement.local_partitions())
        host_states = all_host_states(runner.host_states, self.pipeline)
        return make_state(self.pipeline, position, self.hosts, host_states, runner.step)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the next batch is the one that followed it.

        Args:
            state: what `get_state()` returned (also from another host or worker count).
        """
        rebased, position = restore(self.pipeline, state, self.hosts)
        step = state_step(rebased, state, position)
        if not rebased.continues(self.pipeline):
            raise StateError(
                "set_state: this state continues another stream than this loader's (a mixture under other weights or "
                "from another interleaving, other partitions, or partitions saved at another batch size); make a new "
                "loader for it: cd.Loader(pipeline, state=state, ...)"
            )
        runner = self._runner
        if runner.owner.state == "closed":
            raise LoaderClosedError("set_state on a closed Loader: make a new one with cd.Loader(pipeline, state=state, ...)")
        with runner.jumping():
            runner.stop()
            runner.position = runner.first = position
            runner.step = step
            host_states = rebased.host_states()
            if host_states is not None:  # its hosts start from the states the pipeline carries: a new transport
                self._transport_parts.close()
                self._transport_parts = runner.owner.child("transport")
                self.pipeline = runner.pipeline = rebased
                transport = self.backend.start(rebased, self.placement, runner.prefetch, self._transport_parts)
                runner.transport = transport
                runner.meters.replace_transport(transport)
                runner.host_states = host_states

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Stop prefetching, the worker processes, the sidecar sessions and the sidecars
        this loader started, within `timeout` seconds in all; a second call does nothing.
        Telemetry stays readable.

        Args:
            timeout: seconds for everything to stop; what is still running then is named
                in a RuntimeWarning and left to finish on its own.
        """
        self._finalizer.detach()
        late = self._runner.close(timeout)
        if late:
            warnings.warn(f"Loader.close: still running after {timeout:g} s: {', '.join(late)}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_numpy(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """A global batch (what a `Loader` yields) with every `jax.Array` copied to host memory."""
    return {name: np.asarray(array) for name, array in batch.items()}
