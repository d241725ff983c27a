"""The sidecar backend with real sidecar processes, real shared memory and real signals:
same batches as in-process, resume through it, errors with the remote traceback, and no
process or segment left behind when any party is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest
from pipelines import BATCH, idle_host, make_pipeline, until_workers_made
from real_cgroup import cpu_cgroup
from start_gate import tmpfs

import colo_data as cd
from colo_data import defaults, demo
from colo_data.backends.options import auto_backend
from colo_data.backends.sidecar import local
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.backends.sidecar.local import LocalSidecar
from colo_data.backends.sidecar.ring_plan import SLOT_TARGET_BYTES, batches_per_slot
from colo_data.host.host_pipeline import HostPipeline
from colo_data.runtime.budget import CpuBudget
from colo_data.testing import assert_batches_equal, read_all, to_numpy
from colo_data.workers.settings import auto_most

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the sidecar cannot import this test module
COLO = Path(sys.executable).parent / "colo-data"


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm; the test fails if a segment is left in it."""
    directory = Path(tempfile.mkdtemp(prefix="ring-test-", dir="/dev/shm"))
    yield directory
    left = sorted(p.name for p in directory.iterdir())
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()
    assert not left, f"segments left behind: {left}"


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.1)


def sidecars() -> list[psutil.Process]:
    me = psutil.Process()
    return [c for c in me.children(recursive=True) if "sidecar" in " ".join(c.cmdline()) and c.status() != "zombie"]


@pytest.mark.parametrize("hosts", [1, 2])
def test_sidecar_batches_equal_in_process(token_corpus: Path, shm_dir: Path, hosts: int) -> None:
    pipeline = make_pipeline(token_corpus)
    expected = read_all(cd.Loader(pipeline, hosts=hosts))
    # 2 slots: every slot is rewritten many times while the test holds all batches, so a
    # batch that aliased its slot would change under us
    got = read_all(cd.Loader(pipeline, backend=cd.Sidecar(workers=2, shm_dir=str(shm_dir), slots=2), hosts=hosts))
    assert_batches_equal(expected, got, f"sidecar backend, {hosts} host(s)")
    wait_for(lambda: not sidecars(), 10, "local sidecars exit with the loader")


