"""A MaxText-style Grain pipeline for the GrainPipeline tests: ArrayRecord files of JSON
records, parsed, tokenized (bytes as token ids), filtered, randomly cropped, packed
first-fit into rows of `LENGTH` tokens (inputs and targets), batched per host, optionally
with Grain's `mp_prefetch`. `write_records` writes the files."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from grain.experimental import ElasticIterator, FirstFitPackIterDataset

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # sidecars and colocated hosts get it by value

LENGTH = 32  # tokens of a packed row
BATCH = 12  # global batch: divisible by 1, 2, 3 hosts
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


def write_records(directory: Path, files: int = 3, records: int = 60) -> list[str]:
    """`files` ArrayRecord files of `records` JSON records each: {"id": i, "text": ...}."""
    rng = np.random.default_rng(0)
    paths = []
    for f in range(files):
        path = str(directory / f"part-{f:02d}.array_record")
        writer = ArrayRecordWriter(path, "group_size:1")
        for r in range(records):
            i = f * records + r
            words = rng.choice(WORDS, size=int(rng.integers(0, 9)))
            writer.write(json.dumps({"id": i, "text": " ".join(words)}).encode())
        writer.close()
        paths.append(path)
    return paths


def parse(record: bytes) -> dict[str, Any]:
    return json.loads(record)


def tokenize(record: dict[str, Any]) -> dict[str, np.ndarray]:
    tokens = np.frombuffer(record["text"].encode(), np.uint8)[:LENGTH].astype(np.int32) + 1
    return {"inputs": tokens, "targets": np.roll(tokens, -1)}


def long_enough(record: dict[str, np.ndarray]) -> bool:
    return len(record["inputs"]) >= 4


def crop(record: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    keep = int(rng.integers(len(record["inputs"]) // 2, len(record["inputs"]) + 1))
    return {name: column[:keep] for name, column in record.items()}


def maxtext_like(shard: grain.sharding.ShardOptions, paths: list[str], workers: int = 0, seed: int = 3) -> grain.IterDataset:
    """One host's share: its shard of the shuffled records, parsed, tokenized, filtered,
    cropped, packed and batched by `BATCH / hosts` (with `workers` mp_prefetch processes)."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).shuffle(seed=seed)
    ds = ds[shard.shard_index :: shard.shard_count]
    ds = ds.map(parse).map(tokenize).filter(long_enough).random_map(crop, seed=seed)
    packed = FirstFitPackIterDataset(
        ds.to_iter_dataset(), length_struct={"inputs": LENGTH, "targets": LENGTH}, num_packing_bins=3, shuffle_bins=False
    )
    out = packed.batch(BATCH // shard.shard_count, drop_remainder=True)
    if workers:
        out = out.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return out


def records_of(shard: grain.sharding.ShardOptions, paths: list[str]) -> grain.MapDataset:
    """One record an element (for `records=True`): tokens padded to `LENGTH`."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))[shard.shard_index :: shard.shard_count]
    return ds.map(parse).map(functools.partial(_padded, length=LENGTH))


def _padded(record: dict[str, Any], length: int) -> dict[str, np.ndarray]:
    tokens = np.frombuffer(record["text"].encode(), np.uint8)[:length].astype(np.int32)
    return {"id": np.int64(record["id"]), "tokens": np.pad(tokens, (0, length - len(tokens)))}


def elastic(shard: grain.sharding.ShardOptions, paths: list[str]) -> ElasticIterator:
    """Grain's elastic iterator over the parsed records: restorable on any host count."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).map(parse)
    ds = ds.map(functools.partial(_padded, length=LENGTH))
    return ElasticIterator(ds, BATCH, shard)


def grain_batches(make_dataset: Any, hosts: int, steps: int) -> list[list[dict[str, np.ndarray]]]:
    """Grain itself, host by host: the first `steps` elements of each host's dataset."""
    out = []
    for h in range(hosts):
        iterator = iter(make_dataset(grain.sharding.ShardOptions(h, hosts)))
        out.append([{k: np.asarray(v) for k, v in next(iterator).items()} for _ in range(steps)])
        if hasattr(iterator, "close"):
            iterator.close()
    return out
