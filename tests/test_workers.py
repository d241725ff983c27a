"""Worker processes (colo_data/host/workers.py): started once and kept across restarts,
light (no JAX in them), usable from a script without a `__main__` guard, and the same
batches as without workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil

import pytest

import colo_data as cd
from colo_data import defaults
from colo_data.host.chunk import HostChunk, merge_shares
from colo_data.host.chunk_work import ChunkWork, Share
from colo_data.host.pipeline import HostPipeline
from colo_data.workers.processes import WorkerPool
from colo_data.runtime.child_env import process_settings
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.testing import assert_batches_equal, read_all, to_numpy
from pipelines import BATCH, make_pipeline


def workers_of(me: psutil.Process) -> list[psutil.Process]:
    return [c for c in me.children(recursive=True) if "colo_data.workers.processes" in " ".join(c.cmdline())]


def test_workers_are_kept_across_restarts_and_hold_no_jax(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "global", epochs=None)
    me = psutil.Process()
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        first = [to_numpy(next(loader)) for _ in range(60)]  # past the first chunk, which the host's thread makes
        pids = sorted(p.pid for p in workers_of(me))
        assert len(pids) == 2, pids
        loader.set_state(cd.Loader(pipeline).get_state())
        again = [to_numpy(next(loader)) for _ in range(60)]
        assert sorted(p.pid for p in workers_of(me)) == pids, "the same workers serve the restarted stream"
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "jaxlib" not in maps and "xla_extension" not in maps, f"worker {pid} loaded JAX"
    assert_batches_equal(first, again, "after set_state")
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), 60), first, "workers vs none")


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
    with pytest.raises(cd.TransformError, match=r"column 'tokens' came out as int32 rows of shape \(4,\)"):
        merge_shares([a, b])
    c = HostChunk({"tokens": np.zeros((1, 4), np.int32), "extra": np.zeros(1)}, places=np.array([1]))
    with pytest.raises(cd.TransformError, match=r"columns \['extra'\] came out"):
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
        with pytest.raises(cd.TransformError, match=r"'tokens'.*(came out as int|where the first batch had)"):
            for _ in range(20):
                next(loader)


def test_worker_processes_get_the_process_defaults_unless_set(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")  # the user's setting wins
    owner = Lifecycle("test")
    try:
        pool = WorkerPool(1, owner)
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


def test_a_stream_left_early_does_not_leak_into_the_next(token_corpus: Path) -> None:
    """Chunks still in flight for an abandoned stream are passed over, not delivered."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    owner = Lifecycle("test")
    try:
        host = HostPipeline(pipeline, 0, 1, WorkerPool(2, owner))
        abandoned = host.chunks(0, owner)
        next(abandoned), next(abandoned)  # chunk 0 here, chunk 1 from a worker; chunks 2-4 in flight
        abandoned.close()  # type: ignore[attr-defined]
        got = host.chunks(36, owner)
        reference = HostPipeline(pipeline, 0, 1).chunks(36)  # smaller chunks: compare the rows
        have = [next(got) for _ in range(4)]
        rows = sum(chunk.rows for chunk in have)
        want = []
        while sum(chunk.rows for chunk in want) < rows:
            want.append(next(reference))
        for name in have[0].columns:
            np.testing.assert_array_equal(
                np.concatenate([c.columns[name] for c in have]), np.concatenate([c.columns[name] for c in want])[:rows]
            )
    finally:
        owner.close()


def test_a_script_without_a_main_guard_can_use_workers(tmp_path: Path, token_corpus: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import colo_data as cd\n"
        "from pipelines import make_pipeline\n"
        f"loader = cd.Loader(make_pipeline({str(token_corpus)!r}, epochs=None), hosts=1, backend=cd.InProcess(workers=2))\n"
        "rows = sum(len(next(loader)['_index']) for _ in range(40))\n"
        "loader.close()\n"
        "print('rows', rows)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rows 480" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
