"""Packing side by side: fill (the share of a batch's tokens that are real) and records/s of
`cd.Pack`'s next-, first- and best-fit against Grain's `FirstFitPackIterDataset` and
`BestFitPackIterDataset`, on the same records in the same order, batches of 16 rows of 512
tokens, records cut to 512 tokens (Grain's packers need that), no limit on records a row.

Two corpora:

- the tokenized demo text corpus (`colo_data.demo.text_corpus()`, its BPE tokenizer;
  the three components' texts interleaved), and
- a long-tailed length distribution (log-normal lengths, median about 150 tokens).

Grain packs with one bin a row (`num_packing_bins=16`), as colo-data packs a batch's rows;
the fill counts full batches only (the last, partial one apart). Then the language-model
demo (`configs/lm.toml`: mixture, tokenize, pack into rows of 1024) with today's default
(best fit) against next fit, the earlier default. Goals (issue 23): colo-data's fullest
fills at least as much as Grain's fullest on both; the LM demo keeps at least 0.9x of its
records/s with the new default. Run: `.venv/bin/python benchmarks/packing.py [--rounds N]
[--quick] [--out DIR]`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grain
import harness
import jax
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from grain.experimental import BestFitPackIterDataset, FirstFitPackIterDataset
from tokenizers import Tokenizer

import colo_data as cd
from colo_data import demo

LENGTH, ROWS = 512, 16
LONG_TAILED = 20_000  # records
LM_RECORDS = 12_000  # source records an LM demo run packs
WHOLE = harness.WHOLE
METHODS = ("next_fit", "first_fit", "best_fit")
GRAIN = {"Grain FirstFitPackIterDataset": FirstFitPackIterDataset, "Grain BestFitPackIterDataset": BestFitPackIterDataset}


def corpora() -> dict[str, Path]:
    """The two record sets as Parquet files of one `tokens` column (int32 lists, cut to
    `LENGTH`), in the order both packers read them; written once."""
    folder = Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data")) / "packing-bench"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"demo text, tokenized": folder / "demo-text.parquet", "long-tailed lengths": folder / "long-tailed.parquet"}
    if not paths["demo text, tokenized"].exists():
        directory = demo.text_corpus()
        tokenizer = Tokenizer.from_file(str(directory / demo.TOKENIZER_FILE))
        parts = [pq.read_table(sorted(str(p) for p in (directory / c).rglob("*.parquet"))) for c in demo.TEXT_COMPONENTS]
        texts = [t for group in itertools.zip_longest(*(p.column("text").to_pylist() for p in parts)) for t in group if t]
        ids = [e.ids[:LENGTH] for e in tokenizer.encode_batch_fast(texts)]
        _write(paths["demo text, tokenized"], ids)
    if not paths["long-tailed lengths"].exists():
        rng = np.random.default_rng(23)
        lengths = np.minimum(np.exp(rng.normal(5.0, 1.0, LONG_TAILED)).astype(np.int64) + 1, LENGTH)
        _write(paths["long-tailed lengths"], [rng.integers(1, 32_000, n).tolist() for n in lengths])
    return paths


def _write(path: Path, ids: list[list[int]]) -> None:
    table = pa.table({"tokens": pa.array(ids, pa.list_(pa.int32()))})
    pq.write_table(table, str(path) + ".tmp", row_group_size=2_048)
    os.replace(str(path) + ".tmp", path)


def colo_data_batches(path: Path, method: str) -> Iterator[np.ndarray]:
    """`cd.Pack` through `cd.Loader`, in file order: each batch's segment ids."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(path)),
        pack=cd.Pack("tokens", LENGTH, max_segments=LENGTH, method=method),
        global_batch_size=ROWS,
    )
    with cd.Loader(pipeline) as loader:
        for batch in loader:
            yield np.asarray(batch["segment_ids"])


def grain_batches(path: Path, packer: Callable[..., grain.IterDataset]) -> Iterator[np.ndarray]:
    """Grain's packer over the same records in the same order, one bin a row, batched by
    `ROWS`: each batch's segment ids."""
    tokens = pq.read_table(path).column("tokens").to_numpy(zero_copy_only=False)
    records = grain.MapDataset.source(tokens).map(lambda t: {"tokens": t}).to_iter_dataset()
    packed = packer(records, length_struct={"tokens": LENGTH}, num_packing_bins=ROWS, shuffle_bins=False)
    for batch in packed.batch(ROWS):
        yield np.asarray(batch["tokens_segment_ids"])


def records_of(batches: Iterator[np.ndarray]) -> Iterator[int]:
    """The records each batch holds (a row's segment ids count 1, 2, ...)."""
    for segment_ids in batches:
        yield int(segment_ids.max(axis=1).sum())


