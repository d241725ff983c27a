"""`cd.RayWorkers` against a real local Ray cluster (`ray.cluster_utils.Cluster`: a head and
worker nodes, each its own raylet): the batches of local workers on every backend and host
count, resume, an actor killed and a node removed mid-stream (every record once), and an
unreachable cluster named in seconds."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import psutil
import pytest
from pipelines import backend_of, make_pipeline, until_workers_made

import colo_data as cd
from colo_data.host.resources import workers_from
from colo_data.testing import assert_batches_equal, read_all, to_numpy

ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="Ray is not installed (pip install 'colo-data[ray]')")

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray actors cannot import this test module


def slow(batch: dict) -> dict:
    """A chunk takes 0.1 s more wherever it is computed: actors beside the host's thread pay."""
    time.sleep(0.1)
    return batch


@pytest.fixture(scope="module")
def cluster() -> Iterator[ray_cluster_utils.Cluster]:
    """A head and one worker node, 2 logical CPUs each."""
    cluster = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    yield cluster
    cluster.shutdown()


def pipeline_of(corpus: Path, *transforms) -> cd.Pipeline:
    return make_pipeline(corpus, "block", epochs=None, transforms=[*transforms, cd.pad_or_truncate("tokens", 8)])


def actor_processes() -> list[psutil.Process]:
    """The processes of the Ray actors that compute chunks (their title names the class)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "ChunkActor" in " ".join(process.info["cmdline"] or ()):
            found.append(process)
    return found


@pytest.mark.parametrize(("backend", "hosts"), [("inprocess", 1), ("inprocess", 3), ("sidecar", 2)])
def test_ray_workers_make_the_batches_of_local_ones(
    cluster: ray_cluster_utils.Cluster, token_corpus: Path, tmp_path: Path, backend: str, hosts: int
) -> None:
    ray = cd.RayWorkers(address=cluster.address, actors=2, num_cpus=0.25)
    options = {"shm_dir": str(tmp_path)} if backend == "sidecar" else {}
    chosen = cd.Sidecar(workers=ray, **options) if backend == "sidecar" else cd.InProcess(workers=ray)
    with cd.Loader(pipeline_of(token_corpus, slow), hosts=hosts, backend=chosen) as loader:
        got = until_workers_made(loader)
        got += [to_numpy(next(loader)) for _ in range(100)]
        hosts_seen = loader.telemetry().hosts
    assert all("Ray actor" in h.workers_chosen for h in hosts_seen), [h.workers_chosen for h in hosts_seen]
    want = read_all(cd.Loader(pipeline_of(token_corpus), hosts=hosts, backend=backend_of(backend, 0, tmp_path)), len(got))
    assert_batches_equal(want, got, f"Ray workers vs none, {backend}, {hosts} hosts")


def test_ray_workers_resume_from_a_state(cluster: ray_cluster_utils.Cluster, token_corpus: Path) -> None:
    ray = cd.RayWorkers(address=cluster.address, actors=2, num_cpus=0.25)
    pipeline = pipeline_of(token_corpus, slow)
    with cd.Loader(pipeline, hosts=2, backend=cd.InProcess(workers=ray)) as loader:
        until_workers_made(loader)
        state = loader.get_state()
    resumed = read_all(cd.Loader(pipeline, hosts=2, backend=cd.InProcess(workers=ray), state=state), 60)
    want = read_all(cd.Loader(pipeline_of(token_corpus), hosts=2, state=state), 60)
    assert_batches_equal(want, resumed, "resumed with Ray workers")


def test_actors_killed_mid_stream_lose_and_repeat_no_record(
    cluster: ray_cluster_utils.Cluster, token_corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGKILL of the actors' processes while they compute: their shares in flight are
    computed again here (Ray restarts them, and they set the stream up again with their next
    share), and the stream is the one of no workers, record for record."""
    ray = cd.RayWorkers(address=cluster.address, actors=2, num_cpus=0.25)
    with cd.Loader(pipeline_of(token_corpus, slow), hosts=1, backend=cd.InProcess(workers=ray)) as loader:
        got = until_workers_made(loader)
        victims = actor_processes()
        assert victims, "no Ray actor process found"
        for victim in victims:
            os.kill(victim.pid, signal.SIGKILL)
        got += [to_numpy(next(loader)) for _ in range(300)]
    assert "its share is computed here" in caplog.text, "no share of a killed actor was computed again"
    want = read_all(cd.Loader(pipeline_of(token_corpus), hosts=1), len(got))
    assert_batches_equal(want, got, "actors killed mid-stream")


