"""A real CPU-limited cgroup for tests (root only): created under the machine's cgroup v1
`cpu` controller or a cgroup2 hierarchy with `cpu`, removed afterwards. Skips, saying
why, where the machine cannot do it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class CpuCgroup:
    version: int
    mount: Path
    path: Path

    @property
    def procs(self) -> Path:
        """Write a pid here to move that process (and its future children) in."""
        return self.path / "cgroup.procs"


def cpu_hierarchy() -> tuple[int, Path]:
    """(cgroup version, mount point) of a writable CPU controller, or pytest.skip saying why not."""
    if os.geteuid() != 0:
        pytest.skip(f"creating a cgroup needs root; this test runs as uid {os.geteuid()}")
    v2 = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fs_type, _, options = right.split()
        mount = Path(left.split()[4])
        if fs_type == "cgroup" and "cpu" in options.split(","):
            return 1, mount
        if fs_type == "cgroup2" and "cpu" in (mount / "cgroup.controllers").read_text().split():
            v2 = mount
    if v2 is None:
        pytest.skip(
            "/proc/self/mountinfo has no cgroup v1 mount with the cpu controller and no cgroup2 mount "
            "whose cgroup.controllers lists cpu"
        )
    return 2, v2


@contextmanager
def cpu_cgroup(quota_us: int, period_us: int = 100_000) -> Iterator[CpuCgroup]:
    """A fresh cgroup limited to quota_us/period_us CPUs; its processes are moved back to
    the hierarchy's root and the cgroup removed on exit."""
    version, mount = cpu_hierarchy()
    group = mount / f"colo-data-test-{os.getpid()}"
    enabled_cpu = False
    try:
        try:
            if version == 2 and "cpu" not in (mount / "cgroup.subtree_control").read_text().split():
                (mount / "cgroup.subtree_control").write_text("+cpu")
                enabled_cpu = True
            group.mkdir()
            if version == 1:
                (group / "cpu.cfs_period_us").write_text(str(period_us))
                (group / "cpu.cfs_quota_us").write_text(str(quota_us))
            else:
                (group / "cpu.max").write_text(f"{quota_us} {period_us}")
        except OSError as error:
            pytest.skip(f"cgroup v{version} at {mount} is not writable: {error}")
        yield CpuCgroup(version, mount, group)
    finally:
        if group.exists():
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (mount / "cgroup.procs").write_text(pid)
                except OSError:  # the process exited meanwhile
                    pass
            group.rmdir()
        if enabled_cpu:
            (mount / "cgroup.subtree_control").write_text("-cpu")
