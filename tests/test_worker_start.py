"""Workers ready sooner (colo_data/workers/forks.py): a pool starts a fork server when its
first worker is asked for, which imports numpy, pyarrow and colo-data's chunk work (and
never JAX), and forks each worker from it; a sidecar's server is a fork of the sidecar, made
with the pool, which has imported them already (a process running more threads than its one
gets a fresh interpreter). The
server and its workers are gone after `close()`, after the loader is dropped unclosed, after
a script that just ends, and when the process that owns the pool is killed; workers die
with their server."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import psutil
import pytest
from pipelines import WORKERS_S, OnArrival, idle_host, make_pipeline, until_workers_made

import colo_data as cd
from colo_data.runtime.budget import cpu_budget
from colo_data.runtime.child_env import child_env
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.workers.processes import WorkerPool

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

TESTS = Path(__file__).parent
PRELOADED = ("numpy", "numpy.random", "pyarrow", "cloudpickle", "colo_data.host.chunk_work", "colo_data.host.slices")
MARK = "colo_data.workers.processes"  # on the command line of worker processes (and of no fork server)


class NoteArrival(OnArrival):
    """A transform (doing nothing to the batch) that, as a worker process unpickles it (the
    job has just arrived), writes the worker's pid, parent pid, which of `PRELOADED` it has
    imported already, whether it has JAX, a draw from numpy's global random state and its
    RAYON_NUM_THREADS, to `directory`/PID.json."""

    def arrived(self) -> None:
        """Write what the worker has at its set-up."""
        import numpy as np

        seen = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "preloaded": [m for m in PRELOADED if m in sys.modules],
            "jax": "jax" in sys.modules,
            "draw": float(np.random.random()),
            "rayon": os.environ.get("RAYON_NUM_THREADS"),
        }
        (self.directory / f"{os.getpid()}.json").write_text(json.dumps(seen))


def settle(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether `check()` holds within `seconds` (a bound for a slow machine, not a timing)."""
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return check()


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (not zombies)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def descendants() -> list[int]:
    """This process's live descendants, without multiprocessing's resource tracker."""
    return alive([c.pid for c in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())])


def ready(pool: WorkerPool, payload: bytes, workers: int) -> None:
    """Start a feed of `payload` on `pool` and wait until its first `workers` have set it up."""
    feed = pool.feed(payload, 0, 1, 0)
    assert settle(lambda: feed.ready(workers) == workers, WORKERS_S), f"the workers were not ready in {WORKERS_S:g} s"


def test_workers_are_forked_from_a_server_started_with_the_first_feed_that_preloaded_their_imports(
    token_corpus: Path, tmp_path: Path
) -> None:
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(2, owner)
        assert not psutil.Process().children(), "a server before any feed"
        pipeline = make_pipeline(token_corpus, transforms=[NoteArrival(tmp_path), cd.pad_or_truncate("tokens", 8)])
        feed = pool.feed(cloudpickle.dumps(pipeline), 0, 1, 0)
        (server,) = psutil.Process().children()
        assert not pool.pids, "a worker before the feed asked for one"
        feed.ready(2)
        maps = Path(f"/proc/{server.pid}/maps")
        assert settle(lambda: "libarrow" in maps.read_text(), WORKERS_S), "the server did not import pyarrow"
        assert "jaxlib" not in maps.read_text() and "xla_extension" not in maps.read_text(), "the server loaded JAX"
        assert settle(lambda: feed.ready(2) == 2, WORKERS_S), f"the workers were not ready in {WORKERS_S:g} s"
        seen = [json.loads((tmp_path / f"{pid}.json").read_text()) for pid in pool.pids]
        assert MARK not in " ".join(server.cmdline()), "the server's command line says it is a worker"
        for worker in seen:
            assert worker["ppid"] == server.pid, f"worker {worker['pid']} was not forked from the server"
            assert worker["preloaded"] == list(PRELOADED), f"worker {worker['pid']} had only {worker['preloaded']}"
            assert not worker["jax"]
            assert MARK in " ".join(psutil.Process(worker["pid"]).cmdline()), "a worker's command line names its module"
        assert seen[0]["draw"] != seen[1]["draw"], "the workers share numpy's global random state"
    finally:
        owner.close()


