"""What importing colo-data costs: `import colo_data` loads none of the heavy optional
machinery (orbax, matplotlib, prometheus-client, kubernetes, pathwaysutils' FastAPI
server, Ray), `colo-data --help` and `colo-data manifest` start without JAX, every public name
of the lazy façade still resolves, the package's imports form no cycle (not even behind
`TYPE_CHECKING` or inside functions), and importing it installs no import machinery."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import colo_data

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "colo_data"
HEAVY = {"orbax", "matplotlib", "prometheus_client", "kubernetes", "fastapi", "ray"}


def imported_modules(*args: str, cwd: Path) -> set[str]:
    """The modules `python -X importtime ARGS` imports, read from its import-time lines
    (stderr: `import time: self | cumulative | <indent>module`)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        check=False, capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    modules.discard("imported package")  # the header line
    assert "colo_data" in modules or "colo_data.cli" in modules, "no import-time lines read: " + run.stderr[-2000:]
    return modules


def top_level(modules: set[str]) -> set[str]:
    return {name.partition(".")[0] for name in modules}


def test_import_colo_data_leaves_the_heavy_machinery_alone(tmp_path: Path) -> None:
    modules = imported_modules("-c", "import colo_data", cwd=tmp_path)
    assert not top_level(modules) & HEAVY, sorted(name for name in modules if name.partition(".")[0] in HEAVY)


def test_cli_help_and_manifest_start_without_jax(tmp_path: Path) -> None:
    assert "jax" not in top_level(imported_modules("-m", "colo_data.cli", "--help", cwd=tmp_path))
    config = tmp_path / "deploy.toml"  # shm_size given: nothing to measure, so no pipeline is built
    config.write_text('pipeline = "colo_data.demo:pipeline"\n[deploy]\nshm_size = "64Mi"\nhosts = 2\n')
    modules = imported_modules("-m", "colo_data.cli", "manifest", str(config), "--target", "multi-controller", cwd=tmp_path)
    assert "colo_data.deploy.manifest" in modules
    assert not top_level(modules) & (HEAVY | {"jax", "grain"})


def test_every_public_name_resolves() -> None:
    """The façade's lazy names give what the modules define, and `dir()` lists them."""
    from colo_data.loader import checkpoint
    from colo_data.loader.loader import Loader
    from colo_data.pipeline.native import Pipeline
    from colo_data.verification import verify

    resolved = (colo_data.Loader, colo_data.Pipeline, colo_data.checkpoint, colo_data.verify)
    assert resolved == (Loader, Pipeline, checkpoint, verify)
    assert callable(colo_data.checkpoint.save_args) and callable(colo_data.elastic.rebuild)
    for name in colo_data.__all__:
        assert getattr(colo_data, name) is not None, name
    assert dir(colo_data) == colo_data.__all__
    with pytest.raises(AttributeError, match="no attribute 'Lodaer'"):
        colo_data.Lodaer  # noqa: B018


def test_no_room_is_named_like_a_public_name_it_is_not() -> None:
    """Importing `colo_data.X` makes `X` an attribute of `colo_data`, so a module or package
    named like a public name it is not (a `colo_data/lineage/` beside the function
    `cd.lineage`) would replace that name as soon as anything imported it."""
    rooms = {path.stem for path in PACKAGE.glob("*.py")} | {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    for name in rooms & set(colo_data.__all__):
        assert getattr(colo_data, name) is importlib.import_module(f"colo_data.{name}"), f"colo_data/{name} is not cd.{name}"


def test_type_checking_imports_match_the_lazy_names() -> None:
    """The `if TYPE_CHECKING:` block (what type checkers see) names the same modules as
    the lazy tables (what runs), and together with the errors (imported at once) they are
    `__all__`."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            seen[alias.name] = f"{node.module}.{alias.name}" if alias.name in colo_data._MODULES else node.module
    assert seen == colo_data._NAMES | colo_data._MODULES
    assert set(colo_data.__all__) == set(seen) | {"errors", "ColoDataError"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: at module level, under `if TYPE_CHECKING:` and
    inside functions alike. An import that runs only for a type checker or only when a
    function is called still ties the two modules together: a circle through one is a
    circle in the design, even where it cannot fail at run time."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def import_graph() -> dict[str, set[str]]:
    """colo_data's module -> the colo_data modules it imports, packages included: importing
    `a.b.c` runs `a`, `a.b` and `a.b.c`; `from a.b import c` also `a.b.c` when that is a
    module. A module's own packages are left out (they run before it, never because of it)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in imports_in(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        runs: set[str] = set()
        for target in targets:
            parts = target.split(".")
            runs.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {target for target in runs if target in paths and target != name and not name.startswith(target + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_sees_every_import_and_finds_a_cycle_when_there_is_one() -> None:
    graph = import_graph()
    assert {"colo_data.errors", "colo_data.config", "colo_data.deploy.versions"} <= graph["colo_data.deploy.manifest"]
    assert "colo_data.pipeline.kinds" in graph["colo_data.config"]  # under `if TYPE_CHECKING:` and in a function
    assert "colo_data.telemetry.prometheus" in graph["colo_data.telemetry.export"]  # in a function
    assert "colo_data.backends.inprocess" in graph["colo_data.backends.options"]  # in a method
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_colo_data() -> None:
    """No circle at all: not at module level, not behind `TYPE_CHECKING`, not through an
    import inside a function."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_importing_colo_data_changes_no_import_machinery(tmp_path: Path) -> None:
    """`import colo_data` leaves `sys.meta_path` and `sys.path_hooks` as they were (no finder
    of its own), and each package's names are its modules, with no forwarding `__getattr__`."""
    check = (
        "import sys; before = (list(sys.meta_path), list(sys.path_hooks)); import colo_data, colo_data.cli; "
        "assert (list(sys.meta_path), list(sys.path_hooks)) == before, sys.meta_path"
    )
    run = subprocess.run([sys.executable, "-c", check], check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    forwarders = [name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("__init__.py")) if name != "colo_data"
                  and "def __getattr__" in path.read_text()]
    assert not forwarders, f"packages that forward names of other modules: {forwarders}"


def mix_checks(tree: ast.AST) -> list[int]:
    """Lines of `isinstance(..., Mix)` (or a tuple holding `Mix`) in a module's syntax tree."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            kinds = node.args[1] if len(node.args) == 2 else None
            names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", None) for n in ast.walk(kinds)} if kinds else set()
            if "Mix" in names:
                lines.append(node.lineno)
    return lines


def test_only_the_mixtures_module_asks_whether_a_source_is_a_mix() -> None:
    """A mixture is an ordinary source: what is special about it lives in `pipeline/mix.py` (its
    `Stream`), and the rest of colo-data asks the pipeline's stream, not the source's type."""
    assert mix_checks(ast.parse("if isinstance(s, cd.Mix) or isinstance(s, (int, Mix)): pass")) == [1, 1]
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "pipeline" / "mix.py"
        for line in mix_checks(ast.parse(path.read_text()))
    }
    assert not found, f"isinstance(..., Mix) outside colo_data/pipeline/mix.py: {sorted(found)}"
