"""Core throughput, side by side in one run: colo-data (in process and through the sidecar)
against the vectorised Arrow reference (the machine's limit for this pipeline) and against
Grain pipelines, on the demo corpus, and on a second pipeline with a per-record Python
transform.

Pipeline 1: demo token corpus, `tokens` padded or cut to 1024, batches of 32; each
contender reads one whole epoch per round. Pipeline 2: the same plus a per-record Python
function (BOS/EOS around each record's tokens, as tokenizer code is) before the pad; each
contender reads the first `PER_RECORD_BATCHES` batches. Rounds are interleaved and the
median is reported, so that a noisy neighbour hits every contender alike. Grain runs with
its own defaults: `mp_prefetch()` starts 10 worker processes, `DataLoader(worker_count=None)`
one per `os.cpu_count()`. Run: `make benchmarks` or
`.venv/bin/python benchmarks/core.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grain
import harness
import jax
import numpy as np
import psutil
import pyarrow.parquet as pq
from demo_pad import BATCH, SEQ_LEN, PadRecord, numpy_pad
from harness import AFTER_FIRST, WHOLE

import colo_data as cd
from colo_data import demo
from colo_data.bench import grain_baseline
from colo_data.host.host_pipeline import HostPipeline

PER_RECORD_BATCHES = 250  # pipeline 2: the first 8,000 records


def arrow_reference(files: list[str], to_device: bool) -> Iterator[int]:
    """Read each row group in file order, pad with numpy, cut into batches: no shuffle."""
    for path in files:
        reader = pq.ParquetFile(path, memory_map=True)
        for g in range(reader.num_row_groups):
            table = reader.read_row_group(g, columns=["id", "tokens"])
            tokens = table.column("tokens").combine_chunks()
            padded = numpy_pad(tokens.offsets.to_numpy(), tokens.values.to_numpy(), SEQ_LEN)
            ids = table.column("id").to_numpy()
            for s in range(0, len(ids) - BATCH + 1, BATCH):
                batch = {"id": ids[s : s + BATCH], "tokens": padded[s : s + BATCH]}
                if to_device:
                    jax.block_until_ready(jax.device_put(batch))
                yield BATCH


def colo_host_pipeline(directory: Path) -> Iterator[int]:
    """colo-data's HostPipeline alone: numpy batches, no JAX."""
    pipeline = demo.pipeline(directory, seq_len=SEQ_LEN, global_batch_size=BATCH)
    for chunk in HostPipeline(pipeline).chunks(0, batches=1):
        yield chunk.rows


def colo_loader(directory: Path, shuffle: str, backend: cd.InProcess | cd.Sidecar) -> Iterator[int]:
    """colo-data end to end: global jax.Arrays from cd.Loader."""
    pipeline = demo.pipeline(directory, seq_len=SEQ_LEN, global_batch_size=BATCH, shuffle=shuffle)
    with cd.Loader(pipeline, backend=backend) as loader:
        for batch in loader:
            yield len(jax.block_until_ready(batch["tokens"]))


def add_bos_eos(record: dict) -> dict:
    """A per-record Python function, as tokenizer code is: BOS and EOS around the tokens."""
    tokens = np.asarray(record["tokens"], dtype=np.int32)[: SEQ_LEN - 2]
    return {"id": record["id"], "tokens": np.concatenate([[1], tokens, [2]]).astype(np.int32)}


class AddBosEos(grain.transforms.Map):
    """`add_bos_eos` as a Grain transform."""

    def map(self, record: dict) -> dict:
        return add_bos_eos(record)


def colo_per_record(directory: Path, backend: str) -> Iterator[int]:
    """Pipeline 2 through cd.Loader: cd.per_record(add_bos_eos), then the vectorised pad."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(directory), columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=0),
        transforms=[cd.per_record(add_bos_eos), cd.pad_or_truncate("tokens", SEQ_LEN)],
        global_batch_size=BATCH,
    )
    with cd.Loader(pipeline, backend=backend) as loader:
        for batch in itertools.islice(loader, PER_RECORD_BATCHES):
            yield len(jax.block_until_ready(batch["tokens"]))


def colo_packed(directory: Path) -> Iterator[int]:
    """colo-data with cd.Pack: records packed into rows of 1024 tokens (records counted as
    the positions consumed, not rows)."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(directory), columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=0),
        pack=cd.Pack("tokens", SEQ_LEN),
        global_batch_size=BATCH,
    )
    with cd.Loader(pipeline) as loader:
        done = 0
        for batch in loader:
            jax.block_until_ready(batch["tokens"])
            state = loader.get_state()
            now = state["epoch"] * state["records"] + state["position"]
            yield now - done
            done = now


def grain_map_dataset(directory: Path) -> Iterator[int]:
    """Grain MapDataset over a random-access Parquet source (colo-data's ArrowSource, the
    fastest we have), global shuffle, per-record pad, batch: Grain's random-access path."""
    source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(PadRecord()).batch(BATCH, drop_remainder=True)
    for batch in ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)):
        yield len(batch["tokens"])


