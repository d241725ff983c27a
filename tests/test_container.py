"""The sidecar image in real containers (podman with runc; see `container.py`): the doctor
reads the container's CPU quota, not the machine's CPU count; a ring too big for the
container's /dev/shm stops it at start with the shared-memory message; a containerised
sidecar serves a trainer on the host through a mounted socket directory and shared-memory
directory, with the in-process backend's batches, and its health check says so; with Ray
workers in its config, it computes its chunks on a Ray cluster on the host, through Ray
Client."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from container import SidecarImage, sidecar_image
from pipelines import until_workers_made
from ray_head import head_node, ray_port
from start_gate import demo_config, tmpfs

import colo_data as cd
from colo_data import demo
from colo_data.testing import assert_batches_equal, read_all, to_numpy

HEALTH = ("python", "/usr/local/lib/colo-data/healthcheck.py")


@pytest.fixture(scope="session")
def image() -> SidecarImage:
    return sidecar_image()  # built on a thread since the session started; removed at its end


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny demo corpus, mounted read-only into the containers at the same path."""
    return demo.write_corpus(
        tmp_path_factory.mktemp("container-corpus"), files=2, rows_per_file=40, row_group_size=8, min_tokens=1, max_tokens=12
    )


@pytest.fixture
def shm_mount(tmp_path: Path) -> Iterator[Path]:
    """A 64 MB host tmpfs, as a trainer host would mount for its sidecar."""
    with tmpfs(tmp_path / "shm", "64m") as mount:
        yield mount


def configs(tmp_path: Path) -> Path:
    directory = tmp_path / "configs"
    directory.mkdir()
    return directory


def same_path(path: Path, mode: str = "rw") -> tuple[str, str]:
    """Mount `path` at the same path inside: the trainer and the sidecar exchange paths
    (the shm dir, the data) and must agree on them."""
    return "-v", f"{path}:{path}:{mode}"


def test_doctor_in_a_half_cpu_container_counts_the_quota_not_the_machine(image: SidecarImage) -> None:
    result = image.podman.run(
        image.tag,
        "-c",
        "nproc; colo-data doctor --json",
        options=["--cpus=0.5", "--shm-size=64m", "--entrypoint", "sh"],
    )
    assert result.returncode == 0, result.stderr
    nproc, _, report = result.stdout.partition("\n")
    doctor = json.loads(report)
    assert int(nproc) == len(os.sched_getaffinity(0)) >= 2, "nproc inside sees the machine's CPUs"
    assert doctor["cpu"]["cpus"] == 0.5 and doctor["cpu"]["quota"] == 0.5, doctor["cpu"]
    assert doctor["cpu"]["workers"] == 0  # half a CPU: Grain's multiprocessing gets no worker process
    assert doctor["cpu"]["source"].startswith("cgroup"), doctor["cpu"]["source"]
    assert doctor["shm"] == {"directory": "/dev/shm", "free_bytes": 64 * 2**20}
    assert doctor["versions"]["colo-data"] == importlib.metadata.version("colo-data")


def test_a_ring_bigger_than_the_shm_refuses_to_start(image: SidecarImage, corpus: Path, tmp_path: Path) -> None:
    """4 slots of 40 rows x 131072 int32 tokens need 80 MiB; the container has 64 MB."""
    config = demo_config(configs(tmp_path), corpus, seq_len=131072, global_batch_size=40)
    options = ["--shm-size=64m", "-e", f"COLO_DATA_CONFIG={config}", *same_path(config.parent, "ro"), *same_path(corpus, "ro")]
    socket_dir = tmp_path / "sock"
    socket_dir.mkdir()
    options += [*same_path(socket_dir), "-e", f"COLO_DATA_SOCKET={socket_dir}/sidecar.sock"]

    gated = image.podman.run(image.tag, options=options)  # the entrypoint's doctor refuses
    assert gated.returncode == 78, (gated.returncode, gated.stderr)
    assert "ring fits" in gated.stderr and "NO" in gated.stderr  # the doctor's report is in the log
    assert "needs 83888640 bytes (80.0 MiB), but /dev/shm has 67108864 bytes (64.0 MiB) free" in gated.stderr
    assert "--shm-size" in gated.stderr and "refusing to start" in gated.stderr

    direct = image.podman.run(image.tag, options=[*options, "-e", "COLO_DATA_SKIP_DOCTOR=1"])  # serve checks at start too
    assert direct.returncode == 1, (direct.returncode, direct.stderr)
    assert "ShmError" not in direct.stderr and "Traceback" not in direct.stderr, direct.stderr
    assert f"Error: {config}: a ring of 4 slots x 20972160 bytes needs 83888640 bytes" in direct.stderr
    assert "--shm-size" in direct.stderr
    assert not any(socket_dir.iterdir()), "it never listened"


