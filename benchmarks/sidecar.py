"""Sidecar throughput, side by side in one run: the shared-memory hand-off against numpy.copyto,
the sidecar backend against the in-process backend, and colo-data's sidecar in a 1-CPU
cgroup against Grain's DataLoader(worker_count=None) in the same cgroup.

1. Hand-off. A `colo-data sidecar serve` process (colo_data.backends.sidecar.local.LocalSidecar,
   workers=0, 4 slots) serves a pipeline whose transform returns a preallocated batch of
   8/32/64 MiB (one uint8 array) without doing work, over a source whose `take` is a
   constant-time stub. The trainer reads host batches as numpy views through
   SidecarClient.batches() and does not touch their bytes. Included per batch: the sidecar's
   (tiny) host-pipeline step, its copy of the batch into a ring slot (in its own process, by
   its copy threads, overlapped with the trainer), the release/next messages over the Unix socket and the
   views in the trainer. Baseline: a single-thread numpy.copyto of the same size, into 4
   rotating destinations (the ring's memory pattern) and into one destination (at 8 MiB the
   source and destination then stay in this machine's 32 MiB L3 cache), and ShmRing.write
   alone (the sidecar's copy, without the sidecar).
2. Demo pipeline (block shuffle, batch 32, pad 1024), one epoch per round:
   cd.Loader(p, backend="sidecar") against cd.Loader(p), each batch jax.block_until_ready.
3. A child process confined to a 1-CPU cgroup v1 (cpu.cfs_quota_us = cpu.cfs_period_us):
   colo-data, sidecar backend, workers=None, against grain.DataLoader(worker_count=None)
   (global shuffle through IndexSampler, per-record pad, Batch(32)), the first 400 batches of
   an epoch each; both consumers put every batch on the device (jax.block_until_ready).

Rounds are interleaved and medians reported. Run:
`.venv/bin/python benchmarks/sidecar.py [--rounds N] [--out DIR]` (as root for part 3).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import psutil
import pyarrow as pa
from absl import flags
from core import BATCH, SEQ_LEN, PadRecord  # the core benchmark's pipeline and Grain per-record pad

import colo_data as cd
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.backends.sidecar.local import LocalSidecar
from colo_data.backends.sidecar.server import copy_threads
from colo_data.backends.sidecar.shm import ShmRing
from colo_data.defaults import CHUNK_RECORDS
from colo_data.ops import demo

MIB = 2**20
HANDOFF_MIB = (8, 32, 64)
HANDOFF_ROWS = 512  # >= CHUNK_RECORDS: one host batch per host-pipeline call
HANDOFF_WARMUP = 6  # more than the ring's 4 slots: every slot written (pages faulted) once
HANDOFF_BYTES = 2 * 2**30  # measured bytes per size and round (at least 20 batches)
SLOTS = 4
SHM_DIR = "/dev/shm"
CGROUP_NAME = f"colo-bench-sidecar-{os.getpid()}"
CHILD_TIMEOUT_S = 300
CGROUP_BATCHES = 400  # part 3: the first 400 batches (12,800 records) of an epoch, for both
LOADERS: dict[str, dict[str, Any]] = {  # part 2; the last one is for reading the gap, not a goal
    "in-process": {},
    "sidecar": {"backend": "sidecar"},
    "sidecar, workers=0 (extra)": {"backend": "sidecar", "workers": 0},
}
NOTHING_LEFT = "no process, worker or /dev/shm/colo-data-* segment of this run was left behind"
_SEGMENT = re.compile(r"colo-data-(\d+)-[0-9a-f]{8}-\d+")


# ---------------------------------------------------------------------------------------------
# Part 1: the hand-off


class StubSource:
    """A colo-data Source of `n` records whose `take` costs microseconds: one int8 column."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @property
    def row_group_sizes(self) -> np.ndarray:
        return np.array([self.n], dtype=np.int64)

    def take(self, indices: np.ndarray) -> pa.Table:
        return pa.table({"i": np.zeros(len(indices), np.int8)})

    def fingerprint(self) -> str:
        return f"stub-{self.n}"