@pytest.mark.usefixtures("own_cpu_budget")
def test_sidecar_worker_shares_make_the_same_stream(token_corpus: Path, shm_dir: Path) -> None:
    """Past the chunks the sidecar makes itself, its workers each compute their share of
    every chunk (the sidecar puts them together): the same batches as in process."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    with cd.Loader(pipeline, backend=cd.Sidecar(workers=2, shm_dir=str(shm_dir)), hosts=1) as loader:
        got = until_workers_made(loader)
        got += [to_numpy(next(loader)) for _ in range(100)]
    expected = read_all(cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=0)), len(got))
    assert_batches_equal(expected, got, "sidecar with 2 workers")


def test_resume_through_the_sidecar(token_corpus: Path, shm_dir: Path) -> None:
    pipeline = make_pipeline(token_corpus, "global")
    expected = read_all(cd.Loader(pipeline))
    with cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm_dir)), hosts=2) as loader:
        for _ in range(4):
            next(loader)
        state = loader.get_state()
        assert state == cd.Loader(pipeline).get_state() | {"position": 4 * BATCH, "step": 4}
        rest = [to_numpy(b) for b in loader]
        loader.set_state(state)  # the same sidecars serve a new session
        again = [to_numpy(b) for b in loader]
    assert_batches_equal(expected[4:], rest, "sidecar after 4 steps")
    assert_batches_equal(expected[4:], again, "sidecar after set_state")


def test_slots_holding_several_batches(token_corpus: Path, shm_dir: Path) -> None:
    # 12 rows x 26,000 int32 tokens: 1.25 MiB a batch, so a 4 MiB slot holds 3 of the 10
    # batches and the last slot 1; starting at batch 4 cuts the first group short.
    pipeline = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 26_000)])
    batch_bytes = sum(v.nbytes for v in next(HostPipeline(pipeline).chunks(0, batches=1)).columns.values())
    assert batches_per_slot(next(HostPipeline(pipeline).chunks(0)).columns, BATCH, 42) == SLOT_TARGET_BYTES // batch_bytes == 3
    expected = read_all(cd.Loader(pipeline))
    got = read_all(cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm_dir), slots=2)))
    assert_batches_equal(expected, got, "3 batches a slot")
    state = cd.Loader(pipeline).get_state() | {"position": 4 * BATCH}
    resumed = read_all(cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm_dir)), state=state))
    assert_batches_equal(expected[4:], resumed, "3 batches a slot, from batch 4")
    sidecar = LocalSidecar(str(shm_dir), 0, 2)
    try:  # the client's views (no copy) hold until the next batch is asked for
        client = SidecarClient(sidecar.address, sidecar.process.pid)
        views = [{k: np.array(v) for k, v in b.columns.items()} for b in client.batches(pipeline, 0, 1, 0)]
    finally:
        sidecar.stop()
    assert_batches_equal([to_numpy(c.columns) for c in HostPipeline(pipeline).chunks(0, batches=1)], views, "views, 3 batches a slot")


def test_a_deep_tmpdir_puts_the_sidecars_socket_in_tmp(
    token_corpus: Path, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's own sidecar listens on a socket in a temp dir of its own: under a TMPDIR
    too deep for a Unix socket's 107 bytes (a job scheduler's per-job one), in /tmp instead,
    and the batches come; where no directory would do, a ConfigError that names TMPDIR."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert tempfile.gettempdir() == str(deep)
    pipeline = make_pipeline(token_corpus)
    sidecar = LocalSidecar(str(shm_dir), 0, 2)
    try:
        assert sidecar.address.startswith("/tmp/" + defaults.LOCAL_SIDECAR_DIR_PREFIX), sidecar.address
        client = SidecarClient(sidecar.address, sidecar.process.pid)
        got = [to_numpy(b.columns) for b in client.batches(pipeline, 0, 1, 0, copy=True)]
    finally:
        sidecar.stop()
    assert not os.path.exists(os.path.dirname(sidecar.address))
    assert_batches_equal([to_numpy(c.columns) for c in HostPipeline(pipeline).chunks(0, batches=1)], got, "a socket in /tmp")
    monkeypatch.setattr(local, "MAX_PATH_BYTES", 20)
    with pytest.raises(cd.errors.ConfigError, match=r"at most 20 bytes.*bytes under .*ddd.*set TMPDIR to a shorter directory"):
        cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm_dir)))


def test_a_small_shm_dir_gets_one_batch_a_slot(token_corpus: Path, tmp_path: Path) -> None:
    # 1.25 MiB batches: 3 a slot would need 2 x 3.75 MiB, more than a 6 MiB tmpfs holds
    with tmpfs(tmp_path / "shm", "6m") as mount:  # fails if a segment is left in it
        pipeline = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 26_000)])
        sidecar = LocalSidecar(str(mount), 0, 2)
        try:
            client = SidecarClient(sidecar.address, sidecar.process.pid)
            got = [{k: np.array(v) for k, v in b.columns.items()} for b in client.batches(pipeline, 0, 1, 0)]
        finally:
            sidecar.stop()
        assert client.info["batches_per_slot"] == 1, client.info
        assert_batches_equal([to_numpy(c.columns) for c in HostPipeline(pipeline).chunks(0, batches=1)], got, "6 MB tmpfs")


def test_batches_per_slot() -> None:
    chunk = {"x": np.zeros((512, 1024), np.int32), "i": np.zeros(512, np.int64)}  # 4,104 bytes a record
    assert batches_per_slot(chunk, 32, 16) == 16  # 128 KiB batches: a chunk's worth
    assert batches_per_slot(chunk, 128, 4) == 4 and batches_per_slot(chunk, 128, 100) == 7
    assert batches_per_slot(chunk, 512, 1) == 1 and batches_per_slot(chunk, 4096, 1) == 1  # 2 MiB, 16 MiB
    assert batches_per_slot({"x": np.zeros((0, 8))}, 4, 3) == 3  # nothing to measure: as many as allowed


def fail_when_asked(batch: dict) -> dict:
    if batch["_index"].min() >= 0 and os.environ.get("COLO_DATA_TEST_FAIL") == "1":
        raise ValueError("record is broken")
    return batch


def test_worker_exception_reaches_the_trainer_with_its_traceback(token_corpus: Path, shm_dir: Path) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 8), fail_when_asked])
    os.environ["COLO_DATA_TEST_FAIL"] = "1"  # inherited by the sidecar and its worker
    try:
        with cd.Loader(pipeline, backend=cd.Sidecar(workers=2, shm_dir=str(shm_dir))) as loader:
            with pytest.raises(cd.errors.TransformError) as raised:
                next(loader)
    finally:
        del os.environ["COLO_DATA_TEST_FAIL"]
    message = str(raised.value)
    assert "record is broken" in message and "raised in the sidecar" in message
    assert "fail_when_asked" in message  # the remote traceback names the failing function


def test_sidecar_killed_is_detected_and_its_segments_removed(token_corpus: Path, shm_dir: Path) -> None:
    pipeline = make_pipeline(token_corpus, epochs=None)
    with cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm_dir)), prefetch=0) as loader:
        next(loader)
        assert any(shm_dir.iterdir())
        (victim,) = sidecars()
        victim.send_signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(cd.errors.SidecarError, match="died"):
            for _ in range(100):
                next(loader)
        assert time.monotonic() - started < 10
    assert not any(shm_dir.iterdir())


@pytest.mark.usefixtures("own_cpu_budget")
def test_worker_killed_is_an_error_not_a_hang(token_corpus: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])  # the sidecar hands its workers work
    with cd.Loader(pipeline, backend=cd.Sidecar(workers=2, shm_dir=str(shm_dir)), prefetch=0) as loader:
        until_workers_made(loader)
        (side,) = sidecars()
        workers = [c for c in side.children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]
        assert 2 <= len(workers) <= 3, "the sidecar runs its workers' fork server and its workers"
        for w in workers:
            w.send_signal(signal.SIGKILL)
        # by time, not by batches: where the worker policy had counted none before the kill, the
        # pool is looked at at its next count, by then the ring may hold many batches made by the
        # sidecar's own thread
        started = time.monotonic()
        with pytest.raises(cd.ColoDataError):
            while time.monotonic() - started < 30:
                next(loader)


TRAINER = """
import sys, time
from absl import flags
flags.FLAGS.mark_as_parsed()
import colo_data as cd
pipeline = cd.Pipeline(source=cd.ArrowSource(sys.argv[1]), transforms=[cd.pad_or_truncate("tokens", 8)],
                       global_batch_size=12, epochs=None)