def grain_mp_prefetch(directory: Path, per_record: bool = False) -> Iterator[int]:
    """Grain MapDataset (global shuffle, per-record maps, batch) + mp_prefetch() with its
    default options (10 worker processes); each batch put on the device."""
    source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
    ds = grain.MapDataset.source(source).shuffle(seed=0)
    ds = (ds.map(AddBosEos()) if per_record else ds).map(PadRecord()).batch(BATCH, drop_remainder=True)
    iterator = iter(ds.to_iter_dataset().mp_prefetch())
    for batch in itertools.islice(iterator, PER_RECORD_BATCHES if per_record else None):
        yield len(jax.block_until_ready(jax.device_put(batch))["tokens"])
    del iterator  # stops the worker processes


def grain_data_loader(directory: Path, per_record: bool = False) -> Iterator[int]:
    """Grain DataLoader(worker_count=None: os.cpu_count() workers), global shuffle, per-record
    maps, batch; each batch put on the device."""
    source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
    operations = [*([AddBosEos()] if per_record else []), PadRecord(), grain.transforms.Batch(BATCH, drop_remainder=True)]
    loader = grain_baseline.data_loader(source, operations)
    iterator = iter(loader)
    for batch in itertools.islice(iterator, PER_RECORD_BATCHES if per_record else None):
        yield len(jax.block_until_ready(jax.device_put(batch))["tokens"])
    del iterator


def grain_parquet_iter(files: list[str]) -> Iterator[int]:
    """Grain ParquetIterDataset (sequential, no shuffle) + per-record pad + batch."""
    for path in files:
        ds = grain.experimental.ParquetIterDataset(path).map(PadRecord()).batch(BATCH, drop_remainder=True)
        for batch in ds:
            yield len(batch["tokens"])


PIPELINE_1 = "Demo pipeline"
PIPELINE_2 = "Per-record Python transform"
ARROW, ARROW_DEVICE = "Arrow reference (read in order + numpy pad)", "Arrow reference + jax.device_put"
HOST = "colo-data HostPipeline, block shuffle (numpy batches)"
LOADER, LOADER_GLOBAL = "colo-data Loader, block shuffle, 0 workers", "colo-data Loader, global shuffle, 0 workers"
SIDECAR = "colo-data Loader, block shuffle, sidecar backend"
PACKED = "colo-data Loader, block shuffle, packed (cd.Pack, rows of 1024)"
GRAIN_MAP = "Grain MapDataset, global shuffle, per-record pad"
GRAIN_MP = "Grain MapDataset + mp_prefetch (10 workers), global shuffle"
GRAIN_LOADER = "Grain DataLoader (worker_count=None), global shuffle"
PER_RECORD = "colo-data Loader, block shuffle, per_record"
PER_RECORD_SIDECAR = "colo-data Loader, block shuffle, per_record, sidecar backend"
PER_RECORD_GRAIN_MP = "Grain MapDataset + mp_prefetch (10 workers)"
PER_RECORD_GRAIN_LOADER = "Grain DataLoader (worker_count=None)"
# (what, numerator, denominator, key): against the Arrow reference (no start-up of its own)
# whole runs are compared; where a contender starts processes, rates after the first batch
RATIOS = (
    ("HostPipeline (block) / Arrow reference, whole epoch", HOST, ARROW, WHOLE),
    ("Loader (block, 0 workers) / Arrow reference, whole epoch", LOADER, ARROW, WHOLE),
    ("Loader (block, 0 workers) / Arrow reference + device_put, whole epoch", LOADER, ARROW_DEVICE, WHOLE),
    ("Loader (block, 0 workers) / Grain MapDataset global shuffle", LOADER, GRAIN_MAP, AFTER_FIRST),
    ("Loader (global, 0 workers) / Grain MapDataset global shuffle", LOADER_GLOBAL, GRAIN_MAP, AFTER_FIRST),
    ("Loader (block, 0 workers) / Grain MapDataset + mp_prefetch", LOADER, GRAIN_MP, AFTER_FIRST),
    ("Loader (block, 0 workers) / Grain DataLoader", LOADER, GRAIN_LOADER, AFTER_FIRST),
    ("Loader sidecar / Loader in process (block)", SIDECAR, LOADER, AFTER_FIRST),
    ("Loader sidecar / Loader in process (block), whole epoch", SIDECAR, LOADER, WHOLE),
    ("Loader packed / Loader padded (block, 0 workers), source records/s", PACKED, LOADER, AFTER_FIRST),
    ("per-record: Loader / Grain MapDataset + mp_prefetch", PER_RECORD, PER_RECORD_GRAIN_MP, AFTER_FIRST),
    ("per-record: Loader / Grain DataLoader", PER_RECORD, PER_RECORD_GRAIN_LOADER, AFTER_FIRST),
    ("per-record: Loader sidecar / Loader in process", PER_RECORD_SIDECAR, PER_RECORD, AFTER_FIRST),
    ("per-record: Loader sidecar / Loader in process, whole run", PER_RECORD_SIDECAR, PER_RECORD, WHOLE),
)

