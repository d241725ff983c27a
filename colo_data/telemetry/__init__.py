"""Telemetry: counters, the report and its verdict, exporters. `cd.telemetry` holds what a
user meets: the report `loader.telemetry()` returns, the types of its fields, and the
exporter a `Loader` takes."""

from colo_data.telemetry.export import TelemetryExport
from colo_data.telemetry.quality import ColumnQuality, ComponentShare, Lost, Quality
from colo_data.telemetry.report import HostSide, Phase, Stage, Telemetry

__all__ = ["ColumnQuality", "ComponentShare", "HostSide", "Lost", "Phase", "Quality", "Stage", "Telemetry", "TelemetryExport"]
