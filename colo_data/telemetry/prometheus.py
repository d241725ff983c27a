"""Prometheus metrics of a loader's telemetry, served over HTTP by prometheus-client. Kept
apart from `colo_data.telemetry.export` so that prometheus-client is imported only when a
`TelemetryExport` names a Prometheus port."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from colo_data.errors import ConfigError
from colo_data.telemetry.quality import PACKED, QUANTILES, Quality
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
    yield from _quality_metrics(t.quality)


def _quality_metrics(q: Quality) -> Iterator[Metric]:
    """The data-quality metric families (since the loader started): packed and padded
    columns, the filter, the records dropped and truncated, a mixture's shares."""
    column = ["column", "kind", "length"]
    fill = GaugeMetricFamily("colo_data_packing_fill", "Share of a packed column's token places holding tokens.", labels=column)
    padding = GaugeMetricFamily(
        "colo_data_padding_share", "Share of a packed or padded column's token places that are padding.", labels=column
    )
    tokens = CounterMetricFamily("colo_data_tokens", "Tokens of records in a packed or padded column.", labels=column)
    places = CounterMetricFamily(
        "colo_data_token_places", "Token places (rows x length) of a packed or padded column.", labels=column
    )
    quantiles = GaugeMetricFamily(
        "colo_data_token_length", "Records' lengths as read, quantiles (top of their bucket).", labels=[*column, "quantile"]
    )
    lengths = HistogramMetricFamily("colo_data_record_length_tokens", "Records' lengths as read, in tokens.", labels=column)
    truncated = CounterMetricFamily(
        "colo_data_truncated_records",
        "Records longer than their row or pad length, cut to its first tokens.",
        labels=["column", "reason"],
    )
    for c in q.columns:
        labels = [c.column, c.kind, str(c.length)]
        if c.kind == PACKED:
            fill.add_metric(labels, c.fill)
        padding.add_metric(labels, c.padding_share)
        tokens.add_metric(labels, c.tokens)
        places.add_metric(labels, c.rows * c.length)
        for level, value in zip(QUANTILES, (c.length_p50, c.length_p90, c.length_p99), strict=True):
            quantiles.add_metric([*labels, str(level)], value)
        buckets = [(str(power), count) for power, count in c.length_buckets]
        lengths.add_metric(labels, [*buckets, ("+Inf", c.records)], c.length_sum)
    for lost in q.truncated:
        truncated.add_metric([lost.column, lost.reason], lost.records)
    yield from (fill, padding, tokens, places, quantiles, lengths, truncated)
    dropped = CounterMetricFamily("colo_data_dropped_records", "Records dropped, by reason (keep: a filter).", labels=["reason"])
    for lost in q.dropped:
        dropped.add_metric([lost.reason], lost.records)
    yield dropped
    if q.keep_rate is not None:
        yield GaugeMetricFamily("colo_data_keep_rate", "Share of the records judged that the filter kept.", value=q.keep_rate)
        yield CounterMetricFamily("colo_data_judged_records", "Records the filter judged.", value=q.judged)
        yield CounterMetricFamily("colo_data_kept_records", "Records the filter kept.", value=q.kept)
    if q.mixture:
        share = GaugeMetricFamily(
            "colo_data_component_share", "A mixture component's share of the records so far.", labels=["component"]
        )
        weight = GaugeMetricFamily("colo_data_component_weight", "A mixture component's normalised weight.", labels=["component"])
        for component in q.mixture:
            share.add_metric([component.component], component.share)
            weight.add_metric([component.component], component.weight)
        yield from (share, weight)


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
