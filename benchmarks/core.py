"""Core throughput, side by side in one run: colo-data against the vectorised Arrow reference
(the machine's limit for this pipeline) and against Grain pipelines, on the demo corpus.

Pipeline: demo token corpus, `tokens` padded or cut to 1024, batches of 32. Each contender
reads one whole epoch per round; rounds are interleaved and the median is reported, so
that a noisy neighbour hits every contender alike. Run: `make benchmarks` or
`.venv/bin/python benchmarks/core.py [--rounds N] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grain
import jax
import numpy as np
import psutil
import pyarrow.parquet as pq
from absl import flags

import colo_data as cd
from colo_data import demo

SEQ_LEN, BATCH = 1024, 32


def numpy_pad(offsets: np.ndarray, values: np.ndarray, length: int) -> np.ndarray:
    """Pad/truncate every list of a row group at once: one 2-D take and one select."""
    starts, lengths = offsets[:-1].astype(np.int64), np.diff(offsets)
    steps = np.arange(length)
    taken = np.take(values, starts[:, None] + steps[None, :], mode="clip")
    return np.where(steps[None, :] < lengths[:, None], taken, 0)


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
    for batch in cd.HostPipeline(pipeline).batches(0):
        yield len(batch["tokens"])


def colo_loader(directory: Path, shuffle: str, workers: int) -> Iterator[int]:
    """colo-data end to end: global jax.Arrays from cd.Loader."""
    pipeline = demo.pipeline(directory, seq_len=SEQ_LEN, global_batch_size=BATCH, shuffle=shuffle)
    with cd.Loader(pipeline, workers=workers) as loader:
        for batch in loader:
            yield len(jax.block_until_ready(batch["tokens"]))


def colo_packed(directory: Path) -> Iterator[int]:
    """colo-data with cd.Pack: records packed into rows of 1024 tokens (records counted as
    the stream positions consumed, not rows)."""
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


class PadRecord(grain.transforms.Map):
    def map(self, record: dict) -> dict:
        tokens = np.zeros(SEQ_LEN, dtype=np.int32)
        row = np.asarray(record["tokens"][:SEQ_LEN], dtype=np.int32)
        tokens[: len(row)] = row
        return {"id": record["id"], "tokens": tokens}


def grain_map_dataset(directory: Path) -> Iterator[int]:
    """Grain MapDataset over a random-access Parquet source (colo-data's ArrowSource, the
    fastest we have), global shuffle, per-record pad, batch: Grain's random-access path."""
    source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(PadRecord()).batch(BATCH, drop_remainder=True)
    for batch in ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)):
        yield len(batch["tokens"])


def grain_parquet_iter(files: list[str]) -> Iterator[int]:
    """Grain ParquetIterDataset (sequential, no shuffle) + per-record pad + batch."""
    for path in files:
        ds = grain.experimental.ParquetIterDataset(path).map(PadRecord()).batch(BATCH, drop_remainder=True)
        for batch in ds:
            yield len(batch["tokens"])


def measure(run: Callable[[], Iterator[int]]) -> dict[str, float]:
    """Records/s over one full run, and CPU seconds (this process and its children)."""
    me = psutil.Process()

    def cpu() -> float:
        times = me.cpu_times()
        children = sum(c.cpu_times().user + c.cpu_times().system for c in me.children(recursive=True))
        return times.user + times.system + times.children_user + times.children_system + children

    cpu0, t0 = cpu(), time.perf_counter()
    records = sum(run())
    wall, used = time.perf_counter() - t0, cpu() - cpu0
    return {"records": records, "seconds": wall, "records_per_s": records / wall, "cpu_s_per_1k": 1000 * used / records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    flags.FLAGS.mark_as_parsed()
    directory = demo.corpus()
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings

    contenders: dict[str, Callable[[], Iterator[int]]] = {
        "Arrow reference (read in order + numpy pad)": lambda: arrow_reference(files, to_device=False),
        "Arrow reference + jax.device_put": lambda: arrow_reference(files, to_device=True),
        "colo-data HostPipeline, block shuffle (numpy batches)": lambda: colo_host_pipeline(directory),
        "colo-data Loader, block shuffle, 0 workers": lambda: colo_loader(directory, "block", 0),
        "colo-data Loader, block shuffle, 1 worker": lambda: colo_loader(directory, "block", 1),
        "colo-data Loader, global shuffle, 0 workers": lambda: colo_loader(directory, "global", 0),
        "colo-data Loader, block shuffle, packed (cd.Pack, rows of 1024)": lambda: colo_packed(directory),
        "Grain MapDataset, global shuffle, per-record pad": lambda: grain_map_dataset(directory),
        "Grain ParquetIterDataset, no shuffle, per-record pad": lambda: grain_parquet_iter(files),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, run in contenders.items():
            runs[name].append(measure(run))
            print(f"round {r + 1}/{args.rounds}  {name}: {runs[name][-1]['records_per_s']:,.0f} records/s", flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(m[key] for m in runs[name])

    names = list(contenders)
    ref, ref_dev, grain_map = names[0], names[1], names[7]
    ratios = {
        "HostPipeline (block) / Arrow reference": median(names[2], "records_per_s") / median(ref, "records_per_s"),
        "Loader (block, 0 workers) / Arrow reference": median(names[3], "records_per_s") / median(ref, "records_per_s"),
        "Loader (block, 0 workers) / Arrow reference + device_put": median(names[3], "records_per_s")
        / median(ref_dev, "records_per_s"),
        "Loader (block, 0 workers) / Grain MapDataset global shuffle": median(names[3], "records_per_s")
        / median(grain_map, "records_per_s"),
        "Loader (global, 0 workers) / Grain MapDataset global shuffle": median(names[5], "records_per_s")
        / median(grain_map, "records_per_s"),
        "Loader packed / Loader padded (block, 0 workers), records/s": median(names[6], "records_per_s")
        / median(names[3], "records_per_s"),
    }
    lines = [
        f"Demo corpus ({len(files)} files, 40,000 records), pad to {SEQ_LEN}, batch {BATCH}; median of {args.rounds} "
        f"interleaved rounds; {psutil.cpu_count()} CPUs.",
        "",
        "| pipeline | records/s | CPU s per 1k records |",
        "| --- | ---: | ---: |",
        *(f"| {n} | {median(n, 'records_per_s'):,.0f} | {median(n, 'cpu_s_per_1k'):.3f} |" for n in names),
        "",
        "| ratio | value |",
        "| --- | ---: |",
        *(f"| {k} | {v:.2f}x |" for k, v in ratios.items()),
    ]
    table = "\n".join(lines)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core.md").write_text(table + "\n")
    (args.out / "core.json").write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=1))
    print(f"\nwrote {args.out / 'core.md'} and {args.out / 'core.json'}")


if __name__ == "__main__":
    main()
