"""A user's Grain pipeline three ways, side by side, each under a simulated training step as
long as the pipeline's own time per batch (measured first, Grain alone) that holds the GIL
for half of it (a training loop's Python) and sleeps the other half (the accelerator).

The three:

- (a) the Grain pipeline iterated in the trainer's process, as a Grain user runs it;
- (b) the same pipeline, unchanged, as a `cd.GrainPipeline` through the loader's sidecar;
- (c) the equivalent native `cd.Pipeline` over `cd.sources.ArrayRecordSource` (first-fit packing in
  Grain, colo-data's `cd.Pack` here), through the sidecar.

The pipeline is MaxText-style: ArrayRecord files of JSON text records, parse, tokenize
(bytes as token ids), filter, random crop, pack into rows of 512 tokens, batch 32. Rows/s
and the input wait (the share of the wall time the trainer waits in `next()`) after the
first batch (the sidecar starts while a trainer compiles: the first batch's time is shown
apart), medians of interleaved rounds. Goal (issue 22): (b) at least 1.3x (a), with a lower input
wait. Run: `.venv/bin/python benchmarks/grain_pipeline.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grain
import harness
import jax
import numpy as np
from absl import flags
from array_record.python.array_record_module import ArrayRecordWriter
from grain.experimental import FirstFitPackIterDataset

import colo_data as cd

FILES, PER_FILE = 4, 4_000
LENGTH, BATCH = 512, 32
BATCHES = 200  # a run
STEADY = harness.AFTER_FIRST
WAIT = "input_wait"


def corpus() -> list[str]:
    """`FILES` ArrayRecord files of `PER_FILE` JSON text records (20 to 400 words); written once."""
    directory = Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data")) / "grain-bench"
    if not (directory / "done").exists():
        directory.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(7)
        words = [f"w{i}" for i in range(500)]
        for f in range(FILES):
            writer = ArrayRecordWriter(str(directory / f"part-{f}.array_record"), "group_size:1")
            for i in range(f * PER_FILE, (f + 1) * PER_FILE):
                text = " ".join(rng.choice(words, int(rng.integers(20, 400))))
                writer.write(json.dumps({"id": i, "text": text}).encode())
            writer.close()
        (directory / "done").touch()
    return sorted(str(p) for p in directory.glob("*.array_record"))


def parse(record: bytes) -> dict[str, Any]:
    """A JSON record as a dict."""
    return json.loads(record)


def tokenize(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """A record's text as token ids (its bytes plus one), cut to `LENGTH`."""
    tokens = np.frombuffer(record["text"].encode(), np.uint8)[:LENGTH].astype(np.int32) + 1
    return {"tokens": tokens}


def long_enough(record: dict[str, np.ndarray]) -> bool:
    """The filter: records of at least 64 tokens."""
    return len(record["tokens"]) >= 64


