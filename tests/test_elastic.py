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


def one_device_slices() -> dict[int, list[jax.Device]]:
    """The 4 test devices as 4 slices of 1: a mesh of 4 can lose a slice twice."""
    return {i: [d] for i, d in enumerate(jax.devices())}


def rows_of(batches: list[dict[str, np.ndarray]], partitions: int) -> list[list[int]]:
    """Each partition's records, batch after batch (partition k is rows [k*R, (k+1)*R))."""
    own: list[list[int]] = [[] for _ in range(partitions)]
    for batch in batches:
        for k, rows in enumerate(np.split(np.asarray(batch["_index"]), partitions)):
            own[k].extend(rows.tolist())
    return own


def delivered(state: dict) -> int:
    """A padded state's global position: records delivered since the stream's start."""
    return state["epoch"] * RECORDS + state["position"]


def test_rebuild_twice_at_smaller_batches_continues_as_a_fresh_loader(token_corpus: Path) -> None:
    """Issue 80, item 4: an endless padded pipeline that chooses its partitions (16 at
    batches of 64) runs on 4 devices at 64, loses a slice (rebuilt on 3 at 48: its partitions
    turn from 128 % 48 = 32), then another (on 2 at 32, where an origin of 32 is no position
    of a batch), then a third (on 1 at 16). The second rebuild raised a ConfigError about
    `partition_origin` after closing the loader; every rebuild must give, row for row, what
    a loader made fresh from the same state at that size gives, and each partition's
    records go on as one uninterrupted run at 64 reads them."""
    pipeline = make_pipeline(token_corpus, epochs=None, global_batch_size=64)
    assert pipeline.partitioning.partitions == 16
    active = set(one_device_slices())
    loader = cd.Loader(pipeline, mesh=Mesh(np.array(jax.devices()), ("data",)))
    full = loader.mesh
    got = [to_numpy(next(loader)) for _ in range(2)]
    for lost, size, steps in [(0, 48, 1), (1, 32, 2), (2, 16, 3)]:
        active -= {lost}
        mesh = active_mesh(one_device_slices(), active, like=full)
        state = loader.get_state()
        old = loader
        loader = rebuild(loader, mesh, global_batch_size=size)
        with pytest.raises(cd.errors.LoaderClosedError):
            next(old)
        assert loader.mesh is mesh and loader.pipeline.partition_origin == delivered(state) % size
        after = [to_numpy(next(loader)) for _ in range(steps)]
        assert {b["_index"].shape[0] for b in after} == {size}
        smaller = make_pipeline(token_corpus, epochs=None, global_batch_size=size)
        fresh = read_all(cd.Loader(smaller, mesh=mesh, state=state), steps)
        assert_batches_equal(fresh, after, f"rebuilt at {size} vs a loader from the same state at {size}")
        got += after
    assert delivered(loader.get_state()) == 2 * 64 + 48 + 2 * 32 + 3 * 16
    loader.close()
    straight = rows_of(read_all(cd.Loader(pipeline), 5), 16)
    assert rows_of(got, 16) == [own[: len(mine)] for own, mine in zip(straight, rows_of(got, 16), strict=True)]
    assert all(len(mine) == 18 for mine in rows_of(got, 16)), "each partition took 4 + 3 + 2*2 + 3*1 records"


def test_a_rebuild_that_fails_leaves_the_old_loader_open(token_corpus: Path) -> None:
    """A rebuild whose new loader cannot be made (a batch size the state's 16 partitions do
    not divide, before and after a first rebuild; a state of another pipeline) raises that
    error and leaves the old loader open: it reads on where it stood, and a later rebuild
    from it continues as a loader made fresh from its state."""
    pipeline = make_pipeline(token_corpus, epochs=None, global_batch_size=64)
    other = make_pipeline(token_corpus, epochs=None, global_batch_size=64, order=cd.Order(shuffle="block", seed=8, window=2))
    with cd.Loader(other) as loader:
        next(loader)
        foreign = loader.get_state()
    expected = read_all(cd.Loader(pipeline), 5)
    loader = cd.Loader(pipeline)
    got = [to_numpy(next(loader))]
    with pytest.raises(cd.errors.StateError, match=r"saved with 16 partitions .* do not divide global_batch_size=40"):
        rebuild(loader, loader.mesh, global_batch_size=40)
    got.append(to_numpy(next(loader)))
    loader = rebuild(loader, loader.mesh, global_batch_size=48)  # restored: its partitions turn from 128 % 48 = 32
    mesh = active_mesh(one_device_slices(), {1, 2}, like=loader.mesh)
    with pytest.raises(cd.errors.ConfigError, match=r"global_batch_size=40: .* 16 partitions .* give a batch size that 16"):
        rebuild(loader, mesh, global_batch_size=40)
    with pytest.raises(cd.errors.StateError, match="saved from a different pipeline"):
        rebuild(loader, mesh, state=foreign)
    got.append(to_numpy(next(loader)))
    assert [len(b["_index"]) for b in got] == [64, 64, 48]
    assert rows_of(got, 16) == [own[: 4 + 4 + 3] for own in rows_of(expected, 16)], "the old loader read on where it stood"
    state = loader.get_state()
    loader = rebuild(loader, mesh, global_batch_size=32)
    smaller = make_pipeline(token_corpus, epochs=None, global_batch_size=32)
    fresh = read_all(cd.Loader(smaller, mesh=mesh, state=state), 2)
    assert_batches_equal(fresh, read_all(loader, 2), "then a rebuild works")
