"""Everything a loader starts stops with it, on every path users write: a script that breaks
out of an unclosed loop and just ends, a loader dropped mid-epoch, many create/close
cycles, `close()` twice or with a timeout, and `next()` after `close()`."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from leftovers import left_behind
from pipelines import WORKERS_S, IdleHost, backend_of, in_worker_process, make_pipeline

import colo_data as cd
from colo_data import defaults, demo
from colo_data.backends.sidecar.local import LocalSidecar

# every test counts what is left in /dev/shm and in the temporary directory: they run alone, and
# count only what their own processes left (directories of their own, or tests/leftovers.py)
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
RUNS = 2  # runs of each case, side by side (a loaded machine is where exits race): 8 scripts in all

# The loop users write most, with the loader never closed and the script just ending. Before
# the loader had one owner for its threads, this aborted (SIGABRT, `terminate called ...`) in
# most runs with 4 devices: see colo_data/runtime/lifecycle.py.
SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import colo_data as cd
from colo_data import demo

if __name__ == "__main__":
    shuffle, backend, workers, prefetch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    shm_dir = os.environ["LIFECYCLE_SHM_DIR"]  # a directory of its own in /dev/shm: what it leaves there is its own
    chosen = cd.InProcess(workers=workers) if backend == "inprocess" else cd.Sidecar(workers=workers, shm_dir=shm_dir)
    loader = cd.Loader(demo.pipeline(shuffle=shuffle, epochs=None), backend=chosen, prefetch=prefetch)
    for i, batch in enumerate(loader):
        if i >= 12:
            break
"""


def ours_in_shm(directory: str = "/dev/shm") -> set[str]:
    """Shared-memory files a loader could leave: its sidecars' ring segments (worker
    processes send their chunks through pipes and make none)."""
    return {n for n in os.listdir(directory) if n.startswith("colo-data-")}


def local_sidecar_dirs(directory: Path | None = None) -> set[str]:
    """The socket directories of sidecars that loaders start for themselves (in `directory`,
    or the temporary directory)."""
    where = directory if directory is not None else tempfile.gettempdir()
    return {n for n in os.listdir(where) if n.startswith(defaults.LOCAL_SIDECAR_DIR_PREFIX)}


