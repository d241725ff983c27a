"""The documentation runs: every Python code block of the README and of `docs/` is executed
(a page's blocks in order, as one script, as a reader would paste them), the site builds
with `mkdocs build --strict` (broken links, anchors and API references fail), and the built
pages load in headless Chromium with navigation, highlighted code and no console error.

A block that needs what this machine cannot have (a TPU, a cluster, a bucket) is preceded
by `<!-- skip: why -->`; it is reported as a skip with that reason, never run."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^(?:<!-- skip: (?P<skip>.+?) -->\n)?```python[^\n]*\n(?P<code>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One Python code block of a page: where it starts, its code, and why it is not run."""

    page: Path
    line: int
    code: str
    skip: str | None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, text.count("\n", 0, m.start("code")), m.group("code"), m.group("skip")) for m in FENCE.finditer(text)]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUN = [page for page in PAGES if any(b.skip is None for b in blocks(page))]
SKIPPED = [b for page in PAGES for b in blocks(page) if b.skip is not None]


def script(page: Path) -> str:
    """The page's runnable blocks as one script, each line of code on its line of the page
    (the rest blank), so that a traceback's line numbers are the page's."""
    lines = [""] * (page.read_text().count("\n") + 1)
    for block in blocks(page):
        if block.skip is None:
            for i, line in enumerate(block.code.splitlines()):
                lines[block.line + i] = line
    return "\n".join(lines)


@pytest.mark.parametrize("page", RUN, ids=name)
def test_the_page_examples_run(page: Path, tmp_path: Path) -> None:
    path = tmp_path / f"{page.name}.py"  # a traceback names the page, at the page's line
    path.write_text(script(page))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a reader's JAX: one CPU device unless a page asks
    result = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name(page)}: its examples failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: f"{name(b.page)}:{b.line + 1}")
def test_blocks_that_need_a_cluster_say_why(block: Block) -> None:
    assert len(block.skip or "") > 15, f"{name(block.page)}:{block.line + 1}: say what the block needs"
    pytest.skip(f"{name(block.page)}:{block.line + 1} is not run here: {block.skip}")


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: the reference belongs in docs/"
    opening = "\n".join(lines[:6])
    assert "make bench" in opening and "make test" in opening, opening


def test_readme_links_point_at_pages_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?!https?:)[^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    for link in links:
        assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in (ROOT / "docs").rglob("*.md"):
        relative = page.relative_to(ROOT / "docs").with_suffix("")
        built = site / ("index.html" if relative.name == "index" else f"{relative}/index.html")
        assert built.exists(), f"{name(page)} was not built ({built})"
    reference = (site / "reference" / "pipelines" / "index.html").read_text()
    assert 'id="colo_data.spec.pipeline.Pipeline"' in reference, "the API reference has no Pipeline entry"


@pytest.fixture(scope="session")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def chromium(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Debian's Chromium, headless, with the flags that keep it off this closed network."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
        "--virtual-time-budget=3000",
    ]  # fmt: skip
    return subprocess.run([binary, *flags, *args, url], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", ["", "reference/pipelines/"])
def test_pages_render_in_chromium_with_navigation_and_highlighting(served: str, path: str, tmp_path: Path) -> None:
    result = chromium(f"{served}/{path}", tmp_path, "--dump-dom")
    dom = result.stdout
    assert result.returncode == 0 and "</html>" in dom, result.stderr[-3000:]
    assert 'class="md-nav' in dom and "Getting started" in dom, "no navigation in the rendered page"
    assert re.search(r'<span class="(kn|k|n|nf)">', dom), "no highlighted code in the rendered page"
    # Chromium logs every console message (console.error and uncaught exceptions among them)
    # as INFO:CONSOLE, with no level: the site's pages log none at all.
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "\n".join(console)
    screenshot = Path(os.environ.get("COLO_DATA_SCREENSHOTS", tmp_path)) / f"{path.strip('/').replace('/', '-') or 'home'}.png"
    shot = chromium(f"{served}/{path}", tmp_path, f"--screenshot={screenshot}", "--window-size=1280,900")
    assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-3000:]