def environ(pid: int) -> bytes:
    """The environment process `pid` started with (a fork's is its parent's, whatever it set since)."""
    return Path(f"/proc/{pid}/environ").read_bytes()


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_sidecars_fork_server_is_a_fork_of_the_sidecar(
    token_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)  # the sidecar then gets 1: one thread, as the image's
    pipeline = make_pipeline(
        token_corpus, epochs=None, transforms=[idle_host, NoteArrival(tmp_path), cd.pad_or_truncate("tokens", 8)]
    )
    with cd.Loader(pipeline, hosts=1, backend=cd.Sidecar(workers=2)) as loader:
        until_workers_made(loader)
        (sidecar,) = psutil.Process().children()
        (server,) = sidecar.children()
        workers = server.children()
        assert environ(server.pid) == environ(sidecar.pid), "the server is a fresh interpreter, not a fork of the sidecar"
        assert MARK not in " ".join(server.cmdline()), "the server's command line says it is a worker"
        assert workers, "no worker was forked"
        notes = [tmp_path / f"{worker.pid}.json" for worker in workers]  # a worker forked just now may not have its job yet
        assert settle(lambda: all(note.exists() for note in notes), WORKERS_S), "a worker never set its job up"
        for worker, note in zip(workers, notes, strict=True):
            seen = json.loads(note.read_text())
            assert seen["ppid"] == server.pid
            assert seen["preloaded"] == list(PRELOADED) and not seen["jax"]
            assert MARK in " ".join(worker.cmdline()), "a worker's command line names its module"
            assert seen["rayon"] == str(max(1, math.ceil(cpu_budget().cpus) // 2)), "a worker lacks its share of the budget"


FROM_HERE = """
import json, threading
import psutil
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.workers.processes import WorkerPool

def server_forked(owner):
    before = {c.pid for c in psutil.Process().children()}
    WorkerPool(1, owner, from_here=True)
    (server,) = [c for c in psutil.Process().children() if c.pid not in before]
    with open(f"/proc/{server.pid}/environ", "rb") as theirs, open("/proc/self/environ", "rb") as ours:
        return theirs.read() == ours.read()

owner = Lifecycle("test")
alone = server_forked(owner)
stop = threading.Event()
thread = threading.Thread(target=stop.wait)
thread.start()
beside_a_thread = server_forked(owner)
stop.set()
thread.join()
owner.close()
print(json.dumps([alone, beside_a_thread]))
"""


def test_a_pool_forks_its_server_from_a_process_that_runs_one_thread_only(tmp_path: Path) -> None:
    # with the process settings a sidecar starts with (one OpenBLAS thread: numpy's pool would be more threads)
    result = subprocess.run(
        [sys.executable, "-c", FROM_HERE], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=child_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    alone, beside_a_thread = json.loads(result.stdout.splitlines()[-1])
    assert alone, "a process of one thread started a fresh interpreter as its server"
    assert not beside_a_thread, "a process running a second thread forked itself"


def test_close_stops_the_server_and_its_workers(token_corpus: Path) -> None:
    owner = Lifecycle("test")
    pool = WorkerPool(2, owner)
    ready(pool, cloudpickle.dumps(make_pipeline(token_corpus)), 2)
    started = descendants()
    assert len(started) == 3, f"a server and 2 workers: {started}"
    owner.close()
    assert not alive(started), "close() returned before the server and its workers were gone"


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_dropped_loader_stops_the_server_and_its_workers(token_corpus: Path) -> None:
    before = set(descendants())
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    loader = cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=1))
    until_workers_made(loader)
    started = [pid for pid in descendants() if pid not in before]
    assert started, "the loader started no fork server"
    del loader
    assert settle(lambda: not alive(started)), f"left running: {alive(started)}"


SCRIPT = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, {tests!r})
import psutil
import colo_data as cd
from pipelines import idle_host, make_pipeline, until_workers_made
pipeline = make_pipeline({corpus!r}, epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
loader = cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=1))
until_workers_made(loader)
print(json.dumps([c.pid for c in psutil.Process().children(recursive=True)]), flush=True)
if {wait!r}:
    sys.stdin.read()
"""


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_script_that_just_ends_leaves_no_server_and_no_workers(token_corpus: Path, tmp_path: Path) -> None:
    script = SCRIPT.format(tests=str(TESTS), corpus=str(token_corpus), wait=False)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    started = json.loads(result.stdout.splitlines()[-1])
    assert len(started) == 2, f"a server and a worker: {started}"
    assert settle(lambda: not alive(started)), f"left running: {alive(started)}"


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_killed_trainer_leaves_no_server_and_no_workers(token_corpus: Path, tmp_path: Path) -> None:
    script = SCRIPT.format(tests=str(TESTS), corpus=str(token_corpus), wait=True)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path)
    try:
        assert trainer.stdout is not None
        started = json.loads(trainer.stdout.readline())
        assert len(started) == 2, f"a server and a worker: {started}"
        trainer.kill()
        trainer.wait(10)
        assert settle(lambda: not alive(started)), f"left running after their trainer was killed: {alive(started)}"
    finally:
        trainer.kill()
        trainer.wait(10)


def test_workers_die_with_their_server_and_the_pool_says_so(token_corpus: Path) -> None:
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(2, owner)
        payload = cloudpickle.dumps(make_pipeline(token_corpus))
        ready(pool, payload, 2)
        workers = pool.pids
        (server,) = psutil.Process().children()
        server.send_signal(signal.SIGKILL)
        assert settle(lambda: not alive(workers)), f"workers outlived their server: {alive(workers)}"
        with pytest.raises(cd.ColoDataError, match=r"a worker process died \(worker 0 was killed by SIGKILL; worker 1 was killed"):
            pool.feed(payload, 0, 1, 0)
    finally:
        owner.close()
