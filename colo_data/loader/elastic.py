"""Elastic resume: rebuild the mesh from the devices still there and the loader from a
saved state. The stream continues exactly, on any device or host count and with another
global batch size where it divides, because the state is a record position. The glue to
`pathwaysutils.elastic.Manager` is its two attributes, `slice_to_devices` and
`active_slice_indices`; see docs/multi-host.md, "Elastic resume", for the whole loop."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from colo_data.errors import ConfigError
from colo_data.loader.loader import Loader


def active_mesh(slice_to_devices: Mapping[int, Sequence[jax.Device]], active: Collection[int], like: Mesh) -> Mesh:
    """A mesh like `like` (same axis names and sizes, but the first axis, the data axis,
    resized) over the devices of the `active` slices, slice by slice in index order."""
    missing = sorted(set(active) - set(slice_to_devices))
    if missing or not active:
        raise ConfigError(f"active slices {sorted(active)}: no devices known for {missing or 'an empty set'}")
    devices = [d for s in sorted(active) for d in slice_to_devices[s]]
    rest = like.devices.shape[1:]
    per_row = int(np.prod(rest))
    if len(devices) % per_row:
        raise ConfigError(
            f"{len(devices)} devices in the active slices cannot fill a mesh {dict(like.shape)} with axis "
            f"{like.axis_names[0]!r} resized: a multiple of {per_row} devices is needed"
        )
    return Mesh(np.array(devices).reshape(-1, *rest), like.axis_names)


def rebuild(
    loader: Loader, mesh: Mesh, *, state: dict[str, Any] | None = None, global_batch_size: int | None = None
) -> Loader:
    """Return a loader like `loader` on `mesh`, continuing from `state` (default: where
    `loader` stands) with `global_batch_size` (default: the same), as one made from that
    state at that size; then close `loader`. Where the new loader cannot be made, its error
    is raised and `loader` is left open, where it stood."""
    state = loader.get_state() if state is None else state
    pipeline = loader.pipeline
    if global_batch_size is not None:
        pipeline = pipeline.with_global_batch_size(global_batch_size)
    rebuilt = Loader(pipeline, mesh=mesh, state=state, **loader.options)
    loader.close()
    return rebuilt
