"""Worker processes (colo_data/workers/processes.py): started once and kept across restarts,
light (no JAX in them), usable from a script without a `__main__` guard, the same batches
as without workers; and how a host pipeline uses them (colo_data/host/pool_schedule.py, as
colo_data/host/worker_policy.py counts them) with real processes: never waiting for one
that starts, none where the CPUs are taken or where they would be slower than the host's
own thread, a dead one named with how it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest
from pipelines import (
    WORKERS_S,
    BATCH,
    IdleWorkers,
    InWorkers,
    SlowToStart,
    backend_of,
    idle_host,
    idle_records,
    in_worker_process,
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


def settled(check: Callable[[], bool], seconds: float = WORKERS_S) -> bool:
    """Whether `check()` holds within `seconds` (a bound for a loaded machine, not a timing)."""
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def workers_of(me: psutil.Process) -> list[psutil.Process]:
    return [c for c in me.children(recursive=True) if "colo_data.workers.processes" in " ".join(c.cmdline())]


@pytest.mark.usefixtures("own_cpu_budget")
def test_workers_are_kept_across_restarts_and_hold_no_jax(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "global", epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    me = psutil.Process()
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        first = until_workers_made(loader)
        pids = sorted(p.pid for p in workers_of(me))
        assert 1 <= len(pids) <= 2, f"the workers the policy counted, at most the 2 allowed: {pids}"
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
    """Slow in a worker process only: there, a call (a share of up to 512 records) takes
    1.5 s more than here, so that one worker delivers about a third of what the host's
    thread alone does (a record costs it 1 ms), and the count is not raised again unless a
    loaded machine slows that thread down 4 times."""
    if os.environ.get("COLO_DATA_TEST_TRAINER") != str(os.getpid()):
        time.sleep(1.5)
    return batch


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget")
def test_workers_slower_than_the_hosts_own_thread_are_given_up(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers are counted from the host's own records first; once they have worked, their
    records are measured to cost far more there, the host's thread alone delivers more than
    they would: the count falls to none (their chunks in flight still taken) and stays
    there, and the batches are the same."""
    monkeypatch.setenv("COLO_DATA_TEST_TRAINER", str(os.getpid()))
    transforms = [idle_records, slow_in_workers, cd.pad_or_truncate("tokens", 8)]
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=transforms)

    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=1)) as loader:
        got = read_while_given_up(loader)  # the worker's calls take 1.5 s: it would not pay
        why = loader.telemetry().hosts[0].workers_why
    assert why.startswith("no workers"), why
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "after the pool was given up")


def paced(loader: cd.Loader, got: list[dict], busy: bool) -> None:
    """One batch into `got`, then a wait until 10 ms after it was asked for: a training step
    that sleeps, or (`busy`) that keeps this thread's CPU busy, as a step on the CPU does."""
    due = time.monotonic() + 0.01
    got.append(to_numpy(next(loader)))
    while time.monotonic() < due:
        if not busy:
            time.sleep(max(0.0, due - time.monotonic()))


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget")
def test_a_starting_worker_never_holds_up_the_stream(token_corpus: Path, tmp_path: Path) -> None:
    """Requests go to the workers that are ready: while the second one starts (here, held
    up until the test says go), the stream goes on, made by the first. Before, a starting
    worker was asked for its shares at once, and the stream stopped for its whole start.
    The workers' records wait 1 ms each: one worker cannot feed the test's loop, and the
    policy counts the second."""
    transforms = [idle_records, IdleWorkers(), SlowToStart(tmp_path), cd.pad_or_truncate("tokens", 8)]
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=transforms)
    more: list[dict] = []
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        got = until_workers_made(loader)

        def read() -> None:  # until the second worker waits to start, then 1,500 batches more
            stop = time.monotonic() + 60
            while not (tmp_path / "waiting").exists() and time.monotonic() < stop:
                got.append(to_numpy(next(loader)))
            more.extend(to_numpy(next(loader)) for _ in range(1500))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(90)  # a hang detector, not a timing: this takes seconds
        went_on, read_by_then = not reader.is_alive(), len(more)
        (tmp_path / "go").touch()
        reader.join(60)
    assert (tmp_path / "waiting").exists(), "no second worker was asked for"
    assert went_on and read_by_then == 1500, f"the stream stopped after {read_by_then} batches while the second worker started"
    got += more
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "workers vs none")


