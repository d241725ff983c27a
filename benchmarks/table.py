"""The performance page's table, made from the benchmarks' own output: every benchmark of
`make benchmarks` writes its headline figures to `benchmarks/headlines/<name>.json`
(`harness.write_headlines`), and this renders the latest of them as Markdown between the two
marker comments of `docs/performance.md`, so that no figure on the page is typed by hand.
The page shows the figures `SHOWN` names, those a user acts on; the rest stay in the files.
It is also the one runner of the benchmarks: `make benchmarks` is `table.py --run`, every
benchmark in `BENCHMARKS`' order, each in a process of its own, then the table. Alone,
`.venv/bin/python benchmarks/table.py` rewrites the table from the headline files there are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HEADLINES = ROOT / "benchmarks" / "headlines"
PAGE = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
# What `make benchmarks` runs, in this order: the name each writes its headlines under, its command.
BENCHMARKS = (
    ("core", "benchmarks/core.py"),
    ("sidecar", "benchmarks/sidecar.py"),
    ("startup", "benchmarks/startup.py"),
    ("workers", "benchmarks/workers.py"),
    ("worker_sim", "benchmarks/worker_sim.py"),
    ("worker_world", "benchmarks/worker_world.py"),
    ("ray", "benchmarks/ray.py"),
    ("ray_hosts", "benchmarks/ray_hosts.py"),
    ("ray_hosts_pool", "benchmarks/ray_hosts.py --pool 16"),
    ("lm", "benchmarks/lm.py"),
    ("mixture", "benchmarks/mixture.py"),
    ("remote", "benchmarks/remote.py"),
    ("index", "benchmarks/index.py"),
    ("scale", "benchmarks/scale.py"),
    ("array_record_reads", "benchmarks/array_record_reads.py"),
    ("grain", "benchmarks/grain_pipeline.py"),
    ("packing", "benchmarks/packing.py"),
)
# The figures the page shows, in this order: per benchmark, each figure's `what`, or its
# (`what`, `peer`) where the `what` alone names more than one. At most 25 in all; a figure of a
# benchmark not run is left out, and tests/test_performance_page.py fails on one that no
# committed headline file has (a renamed figure).
SHOWN: dict[str, tuple[str | tuple[str, str], ...]] = {
    "core": (
        "demo pipeline (pad to 1024, batch 32): colo-data Loader, block shuffle, in process, after the first batch",
        "colo-data Loader, block shuffle, in process, whole epoch",
        ("colo-data Loader, block shuffle", "Grain `DataLoader(worker_count=None)`"),
        "with a per-record Python function: colo-data Loader",
    ),
    "grain": ("a Grain pipeline as `cd.GrainPipeline` through the sidecar",),
    "sidecar": (
        "sidecar backend, after the first batch",
        'in a 1-CPU cgroup: colo-data sidecar, `workers="auto"`',
    ),
    "startup": (
        "first batch from `cd.Loader(...)`, demo pipeline, in process",
        "the same through a sidecar, 2 workers",
    ),
    "workers": (
        '`workers="auto"`, in process, CPU-bound pipeline',
        "CPU-bound pipeline: sidecar with 2 workers",
        "records that wait 2 ms, in process: 16 workers allowed",
        "records that wait 2 ms: `cd.Loader(pipeline)`",
    ),
    "worker_world": (
        "harsh simulated world, 8 to 224 CPUs, 20% speed plateaus, a trainer that takes half: most input wait",
        "harsh simulated world, 8 to 224 CPUs, 20% speed plateaus: latest time to 0.9 of the best fixed count",
    ),
    "ray": ("CPU-bound pipeline, host on 1 CPU + 1 Ray actor",),
    "lm": (
        "`cd.tokenize` through the Loader, block shuffle, in process",
        "LM demo (3-component mixture, tokenize, pack to 1024), source records/s",
    ),
    "mixture": ("3-component `cd.Mix`, block shuffle",),
    "index": (
        "time to the first batch without an index, S3",
        "first batch with an index, S3, 1,000 objects, +100 ms a request",
    ),
    "scale": (
        "packed pipeline, no partitions named: CPU of 16 hosts",
        "packed pipeline, no partitions named: bytes decoded by 4 hosts",
    ),
    "packing": (
        "`cd.Pack` fill, long-tailed lengths",
        "`cd.Pack` best fit, records/s, long-tailed lengths",
    ),
}
FIELDS = ("benchmark", "command", "date", "commit", "cpus", "rounds", "wall_s", "machine_spread", "headlines")
HEADLINE_FIELDS = ("what", "value", "unit", "peer", "goal")

Result = Mapping[str, Any]  # one headline file


def load(folder: Path = HEADLINES) -> dict[str, Result]:
    """Every headline file in `folder`, by benchmark; a file without the fields the table needs
    is an error that names it and them."""
    results = {}
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        missing = [f for f in FIELDS if f not in result]
        missing += sorted({f"headlines[].{f}" for h in result.get("headlines", []) for f in HEADLINE_FIELDS if f not in h})
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)}; rerun its benchmark to write it whole")
        results[result["benchmark"]] = result
    return results


def value(figure: Mapping[str, Any]) -> str:
    """A figure as the page shows it: '16.82x', '0.90 s', '51,980 records/s'."""
    v, unit = float(figure["value"]), figure["unit"]
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.2f} {unit}"


def picked(result: Result, entry: str | tuple[str, str]) -> list[Mapping[str, Any]]:
    """The figures of `result` that a `SHOWN` entry names: its `what`, and its `peer` if given."""
    what, peer = (entry, None) if isinstance(entry, str) else entry
    return [f for f in result["headlines"] if f["what"] == what and (peer is None or f["peer"] == peer)]


def span(values: list[Any], unit: str) -> str:
    """'2 CPUs', '2 to 8 CPUs'; 'on 2026-12-04', 'from 2026-12-04 to 2026-12-07'."""
    low, high = min(values), max(values)
    if unit:
        return f"{low} {unit}" if low == high else f"{low} to {high} {unit}"
    return f"on {low}" if low == high else f"from {low} to {high}"


def render(results: Mapping[str, Result], shown: Mapping[str, tuple[str | tuple[str, str], ...]] = SHOWN) -> str:
    """The Markdown of the marked block: the figures `shown` names of the benchmarks run, then
    on how many CPUs and when they were run, and which of `make benchmarks` have no figures yet."""
    lines = [
        "<!-- Written by benchmarks/table.py from benchmarks/headlines/*.json (make benchmarks): do not edit. -->",
        "",
        "| benchmark | measured | against | value |",
        "| --- | --- | --- | ---: |",
    ]
    for name, entries in shown.items():
        figures = [f for entry in entries for f in picked(results[name], entry)] if name in results else []
        for i, f in enumerate(figures):
            lines.append(f"| {name if i == 0 else ''} | {f['what']} | {f['peer']} | {value(f)} |")
    runs = [results[name] for name, _ in BENCHMARKS if name in results]
    if runs:
        cpus = span([int(r["cpus"]) for r in runs], "CPUs" if max(r["cpus"] for r in runs) > 1 else "CPU")
        spreads = [r["machine_spread"] for r in runs if r["machine_spread"]]
        moved = f"; the CPUs' speed moved by up to {max(spreads):.2f}x during a run" if spreads else ""
        lines += [
            "",
            f"Measured on {cpus}, {span([r['date'][:10] for r in runs], '')}{moved}. Each run's command, "
            "commit (`-dirty`: with changes not yet committed), rounds and time are in "
            "`benchmarks/headlines/<name>.json`.",
        ]
    missing = [(name, command) for name, command in BENCHMARKS if name not in results]
    if missing:
        lines += [
            "",
            f"Not measured for this table: {', '.join(f'{name} (`{command}`)' for name, command in missing)}. "
            "Run them with `.venv/bin/python` to write their figures to `benchmarks/headlines/`; `SHOWN` in "
            "`benchmarks/table.py` names those this table shows.",
        ]
    return "\n".join(lines)


def marked(page: str) -> tuple[int, int]:
    """Where the text between the page's markers starts and ends."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} block")
    return start + len(BEGIN), end


def rewrite(page: str, block: str) -> str:
    """`page` with the text between its markers replaced by `block`."""
    start, end = marked(page)
    return f"{page[:start]}\n{block}\n{page[end:]}"


def main() -> None:
    """Rewrite the page's table from the headline files; with `--run`, run every benchmark first
    (a benchmark that fails stops the run, as `make` would)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="run every benchmark of `make benchmarks` first (hours)")
    if parser.parse_args().run:
        for _, command in BENCHMARKS:
            print(f"$ .venv/bin/python {command}", flush=True)
            subprocess.run([sys.executable, *command.split()], cwd=ROOT, check=True)
    PAGE.write_text(rewrite(PAGE.read_text(), render(load())))
    print(f"wrote the table of {PAGE.relative_to(ROOT)} from {HEADLINES.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