def children() -> list[psutil.Process]:
    """Live child processes, without multiprocessing's resource tracker (one per process,
    started by multiprocessing on first use and kept for the process's life by design)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def settle(check: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture
def own_shm() -> Iterator[Path]:
    """A directory of the test's own in /dev/shm, for its sidecars' rings: what is left
    there is theirs, never a neighbour's."""
    directory = Path(tempfile.mkdtemp(prefix="lifecycle-", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """A temporary directory of the test's own, for TMPDIR, directly in the machine's (the
    sockets of the sidecars started there have 107 bytes for their path)."""
    directory = Path(tempfile.mkdtemp(prefix="lifecycle-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    demo.corpus()  # written once, before the runs race to write it
    path = tmp_path_factory.mktemp("exit") / "unclosed.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize(
    "shuffle, backend, workers, prefetch",
    [
        ("global", "inprocess", 0, 2),
        ("block", "inprocess", 0, 2),
        ("block", "inprocess", 1, 2),
        ("block", "sidecar", 0, 2),
        ("block", "inprocess", 0, 0),  # the stream read on the script's own thread: ended at exit, not at teardown
    ],
    ids=["inprocess-global", "inprocess-block", "inprocess-1-worker", "sidecar", "inprocess-no-prefetch"],
)
def test_a_script_that_breaks_out_of_an_unclosed_loader_exits_cleanly(
    script: Path, shuffle: str, backend: str, workers: int, prefetch: int, own_shm: Path, own_tmp: Path
) -> None:
    """The scripts' sidecars put their rings and socket directories in directories of their
    own (a ring directory in /dev/shm, TMPDIR), so that what is left there is theirs alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "COLO_DATA_SIDECAR")}
    env.update(TMPDIR=str(own_tmp), LIFECYCLE_SHM_DIR=str(own_shm))

    def run(_: int) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(script), shuffle, backend, str(workers), str(prefetch)]
        return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)

    with ThreadPoolExecutor(2) as pool:  # two at a time: a loaded machine is where exits race
        results = list(pool.map(run, range(RUNS)))
    failures = [
        f"exit {r.returncode}: {r.stderr[-2000:]}"
        for r in results
        if r.returncode != 0 or "terminate" in r.stderr or "Traceback" in r.stderr
    ]
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly; first: {failures[0]}"
    assert settle(lambda: not os.listdir(own_shm)), f"left in {own_shm}: {sorted(os.listdir(own_shm))}"
    assert settle(lambda: not local_sidecar_dirs(own_tmp)), f"left in TMPDIR: {sorted(local_sidecar_dirs(own_tmp))}"


@pytest.mark.parametrize("backend, workers", [("inprocess", 0), ("inprocess", 1), ("sidecar", 0)])
def test_a_dropped_loader_stops_everything_it_started(token_corpus: Path, backend: str, workers: int) -> None:
    pipeline = make_pipeline(token_corpus, "global", epochs=None)
    # Process-wide helpers made on first use stay in the baseline (JAX's).
    with cd.Loader(pipeline, backend=backend_of(backend, workers)) as warm:
        next(warm)
    threads, shm = threading.active_count(), ours_in_shm()
    assert not children(), f"children before the test: {children()}"

    loader = cd.Loader(pipeline, backend=backend_of(backend, workers))
    next(loader)
    next(loader)
    assert threading.active_count() > threads or children(), "the loader started something to stop"
    del loader

    assert settle(lambda: threading.active_count() <= threads), [t.name for t in threading.enumerate()]
    assert settle(lambda: not children()), f"still running: {[' '.join(c.cmdline()) for c in children()]}"
    assert settle(lambda: not left_behind(shm, ours_in_shm())), f"left in /dev/shm: {sorted(left_behind(shm, ours_in_shm()))}"


HOOKS = """
import atexit

live, calls = set(), []
register, unregister = atexit.register, atexit.unregister


def counted_register(fn, *args, **kwargs):
    live.add(fn)
    calls.append(fn)
    return register(fn, *args, **kwargs)


def counted_unregister(fn):
    live.discard(fn)
    return unregister(fn)


atexit.register, atexit.unregister = counted_register, counted_unregister

import numpy as np
import colo_data as cd

pipeline = cd.Pipeline(source=[{"x": np.int32(i)} for i in range(64)], global_batch_size=8, epochs=None)
first = cd.Loader(pipeline)
next(first)
first.close()  # first-use registrations (the imports' own hooks) are not what is counted
kept = []
register(lambda: print("loaders closed before a later hook:", all(k._runner.owner.state == "closed" for k in kept)))
before = len(calls)
for i in range(100):
    loader = cd.Loader(pipeline, prefetch=i % 2)
    next(loader)
    if i % 3 == 0:
        loader.close()
    elif i % 3 == 1:
        kept.append(loader)  # left open: the exit hook closes them
print("registered by 100 loaders:", len(calls) - before)
print("colo-data hooks:", sum(fn.__module__.startswith("colo_data") for fn in live))
"""


def test_a_hundred_loaders_register_one_exit_hook_that_runs_first(tmp_path: Path) -> None:
    """100 loaders (closed, dropped, left open) register colo-data's exit hook at most once
    more, so atexit holds one of colo-data's; it runs before a hook that another library
    registered after colo-data started (as `ray.init` does), closing the open loaders."""
    script = tmp_path / "hooks.py"
    script.write_text(HOOKS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    registered = int(done.stdout.split("registered by 100 loaders:")[1].split()[0])
    assert registered <= 1, done.stdout
    assert "colo-data hooks: 1" in done.stdout, done.stdout
    assert "loaders closed before a later hook: True" in done.stdout, done.stdout


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_create_iterate_close_cycles_leak_nothing(token_corpus: Path, backend: str, own_shm: Path) -> None:
    """30 cycles: threads, file descriptors and segments unchanged, RSS grows < 64 MiB. The
    sidecar cycles are sessions of one sidecar (its start is not what is measured)."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    sidecar = LocalSidecar(str(own_shm), 0, 4) if backend == "sidecar" else None
    options = {"backend": cd.Sidecar(address=sidecar.address)} if sidecar else {}
    me = psutil.Process()

    def cycle() -> None:
        loader = cd.Loader(pipeline, hosts=1, **options)
        for _ in range(5):
            next(loader)
        loader.close()

    try:
        cycle()  # first-use costs (JAX, caches, the sidecar's imports) are not leaks
        gc.collect()
        threads, fds, shm, rss = threading.active_count(), me.num_fds(), ours_in_shm(str(own_shm)), me.memory_info().rss
        for _ in range(30):
            cycle()
        gc.collect()
        assert settle(lambda: threading.active_count() == threads), [t.name for t in threading.enumerate()]
        assert settle(lambda: me.num_fds() == fds), f"{me.num_fds()} fds, {fds} before"
        assert settle(lambda: ours_in_shm(str(own_shm)) == shm), sorted(ours_in_shm(str(own_shm)) ^ shm)
        grown = me.memory_info().rss - rss
        assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 30 cycles"
    finally:
        if sidecar is not None:
            sidecar.stop()


def test_close_is_final_idempotent_and_bounded(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    loader = cd.Loader(pipeline)
    next(loader)
    loader.close(timeout=5)
    loader.close()  # a second close does nothing
    assert loader.telemetry().steps == 1, "telemetry stays readable after close"
    with pytest.raises(cd.errors.LoaderClosedError, match="make a new one"):
        next(loader)
    with pytest.raises(cd.errors.LoaderClosedError):
        loader.set_state(loader.get_state())
    resumed = cd.Loader(pipeline, state=loader.get_state())
    assert next(resumed)["_index"].shape == (12,)
    resumed.close()


@pytest.mark.parametrize(
    ("backend", "prefetch", "workers"), [("inprocess", 2, 0), ("inprocess", 0, 2), ("sidecar", 2, 0), ("sidecar", 0, 0)]
)
def test_close_from_another_thread_ends_a_blocked_next(
    token_corpus: Path, tmp_path: Path, backend: str, prefetch: int, workers: int
) -> None:
    """A consumer waiting in `next()` for a slow pipeline wakes up when another thread
    closes the loader, with a `LoaderClosedError` that says so (not the error of a worker
    or sidecar connection that the close stopped), whether the consumer waits on the
    prefetch thread or runs the stream itself."""

    def slow(columns: dict) -> dict:
        time.sleep(0.5)
        return columns

    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), slow])
    loader = cd.Loader(pipeline, backend=backend_of(backend, workers, tmp_path), prefetch=prefetch)
    next(loader)
    threading.Timer(0.2, loader.close).start()
    started = time.monotonic()
    with pytest.raises(cd.errors.LoaderClosedError, match="closed"):
        for _ in range(1000):
            next(loader)
    assert time.monotonic() - started < 30, "next() woke up once the loader was closed"


def test_a_sidecar_killed_on_close_leaves_no_ring(token_corpus: Path, tmp_path: Path) -> None:
    """A loader closed with no time to spare while its own sidecar is inside a slow
    transform: the sidecar is killed before it can remove its ring, and the loader removes
    it (before, the ring's slot files stayed in the shared-memory directory)."""

    def slow(columns: dict) -> dict:
        time.sleep(3)
        return columns

    shm = tmp_path / "shm"
    shm.mkdir()
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[slow, cd.pad_or_truncate("tokens", 8)])
    loader = cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm)))
    next(loader)
    assert any(shm.iterdir()), "the sidecar's ring is in the directory"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # what was still running at the deadline is named
        loader.close(timeout=0)
    assert not any(shm.iterdir()), f"left: {sorted(p.name for p in shm.iterdir())}"