def test_a_node_removed_mid_stream_loses_and_repeats_no_record(
    cluster: ray_cluster_utils.Cluster, token_corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The node that runs every actor goes away: their shares are computed here (Ray cannot
    place them again: no other node has the resource they ask for), and the stream is the
    one of no workers."""
    node = cluster.add_node(num_cpus=2, resources={"doomed": 1})
    ray = cd.RayWorkers(address=cluster.address, actors=2, num_cpus=0.25, resources={"doomed": 0.1})
    with cd.Loader(pipeline_of(token_corpus, slow), hosts=1, backend=cd.InProcess(workers=ray)) as loader:
        got = until_workers_made(loader)
        cluster.remove_node(node)
        got += [to_numpy(next(loader)) for _ in range(300)]
    assert "its share is computed here" in caplog.text, "no share of the removed node's actors was computed again"
    want = read_all(cd.Loader(pipeline_of(token_corpus), hosts=1), len(got))
    assert_batches_equal(want, got, "a node removed mid-stream")


def test_a_module_the_actors_cannot_import_is_named(cluster: ray_cluster_utils.Cluster, token_corpus: Path, tmp_path: Path) -> None:
    """A pipeline function of a module that only this process can import (its directory is
    on this process's path, not the actors'): the loader raises what the actor met, naming
    the module, the actor and the fix."""
    (tmp_path / "only_here.py").write_text("def same(batch):\n    return batch\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import only_here

        ray = cd.RayWorkers(address=cluster.address, actors=1, num_cpus=0.25)
        with cd.Loader(pipeline_of(token_corpus, slow, only_here.same), hosts=1, backend=cd.InProcess(workers=ray)) as loader:
            with pytest.raises(cd.TransformError, match=r"(?s)No module named 'only_here'.*py_modules.*Ray actor 0 of host 0"):
                until_workers_made(loader)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("only_here", None)


def test_an_unreachable_cluster_is_named_within_30_s(token_corpus: Path) -> None:
    started = time.monotonic()
    ray = cd.RayWorkers(address="127.0.0.1:9", connect_timeout=3)  # the discard port: nothing listens
    with pytest.raises(cd.RayClusterError, match=r"127\.0\.0\.1:9.*cannot reach the Ray cluster"):
        cd.Loader(pipeline_of(token_corpus), hosts=1, backend=cd.InProcess(workers=ray))
    assert time.monotonic() - started < 30, "the unreachable cluster took longer than 30 s to name"


def test_ray_workers_options_are_checked_and_read_back() -> None:
    ray = cd.RayWorkers(address="ray://head:10001", actors=4, num_cpus=0.5, resources={"pre": 1})
    assert workers_from(ray.to_spec(), "--workers") == ray
    assert workers_from({"ray": "auto", "actors": 3}, "[sidecar] workers") == cd.RayWorkers(actors=3)
    assert workers_from("ray", "--workers") == cd.RayWorkers()
    assert cd.InProcess(workers=ray).workers is ray
    for bad, match in [
        (dict(actors=0), r"actors=0.*int >= 1"),
        (dict(num_cpus=-1), r"num_cpus=-1.*> 0"),
        (dict(resources={"pre": "one"}), r"resources=.*amounts > 0"),
        (dict(address=""), r"address=''"),
    ]:
        with pytest.raises(cd.ConfigError, match=match):
            cd.RayWorkers(**bad)
    with pytest.raises(cd.ConfigError, match=r"--workers = 'ray:\{\"actor\": 2\}'.*unknown RayWorkers option"):
        workers_from('ray:{"actor": 2}', "--workers")
    with pytest.raises(cd.ConfigError, match=r"workers = 'many'.*\"auto\", or Ray workers"):
        workers_from("many", "[sidecar] workers")
