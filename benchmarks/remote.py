"""Remote-storage table: the text demo read from local files and from object storage, side by
side in one run. An input pipeline on a training host reads from S3 or GCS, where every request
costs a round trip; this shows how much of the local rate survives 0, 25 and 100 ms added to
each request.

Pipeline (benchmarks/lm.py's loader): `cd.ArrowSource` over the whole text demo
(`colo_data.demo.text_corpus()`: web, code and math, six Parquet files) -> `cd.tokenize` ->
`cd.pad_or_truncate` to `SEQ_LEN`, batches of `BATCH`, one epoch through `cd.Loader(pipeline)` (in process, no workers),
block and global shuffle. Remote contenders read the same files uploaded to a local S3 server
(moto) and GCS server (gcp-storage-emulator; read through pyarrow's `GcsFileSystem` and, as a
contender of its own, through gcsfs) through a `FaultProxy` that adds the delay to every
request (the tokenizer stays local). Each contender is timed from building the ArrowSource (it
reads the footers, remotely) to the last batch on the device; the ratio is remote / local
whole-epoch records/s for the same shuffle. Rounds are interleaved and the median is reported,
so that a noisy neighbour hits every contender alike. A second table runs the same on the text
demo written `LARGER` times over: the demo's epoch lasts a few seconds, so its whole-epoch rate
is much start-up (listing, footers, first reads, each a round trip or more). Goals, on the larger
corpus, for both shuffles: >= 0.9x at 25 ms and >= 0.8x at 100 ms. Run: `make benchmarks` or
`.venv/bin/python benchmarks/remote.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any, Literal

import harness
import jax
import numpy as np
import psutil
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from harness import AFTER_FIRST, WHOLE

import colo_data as cd
from colo_data import demo
from colo_data.testing.storage import FaultProxy, ObjectStore, gcs_server, gcsfs_server, s3_server

SEQ_LEN, BATCH = 512, 32
DELAYS_MS = (0, 25, 100)
# delay (ms) -> remote / local records/s, whole epoch, both shuffles: on the larger corpus, whose
# epoch is long enough to hide the start-up's round trips (the text demo's lasts a few seconds)
GOALS = {25: ">= 0.9", 100: ">= 0.8"}
SHUFFLES: tuple[Literal["block", "global"], ...] = ("block", "global")
BUCKET = "text-demo"
LARGER = 4  # the second table's corpus: the text demo's files this many times over
# the performance page's figures: (the start of a ratio's name, what, peer)
HEADLINES = tuple(
    (
        f"text demo x{LARGER}: {client}, 100 ms per request, global shuffle",
        f"an epoch read from {client} at +100 ms a request",
        "local files",
    )
    for client in ("S3", "GCS", "GCS via gcsfs")
)


def epoch(path: str, tokenizer: Path, shuffle: Literal["block", "global"], fs: pafs.FileSystem | Any) -> Iterator[int]:
    """One epoch of the text pipeline through cd.Loader, source built first (its footer reads timed)."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(path, columns=["text"], filesystem=fs),
        order=cd.Order(shuffle=shuffle, seed=0),
        transforms=[cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", SEQ_LEN)],
        global_batch_size=BATCH,
    )
    with cd.Loader(pipeline) as loader:
        for batch in loader:
            yield len(jax.block_until_ready(batch["text"]))


def local_name(shuffle: str) -> str:
    """The local contender's name."""
    return f"local files, {shuffle} shuffle"


def client_name(store: ObjectStore) -> str:
    """The store and the client that reads it: "S3", "GCS" (pyarrow's) or "GCS via gcsfs"."""
    return store.kind.upper() + (" via gcsfs" if store.client == "fsspec" else "")


def remote_name(client: str, delay_ms: int, shuffle: str) -> str:
    """A remote contender's name."""
    return f"{client}, {delay_ms} ms per request, {shuffle} shuffle"


def remote_epoch(
    proxy: FaultProxy,
    fs: pafs.FileSystem | Any,
    uri: str,
    tokenizer: Path,
    shuffle: Literal["block", "global"],
    delay_ms: int,
    batches: int | None,
) -> harness.Measurement:
    """One measured epoch (or its first `batches`) through `proxy` with `delay_ms` added per
    request, and the requests it made."""
    proxy.delay_s = delay_ms / 1000
    before = proxy.requests
    result = harness.measure(partial(epoch, uri, tokenizer, shuffle, fs), batches)
    result["requests"] = proxy.requests - before
    return result


def show(m: harness.Measurement) -> str:
    """A progress line: the rates, and the requests of a remote epoch."""
    return harness.rates(m) + (f", {m['requests']:,.0f} requests" if "requests" in m else "")


