"""`Loader`: the controller-side iterator. It drives one host pipeline per host, assembles
their pieces into global `jax.Array`s sharded over the mesh, prefetches, and keeps the
global position that `get_state()` saves and `set_state()` restores."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from colo_data.errors import ConfigError, TransformError
from colo_data.host import HostBatch, HostPipeline
from colo_data.pipeline import Pipeline
from colo_data.prefetch import Prefetcher
from colo_data.sidecar.client import SidecarClient
from colo_data.sidecar.local import LocalSidecar
from colo_data.state import make_state, restore_position

Backend = Literal["inprocess", "sidecar"]
_BACKENDS = ("inprocess", "sidecar")


def _rows_for(parts: Sequence[np.ndarray], per_host: int, index: tuple[slice, ...]) -> np.ndarray:
    """The block of the global array at `index`, cut from the host pieces without
    concatenating them unless the block spans hosts."""
    start, stop, _ = index[0].indices(per_host * len(parts))
    first, last = start // per_host, (stop - 1) // per_host
    if first == last:
        block = parts[first][start - first * per_host : stop - first * per_host]
    else:
        block = np.concatenate(parts[first : last + 1])[start - first * per_host : stop - first * per_host]
    return block[(slice(None), *index[1:])]


def _batch_shards(mesh: Mesh, spec: PartitionSpec) -> int:
    axes = spec[0] if len(spec) else None
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in names]))


class Loader:
    """Iterate global batches (`dict[str, jax.Array]`, leading dimension the global batch
    size) of `pipeline`. `hosts` simulates or names the host count (default: the JAX
    process count). `backend="inprocess"` runs the host pipelines here, with `workers`
    processes each (default 0); `backend="sidecar"` has a sidecar process per host run
    them (`sidecar`: one address per host, else local sidecars are started, with `workers`
    each, default from their CPU budget) and reads batches from their shared-memory ring
    (`shm_dir`, `slots`). `mesh`/`partition_spec` place the batch (default: every device
    on one `"data"` axis, batch dimension sharded over it)."""

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
    ) -> None:
        if backend not in _BACKENDS:
            raise ConfigError(f"backend={backend!r}: allowed values are {', '.join(_BACKENDS)}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch={prefetch!r}: must be an int >= 0 (global batches prepared ahead)")
        self.pipeline = pipeline
        self.backend = backend
        self.hosts = jax.process_count() if hosts is None else hosts
        self._host_pipelines = [HostPipeline(pipeline, h, self.hosts, workers or 0) for h in range(self.hosts)]
        addresses = [sidecar] if isinstance(sidecar, str) else list(sidecar or [])
        if addresses and (backend != "sidecar" or len(addresses) != self.hosts):
            raise ConfigError(
                f"sidecar={sidecar!r}: give one address per host ({self.hosts}) and backend='sidecar'"
            )
        self._addresses = addresses
        self._sidecar_settings = (shm_dir, workers, slots)
        self._local_sidecars: list[LocalSidecar] = []
        self.mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("data",))
        # JAX's CPU backend keeps page-aligned host memory instead of copying it (even with
        # may_alias=False), and a shared-memory slot is rewritten once released: there the
        # trainer copies each slot out (once per slot, not per batch) and releases it at once
        self._copy = backend == "sidecar" and any(d.platform == "cpu" for d in self.mesh.devices.flat)
        self.partition_spec = partition_spec if partition_spec is not None else PartitionSpec(self.mesh.axis_names[0])
        shards = _batch_shards(self.mesh, self.partition_spec)
        if pipeline.global_batch_size % shards:
            raise ConfigError(
                f"global_batch_size={pipeline.global_batch_size} is not divisible by the {shards} shards of the batch "
                f"dimension (partition_spec={self.partition_spec}, mesh {dict(self.mesh.shape)}): use a multiple of {shards}"
            )
        self._prefetch = prefetch
        self._shardings: dict[int, NamedSharding] = {}
        self._position = 0 if state is None else restore_position(pipeline, state)
        self._iterator: Prefetcher[dict[str, jax.Array]] | Iterator[dict[str, jax.Array]] | None = None
        if backend == "sidecar" and not addresses:  # started last and now: they load while the trainer compiles
            self._local_sidecars = [LocalSidecar(shm_dir, workers, slots) for _ in range(self.hosts)]

    def _sharding(self, ndim: int) -> NamedSharding:
        if ndim not in self._shardings:
            self._shardings[ndim] = NamedSharding(self.mesh, PartitionSpec(*tuple(self.partition_spec)[:ndim]))
        return self._shardings[ndim]

    def _assemble(self, pieces: tuple[HostBatch, ...]) -> dict[str, jax.Array]:
        per_host = self.pipeline.global_batch_size // self.hosts
        out = {}
        for name, first in pieces[0].items():
            parts = [p.get(name) for p in pieces]
            for h, part in enumerate(parts):
                if part is None or part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
                    got = "no such column" if part is None else f"{part.dtype}{list(part.shape)}"
                    raise TransformError(
                        f"column {name!r}: host 0 made {first.dtype}{list(first.shape)}, host {h} made {got}; "
                        "transforms must give every host the same columns, dtypes and trailing shapes"
                    )
            shape = (self.pipeline.global_batch_size, *first.shape[1:])
            out[name] = jax.make_array_from_callback(
                shape, self._sharding(len(shape)), functools.partial(_rows_for, parts, per_host)
            )
        return out

    def _global_batches(self, hosts: list[Iterator[HostBatch]]) -> Iterator[dict[str, jax.Array]]:
        try:
            for pieces in zip(*hosts):
                batch = self._assemble(pieces)
                if self.backend == "sidecar" and not self._copy:  # slots are rewritten once the next pieces are asked for
                    jax.block_until_ready(batch)
                yield batch
        finally:
            for it in hosts:
                it.close()

    def _host_streams(self) -> list[Iterator[HostBatch]]:
        if self.backend == "inprocess":
            return [h.batches(self._position) for h in self._host_pipelines]
        if not self._addresses and not self._local_sidecars:  # closed, then iterated again
            self._local_sidecars = [LocalSidecar(*self._sidecar_settings) for _ in range(self.hosts)]
        targets = [(a, None) for a in self._addresses] or [(s.address, s.process.pid) for s in self._local_sidecars]
        clients = [SidecarClient(address, pid) for address, pid in targets]
        return [c.batches(self.pipeline, h, self.hosts, self._position, self._copy) for h, c in enumerate(clients)]

    def _start(self) -> Iterator[dict[str, jax.Array]]:
        batches = self._global_batches(self._host_streams())
        return Prefetcher(batches, self._prefetch) if self._prefetch else batches

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._iterator is None:
            self._iterator = self._start()
        batch = next(self._iterator)
        self._position += self.pipeline.global_batch_size
        return batch

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

    def close(self) -> None:
        """Stop prefetching, the worker processes and the sidecars this loader started.
        The loader can be restarted by iterating again or by `set_state`."""
        self._stop()
        for local in self._local_sidecars:
            local.stop()
        self._local_sidecars = []

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