@pytest.mark.usefixtures("own_cpu_budget")
@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_close_from_another_thread_with_busy_workers_is_bounded_by_its_timeout(
    token_corpus: Path, tmp_path: Path, backend: str
) -> None:
    """Issue 26: with worker processes stuck in a long chunk, `close(timeout=3)` from
    another thread took twice its timeout: the run's prefetch thread, waiting on the
    workers (or on the sidecar's connection, closed after it), was waited for in full, then
    the workers (or the sidecar, waiting on its own) had a whole timeout again."""
    busy = tmp_path / "busy"

    def stuck_in_workers(columns: dict) -> dict:
        if in_worker_process():
            open(busy, "w").close()
            time.sleep(60)
        return columns

    transforms = [IdleHost(0.1), stuck_in_workers, cd.pad_or_truncate("tokens", 8)]  # the host leaves CPU to workers
    loader = cd.Loader(make_pipeline(token_corpus, epochs=None, transforms=transforms), backend=backend_of(backend, 2, tmp_path))
    ended: list[BaseException] = []

    def consume() -> None:
        try:
            while True:
                next(loader)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            ended.append(e)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert settle(busy.exists, WORKERS_S), "no worker ever took a chunk"
    time.sleep(0.5)  # the consumer drains what the host made meanwhile and waits on the stuck workers
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # what was still running at the run's deadline is named
        loader.close(timeout=3)
    took = time.monotonic() - started
    consumer.join(10)
    assert took < 1.5 * 3, f"close(timeout=3) took {took:.1f} s"
    assert not consumer.is_alive() and isinstance(ended[0], cd.errors.LoaderClosedError), ended
    assert settle(lambda: not children(), 10), f"left running: {children()}"
