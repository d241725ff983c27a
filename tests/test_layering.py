"""The package's layers and its kinds. colo_data's rooms (its folders, and the modules that
are a room alone) are layers, and a module imports only from its own layer or one below it
(`LAYERS`, lowest first, as the "Layout" section of docs/development.md tells them): the
errors, defaults and setting checks, the runtime, telemetry, io, pipeline, the demo, host,
replay, workers, config, backends, deploy, the loader, the testing helpers, verification,
bench, the façade (`colo_data/__init__.py`), the command line. Each room sits just above
the highest one it imports from. Every import counts, as in the cycle check of
`test_imports.py` (which this file leaves to it): at module level, inside a function (one
that runs late still ties the modules together) and under `if TYPE_CHECKING:`
(docs/development.md: imports flow one way, not even a type checker's import goes back
up). A public name taken from the façade counts as an import of the module that defines it.

A kind of pipeline, of workers or of backend answers for itself through its protocol
(`PipelineKind`, `RemoteWorkers`, `BackendOptions`): no module but the one that defines a
kind asks `isinstance` of it. `isinstance(x, AnyPipeline)`, whether a value is a pipeline
at all, is a question of no kind's."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_imports import PACKAGE, ROOT, imports_in, module_name

import colo_data

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

# lowest first; a module imports from its own layer and the ones before it
LAYERS = (
    ("colo_data.errors", "colo_data.defaults", "colo_data.setting_checks"),
    ("colo_data.runtime",),
    ("colo_data.telemetry",),
    ("colo_data.io",),
    ("colo_data.pipeline",),
    ("colo_data.demo",),
    ("colo_data.host",),
    ("colo_data.replay",),
    ("colo_data.workers",),
    ("colo_data.config",),
    ("colo_data.backends",),
    ("colo_data.deploy",),
    ("colo_data.loader",),
    ("colo_data.testing",),
    ("colo_data.verification",),
    ("colo_data.bench",),
    ("colo_data", "colo_data.sources", "colo_data.resources"),  # the façade and its namespaces
    ("colo_data.cli",),
)
# the kinds that answer for themselves, each asked `isinstance` of only where it is defined
KINDS = {"Pipeline", "GrainPipeline", "RayWorkers", "RemoteWorkers", "InProcess", "Sidecar", "Colocated", "BackendOptions"}


def layer(module: str) -> int:
    """The index in `LAYERS` of `module`'s layer: of the longest name it is or is inside
    (the façade's only for `colo_data` itself)."""
    found = [
        (len(name), i) for i, names in enumerate(LAYERS) for name in names
        if module == name or (name != "colo_data" and module.startswith(name + "."))
    ]
    assert found, f"{module} is in no layer: add its folder to LAYERS (and to docs/development.md)"
    return max(found)[1]


def modules() -> dict[str, Path]:
    """colo_data's module names -> their files."""
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(tree: ast.Module, known: set[str]) -> Iterator[tuple[str, int]]:
    """The colo_data modules a module's imports name, with their lines: `import a.b`
    names `a.b`, `from a import b` names `a.b` where that is a module, else `a`; a name
    from the façade (`from colo_data import Loader`) names the module that defines it."""
    lazy = {**colo_data._NAMES, **colo_data._MODULES}
    for node in imports_in(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names if alias.name in known)
            continue
        assert not node.level, f"line {node.lineno}: a relative import; write the module's full name"
        base, named = node.module or "", set()
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in known:
                named.add(full)
            elif base == "colo_data":  # a public name: lazy, or one of the exceptions it imports itself
                named.add(lazy.get(alias.name, "colo_data.errors"))
            elif base in known:
                named.add(base)
        yield from ((name, node.lineno) for name in sorted(named))


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Each import of a module from a layer above its own, as `module:line -> module`."""
    return [
        f"{source}:{line} -> {target}"
        for source, targets in sorted(graph.items())
        for target, line in targets
        if layer(target) > layer(source)
    ]


def test_the_layer_check_finds_an_import_from_above() -> None:
    graph = {
        "colo_data.host.shares": [("colo_data.workers.ray_options", 17), ("colo_data.setting_checks", 16)],
        "colo_data.cli.bench": [("colo_data.backends.options", 16)],
        "colo_data.io.arrow_source": [("colo_data.pipeline.order", 51)],
    }
    assert upward_imports(graph) == [
        "colo_data.host.shares:17 -> colo_data.workers.ray_options",
        "colo_data.io.arrow_source:51 -> colo_data.pipeline.order",
    ]
    assert layer("colo_data") > layer("colo_data.bench") and layer("colo_data.cli.bench") > layer("colo_data")
    tree = ast.parse("from colo_data import Loader, defaults\nif TYPE_CHECKING:\n    import colo_data.pipeline.kinds\n"
                     "def f():\n    from colo_data.pipeline.order import Order\n")
    assert list(imported(tree, set(modules()))) == [
        ("colo_data.defaults", 1), ("colo_data.loader.loader", 1), ("colo_data.pipeline.kinds", 3), ("colo_data.pipeline.order", 5)
    ]


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    paths = modules()
    graph = {name: list(imported(ast.parse(path.read_text(), str(path)), set(paths))) for name, path in paths.items()}
    found = upward_imports(graph)
    assert not found, "imports from a layer above (LAYERS, lowest first):\n" + "\n".join(found)


def kind_checks(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """The kinds (`KINDS`) that `isinstance` or `issubclass` calls, or `type(x) is` and
    `==` comparisons, ask about, with their lines; a kind written as `cd.Name`, in a tuple
    or in a union counts."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            asked = node.args[1:]
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.Eq) for op in node.ops):
            sides = [node.left, *node.comparators]
            typed = any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides)
            asked = sides if typed else []
        else:
            continue
        for part in (n for a in asked for n in ast.walk(a)):
            name = part.id if isinstance(part, ast.Name) else part.attr if isinstance(part, ast.Attribute) else None
            if name in KINDS:
                yield name, node.lineno


