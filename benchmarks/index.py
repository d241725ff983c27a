"""Start-up from object storage with and without a dataset index, side by side in one run:
a source of `OBJECTS` Parquet objects behind `DELAY_MS` of added latency per request, the
time and the store requests until the source is made and until the first batch.

Corpus: the demo corpus (`colo_data.demo.corpus()`, 40,000 token lists) rewritten as
`OBJECTS` objects of one row group each, uploaded twice to a local S3 server (moto, read
through pyarrow's client) and a GCS server (gcp-storage-emulator, read through gcsfs: pyarrow's
GCS client holds the GIL for a round trip per object it opens, docs/object-storage.md): one
bucket bare, one with the index that `cd.write_index` wrote. Pipeline: the demo's (block
shuffle, pad to 1,024, batches of 64) through `cd.Loader` in process. Each run makes a new client (nothing cached) behind a
`FaultProxy` that adds the delay and counts requests. Rounds interleave the contenders and
medians are reported. Goals, with the index: the first batch within 3 s, and at most 50
requests at start-up (to make the source: the listing and the index). The requests until the
first batch are reported too: they add each object the first chunk reads (open, footer, row
group) and the read-ahead begun before the batch is handed on. Run: `make benchmarks` or
`.venv/bin/python benchmarks/index.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import harness
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import colo_data as cd
from colo_data import demo
from colo_data.testing.storage import FaultProxy, ObjectStore, gcsfs_server, s3_server

OBJECTS, QUICK_OBJECTS = 1000, 100
DELAY_MS = 100
SEQ_LEN, BATCH = 1024, 64
BUCKETS = {"no index": "bare", "index": "indexed"}
# with the index: (what, the measurement's key, its unit in the table, the goal)
GOALS = (("first batch, s", "first_batch_s", " s", "<= 3"), ("requests to make the source", "source_requests", "", "<= 50"))


def split_corpus(objects: int) -> Path:
    """The demo corpus as `objects` Parquet files of one row group each, in a new folder."""
    table = pa.concat_tables(pq.read_table(p, columns=["id", "tokens"]) for p in sorted(demo.corpus().glob("*.parquet")))
    out = Path(tempfile.mkdtemp(prefix="colo-data-index-bench-"))
    rows = -(-table.num_rows // objects)
    for i in range(objects):
        pq.write_table(table.slice(i * rows, rows), out / f"part-{i:05d}.parquet")
    return out


def start_up(store: ObjectStore, proxy: FaultProxy, bucket: str) -> harness.Measurement:
    """One start: make the source and the loader with a new client, take the first batch."""
    fs = store.filesystem(proxy.endpoint)
    before, t0 = proxy.requests, time.perf_counter()
    source = cd.ArrowSource(bucket, columns=["id", "tokens"], filesystem=fs)
    made_s, made = time.perf_counter() - t0, proxy.requests - before
    pipeline = cd.Pipeline(
        source=source,
        order=cd.Order(shuffle="block", seed=0),
        transforms=[cd.pad_or_truncate("tokens", SEQ_LEN)],
        global_batch_size=BATCH,
    )
    with cd.Loader(pipeline, warmup=0) as loader:
        jax.block_until_ready(next(loader))
        first_s, first = time.perf_counter() - t0, proxy.requests - before
    return {"source_s": made_s, "source_requests": made, "first_batch_s": first_s, "first_requests": first}


def show(m: harness.Measurement) -> str:
    """One run's progress line."""
    return (
        f"source made in {m['source_s']:.2f} s ({m['source_requests']} requests), first batch at "
        f"{m['first_batch_s']:.2f} s ({m['first_requests']} requests)"
    )


def main() -> None:
    """The start-up table; index.md and index.json."""
    options = harness.parser(__doc__)
    args = harness.parse(options)
    objects = QUICK_OBJECTS if args.quick else OBJECTS
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings
    corpus = split_corpus(objects)
    contenders: dict[str, Callable[[], harness.Measurement]] = {}
    try:
        with ExitStack() as stack:
            for kind, server in (("S3", s3_server), ("GCS", gcsfs_server)):
                store = stack.enter_context(server())
                for bucket in BUCKETS.values():
                    store.upload(corpus, bucket)
                cd.write_index(f"{store.kind}://{BUCKETS['index']}", filesystem=store.pyarrow_filesystem())
                proxy = stack.enter_context(FaultProxy(store.endpoint, delay_s=DELAY_MS / 1000))
                for label, bucket in BUCKETS.items():
                    contenders[f"{kind}, {label}"] = lambda s=store, p=proxy, b=bucket: start_up(s, p, b)
            runs = harness.interleave(contenders, args.rounds, show)
    finally:
        shutil.rmtree(corpus)
    lines = [
        f"{objects:,} objects of one row group each at +{DELAY_MS} ms per request, median of {args.rounds} round(s):",
        "",
        "| contender | source made | requests | first batch | requests until it |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, rounds in runs.items():
        lines.append(
            f"| {name} | {harness.median(rounds, 'source_s'):.2f} s | {harness.median(rounds, 'source_requests'):.0f} | "
            f"{harness.median(rounds, 'first_batch_s'):.2f} s | {harness.median(rounds, 'first_requests'):.0f} |"
        )
    ratios: list[harness.Ratio] = []
    for kind in ("S3", "GCS"):
        indexed, bare = runs[f"{kind}, index"], runs[f"{kind}, no index"]
        ratios.append(harness.ratio_within_rounds(f"{kind}: first batch, no index / index", bare, indexed, "first_batch_s"))
        for what, key, unit, goal in GOALS:
            median, each = harness.median(indexed, key), tuple(harness.values(indexed, key))
            ratios.append(harness.Ratio(f"{kind}, index: {what}", median, harness.Goal.of(goal), each, unit))
    lines += ["", *harness.ratio_table(ratios)]
    details: dict[str, Any] = {"objects": objects, "delay_ms": DELAY_MS}
    picked = [
        (f"{kind}: first batch, no index", f"time to the first batch without an index, {kind}", "with `cd.write_index`'s index")
        for kind in ("S3", "GCS")
    ]
    picked.append(("S3, index: first batch", f"first batch with an index, S3, {objects:,} objects, +{DELAY_MS} ms a request", ""))
    harness.write_results("index", args, lines, runs, ratios, details=details, headlines=harness.headlines(ratios, picked))


if __name__ == "__main__":
    main()
