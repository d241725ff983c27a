"""ArrayRecord reads side by side: `cd.sources.ArrayRecordSource.take` (one batched read per file,
the whole chunk parsed at once) against ArrayRecord's own batched read
(`ArrayRecordDataSource.__getitems__`, as Grain's source exposes it) with the same parse, and
against the per-record path a Grain source took before (`cd.sources.RecordSource` over
`grain.MapDataset.source(ArrayRecordDataSource).map(json.loads)`: one `__getitem__` a
record, as Grain itself reads). Every contender reads the same chunks of 512 indices of a
global shuffle over 8 files of JSON records (about 150 bytes each), written once; records/s,
medians of interleaved rounds. Goals (issue 22): take at least 0.8x `__getitems__` and at
least 10x the per-record path. Also the cost of opening the files (making the source) and of
its fingerprint from their content, which the first state saved or restored pays, per file
(the files in the page cache). Run: `.venv/bin/python benchmarks/array_record_reads.py [--rounds N]
[--quick] [--out DIR]`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grain
import harness
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from grain.sources import ArrayRecordDataSource

import colo_data as cd
from colo_data.io import content

FILES, PER_FILE = 8, 8_000
CHUNK = 512  # records a read: a host pipeline's chunk
READ = 40  # chunks a run (20,480 records)
WHOLE = harness.WHOLE


def corpus() -> Path:
    """`FILES` ArrayRecord files of `PER_FILE` JSON records each; written once."""
    directory = Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data")) / "array-record-bench"
    if (directory / "done").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    for f in range(FILES):
        writer = ArrayRecordWriter(str(directory / f"part-{f}.array_record"), "group_size:1")
        for i in range(f * PER_FILE, (f + 1) * PER_FILE):
            record = {"id": i, "tokens": rng.integers(0, 32_000, int(rng.integers(8, 32))).tolist()}
            writer.write(json.dumps(record).encode())
        writer.close()
    (directory / "done").touch()
    return directory


def chunks(total: int, count: int) -> list[np.ndarray]:
    """The first `count` chunks of a global shuffle of `total` records."""
    return np.array_split(np.random.default_rng(0).permutation(total)[: count * CHUNK], count)


def take(files: list[str], indices: list[np.ndarray]) -> Iterator[int]:
    """colo-data's read: one batched read per file, the chunk parsed at once."""
    source = cd.sources.ArrayRecordSource(files)
    for idx in indices:
        yield source.take(idx).num_rows


def getitems(files: list[str], indices: list[np.ndarray]) -> Iterator[int]:
    """ArrayRecord's own batched read (a thread per file a call), the same parse."""
    source = ArrayRecordDataSource(files)
    for idx in indices:
        yield len(cd.sources.parse_json(source.__getitems__(idx.tolist()))["id"])


def per_record(files: list[str], indices: list[np.ndarray]) -> Iterator[int]:
    """One `__getitem__` and one `json.loads` a record, as a Grain source was read."""
    source = cd.sources.RecordSource(grain.MapDataset.source(ArrayRecordDataSource(files)).map(json.loads))
    for idx in indices:
        yield source.take(idx).num_rows


def opening(files: list[str], rounds: int) -> tuple[list[str], dict[str, float]]:
    """Seconds to make the source and then to take its fingerprint, medians of `rounds`
    fresh sources: a line for the table, and the figures."""
    made, printed = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        source = cd.sources.ArrayRecordSource(files)
        opened = time.perf_counter()
        source.fingerprint()
        made.append(opened - start)
        printed.append(time.perf_counter() - opened)
    figures = {"open_s": float(np.median(made)), "fingerprint_s": float(np.median(printed))}
    line = (
        f"Opening the {len(files)} files: {figures['open_s'] * 1e3:.1f} ms ({figures['open_s'] / len(files) * 1e3:.2f} ms a "
        f"file); then the fingerprint ({content.WINDOWS} windows of {content.WINDOW:,} bytes a file): "
        f"{figures['fingerprint_s'] * 1e3:.1f} ms ({figures['fingerprint_s'] / len(files) * 1e3:.2f} ms a file)."
    )
    return [line], figures


def main() -> None:
    """Run the three readers in interleaved rounds; write the table and the goals."""
    args = harness.parse(harness.parser(__doc__))
    files = sorted(str(p) for p in corpus().glob("*.array_record"))
    indices = chunks(FILES * PER_FILE, 2 if args.quick else READ)
    names = {
        "`cd.sources.ArrayRecordSource.take`": take,
        "`ArrayRecordDataSource.__getitems__` + `cd.sources.parse_json`": getitems,
        "per record: `cd.sources.RecordSource` over `grain.MapDataset.source(...).map(json.loads)`": per_record,
    }
    contenders = {name: partial(harness.measure, partial(run, files, indices)) for name, run in names.items()}
    runs = harness.interleave(contenders, args.rounds)
    ours, batched, single = (runs[n] for n in names)
    lines = [
        f"{FILES} ArrayRecord files of {PER_FILE:,} JSON records; {len(indices)} reads of {CHUNK} indices of a global "
        f"shuffle a run; medians of {args.rounds} interleaved rounds; {os.cpu_count()} CPUs.",
        "",
        "| reader | records/s | all rounds |",
        "| --- | ---: | ---: |",
        *(
            f"| {n} | {harness.median(r, WHOLE):,.0f} | {harness.span(harness.values(r, WHOLE), ',.0f')} |"
            for n, r in runs.items()
        ),
    ]
    ratios = [
        harness.ratio_within_rounds("take / `__getitems__` with the same parse", ours, batched, WHOLE, ">= 0.8"),
        harness.ratio_within_rounds("take / the per-record path", ours, single, WHOLE, ">= 10"),
    ]
    opened, figures = opening(files, args.rounds)
    table = [*lines, "", *harness.ratio_table(ratios), "", *opened]
    headlines = harness.headlines(
        ratios,
        [
            ("take / `__getitems__`", "`cd.sources.ArrayRecordSource.take`", "ArrayRecord's `__getitems__` + the same parse"),
            ("take / the per-record path", "`cd.sources.ArrayRecordSource.take`", "a Grain source read record by record"),
        ],
    )
    harness.write_results("array_record_reads", args, table, runs, ratios, details=figures, headlines=headlines)


if __name__ == "__main__":
    main()
