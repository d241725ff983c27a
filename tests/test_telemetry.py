"""Telemetry against known, injected delays: a transform or a read that sleeps, a training
step that sleeps. The verdict must name the stage that sleeps and the input-wait share must
be near the one the delays imply. Margins are wide (a shared, noisy 2-core machine); no
assertion is about speed."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
from pipelines import BATCH, make_pipeline

import colo_data as cd
from colo_data import defaults
from colo_data.telemetry import counters, report

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the sidecar cannot import this test module


class SleepPerRecord:
    """A batch transform that sleeps `seconds` per record (a slow transform)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, columns: dict) -> dict:
        time.sleep(self.seconds * len(next(iter(columns.values()))))
        return columns


class SpinPerRecord(SleepPerRecord):
    """A batch transform that computes (spins on the CPU) `seconds` per record."""

    def __call__(self, columns: dict) -> dict:
        end = time.perf_counter() + self.seconds * len(next(iter(columns.values())))
        while time.perf_counter() < end:
            pass
        return columns


class SlowSource:
    """The corpus, with a `take` that sleeps `seconds` per call (a slow read)."""

    def __init__(self, corpus: Path, seconds: float) -> None:
        self.inner = cd.ArrowSource(str(corpus), columns=["id", "tokens"])
        self.seconds = seconds
        self.columns = self.inner.columns

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def row_group_sizes(self) -> np.ndarray:
        return self.inner.row_group_sizes

    def take(self, indices: np.ndarray) -> pa.Table:
        time.sleep(self.seconds)
        return self.inner.take(indices)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()


@pytest.fixture
def one_batch_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host pipelines (in this process) work one batch at a time, so a per-call delay is a
    per-batch delay. The tests that use it read the host's own thread (`InProcess(workers=0)`):
    by default, records that wait get worker processes."""
    monkeypatch.setattr(defaults, "CHUNK_RECORDS", BATCH)


ALONE = cd.InProcess(workers=0)  # the host's own thread: what these tests read the telemetry of


def timed_run(loader: cd.Loader, steps: int, step_s: float) -> tuple[cd.telemetry.Telemetry, float]:
    """`steps` steps, each sleeping `step_s` after its batch. Returns the telemetry and the
    input-wait share measured here, by the test's own clock, over the steady-state steps."""
    warmup = loader.options["warmup"]
    waited, start = 0.0, None
    with loader:
        iterator = iter(loader)
        for i in range(steps):
            t0 = time.perf_counter()
            next(iterator)
            t1 = time.perf_counter()
            if i == warmup - 1:
                start = t1
            elif i >= warmup:
                waited += t1 - t0
            time.sleep(step_s)
        end = t1
        telemetry = loader.telemetry()
    return telemetry, waited / (end - start)


def test_a_slow_transform_is_named_and_the_wait_share_is_right(token_corpus: Path, one_batch_chunks: None) -> None:
    # the transform sleeps 20 ms per batch, the step 5 ms: the trainer waits about 15 of every 20 ms
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), SleepPerRecord(0.020 / BATCH)])
    telemetry, measured = timed_run(cd.Loader(pipeline, warmup=3, backend=ALONE), steps=40, step_s=0.005)
    assert telemetry.input_bound and telemetry.bottleneck == "transform", telemetry.verdict
    assert telemetry.verdict.startswith("input-bound: transform stage; the host's own thread at "), telemetry.verdict
    assert "CPU budget" in telemetry.verdict
    assert telemetry.steady.input_wait_share == pytest.approx(0.75, abs=0.15)
    assert telemetry.steady.input_wait_share == pytest.approx(measured, abs=0.08)
    transform = telemetry.stages[counters.TRANSFORM]
    assert transform.seconds / telemetry.steady.steps == pytest.approx(0.020, rel=0.5)
    assert telemetry.warmup.steps == 3 and telemetry.steady.steps == 37


def test_a_slow_read_is_named(token_corpus: Path, one_batch_chunks: None) -> None:
    pipeline = make_pipeline(token_corpus, epochs=None, source=SlowSource(token_corpus, 0.015))
    telemetry, _ = timed_run(cd.Loader(pipeline, warmup=2, backend=ALONE), steps=30, step_s=0.002)
    assert telemetry.bottleneck == "read", telemetry.verdict
    assert telemetry.steady.input_wait_share > 0.5


