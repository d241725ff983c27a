"""Elastic resume on real meshes: lose half of a 4-device mesh mid-epoch, rebuild the mesh
from the slices still there and the loader from its state, and finish the epoch with every
record once; also with another global batch size."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import colo_data as cd
from colo_data.host.host_pipeline import HostPipeline
from colo_data.loader.elastic import active_mesh, rebuild
from colo_data.testing import assert_batches_equal, read_all, to_numpy

from pipelines import BATCH, make_pipeline

RECORDS = 120


def slices() -> dict[int, list[jax.Device]]:
    """The 4 test devices as 2 slices of 2, as pathwaysutils.elastic.Manager.slice_to_devices."""
    devices = jax.devices()
    return {0: devices[:2], 1: devices[2:]}


def indices(batches: list[dict[str, np.ndarray]]) -> list[int]:
    return [int(i) for b in batches for i in b["_index"]]


@pytest.mark.parametrize("shuffle", ["block", "global"])
@pytest.mark.parametrize("lose", [0, 1])
def test_lose_a_slice_and_finish_the_epoch(token_corpus: Path, shuffle: str, lose: int) -> None:
    pipeline = make_pipeline(token_corpus, shuffle)
    full = Mesh(np.array(jax.devices()), ("data",))
    k = 4
    loader = cd.Loader(pipeline, mesh=full)
    before = [to_numpy(next(loader)) for _ in range(k)]
    state = loader.get_state()
    mesh = active_mesh(slices(), {0, 1} - {lose}, like=full)
    assert list(mesh.devices.flat) == slices()[1 - lose] and mesh.axis_names == ("data",)
    loader = rebuild(loader, mesh)
    first = next(loader)
    assert all(a.sharding.device_set == set(mesh.devices.flat) for a in first.values())
    after = [to_numpy(first), *read_all(loader)]
    assert sorted(indices(before + after)) == list(range(RECORDS)), "every record exactly once"
    fresh = read_all(cd.Loader(pipeline, mesh=mesh, state=state))
    assert_batches_equal(fresh, after, "rebuilt loader vs a 2-device loader from the same state")
    assert_batches_equal(read_all(cd.Loader(pipeline))[k:], after, "the uninterrupted run's tail")


def test_rebuild_a_data_by_model_mesh(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    full = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    spec = PartitionSpec("data")
    with cd.Loader(pipeline, mesh=full, partition_spec=spec) as loader:
        next(loader)
        state = loader.get_state()
    mesh = active_mesh(slices(), {1}, like=full)
    assert mesh.shape == {"data": 1, "model": 2}
    rebuilt = read_all(cd.Loader(pipeline, mesh=mesh, partition_spec=spec, state=state))
    assert_batches_equal(read_all(cd.Loader(pipeline))[1:], rebuilt, "data x model mesh rebuilt on one slice")
    with pytest.raises(cd.errors.ConfigError, match=r"3 devices in the active slices cannot fill a mesh.*multiple of 2"):
        active_mesh({0: jax.devices()[:3]}, {0}, like=full)
    with pytest.raises(cd.errors.ConfigError, match=r"no devices known for \[5\]"):
        active_mesh(slices(), {0, 5}, like=full)


@pytest.mark.parametrize("new_batch, dropped", [(6, 0), (4, 0), (24, 12)])
def test_another_global_batch_size_keeps_exactly_once(token_corpus: Path, new_batch: int, dropped: int) -> None:
    """The position is a record count: a new batch size continues the same stream. Records
    of a trailing partial batch are dropped at the end of the stream, as always."""
    pipeline = make_pipeline(token_corpus, "global")
    loader = cd.Loader(pipeline)
    before = [to_numpy(next(loader)) for _ in range(3)]  # 36 records
    state = loader.get_state()
    mesh = active_mesh(slices(), {0}, like=loader.mesh)
    loader = rebuild(loader, mesh, global_batch_size=new_batch)
    after = read_all(loader)
    assert {b["tokens"].shape[0] for b in after} == {new_batch}
    seen = indices(before + after)
    assert len(seen) == len(set(seen)) == RECORDS - dropped
    stream = np.concatenate([b["_index"] for b in read_all(cd.Loader(pipeline))] + [np.zeros(0, np.int64)])
    reference = HostPipeline(pipeline).indices_at(np.arange(RECORDS // BATCH * BATCH))
    np.testing.assert_array_equal(stream, reference)
    np.testing.assert_array_equal(np.array(seen), reference[: RECORDS - dropped], "same records, same order")
    assert loader.get_state()["global_batch_size"] == new_batch
