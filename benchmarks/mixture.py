"""What a mixture costs: the demo corpus read as one source, and the same files read as a
3-component `cd.Mix` (files 0-2, 3-5 and 6-7) with weights proportional to the
components' sizes, so both read the same records and the same amount of them. In
process, `tokens` padded to 1024, batches of 32, one epoch's worth of batches (the mixture
is endless: the same count), block and global shuffle. Rounds are interleaved; medians.
Goal: mixture / single source >= 0.9x records/s after the first batch. Run:
`make benchmarks` or `.venv/bin/python benchmarks/mixture.py [--rounds N] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
from absl import flags

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


def measure(pipeline: cd.Pipeline, batches: int) -> dict[str, float]:
    """Records/s after the first batch (and the first batch's time) over `batches` batches."""
    t0 = time.perf_counter()
    with cd.Loader(pipeline) as loader:
        jax.block_until_ready(next(loader))
        first = time.perf_counter()
        for _ in range(batches - 1):
            jax.block_until_ready(next(loader))
        end = time.perf_counter()
    return {"first_batch_s": first - t0, "after_first_per_s": (batches - 1) * BATCH / (end - first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    flags.FLAGS.mark_as_parsed()
    directory = demo.corpus()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(args.rounds):
        for shuffle in ("block", "global"):
            for name, pipeline in pipelines(directory, shuffle).items():
                batches = len(pipeline.source) // BATCH
                result = measure(pipeline, batches)
                runs.setdefault(shuffle, {}).setdefault(name, []).append(result)
                print(f"round {r + 1}/{args.rounds}  {shuffle}  {name}: {result['after_first_per_s']:,.0f} records/s", flush=True)
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
            rates = [x["after_first_per_s"] for x in results]
            first = statistics.median(x["first_batch_s"] for x in results)
            lines.append(
                f"| {shuffle} | {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}..{max(rates):,.0f} | {first:.2f} |"
            )
        per_round = [
            m["after_first_per_s"] / s["after_first_per_s"]
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
