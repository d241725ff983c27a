"""colo-data: colocated input pipelines for JAX.

Define a `Pipeline` (an `ArrowSource`, an `Order`, batch transforms, a global batch size);
a `Loader` runs each host's share of it and yields global `jax.Array` batches with a
small, host-count-independent checkpoint state.

The top level holds what a training script writes; the rest is in namespaces:
`cd.errors` (the exception types), `cd.sources` (every source), `cd.telemetry` (the report
and its exporter), `cd.resources` (the CPU and memory budget). This module is a thin
façade: every name but the errors is imported on first use (PEP 562), so that
`import colo_data` and the `colo-data` command start without JAX, Grain, orbax or
prometheus-client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from colo_data import errors
from colo_data.errors import ColoDataError

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from colo_data import resources, sources, telemetry
    from colo_data.backends.options import Colocated, InProcess, Sidecar
    from colo_data.io.arrow_source import ArrowSource
    from colo_data.io.dataset_index import write_index
    from colo_data.loader import checkpoint, elastic
    from colo_data.loader.loader import Loader
    from colo_data.pipeline.grain_pipeline import GrainPipeline
    from colo_data.pipeline.mix import Mix
    from colo_data.pipeline.native import Pipeline
    from colo_data.pipeline.order import Order
    from colo_data.pipeline.pack import Pack
    from colo_data.pipeline.tokenize import tokenize
    from colo_data.pipeline.transforms import drop, pad_or_truncate, per_record, random_map, select
    from colo_data.replay.lineage import lineage
    from colo_data.replay.skip import skip
    from colo_data.verification import verify
    from colo_data.workers.ray_options import RayWorkers

# public name -> the module that defines it, imported on first use
_NAMES = {
    "ArrowSource": "colo_data.io.arrow_source",
    "Colocated": "colo_data.backends.options",
    "GrainPipeline": "colo_data.pipeline.grain_pipeline",
    "InProcess": "colo_data.backends.options",
    "Loader": "colo_data.loader.loader",
    "Mix": "colo_data.pipeline.mix",
    "Order": "colo_data.pipeline.order",
    "Pack": "colo_data.pipeline.pack",
    "Pipeline": "colo_data.pipeline.native",
    "RayWorkers": "colo_data.workers.ray_options",
    "Sidecar": "colo_data.backends.options",
    "drop": "colo_data.pipeline.transforms",
    "lineage": "colo_data.replay.lineage",
    "pad_or_truncate": "colo_data.pipeline.transforms",
    "per_record": "colo_data.pipeline.transforms",
    "random_map": "colo_data.pipeline.transforms",
    "select": "colo_data.pipeline.transforms",
    "skip": "colo_data.replay.skip",
    "tokenize": "colo_data.pipeline.tokenize",
    "write_index": "colo_data.io.dataset_index",
}
# public name -> the module it stands for (`cd.checkpoint.save_args`), imported on first use
_MODULES = {
    "checkpoint": "colo_data.loader.checkpoint",
    "elastic": "colo_data.loader.elastic",
    "resources": "colo_data.resources",
    "sources": "colo_data.sources",
    "telemetry": "colo_data.telemetry",
    "verify": "colo_data.verification.verify",
}

__all__ = [
    "ArrowSource",
    "ColoDataError",
    "Colocated",
    "GrainPipeline",
    "InProcess",
    "Loader",
    "Mix",
    "Order",
    "Pack",
    "Pipeline",
    "RayWorkers",
    "Sidecar",
    "checkpoint",
    "drop",
    "elastic",
    "errors",
    "lineage",
    "pad_or_truncate",
    "per_record",
    "random_map",
    "resources",
    "select",
    "skip",
    "sources",
    "telemetry",
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
    """The public names only (not this module's own imports, nor the subpackages)."""
    return list(__all__)
