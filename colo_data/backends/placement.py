"""`Placement`: where the rows of a global batch go. From the mesh and the partition spec it
knows which hosts' rows the devices of this process hold (so a process computes only
those hosts' pieces), and it builds each global `jax.Array` from those pieces, one block
per addressable device. The same code serves one process simulating many hosts and one
process per host under `jax.distributed`.

The blocks go to the devices through `jax.make_array_from_callback`, which transfers them
in one batched call, where a `jax.device_put` of the blocks followed by
`jax.make_array_from_single_device_arrays` makes a call a block."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from colo_data.errors import ConfigError, TransformError
from colo_data.host.chunk import HostBatch
from colo_data.pipeline import parts
from colo_data.pipeline.order import Partitioning, host_rows

Index = tuple[slice, ...]


def batch_shards(mesh: Mesh, spec: PartitionSpec) -> int:
    """How many ways the batch dimension is split: the product of the mesh axes that the
    spec's first entry names (1 when it names none: every device holds the whole batch)."""
    axes = spec[0] if len(spec) else None
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in names]))


class Placement:
    """Host pieces -> global arrays for `mesh`/`spec`, `hosts` hosts of `global_batch_size`
    rows. `local_hosts` lists the hosts whose rows this process's devices hold;
    `partitioning`, a partitioned packed or filtered pipeline's partitions (None for
    others), which partitions each host's position covers. With `only`, this process runs
    that one host and its batches are that host's rows alone (`batch_rows` of them), on
    the whole mesh: one host of a large job, run alone."""

    def __init__(
        self,
        mesh: Mesh,
        spec: PartitionSpec,
        global_batch_size: int,
        hosts: int,
        partitioning: Partitioning | None = None,
        only: int | None = None,
    ) -> None:
        host_rows(global_batch_size, 0 if only is None else only, hosts)  # checks the host, and that hosts divide the batch
        self.mesh, self.spec = mesh, spec
        self.global_batch_size, self.hosts, self.partitioning, self.only = global_batch_size, hosts, partitioning, only
        self.per_host = global_batch_size // hosts
        self.batch_rows = global_batch_size if only is None else self.per_host
        shards = batch_shards(mesh, spec)
        if self.batch_rows % shards:
            what = "global_batch_size" if only is None else f"host {only}'s rows (global_batch_size / hosts)"
            raise ConfigError(
                f"{what}={self.batch_rows} is not divisible by the {shards} shards of the batch "
                f"dimension (partition_spec={spec}, mesh {dict(mesh.shape)}): use a multiple of {shards}"
            )
        self._shardings: dict[int, NamedSharding] = {}
        if only is not None:
            self.local_hosts = [only]
            return
        needed: set[int] = set()
        for index in self.sharding(1).addressable_devices_indices_map((global_batch_size,)).values():
            # jax types the values `Index | None`, but they come from `devices_indices_map`: never None
            start, stop, _ = index[0].indices(global_batch_size)
            needed.update(range(start // self.per_host, -(-stop // self.per_host)))
        self.local_hosts = sorted(needed)
        if not self.local_hosts:
            raise ConfigError(
                f"process {jax.process_index()} holds no device of the mesh {dict(mesh.shape)} (its devices: "
                f"{jax.local_devices()}): build the Loader on a mesh that includes this process's devices, "
                "or do not build one in this process"
            )

    def local_partitions(self) -> np.ndarray | None:
        """For a partitioned packed or filtered pipeline, which entries of its position
        (`colo_data.pipeline.parts`) this process's hosts know: the phase and their partitions'
        (a mask); None for other pipelines."""
        if self.partitioning is None:
            return None
        mask = np.zeros(1 + self.partitioning.partitions, bool)
        mask[0] = True
        for host in self.local_hosts:
            owned = self.partitioning.owned(host, self.hosts)
            mask[1 + owned.start : 1 + owned.stop] = True
        return mask

    def ends(self, pieces: Mapping[int, np.ndarray]) -> np.ndarray:
        """A partitioned pipeline's position after a batch, from the local hosts' shares of
        it (host -> `[phase, its partitions' own positions]`): -1 for the partitions of
        other processes' hosts."""
        assert self.partitioning is not None  # only a partitioned pipeline's hosts end with own positions
        phase = int(next(iter(pieces.values()))[0])
        firsts = {self.partitioning.owned(host, self.hosts).start: end[1:] for host, end in pieces.items()}
        return parts.joined(phase, firsts, self.partitioning.partitions)

    def sharding(self, ndim: int) -> NamedSharding:
        """The sharding of an `ndim`-dimensional column: the spec, cut to `ndim` entries."""
        if ndim not in self._shardings:
            self._shardings[ndim] = NamedSharding(self.mesh, PartitionSpec(*tuple(self.spec)[:ndim]))
        return self._shardings[ndim]

    def _rows(self, parts: Mapping[int, np.ndarray], index: Index) -> np.ndarray:
        """The block at `index`, cut from the local host pieces; concatenated only when the
        block spans hosts."""
        if self.only is not None:
            return parts[self.only][index]
        start, stop, _ = index[0].indices(self.global_batch_size)
        first, last = start // self.per_host, (stop - 1) // self.per_host
        offset = start - first * self.per_host
        if first == last:
            block = parts[first][offset : offset + stop - start]
        else:
            block = np.concatenate([parts[h] for h in range(first, last + 1)])[offset : offset + stop - start]
        return block[(slice(None), *index[1:])]

    def assemble(self, pieces: Mapping[int, HostBatch]) -> dict[str, jax.Array]:
        """The global batch from the pieces of the local hosts (host -> its rows), whose
        64-bit columns have been through `jax_columns` (a check per chunk, not per batch)."""
        out: dict[str, jax.Array] = {}
        reference_host = self.local_hosts[0]
        for name, first in pieces[reference_host].items():
            parts: dict[int, np.ndarray] = {}
            for h in self.local_hosts:
                part = pieces[h].get(name)
                if part is None or part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
                    got = "no such column" if part is None else f"{part.dtype}{list(part.shape)}"
                    raise TransformError(
                        f"column {name!r}: host {reference_host} made {first.dtype}{list(first.shape)}, host {h} made "
                        f"{got}; transforms must give every host the same columns, dtypes and trailing shapes"
                    )
                parts[h] = part
            shape = (self.batch_rows, *first.shape[1:])
            out[name] = jax.make_array_from_callback(shape, self.sharding(len(shape)), functools.partial(self._rows, parts))
        return out