@pytest.mark.serial
def test_no_second_worker_where_the_trainer_takes_the_cpu(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of 1 CPU that the trainer's steps keep busy (a step on the CPU takes 10 ms):
    the host's thread alone, or one worker, keeps the trainer fed, and the policy says what
    the trainer takes; the count falls to that (a second worker would only take its CPU
    from the first and the trainer)."""
    monkeypatch.setenv("COLO_DATA_CPUS", "1")
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        got: list[dict] = []
        began = time.monotonic()
        while time.monotonic() - began < 4.0:  # sixteen of the policy's decisions
            paced(loader, got, busy=True)
        host = loader.telemetry().hosts[0]
    at_work = host.workers if host.worker_processes else 0
    assert at_work <= 1 and "the trainer takes" in host.workers_why, (at_work, host.workers_why)
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
@pytest.mark.parametrize("workers", [2, 3, 7])
def test_worker_shares_are_balanced_runs_in_reading_order_that_make_the_chunk(
    token_corpus: Path, shuffle: str, workers: int
) -> None:
    """Each worker computes an equal run (to a record) of a chunk's records taken in
    reading order: a row group is in one share, or in two where a run ends inside it
    (more, where there are more workers than row groups); the shares put back in place are
    the chunk, also for a chunk that straddles two epochs."""
    pipeline = make_pipeline(token_corpus, shuffle, epochs=None)
    work = ChunkWork(pipeline)
    for position in (0, 5 * BATCH, 108):  # 108: the last record of an epoch of 120 is at 119
        whole = work.compute(position, 3)
        shares = [work.compute(position, 3, share=Share(k, workers)) for k in range(workers)]
        sizes = [0 if s.places is None else len(s.places) for s in shares]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == whole.rows, sizes
        places = np.concatenate([s.places for s in shares if s.places is not None])
        np.testing.assert_array_equal(np.sort(places), np.arange(whole.rows), "the shares partition the chunk")
        groups = [row_groups_of(pipeline, s.columns["_index"]) for s in shares if s.columns]
        together = len(set().union(*groups))
        assert sum(map(len, groups)) <= together + len(groups) - 1 or workers > together, f"a row group in many shares: {groups}"
        merged = merge_shares(shares)
        for name, column in whole.columns.items():
            np.testing.assert_array_equal(merged.columns[name], column, f"{name} at {position}")


def test_block_shares_take_a_row_group_each_of_a_window_of_two(token_corpus: Path) -> None:
    """In block order a window's records are read together: two workers each take the
    records of one of its row groups, whatever the permutation."""
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
        feed = pool.feed(cloudpickle.dumps(make_pipeline(token_corpus)), 0, 1, 0)
        assert not pool.pids, "workers start when a feed first asks for them"
        feed.ready(1)
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
    warm = work.indices_at(work.positions(at, 1))
    noting = InWorkers(tmp_path, fail_on=int(warm[0]))
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[noting, cd.pad_or_truncate("tokens", 8)])
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(1, owner)
        feed = pool.feed(cloudpickle.dumps(pipeline), 0, 1, at)
        stop = time.monotonic() + WORKERS_S
        while not feed.ready(1):
            assert time.monotonic() < stop, f"the worker was not ready in {WORKERS_S:g} s"
            time.sleep(0.05)
        seen = (tmp_path / str(pool.pids[0])).read_text().split()
        assert sorted(map(int, seen)) == sorted(warm.tolist()), "the worker did not warm at the stream's position"
        feed.ask(at + BATCH, 2, 1)  # the batches after it are computed
        got = feed.take()
        want = work.compute(at + BATCH, 2)
        np.testing.assert_array_equal(got.columns["_index"], want.columns["_index"])
        feed.ask(at, 1, 1)  # the warm batch's error is the chunk's
        with pytest.raises(cd.errors.TransformError, match=f"record {warm[0]}"):
            feed.take()
    finally:
        owner.close()


def test_a_feed_left_early_does_not_leak_into_the_next(token_corpus: Path) -> None:
    """Chunks still in flight for an abandoned feed are passed over, not delivered; a
    chunk is the same made by one worker or shared by two."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    payload, work = cloudpickle.dumps(pipeline), ChunkWork(pipeline)
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(2, owner)
        abandoned = pool.feed(payload, 0, 1, 0)
        assert settled(lambda: abandoned.ready(2) == 2), "the workers did not set the feed up"
        for position in (0, 60, 120):
            abandoned.ask(position, 5, 2)
        abandoned.take()  # the first; the other two are left in flight
        feed = pool.feed(payload, 0, 1, 0)
        assert settled(lambda: feed.ready(2) == 2), "the workers did not set the feed up"
        for position, workers in ((36, 1), (96, 2)):  # one worker's chunk, then one shared by both
            feed.ask(position, 5, workers)
        for position in (36, 96):
            got, want = feed.take(), work.compute(position, 5)
            for name in want.columns:
                np.testing.assert_array_equal(got.columns[name], want.columns[name], f"{name} at {position}")
    finally:
        owner.close()


class OneSlowWorker:
    """A transform that, in the first worker process to call it, sleeps 50 ms a call (a
    straggler: another job's CPUs, a slow disk), and in every process notes its pid a call."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self, batch: dict) -> dict:
        try:
            (self.directory / "slow").open("x").write(str(os.getpid()))
        except FileExistsError:
            pass
        if (self.directory / "slow").read_text() == str(os.getpid()):
            time.sleep(0.05)
        with (self.directory / "calls").open("a") as calls:
            calls.write(f"{os.getpid()}\n")
        return batch


@pytest.mark.serial
def test_shares_go_to_the_workers_as_they_have_room(token_corpus: Path, tmp_path: Path) -> None:
    """A chunk's shares go to whichever worker has room: beside a straggling worker, the
    other computes most of them (before, each worker got one share of every chunk, and
    every chunk waited for the straggler's); the chunks are those of no workers."""
    transforms = [OneSlowWorker(tmp_path), cd.pad_or_truncate("tokens", 8)]
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=transforms)
    payload, work = cloudpickle.dumps(pipeline), ChunkWork(pipeline)
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(2, owner)
        feed = pool.feed(payload, 0, 1, 0)
        assert settled(lambda: feed.ready(2) == 2), "the workers did not set the feed up"
        (tmp_path / "calls").unlink(missing_ok=True)  # (their warm-up's calls)
        positions = [2 * BATCH * i for i in range(16)]  # 16 chunks of 2 batches, 2 shares each
        for position in positions[:3]:
            feed.ask(position, 2, 2)
        for i, position in enumerate(positions):
            got, want = feed.take(), work.compute(position, 2)
            for name in want.columns:
                np.testing.assert_array_equal(got.columns[name], want.columns[name], f"{name} at {position}")
            if i + 3 < len(positions):
                feed.ask(positions[i + 3], 2, 2)
        pids = pool.pids
    finally:
        owner.close()
    slow = int((tmp_path / "slow").read_text())
    calls = [int(pid) for pid in (tmp_path / "calls").read_text().split()]
    assert slow in pids, "a worker was not the first to call the transform"
    fast = len([pid for pid in calls if pid in pids and pid != slow])
    assert fast >= 2 * calls.count(slow), f"the straggler computed {calls.count(slow)} shares, the other {fast}"


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


def worker_processes_made_some(loader: cd.Loader, me: psutil.Process, backend: str) -> bool:
    """Whether the loader's worker processes have made records (where its telemetry counts
    them: in process, a sidecar), or are running (colocated hosts')."""
    if backend == "colocated":
        return bool(workers_of(me))
    return pool_records(loader) > 0


@pytest.mark.usefixtures("own_cpu_budget")
@pytest.mark.parametrize("backend", ["inprocess", "sidecar", "colocated"])
def test_every_worker_count_gives_the_same_batches_and_a_state_that_resumes_exactly(
    token_corpus: Path, tmp_path: Path, backend: str
) -> None:
    """1 and 3 workers allowed, the count the policy takes as the stream goes: the batches
    are those of none, and a state saved with workers at work resumes exactly with none
    (the batches are global: the same for any host count)."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=[idle_records, cd.pad_or_truncate("tokens", 8)])
    me, alone = psutil.Process(), cd.InProcess(workers=0)
    for workers in (1, 3):
        hosts = None if backend == "colocated" else 1  # colocated: a host per CPU device
        with cd.Loader(pipeline, hosts=hosts, backend=backend_of(backend, workers, tmp_path)) as loader:
            got, stop = [], time.monotonic() + WORKERS_S
            while not worker_processes_made_some(loader, me, backend) or len(got) < 40:
                assert time.monotonic() < stop, f"no worker made anything in {WORKERS_S:g} s"
                got.append(to_numpy(next(loader)))
            got += [to_numpy(next(loader)) for _ in range(40)]
            state = loader.get_state()
        want = read_all(cd.Loader(pipeline, hosts=1, backend=alone), len(got) + 10)
        assert_batches_equal(want[: len(got)], got, f"{backend}, {workers} workers allowed")
        resumed = read_all(cd.Loader(pipeline, hosts=1, state=state, backend=alone), 10)
        assert_batches_equal(want[len(got) :], resumed, f"{backend}, {workers} workers allowed, resumed")


class EndsInWorkers:
    """A transform that, in a worker process, ends it: `os._exit(code)`, or SIGKILL to itself."""

    def __init__(self, code: int | None) -> None:
        self.code = code

    def __call__(self, batch: dict) -> dict:
        if in_worker_process():
            if self.code is None:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(self.code)
        return batch


@pytest.mark.usefixtures("own_cpu_budget")
@pytest.mark.parametrize(("code", "said"), [(3, "worker 0 exited with code 3"), (None, "worker 0 was killed by SIGKILL")])
def test_a_dead_worker_is_named_with_how_it_ended(token_corpus: Path, code: int | None, said: str) -> None:
    """A worker that exits (or is killed) inside a transform: the error names its exit code
    or the signal, not "exit codes [None]" (raised before the fork server had told)."""
    transforms = [idle_host, EndsInWorkers(code), cd.pad_or_truncate("tokens", 8)]
    pipeline = make_pipeline(token_corpus, "block", epochs=None, transforms=transforms)
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=1)) as loader:
        with pytest.raises(cd.ColoDataError, match=rf"a worker process died \({said}\)"):
            stop = time.monotonic() + WORKERS_S
            while time.monotonic() < stop:
                next(loader)