def test_a_slow_step_is_not_input_bound(token_corpus: Path, one_batch_chunks: None) -> None:
    # the transform takes 2 ms a batch, the step 20 ms: nothing to wait for after the warm-up
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), SleepPerRecord(0.002 / BATCH)])
    telemetry, measured = timed_run(cd.Loader(pipeline, warmup=3, backend=ALONE), steps=40, step_s=0.020)
    assert not telemetry.input_bound and telemetry.bottleneck is None
    assert telemetry.verdict.startswith("not input-bound: wait "), telemetry.verdict
    # the truth is about 0; the test's own clock also sees the GIL handed back and forth
    # with the loader's threads around each call (a few %), which is not input wait
    assert telemetry.steady.input_wait_share < 0.05 and measured < 0.1
    assert telemetry.steady.step_p50_s == pytest.approx(0.020, abs=0.010)


def test_the_warm_up_is_kept_apart(token_corpus: Path) -> None:
    """A first batch that takes long (think: a compile) shows in the warm-up and the
    first-batch latency, not in the steady state."""

    class SlowFirstCall:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, columns: dict) -> dict:
            self.calls += 1
            if self.calls == 1:
                time.sleep(0.3)
            return columns

    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), SlowFirstCall()])
    telemetry, _ = timed_run(cd.Loader(pipeline, warmup=2), steps=25, step_s=0.010)
    assert telemetry.first_batch_s is not None and telemetry.first_batch_s >= 0.3
    assert telemetry.startup_s is not None and telemetry.startup_s >= telemetry.first_batch_s
    assert telemetry.warmup.input_wait_s >= 0.3 and telemetry.warmup.input_wait_share > 0.5
    # the first call's 0.3 s is the warm-up's alone (the steady state's own waits, on a loaded
    # machine, can make it input-bound: that is not what this checks)
    assert telemetry.steady.wait_max_s < 0.3 and telemetry.steady.input_wait_s < 0.3
    assert telemetry.steady.records == 23 * BATCH


def test_the_sidecar_sends_its_stage_counters_with_the_slots(token_corpus: Path) -> None:
    """The host side runs in the sidecar process: its stages, CPU and ring come back with
    the slot announcements, and the verdict names the slow transform there."""
    shm = Path(tempfile.mkdtemp(prefix="ring-test-", dir="/dev/shm"))
    try:
        # the sidecar computes 42 batches a call (6 ms a batch here) and puts them in one slot
        pipeline = make_pipeline(token_corpus, epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), SleepPerRecord(0.0005)])
        loader = cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=str(shm)), warmup=3)
        telemetry, _ = timed_run(loader, steps=150, step_s=0.002)
        assert sorted(p.name for p in shm.iterdir()) == []
    finally:
        shm.rmdir()
    assert telemetry.bottleneck == "transform", telemetry.verdict
    (side,) = telemetry.hosts
    assert side.runs_in.startswith("sidecar ") and not side.worker_processes
    assert side.ring_slots == 4 and side.ring_slots_in_use is not None and 1 <= side.ring_slots_in_use <= 4
    assert side.shm_bytes > 0 and side.cpu_budget is not None and side.worker_cpu is not None
    stages = {s.name: s for s in side.stages}
    assert stages["shm_write"].items > 0 and stages["transform"].items > 0 and stages["read"].bytes > 0
    assert telemetry.steady.input_wait_share > 0.3


