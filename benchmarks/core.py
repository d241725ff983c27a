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
from colo_data.ops import demo

SEQ_LEN, BATCH = 1024, 32
PER_RECORD_BATCHES = 250  # pipeline 2: the first 8,000 records


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


def colo_loader(directory: Path, shuffle: str, workers: int | None, backend: str = "inprocess") -> Iterator[int]:
    """colo-data end to end: global jax.Arrays from cd.Loader."""
    pipeline = demo.pipeline(directory, seq_len=SEQ_LEN, global_batch_size=BATCH, shuffle=shuffle)
    with cd.Loader(pipeline, workers=workers, backend=backend) as loader:
        for batch in loader:
            yield len(jax.block_until_ready(batch["tokens"]))


def add_bos_eos(record: dict) -> dict:
    """A per-record Python function, as tokenizer code is: BOS and EOS around the tokens."""
    tokens = np.asarray(record["tokens"], dtype=np.int32)[: SEQ_LEN - 2]
    return {"id": record["id"], "tokens": np.concatenate([[1], tokens, [2]]).astype(np.int32)}


class AddBosEos(grain.transforms.Map):
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
        for _, batch in zip(range(PER_RECORD_BATCHES), loader):
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


def grain_mp_prefetch(directory: Path, per_record: bool = False) -> Iterator[int]:
    """Grain MapDataset (global shuffle, per-record maps, batch) + mp_prefetch() with its
    default options (10 worker processes); each batch put on the device."""
    source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
    ds = grain.MapDataset.source(source).shuffle(seed=0)
    ds = (ds.map(AddBosEos()) if per_record else ds).map(PadRecord()).batch(BATCH, drop_remainder=True)
    iterator = iter(ds.to_iter_dataset().mp_prefetch())
    for _, batch in zip(range(PER_RECORD_BATCHES if per_record else 2**62), iterator):
        yield len(jax.block_until_ready(jax.device_put(batch))["tokens"])
    del iterator  # stops the worker processes


def grain_data_loader(directory: Path, per_record: bool = False) -> Iterator[int]:
    """Grain DataLoader(worker_count=None: os.cpu_count() workers), global shuffle, per-record
    maps, batch; each batch put on the device."""
    source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(num_records=len(source), shuffle=True, seed=0, num_epochs=1),
        operations=[*([AddBosEos()] if per_record else []), PadRecord(), grain.transforms.Batch(BATCH, drop_remainder=True)],
        worker_count=None,
    )
    iterator = iter(loader)
    for _, batch in zip(range(PER_RECORD_BATCHES if per_record else 2**62), iterator):
        yield len(jax.block_until_ready(jax.device_put(batch))["tokens"])
    del iterator


def grain_parquet_iter(files: list[str]) -> Iterator[int]:
    """Grain ParquetIterDataset (sequential, no shuffle) + per-record pad + batch."""
    for path in files:
        ds = grain.experimental.ParquetIterDataset(path).map(PadRecord()).batch(BATCH, drop_remainder=True)
        for batch in ds:
            yield len(batch["tokens"])


def measure(run: Callable[[], Iterator[int]]) -> dict[str, float]:
    """Records/s over one full run and after its first batch (start-up apart), and CPU
    seconds (this process and its children)."""
    me = psutil.Process()

    def cpu() -> float:
        times = me.cpu_times()
        children = sum(c.cpu_times().user + c.cpu_times().system for c in me.children(recursive=True))
        return times.user + times.system + times.children_user + times.children_system + children

    cpu0, t0 = cpu(), time.perf_counter()
    records, first, first_s = 0, 0, 0.0
    for n in run():
        if not records:
            first, first_s = n, time.perf_counter() - t0
        records += n
    wall, used = time.perf_counter() - t0, cpu() - cpu0
    return {
        "records": records,
        "seconds": wall,
        "first_batch_s": first_s,
        "records_per_s": records / wall,
        "after_first_per_s": (records - first) / (wall - first_s),
        "cpu_s_per_1k": 1000 * used / records,
    }


PIPELINE_1 = "Demo pipeline"
PIPELINE_2 = "Per-record Python transform"


Runs = dict[str, dict[str, list[dict[str, float]]]]
WHOLE = "records_per_s"  # whole run, start-up included
AFTER_FIRST = "after_first_per_s"