def fill(batches: Iterator[np.ndarray], rows: int = ROWS) -> float:
    """The share of real tokens in the full batches (of `rows` rows)."""
    real = slots = 0
    for segment_ids in batches:
        if len(segment_ids) == rows:
            real, slots = real + int((segment_ids > 0).sum()), slots + segment_ids.size
    return real / slots


def lm_demo(method: str, records: int) -> Iterator[int]:
    """The LM demo pipeline with `method`, until `records` source records are packed."""
    pipeline = demo.lm_pipeline()
    pipeline = dataclasses.replace(pipeline, pack=dataclasses.replace(pipeline.pack, method=method))
    seen = 0
    with cd.Loader(pipeline) as loader:
        while seen < records:
            batch = jax.block_until_ready(next(loader))
            placed = int((np.asarray(batch["_component"]) >= 0).sum())
            seen += placed
            yield placed


def lm_fill(method: str, batches: int) -> float:
    """The LM demo's fill over its first `batches` batches with `method`."""
    pipeline = demo.lm_pipeline()
    pipeline = dataclasses.replace(pipeline, pack=dataclasses.replace(pipeline.pack, method=method))
    with cd.Loader(pipeline) as loader:
        return fill((np.asarray(b["segment_ids"]) for b in itertools.islice(loader, batches)), pipeline.global_batch_size)


def main() -> None:
    """Fill once per contender (deterministic), records/s in interleaved rounds; packing.md
    and packing.json."""
    args = harness.parse(harness.parser(__doc__))
    paths = corpora()
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings
    contenders: dict[str, Callable[[], Iterator[np.ndarray]]] = {}
    for data, path in paths.items():
        for method in METHODS:
            contenders[f"{data}: cd.Pack {method}"] = partial(colo_data_batches, path, method)
        for name, packer in GRAIN.items():
            contenders[f"{data}: {name}"] = partial(grain_batches, path, packer)
    fills = {name: fill(make()) for name, make in contenders.items()}
    lm_records = 1_000 if args.quick else LM_RECORDS
    lm = {f"LM demo: cd.Pack {m}": partial(lm_demo, m, lm_records) for m in ("next_fit", "best_fit")}
    for name in lm:
        fills[name] = lm_fill(name.rsplit(" ", 1)[1], 20 if args.quick else 100)
    timed = {
        name: partial(harness.measure, lambda make=make: records_of(make()), args.batches) for name, make in contenders.items()
    }
    timed.update({name: partial(harness.measure, run, args.batches) for name, run in lm.items()})
    runs = harness.interleave(timed, args.rounds)

    lines = [
        f"Batches of {ROWS} rows of {LENGTH} tokens (the LM demo: 32 of 1024), records in file order; fill of the full "
        f"batches, records/s the median of {args.rounds} interleaved rounds; {psutil.cpu_count()} CPUs.",
        "",
        "| packer | fill | records/s | all rounds |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {n} | {fills[n]:.3f} | {harness.median(r, WHOLE):,.0f} | {harness.span(harness.values(r, WHOLE), ',.0f')} |"
            for n, r in runs.items()
        ),
    ]
    ratios = []
    for data in paths:
        ours = max(fills[f"{data}: cd.Pack {m}"] for m in METHODS)
        theirs = max(fills[f"{data}: {n}"] for n in GRAIN)
        name = f"{data}: colo-data's fullest fill / Grain's fullest"
        ratios.append(harness.Ratio(name, ours / theirs, harness.Goal.of(">= 1")))
    ratios.append(
        harness.ratio_within_rounds(
            "LM demo records/s: best fit (the default) / next fit (the earlier default)",
            runs["LM demo: cd.Pack best_fit"], runs["LM demo: cd.Pack next_fit"], WHOLE, ">= 0.9",
        )
    )
    data = "long-tailed lengths"
    best, grain_best = (harness.median(runs[f"{data}: {n}"], WHOLE) for n in ("cd.Pack best_fit", "Grain BestFitPackIterDataset"))
    speed = harness.Headline(f"`cd.Pack` best fit, records/s, {data}", best / grain_best, "x", "Grain `BestFitPackIterDataset`")
    picked = [
        (f"{data}: colo-data's fullest", f"`cd.Pack` fill, {data}", "Grain's fullest packer"),
        ("LM demo records/s: best fit", "LM demo, best fit (the default)", "next fit"),
    ]
    headlines = [speed, *harness.headlines(ratios, picked)]
    lines = [*lines, "", *harness.ratio_table(ratios)]
    harness.write_results("packing", args, lines, runs, ratios, details={"fill": fills}, headlines=headlines)


if __name__ == "__main__":
    main()
