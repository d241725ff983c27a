"""The documentation runs: every Python code block of the README and of `docs/` is executed
(a page's blocks in order, as one script, as a reader would paste them), the site builds
with `mkdocs build --strict` (broken links, anchors and API references fail), every built
page's text is free of Markdown that did not render (Python-Markdown, unlike GitHub, needs a
blank line before a list, a table or a code fence), and the built pages load in headless
Chromium with navigation, highlighted code and no console error.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
from run_lock import held

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


def run_page(page: Path, directory: Path) -> subprocess.CompletedProcess[str]:
    """The page's script, run as a reader would run it, in `directory`, its temporary files
    (a page's `tempfile.mkdtemp`) there too: pytest removes them with its old runs."""
    path = directory / f"{page.name}.py"  # a traceback names the page, at the page's line
    path.write_text(script(page))
    (temp := directory / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a reader's JAX: one CPU device unless a page asks
    env["TMPDIR"] = str(temp)
    with held(alone=False, queue=False):  # in the background (`page_runs`): not while a `serial` test runs elsewhere
        return subprocess.run([sys.executable, str(path)], cwd=directory, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def page_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Future]]:
    """Each selected page's script, one process a CPU at a time, in the order of their tests:
    each is a Python process that mostly waits on one core for its imports, so on 2 CPUs the
    pages take about half the time one after another took (the first test waits for its own
    page while the next one runs)."""
    pages = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_the_page_examples_run" and hasattr(item, "callspec")
    ]
    directories = {page: tmp_path_factory.mktemp(page.name) for page in pages}
    with ThreadPoolExecutor(max(1, min(4, len(os.sched_getaffinity(0))))) as pool:
        futures = {page: pool.submit(run_page, page, directories[page]) for page in pages}
        yield futures
        for future in futures.values():
            future.cancel()  # those not started (a run stopped early): the rest finish before the pool closes


@pytest.mark.parametrize("page", RUN, ids=name)
def test_the_page_examples_run(page: Path, page_runs: dict[Path, Future], tmp_path: Path) -> None:
    result = page_runs[page].result() if page in page_runs else run_page(page, tmp_path)
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
        built = built_page(site, page)
        assert built.exists(), f"{name(page)} was not built ({built})"
    reference = (site / "reference" / "pipelines" / "index.html").read_text()
    assert 'id="colo_data.pipeline.native.Pipeline"' in reference, "the API reference has no Pipeline entry"


def built_page(site: Path, page: Path) -> Path:
    """Where the site build puts a page of `docs/`."""
    relative = page.relative_to(ROOT / "docs").with_suffix("")
    return site / ("index.html" if relative.name == "index" else f"{relative}/index.html")


CODE = {"code", "pre", "script", "style"}  # their text is code, where Markdown is left alone
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
TEXT_BLOCKS = {"p", "li", "td", "th", "dt", "dd", "summary", "figcaption", *HEADINGS}
BLOCKS = {"div", "pre", "table", "ul", "ol", "dl", "blockquote", "details", "p", *HEADINGS}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
EMPHASIS = {"strong", "em", "b", "i"}
HIDDEN = "\N{HORIZONTAL ELLIPSIS}"  # stands for a piece of code in the text: not a word, no Markdown
LINE_MARKERS = [  # at the start of a line of a paragraph, list item or cell (a heading may start "1. ")
    (re.compile(r"\s*(?:[-*+]|\d+\.)\s"), "a list that stayed in a paragraph (it needs a blank line before it)"),
    (re.compile(r"\s*\|"), "a table row that stayed in a paragraph (a table needs a blank line before it)"),
]
LITERALS = [  # anywhere in the text; the first that matches a line names it
    (re.compile(r"```"), "a literal code fence (a fence must start its own block, after a blank line)"),
    # `2**31` between two operands is the docs' way to write a power and renders as written
    # (the API reference's docstrings too); any other ** is emphasis that did not render
    (re.compile(r"(?<![\w)\]])\*\*|\*\*(?![\w(])"), "a literal ** (emphasis that did not render, or code that needs backticks)"),
    (re.compile(r"__"), "a literal __ (emphasis that did not render, or a Python name that needs backticks)"),
    (re.compile(r"`"), "a literal backtick (code that did not render)"),
    (re.compile(r"\]\("), "a literal ]( (a link that did not render)"),
]


@dataclass
class TextBlock:
    """A paragraph, list item, cell or heading being read: its text (code as HIDDEN) and the
    blocks opened inside it."""

    tag: str
    pieces: list[str]
    holds: list[str]


def shorten(text: str, most: int = 100) -> str:
    """The text on one line, its middle cut to keep it under `most` characters."""
    text = " ".join(text.split())
    return text if len(text) <= most else f"{text[: most // 2]} {HIDDEN} {text[-most // 2 :]}"


