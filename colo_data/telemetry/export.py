"""Telemetry exporters: JSON lines appended to a file every few seconds, and Prometheus
metrics served over HTTP (`colo_data.telemetry.prometheus`, imported only when a port is
set). Both read `Loader.telemetry()` when they write or are scraped, so the loader's hot
path does no extra work for them."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from colo_data.errors import ConfigError
from colo_data.telemetry.report import TelemetrySource


@dataclass(frozen=True, kw_only=True)
class TelemetryExport:
    """Where a `Loader` sends its telemetry besides `loader.telemetry()` (all off by
    default): `jsonl`, a file that gets one JSON object per line every `every_s` seconds
    and a last one at `close()`; `prometheus_port`, a port on which prometheus-client
    serves the metrics (0: any free one, see `Loader.prometheus_port`), on `prometheus_addr`."""

    jsonl: str | None = None
    every_s: float = 10.0
    prometheus_port: int | None = None
    prometheus_addr: str = "0.0.0.0"

    def __post_init__(self) -> None:
        if not isinstance(self.every_s, (int, float)) or not self.every_s > 0:
            raise ConfigError(f"TelemetryExport(every_s={self.every_s!r}): must be a number of seconds > 0")
        port = self.prometheus_port
        if port is not None and (not isinstance(port, int) or not 0 <= port <= 65535):
            raise ConfigError(f"TelemetryExport(prometheus_port={port!r}): a port 0..65535 (0: any free port), or None for off")


class JsonlWriter:
    """Appends `{"time": unix seconds, **telemetry.as_dict()}` to `path` every `every_s`
    seconds on a daemon thread, and once more at `close()`."""

    def __init__(self, source: TelemetrySource, path: str, every_s: float) -> None:
        self.source, self.path, self.every_s = source, path, every_s
        try:
            open(path, "a").close()
        except OSError as e:
            raise ConfigError(
                f"TelemetryExport(jsonl={path!r}): cannot write there ({e.strerror}); give a writable file path"
            ) from e
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="colo-data-telemetry-jsonl", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def write(self) -> None:
        line = json.dumps({"time": time.time(), **self.source().as_dict()})
        with self._lock, open(self.path, "a") as file:
            file.write(line + "\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.write()


def start(export: TelemetryExport, source: TelemetrySource) -> list[Any]:
    """The exporters `export` asks for, started (each has `close()`)."""
    out: list[Any] = []
    try:
        if export.jsonl is not None:
            out.append(JsonlWriter(source, export.jsonl, export.every_s))
        if export.prometheus_port is not None:
            from colo_data.telemetry.prometheus import PrometheusServer

            out.append(PrometheusServer(source, export.prometheus_port, export.prometheus_addr))
    except BaseException:  # one could not start: stop the others
        for exporter in out:
            exporter.close()
        raise
    return out
