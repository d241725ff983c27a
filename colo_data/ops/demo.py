"""The built-in demo: a synthetic token corpus (Parquet files of variable-length `int32`
token lists, several row groups each), written once into a cache folder, and the pipeline
that `make bench` runs on it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from colo_data.io.sources import ArrowSource
from colo_data.spec.order import Order, Shuffle
from colo_data.spec.pipeline import Pipeline
from colo_data.spec.transforms import pad_or_truncate

FILES, ROWS_PER_FILE, ROW_GROUP_SIZE = 8, 5_000, 1_000
MIN_TOKENS, MAX_TOKENS, VOCAB = 64, 2047, 32_000
_VERSION = "demo-v1"


def cache_dir() -> Path:
    """Where the demo corpus lives: `$COLO_DATA_CACHE`, else `~/.cache/colo-data`."""
    return Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data"))


def write_corpus(
    directory: str | os.PathLike[str],
    files: int = FILES,
    rows_per_file: int = ROWS_PER_FILE,
    row_group_size: int = ROW_GROUP_SIZE,
    min_tokens: int = MIN_TOKENS,
    max_tokens: int = MAX_TOKENS,
    seed: int = 0,
) -> Path:
    """Write `files` Parquet files of `rows_per_file` rows (`id: int64`, `tokens: list<int32>`
    of `min_tokens..max_tokens` items) into `directory`; ids are the global record indices."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in range(files):
        lengths = rng.integers(min_tokens, max_tokens + 1, rows_per_file)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, VOCAB, offsets[-1], dtype=np.int32)))
        ids = pa.array(np.arange(f * rows_per_file, (f + 1) * rows_per_file, dtype=np.int64))
        table = pa.table({"id": ids, "tokens": tokens})
        pq.write_table(table, out / f"part-{f:05d}.parquet", row_group_size=row_group_size)
    return out


def corpus() -> Path:
    """The demo corpus directory, written on first use (atomically, so concurrent first
    uses are safe)."""
    target = cache_dir() / _VERSION
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write_corpus(staging)
        os.replace(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def pipeline(
    data_dir: str | os.PathLike[str] | None = None,
    seq_len: int = 1024,
    global_batch_size: int = 32,
    shuffle: Shuffle = "block",
    seed: int = 0,
    epochs: int | None = 1,
) -> Pipeline:
    """The demo pipeline: tokens padded or cut to `seq_len`, batches of `global_batch_size`,
    with the global record index in `_index`."""
    directory = corpus() if data_dir is None else Path(data_dir)
    return Pipeline(
        source=ArrowSource(str(directory), columns=["id", "tokens"]),
        order=Order(shuffle=shuffle, seed=seed),
        transforms=[pad_or_truncate("tokens", seq_len)],
        global_batch_size=global_batch_size,
        epochs=epochs,
        index_column="_index",
    )
