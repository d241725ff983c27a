"""Telemetry: counters, the report and its verdict, exporters."""

from typing import Any

from colo_data._moved import old_names


def __getattr__(name: str) -> Any:
    """The names of the module `colo_data.telemetry` was before it became this package."""
    return old_names(__name__, ('colo_data.telemetry.counters', 'colo_data.telemetry.report'), name)