def render(runs: Runs, rounds: int, files: int) -> tuple[str, dict[str, float]]:
    """The Markdown tables and the ratios of one run's measurements. Against the Arrow
    reference (no start-up of its own) whole runs are compared; where a contender starts
    processes, rates after the first batch, with the whole run beside them."""

    def rate(table: str, name: str, key: str = AFTER_FIRST) -> float:
        return statistics.median(m[key] for m in runs[table][name])

    def ratio(table: str, a: str, b: str, key: str = AFTER_FIRST) -> float:
        return rate(table, a, key) / rate(table, b, key)

    loader, one, two = "colo-data Loader, block shuffle, 0 workers", PIPELINE_1, PIPELINE_2
    arrow, host = "Arrow reference (read in order + numpy pad)", "colo-data HostPipeline, block shuffle (numpy batches)"
    sidecar, grain_map = "colo-data Loader, block shuffle, sidecar backend", "Grain MapDataset, global shuffle, per-record pad"
    per_record, per_record_sidecar = "colo-data Loader, block shuffle, per_record", "colo-data Loader, block shuffle, per_record, sidecar backend"
    ratios = {
        "HostPipeline (block) / Arrow reference, whole epoch": ratio(one, host, arrow, WHOLE),
        "Loader (block, 0 workers) / Arrow reference, whole epoch": ratio(one, loader, arrow, WHOLE),
        "Loader (block, 0 workers) / Arrow reference + device_put, whole epoch": ratio(one, loader, "Arrow reference + jax.device_put", WHOLE),
        "Loader (block, 0 workers) / Grain MapDataset global shuffle": ratio(one, loader, grain_map),
        "Loader (global, 0 workers) / Grain MapDataset global shuffle": ratio(one, "colo-data Loader, global shuffle, 0 workers", grain_map),
        "Loader (block, 0 workers) / Grain MapDataset + mp_prefetch": ratio(one, loader, "Grain MapDataset + mp_prefetch (10 workers), global shuffle"),
        "Loader (block, 0 workers) / Grain DataLoader": ratio(one, loader, "Grain DataLoader (worker_count=None), global shuffle"),
        "Loader sidecar / Loader in process (block)": ratio(one, sidecar, loader),
        "Loader sidecar / Loader in process (block), whole epoch": ratio(one, sidecar, loader, WHOLE),
        "Loader packed / Loader padded (block, 0 workers), source records/s": ratio(
            one, "colo-data Loader, block shuffle, packed (cd.Pack, rows of 1024)", loader
        ),
        "per-record: Loader / Grain MapDataset + mp_prefetch": ratio(two, per_record, "Grain MapDataset + mp_prefetch (10 workers)"),
        "per-record: Loader / Grain DataLoader": ratio(two, per_record, "Grain DataLoader (worker_count=None)"),
        "per-record: Loader sidecar / Loader in process": ratio(two, per_record_sidecar, per_record),
        "per-record: Loader sidecar / Loader in process, whole run": ratio(two, per_record_sidecar, per_record, WHOLE),
    }
    lines = [
        f"Demo corpus ({files} files, 40,000 records), pad to {SEQ_LEN}, batch {BATCH}; median of {rounds} "
        f"interleaved rounds; {psutil.cpu_count()} CPUs. \"After the first batch\" leaves out each contender's "
        "start-up (worker or sidecar processes, first reads), which \"first batch\" shows.",
    ]
    for table, rows in runs.items():
        what = "one epoch" if table == PIPELINE_1 else f"the first {PER_RECORD_BATCHES * BATCH:,} records"
        lines += [
            "", f"**{table}** ({what})", "",
            "| pipeline | records/s after the first batch | records/s, whole run | first batch (s) | CPU s per 1k records |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {n} | {rate(table, n):,.0f} | {rate(table, n, WHOLE):,.0f} | {rate(table, n, 'first_batch_s'):.2f} "
            f"| {rate(table, n, 'cpu_s_per_1k'):.3f} |"
            for n in rows
        ]
    lines += ["", "| ratio | value |", "| --- | ---: |", *(f"| {k} | {v:.2f}x |" for k, v in ratios.items())]
    return "\n".join(lines), ratios


def arguments(doc: str) -> argparse.Namespace:
    """`--rounds N` and `--out DIR`, the options of the side-by-side benchmarks (`doc`'s first
    line is the help); absl's flags marked parsed, as Grain needs."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    flags.FLAGS.mark_as_parsed()
    return args


def main() -> None:
    args = arguments(__doc__)
    directory = demo.corpus()
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings

    contenders: dict[str, dict[str, Callable[[], Iterator[int]]]] = {
        PIPELINE_1: {
            "Arrow reference (read in order + numpy pad)": lambda: arrow_reference(files, to_device=False),
            "Arrow reference + jax.device_put": lambda: arrow_reference(files, to_device=True),
            "colo-data HostPipeline, block shuffle (numpy batches)": lambda: colo_host_pipeline(directory),
            "colo-data Loader, block shuffle, 0 workers": lambda: colo_loader(directory, "block", 0),
            "colo-data Loader, block shuffle, 1 worker": lambda: colo_loader(directory, "block", 1),
            "colo-data Loader, global shuffle, 0 workers": lambda: colo_loader(directory, "global", 0),
            "colo-data Loader, block shuffle, sidecar backend": lambda: colo_loader(directory, "block", None, "sidecar"),
            "colo-data Loader, block shuffle, packed (cd.Pack, rows of 1024)": lambda: colo_packed(directory),
            "Grain MapDataset, global shuffle, per-record pad": lambda: grain_map_dataset(directory),
            "Grain MapDataset + mp_prefetch (10 workers), global shuffle": lambda: grain_mp_prefetch(directory),
            "Grain DataLoader (worker_count=None), global shuffle": lambda: grain_data_loader(directory),
            "Grain ParquetIterDataset, no shuffle, per-record pad": lambda: grain_parquet_iter(files),
        },
        PIPELINE_2: {
            "colo-data Loader, block shuffle, per_record": lambda: colo_per_record(directory, "inprocess"),
            "colo-data Loader, block shuffle, per_record, sidecar backend": lambda: colo_per_record(directory, "sidecar"),
            "Grain MapDataset + mp_prefetch (10 workers)": lambda: grain_mp_prefetch(directory, per_record=True),
            "Grain DataLoader (worker_count=None)": lambda: grain_data_loader(directory, per_record=True),
        },
    }
    runs: Runs = {table: {name: [] for name in rows} for table, rows in contenders.items()}
    for r in range(args.rounds):
        for table, rows in contenders.items():
            for name, run in rows.items():
                runs[table][name].append(measure(run))
                m = runs[table][name][-1]
                print(
                    f"round {r + 1}/{args.rounds}  {name}: {m[AFTER_FIRST]:,.0f} records/s after the first batch "
                    f"({m['first_batch_s']:.2f} s)",
                    flush=True,
                )

    table_md, ratios = render(runs, args.rounds, len(files))
    print("\n" + table_md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core.md").write_text(table_md + "\n")
    (args.out / "core.json").write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=1))
    print(f"\nwrote {args.out / 'core.md'} and {args.out / 'core.json'}")


if __name__ == "__main__":
    main()
