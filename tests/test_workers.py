"""Worker processes (colo_data/workers/processes.py): started once and kept across restarts,
light (no JAX in them), usable from a script without a `__main__` guard, the same batches
as without workers; and how a host pipeline uses them (colo_data/host/host_pipeline.py
`_pooled`, as colo_data/host/pool_policy.py decides): only while CPU goes unused, never
waiting for them, given up when they cost more than they give."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest
from pipelines import (
    WORKERS_S,
    BATCH,
    InWorkers,
    SlowToStart,
    idle_host,
    make_pipeline,
    pool_records,
    read_while_given_up,
    until_workers_made,
)

import colo_data as cd
from colo_data import defaults
from colo_data.host.chunk import HostChunk, merge_shares
from colo_data.host.chunk_work import ChunkWork, Share
from colo_data.runtime.child_env import process_settings
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.testing import assert_batches_equal, read_all, to_numpy
from colo_data.workers.processes import WORKER_NICE, WorkerPool

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module


def workers_of(me: psutil.Process) -> list[psutil.Process]:
    return [c for c in me.children(recursive=True) if "colo_data.workers.processes" in " ".join(c.cmdline())]


@pytest.mark.usefixtures("own_cpu_budget")
def test_workers_are_kept_across_restarts_and_hold_no_jax(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "global", epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    me = psutil.Process()
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        first = until_workers_made(loader)
        pids = sorted(p.pid for p in workers_of(me))
        assert len(pids) == 1, f"one worker starts first, the next when one more is tried: {pids}"
        loader.set_state(cd.Loader(pipeline).get_state())
        again = [to_numpy(next(loader)) for _ in range(len(first))]
        assert set(pids) <= {p.pid for p in workers_of(me)}, "the same workers serve the restarted stream"
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "jaxlib" not in maps and "xla_extension" not in maps, f"worker {pid} loaded JAX"
            assert psutil.Process(pid).nice() == WORKER_NICE, "workers run below the trainer's priority"
            # its own session, at the same nice: where the kernel schedules sessions as groups (autogroup), nice
            # ranks processes only within one
            assert os.getsid(pid) == pid != os.getsid(0), f"worker {pid} is not in a session of its own"
            group = Path(f"/proc/{pid}/autogroup")  # "/autogroup-N nice K", where the kernel has autogroup
            assert not group.exists() or group.read_text().split()[-1] == str(WORKER_NICE), group.read_text()
    assert_batches_equal(first, again, "after set_state")
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(first)), first, "workers vs none")


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_sidecars_workers_make_the_same_batches(token_corpus: Path, tmp_path: Path) -> None:
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    with cd.Loader(pipeline, hosts=1, backend=cd.Sidecar(workers=2, shm_dir=str(tmp_path))) as loader:
        got = until_workers_made(loader)
        host = loader.telemetry().hosts[0]
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "a sidecar's workers vs none")
    # the sidecar reports each worker's stages: together, the records the host took from them
    made = next(s for s in host.stages if s.name == "pool_wait").items
    by_worker = [next(s for s in w if s.name == "transform").items for w in host.worker_stages]
    assert 1 <= len(by_worker) <= 2 and sum(by_worker) == made > 0, (by_worker, made)


def slow_in_workers(batch: dict) -> dict:
    """Slow in a worker process only: there, a chunk takes 1 s more than here (about ten
    times what the host's thread takes), so that the pool's trial shows it whatever the
    machine's load."""
    if os.environ.get("COLO_DATA_TEST_TRAINER") != str(os.getpid()):
        time.sleep(1.0)
    return batch


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget", "long_pool_retry")
def test_workers_that_cost_more_than_they_give_are_given_up(
    token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool is tried once CPU goes unused; slower than the host's own thread, it is given
    up (its chunks in flight are still taken) and not asked again: the workers' share of the
    stream stops growing, and the batches are the same."""
    monkeypatch.setenv("COLO_DATA_TEST_TRAINER", str(os.getpid()))
    transforms = [idle_host, slow_in_workers, cd.pad_or_truncate("tokens", 8)]
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=transforms)

    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        got = read_while_given_up(loader)  # a worker's chunks take 1 s each: 2 s without one is given up
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "after the pool was given up")


def paced(loader: cd.Loader, got: list[dict], busy: bool) -> None:
    """One batch into `got`, then a wait until 10 ms after it was asked for: a training step
    that sleeps, or (`busy`) that keeps this thread's CPU busy, as a step on the CPU does."""
    due = time.monotonic() + 0.01
    got.append(to_numpy(next(loader)))
    while time.monotonic() < due:
        if not busy:
            time.sleep(max(0.0, due - time.monotonic()))


def paced_until_workers_made(loader: cd.Loader) -> list[dict]:
    """`until_workers_made`, reading with sleeping steps (`paced`): the CPU the pipeline leaves
    unused is left so, and the host's rate alone is the one its workers then keep."""
    got: list[dict] = []
    stop = time.monotonic() + WORKERS_S
    while len(got) % 20 or not pool_records(loader):
        assert time.monotonic() < stop, f"the workers made nothing in {WORKERS_S:g} s"
        paced(loader, got, busy=False)
    return got


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget")
def test_a_starting_worker_never_holds_up_the_stream(token_corpus: Path, tmp_path: Path) -> None:
    """When one worker pays and one more is tried, the second is asked for shares only once
    it is ready: while it starts (here, held up until the test says go), the stream goes on,
    made by the first worker and the host's own thread. Before, the second was asked at
    once, and the stream stopped for its whole start."""
    transforms = [idle_host, SlowToStart(tmp_path), cd.pad_or_truncate("tokens", 8)]
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=transforms)
    more: list[dict] = []
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        got = paced_until_workers_made(loader)

        def read() -> None:  # until the first worker has paid and the second starts, then 1,500 batches more
            stop = time.monotonic() + 60
            while not (tmp_path / "waiting").exists() and time.monotonic() < stop:
                paced(loader, got, busy=False)  # one more worker is tried only where CPU goes unused
            more.extend(to_numpy(next(loader)) for _ in range(1500))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(90)  # a hang detector, not a timing: this takes seconds
        went_on, read_by_then = not reader.is_alive(), len(more)
        (tmp_path / "go").touch()
        reader.join(60)
    assert (tmp_path / "waiting").exists(), "no second worker was tried"
    assert went_on and read_by_then == 1500, f"the stream stopped after {read_by_then} batches while the second worker started"
    got += more
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "workers vs none")


