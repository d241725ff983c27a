"""colo-data: colocated input pipelines for JAX.

Define a `Pipeline` (an `ArrowSource`, an `Order`, batch transforms, a global batch size);
a `Loader` runs each host's share of it and yields global `jax.Array` batches with a
small, host-count-independent checkpoint state.

This module is a thin façade: the exceptions are imported here, every other public name
on first use (PEP 562), so that `import colo_data` and the `colo-data` command start
without JAX, Grain, orbax or prometheus-client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from colo_data.errors import (
    ArgumentError,
    ColoDataError,
    ConfigError,
    CorruptFileError,
    GrainError,
    LoaderBusyError,
    LoaderClosedError,
    RayClusterError,
    RecordIndexError,
    ResourceError,
    SchemaError,
    ShmError,
    SidecarError,
    SourceError,
    StaleIndexError,
    StateError,
    TransformError,
)

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from colo_data.backends.options import Colocated, InProcess, Sidecar, auto_backend
    from colo_data.host.pipeline import HostPipeline
    from colo_data.host.resources import CpuBudget, cpu_budget, grain_multiprocessing_options, memory_limit
    from colo_data.io.array_record import ArrayRecordSource, parse_json
    from colo_data.io.columns import Column, Columns
    from colo_data.io.dataset_index import write_index
    from colo_data.io.sources import ArrowSource, RecordSource, Source
    from colo_data.io.tf_example import parse_tf_example
    from colo_data.loader import checkpoint, elastic
    from colo_data.loader.loader import Loader
    from colo_data.ops import verify
    from colo_data.ops.lineage import lineage
    from colo_data.ops.skip import skip
    from colo_data.spec.grain_pipeline import GrainPipeline
    from colo_data.spec.mix import Mix
    from colo_data.spec.order import GlobalOrder, Order, host_rows
    from colo_data.spec.pack import Pack
    from colo_data.spec.pipeline import Pipeline
    from colo_data.spec.tokenize import tokenize
    from colo_data.spec.transforms import drop, pad_or_truncate, per_record, random_map, select
    from colo_data.telemetry.export import TelemetryExport
    from colo_data.telemetry.report import Telemetry
    from colo_data.workers.ray_workers import RayWorkers

# public name -> the module that defines it, imported on first use
_NAMES = {
    "ArrayRecordSource": "colo_data.io.array_record",
    "ArrowSource": "colo_data.io.sources",
    "Colocated": "colo_data.backends.options",
    "Column": "colo_data.io.columns",
    "Columns": "colo_data.io.columns",
    "CpuBudget": "colo_data.host.resources",
    "GlobalOrder": "colo_data.spec.order",
    "GrainPipeline": "colo_data.spec.grain_pipeline",
    "HostPipeline": "colo_data.host.pipeline",
    "InProcess": "colo_data.backends.options",
    "Loader": "colo_data.loader.loader",
    "Mix": "colo_data.spec.mix",
    "Order": "colo_data.spec.order",
    "Pack": "colo_data.spec.pack",
    "Pipeline": "colo_data.spec.pipeline",
    "RayWorkers": "colo_data.workers.ray_workers",
    "RecordSource": "colo_data.io.sources",
    "Sidecar": "colo_data.backends.options",
    "Source": "colo_data.io.sources",
    "Telemetry": "colo_data.telemetry.report",
    "TelemetryExport": "colo_data.telemetry.export",
    "auto_backend": "colo_data.backends.options",
    "cpu_budget": "colo_data.host.resources",
    "drop": "colo_data.spec.transforms",
    "grain_multiprocessing_options": "colo_data.host.resources",
    "host_rows": "colo_data.spec.order",
    "lineage": "colo_data.ops.lineage",
    "memory_limit": "colo_data.host.resources",
    "pad_or_truncate": "colo_data.spec.transforms",
    "parse_json": "colo_data.io.array_record",
    "parse_tf_example": "colo_data.io.tf_example",
    "per_record": "colo_data.spec.transforms",
    "random_map": "colo_data.spec.transforms",
    "select": "colo_data.spec.transforms",
    "skip": "colo_data.ops.skip",
    "tokenize": "colo_data.spec.tokenize",
    "write_index": "colo_data.io.dataset_index",
}
# public name -> the module it stands for (`cd.checkpoint.save_args`), imported on first use
_MODULES = {
    "checkpoint": "colo_data.loader.checkpoint",
    "elastic": "colo_data.loader.elastic",
    "verify": "colo_data.ops.verify",
}

__all__ = [
    "ArgumentError",
    "ArrayRecordSource",
    "ArrowSource",
    "ColoDataError",
    "Colocated",
    "Column",
    "Columns",
    "ConfigError",
    "CorruptFileError",
    "CpuBudget",
    "GlobalOrder",
    "GrainError",
    "GrainPipeline",
    "HostPipeline",
    "InProcess",
    "Loader",
    "LoaderBusyError",
    "LoaderClosedError",
    "Mix",
    "Order",
    "Pack",
    "Pipeline",
    "RayClusterError",
    "RayWorkers",
    "RecordIndexError",
    "RecordSource",
    "ResourceError",
    "SchemaError",
    "ShmError",
    "Sidecar",
    "SidecarError",
    "Source",
    "SourceError",
    "StaleIndexError",
    "StateError",
    "Telemetry",
    "TelemetryExport",
    "TransformError",
    "auto_backend",
    "checkpoint",
    "cpu_budget",
    "drop",
    "elastic",
    "grain_multiprocessing_options",
    "host_rows",
    "lineage",
    "memory_limit",
    "pad_or_truncate",
    "parse_json",
    "parse_tf_example",
    "per_record",
    "random_map",
    "select",
    "skip",
    "tokenize",
    "verify",
    "write_index",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the value here."""
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'colo_data' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