def test_a_container_sidecar_serves_a_host_trainer(image: SidecarImage, corpus: Path, shm_mount: Path, tmp_path: Path) -> None:
    config = demo_config(configs(tmp_path), corpus, seq_len=16, global_batch_size=8)
    socket_dir = tmp_path / "sock"
    socket_dir.mkdir()
    socket = socket_dir / "sidecar.sock"
    options = [
        "--cpus=1",  # (half a CPU is the doctor test's; here it would only slow the start)
        "-e", f"COLO_DATA_CONFIG={config}",
        "-e", f"COLO_DATA_SOCKET={socket}",
        "-e", f"COLO_DATA_SHM_DIR={shm_mount}",
        *same_path(config.parent, "ro"), *same_path(corpus, "ro"), *same_path(socket_dir), *same_path(shm_mount),
    ]  # fmt: skip
    name = image.podman.start(image.tag, options=options)
    try:
        wait_healthy(image, name)
        pipeline = demo.pipeline(corpus, seq_len=16, global_batch_size=8)
        expected = read_all(cd.Loader(pipeline, backend="inprocess"))
        with cd.Loader(pipeline, backend=cd.Sidecar(address=f"unix://{socket}")) as loader:
            got = [to_numpy(next(loader))]
            assert any(shm_mount.iterdir()), "the container's ring lies in the host's tmpfs"
            for _ in range(3):  # busy with this trainer, probes queue up: still healthy
                assert health(image, name).returncode == 0
            got += [to_numpy(batch) for batch in loader]
        assert_batches_equal(expected, got, "a sidecar in a container")
        wrong = image.podman("exec", "-e", "COLO_DATA_SOCKET=/run/colo/none.sock", name, *HEALTH, check=False)
        assert wrong.returncode == 1 and "no sidecar listens on /run/colo/none.sock" in wrong.stdout
        logs = container_log(image, name)
        assert "cpu budget" in logs and "CPU budget 1 (cgroup" in logs and "workers: auto: up to 16 " in logs, logs
        image.podman("stop", "--time", "10", name)  # SIGTERM: the sidecar removes its ring and socket
        state = image.podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert state == "0", container_log(image, name)
        assert not socket.exists()
    finally:
        image.podman.remove(name)


def test_a_container_sidecar_computes_its_chunks_on_a_ray_cluster(
    image: SidecarImage, corpus: Path, shm_mount: Path, tmp_path: Path
) -> None:
    """The image with Ray in its requirements (`ray[client]==VERSION`, as docs/ray.md says):
    a containerised sidecar whose config names Ray workers at the Ray Client address of a
    head node on the host passes its doctor, sends chunks to the cluster's actor (the
    trainer's telemetry counts the records they made), and the trainer on the host gets the
    batches of no workers. (The container's Python is Debian's, the cluster's this venv's:
    Ray Client compares the minor version only.)"""
    client = ray_port()
    config = demo_config(configs(tmp_path), corpus, seq_len=16, global_batch_size=8)
    workers = f'{{ ray = "ray://127.0.0.1:{client}", actors = 1, num_cpus = 1, connect_timeout = 60 }}'
    config.write_text(f"{config.read_text()}epochs = 1000\n[sidecar]\nworkers = {workers}\n")
    socket_dir = tmp_path / "sock"
    socket_dir.mkdir()
    socket = socket_dir / "sidecar.sock"
    options = [
        "--cpus=1",
        "-e", f"COLO_DATA_CONFIG={config}",
        "-e", f"COLO_DATA_SOCKET={socket}",
        "-e", f"COLO_DATA_SHM_DIR={shm_mount}",
        "-e", "RAY_AUTH_MODE=disabled",  # as the head runs (docs/ray.md, token authentication)
        *same_path(config.parent, "ro"), *same_path(corpus, "ro"), *same_path(socket_dir), *same_path(shm_mount),
    ]  # fmt: skip
    with head_node(Path(sys.executable).parent / "ray", client_port=client, cpus=2):
        name = image.podman.start(image.tag, options=options, network="host")  # the head's ports are the host's
        try:
            wait_healthy(image, name, 180)
            logs = container_log(image, name)
            assert "reachable: Ray" in logs and "1 node(s), 2 CPUs" in logs, f"the doctor did not report the cluster:\n{logs}"
            pipeline = demo.pipeline(corpus, seq_len=16, global_batch_size=8, epochs=1000)
            with cd.Loader(pipeline, backend=cd.Sidecar(address=f"unix://{socket}")) as loader:
                got = until_workers_made(loader, 120)
                got += [to_numpy(next(loader)) for _ in range(20)]
            expected = read_all(cd.Loader(pipeline, backend="inprocess"), len(got))
            assert_batches_equal(expected, got, "a container sidecar with Ray workers")
            image.podman("stop", "--time", "10", name)
            state = image.podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
            assert state == "0", container_log(image, name)
        finally:
            image.podman.remove(name)


def health(image: SidecarImage, name: str) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK, run now."""
    return image.podman("healthcheck", "run", name, check=False)


def wait_healthy(image: SidecarImage, name: str, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while (result := health(image, name)).returncode:
        running = image.podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        assert running == "true", f"the sidecar container exited:\n{container_log(image, name)}"
        assert time.monotonic() < deadline, f"not healthy within {seconds} s: {result.stdout} {result.stderr}"
        time.sleep(1)


def container_log(image: SidecarImage, name: str) -> str:
    logs = image.podman("logs", name)
    return logs.stdout + logs.stderr