def crop(record: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random prefix of a record's tokens, at least half of them."""
    tokens = record["tokens"]
    return {"tokens": tokens[: int(rng.integers(len(tokens) // 2, len(tokens) + 1))]}


def make_dataset(shard: grain.sharding.ShardOptions, paths: list[str]) -> grain.IterDataset:
    """One host's share of the MaxText-style pipeline."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).shuffle(seed=1)
    ds = ds[shard.shard_index :: shard.shard_count].repeat()
    ds = ds.map(parse).map(tokenize).filter(long_enough).random_map(crop, seed=1)
    packed = FirstFitPackIterDataset(ds.to_iter_dataset(), length_struct={"tokens": LENGTH}, num_packing_bins=8)
    return packed.batch(BATCH // shard.shard_count, drop_remainder=True)


def tokenize_chunk(records: list[bytes]) -> dict[str, Any]:
    """(c)'s parse: a chunk of records to token lists at once."""
    texts = [json.loads(r)["text"].encode()[:LENGTH] for r in records]
    return {"tokens": [np.frombuffer(t, np.uint8).astype(np.int32) + 1 for t in texts]}


def keep_long(columns: dict[str, Any]) -> np.ndarray:
    """(c)'s filter, `long_enough` over a chunk."""
    return np.array([len(t) >= 64 for t in columns["tokens"]])


def native(paths: list[str]) -> cd.Pipeline:
    """(c): the same records, shuffled, filtered and packed by colo-data."""
    return cd.Pipeline(
        source=cd.sources.ArrayRecordSource(paths, parse=tokenize_chunk),
        order=cd.Order(shuffle="global", seed=1),
        pack=cd.Pack("tokens", LENGTH, keep=keep_long),
        global_batch_size=BATCH,
        epochs=None,
    )


class Step:
    """A simulated training step of `seconds`: half holding the GIL, half sleeping."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self) -> None:
        end = time.perf_counter() + self.seconds / 2
        while time.perf_counter() < end:
            pass
        time.sleep(self.seconds / 2)


def trained(batches: Iterator[Any], step: Step, waited: list[float]) -> Iterator[int]:
    """`BATCHES` batches read as a training loop reads them: each put on the devices, then a
    step; the time in `next()` after the first batch adds up in `waited[0]`."""
    for i in range(BATCHES):
        t0 = time.perf_counter()
        batch = next(batches)
        jax.block_until_ready(jax.device_put(batch))
        waited[0] += (time.perf_counter() - t0) if i else 0.0
        step()
        yield BATCH


def in_trainer(paths: list[str], step: Step, waited: list[float]) -> Iterator[int]:
    """(a): Grain in the trainer's process."""
    iterator = iter(make_dataset(grain.sharding.ShardOptions(0, 1), paths))
    yield from trained(iterator, step, waited)


def through_loader(pipeline: Any, step: Step, waited: list[float]) -> Iterator[int]:
    """(b) and (c): a loader with the sidecar backend."""
    with cd.Loader(pipeline, backend="sidecar", hosts=1) as loader:
        yield from trained(loader, step, waited)


def measured(run: Callable[[list[float]], Iterator[int]]) -> harness.Measurement:
    """One run, with its input wait: the share of the time after the first batch spent in `next()`."""
    waited = [0.0]
    m = harness.measure(lambda: run(waited))
    m[WAIT] = waited[0] / (m["seconds"] - m["first_batch_s"])
    return m


def pipeline_seconds(paths: list[str]) -> float:
    """The pipeline's own time per batch: Grain alone, in this process, after a warm-up."""
    iterator = iter(make_dataset(grain.sharding.ShardOptions(0, 1), paths))
    for _ in range(5):
        next(iterator)
    t0 = time.perf_counter()
    for _ in range(20):
        next(iterator)
    return (time.perf_counter() - t0) / 20


def main() -> None:
    """Measure the three side by side and write the table and the goal."""
    flags.FLAGS.mark_as_parsed()  # Grain reads absl flags
    args = harness.parse(harness.parser(__doc__))
    global BATCHES
    BATCHES = harness.QUICK_BATCHES if args.quick else BATCHES
    paths = corpus()
    step = Step(pipeline_seconds(paths))
    grain_pipeline = cd.GrainPipeline(make_dataset=functools.partial(make_dataset, paths=paths), global_batch_size=BATCH)
    names = {
        "(a) Grain in the trainer's process": lambda w: in_trainer(paths, step, w),
        "(b) the same as a `cd.GrainPipeline` through the sidecar": lambda w: through_loader(grain_pipeline, step, w),
        "(c) native `cd.Pipeline` over `cd.sources.ArrayRecordSource`, through the sidecar": lambda w: through_loader(
            native(paths), step, w
        ),
    }
    contenders = {name: functools.partial(measured, run) for name, run in names.items()}
    runs = harness.interleave(contenders, args.rounds)
    a, b, c = (runs[n] for n in names)
    lines = [
        f"{FILES} ArrayRecord files of {PER_FILE:,} JSON text records; packed rows of {LENGTH} tokens, batch {BATCH}; "
        f"{BATCHES} batches a run under a step of {1000 * step.seconds:.1f} ms (the pipeline's own time per batch, "
        f"half of it holding the GIL); medians of {args.rounds} interleaved rounds; {os.cpu_count()} CPUs.",
        "",
        "| contender | rows/s | input wait | first batch | all rounds (rows/s) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {n} | {harness.median(r, STEADY):,.0f} | {harness.median(r, WAIT):.0%} | "
            f"{harness.median(r, 'first_batch_s'):.2f} s | {harness.span(harness.values(r, STEADY), ',.0f')} |"
            for n, r in runs.items()
        ),
    ]
    ratios = [
        harness.ratio_within_rounds("(b) / (a)", b, a, STEADY, ">= 1.3"),
        harness.ratio_within_rounds("(a)'s input wait / (b)'s", a, b, WAIT, "> 1"),
        harness.ratio_within_rounds("(c) / (a)", c, a, STEADY),
    ]
    headlines = harness.headlines(
        ratios,
        [
            ("(b) / (a)", "a Grain pipeline as `cd.GrainPipeline` through the sidecar", "Grain in the trainer's process"),
            ("(c) / (a)", "the same as a native `cd.Pipeline` through the sidecar", "Grain in the trainer's process"),
        ],
    )
    harness.write_results("grain", args, [*lines, "", *harness.ratio_table(ratios)], runs, ratios, headlines=headlines)


if __name__ == "__main__":
    main()
