"""The processes a benchmark run starts (sidecars, worker processes): which of them are
workers, their CPU time sampled while they live, and, at the end, stopping any still alive
and removing the shared-memory ring segments they wrote, so that nothing is left behind.
"""

from __future__ import annotations

import os
import re

import psutil

SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"colo-data-(\d+)-[0-9a-f]{8}-\d+")
# Worker processes: Grain's and multiprocessing's (spawned) and colo-data's own pool, under
# its module name of each commit (benchmarks/startup.py compares commits).
_WORKER_MARKS = ("spawn_main", "colo_data.host.workers", "colo_data.workers.processes")


def cpu_of(proc: psutil.Process) -> float:
    """User + system CPU seconds of `proc` (0 once it is gone)."""
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def is_worker(proc: psutil.Process) -> bool:
    """Whether `proc` is a worker process (Grain's, multiprocessing's or colo-data's)."""
    try:
        command = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(mark in command for mark in _WORKER_MARKS)


def worker_processes() -> int:
    """Worker processes among this process's descendants now (those of its sidecar too)."""
    return sum(map(is_worker, psutil.Process().children(recursive=True)))


class Tracker:
    """Remembers the pids of this run's descendants (sidecars, workers) and, at the end,
    stops any still alive and removes ring segments that they wrote."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.shm_before = set(self.segments())

    @staticmethod
    def segments() -> list[str]:
        """colo-data's ring segments in `SHM_DIR` now."""
        try:
            return sorted(n for n in os.listdir(SHM_DIR) if _SEGMENT.fullmatch(n))
        except FileNotFoundError:
            return []

    def note(self, pids: list[int] | None = None) -> list[psutil.Process]:
        """Remember this process's descendants now (and `pids`); returns the descendants."""
        found = psutil.Process().children(recursive=True)
        self.pids.update(p.pid for p in found)
        self.pids.update(pids or [])
        return found

    def cleanup(self) -> dict[str, list[str]]:
        """Stop the descendants still alive (terminate, then kill) and remove the new segments
        of this run's processes; returns what was stopped and removed, and the new segments
        of other processes."""
        left = psutil.Process().children(recursive=True)
        self.pids.update(p.pid for p in left)
        stopped = []
        for proc in left:
            try:
                stopped.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
            except psutil.Error:
                pass
        report: dict[str, list[str]] = {"processes_stopped": stopped}
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


class DescendantCpu:
    """A `harness.CpuClock`: CPU seconds of this process and its descendants since it was made,
    the descendants sampled while they live (their workers may end before the run does, taking
    their CPU times with them); counts the worker processes seen too. With a `tracker`, every
    descendant sampled is remembered for its clean-up."""

    def __init__(self, tracker: Tracker | None = None) -> None:
        self.me = psutil.Process()
        self.tracker = tracker
        self.before = {p.pid: cpu_of(p) for p in self.me.children(recursive=True)}  # e.g. an idle sidecar's
        self.own = cpu_of(self.me)
        self.seen: dict[int, float] = {}
        self.workers = 0

    def sample(self) -> None:
        descendants = self.tracker.note() if self.tracker else self.me.children(recursive=True)
        self.workers = max(self.workers, sum(map(is_worker, descendants)))
        for p in descendants:
            self.seen[p.pid] = max(self.seen.get(p.pid, 0.0), cpu_of(p))

    def used(self) -> float:
        return cpu_of(self.me) - self.own + sum(used - self.before.get(pid, 0.0) for pid, used in self.seen.items())
