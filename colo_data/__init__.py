"""colo-data: colocated input pipelines for JAX.

Define a `Pipeline` (an `ArrowSource`, an `Order`, batch transforms, a global batch size);
a `Loader` runs each host's share of it and yields global `jax.Array` batches with a
small, host-count-independent checkpoint state.
"""

from colo_data.columns import Column, Columns
from colo_data.errors import (
    ColoDataError,
    ConfigError,
    CorruptFileError,
    RecordIndexError,
    SchemaError,
    SourceError,
    StateError,
    TransformError,
)
from colo_data.host import HostPipeline
from colo_data.loader import Loader
from colo_data.order import GlobalOrder, Order, host_rows
from colo_data.pipeline import Pipeline
from colo_data.sources import ArrowSource, RecordSource, Source
from colo_data.transforms import pad_or_truncate, per_record

__all__ = [
    "ArrowSource",
    "ColoDataError",
    "Column",
    "Columns",
    "ConfigError",
    "CorruptFileError",
    "GlobalOrder",
    "HostPipeline",
    "Loader",
    "Order",
    "Pipeline",
    "RecordIndexError",
    "RecordSource",
    "SchemaError",
    "Source",
    "SourceError",
    "StateError",
    "TransformError",
    "host_rows",
    "pad_or_truncate",
    "per_record",
]