def test_the_kind_check_finds_each_way_of_asking() -> None:
    source = (
        "isinstance(p, cd.GrainPipeline)\nisinstance(w, (int, RayWorkers))\nissubclass(b, InProcess | Sidecar)\n"
        "type(b) is Colocated\nisinstance(p, AnyPipeline)\nisinstance(p, HostPipeline)\ntype(p) == cd.Pipeline\n"
    )
    assert list(kind_checks(ast.parse(source))) == [
        ("GrainPipeline", 1), ("RayWorkers", 2), ("InProcess", 3), ("Sidecar", 3), ("Colocated", 4), ("Pipeline", 7)
    ]


def test_no_module_asks_isinstance_of_a_kind_it_does_not_define() -> None:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}
    defined = {
        node.name: path for path, tree in trees.items() for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name in KINDS
    }
    assert set(defined) == KINDS, f"kinds defined nowhere: {sorted(KINDS - set(defined))}"
    found = sorted(
        f"{path.relative_to(ROOT)}:{line} asks about {name} (defined in {defined[name].relative_to(ROOT)})"
        for path, tree in trees.items()
        for name, line in kind_checks(tree)
        if path != defined[name]
    )
    assert not found, "ask the kind (its protocol's members) instead:\n" + "\n".join(found)


def private_uses(tree: ast.Module, module: str, known: set[str]) -> Iterator[str]:
    """Each private name (one leading underscore) of another colo_data module that `tree`
    imports (`from colo_data.a import _b`) or reads through a module it imported
    (`from colo_data import a` then `a._b`, or `import colo_data.a as a`), as
    `line: module._name`."""
    aliases: dict[str, str] = {}
    for node in imports_in(tree):
        if isinstance(node, ast.Import):
            aliases.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known})
            continue
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            if full in known:
                aliases[alias.asname or alias.name] = full
            elif node.module in known and node.module != module and alias.name.startswith("_") and not alias.name.startswith("__"):
                yield f"{node.lineno}: {node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != module
        ):
            yield f"{node.lineno}: {aliases[node.value.id]}.{node.attr}"


def test_the_private_name_check_finds_each_way_of_reaching_one() -> None:
    known = {"colo_data.host.worker_policy", "colo_data.pipeline.parts", "colo_data.setting_checks"}
    source = (
        "from colo_data.host.worker_policy import _Means, WorkerPolicy\nfrom colo_data.pipeline import parts\n"
        "import colo_data.setting_checks as checks\nparts._cap(1)\nchecks.as_int(2)\nchecks._digits\nparts.__doc__\n"
    )
    found = sorted(private_uses(ast.parse(source), "colo_data.host.pool_schedule", known))
    assert found == ["1: colo_data.host.worker_policy._Means", "4: colo_data.pipeline.parts._cap", "6: colo_data.setting_checks._digits"]
    assert not list(private_uses(ast.parse("from colo_data.pipeline import parts\nparts._cap\n"), "colo_data.pipeline.parts", known))


def test_no_module_uses_another_modules_private_name() -> None:
    paths = modules()
    found = [
        f"{name}:{use}" for name, path in sorted(paths.items())
        for use in private_uses(ast.parse(path.read_text(), str(path)), name, set(paths))
    ]
    assert not found, "a private name used outside its module: make it public, or move the code that needs it:\n" + "\n".join(found)


def name_checks(tree: ast.AST) -> Iterator[int]:
    """The lines that ask which backend a value is by its name (`x.name == "sidecar"`) or
    which workers a host has by the words of why they were chosen (`"Ray" in
    h.workers_chosen`), where a member should answer."""
    from colo_data.backends.options import NAMES

    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides) and any(
            isinstance(s, ast.Constant) and s.value in NAMES for s in sides
        )
        worded = any(isinstance(s, ast.Attribute) and s.attr == "workers_chosen" for s in sides) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        )
        if named or worded:
            yield node.lineno


def test_the_name_check_finds_a_backend_asked_by_name() -> None:
    source = 'if b.name == "sidecar": pass\nif "Ray actor" in h.workers_chosen: pass\nif s.name == "read": pass\nb.ships_to\n'
    assert list(name_checks(ast.parse(source))) == [1, 2]


def test_backends_and_workers_are_asked_by_their_members_not_their_names() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
        for line in name_checks(ast.parse(path.read_text()))
        if path != PACKAGE / "backends" / "options.py"  # where `resolve` reads a backend's name, the one place
    ]
    assert not found, "ask a member (BackendOptions.ships_to, HostSide.remote_workers) instead:\n" + "\n".join(found)