class OthersCpu:
    """The CPUs that processes outside this one's tree (itself and its descendants) kept
    busy, on average, since this was made: what other work on the machine took."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._start = self._now()

    def _now(self) -> tuple[float, float, float]:
        machine = psutil.cpu_times()
        busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq + machine.steal
        mine = 0.0
        for process in [self._me, *self._me.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            mine += times.user + times.system
        return time.monotonic(), busy, mine

    def cpus(self) -> float:
        (t0, busy0, mine0), (t1, busy1, mine1) = self._start, self._now()
        return max(0.0, (busy1 - busy0) - (mine1 - mine0)) / (t1 - t0)


@pytest.mark.serial
def test_no_second_worker_where_the_first_leaves_no_cpu_unused(
    token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget of 1 CPU. While the host's thread works alone, the training loop sleeps
    between batches and the budget goes unused: the first worker starts and is used. From
    then on the loop's steps keep its CPU busy, and none of the budget is left: no second
    worker starts (it would only take its CPU from the first and the loop: beside the light
    pipeline in process on 2 CPUs, the stream ran at about 0.8x of one worker's rate while a
    second started), and the first stays in use. Where other processes keep the machine's
    CPUs busy, the first worker (at nice 10) is slower than the host's thread alone and is
    rightly given up: then there is nothing to test, and the test says so."""
    monkeypatch.setenv("COLO_DATA_CPUS", "1")
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    me, others = psutil.Process(), OthersCpu()
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        got = paced_until_workers_made(loader)
        tried = time.monotonic()
        while time.monotonic() - tried < 3.0:  # the first worker's trial, and time for a second to start
            paced(loader, got, busy=True)
        made = pool_records(loader)
        while time.monotonic() - tried < 4.0:
            paced(loader, got, busy=True)
        taken = others.cpus()
        if pool_records(loader) == made and taken >= 0.5:
            pytest.skip(
                f"the first worker was given up while other processes kept {taken:.1f} of the machine's "
                f"{psutil.cpu_count()} CPUs busy: this test needs it in use (run it on a machine left idle)"
            )
        assert pool_records(loader) > made, "the first worker was given up: this test needs it in use"
        assert len(workers_of(me)) == 1, f"a second worker started: {workers_of(me)}"
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "workers vs none")


