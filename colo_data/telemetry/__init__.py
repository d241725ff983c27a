"""Telemetry: counters, the report and its verdict, exporters."""
