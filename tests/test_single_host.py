"""One host of many, alone in a process (`cd.Loader(pipeline, hosts=H, host=h)`): its batches
are host h's rows of the global batches, computed by that host's pipeline only, on the in-process
and sidecar backends; what it cannot do is a clear error."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import colo_data as cd
from colo_data.testing import assert_batches_equal, read_all

from pipelines import BATCH, backend_of, make_pipeline



def one_device() -> Mesh:
    """A mesh of one device, for a host whose rows the 4 test devices do not divide."""
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def rows_of(batches: list[dict[str, np.ndarray]], host: int, hosts: int) -> list[dict[str, np.ndarray]]:
    per_host = BATCH // hosts
    return [{k: v[host * per_host : (host + 1) * per_host] for k, v in b.items()} for b in batches]


def test_each_host_alone_gives_its_rows_of_the_global_batches(token_corpus: Path) -> None:
    """A padded pipeline and an endless packed one (which chooses 12 partitions: 3 hosts
    of 4 own theirs, hosts of 8 share some)."""
    padded = make_pipeline(token_corpus)
    packed = make_pipeline(token_corpus, transforms=[], pack=cd.Pack("tokens", 16), epochs=None)
    for pipeline, hosts in ((padded, 4), (packed, 4), (packed, 3)):
        whole = read_all(cd.Loader(pipeline), 6)
        for host in range(hosts):
            with cd.Loader(pipeline, hosts=hosts, host=host, mesh=one_device()) as loader:
                alone = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(6)]
                assert alone[0]["_index"].shape[0] == BATCH // hosts
                assert loader.backend.name == "inprocess" and len(loader.placement.local_hosts) == 1
            assert_batches_equal(rows_of(whole, host, hosts), alone, f"host {host} of {hosts}")


def test_one_host_through_its_sidecar(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[], pack=cd.Pack("tokens", 16), epochs=None)
    whole = read_all(cd.Loader(pipeline), 4)
    with cd.Loader(pipeline, hosts=4, host=2, mesh=one_device(), backend=backend_of("sidecar")) as loader:
        alone = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(4)]
    assert_batches_equal(rows_of(whole, 2, 4), alone, "host 2 of 4 through its sidecar")


def test_a_padded_hosts_state_resumes_the_whole_stream(token_corpus: Path) -> None:
    """A padded pipeline's position is global: the state of one host alone is the job's."""
    pipeline = make_pipeline(token_corpus)
    whole = read_all(cd.Loader(pipeline), 5)
    with cd.Loader(pipeline, hosts=2, host=1, mesh=one_device()) as loader:
        next(loader), next(loader)
        state = loader.get_state()
    assert_batches_equal(whole[2:], read_all(cd.Loader(pipeline, state=state), 3), "resumed on one host")


def test_what_one_host_alone_cannot_do(token_corpus: Path) -> None:
    packed = make_pipeline(token_corpus, transforms=[], pack=cd.Pack("tokens", 16), epochs=None)
    with cd.Loader(packed, hosts=4, host=1, mesh=one_device()) as loader:
        next(loader)
        with pytest.raises(cd.errors.StateError, match=r"host 1 alone .*partitioned.*Save the state from a loader of every host"):
            loader.get_state()
    with pytest.raises(cd.errors.ConfigError, match=r"host=4: there are 4 hosts \(0 to 3\)"):
        cd.Loader(packed, hosts=4, host=4)
    with pytest.raises(cd.errors.ConfigError, match=r"host=-1"):
        cd.Loader(packed, hosts=4, host=-1)
    with pytest.raises(cd.errors.ConfigError, match=r"host=0\) with the colocated backend"):
        cd.Loader(packed, hosts=1, host=0, mesh=one_device(), backend="colocated")
    with pytest.raises(cd.errors.ConfigError, match=r"host 0's rows .*=3 is not divisible by the 4 shards"):
        cd.Loader(packed, hosts=4, host=0)  # the default mesh: the 4 test devices
