"""colo-data: colocated input pipelines for JAX.

Define a `Pipeline` (an `ArrowSource`, an `Order`, batch transforms, a global batch size);
a `Loader` runs each host's share of it and yields global `jax.Array` batches with a
small, host-count-independent checkpoint state.
"""

from colo_data.errors import (
    ColoDataError,
    ConfigError,
    CorruptFileError,
    LoaderClosedError,
    RecordIndexError,
    SchemaError,
    ShmError,
    SidecarError,
    SourceError,
    StateError,
    TransformError,
)
from colo_data.host.pipeline import HostPipeline
from colo_data.host.resources import CpuBudget, cpu_budget, memory_limit
from colo_data.io.columns import Column, Columns
from colo_data.io.sources import ArrowSource, RecordSource, Source
from colo_data.loader import checkpoint, elastic
from colo_data.loader.loader import Loader
from colo_data.ops import verify
from colo_data.spec.order import GlobalOrder, Order, host_rows
from colo_data.spec.pack import Pack
from colo_data.spec.pipeline import Pipeline
from colo_data.spec.transforms import pad_or_truncate, per_record
from colo_data.telemetry.export import TelemetryExport
from colo_data.telemetry.report import Telemetry

__all__ = [
    "ArrowSource",
    "ColoDataError",
    "Column",
    "Columns",
    "ConfigError",
    "CorruptFileError",
    "CpuBudget",
    "GlobalOrder",
    "HostPipeline",
    "Loader",
    "LoaderClosedError",
    "Order",
    "Pack",
    "Pipeline",
    "RecordIndexError",
    "RecordSource",
    "SchemaError",
    "ShmError",
    "SidecarError",
    "Source",
    "SourceError",
    "StateError",
    "Telemetry",
    "TelemetryExport",
    "TransformError",
    "checkpoint",
    "cpu_budget",
    "elastic",
    "host_rows",
    "memory_limit",
    "pad_or_truncate",
    "per_record",
    "verify",
]