def render(
    runs: harness.Runs, ratios: dict[str, harness.Ratio], rounds: int, corpus: str, remote: list[tuple[str, int, str]]
) -> list[str]:
    """The Markdown table of one run, with each remote contender's ratio to local files and its goal."""

    def rate(name: str, key: str = WHOLE) -> float:
        return harness.median(runs[name], key)

    steady = {remote_name(*c): rate(remote_name(*c), AFTER_FIRST) / rate(local_name(c[2]), AFTER_FIRST) for c in remote}
    lines = [
        f"{corpus[0].upper()}{corpus[1:]}; `cd.tokenize`, ids padded or cut to {SEQ_LEN}, "
        f"batch {BATCH}, `cd.Loader(pipeline)` (in process, no workers); one epoch a round from building the "
        f"ArrowSource to the last batch, median of {rounds} interleaved rounds; {psutil.cpu_count()} CPUs, the servers "
        "and the proxy on the same machine. "
        "Remote: a local S3 (moto) or GCS (gcp-storage-emulator) server behind a FaultProxy adding the delay to every "
        "request; GCS read through pyarrow's GcsFileSystem, and through gcsfs (an fsspec filesystem). "
        "Ratio: records/s / local records/s, same shuffle, over the whole epoch (the goal's) and after the "
        "first batch (start-up left out).",
        "",
        "| pipeline | records/s, whole epoch | first batch (s) | requests per epoch | ratio to local | goal met "
        "| ratio after the first batch |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    lines += [f"| {n} | {rate(n):,.0f} | {rate(n, 'first_batch_s'):.2f} | | | | |" for n in map(local_name, SHUFFLES)]
    for kind, delay_ms, shuffle in remote:
        name = remote_name(kind, delay_ms, shuffle)
        lines.append(
            f"| {name} | {rate(name):,.0f} | {rate(name, 'first_batch_s'):.2f} | {rate(name, 'requests'):,.0f} "
            f"| {ratios[name].value:.2f}x | {ratios[name].verdict()} | {steady[name]:.2f}x |"
        )
    return lines


def larger_corpus() -> Path:
    """The text demo written again with `LARGER` times the files (the same texts' kind, the
    demo's tokenizer), kept beside the demo corpus: its epoch is long enough that start-up
    (listing, footers, the first reads) no longer dominates the whole-epoch rate."""
    directory = demo.cache_dir() / f"remote-bench-text-x{LARGER}"
    if not (directory / demo.TEXT_COMPONENTS[-1]).is_dir():
        demo.write_text_corpus(directory.with_suffix(".tmp"), files=demo.TEXT_FILES * LARGER)
        directory.with_suffix(".tmp").rename(directory)
    return directory


def run_table(
    args: argparse.Namespace, directory: Path, tokenizer: Path, label: str, goals: dict[int, str]
) -> tuple[list[str], list[harness.Ratio], harness.Runs]:
    """Start the servers and proxies, upload `directory`, run the rounds; the table, the ratios
    (remote / local whole-epoch records/s, with `goals` by delay) and the runs, named after
    `label`."""
    footers = [pq.ParquetFile(p).metadata for p in directory.rglob("*.parquet")]
    rows, groups = sum(f.num_rows for f in footers), sum(f.num_row_groups for f in footers)
    corpus = f"{label}: {rows:,} texts in {len(footers)} Parquet files, {groups} row groups"
    with ExitStack() as stack:
        contenders: dict[str, Callable[[], harness.Measurement]] = {
            local_name(s): partial(harness.measure, partial(epoch, str(directory), tokenizer, s, None), args.batches)
            for s in SHUFFLES
        }
        remote: list[tuple[str, int, str]] = []
        for start in (s3_server, gcs_server, gcsfs_server):
            store = stack.enter_context(start())
            uri = store.uri(store.upload(directory, BUCKET))
            proxy = stack.enter_context(FaultProxy(store.endpoint))
            fs = store.filesystem(proxy.endpoint)
            for delay_ms in DELAYS_MS:
                for shuffle in SHUFFLES:
                    remote.append((client_name(store), delay_ms, shuffle))
                    contenders[remote_name(client_name(store), delay_ms, shuffle)] = partial(
                        remote_epoch, proxy, fs, uri, tokenizer, shuffle, delay_ms, args.batches
                    )
        runs = harness.interleave(contenders, args.rounds, show)

    ratios = {
        remote_name(*c): harness.ratio_of_medians(
            f"{label}: {remote_name(*c)}", runs[remote_name(*c)], runs[local_name(c[2])], WHOLE, goals.get(c[1])
        )
        for c in remote
    }
    return render(runs, ratios, args.rounds, corpus, remote), list(ratios.values()), {f"{label}: {n}": r for n, r in runs.items()}


def main() -> None:
    """Both tables: the text demo, and the same corpus `LARGER` times over; remote.md and remote.json."""
    args = harness.parse(harness.parser(__doc__))
    directory = demo.text_corpus()
    tokenizer = directory / demo.TOKENIZER_FILE
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings
    lines: list[str] = []
    ratios: list[harness.Ratio] = []
    runs: harness.Runs = {}
    for path, label, goals in ((directory, "text demo", {}), (larger_corpus(), f"text demo x{LARGER}", GOALS)):
        table, table_ratios, table_runs = run_table(args, path, tokenizer, label, goals)
        print("\n" + "\n".join(table), flush=True)
        lines += [*([""] if lines else []), *table]
        ratios += table_ratios
        runs |= table_runs
    harness.write_results("remote", args, lines, runs, ratios, headlines=harness.headlines(ratios, HEADLINES))


if __name__ == "__main__":
    main()
