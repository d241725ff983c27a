"""What a mixture costs: the demo corpus read as one source, and the same files read as a
3-component `cd.Mix` (files 0-2, 3-5 and 6-7) with weights proportional to the
components' sizes, so both read the same records and the same amount of them. In
process, `tokens` padded to 1024, batches of 32, one epoch's worth of batches (the mixture
is endless: the same count), block and global shuffle. Rounds are interleaved; medians.
Goal: mixture / single source >= 0.9x records/s after the first batch. Run:
`make benchmarks` or `.venv/bin/python benchmarks/mixture.py [--rounds N] [--out DIR]`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import jax
from core import AFTER_FIRST, arguments, measure  # the core benchmark's timing and options

import colo_data as cd
from colo_data.ops import demo

SEQ_LEN, BATCH = 1024, 32
GOAL = 0.9
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


def main() -> None:
    args = arguments(__doc__)
    directory = demo.corpus()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(args.rounds):
        for shuffle in ("block", "global"):
            for name, pipeline in pipelines(directory, shuffle).items():
                batches = len(pipeline.source) // BATCH
                result = measure(lambda p=pipeline, n=batches: read(p, n))
                runs.setdefault(shuffle, {}).setdefault(name, []).append(result)
                print(f"round {r + 1}/{args.rounds}  {shuffle}  {name}: {result[AFTER_FIRST]:,.0f} records/s", flush=True)
    lines = [
        f"Mixture against a single source, the same {len(pipelines(directory, 'block')['single source'].source):,} demo "
        f"records (8 files; the mixture: files 0-2, 3-5, 6-7 weighted by size), pad to {SEQ_LEN}, batch {BATCH}, "
        f"in process, one epoch's worth of batches; median of {args.rounds} interleaved rounds.",
        "",
        "| shuffle | pipeline | records/s after the first batch | all rounds | first batch (s) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    ratios: dict[str, dict[str, float]] = {}
    for shuffle, by_name in runs.items():
        for name, results in by_name.items():
            rates = [x[AFTER_FIRST] for x in results]
            first = statistics.median(x["first_batch_s"] for x in results)
            lines.append(
                f"| {shuffle} | {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}..{max(rates):,.0f} | {first:.2f} |"
            )
        per_round = [
            m[AFTER_FIRST] / s[AFTER_FIRST]
            for m, s in zip(by_name["3-component mixture"], by_name["single source"], strict=True)
        ]
        ratios[shuffle] = {"median": statistics.median(per_round), "low": min(per_round), "high": max(per_round)}
    lines += ["", f"| ratio (within each round) | median | all rounds | goal >= {GOAL}x |", "| --- | ---: | ---: | --- |"]
    for shuffle, ratio in ratios.items():
        met = "yes" if ratio["median"] >= GOAL else "**no**"
        lines.append(
            f"| {shuffle}: mixture / single source | {ratio['median']:.2f}x | {ratio['low']:.2f}..{ratio['high']:.2f} | {met} |"
        )
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixture.md").write_text(text)
    (args.out / "mixture.json").write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=1))
    print(f"wrote {args.out / 'mixture.md'} and {args.out / 'mixture.json'}")


if __name__ == "__main__":
    main()
