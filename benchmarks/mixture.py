"""What a mixture costs: the demo corpus read as one source, and the same files read as a
3-component `cd.Mix` (files 0-2, 3-5 and 6-7) with weights proportional to the
components' sizes, so both read the same records and the same amount of them. In
process, `tokens` padded to 1024, batches of 32, one epoch's worth of batches (the mixture
is endless: the same count), block and global shuffle. Rounds are interleaved; medians.
Goal: mixture / single source >= 0.9x records/s after the first batch. Run:
`make benchmarks` or `.venv/bin/python benchmarks/mixture.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import harness
import jax
from demo_pad import BATCH, SEQ_LEN
from harness import AFTER_FIRST

import colo_data as cd
from colo_data import demo

GOAL = ">= 0.9"  # mixture / single source, records/s after the first batch, within each round
SHUFFLES = ("block", "global")
PARTS = {"web": slice(0, 3), "code": slice(3, 6), "math": slice(6, 8)}


def pipelines(directory: Path, shuffle: str) -> dict[str, cd.Pipeline]:
    """The single source and the mixture over the same files."""
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    order = cd.Order(shuffle=shuffle, seed=0)  # type: ignore[arg-type]
    common = {"order": order, "transforms": [cd.pad_or_truncate("tokens", SEQ_LEN)], "global_batch_size": BATCH}
    single = cd.Pipeline(source=cd.ArrowSource(files, columns=["id", "tokens"]), epochs=None, index_column="_index", **common)
    components = {name: cd.ArrowSource(files[part], columns=["id", "tokens"]) for name, part in PARTS.items()}
    weights = {name: len(source) for name, source in components.items()}
    mixed = cd.Pipeline(source=cd.Mix(components, weights), epochs=None, index_column="_index", **common)
    return {"single source": single, "3-component mixture": mixed}


def read(pipeline: cd.Pipeline, batches: int) -> Iterator[int]:
    """`batches` global batches of the (endless) pipeline through cd.Loader, on the devices."""
    with cd.Loader(pipeline) as loader:
        for _ in range(batches):
            yield len(jax.block_until_ready(next(loader))["tokens"])


def contender(directory: Path, shuffle: str, name: str, batches: int | None) -> harness.Measurement:
    """One timed read of one pipeline, built first (outside the timing): one epoch's worth of
    batches, or `batches`."""
    pipeline = pipelines(directory, shuffle)[name]
    count = len(pipeline.source) // BATCH
    return harness.measure(lambda: read(pipeline, min(count, batches or count)))


def main() -> None:
    """Both pipelines and shuffles, round by round; mixture.md and mixture.json."""
    args = harness.parse(harness.parser(__doc__))
    directory = demo.corpus()
    names = list(pipelines(directory, "block"))
    runs = harness.interleave(
        {
            f"{shuffle}: {name}": partial(contender, directory, shuffle, name, args.batches)
            for shuffle in SHUFFLES
            for name in names
        },
        args.rounds,
    )
    lines = [
        f"Mixture against a single source, the same {len(pipelines(directory, 'block')['single source'].source):,} demo "
        f"records (8 files; the mixture: files 0-2, 3-5, 6-7 weighted by size), pad to {SEQ_LEN}, batch {BATCH}, "
        f"in process, one epoch's worth of batches; median of {args.rounds} interleaved rounds.",
        "",
        "| shuffle | pipeline | records/s after the first batch | all rounds | first batch (s) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for shuffle in SHUFFLES:
        for name in names:
            results = runs[f"{shuffle}: {name}"]
            rates = harness.values(results, AFTER_FIRST)
            lines.append(
                f"| {shuffle} | {name} | {statistics.median(rates):,.0f} | {harness.span(rates, ',.0f')} "
                f"| {harness.median(results, 'first_batch_s'):.2f} |"
            )
    ratios = [
        harness.ratio_within_rounds(
            f"{shuffle}: mixture / single source, records/s after the first batch (within each round)",
            runs[f"{shuffle}: 3-component mixture"],
            runs[f"{shuffle}: single source"],
            AFTER_FIRST,
            GOAL,
        )
        for shuffle in SHUFFLES
    ]
    headlines = harness.headlines(
        ratios,
        [(f"{s}: mixture", f"3-component `cd.Mix`, {s} shuffle", "the same files as one source") for s in SHUFFLES],
    )
    harness.write_results("mixture", args, [*lines, "", *harness.ratio_table(ratios)], runs, ratios, headlines=headlines)


if __name__ == "__main__":
    main()
