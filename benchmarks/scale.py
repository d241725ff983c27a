"""What each host pays for its share, measured with one process per host (hosts simulated in
one process share its caches, which hides the duplication): two tables in one run.

Four hosts: the same global batches read by 1 host and by 4, each host alone in a process of
its own running its host pipeline as its sidecar would (`HostPipeline(pipeline, h, H)`, no
ring): the hosts' CPU seconds over 200 global batches after the first 5 of an endless
stream (as issue 44 measured: a host's start-up, its tokenizer's load and first reads,
apart), and, with a source of its own, the row-group bytes they decoded over one epoch
(`epochs=1`: no reading ahead past its end; over more, one host would decode the corpus
once: it fits in a source's row-group cache), each host up to the epoch's last batch as one
host reads it (a partitioned stream ends at the first batch one partition cannot make, which
a host of four sees only for its own partitions), summed, 4 hosts over 1 (1.0: each host
does a quarter of the work; 4.0: each does all of it). The LM path over the text demo
(`demo.text_corpus()`: 15,000 texts in 30 row groups of 500), block shuffle (windows of 8 row
groups), batches of 64: `cd.tokenize` then padded to 512, with one partition and
with a partition per batch row; the same filtered (`keep=`: 44% of the texts); packed
(`cd.Pack("tokens", 512, prepare=[cd.tokenize(...)])`), and packed from a `cd.Mix` of the text
demo's three components (web 0.6, code 0.3, math 0.1: the LM demo's); filtered and packed with a partition per
batch row (each partition reads, filters and packs its own records: `colo_data.host.partitioned`),
and, padded too, with no partitions named (they choose 16: docs/scaling.md; these also at 16 hosts, goal
at most 1.5x; their bytes over 4 epochs' batches, each host's source with a 32 MB row-group
cache: a host that read other row groups each epoch would show it). With one partition, the
filtered and packed pipelines are planned over the whole global batch on every host. Goals: at
most 1.3x, CPU and bytes. Each partition takes its even slice of every window, so the 4 hosts'
slices of a window of 8 row groups meet at row-group boundaries; the window of the 6 left
over splits inside 2 (docs/scaling.md): 32 row groups where one host reads 30, the same
groups every epoch.
The packed pipelines' fill
(tokens over row slots, one host) with one partition and with 64 is reported beside: the goal is
to stay within a point.

A thousand hosts: hosts 0, 511 and 1023 of a 1,024-host job, each alone in a process of its
own (`HostPipeline(pipeline, h, 1024)`, no loader), against one host reading every row: a
padded pipeline over the demo corpus rewritten in row groups of 40 records (1,000 of them),
batches of 1,024 rows, 1,024 partitions, block shuffle in windows of 1,024 row groups (at
least a row group a host: docs/scaling.md), one epoch (39 batches). Per host and global
batch: CPU seconds (from the first chunk on) and bytes decoded; the time to the first batch;
the loader state's size in bytes. Run: `make benchmarks` or
`.venv/bin/python benchmarks/scale.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

import colo_data as cd
from colo_data import demo

HERE = Path(__file__).resolve().parent
BATCH, SEQ_LEN = 64, 512
KINDS = (
    "padded",
    "padded, partitions",
    "padded, named none",
    "filtered",
    "filtered, partitions",
    "filtered, named none",
    "packed",
    "packed, partitions",
    "packed, named none",
    "mixed, named none",
)
SKIPPED, MEASURED = 5, 200  # the four-host table's batches: skipped (start-up), then measured
FOUR_GOAL = "<= 1.3"
SIXTEEN_GOAL = "<= 1.5"
BIG_HOSTS, BIG_BATCH, BIG_ROW_GROUP, BIG_WINDOW = 1024, 1024, 40, 1024  # a window of the hosts' count (docs/scaling.md)
SIMULATED = (0, 511, 1023)
NAMED_EPOCHS, NAMED_CACHE = 4, 32 * 2**20  # the pipelines that name no partitions: bytes over 4 epochs, a 32 MB cache


def four_host_pipeline(kind: str, corpus: Path, epochs: int | None = None, cache_bytes: int | None = None) -> cd.Pipeline:
    """The LM pipeline of `kind` over the text demo: tokenized, then padded ("padded",
    "padded, partitions"), filtered, or packed; "mixed" packed from a `cd.Mix` of the text
    demo's components, 0.6/0.3/0.1, as `demo.lm_pipeline` (its sources' row-group cache
    `cache_bytes`, or the default)."""
    tokenizer = str(corpus / demo.TOKENIZER_FILE)
    cache = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    if kind.startswith("mixed"):  # the LM demo's mixture (`demo.lm_pipeline`)
        components = {name: cd.ArrowSource(str(corpus / name), columns=["text"], **cache) for name in demo.TEXT_COMPONENTS}
        source: Any = cd.Mix(components, {"web": 0.6, "code": 0.3, "math": 0.1})
    else:
        source = cd.ArrowSource(str(corpus), columns=["text"], **cache)
    settings: dict[str, Any] = dict(
        source=source,
        order=cd.Order(shuffle="block", seed=0, window=8),
        global_batch_size=BATCH,
        epochs=epochs,
    )
    padded = [cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", SEQ_LEN)]
    if "named none" not in kind:  # those take the partitions the pipeline chooses (16 for these batches of 64)
        settings["partitions"] = BATCH if "partitions" in kind else 1
    if kind.startswith("padded"):
        settings["transforms"] = padded
    elif kind.startswith("filtered"):
        settings["transforms"] = padded
        settings["keep"] = long_enough
    else:
        settings["pack"] = cd.Pack("tokens", SEQ_LEN, prepare=[cd.tokenize("text", tokenizer, output="tokens")])
    return cd.Pipeline(**settings)


def long_enough(columns: dict[str, Any]) -> np.ndarray:
    """The filter: texts of 400 characters or more (44% of the text demo's)."""
    return np.asarray(pc.utf8_length(columns["text"])) >= 400


def big_corpus() -> Path:
    """The demo corpus in row groups of `BIG_ROW_GROUP` records, in a new folder."""
    out = Path(tempfile.mkdtemp(prefix="colo-data-scale-"))
    for path in sorted(demo.corpus().glob("*.parquet")):
        pq.write_table(pq.read_table(path, columns=["id", "tokens"]), out / path.name, row_group_size=BIG_ROW_GROUP)
    return out


def big_pipeline(corpus: str) -> cd.Pipeline:
    """The thousand-host table's pipeline (padded, a partition per batch row)."""
    return cd.Pipeline(
        source=cd.ArrowSource(corpus, columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=0, window=BIG_WINDOW),
        transforms=[cd.pad_or_truncate("tokens", SEQ_LEN)],
        global_batch_size=BIG_BATCH,
        partitions=BIG_BATCH,
    )


def epoch_batches(kind: str, corpus: str) -> int:
    """The global batches of one epoch (`epochs=1`) of pipeline `kind`, as one host reads
    them: a partitioned stream ends at the first batch that one partition cannot make, which
    a host of four sees only for its own partitions (a partitioned filtered stream's epoch
    ends where one partition runs out of accepted records). A `cd.Mix` is endless: the packed
    pipeline's, of the same records."""
    from colo_data.host.host_pipeline import HostPipeline

    kind = "packed, named none" if kind.startswith("mixed") else kind

    return sum(1 for _ in HostPipeline(four_host_pipeline(kind, Path(corpus), epochs=1)).chunks(0, batches=1))


def one_host_of(
    kind: str, corpus: str, host: int, hosts: int, batches: int | None, epoch: int | None = None
) -> dict[str, Any]:
    """In a process of its own: host `host` of `hosts` of the pipeline `kind` ("thousand"
    or one of `KINDS`) reads alone, as its sidecar would, without the ring: "thousand" an
    epoch (or `batches`), its CPU from its first chunk on (the imports and the source's
    metadata read apart); the others `SKIPPED` batches and `MEASURED` more of an endless
    stream (or one and `batches`), their CPU over the `MEASURED`, then, with a source of
    their own, the first `epoch` batches (`epoch_batches`; none with `batches`). Its CPU seconds, the row-group bytes it
    decoded (over that epoch), the time to its first batch, a packed pipeline's fill (over
    the measured batches), and a padded one's state size."""
    from colo_data.host.host_pipeline import HostPipeline
    from colo_data.pipeline.state import make_state

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    start = time.perf_counter()
    pipeline = big_pipeline(corpus) if kind == "thousand" else four_host_pipeline(kind, Path(corpus))
    made = cpu()  # the source's metadata read: start-up, apart
    chunks = HostPipeline(pipeline, host, hosts).chunks(0, batches=1)
    first = next(chunks)
    first_s = time.perf_counter() - start
    if kind != "thousand":  # the CPU from the batch after the skipped ones
        skipped = 1 if batches is not None else SKIPPED
        for _ in range(skipped - 1):
            next(chunks)
        made = cpu()
        batches = batches or MEASURED
    count = filled = 0
    for chunk in chunks if batches is None else (next(chunks) for _ in range(batches - (kind == "thousand"))):
        count += 1
        filled += int((chunk.columns["segment_ids"] > 0).sum()) if pipeline.pack is not None else 0
    count += kind == "thousand"  # its first batch counts
    spent = cpu() - made
    decoded = int(pipeline.source.read_stats()[5])
    if kind != "thousand" and epoch:  # the bytes of the epoch's batches, with a source of its own
        # a finite stream keeps one partition where none is named: the pipelines that choose theirs read
        # endlessly, over `NAMED_EPOCHS` epochs' batches, a host's reads held to `NAMED_CACHE` bytes
        named = kind.endswith("named none")
        alone = four_host_pipeline(kind, Path(corpus), epochs=None if named else 1, cache_bytes=NAMED_CACHE if named else None)
        chunks = HostPipeline(alone, host, hosts).chunks(0, batches=1)
        for _ in zip(chunks, range(epoch * (NAMED_EPOCHS if named else 1)), strict=False):
            pass
        decoded = int(alone.source.read_stats()[5])
    out = {
        "batches": count,
        "cpu_s": spent,
        "decoded_bytes": decoded,
        "first_batch_s": first_s,
        "fill": filled / max(1, count * len(first.columns.get("segment_ids", [0])) * SEQ_LEN),
    }
    if kind == "thousand":  # a padded pipeline: its state is one position
        out["state_bytes"] = len(json.dumps(make_state(pipeline, count * pipeline.global_batch_size)))
    return out


def in_child(kind: str, corpus: str, host: int, hosts: int, batches: int | None, epoch: int | None = None) -> harness.Measurement:
    """`one_host_of` in a fresh interpreter."""
    call = f"scale.one_host_of({kind!r}, {corpus!r}, {host}, {hosts}, {batches!r}, {epoch!r})"
    code = f"import json, scale; print(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{call} failed:\n{done.stderr[-3000:]}")
    m = json.loads(done.stdout.strip().splitlines()[-1])
    per_batch = {"cpu_per_batch_s": m["cpu_s"] / m["batches"], "bytes_per_batch": m["decoded_bytes"] / m["batches"]}
    return {**m, **per_batch}