class Unrendered(HTMLParser):
    """Finds Markdown that Python-Markdown left as text in a built page's main content (its
    <article>): it reads the text of each block outside <code>/<pre>, and the emphasis in it."""

    def __init__(self, source: str) -> None:
        super().__init__()
        # Emphasis is written with asterisks: a word set in emphasis that the page's prose writes as
        # `__word__` or `_word_` is a Python name whose underscores Markdown took as emphasis.
        prose = re.sub(r"`[^`]*`", "", re.sub(r"^```.*?^```", "", source, flags=re.M | re.S))
        self.underscored = set(re.findall(r"(?<![\w`])__?(\w+?)__?(?![\w`])", prose))
        self.article = 0  # depth of <article> elements open
        self.code = 0  # depth of code elements open
        self.open: list[str] = []  # the tags open inside the article
        self.blocks: list[TextBlock] = []  # the text blocks open
        self.emphasis: list[tuple[str, int, str]] = []  # open: tag, where it starts in its block, the character before
        self.closed: tuple[str, str, str] | None = None  # closed, the character after not yet read
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "article":
            self.article += 1
        if not self.article or tag in VOID:
            return
        if tag in BLOCKS and self.open and self.open[-1] == "p" and self.blocks:
            self.blocks[-1].holds.append(tag)
        self.open.append(tag)
        if tag in CODE:
            if not self.code:
                self.add(HIDDEN)
            self.code += 1
        elif tag in TEXT_BLOCKS:
            self.settle("")
            self.blocks.append(TextBlock(tag, [], []))
        elif tag in EMPHASIS and self.blocks and not self.code:
            self.emphasis.append((tag, len(self.text()), self.text()[-1:]))

    def handle_endtag(self, tag: str) -> None:
        if not self.article or tag in VOID:
            return
        if tag == "article":
            self.article -= 1
            return
        if tag not in self.open:
            return
        while self.open[-1] != tag:  # an element HTML lets the page leave unclosed
            self.handle_endtag(self.open[-1])
        self.open.pop()
        if tag in CODE:
            self.code -= 1
        elif tag in TEXT_BLOCKS:
            self.settle("")
            self.check(self.blocks.pop())
        elif tag in EMPHASIS and self.emphasis and self.emphasis[-1][0] == tag:
            _, start, before = self.emphasis.pop()
            self.settle("")
            self.closed = (tag, self.text()[start:], before)

    def handle_data(self, data: str) -> None:
        if self.article and not self.code:
            self.add(data)

    def add(self, text: str) -> None:
        if self.blocks and text:
            self.settle(text[0])
            self.blocks[-1].pieces.append(text)

    def text(self) -> str:
        return "".join(self.blocks[-1].pieces) if self.blocks else ""

    def settle(self, after: str) -> None:
        """Judges the emphasis just closed, now that the character after it is known."""
        if self.closed is None:
            return
        tag, inner, before = self.closed
        self.closed = None
        if re.match(r"\w", before) or re.match(r"\w", after):
            # `2**16 ... 2**16` becomes 2<strong>16 ... 2</strong>16: emphasis that opens or closes
            # inside a word, which the docs never write on purpose
            what = f"<{tag}> that opens or closes inside a word (math or code: escape its * as \\* or set it in backticks)"
            self.problems.append(f"{what}: {before}<{tag}>{shorten(inner)}</{tag}>{after}")
        elif inner in self.underscored:
            self.problems.append(f"<{tag}>{inner}</{tag}> made of a Python name in underscores (it needs backticks)")

    def check(self, block: TextBlock) -> None:
        text = "".join(block.pieces)
        for inner in block.holds:
            what = f"a <{inner}> inside a paragraph (a code fence, list or table that does not start its own block)"
            self.problems.append(f"{what}: {shorten(text)!r}")
        for line in text.splitlines():
            for marker, what in LINE_MARKERS:
                if block.tag not in HEADINGS and marker.match(line):
                    self.problems.append(f"{what}: {shorten(line)!r}")
            for literal, what in LITERALS:
                if literal.search(line):
                    self.problems.append(f"{what}: {shorten(line)!r}")
                    break


def unrendered(html: str, source: str) -> list[str]:
    """What a built page (`html`, from the Markdown `source`) shows of Markdown that did not render."""
    parser = Unrendered(source)
    parser.feed(html)
    parser.close()
    return parser.problems


def test_no_page_shows_markdown_that_did_not_render(site: Path) -> None:
    problems = [
        f"{name(page)}: {problem}"
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for problem in unrendered(built_page(site, page).read_text(), page.read_text())
    ]
    assert not problems, "Markdown left as text in the built site:\n" + "\n".join(problems)


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
