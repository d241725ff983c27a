"""Worker processes (colo_data/host/workers.py): started once and kept across restarts,
light (no JAX in them), usable from a script without a `__main__` guard, and the same
batches as without workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil

import colo_data as cd
from colo_data.host.pipeline import HostPipeline
from colo_data.host.workers import WorkerPool
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.testing import assert_batches_equal, read_all, to_numpy
from pipelines import make_pipeline


def workers_of(me: psutil.Process) -> list[psutil.Process]:
    return [c for c in me.children(recursive=True) if "colo_data.host.workers" in " ".join(c.cmdline())]


def test_workers_are_kept_across_restarts_and_hold_no_jax(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "global", epochs=None)
    me = psutil.Process()
    with cd.Loader(pipeline, hosts=1, workers=2) as loader:
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


def test_a_stream_left_early_does_not_leak_into_the_next(token_corpus: Path) -> None:
    """Chunks still in flight for an abandoned stream are passed over, not delivered."""
    pipeline = make_pipeline(token_corpus, "block", epochs=None)
    owner = Lifecycle("test")
    try:
        host = HostPipeline(pipeline, 0, 1, workers=2)
        host.pool = WorkerPool(2, owner)
        abandoned = host.chunks(0, owner)
        next(abandoned), next(abandoned)  # chunk 0 here, chunk 1 from a worker; chunks 2-4 in flight
        abandoned.close()  # type: ignore[attr-defined]
        got = host.chunks(36, owner)
        reference = HostPipeline(pipeline, 0, 1).chunks(36)
        for _ in range(6):
            want, have = next(reference), next(got)
            for name in want.columns:
                np.testing.assert_array_equal(have.columns[name], want.columns[name])
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
        f"loader = cd.Loader(make_pipeline({str(token_corpus)!r}, epochs=None), hosts=1, workers=2)\n"
        "rows = sum(len(next(loader)['_index']) for _ in range(40))\n"
        "loader.close()\n"
        "print('rows', rows)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rows 480" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
