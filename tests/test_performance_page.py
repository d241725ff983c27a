"""The performance page stays a page for users: short, and its table exactly what
`benchmarks/table.py` makes from the committed headline files, so that a figure typed by
hand, or a change to the table's format without a new run, fails here. The headline files
carry what the table needs, every figure the table picks (`SHOWN`) is in one of them, and
what the benchmarks' harness writes is what the table reads. No benchmark runs here."""

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


def table_rows(text: str) -> int:
    """The rows of the Markdown tables in `text`, their header rows (a header and the line of
    dashes under it) not counted."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    dashes = [line for line in rows if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line)]
    return len(rows) - 2 * len(dashes)


def test_the_page_is_120_lines_and_its_table_25_rows() -> None:
    """The page's prose is at most 120 lines, its generated table at most 25 rows."""
    page = PAGE.read_text()
    start, end = table.marked(page)
    prose = (page[:start] + page[end:]).splitlines()
    assert len(prose) <= 120, (
        f"docs/performance.md has {len(prose)} lines outside its table: the history belongs in benchmarks/NOTES.md"
    )
    rows = table_rows(page[start:end])
    assert 0 < rows <= 25, f"docs/performance.md's table has {rows} rows: SHOWN in benchmarks/table.py names at most 25"


def test_table_rows_counts_rows_not_headers() -> None:
    """The rows counted are a table's rows, its header and line of dashes not among them."""
    assert table_rows("| a | b |\n| --- | ---: |\n| 1 | 2 |\n| 3 | 4 |\n\ntext\n") == 2


def test_a_span_names_one_value_once() -> None:
    """The CPUs and dates under the table: one value once, or the lowest to the highest."""
    assert table.span([2, 2], "CPUs") == "2 CPUs" and table.span([16, 2], "CPUs") == "2 to 16 CPUs"
    assert table.span(["2026-12-07", "2026-12-04"], "") == "from 2026-12-04 to 2026-12-07"


def test_shown_names_at_most_25_figures_each_of_a_committed_headline_file() -> None:
    """Every figure `SHOWN` names is one figure of a committed headline file, so that a renamed
    figure fails here by name rather than vanish from the page; and there are at most 25."""
    results = table.load()
    names = {name for name, _ in table.BENCHMARKS}
    assert sum(len(entries) for entries in table.SHOWN.values()) <= 25, "SHOWN names more than 25 figures"
    for name, entries in table.SHOWN.items():
        assert name in names, f"SHOWN names {name!r}, no benchmark of make benchmarks"
        assert name in results, f"SHOWN names figures of {name!r}, which has no committed headline file"
        for entry in entries:
            found = table.picked(results[name], entry)
            assert len(found) == 1, (
                f"{name}: SHOWN's {entry!r} names {len(found)} figures of benchmarks/headlines/{name}.json, not 1"
            )


def test_the_table_is_what_the_renderer_makes_from_the_headline_files() -> None:
    """The page's table is what `table.py` makes of the committed headline files."""
    page = PAGE.read_text()
    made = table.rewrite(page, table.render(table.load()))
    assert made == page, "docs/performance.md's table differs from the headline files: run .venv/bin/python benchmarks/table.py"


def test_every_headline_file_has_what_the_table_needs() -> None:
    """Every committed headline file is a benchmark's, whole, with figures."""
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
    """`make benchmarks` is `table.py --run`, and every command it runs is a file."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^benchmarks:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "the Makefile has no benchmarks target"
    assert recipe.group(1) == "\t$(VENV)/bin/python benchmarks/table.py --run\n"
    for _, command in table.BENCHMARKS:
        assert (ROOT / command.split()[0]).is_file(), command


def test_what_a_run_writes_is_what_the_table_shows(tmp_path: Path) -> None:
    """The harness's headline file renders as the figures `shown` names, in its order, those of a
    part that did not run left out, then the run's CPUs and dates and the benchmarks not run."""
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

    shown = {"core": (("colo-data A", "B"), "A alone", "first batch, A", "a figure not written"), "sidecar": ("C",)}
    block = table.render(table.load(tmp_path), shown)
    rows = block.splitlines()
    figures = [row for row in rows[4:] if row.startswith("|")]
    assert figures == [
        "| core | colo-data A | B | 1.23x |",
        "|  | A alone |  | 51,980 records/s |",
        "|  | first batch, A |  | 0.46 s |",
    ]
    assert any(
        re.fullmatch(r"Measured on \d+ CPUs?, on \d{4}-\d\d-\d\d(; .* \d\.\d\dx during a run)?\. .*", row) for row in rows
    ), block
    assert "Not measured for this table: sidecar (`benchmarks/sidecar.py`), startup" in block
    only = table.render(table.load(tmp_path), {"core": ("A alone",)})
    assert "| core | A alone |  | 51,980 records/s |" in only and "colo-data A" not in only, only


def test_a_headline_file_without_a_field_is_refused_by_name(tmp_path: Path) -> None:
    """A headline file without a field the table needs is refused, naming the file and the field."""
    (tmp_path / "core.json").write_text(json.dumps({"benchmark": "core", "headlines": [{"what": "A"}]}))
    with pytest.raises(ValueError, match=r"core\.json: no command, .*headlines\[\]\.value"):
        table.load(tmp_path)


def test_a_page_without_markers_is_refused() -> None:
    """A page without the markers is refused rather than written over."""
    with pytest.raises(ValueError, match="no <!-- benchmarks:begin -->"):
        table.rewrite("# Performance\n", "| table |")
