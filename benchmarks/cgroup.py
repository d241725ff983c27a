"""A cgroup v1 CPU quota for a benchmark's child process: a child cgroup of this process's
own with `cpu.cfs_quota_us` set, so that a contender runs in a container's CPU budget, and
its removal with whatever is still inside. Needs root and a v1 cpu controller.
"""

from __future__ import annotations

import os
import time

import psutil


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
    """This process's cgroup under the cpu controller mounted at `mount`."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if "cpu" in controllers.split(","):
                return os.path.join(mount, path.lstrip("/"))
    return mount


class CpuCgroup:
    """A child cgroup `name` of this process's own under the v1 cpu controller, limited to
    `cpus` CPUs (cpu.cfs_quota_us = `cpus` x cpu.cfs_period_us); OSError where none can be
    made (no v1 cpu controller, not root)."""

    def __init__(self, name: str, cpus: float) -> None:
        mount = cpu_cgroup_mount()
        if mount is None:
            raise OSError("no cgroup v1 hierarchy with the cpu controller is mounted")
        self.parent = own_cpu_cgroup(mount)
        self.path = os.path.join(self.parent, name)
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
        """Move process `pid` into the cgroup."""
        self._write("cgroup.procs", str(pid))

    def procs(self) -> list[int]:
        """The pids inside."""
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]

    def stat(self) -> dict[str, int]:
        """cpu.stat: nr_periods, nr_throttled, throttled_time (ns)."""
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
