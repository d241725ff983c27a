"""`colo-data verify` and `cd.verify.verify` of a `cd.GrainPipeline`: a sound Grain
pipeline over Parquet passes (its int64 column included, which JAX's 32-bit mode holds as
int32), through the CLI and from Python, and one whose map is not deterministic fails a
check that names the batch, the host and the column."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import colo_data as cd

ROOT = Path(__file__).resolve().parents[1]
ROWS, BATCH = 48, 12


def rows(shard: grain.sharding.ShardOptions, path: str) -> grain.MapDataset:
    """The host's shard of the Parquet file's rows, shuffled, as numpy records."""
    columns = pq.read_table(path).to_pydict()
    records = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    ds = grain.MapDataset.source(records).shuffle(seed=5)[shard.shard_index :: shard.shard_count]
    return ds.map(lambda r: {"id": np.int64(r["id"]), "score": np.float32(r["score"])})


def batched(shard: grain.sharding.ShardOptions, path: str) -> grain.MapDataset:
    """The sound pipeline: the host's rows batched by its share of the global batch."""
    return rows(shard, path).batch(BATCH // shard.shard_count)


def noisy(shard: grain.sharding.ShardOptions, path: str) -> grain.MapDataset:
    """The bug: a map that draws from an unseeded generator, so each iteration differs."""
    drawn = rows(shard, path).map(lambda r: {**r, "score": np.random.default_rng().random(dtype=np.float32)})
    return drawn.batch(BATCH // shard.shard_count)


# The config's module, written next to it so that the CLI imports it from its working directory.
MODULE = f"""
import functools, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import colo_data as cd
import test_verify_grain as t


def pipeline(path):
    return cd.GrainPipeline(functools.partial(t.batched, path=path), global_batch_size=t.BATCH)
"""


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Parquet file: an int64 id column (values past int16, inside int32) and a float32 one."""
    path = tmp_path_factory.mktemp("verify_grain") / "data.parquet"
    ids = np.arange(ROWS, dtype=np.int64) * 100_003
    pq.write_table(pa.table({"id": ids, "score": (ids % 7).astype(np.float32)}), path, row_group_size=16)
    return str(path)


def colo_data(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`colo-data ARGS` run in `cwd`, as a user runs it."""
    command = [sys.executable, "-m", "colo_data.cli", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_cli_passes_a_grain_pipeline_with_an_int64_column(parquet: str, tmp_path: Path) -> None:
    """In JAX's 32-bit mode the loader's int64 column is int32: the check compares it with
    Grain's rows as JAX holds them, not with Grain's int64 dtype."""
    (tmp_path / "int64_grain.py").write_text(MODULE)
    (tmp_path / "int64.toml").write_text(f'pipeline = "int64_grain:pipeline"\n[args]\npath = "{parquet}"\n')
    run = colo_data(tmp_path, "verify", "int64.toml", "--hosts", "1,2", "--steps", "3")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "FAIL" not in run.stdout, run.stdout
    for line in ("PASS  identical to Grain, 2 host(s), inprocess", "PASS  identical to Grain, 2 host(s), sidecar"):
        assert line in run.stdout, run.stdout


def test_cd_verify_passes_a_sound_grain_pipeline(parquet: str) -> None:
    """Each host count that divides the batch: the loader's batches, in process and through
    sidecars, are Grain's host by host, and the state after a batch continues as Grain does."""
    pipeline = cd.GrainPipeline(functools.partial(batched, path=parquet), global_batch_size=BATCH)
    checks = cd.verify.verify(pipeline, hosts=(1, 2, 5), steps=3, resume_at=1)
    statuses = {check.name: check.status for check in checks}
    assert statuses == {
        "identical to Grain, 1 host(s), inprocess": "PASS",
        "identical to Grain, 1 host(s), sidecar": "PASS",
        "resume, 1 host(s)": "PASS",
        "identical to Grain, 2 host(s), inprocess": "PASS",
        "identical to Grain, 2 host(s), sidecar": "PASS",
        "resume, 2 host(s)": "PASS",
        "identical to Grain, 5 host(s)": "SKIP",
    }, "\n".join(map(str, checks))


def test_cd_verify_fails_a_grain_pipeline_whose_map_is_not_deterministic(parquet: str) -> None:
    """The loader's batches and the resumed ones differ from Grain's own reading: those
    checks fail, naming the batch, host, column and row."""
    pipeline = cd.GrainPipeline(functools.partial(noisy, path=parquet), global_batch_size=BATCH)
    checks = cd.verify.verify(pipeline, hosts=(2,), steps=2)
    failed = {check.name: check.detail for check in checks if check.failed}
    assert set(failed) == {
        "identical to Grain, 2 host(s), inprocess",
        "identical to Grain, 2 host(s), sidecar",
        "resume, 2 host(s)",
    }, "\n".join(map(str, checks))
    assert failed["identical to Grain, 2 host(s), inprocess"].startswith("batch 0, host 0, column 'score': row 0 "), failed