@pytest.mark.serial
def test_no_unused_cpu_no_work_for_the_workers(token_corpus: Path) -> None:
    """With every CPU of the affinity mask kept busy by other processes, the host's thread
    makes every chunk: its workers are not handed any (they would only take CPU from it)."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
            started, read = time.monotonic(), []
            while time.monotonic() - started < 3.0:  # six of the host's decisions
                read.append(to_numpy(next(loader)))
            assert next(s for s in loader.telemetry().stages if s.name == "pool_wait").items == 0
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(read)), read, "the host's thread alone")


def row_groups_of(pipeline: cd.Pipeline, indices: np.ndarray) -> set[int]:
    starts = np.cumsum(pipeline.source.row_group_sizes)
    return set(np.searchsorted(starts, indices, side="right").tolist())


@pytest.mark.parametrize("shuffle", ["none", "global", "block"])
@pytest.mark.parametrize("workers", [2, 3])
def test_worker_shares_read_their_own_row_groups_and_make_the_chunk(
    token_corpus: Path, shuffle: str, workers: int
) -> None:
    """Each worker computes the rows of a chunk whose row groups are its own: no row group
    is decoded by two workers, and the shares put back in place are the chunk, also for a
    chunk that straddles two epochs."""
    pipeline = make_pipeline(token_corpus, shuffle, epochs=None)
    work = ChunkWork(pipeline)
    for position in (0, 5 * BATCH, 108):  # 108: the last record of an epoch of 120 is at 119
        whole = work.compute(position, 3)
        shares = [work.compute(position, 3, share=Share(k, workers)) for k in range(workers)]
        places = np.concatenate([s.places for s in shares if s.places is not None])
        np.testing.assert_array_equal(np.sort(places), np.arange(whole.rows), "the shares partition the chunk")
        groups = [row_groups_of(pipeline, s.columns["_index"]) for s in shares if s.columns]
        assert sum(map(len, groups)) == len(set().union(*groups)), f"a row group in two shares: {groups}"
        merged = merge_shares(shares)
        for name, column in whole.columns.items():
            np.testing.assert_array_equal(merged.columns[name], column, f"{name} at {position}")


def test_block_shares_take_as_many_row_groups_of_each_window(token_corpus: Path) -> None:
    """In block order the k-th row groups of a window go to worker k mod n: two workers
    each decode one of every window of two row groups, whatever the permutation."""
    pipeline = make_pipeline(token_corpus, "block")  # window=2
    work = ChunkWork(pipeline)
    # The first window is two row groups of 7 records: the first batch (12 of its 14
    # records) reads both, one for each worker.
    shares = [work.compute(0, 1, share=Share(k, 2)) for k in range(2)]
    groups = [row_groups_of(pipeline, share.columns["_index"]) for share in shares]
    assert [len(g) for g in groups] == [1, 1] and groups[0] != groups[1], groups


def test_shares_that_disagree_on_a_column_are_an_error() -> None:
    a = HostChunk({"tokens": np.zeros((2, 4), np.int32)}, places=np.array([0, 2]))
    b = HostChunk({"tokens": np.zeros((1, 5), np.int32)}, places=np.array([1]))
    with pytest.raises(cd.errors.TransformError, match=r"column 'tokens' came out as int32 rows of shape \(4,\)"):
        merge_shares([a, b])
    c = HostChunk({"tokens": np.zeros((1, 4), np.int32), "extra": np.zeros(1)}, places=np.array([1]))
    with pytest.raises(cd.errors.TransformError, match=r"columns \['extra'\] came out"):
        merge_shares([a, c])


def pad_to_longest(batch: dict) -> dict:
    """A transform whose output shape depends on the records it is given."""
    return {**batch, "tokens": cd.pad_or_truncate("tokens", max(len(t) for t in batch["tokens"].to_pylist()))(batch)["tokens"]}


def test_a_transform_whose_shape_depends_on_the_records_fails_clearly_with_workers(
    token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(defaults, "CHUNK_RECORDS", BATCH)
    pipeline = make_pipeline(token_corpus, "global", transforms=[pad_to_longest], epochs=None)
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        # the shares of one chunk disagree, or a chunk disagrees with the first: either is named
        with pytest.raises(cd.errors.TransformError, match=r"'tokens'.*(came out as int|where the first batch had)"):
            for _ in range(20):
                next(loader)


def test_worker_processes_get_the_process_defaults_unless_set(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")  # the user's setting wins
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(1, owner)
        stream = pool.stream(cloudpickle.dumps(make_pipeline(token_corpus)), 0, 1, 0)
        assert not pool.pids, "workers start when a stream first asks for them"
        stream.ready(1)
        environ = Path(f"/proc/{pool.pids[0]}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    finally:
        owner.close()
    for name, value in process_settings().items():
        assert env[name] == ("3" if name == "OPENBLAS_NUM_THREADS" else value), name
    assert env["ARROW_DEFAULT_MEMORY_POOL"] == "jemalloc"


def test_the_sidecar_image_sets_the_same_process_defaults() -> None:
    dockerfile = (Path(__file__).parents[1] / "sidecar_image" / "Dockerfile").read_text()
    serve = dockerfile.split("FROM colocated AS serve", 1)[1]
    for name, value in process_settings().items():
        assert f"{name}={value}" in serve, f"the image's serve stage does not set {name}={value}"
    assert "ARROW_DEFAULT_MEMORY_POOL=jemalloc" in serve


def test_a_worker_is_warmed_where_the_stream_is_before_it_says_it_is_ready(token_corpus: Path, tmp_path: Path) -> None:
    """A worker computes one batch at the stream's position before it is ready (its first
    chunk is then not the one that pays for its imports and file opens); an error there is
    raised by the chunk that meets it, not by the set-up."""
    work = ChunkWork(make_pipeline(token_corpus, "block", epochs=None))
    at = 5 * BATCH
    warm = work.stream_indices(work.stream(at, 1))
    noting = InWorkers(tmp_path, fail_on=int(warm[0]))
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[noting, cd.pad_or_truncate("tokens", 8)])
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(1, owner)
        stream = pool.stream(cloudpickle.dumps(pipeline), 0, 1, at)
        stop = time.monotonic() + WORKERS_S
        while not stream.ready(1):
            assert time.monotonic() < stop, f"the worker was not ready in {WORKERS_S:g} s"
            time.sleep(0.05)
        seen = (tmp_path / str(pool.pids[0])).read_text().split()
        assert sorted(map(int, seen)) == sorted(warm.tolist()), "the worker did not warm at the stream's position"
        stream.ask(at + BATCH, 2, 1)  # the batches after it are computed
        got = stream.take()
        want = work.compute(at + BATCH, 2)
        np.testing.assert_array_equal(got.columns["_index"], want.columns["_index"])
        stream.ask(at, 1, 1)  # the warm batch's error is the chunk's
        with pytest.raises(cd.errors.TransformError, match=f"record {warm[0]}"):
            stream.take()
    finally:
        owner.close()


def test_a_stream_left_early_does_not_leak_into_the_next(token_corpus: Path) -> None:
    """Chunks still in flight for an abandoned stream are passed over, not delivered; a
    chunk is the same made by one worker or shared by two."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    payload, work = cloudpickle.dumps(pipeline), ChunkWork(pipeline)
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(2, owner)
        abandoned = pool.stream(payload, 0, 1, 0)
        for position in (0, 60, 120):
            abandoned.ask(position, 5, 2)
        abandoned.take()  # the first; the other two are left in flight
        stream = pool.stream(payload, 0, 1, 0)
        for position, workers in ((36, 1), (96, 2)):  # one worker's chunk, then one shared by both
            stream.ask(position, 5, workers)
        for position in (36, 96):
            got, want = stream.take(), work.compute(position, 5)
            for name in want.columns:
                np.testing.assert_array_equal(got.columns[name], want.columns[name], f"{name} at {position}")
    finally:
        owner.close()


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_script_without_a_main_guard_can_use_workers(tmp_path: Path, token_corpus: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import colo_data as cd\n"
        "from pipelines import idle_host, make_pipeline, until_workers_made\n"
        "def tag(batch):\n"
        "    return {**batch, 'tag': batch['_index'] % 7}\n"
        f"pipeline = make_pipeline({str(token_corpus)!r}, epochs=None, transforms=[idle_host, tag, cd.pad_or_truncate('tokens', 8)])\n"
        "loader = cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2))\n"
        "batches = until_workers_made(loader)\n"
        "loader.close()\n"
        "print('tags right', all((b['tag'] == b['_index'] % 7).all() for b in batches))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tags right True" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
