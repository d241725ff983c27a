"""The public surface, pinned: the top level a newcomer reads in one screen (`dir(cd)`, at
most 30 names), the namespaces that hold the rest (and only they), and the API reference
pages, which document exactly these names. Every `cd.NAME` the docs and the package's own
messages mention resolves."""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import Any

import pytest
from test_imports import PACKAGE, ROOT

import colo_data as cd
import colo_data.testing
import colo_data.testing.storage

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

TOP = [
    "ArrowSource", "ColoDataError", "Colocated", "GrainPipeline", "InProcess", "Loader", "Mix", "Order", "Pack",
    "Pipeline", "RayWorkers", "Sidecar", "checkpoint", "drop", "elastic", "errors", "lineage", "pad_or_truncate",
    "per_record", "random_map", "resources", "select", "skip", "sources", "telemetry", "tokenize", "verify",
    "write_index",
]
NAMESPACES = {
    "errors": [
        "ColoDataError", "ConfigError", "CorruptFileError", "GrainError", "LoaderBusyError",
        "LoaderClosedError", "RayClusterError", "RecordIndexError", "RemoteError", "ResourceError", "SchemaError",
        "ShmError", "SidecarError", "SourceError", "StaleIndexError", "StateError", "TransformError",
    ],
    "sources": [
        "ArrayRecordSource", "ArrowSource", "Column", "Columns", "RecordSource", "Source", "parse_json",
        "parse_tf_example", "write_index",
    ],
    "telemetry": [
        "ColumnQuality", "ComponentShare", "HostSide", "Lost", "Phase", "Quality", "Stage", "Telemetry",
        "TelemetryExport",
    ],
    "resources": ["CpuBudget", "cpu_budget", "grain_multiprocessing_options", "memory_limit"],
}
# modules a reference page documents whole or member by member: the top level's and the testing helpers'
MODULE_PAGES = ("checkpoint", "elastic", "verify")
REFERENCE = ROOT / "docs" / "reference"
DIRECTIVE = re.compile(r"^::: (\S+)\n(?:    options:\n      members: \[([^\]]*)\]\n)?", re.MULTILINE)
MENTION = re.compile(r"(?<![\w.\-/])cd\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


def test_the_top_level_is_one_screen_of_names_meant_for_users() -> None:
    assert dir(cd) == TOP == sorted(cd.__all__)
    assert len(TOP) <= 30
    for name in TOP:
        value = getattr(cd, name)
        assert value.__doc__, f"cd.{name} has no docstring"


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_each_namespace_holds_its_pinned_names(namespace: str) -> None:
    module = getattr(cd, namespace)
    assert isinstance(module, ModuleType) and module.__doc__
    assert sorted(module.__all__) == NAMESPACES[namespace]
    for name in module.__all__:
        assert getattr(module, name) is not None, f"cd.{namespace}.{name}"
    # what is both at the top and in a namespace is one object
    for name in set(module.__all__) & set(TOP):
        assert getattr(module, name) is getattr(cd, name), name


def test_a_namespace_name_is_not_at_the_top_level() -> None:
    for name in {name for names in NAMESPACES.values() for name in names} - set(TOP):
        with pytest.raises(AttributeError, match=rf"no attribute '{name}'$"):
            getattr(cd, name)
    for internal in ("HostPipeline", "host_rows", "GlobalOrder", "auto_backend", "annotations", "importlib", "Any"):
        assert internal not in dir(cd)
    with pytest.raises(AttributeError, match=r"no attribute 'HostPipeline'$"):
        cd.HostPipeline  # noqa: B018  (internal now: colo_data.host.host_pipeline)


def documented() -> list[tuple[str, Any, Any]]:
    """What the reference pages document: each `:::` directive's object, or each member it
    lists, as (`page: path`, object, the module it is listed from or None)."""
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        for path, members in DIRECTIVE.findall(page.read_text()):
            try:
                target: Any = importlib.import_module(path)
            except ModuleNotFoundError:
                module, _, name = path.rpartition(".")
                target = getattr(importlib.import_module(module), name)
            if not members:
                found.append((f"{page.name}: {path}", target, None))
            for member in filter(None, (m.strip() for m in members.split(","))):
                found.append((f"{page.name}: {path}.{member}", getattr(target, member), target))
    return found


def public_objects() -> list[Any]:
    """Every public object: the top level's (modules included) and the namespaces'."""
    found = [getattr(cd, name) for name in TOP if name not in NAMESPACES]
    found += [getattr(getattr(cd, ns), name) for ns, names in NAMESPACES.items() for name in names]
    return found


def test_the_reference_pages_document_the_public_surface_and_nothing_else() -> None:
    pages = documented()
    objects = [value for _, value, _ in pages] + [listed_from for _, _, listed_from in pages if listed_from]
    modules = [getattr(cd, name) for name in MODULE_PAGES] + [colo_data.testing, colo_data.testing.storage]
    public = public_objects()

    def is_public(value: Any, listed_from: Any) -> bool:
        return any(value is p for p in public) or any(value is m or listed_from is m for m in modules)

    internal = [where for where, value, listed_from in pages if not is_public(value, listed_from)]
    assert not internal, f"reference pages document names that are not public: {internal}"
    undocumented = [
        f"{ns}.{name}" if ns else name
        for ns, names in [("", [n for n in TOP if n not in NAMESPACES]), *NAMESPACES.items()]
        for name in names
        if not any(getattr(getattr(cd, ns) if ns else cd, name) is value for value in objects)
    ]
    assert not undocumented, f"public names no reference page documents: {undocumented}"


def mentions() -> list[tuple[str, str, str | None]]:
    """Every `cd.NAME` or `cd.NAME.NAME` in the README, the docs, the examples and the
    package's own text, as (where, name, attribute)."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.py"),
             *PACKAGE.rglob("*.py"), *(PACKAGE / "deploy" / "templates").rglob("*")]
    found = []
    for path in files:
        if path.is_file():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                found.extend((f"{path.relative_to(ROOT)}:{number}", m[1], m[2]) for m in MENTION.finditer(line))
    return found


def test_every_name_the_docs_and_messages_mention_resolves() -> None:
    seen = mentions()
    assert len(seen) > 200, "too few cd.NAME mentions found: is the pattern right?"
    broken = []
    for where, name, attribute in seen:
        try:
            value = getattr(cd, name)
        except AttributeError as e:
            broken.append(f"{where}: cd.{name} ({e})")
            continue
        if attribute and isinstance(value, ModuleType) and not hasattr(value, attribute):
            broken.append(f"{where}: cd.{name}.{attribute}")
    assert not broken, "mentions of names that do not resolve:\n" + "\n".join(broken)


def test_getting_started_lists_the_whole_top_level() -> None:
    """docs/getting-started.md's table of what `colo_data` holds names every top-level name,
    and no other."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    table = page.split("## What `colo_data` holds", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert named == set(TOP), f"missing: {set(TOP) - named}; not public: {named - set(TOP)}"
