"""Prometheus metrics of a loader's telemetry, served over HTTP by prometheus-client. Kept
apart from `colo_data.telemetry.export` so that prometheus-client is imported only when a
`TelemetryExport` names a Prometheus port."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from colo_data.errors import ConfigError
from colo_data.telemetry.report import Telemetry, TelemetrySource


def _metrics(t: Telemetry) -> Iterator[Metric]:
    """The Prometheus metric families of one telemetry snapshot (steady state)."""
    steady = t.steady

    def gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"colo_data_{name}", doc, labels=list(labels or {}))
        if value is not None:
            family.add_metric(list((labels or {}).values()), value)
        return family

    yield CounterMetricFamily("colo_data_steps", "Batches handed to the trainer.", value=t.steps)
    yield gauge("warmup_steps", "Steps counted as warm-up (kept apart from the steady state).", t.warmup_steps)
    yield gauge("first_batch_seconds", "Time blocked in the first next().", t.first_batch_s)
    yield gauge("input_wait_share", "Steady state: time blocked in next() over wall time.", steady.input_wait_share)
    yield gauge("input_wait_seconds_sum", "Steady state: seconds blocked in next().", steady.input_wait_s)
    quantiles = GaugeMetricFamily("colo_data_input_wait_seconds", "Steady state: wait per step, quantiles.", labels=["quantile"])
    for q, value in (("0.5", steady.wait_p50_s), ("0.9", steady.wait_p90_s), ("0.99", steady.wait_p99_s)):
        quantiles.add_metric([q], value)
    yield quantiles
    yield gauge("step_seconds", "Steady state: median time between a batch's return and the next call.", steady.step_p50_s)
    yield gauge("records_per_second", "Steady state: records delivered per second.", steady.records_per_s)
    yield gauge("bytes_per_second", "Steady state: batch bytes delivered per second.", steady.bytes_per_s)
    yield gauge("queue_depth", "Steady state: mean prefetch queue fill at next().", t.queue_depth)
    yield gauge("input_bound", "1 when the trainer waits for input (see colo_data_verdict_info).", float(t.input_bound))
    yield InfoMetricFamily(
        "colo_data_verdict", "The bottleneck in one line.", value={"verdict": t.verdict, "bottleneck": t.bottleneck or ""}
    )
    seconds = CounterMetricFamily(
        "colo_data_stage_seconds", "Steady state: seconds per stage and host.", labels=["stage", "host"]
    )
    items = CounterMetricFamily("colo_data_stage_items", "Steady state: records through each stage.", labels=["stage", "host"])
    nbytes = CounterMetricFamily("colo_data_stage_bytes", "Steady state: bytes out of each stage.", labels=["stage", "host"])
    cpu = GaugeMetricFamily("colo_data_worker_cpu", "Mean CPU use per worker (1 = one core).", labels=["host"])
    workers = GaugeMetricFamily("colo_data_workers", "Workers per host.", labels=["host"])
    budget = GaugeMetricFamily("colo_data_cpu_budget", "CPU budget of the host pipeline.", labels=["host", "source"])
    ring = GaugeMetricFamily("colo_data_ring_slots_in_use", "Mean shared-memory ring slots in use.", labels=["host"])
    shm = GaugeMetricFamily("colo_data_shm_bytes", "Shared memory held by the host's ring.", labels=["host"])
    for host in t.hosts:
        h = str(host.host)
        for stage in host.stages:
            seconds.add_metric([stage.name, h], stage.seconds)
            items.add_metric([stage.name, h], stage.items)
            nbytes.add_metric([stage.name, h], stage.bytes)
        workers.add_metric([h], host.workers)
        shm.add_metric([h], host.shm_bytes)
        if host.worker_cpu is not None:
            cpu.add_metric([h], host.worker_cpu)
        if host.cpu_budget is not None:
            budget.add_metric([h, host.cpu_budget_source or ""], host.cpu_budget)
        if host.ring_slots_in_use is not None:
            ring.add_metric([h], host.ring_slots_in_use)
    seconds.add_metric(["handoff", "trainer"], t.handoff.seconds)
    items.add_metric(["handoff", "trainer"], t.handoff.items)
    nbytes.add_metric(["handoff", "trainer"], t.handoff.bytes)
    yield from (seconds, items, nbytes, cpu, workers, budget, ring, shm)
    if t.components is not None:
        mixed = CounterMetricFamily(
            "colo_data_component_records", "A mixture's records of each component since the loader started.", labels=["component"]
        )
        for name, count in t.components.items():
            mixed.add_metric([name], count)
        yield mixed


class _Collector(Collector):
    def __init__(self, source: TelemetrySource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        return _metrics(self.source())


class PrometheusServer:
    """Serves the telemetry as Prometheus metrics (`colo_data_*`) on `addr:port` (0: any
    free port; `port` is the one bound) from its own registry, read at each scrape."""

    def __init__(self, source: TelemetrySource, port: int, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(source))
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ConfigError(
                f"TelemetryExport(prometheus_port={port}, prometheus_addr={addr!r}): cannot listen there ({e.strerror}); "
                "choose another port, or 0 for any free one"
            ) from e
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