def four_hosts(kind: str, hosts: int, corpus: Path, batches: int | None, epoch: int | None) -> harness.Measurement:
    """The `hosts` hosts of pipeline `kind`, each alone in a process of its own, one after
    the other: their CPU seconds and decoded bytes (over `epoch` batches), summed."""
    each = [in_child(kind, str(corpus), h, hosts, batches, epoch) for h in range(hosts)]
    summed = {"cpu_s": sum(m["cpu_s"] for m in each), "decoded_bytes": sum(m["decoded_bytes"] for m in each)}
    return {**summed, "fill": each[0]["fill"]} if hosts == 1 else summed


def show_host(m: harness.Measurement) -> str:
    """One simulated host's progress line."""
    return f"{m['cpu_per_batch_s'] * 1e6:,.0f} µs CPU and {m['bytes_per_batch'] / 1e3:,.1f} kB decoded a batch"


def main() -> None:
    """Both tables; scale.md and scale.json."""
    args = harness.parse(harness.parser(__doc__))
    batches = harness.QUICK_BATCHES if args.quick else None
    corpus = demo.text_corpus()

    epochs = {kind: None if batches else epoch_batches(kind, str(corpus)) for kind in KINDS}  # (a few seconds each)
    contenders: dict[str, Callable[[], harness.Measurement]] = {}
    for kind in KINDS:
        for hosts in (1, 4, 16) if kind.endswith("named none") else (1, 4):
            contenders[f"{kind}, {hosts} host(s)"] = lambda k=kind, h=hosts: four_hosts(k, h, corpus, batches, epochs[k])
    runs = harness.interleave(
        contenders, args.rounds, lambda m: f"{m['cpu_s']:.2f} CPU-s, {m['decoded_bytes'] / 1e6:.0f} MB decoded"
    )
    lines = [
        f"Four hosts: each host alone in a process, global batches of {BATCH}; CPU over {MEASURED} batches after the "
        f"first {SKIPPED}, row-group bytes decoded over an epoch, summed over the hosts (median of {args.rounds} round(s)):",
        "",
        "| pipeline | CPU-s, 1 host | CPU-s, 4 hosts | MB decoded, 1 host | MB decoded, 4 hosts |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    ratios: list[harness.Ratio] = []
    for kind in KINDS:
        one, four = runs[f"{kind}, 1 host(s)"], runs[f"{kind}, 4 host(s)"]
        lines.append(
            f"| {kind} | {harness.median(one, 'cpu_s'):.2f} | {harness.median(four, 'cpu_s'):.2f} | "
            f"{harness.median(one, 'decoded_bytes') / 1e6:.0f} | {harness.median(four, 'decoded_bytes') / 1e6:.0f} |"
        )
        ratios.append(harness.ratio_within_rounds(f"{kind}: CPU, 4 hosts / 1", four, one, "cpu_s", FOUR_GOAL))
        ratios.append(harness.ratio_within_rounds(f"{kind}: bytes decoded, 4 hosts / 1", four, one, "decoded_bytes", FOUR_GOAL))
        if kind.endswith("named none"):
            sixteen = runs[f"{kind}, 16 host(s)"]
            ratios.append(harness.ratio_within_rounds(f"{kind}: CPU, 16 hosts / 1", sixteen, one, "cpu_s", SIXTEEN_GOAL))
    fills = {kind: harness.median(runs[f"{kind}, 1 host(s)"], "fill") for kind in KINDS if kind.startswith("packed")}
    one = fills["packed"]
    lines += [
        "",
        f"Packing fill, one host, {MEASURED} batches: one partition {100 * one:.2f}%, {BATCH} partitions "
        f"{100 * fills['packed, partitions']:.2f}% ({100 * (fills['packed, partitions'] - one):+.2f} points), "
        f"the partitions it chooses {100 * fills['packed, named none']:.2f}% "
        f"({100 * (fills['packed, named none'] - one):+.2f} points; goal: within 1)",
    ]
    big = big_corpus()
    try:
        limit = 2 if args.quick else None
        alone = lambda: in_child("thousand", str(big), 0, 1, limit)  # noqa: E731
        simulated: dict[str, Callable[[], harness.Measurement]] = {"1 host of 1": alone}
        for h in SIMULATED:
            simulated[f"host {h} of {BIG_HOSTS}"] = lambda h=h: in_child("thousand", str(big), h, BIG_HOSTS, limit)
        big_runs = harness.interleave(simulated, args.rounds, show_host)
    finally:
        shutil.rmtree(big)
    alone = big_runs["1 host of 1"]
    lines += [
        "",
        f"A thousand hosts: each host alone in a process, {BIG_BATCH} rows a batch, {BIG_BATCH} partitions, windows of "
        f"{BIG_WINDOW} row groups of {BIG_ROW_GROUP} records, an epoch (median of {args.rounds} round(s)):",
        "",
        "| host | CPU µs a batch | kB decoded a batch | first batch | state | CPU / one host's | bytes / one host's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rounds in big_runs.items():
        cpu, read = harness.median(rounds, "cpu_per_batch_s"), harness.median(rounds, "bytes_per_batch")
        lines.append(
            f"| {name} | {cpu * 1e6:,.0f} | {read / 1e3:,.1f} | {harness.median(rounds, 'first_batch_s'):.2f} s | "
            f"{harness.median(rounds, 'state_bytes'):.0f} B | {cpu / harness.median(alone, 'cpu_per_batch_s'):.3f} | "
            f"{read / harness.median(alone, 'bytes_per_batch'):.3f} |"
        )
    lines += ["", *harness.ratio_table(ratios)]
    headlines = harness.headlines(
        ratios,
        [
            ("packed, named none: CPU, 4 hosts / 1", "packed pipeline, no partitions named: CPU of 4 hosts", "1 host"),
            ("packed, named none: CPU, 16 hosts / 1", "packed pipeline, no partitions named: CPU of 16 hosts", "1 host"),
            ("filtered, named none: CPU, 16 hosts / 1", "filtered pipeline, no partitions named: CPU of 16 hosts", "1 host"),
            ("mixed, named none: CPU, 4 hosts / 1", "packed mixture, no partitions named: CPU of 4 hosts", "1 host"),
            ("mixed, named none: CPU, 16 hosts / 1", "packed mixture, no partitions named: CPU of 16 hosts", "1 host"),
            ("mixed, named none: bytes decoded", "packed mixture, no partitions named: bytes decoded by 4 hosts", "1 host"),
            ("packed, named none: bytes decoded", "packed pipeline, no partitions named: bytes decoded by 4 hosts", "1 host"),
            ("padded, named none: CPU, 4 hosts / 1", "padded pipeline, no partitions named: CPU of 4 hosts", "1 host"),
            ("padded, named none: CPU, 16 hosts / 1", "padded pipeline, no partitions named: CPU of 16 hosts", "1 host"),
            ("padded, named none: bytes decoded", "padded pipeline, no partitions named: bytes decoded by 4 hosts", "1 host"),
        ],
    )
    harness.write_results("scale", args, lines, {**runs, **big_runs}, ratios, headlines=headlines)


if __name__ == "__main__":
    main()
