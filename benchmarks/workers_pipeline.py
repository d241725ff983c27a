"""The pipelines of benchmarks/workers.py, in a module that imports no JAX: worker
processes and sidecars import it to unpickle the CPU-bound function by name."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import colo_data as cd

VOCAB = 32_000
PASSES = 3  # passes over a record's tokens: about 70 µs of Python a record here, so the transform is the cost
NOTES = "COLO_DATA_BENCH_WORKER_NOTES"  # a folder where each worker process notes when it began its first batches
_began = 0  # batches this process has begun (counted up to 2)
# whether this is a worker process: its command line (a fresh fork server's, or the one a sidecar's
# forked server gives its workers) names the workers' module, also in an older tree (`--before`)
_worker: bool | None = None


def note_start(batch: dict[str, Any]) -> dict[str, Any]:
    """The padded pipelines' first transform: in a worker process, with `NOTES` set, append
    the time (time.monotonic) at which it began its first two batches to NOTES/PID: its
    warm-up batch (computed before it says it is ready) and its first chunk."""
    global _began, _worker
    if _worker is None:  # read once: whether this process shows a worker's command line
        _worker = b"colo_data.workers.processes" in Path("/proc/self/cmdline").read_bytes()
    if _began < 2 and NOTES in os.environ and _worker:
        _began += 1
        with open(Path(os.environ[NOTES]) / str(os.getpid()), "a") as notes:
            notes.write(f"{time.monotonic()}\n")
    return batch


WAIT_S = 0.002  # the `wait` pipeline's wait a record, as a per-record fetch or a remote call would take


def wait_a_while(record: dict[str, Any]) -> dict[str, Any]:
    """The `wait` pipeline's per-record work: `WAIT_S` of waiting and little CPU."""
    time.sleep(WAIT_S)
    return record


def token_passes(record: dict[str, Any]) -> dict[str, Any]:
    """CPU-bound per-record work, as a pure-Python tokenizer's is: `PASSES` passes of one
    Python step per token (a rolling hash into the vocabulary)."""
    tokens = np.asarray(record["tokens"]).tolist()
    for _ in range(PASSES):
        h = 0
        for i, t in enumerate(tokens):
            h = (h * 31 + t) % VOCAB
            tokens[i] = h
    return {**record, "tokens": np.asarray(tokens, dtype=np.int32)}


def corpus(directory: Path) -> Path:
    """12 Parquet files of 6,000 to 12,000 token lists (8 to 160 tokens) in row groups of
    150 to 1,500 rows, uneven on purpose; written once."""
    if (directory / "done").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    for f in range(12):
        n = int(rng.integers(6000, 12000))
        offsets = np.concatenate([[0], np.cumsum(rng.integers(8, 160, n))]).astype(np.int32)
        values = rng.integers(0, VOCAB, offsets[-1], dtype=np.int32)
        table = pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)})
        with pq.ParquetWriter(directory / f"part-{f:03d}.parquet", table.schema) as writer:
            start = 0
            while start < n:
                group = int(rng.integers(150, 1500))
                writer.write_table(table.slice(start, group))
                start += group
    (directory / "done").touch()
    return directory


def wait_and_pad(record: dict[str, Any]) -> dict[str, Any]:
    """Grain's per-record function of the `wait` pipeline's work: `wait_a_while`, then the
    64-token pad that colo-data's pipeline makes with `cd.pad_or_truncate`."""
    tokens = np.asarray(wait_a_while(record)["tokens"], np.int32)[:64]
    return {"tokens": np.pad(tokens, (0, 64 - len(tokens)))}


def grain_default(directory: Path) -> Any:
    """Grain's default iterator over the `wait` pipeline's records, with the same work a
    record: `MapDataset.source(...).map(f).batch(32).to_iter_dataset()`, whose read threads
    (16 by default) overlap the records' waits. Its source is the records read into memory
    first (Grain's best case: a random access into the Parquet files costs each thread about
    0.3 ms of the interpreter, which held it to a quarter of the rate)."""
    import grain  # noqa: PLC0415 - the Grain comparison only

    source = cd.ArrowSource(str(directory), columns=["tokens"])
    columns = source.take(np.arange(len(source))).column("tokens").to_pylist()
    records = [{"tokens": np.asarray(tokens, np.int32)} for tokens in columns]
    return grain.MapDataset.source(records).repeat().map(wait_and_pad).batch(32).to_iter_dataset()


def long_enough(columns: dict[str, Any]) -> np.ndarray:
    """The filter of `cpu filtered`: records of 40 tokens or more (about three in four)."""
    return np.asarray(pc.list_value_length(columns["tokens"])) >= 40


def pipeline(kind: str, directory: Path) -> cd.Pipeline:
    """`light`: block shuffle, a 64-token pad, batch 32; `cpu`: `token_passes` before it
    (both after `note_start`), `wait`: `wait_a_while` there instead; `cpu filtered`: the same keeping `long_enough` records, and
    `cpu packed`: the records packed into rows of 256 tokens, then `token_passes` on each
    row. Both as a user writes them, with default settings: no partitions named (they are
    chosen: 16 of 2 rows) and the CPU work in `transforms=`."""
    transforms: list[Any] = [note_start, cd.pad_or_truncate("tokens", 64)]
    if kind in ("cpu", "cpu filtered"):
        transforms.insert(1, cd.per_record(token_passes))
    if kind == "wait":
        transforms.insert(1, cd.per_record(wait_a_while))
    settings: dict[str, Any] = {}
    if kind == "cpu filtered":
        settings = {"keep": long_enough}
    if kind == "cpu packed":
        transforms = [cd.per_record(token_passes)]
        settings = {"pack": cd.Pack("tokens", 256)}
    return cd.Pipeline(
        source=cd.ArrowSource(str(directory), columns=["tokens"]),
        order=cd.Order(shuffle="block", seed=1),
        transforms=transforms,
        global_batch_size=32,
        epochs=None,
        **settings,
    )
