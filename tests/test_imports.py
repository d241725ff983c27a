"""What importing colo-data costs: `import colo_data` loads none of the heavy optional
machinery (orbax, matplotlib, prometheus-client, kubernetes, pathwaysutils' FastAPI
server), `colo-data --help` and `colo-data manifest` start without JAX, every public name
of the lazy façade still resolves, and the package's module-level imports form no cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import colo_data

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "colo_data"
HEAVY = {"orbax", "matplotlib", "prometheus_client", "kubernetes", "fastapi"}


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
    config.write_text('pipeline = "colo_data.ops.demo:pipeline"\n[deploy]\nshm_size = "64Mi"\nhosts = 2\n')
    modules = imported_modules("-m", "colo_data.cli", "manifest", str(config), "--target", "multi-controller", cwd=tmp_path)
    assert "colo_data.ops.manifest" in modules
    assert not top_level(modules) & (HEAVY | {"jax", "grain"})


def test_every_public_name_resolves() -> None:
    """The façade's lazy names give what the modules define, and `dir()` lists them."""
    from colo_data.loader import checkpoint
    from colo_data.loader.loader import Loader
    from colo_data.ops import verify
    from colo_data.spec.pipeline import Pipeline

    resolved = (colo_data.Loader, colo_data.Pipeline, colo_data.checkpoint, colo_data.verify)
    assert resolved == (Loader, Pipeline, checkpoint, verify)
    assert callable(colo_data.checkpoint.save_args) and callable(colo_data.elastic.rebuild)
    for name in colo_data.__all__:
        assert getattr(colo_data, name) is not None, name
    assert set(colo_data.__all__) <= set(dir(colo_data))
    with pytest.raises(AttributeError, match="no attribute 'Lodaer'"):
        colo_data.Lodaer  # noqa: B018


def test_type_checking_imports_match_the_lazy_names() -> None:
    """The `if TYPE_CHECKING:` block (what type checkers see) names the same modules as
    the lazy tables (what runs), and together with the exceptions they are `__all__`."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            seen[alias.name] = f"{node.module}.{alias.name}" if alias.name in colo_data._MODULES else node.module
    assert seen == colo_data._NAMES | colo_data._MODULES
    errors = {name for name, value in vars(colo_data).items() if isinstance(value, type) and issubclass(value, Exception)}
    assert set(colo_data.__all__) == set(seen) | errors


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def executed_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when a module is imported: at module level, also
    under `if`/`try`/`with` and in class bodies, but not in functions nor under
    `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if ast.unparse(node.test) not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                yield from executed_imports(node.body)
            yield from executed_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                yield from executed_imports(part)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from executed_imports(node.body)


def import_graph() -> dict[str, set[str]]:
    """colo_data's module -> the colo_data modules its import runs, packages included:
    importing `a.b.c` runs `a`, `a.b` and `a.b.c`; `from a.b import c` also `a.b.c` when
    that is a module."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in executed_imports(ast.parse(path.read_text(), str(path)).body):
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


def test_the_import_graph_finds_a_cycle_when_there_is_one() -> None:
    graph = import_graph()
    assert {"colo_data.errors", "colo_data.ops.config", "colo_data.ops.versions"} <= graph["colo_data.ops.manifest"]
    assert "colo_data.spec.pipeline" not in graph["colo_data.ops.config"]  # under `if TYPE_CHECKING:` and in a function
    assert "colo_data.telemetry.prometheus" not in graph["colo_data.telemetry.export"]  # in a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_colo_data() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_module_paths_from_before_the_subpackages_still_import(tmp_path: Path, token_corpus: Path) -> None:
    """Scripts and config files name the old paths (`from colo_data import demo`,
    `pipeline = "colo_data.demo:pipeline"`): each is the moved module itself, never a copy."""
    import importlib

    from colo_data._moved import MOVED
    from colo_data.ops.config import load_config

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from colo_data import demo  # noqa: F401 - the form the README used to show
    from colo_data.host import HostPipeline
    from colo_data.loader import Loader
    from colo_data.telemetry import StageTimes, Telemetry

    assert (HostPipeline, Loader, Telemetry) == (colo_data.HostPipeline, colo_data.Loader, colo_data.Telemetry)
    assert StageTimes.__module__ == "colo_data.telemetry.counters"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        colo_data.loader.nothing  # noqa: B018
    config = tmp_path / "old.toml"
    config.write_text(f'pipeline = "colo_data.demo:pipeline"\n[args]\ndata_dir = "{token_corpus}"\nglobal_batch_size = 12\n')
    assert load_config(config).build().global_batch_size == 12