def test_step_clock_against_exact_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic steps: 2 warm-up steps waiting 1 s, then steps of 10 ms waiting 1, 2, 3, ... ms;
    the history wraps (kept: the last 2048 steps) while the totals count every step."""
    monkeypatch.setattr(counters, "HISTORY", 2048)
    clock = counters.StepClock(warmup=2)
    clock.created = 0.0
    t, waits = 0.0, []
    for i in range(5000):
        wait = 1.0 if i < 2 else 0.001 * (1 + i % 10)
        clock.record(t, t + wait, records=8)
        waits.append(wait)
        t += wait + 0.010
    clock.batch_bytes = 100
    summary = report.summarize(
        backend="test", clock=clock, prefetch=0, queue_depth_known=False, handoff=counters.StageTimes().values,
        handoff_at_warmup=None, infos=[], now=[], at_warmup_hosts=None, shared_thread=False,
    )
    steady = np.array(waits[2:])
    wall = t - 0.010 - (1.0 + 0.010 + 1.0)  # from the second warm-up step's return to the last return
    assert summary.warmup.steps == 2 and summary.warmup.input_wait_s == pytest.approx(2.0)
    assert summary.first_batch_s == pytest.approx(1.0) and summary.startup_s == pytest.approx(1.0)
    assert summary.steady.steps == 4998 and summary.steady.records == 8 * 4998
    assert summary.steady.input_wait_s == pytest.approx(steady.sum())
    assert summary.steady.input_wait_share == pytest.approx(steady.sum() / wall)
    assert summary.steady.records_per_s == pytest.approx(8 * 4998 / wall)
    assert summary.steady.bytes_per_s == pytest.approx(100 * 4998 / wall)
    assert summary.steady.wait_p50_s == pytest.approx(np.percentile(steady[-2048:], 50))
    assert summary.steady.wait_p99_s == pytest.approx(0.010)
    assert summary.steady.step_p50_s == pytest.approx(0.010)
    assert len(report.StepTrace.of(clock).step) == 2048


def host(stages: dict[str, float], workers: int, processes: bool, cpu: float | None) -> report.HostSide:
    values = [report.Stage(name, stages.get(name, 0.0), 10, 10) for name in counters.STAGES[: counters.HANDOFF]]
    return report.HostSide(0, "sidecar x", tuple(values), workers, processes, cpu, 2.0, "cgroup v2 cpu.max 200000 100000 at /sys/fs/cgroup", 4, 2.5, 1)


def test_verdict_lines() -> None:
    steady = report.Phase(100, 10.0, 4.0, 0.4, 800, 80.0, 1.0, 0, 0, 0, 0, 0.06)
    calm = report.Phase(100, 10.0, 0.03, 0.003, 800, 80.0, 1.0, 0, 0, 0, 0, 0.1)
    no_step = report.Phase(100, 1.0, 0.99, 0.99, 800, 800.0, 1.0, 0, 0, 0, 0, 0.00002)
    warm = report.Phase(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    handoff = report.Stage("handoff", 1.0, 10, 10)

    def verdict(phase: report.Phase, hosts: list[report.HostSide]) -> tuple[bool, str | None, str]:
        return report.verdict(phase, warm, 3, report.limit(hosts, handoff, False))

    workers = [host({"transform": 3.9, "read": 1.0}, 2, True, 0.97)]
    assert verdict(steady, workers)[2] == (
        "input-bound: transform stage; 2 worker processes at 97% CPU; CPU budget 2.0 (cgroup); wait 40.0% of step time"
    )
    # two worker processes share the transform out: 3.0 s of it is 1.5 s on the critical path, less
    # than the 2 s of shared-memory writes, which the sidecar's producer thread does alone
    line = verdict(steady, [host({"transform": 3.0, "shm_write": 2.0}, 2, True, 0.5)])[2]
    assert line.startswith("input-bound: shared-memory write stage; 2 worker processes at 50% CPU")
    assert verdict(steady, [host({"transform": 0.5}, 1, False, None)])[1] == "handoff"
    assert verdict(calm, workers) == (False, None, "not input-bound: wait 0.3% of step time")
    # a loop with no training step waits all the time: the verdict says so, and gives the capacity
    assert verdict(no_step, workers) == (
        True,
        "transform",
        "no training step between batches (20 µs a step outside next()), so the loop waits for input all the time: "
        "the pipeline's capacity is 800 records/s; what limits it: transform stage; 2 worker processes at 97% CPU; "
        "CPU budget 2.0 (cgroup)",
    )
    assert verdict(warm, workers)[2].startswith("warming up")
    # what limits the pipeline is named whether or not the trainer waits, and not where nothing was measured
    assert report.limit(workers, handoff, False) == ("transform", "transform stage; 2 worker processes at 97% CPU; CPU budget 2.0 (cgroup)")
    assert report.limit([], handoff, False) == (None, None)


CPUS_WHY = "1 worker: a record costs 1 ms of a worker's CPU, and the trainer waits for input; the 1.2 CPUs that the trainer and others leave of the budget of 4 deliver at most 1,200 records/s"
FED_WHY = "1 worker: a record costs 1 ms of a worker's CPU, and the trainer takes 900 records/s: 1 deliver that"
MOST_WHY = "2 workers: a record takes a worker 2 ms, 20 µs of it on a CPU (it waits the rest), and the trainer waits for input; 2 workers, the most allowed, deliver at most 1,000 records/s"
HANDOFF_WHY = "2 workers: a record costs 1 ms of a worker's CPU, and the trainer waits for input; the host's thread hands on at most 5,000 records/s (200 µs a record)"


def test_the_next_step_follows_the_stage_and_the_room_in_the_budget() -> None:
    """`colo-data bench`'s last line: worker processes where CPU work leaves room in the
    budget (none yet, or fewer than it holds), Ray workers where it is full, more reads in
    flight where the read waits for I/O, fewer bytes for the hand-off, and where the worker
    policy counts the workers (or they are Ray's), what the bound its sentence names calls
    for: always one line (each host of a CPU budget of 2.0, as `host` makes it)."""
    from colo_data.bench.report import next_step

    def said(stage: str, **side: object) -> str | None:
        stages = {"read": 1.0, "io_wait": 0.8} if stage == "read" else {stage: 1.0}
        made = host(stages, int(side.pop("workers", 1)), bool(side.pop("processes", False)), float(side.pop("cpu", 0.5)))
        return next_step(SimpleNamespace(hosts=[dataclasses.replace(made, **side)], limit_stage=stage))

    own = said("transform")
    assert own and "on the host's own thread" in own and "--workers auto" in own and "Ray" not in own, own
    one = said("transform", workers=1, processes=True, cpu_budget=4.0, workers_most=1)
    assert one and "room for more than 1 worker process, all that --workers allows:" in one and "--workers auto" in one, one
    # the worker policy counts fewer than allowed: what the bound its sentence names calls for
    fewer = said("transform", workers=1, processes=True, cpu_budget=4.0, workers_most=8, workers_why=CPUS_WHY)
    assert fewer and "host 0's workers are bound as its sentence above says: give the host more CPUs" in fewer, fewer
    fed = said("transform", workers=1, processes=True, cpu_budget=4.0, workers_most=8, workers_why=FED_WHY)
    assert fed and "run longer (--steps N)" in fed, fed
    full = said("batch", workers=1, processes=True)
    assert full and "budget of 2.0 is taken by 1 worker process and the host's own thread (at 50% CPU each)" in full, full
    assert "ray:" in full, full
    # the count fills the budget, but its CPUs are idle (the work waits): not "taken", no Ray;
    # the worker policy's sentence says why it counts what it counts, or with none allowed, workers
    most = said("transform", workers=2, processes=True, cpu=0.0, workers_most=2, workers_why=MOST_WHY)
    assert most and "allow more workers (--workers N" in most and "Ray" not in most, most
    waits = said("transform", cpu=0.1, cpu_budget=1.0)
    assert waits and "waits more than it computes (it keeps 0.1 of its 1.0 CPUs busy)" in waits, waits
    assert "--workers auto" in waits and "Ray" not in waits, waits
    reads = said("read")
    assert reads and "waits for I/O 80% of its time" in reads and "io_concurrency" in reads, reads
    handoff = said("handoff")
    assert handoff and "the hand-off stage is the limit" in handoff and "fewer bytes a batch" in handoff, handoff
    ray = said("transform", workers=2, processes=True, remote_workers=True, workers_why=HANDOFF_WHY)
    assert ray and "more hosts (or sidecars) share the batch" in ray, ray
    assert "run longer" in next_step(SimpleNamespace(hosts=[], limit_stage=None))


def test_prometheus_endpoint_and_json_lines(token_corpus: Path, tmp_path: Path) -> None:
    jsonl = tmp_path / "telemetry.jsonl"
    export = cd.telemetry.TelemetryExport(jsonl=str(jsonl), every_s=0.2, prometheus_port=0, prometheus_addr="127.0.0.1")
    loader = cd.Loader(make_pipeline(token_corpus, epochs=None), warmup=2, telemetry_export=export)
    with loader:
        for i, _ in enumerate(loader):
            if i == 20:
                break
        time.sleep(0.5)
        port = loader.prometheus_port
        assert port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    metrics = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert metrics["colo_data_steps_total"] == 21
    assert metrics["colo_data_warmup_steps"] == 2
    assert 0 <= metrics["colo_data_input_wait_share"] <= 1
    assert 'colo_data_stage_seconds_total{host="0",stage="transform"}' in metrics
    assert 'colo_data_input_wait_seconds{quantile="0.99"}' in metrics
    assert metrics['colo_data_stage_items_total{host="trainer",stage="handoff"}'] > 0
    assert any(name.startswith("colo_data_verdict_info{") for name in metrics)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) >= 2  # at least one periodic line and the last one at close
    assert lines[-1]["steps"] == 21 and lines[-1]["verdict"] and "time" in lines[-1]
    with pytest.raises(OSError):  # closed with the loader
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_counters_survive_a_restart(token_corpus: Path) -> None:
    with cd.Loader(make_pipeline(token_corpus, epochs=None), warmup=2) as loader:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        before = loader.telemetry()
        loader.set_state(loader.get_state())
        for _ in range(5):
            next(iterator)
        after = loader.telemetry()
    assert after.steps == 10 and after.steady.records == 8 * BATCH
    for old, new in zip(before.stages, after.stages, strict=True):
        assert new.seconds >= old.seconds and new.items >= old.items


def test_telemetry_export_checks_its_settings(token_corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match="prometheus_port"):
        cd.telemetry.TelemetryExport(prometheus_port=70000)
    with pytest.raises(cd.errors.ConfigError, match="every_s"):
        cd.telemetry.TelemetryExport(every_s=0)
    with pytest.raises(cd.errors.ConfigError, match="warmup"):
        cd.Loader(make_pipeline(token_corpus), warmup=-1)
    export = cd.telemetry.TelemetryExport(jsonl=str(tmp_path / "missing" / "telemetry.jsonl"))
    with cd.Loader(make_pipeline(token_corpus), telemetry_export=export) as loader, pytest.raises(cd.errors.ConfigError, match="cannot write"):
        next(loader)


def test_an_exporter_that_cannot_start_stops_the_others(token_corpus: Path, tmp_path: Path) -> None:
    with socket.socket() as probe:  # a free port, for the exporter that starts
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    export = cd.telemetry.TelemetryExport(jsonl=str(tmp_path / "missing" / "t.jsonl"), prometheus_port=free, prometheus_addr="127.0.0.1")
    with cd.Loader(make_pipeline(token_corpus), telemetry_export=export) as loader, pytest.raises(cd.errors.ConfigError, match="jsonl"):
        next(loader)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", free), timeout=2):
        pass  # no metrics server was left listening

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    export = cd.telemetry.TelemetryExport(jsonl=str(tmp_path / "telemetry.jsonl"), prometheus_port=port, prometheus_addr="127.0.0.1")
    try:
        with cd.Loader(make_pipeline(token_corpus), telemetry_export=export) as loader, pytest.raises(cd.errors.ConfigError, match=f"prometheus_port={port}"):
            next(loader)
    finally:
        busy.close()
    assert not [t for t in threading.enumerate() if t.name == "colo-data-telemetry-jsonl"]  # the JSON lines writer stopped


def test_bench_names_the_next_step_workers_where_cpu_is_spare_else_ray(token_corpus: Path, one_batch_chunks: None) -> None:
    """A transform that computes on a host whose CPU budget its own thread fills (this
    process held to one CPU): `colo-data bench` suggests Ray workers. With a CPU to spare, it
    suggests worker processes (`--workers auto`) instead."""
    from colo_data.bench.report import next_step

    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), SpinPerRecord(0.010 / BATCH)])
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip(f"this machine gives the tests {len(cpus)} CPU: the case with a CPU to spare needs 2")
    os.sched_setaffinity(0, {min(cpus)})  # this thread (the test's, which reads the budget) on one CPU
    try:
        held, _ = timed_run(cd.Loader(pipeline, warmup=3, backend=ALONE), steps=80, step_s=0.002)
    finally:
        os.sched_setaffinity(0, cpus)
    assert held.limit_stage == "transform" and held.hosts[0].cpu_budget == 1, held.limit
    advice = next_step(held)
    assert advice and "transform stage is CPU work" in advice and "budget of 1.0 is taken by the host's own thread" in advice and "--workers 'ray:" in advice, advice
    spare, _ = timed_run(cd.Loader(pipeline, warmup=3, backend=ALONE), steps=20, step_s=0.002)
    assert spare.limit_stage == "transform" and spare.hosts[0].cpu_budget == len(cpus), spare.limit
    advice = next_step(spare)
    assert advice and "transform stage is CPU work on the host's own thread" in advice and "--workers auto" in advice, advice
    assert "ray" not in advice.lower(), advice