loader = cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=sys.argv[2]))
next(loader)
print("running", flush=True)
time.sleep(600)
"""


def test_trainer_killed_leaves_no_sidecar(token_corpus: Path, shm_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    trainer = subprocess.Popen([sys.executable, str(script), str(token_corpus), str(shm_dir)], stdout=subprocess.PIPE)
    try:
        assert trainer.stdout.readline().strip() == b"running"
        side = [c for c in psutil.Process(trainer.pid).children(recursive=True) if "sidecar" in " ".join(c.cmdline())]
        assert side and any(shm_dir.iterdir())
        command = side[0].cmdline()
        socket_dir = Path(command[command.index("--socket") + 1]).parent
        assert socket_dir.is_dir()
        trainer.kill()
        trainer.wait()
        wait_for(lambda: not any(p.is_running() and p.status() != "zombie" for p in side), 10, "the sidecar exits")
        wait_for(lambda: not any(shm_dir.iterdir()), 10, "the sidecar removes its ring")
        assert not socket_dir.exists(), f"{socket_dir} (the sidecar's socket directory) is left behind"
    finally:
        trainer.kill()


def test_external_sidecar_from_a_config(token_corpus: Path, shm_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'pipeline = "colo_data.demo:pipeline"\n[args]\ndata_dir = "{token_corpus}"\nseq_len = 8\nglobal_batch_size = 12\n'
    )
    socket = tmp_path / "host0.sock"
    server = subprocess.Popen(
        [str(COLO), "sidecar", "serve", str(config), "--socket", str(socket), "--shm-dir", str(shm_dir), "--workers", "1"],
        stderr=subprocess.PIPE,
    )
    try:
        pipeline = demo.pipeline(token_corpus, seq_len=8, global_batch_size=12)
        expected = read_all(cd.Loader(pipeline))
        got = read_all(cd.Loader(pipeline, backend=cd.Sidecar(address=f"unix://{socket}")))
        assert_batches_equal(expected, got, "external sidecar")
    finally:
        server.terminate()
        server.wait(10)
    assert server.returncode == 0
    assert b"worker" in server.stderr.read()


@pytest.mark.parametrize("quota_us, cpus", [(50_000, 0.5), (None, None)])
def test_sidecar_in_a_cpu_limited_cgroup(token_corpus: Path, shm_dir: Path, tmp_path: Path, quota_us: int | None, cpus: float | None) -> None:
    """A sidecar that starts inside a cgroup with half a CPU reports cpus=0.5, and "auto"'s
    bound of workers for it (16 a CPU, a part of one counting as one); without a quota it
    takes the affinity mask. Either way it serves the right batches."""
    if quota_us is None:
        cpus = float(len(os.sched_getaffinity(0)))
    workers = auto_most(CpuBudget(cpus, 0, "", 0, None))
    socket = tmp_path / "host0.sock"
    with contextlib.ExitStack() as stack:
        join = ""
        if quota_us is not None:
            group = stack.enter_context(cpu_cgroup(quota_us))
            join = f"echo $$ > {group.procs} && "
        env = {k: v for k, v in os.environ.items() if k != "COLO_DATA_CPUS"}
        server = subprocess.Popen(
            ["sh", "-c", f'{join}exec "{COLO}" sidecar serve --socket {socket} --shm-dir {shm_dir}'], env=env
        )
        try:
            client = SidecarClient(f"unix://{socket}", server.pid)
            pipeline = make_pipeline(token_corpus)
            got = [{k: np.array(v) for k, v in b.columns.items()} for b in client.batches(pipeline, 0, 1, 0)]
            client.close()
            assert client.info["budget"]["cpus"] == cpus and client.info["workers"] == workers, client.info
            expected = [to_numpy(c.columns) for c in HostPipeline(pipeline).chunks(0, batches=1)]
            assert_batches_equal(expected, got, f"sidecar with budget {client.info['budget']}")
        finally:
            server.terminate()
            server.wait(10)


def test_ring_too_big_for_the_shm_dir(token_corpus: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "shm", "64m") as mount:  # fails if a segment is left in it
        big = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 2**20)], global_batch_size=12)
        with cd.Loader(big, backend=cd.Sidecar(workers=0, shm_dir=str(mount), slots=4)) as loader:
            with pytest.raises(cd.errors.ShmError, match=r"needs \d+ bytes.*free") as raised:
                next(loader)
        assert "--shm-size" in str(raised.value)
        assert not any(mount.iterdir())
        fits = make_pipeline(token_corpus)
        assert_batches_equal(
            read_all(cd.Loader(fits)),
            read_all(cd.Loader(fits, backend=cd.Sidecar(workers=0, shm_dir=str(mount)))),
            "a ring that fits the 64 MB tmpfs",
        )


def test_sidecar_address_needs_one_per_host(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match="one address per host"):
        cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(address="unix:///tmp/x.sock"), hosts=2)


def test_no_sidecar_at_the_address(tmp_path: Path) -> None:
    with pytest.raises(cd.errors.SidecarError, match=r"no sidecar answers at unix://.*none\.sock"):
        SidecarClient(f"unix://{tmp_path / 'none.sock'}", connect_timeout=0.5)


def test_auto_backend_picks_a_configured_sidecar(token_corpus: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = make_pipeline(token_corpus)
    with cd.Loader(pipeline, backend="auto") as loader:
        assert loader.backend == cd.InProcess()  # no Pathways, no sidecar address
    sidecar = LocalSidecar(str(shm_dir), 0, 2)
    try:
        monkeypatch.setenv("COLO_DATA_SIDECAR", sidecar.address)
        got = read_all(cd.Loader(pipeline, backend="auto", hosts=1))
        with cd.Loader(pipeline, backend="auto", hosts=1) as loader:
            assert loader.backend == cd.Sidecar() and [p.pid for p in sidecars()] == [sidecar.process.pid]  # none started
    finally:
        sidecar.stop()
    assert_batches_equal(read_all(cd.Loader(pipeline)), got, "auto backend through COLO_DATA_SIDECAR")


def test_auto_backend_on_pathways_is_colocated(monkeypatch: pytest.MonkeyPatch) -> None:
    # No Pathways proxy backend can start here; what is checked is the decision on its signal.
    import pathwaysutils

    assert auto_backend() == cd.InProcess()
    monkeypatch.setenv("COLO_DATA_SIDECAR", "unix:///run/colo/host0.sock")
    assert auto_backend() == cd.Sidecar() and cd.Sidecar().addresses() == ("unix:///run/colo/host0.sock",)
    monkeypatch.setattr(pathwaysutils, "is_pathways_backend_used", lambda: True)
    assert auto_backend() == cd.Colocated()