# the performance page's figures: (the start of a ratio's name, what, peer)
HEADLINES = (
    (
        "Loader (block, 0 workers) / Arrow reference + device_put",
        "colo-data Loader, block shuffle, in process, whole epoch",
        "hand-written Arrow read + numpy pad + `jax.device_put`, no shuffle",
    ),
    ("Loader (block, 0 workers) / Grain MapData", "colo-data Loader, block shuffle", "Grain `MapDataset`, global shuffle"),
    ("Loader (global, 0 workers) / Grain MapDataset global", "colo-data Loader, global shuffle", "the same Grain `MapDataset`"),
    ("Loader (block, 0 workers) / Grain DataLoader", "colo-data Loader, block shuffle", "Grain `DataLoader(worker_count=None)`"),
    (
        "per-record: Loader / Grain DataLoader",
        "with a per-record Python function: colo-data Loader",
        "Grain `DataLoader(worker_count=None)`",
    ),
    ("Loader sidecar / Loader in process (block)", "sidecar backend, after the first batch", "in-process Loader"),
)


def contenders(directory: Path, files: list[str]) -> dict[str, dict[str, Callable[[], Iterator[int]]]]:
    """Every contender's run, by pipeline."""
    return {
        PIPELINE_1: {
            ARROW: lambda: arrow_reference(files, to_device=False),
            ARROW_DEVICE: lambda: arrow_reference(files, to_device=True),
            HOST: lambda: colo_host_pipeline(directory),
            LOADER: lambda: colo_loader(directory, "block", cd.InProcess()),
            "colo-data Loader, block shuffle, 1 worker": lambda: colo_loader(directory, "block", cd.InProcess(workers=1)),
            LOADER_GLOBAL: lambda: colo_loader(directory, "global", cd.InProcess()),
            SIDECAR: lambda: colo_loader(directory, "block", cd.Sidecar()),
            PACKED: lambda: colo_packed(directory),
            GRAIN_MAP: lambda: grain_map_dataset(directory),
            GRAIN_MP: lambda: grain_mp_prefetch(directory),
            GRAIN_LOADER: lambda: grain_data_loader(directory),
            "Grain ParquetIterDataset, no shuffle, per-record pad": lambda: grain_parquet_iter(files),
        },
        PIPELINE_2: {
            PER_RECORD: lambda: colo_per_record(directory, "inprocess"),
            PER_RECORD_SIDECAR: lambda: colo_per_record(directory, "sidecar"),
            PER_RECORD_GRAIN_MP: lambda: grain_mp_prefetch(directory, per_record=True),
            PER_RECORD_GRAIN_LOADER: lambda: grain_data_loader(directory, per_record=True),
        },
    }


def render(tables: dict[str, list[str]], runs: harness.Runs, rounds: int, files: int) -> list[str]:
    """The Markdown tables of one run's measurements, by pipeline."""
    lines = [
        f"Demo corpus ({files} files, 40,000 records), pad to {SEQ_LEN}, batch {BATCH}; median of {rounds} "
        f'interleaved rounds; {psutil.cpu_count()} CPUs. "After the first batch" leaves out each contender\'s '
        'start-up (worker or sidecar processes, first reads), which "first batch" shows.',
    ]
    for table, names in tables.items():
        what = "one epoch" if table == PIPELINE_1 else f"the first {PER_RECORD_BATCHES * BATCH:,} records"
        lines += [
            "",
            f"**{table}** ({what})",
            "",
            "| pipeline | records/s after the first batch | records/s, whole run | first batch (s) | CPU s per 1k records |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {n} | {harness.median(runs[n], AFTER_FIRST):,.0f} | {harness.median(runs[n], WHOLE):,.0f} "
            f"| {harness.median(runs[n], 'first_batch_s'):.2f} | {harness.median(runs[n], 'cpu_s_per_1k'):.3f} |"
            for n in names
        ]
    return lines


def main() -> None:
    """Every contender, round by round; core.md and core.json."""
    args = harness.parse(harness.parser(__doc__))
    directory = demo.corpus()
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings

    by_table = contenders(directory, files)
    runs = harness.interleave(
        {name: partial(harness.measure, run, args.batches) for rows in by_table.values() for name, run in rows.items()},
        args.rounds,
    )
    ratios = [harness.ratio_of_medians(what, runs[a], runs[b], key) for what, a, b, key in RATIOS]
    lines = render({table: list(rows) for table, rows in by_table.items()}, runs, args.rounds, len(files))
    rate = harness.Headline(
        "demo pipeline (pad to 1024, batch 32): colo-data Loader, block shuffle, in process, after the first batch",
        harness.median(runs[LOADER], AFTER_FIRST),
        "records/s",
    )
    headlines = [rate, *harness.headlines(ratios, HEADLINES)]
    harness.write_results("core", args, [*lines, "", *harness.ratio_table(ratios)], runs, ratios, headlines=headlines)


if __name__ == "__main__":
    main()
