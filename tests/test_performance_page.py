"""The performance page stays a page for users: short, and its table exactly what
`benchmarks/table.py` makes from the committed headline files, so that a figure typed by
hand, or a change to the table's format without a new run, fails here. The headline files
carry what the table needs, and what the benchmarks' harness writes is what the table reads.
No benchmark runs here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"


def module(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, imported under a name of its own (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # dataclasses look their module up while the class is made
    spec.loader.exec_module(loaded)
    return loaded


table = module("table")


def test_the_page_is_at_most_200_lines() -> None:
    lines = PAGE.read_text().splitlines()
    assert len(lines) <= 200, f"docs/performance.md has {len(lines)} lines: the history belongs in benchmarks/NOTES.md"


def test_the_table_is_what_the_renderer_makes_from_the_headline_files() -> None:
    page = PAGE.read_text()
    made = table.rewrite(page, table.render(table.load()))
    assert made == page, "docs/performance.md's table differs from the headline files: run .venv/bin/python benchmarks/table.py"


def test_every_headline_file_has_what_the_table_needs() -> None:
    paths = sorted(table.HEADLINES.glob("*.json"))
    assert paths, "no headline files: run make benchmarks"
    names = {name for name, _ in table.BENCHMARKS}
    for path in paths:
        result = json.loads(path.read_text())
        assert set(table.FIELDS) <= result.keys(), f"{path.name}: no {set(table.FIELDS) - result.keys()}"
        assert result["benchmark"] == path.stem and path.stem in names, f"{path.name}: not a benchmark of make benchmarks"
        assert result["headlines"], f"{path.name}: no figures"
        for figure in result["headlines"]:
            assert set(table.HEADLINE_FIELDS) <= figure.keys(), f"{path.name}: {figure}"
            assert isinstance(figure["value"], int | float), f"{path.name}: {figure}"


def test_make_benchmarks_is_the_table_runner_and_every_benchmark_it_lists_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^benchmarks:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "the Makefile has no benchmarks target"
    assert recipe.group(1) == "\t$(VENV)/bin/python benchmarks/table.py --run\n"
    for _, command in table.BENCHMARKS:
        assert (ROOT / command.split()[0]).is_file(), command


def test_what_a_run_writes_is_what_the_table_shows(tmp_path: Path) -> None:
    harness = module("harness")
    ratios = [
        harness.Ratio("A / B, after the first batch", 1.234, harness.Goal.of(">= 0.9"), (1.2, 1.3)),
        harness.Ratio("first batch", 0.456, harness.Goal.of("<= 1.5"), (), " s"),
    ]
    picked = [("A / B", "colo-data A", "B"), ("first batch", "first batch, A", ""), ("a part that did not run", "C", "D")]
    headlines = [harness.Headline("A alone", 51_980.4, "records/s"), *harness.headlines(ratios, picked)]
    assert [h.what for h in headlines] == ["A alone", "colo-data A", "first batch, A"]
    args = argparse.Namespace(headlines=tmp_path, rounds=3, started=time.perf_counter())
    harness.write_headlines("core", args, headlines)

    block = table.render(table.load(tmp_path))
    rows = block.splitlines()
    assert "| core | A alone |  | 51,980 records/s |  |" in rows
    assert "|  | colo-data A | B | 1.23x | met (>= 0.9x; 2/2 rounds) |" in rows
    assert "|  | first batch, A |  | 0.46 s | met (<= 1.5 s) |" in rows
    assert "| sidecar | `.venv/bin/python benchmarks/sidecar.py` | not run for this table | | | | | |" in rows
    assert "Not measured for this table: sidecar," in block


def test_a_headline_file_without_a_field_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "core.json").write_text(json.dumps({"benchmark": "core", "headlines": [{"what": "A"}]}))
    with pytest.raises(ValueError, match=r"core\.json: no command, .*headlines\[\]\.value"):
        table.load(tmp_path)


def test_a_page_without_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="no <!-- benchmarks:begin -->"):
        table.rewrite("# Performance\n", "| table |")
