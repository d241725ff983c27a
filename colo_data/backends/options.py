"""The backends a `Loader` can use, as small frozen option objects: `InProcess`, `Sidecar` and
`Colocated`. Each validates its settings once, when it is made, and knows how to count
its hosts and start its transport (whose module is imported only then). `auto_backend()` picks
one from the environment, and `resolve` turns the names users write ("sidecar") into
objects: it is the one place where a backend's name is looked at."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from colo_data import defaults
from colo_data.errors import ConfigError
from colo_data.setting_checks import as_int
from colo_data.workers.settings import Workers, check_workers

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from colo_data.backends.base import Transport
    from colo_data.backends.placement import Placement
    from colo_data.pipeline.kinds import AnyPipeline
    from colo_data.runtime.lifecycle import Lifecycle

SIDECAR_ENV = "COLO_DATA_SIDECAR"  # comma-separated sidecar addresses, one per local host


@runtime_checkable
class BackendOptions(Protocol):
    """A backend as a `Loader` takes it: where the hosts' pipelines run. A new backend is
    one class with these members (and its transport, a `Transport`)."""

    name: ClassVar[str]
    # where it sends the pipeline, pickled, to run each host's share, in words (None: the trainer runs them)
    ships_to: ClassVar[str | None]

    @property
    def workers(self) -> Workers:
        """Worker processes per host, or "auto"."""
        ...

    def host_count(self, mesh: Mesh, requested: int | None) -> int:
        """The number of hosts that share each global batch, given the mesh and the Loader's
        `hosts` (None: the backend's own count)."""
        ...

    def start(self, pipeline: AnyPipeline, placement: Placement, prefetch: int, owner: Lifecycle) -> Transport:
        """The transport for `pipeline` on `placement`; whatever it starts belongs to
        `owner`. `prefetch` is the Loader's (global batches it keeps ready)."""
        ...


def _process_hosts(requested: int | None) -> int:
    """One host per JAX process (multi-controller), or the count a test simulates."""
    import jax

    return jax.process_count() if requested is None else requested


@dataclass(frozen=True)
class InProcess:
    """Each local host's pipeline runs in the trainer process: on a thread of its own (a
    chunk ahead), and in worker processes where they pay. For tests, notebooks, debugging,
    and single-host training where the trainer has CPU to spare.

    Args:
        workers: the most worker processes per host ("auto": from the CPU budget and the
            memory); how many work at a time, the worker policy counts from what a record
            costs and how fast the trainer takes them (docs/workers.md); 0: the host's own
            thread computes every batch.
    """

    workers: Workers = "auto"
    name: ClassVar[str] = "inprocess"
    ships_to: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", check_workers("InProcess", self.workers))

    def host_count(self, mesh: Mesh, requested: int | None) -> int:
        return _process_hosts(requested)

    def start(self, pipeline: AnyPipeline, placement: Placement, prefetch: int, owner: Lifecycle) -> Transport:
        from colo_data.backends.inprocess import InProcessTransport

        return InProcessTransport(pipeline, placement, self.workers, prefetch > 0, owner)


@dataclass(frozen=True)
class Sidecar:
    """A sidecar process per local host runs that host's pipeline and writes its batches
    into a shared-memory ring, which the trainer maps.

    Args:
        address: the sidecars' socket addresses (`unix:///run/colo/host0.sock` or a path),
            one per host of this process; None: those in `COLO_DATA_SIDECAR`
            (comma-separated), else sidecars are started here, one per local host.
        shm_dir: where the sidecars started here put their ring.
        slots: slots of their rings (how far a sidecar runs ahead of the trainer).
        timeout: seconds a sidecar may send nothing while the trainer waits before it
            counts as frozen (a `SidecarError`); a sidecar sends a heartbeat every second
            while it works, so a batch that takes longer than this is not an error.
        workers: worker processes of the sidecars started here; "auto" lets each pick from
            its CPU budget. A sidecar given by address has its own settings.
    """

    address: str | Sequence[str] | None = None
    shm_dir: str = defaults.SHM_DIR
    slots: int = defaults.SLOTS
    timeout: float = defaults.SIDECAR_TIMEOUT_S
    workers: Workers = "auto"
    name: ClassVar[str] = "sidecar"
    ships_to: ClassVar[str | None] = "its sidecar process"

    def __post_init__(self) -> None:
        address = self.address
        if address is not None:
            addresses = (address,) if isinstance(address, str) else tuple(address)
            if not addresses or not all(isinstance(a, str) and a for a in addresses):
                raise ConfigError(
                    f"Sidecar(address={address!r}): give a socket address (unix:///run/colo/host0.sock or a path), "
                    "one per host of this process, or None"
                )
            object.__setattr__(self, "address", addresses)
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise ConfigError(f"Sidecar(shm_dir={self.shm_dir!r}): give a directory path (a string)")
        slots = as_int(self.slots)
        if slots is None or slots < 2:
            raise ConfigError(f"Sidecar(slots={self.slots!r}): a sidecar's ring needs at least 2 slots (one read, one written)")
        object.__setattr__(self, "slots", slots)
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 2 * defaults.HEARTBEAT_S:
            raise ConfigError(
                f"Sidecar(timeout={timeout!r}): must be a number of seconds >= {2 * defaults.HEARTBEAT_S:g} "
                f"(twice the sidecar's heartbeat period; default {defaults.SIDECAR_TIMEOUT_S:g})"
            )
        object.__setattr__(self, "workers", check_workers("Sidecar", self.workers))

    def addresses(self) -> tuple[str, ...]:
        """The sidecars' addresses: given, else from `COLO_DATA_SIDECAR`; empty: start them here."""
        if self.address is not None:
            return tuple(self.address)
        listed = os.environ.get(SIDECAR_ENV, "")
        return tuple(a.strip() for a in listed.split(",") if a.strip())

    def host_count(self, mesh: Mesh, requested: int | None) -> int:
        return _process_hosts(requested)

    def start(self, pipeline: AnyPipeline, placement: Placement, prefetch: int, owner: Lifecycle) -> Transport:
        from colo_data.backends.sidecar.transport import SidecarTransport

        local = placement.local_hosts
        addresses = self.addresses()
        if addresses and len(addresses) != len(local):
            where = "Sidecar(address=...)" if self.address is not None else f"{SIDECAR_ENV}={os.environ.get(SIDECAR_ENV)!r}"
            raise ConfigError(
                f"{where}: {len(addresses)} address(es), but this process computes {len(local)} host(s) "
                f"({local} of {placement.hosts}): give one address per host"
            )
        copy = any(d.platform == "cpu" for d in placement.mesh.devices.flat)
        settings = (self.shm_dir, self.workers, self.slots)
        return SidecarTransport(pipeline, placement, addresses, settings, self.timeout, copy, owner)


@dataclass(frozen=True)
class Colocated:
    """Each host's pipeline runs in its Pathways colocated-Python sidecar (single-controller
    JAX on Cloud TPU): one host per CPU device colocated with the mesh. On a CPU-only JAX
    the same calls run in this process.

    Args:
        workers: worker processes per host in its sidecar (0: the sidecar's own process;
            "auto": from the sidecar's CPU budget).
    """

    workers: Workers = 0
    name: ClassVar[str] = "colocated"
    ships_to: ClassVar[str | None] = "the colocated-Python sidecars"

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", check_workers("Colocated", self.workers))

    def host_count(self, mesh: Mesh, requested: int | None) -> int:
        from colo_data.backends.colocated import colocated_hosts

        found = len(colocated_hosts(mesh))
        if requested is not None and requested != found:
            raise ConfigError(
                f"hosts={requested}: the colocated backend has one host per CPU device colocated with the mesh "
                f"({found}); leave hosts unset"
            )
        return found

    def start(self, pipeline: AnyPipeline, placement: Placement, prefetch: int, owner: Lifecycle) -> Transport:
        import pathwaysutils

        from colo_data.backends.colocated import ColocatedTransport

        if placement.only is not None:
            raise ConfigError(
                f"Loader(host={placement.only}) with the colocated backend: its hosts are the mesh's colocated CPU "
                "devices, which run together; run one host alone with backend='inprocess' or 'sidecar'"
            )
        pathwaysutils.initialize()  # a no-op off Pathways
        return ColocatedTransport(pipeline, placement, self.workers, owner)


def on_pathways() -> bool:
    """Whether JAX runs on Pathways (a single controller with colocated-Python sidecars)."""
    import pathwaysutils  # its server parts are heavy: only when a backend is chosen

    return bool(pathwaysutils.is_pathways_backend_used())  # None when JAX_PLATFORMS is unset


def auto_backend() -> BackendOptions:
    """The backend for this environment: `Colocated` on Pathways, `Sidecar` when sidecar
    addresses are configured (`COLO_DATA_SIDECAR`), else `InProcess`."""
    if on_pathways():
        return Colocated()
    return Sidecar() if Sidecar().addresses() else InProcess()


_NAMES: dict[str, Callable[[], BackendOptions]] = {
    "inprocess": InProcess, "sidecar": Sidecar, "colocated": Colocated, "auto": auto_backend
}
NAMES = tuple(_NAMES)  # the names `resolve` reads: a command line's choices


def resolve(backend: str | BackendOptions) -> BackendOptions:
    """A backend option object: `backend` itself, or the one its name stands for with
    default settings ("auto": `auto_backend()`)."""
    if isinstance(backend, str) and backend in _NAMES:
        return _NAMES[backend]()
    if isinstance(backend, BackendOptions) and not isinstance(backend, type):
        return backend
    raise ConfigError(
        f"backend={backend!r}: give cd.InProcess(...), cd.Sidecar(...) or cd.Colocated(...), "
        f"or one of the names {', '.join(map(repr, _NAMES))}"
    )


def with_sidecar_settings(backend: BackendOptions, settings: Mapping[str, Any]) -> BackendOptions:
    """`backend` with a config's `[sidecar]` settings where it starts its sidecars here (a
    `Sidecar` given no addresses), else as it is: a config's pipeline run as its sidecar
    would run it (`colo-data bench`)."""
    if isinstance(backend, Sidecar) and not backend.addresses():
        return dataclasses.replace(backend, **settings)
    return backend