class FixedBatch:
    """Batch transform that returns a preallocated (rows, nbytes/rows) uint8 array, filled with
    ones (real pages, not the shared zero page), made once in the process that runs it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "_array": None}

    def __call__(self, columns: dict[str, Any]) -> dict[str, np.ndarray]:
        rows = len(next(iter(columns.values())))
        if self._array is None or len(self._array) != rows:
            self._array = np.ones((rows, self.nbytes // rows), np.uint8)
        return {"x": self._array}


def handoff_pipeline(nbytes: int, batches: int) -> cd.Pipeline:
    return cd.Pipeline(
        source=StubSource(HANDOFF_ROWS * batches),
        global_batch_size=HANDOFF_ROWS,
        transforms=[FixedBatch(nbytes)],
        order=cd.Order(shuffle="none"),
    )


def handoff_batches(nbytes: int) -> int:
    return max(20, HANDOFF_BYTES // nbytes)


def _rate(nbytes: int, batches: int, seconds: float) -> dict[str, float]:
    total = nbytes * batches
    return {"bytes": total, "batches": batches, "seconds": seconds, "bytes_per_s": total / seconds}


def measure_handoff(sidecar: LocalSidecar, nbytes: int) -> dict[str, float]:
    """Bytes/s of host batches arriving in the trainer as views, after the warm-up."""
    measured = handoff_batches(nbytes)
    pipeline = handoff_pipeline(nbytes, HANDOFF_WARMUP + measured)
    client = SidecarClient(sidecar.address, sidecar.process.pid)
    try:
        arrivals, seen = [], 0
        for batch in client.batches(pipeline, 0, 1, 0):
            arrivals.append(time.perf_counter())
            seen += batch.columns["x"].nbytes
        assert seen == nbytes * (HANDOFF_WARMUP + measured), (seen, nbytes)
    finally:
        client.close()
    seconds = arrivals[-1] - arrivals[HANDOFF_WARMUP - 1]
    return _rate(nbytes, measured, seconds)


def measure_copyto(nbytes: int, destinations: int) -> dict[str, float]:
    """Single-thread numpy.copyto of `nbytes`, cycling over `destinations` buffers."""
    measured = handoff_batches(nbytes)
    src = np.ones(nbytes, np.uint8)
    dsts = [np.full(nbytes, 2, np.uint8) for _ in range(destinations)]
    for i in range(HANDOFF_WARMUP):
        np.copyto(dsts[i % destinations], src)
    t0 = time.perf_counter()
    for i in range(measured):
        np.copyto(dsts[i % destinations], src)
    seconds = time.perf_counter() - t0
    return _rate(nbytes, measured, seconds)


def measure_slot_write(nbytes: int) -> dict[str, float]:
    """The sidecar's copy alone: ShmRing.write of the same batch into 4 rotating slots, here,
    with the sidecar's copy threads."""
    measured = handoff_batches(nbytes)
    batch = {"x": np.ones((HANDOFF_ROWS, nbytes // HANDOFF_ROWS), np.uint8)}
    with ShmRing.create(SHM_DIR, SLOTS, nbytes, copy_threads=copy_threads(cd.cpu_budget())) as ring:
        for i in range(HANDOFF_WARMUP):
            ring.write(i % SLOTS, batch)
        t0 = time.perf_counter()
        for i in range(measured):
            ring.write(i % SLOTS, batch)
    return _rate(nbytes, measured, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Process bookkeeping: what this run started, so that nothing is left behind


def _cpu_of(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _is_worker(proc: psutil.Process) -> bool:
    try:
        return "spawn_main" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


class Tracker:
    """Remembers the pids of this run's descendants (sidecars, workers) and, at the end,
    stops any still alive and removes ring segments that they wrote."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.shm_before = set(self.segments())

    @staticmethod
    def segments() -> list[str]:
        try:
            return sorted(n for n in os.listdir(SHM_DIR) if _SEGMENT.fullmatch(n))
        except FileNotFoundError:
            return []

    def note(self, pids: list[int] | None = None) -> list[psutil.Process]:
        found = psutil.Process().children(recursive=True)
        self.pids.update(p.pid for p in found)
        self.pids.update(pids or [])
        return found

    def cleanup(self) -> dict[str, list]:
        left = psutil.Process().children(recursive=True)
        self.pids.update(p.pid for p in left)
        stopped = []
        for proc in left:
            try:
                stopped.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
            except psutil.Error:
                pass
        report: dict[str, list] = {"processes_stopped": stopped}
        for proc in left:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(left, timeout=10)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        removed = []
        for name in self.segments():
            pid = int(_SEGMENT.fullmatch(name).group(1))  # type: ignore[union-attr]
            if name not in self.shm_before and (pid in self.pids or pid == os.getpid()):
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        report["segments_removed"] = removed
        report["segments_of_others_now"] = [n for n in self.segments() if n not in self.shm_before]
        return report


# ---------------------------------------------------------------------------------------------
# Part 2: sidecar vs in-process on the demo pipeline


def run_loader(directory: Path, tracker: Tracker | None, batches: int | None = None, **kwargs: Any) -> dict[str, float]:
    """One epoch (or its first `batches`) of the demo pipeline through cd.Loader: records/s from
    creating the pipeline (start-up included) and after the first batch, time to the first
    batch, CPU s per 1k records (this process and its descendants, sampled) and the worker
    processes seen. A new pipeline each time: no row groups cached from an earlier run."""
    me = psutil.Process()
    before = {p.pid: _cpu_of(p) for p in me.children(recursive=True)}  # e.g. part 1's idle sidecar
    own0, t0 = _cpu_of(me), time.perf_counter()
    records, first_at, first_records, workers = 0, None, 0, 0
    child_cpu: dict[int, float] = {}  # workers may end before the last batch: sampled

    def sample() -> None:
        nonlocal workers
        descendants = tracker.note() if tracker else me.children(recursive=True)
        workers = max(workers, sum(_is_worker(p) for p in descendants))
        for p in descendants:
            child_cpu[p.pid] = max(child_cpu.get(p.pid, 0.0), _cpu_of(p))

    pipeline = demo.pipeline(directory, seq_len=SEQ_LEN, global_batch_size=BATCH)
    with cd.Loader(pipeline, **kwargs) as loader:
        for batch in loader:
            jax.block_until_ready(batch)
            records += len(batch["tokens"])
            if first_at is None:
                first_at, first_records = time.perf_counter(), records
            if records % (50 * BATCH) == 0:
                sample()
            if batches is not None and records == batches * BATCH:
                break
        end = time.perf_counter()
        sample()
        cpu = _cpu_of(me) - own0 + sum(used - before.get(pid, 0.0) for pid, used in child_cpu.items())
    closed = time.perf_counter()
    assert first_at is not None
    return {
        "records": records,
        "seconds": end - t0,
        "records_per_s": records / (end - t0),
        "steady_records_per_s": (records - first_records) / (end - first_at),
        "first_batch_s": first_at - t0,
        "close_s": closed - end,
        "cpu_s_per_1k": 1000 * cpu / records,
        "worker_processes": workers,
    }


# ---------------------------------------------------------------------------------------------
# Part 3: a 1-CPU cgroup


def cpu_cgroup_mount() -> str | None:
    """Mount point of the cgroup v1 hierarchy with the `cpu` controller."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fs_type, _, options = right.split()
            if fs_type == "cgroup" and "cpu" in options.split(","):
                return left.split()[4]
    return None


def own_cpu_cgroup(mount: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if "cpu" in controllers.split(","):
                return os.path.join(mount, path.lstrip("/"))
    return mount


class CpuCgroup:
    """A child cgroup under the v1 cpu controller limited to `cpus` CPUs."""

    def __init__(self, cpus: float) -> None:
        mount = cpu_cgroup_mount()
        if mount is None:
            raise OSError("no cgroup v1 hierarchy with the cpu controller is mounted")
        self.parent = own_cpu_cgroup(mount)
        self.path = os.path.join(self.parent, CGROUP_NAME)
        os.mkdir(self.path)
        try:
            self._write("cpu.cfs_period_us", "100000")
            self._write("cpu.cfs_quota_us", str(int(100000 * cpus)))
        except BaseException:
            os.rmdir(self.path)
            raise

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def procs(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]

    def stat(self) -> dict[str, int]:
        with open(os.path.join(self.path, "cpu.stat")) as f:
            return {k: int(v) for k, v in (line.split() for line in f)}

    def wait_empty(self, timeout: float) -> list[str]:
        """Wait for the processes still inside (e.g. a resource tracker finishing) to exit;
        return 'pid cmdline' of those that did not."""
        deadline = time.monotonic() + timeout
        while self.procs() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = []
        for pid in self.procs():
            try:
                left.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:160]}")
            except psutil.Error:
                pass
        return left

    def remove(self) -> list[str]:
        """Stop what is still inside after a grace period (only this run's processes can be
        there), move it back to the parent cgroup, rmdir. Returns what was still inside."""
        left = self.wait_empty(5.0)
        for pid in self.procs():
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        for pid in self.procs():
            try:
                with open(os.path.join(self.parent, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(self.path)
                return left
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def child_main(kind: str, batches: int) -> None:
    """Runs inside the cgroup: says "ready" once imported and JAX is up, waits for "go", reads
    the first `batches` batches of an epoch, prints one JSON line."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # close the loader on the way out
    flags.FLAGS.mark_as_parsed()
    directory = demo.corpus()
    jax.block_until_ready(jax.device_put(np.zeros(1)))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    budget = cd.cpu_budget()
    result: dict[str, Any] = {
        "cgroup": next(line.strip() for line in open("/proc/self/cgroup") if ":cpu:" in line or ":cpu," in line),
        "cpu_budget": {"cpus": budget.cpus, "workers": budget.workers, "source": budget.source},
        "os_cpu_count": os.cpu_count(),
    }
    if kind == "colo":
        result |= run_loader(directory, None, batches, backend="sidecar")
    else:
        me = psutil.Process()
        own0, t0 = _cpu_of(me), time.perf_counter()
        source = cd.ArrowSource(str(directory), columns=["id", "tokens"])
        loader = grain.DataLoader(
            data_source=source,
            sampler=grain.samplers.IndexSampler(num_records=len(source), shuffle=True, seed=0, num_epochs=1),
            operations=[PadRecord(), grain.transforms.Batch(BATCH, drop_remainder=True)],
            worker_count=None,
        )
        result["grain_worker_count"] = loader.multiprocessing_options.num_workers
        records, first_at, first_records, workers = 0, None, 0, 0
        child_cpu: dict[int, float] = {}  # the workers may be gone once the epoch ends: sampled
        iterator = iter(loader)
        for batch in iterator:
            jax.block_until_ready(jax.device_put(batch))
            records += len(batch["tokens"])
            if first_at is None:
                first_at, first_records = time.perf_counter(), records
            if records % (50 * BATCH) == 0:
                descendants = me.children(recursive=True)
                workers = max(workers, sum(_is_worker(p) for p in descendants))
                for p in descendants:
                    child_cpu[p.pid] = max(child_cpu.get(p.pid, 0.0), _cpu_of(p))
            if records == batches * BATCH:
                break
        end = time.perf_counter()
        for p in me.children(recursive=True):
            child_cpu[p.pid] = max(child_cpu.get(p.pid, 0.0), _cpu_of(p))
        cpu = _cpu_of(me) - own0 + sum(child_cpu.values())
        del batch, iterator  # Grain stops its workers when its iterator is collected
        gc.collect()
        assert first_at is not None
        result |= {
            "records": records,
            "seconds": end - t0,
            "records_per_s": records / (end - t0),
            "steady_records_per_s": (records - first_records) / (end - first_at),
            "first_batch_s": first_at - t0,
            "cpu_s_per_1k": 1000 * cpu / records,
            "worker_processes": workers,
        }
    print(json.dumps(result), flush=True)


def run_in_cgroup(cgroup: CpuCgroup, kind: str) -> dict[str, Any]:
    """Start the child, confine it to the cgroup before it does anything timed, let it run."""
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", kind, "--batches", str(CGROUP_BATCHES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            cgroup.add(child.pid)
            assert child.stdout is not None and child.stdin is not None
            ready = child.stdout.readline().strip()
            if ready != "ready":
                raise RuntimeError(f"child {kind} did not start: {ready!r}")
            stat0 = cgroup.stat()
            child.stdin.write("go\n")
            child.stdin.flush()
            out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
            stat1 = cgroup.stat()
            err.seek(0)
            log = err.read()
            if child.returncode:
                at = log.rfind("Traceback")
                why = log[at:][-6000:] if at >= 0 else log[-3000:]
                raise RuntimeError(f"child {kind} failed (exit {child.returncode}):\n{why}")
        finally:
            if child.poll() is None:  # interrupted: let it close its loader, then make sure
                child.terminate()
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
    result = json.loads(out.strip().splitlines()[-1])
    said = re.search(r"colo-data sidecar on .*?: (\d+) worker\(s\); CPU budget (\S+) \((.*)\)", log)
    if said:
        result["sidecar_says"] = {"workers": int(said.group(1)), "cpu_budget": said.group(2), "source": said.group(3)}
    result["throttled_s"] = (stat1.get("throttled_time", 0) - stat0.get("throttled_time", 0)) / 1e9
    result["nr_throttled"] = stat1.get("nr_throttled", 0) - stat0.get("nr_throttled", 0)
    return result


# ---------------------------------------------------------------------------------------------
# The run


Ratio = tuple[str, float, str | None]  # name, value, goal ("> 1", ">= 0.8") or None


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _goal(value: float, goal: str | None) -> str:
    if goal is None:
        return "(no goal)"
    op, bound = goal.split()
    ok = value > float(bound) if op == ">" else value >= float(bound)
    return f"{'yes' if ok else '**no**'} ({op} {bound}x)"


Runs = list[dict[str, Any]]
PART1_SERIES = ("handoff", "copy_rot", "copy_one", "slot_write")


def _ratio_pair(name: str, a: Runs, b: Runs, goal: str | None, first: str) -> list[Ratio]:
    """The ratio of medians with start-up included (`first` names that) and after the first batch."""
    return [
        (f"{name}, {first}", _median(a, "records_per_s") / _median(b, "records_per_s"), goal),
        (f"{name}, after first batch", _median(a, "steady_records_per_s") / _median(b, "steady_records_per_s"), goal),
    ]


def report(
    rounds: int,
    wall: float,
    part1: dict[str, dict[str, list[dict[str, float]]]],
    loaders: dict[str, list[dict[str, float]]],
    cgroup_runs: dict[str, list[dict[str, Any]]],
    cgroup_skipped: str | None,
) -> tuple[list[str], list[Ratio]]:
    """The Markdown tables and the ratios (medians over the rounds)."""
    lines = [
        f"Sidecar benchmarks: median of {rounds} interleaved round(s); {psutil.cpu_count()} CPUs; "
        f"run took {wall:.0f} s."
    ]
    ratios: list[Ratio] = []
    if part1["handoff"]:
        lines += [
            "",
            "**1. Hand-off** (GB = 10^9 bytes). The sidecar (`colo-data sidecar serve`, 0 workers, 4 slots) "
            f"copies each preallocated batch once into a shared-memory slot in its own process ({copy_threads(cd.cpu_budget())} "
            "copy thread(s): its CPU budget's whole CPUs; at these sizes one batch per slot), overlapped with the "
            "trainer; the trainer receives numpy views through `SidecarClient.batches()` (one release "
            f"message per batch; filled slots are announced unasked) and does not touch the bytes. Steady state after {HANDOFF_WARMUP} warm-up batches; "
            f"rows = {HANDOFF_ROWS}, source `take` is a stub. Baseline: single-thread `numpy.copyto` of the same "
            "size into 4 rotating destinations (the ring's memory pattern: the goal's baseline) and, for reference, "
            "into 1 destination (cache-resident at 8 MiB, which no stream of batches is). `ShmRing.write alone`: the sidecar's slot copy (same threads) measured in this process, without "
            "the sidecar.",
            "",
            "| batch | sidecar -> trainer GB/s | copyto GB/s (4 dst) | copyto GB/s (1 dst) | ShmRing.write alone GB/s "
            "| ms per batch (sidecar) | ms per copy (4 dst) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key in part1["handoff"]:
            nbytes = int(key.split()[0]) * MIB
            h, c4, c1, w = (_median(part1[x][key], "bytes_per_s") for x in PART1_SERIES)
            ms = (1e3 * nbytes / h, 1e3 * nbytes / c4)
            lines.append(f"| {key} | {_gb(h)} | {_gb(c4)} | {_gb(c1)} | {_gb(w)} | {ms[0]:.2f} | {ms[1]:.2f} |")
            ratios.append((f"hand-off {key} / copyto (4 dst)", h / c4, ">= 0.8"))
            # the goal's copy is one into a fresh destination each batch, as the ring's is; one
            # destination reused stays in the 32 MiB L3 cache at 8 MiB: shown, not a goal
            ratios.append((f"hand-off {key} / copyto (1 dst, reference)", h / c1, None))
    if loaders["in-process"]:
        budget = cd.cpu_budget()
        lines += [
            "",
            f"**2. Demo pipeline** (40,000 records, block shuffle, pad {SEQ_LEN}, batch {BATCH}), one epoch per round, "
            "`jax.block_until_ready` on each batch. The whole-epoch rate includes the loader's start-up (for the "
            "sidecar: starting the sidecar process and any worker processes); CPU is this process plus its descendants "
            f"(sampled every 50 batches, so a little is missed). `workers=None` (the sidecar's default) picks "
            f"cd.cpu_budget().workers = {budget.workers} here ({budget.source}). On JAX's CPU backend the sidecar "
            "Loader copies each slot out once and releases it at once (colo_data/loader.py `_copy`); the sidecar puts "
            f"up to 4 MiB of host batches in one slot (here {CHUNK_RECORDS // BATCH} batches of "
            f"{BATCH * SEQ_LEN * 4 // 1024} KiB of tokens: colo_data/backends/sidecar/server.py `batches_per_slot`).",
            "",
            "| loader | worker processes seen | records/s, whole epoch | records/s after first batch | first batch s "
            "| CPU s per 1k records |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, runs in loaders.items():
            m = {key: _median(runs, key) for key in runs[0] if isinstance(runs[0][key], int | float)}
            lines.append(
                f"| cd.Loader, {name} | {m['worker_processes']:.0f} | {m['records_per_s']:,.0f} | "
                f"{m['steady_records_per_s']:,.0f} | {m['first_batch_s']:.2f} | {m['cpu_s_per_1k']:.3f} |"
            )
        ip, sc, sc0 = (loaders[name] for name in LOADERS)
        ratios += _ratio_pair("sidecar / in-process Loader", sc, ip, ">= 0.9", "whole epoch")
        ratios += _ratio_pair("extra: sidecar workers=0 / in-process Loader", sc0, ip, None, "whole epoch")
    if cgroup_skipped:
        lines += ["", f"**3. 1-CPU cgroup**: skipped ({cgroup_skipped})."]
    elif cgroup_runs["colo"]:
        colo, gr = cgroup_runs["colo"], cgroup_runs["grain"]

        def each(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> str:
            return "/".join(sorted({str(get(r)) for r in runs}))  # one value unless rounds differed

        said = {
            key: each(colo, lambda r, key=key: r.get("sidecar_says", {}).get(key, "?"))
            for key in ("workers", "cpu_budget", "source")
        }
        grain_workers = each(gr, lambda r: r["grain_worker_count"])
        lines += [
            "",
            "**3. 1-CPU cgroup** (cgroup v1 cpu.cfs_quota_us = cpu.cfs_period_us = 100000; the child and everything it "
            f"starts are inside; os.cpu_count() there = {each(colo, lambda r: r['os_cpu_count'])}). Demo corpus, the "
            f"first {CGROUP_BATCHES} batches ({CGROUP_BATCHES * BATCH:,} records) of an epoch for both, batch {BATCH}, "
            f"pad {SEQ_LEN}; each batch put on the device. colo-data: block shuffle, sidecar backend, workers=None "
            f"(the sidecar said: {said['workers']} worker(s), CPU budget {said['cpu_budget']} from {said['source']}). "
            f"Grain {grain_version()}: `DataLoader(worker_count=None)`, which Grain resolves to os.cpu_count() = "
            f"{grain_workers} (grain/_src/python/data_loader.py `_determine_worker_count`), over `cd.ArrowSource` with "
            "`IndexSampler(shuffle=True)` (global shuffle), per-record pad, `Batch(32)`, default ReadOptions. Rates "
            "incl. start-up: from creating the loader (sidecar, workers) to the last batch; the child's imports and "
            "JAX start are not timed. 'workers picked' is what each chose; 'worker processes seen' counts spawned "
            "worker processes (a sidecar with 1 worker runs it on its own thread: colo_data/backends/sidecar/server.py).",
            "",
            "| contender (1-CPU cgroup) | workers picked | worker processes seen | records/s incl. start-up "
            "| records/s after first batch | first batch s | CPU s per 1k records | throttled s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, runs, picked in (
            ("colo-data Loader, sidecar, workers=None", colo, said["workers"]),
            ("Grain DataLoader, worker_count=None", gr, grain_workers),
        ):
            m = {key: _median(runs, key) for key in runs[0] if isinstance(runs[0][key], int | float)}
            lines.append(
                f"| {name} | {picked} | {m['worker_processes']:.0f} | {m['records_per_s']:,.0f} | "
                f"{m['steady_records_per_s']:,.0f} | {m['first_batch_s']:.2f} | {m['cpu_s_per_1k']:.3f} | "
                f"{m['throttled_s']:.1f} |"
            )
        ratios += _ratio_pair("1-CPU cgroup: colo-data sidecar / Grain DataLoader", colo, gr, "> 1", "incl. start-up")
    if ratios:
        lines += ["", "| ratio | value | goal met |", "| --- | ---: | --- |"]
        lines += [f"| {name} | {value:.2f}x | {_goal(value, goal)} |" for name, value, goal in ratios]
    return lines, ratios


def grain_version() -> str:
    from importlib.metadata import version

    return version("grain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,2")
    parser.add_argument("--child", choices=["colo", "grain"], help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=CGROUP_BATCHES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, args.batches)
        return
    parts = {int(p) for p in args.parts.split(",")}
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # run the finally blocks
    flags.FLAGS.mark_as_parsed()
    started = time.perf_counter()
    directory = demo.corpus()
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings
    tracker = Tracker()
    handoff: dict[str, list[dict[str, float]]] = {}
    copy_rot: dict[str, list[dict[str, float]]] = {}
    copy_one: dict[str, list[dict[str, float]]] = {}
    slot_write: dict[str, list[dict[str, float]]] = {}
    loaders: dict[str, list[dict[str, float]]] = {name: [] for name in LOADERS}
    cgroup_runs: dict[str, list[dict[str, Any]]] = {"colo": [], "grain": []}
    cgroup_skipped: str | None = None
    failures: list[str] = []
    cleanup: dict[str, Any] = {}
    sidecar: LocalSidecar | None = None
    cgroup: CpuCgroup | None = None
    try:
        if 1 in parts:
            sidecar = LocalSidecar(SHM_DIR, 0, SLOTS)  # `colo-data sidecar serve`, batches made in it
            tracker.note([sidecar.process.pid])
        if 3 in parts:
            try:
                cgroup = CpuCgroup(1.0)
            except OSError as e:
                cgroup_skipped = f"cannot create a 1-CPU cgroup: {e}"
                print(f"part 3 skipped: {cgroup_skipped}", flush=True)
        for r in range(args.rounds):
            tag = f"round {r + 1}/{args.rounds}"
            if sidecar is not None:
                for mib in HANDOFF_MIB:
                    key = f"{mib} MiB"
                    copy_rot.setdefault(key, []).append(measure_copyto(mib * MIB, SLOTS))
                    slot_write.setdefault(key, []).append(measure_slot_write(mib * MIB))
                    handoff.setdefault(key, []).append(measure_handoff(sidecar, mib * MIB))
                    copy_one.setdefault(key, []).append(measure_copyto(mib * MIB, 1))
                    print(
                        f"{tag}  hand-off {key}: sidecar {_gb(handoff[key][-1]['bytes_per_s'])} GB/s, copyto "
                        f"{_gb(copy_rot[key][-1]['bytes_per_s'])} GB/s (4 dst) / "
                        f"{_gb(copy_one[key][-1]['bytes_per_s'])} GB/s (1 dst)",
                        flush=True,
                    )
            if 2 in parts:
                for name, kwargs in LOADERS.items():
                    loaders[name].append(run_loader(directory, tracker, **kwargs))
                    m = loaders[name][-1]
                    print(
                        f"{tag}  demo Loader {name}: {m['records_per_s']:,.0f} records/s "
                        f"(after first batch {m['steady_records_per_s']:,.0f}; first batch {m['first_batch_s']:.2f} s)",
                        flush=True,
                    )
            if cgroup is not None:
                for kind in ("colo", "grain"):
                    try:
                        cgroup_runs[kind].append(run_in_cgroup(cgroup, kind))
                    except RuntimeError as e:  # once: report it and try again
                        failures.append(f"{tag} {kind}: {e}")
                        print(f"{tag}  1-CPU cgroup {kind} failed, retrying once:\n{e}", flush=True)
                        cgroup_runs[kind].append(run_in_cgroup(cgroup, kind))
                    m = cgroup_runs[kind][-1]
                    print(
                        f"{tag}  1-CPU cgroup {kind}: {m['records_per_s']:,.0f} records/s "
                        f"(after first batch {m['steady_records_per_s']:,.0f}; first batch {m['first_batch_s']:.2f} s; "
                        f"{m['worker_processes']} worker process(es); throttled {m['throttled_s']:.1f} s)",
                        flush=True,
                    )
    finally:
        if sidecar is not None:
            sidecar.stop()
        if cgroup is not None:
            try:
                cleanup["cgroup_pids_left"] = cgroup.remove()
            except OSError as e:
                cleanup["cgroup_remove_error"] = str(e)
                print(f"could not remove cgroup {cgroup.path}: {e}", file=sys.stderr)
        cleanup |= tracker.cleanup()
        print(f"cleanup: {cleanup}", flush=True)

    wall = time.perf_counter() - started
    results = {"handoff": handoff, "copy_rot": copy_rot, "copy_one": copy_one, "slot_write": slot_write}
    lines, ratios = report(args.rounds, wall, results, loaders, cgroup_runs, cgroup_skipped)
    if failures:
        lines += ["", f"Failed and retried once: {len(failures)} child run(s); see sidecar.json `failures_retried`."]
    left = cleanup.get("processes_stopped") or cleanup.get("segments_removed") or cleanup.get("cgroup_pids_left")
    done = f"left behind and removed: {json.dumps(cleanup)}" if left else NOTHING_LEFT
    lines += ["", f"Clean-up: {done}."]
    table = "\n".join(lines)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sidecar.md").write_text(table + "\n")
    (args.out / "sidecar.json").write_text(
        json.dumps(
            {
                "rounds": args.rounds,
                "wall_s": wall,
                "handoff": {
                    "sidecar": handoff,
                    "copyto_4_dst": copy_rot,
                    "copyto_1_dst": copy_one,
                    "shmring_write_alone": slot_write,
                },
                "demo_loader": loaders,
                "cgroup_1cpu": cgroup_runs if not cgroup_skipped else {"skipped": cgroup_skipped},
                "ratios": {name: value for name, value, _ in ratios},
                "cleanup": cleanup,
                "failures_retried": failures,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.out / 'sidecar.md'} and {args.out / 'sidecar.json'}")


if __name__ == "__main__":
    main()
