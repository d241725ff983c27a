"""The performance page's table, made from the benchmarks' own output: every benchmark of
`make benchmarks` writes its headline figures to `benchmarks/headlines/<name>.json`
(`harness.write_headlines`), and this renders the latest of them as Markdown between the two
marker comments of `docs/performance.md`, so that no figure on the page is typed by hand.
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


def took(seconds: float) -> str:
    """A run's wall time: '5 min 19 s', '48 s'."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def render(results: Mapping[str, Result]) -> str:
    """The Markdown of the marked block: the figures of every benchmark run, then when, where and
    how each was run, and which of `make benchmarks` have no figures yet."""
    lines = [
        "<!-- Written by benchmarks/table.py from benchmarks/headlines/*.json (make benchmarks): do not edit. -->",
        "",
        "| benchmark | measured | against | value | goal |",
        "| --- | --- | --- | ---: | --- |",
    ]
    for name, _ in BENCHMARKS:
        for i, f in enumerate(results[name]["headlines"] if name in results else []):
            lines.append(f"| {name if i == 0 else ''} | {f['what']} | {f['peer']} | {value(f)} | {f['goal']} |")
    lines += [
        "",
        "| benchmark | command | date (UTC) | commit | CPUs | rounds | took | CPU speed moved |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, command in BENCHMARKS:
        if name not in results:
            lines.append(f"| {name} | `.venv/bin/python {command}` | not run for this table | | | | | |")
            continue
        r = results[name]
        spread = f"{r['machine_spread']:.2f}x" if r["machine_spread"] else ""
        lines.append(
            f"| {name} | `{r['command']}` | {r['date'][:10]} | {r['commit']} | {r['cpus']} | {r['rounds']} "
            f"| {took(r['wall_s'])} | {spread} |"
        )
    missing = [name for name, _ in BENCHMARKS if name not in results]
    if missing:
        lines += [
            "",
            f"Not measured for this table: {', '.join(missing)}. Run their commands above, then "
            "`.venv/bin/python benchmarks/table.py`, to add their figures.",
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
