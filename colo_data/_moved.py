"""The module paths of colo-data before its subpackages (`colo_data.demo`, `colo_data.sources`,
`colo_data.sidecar.server`, ...), kept importable: scripts and config files name them
(`pipeline = "colo_data.demo:pipeline"`). An old path is the new module itself, not a copy.
Where an old module became a package of the same name (`colo_data.loader`, `colo_data.host`,
`colo_data.telemetry`), the package hands out the old module's names (`old_names`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

MOVED = {
    "colo_data.bench": "colo_data.ops.bench",
    "colo_data.checkpoint": "colo_data.loader.checkpoint",
    "colo_data.columns": "colo_data.io.columns",
    "colo_data.config": "colo_data.ops.config",
    "colo_data.demo": "colo_data.ops.demo",
    "colo_data.elastic": "colo_data.loader.elastic",
    "colo_data.gather": "colo_data.io.gather",
    "colo_data.loader_telemetry": "colo_data.loader.meters",
    "colo_data.manifest": "colo_data.ops.manifest",
    "colo_data.order": "colo_data.spec.order",
    "colo_data.packing": "colo_data.host.packing",
    "colo_data.pipeline": "colo_data.spec.pipeline",
    "colo_data.placement": "colo_data.backends.placement",
    "colo_data.prefetch": "colo_data.runtime.prefetch",
    "colo_data.resources": "colo_data.host.resources",
    "colo_data.rowgroup_cache": "colo_data.io.rowgroup_cache",
    "colo_data.shm": "colo_data.backends.sidecar.shm",
    "colo_data.sidecar": "colo_data.backends.sidecar",
    "colo_data.sidecar.client": "colo_data.backends.sidecar.client",
    "colo_data.sidecar.colocated": "colo_data.backends.colocated",
    "colo_data.sidecar.local": "colo_data.backends.sidecar.local",
    "colo_data.sidecar.protocol": "colo_data.backends.sidecar.protocol",
    "colo_data.sidecar.server": "colo_data.backends.sidecar.server",
    "colo_data.sources": "colo_data.io.sources",
    "colo_data.state": "colo_data.spec.state",
    "colo_data.telemetry_export": "colo_data.telemetry.export",
    "colo_data.transforms": "colo_data.spec.transforms",
    "colo_data.verify": "colo_data.ops.verify",
    "colo_data.versions": "colo_data.ops.versions",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module it moved to."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module it moved to ran already


def install() -> None:
    """Make the old paths importable (once per process). First on the meta path: an old
    package path (`colo_data.sidecar`) is the new package, and its old submodules must
    resolve to the new modules too, not be found again under the new package's folder."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


def old_names(package: str, modules: tuple[str, ...], name: str) -> Any:
    """`name` from the first of `modules` that has it: a package's `__getattr__` for the
    names its same-named old module had. AttributeError when none has it."""
    for module in modules:
        value = getattr(importlib.import_module(module), name, None)
        if value is not None:
            return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
