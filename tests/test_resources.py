"""CPU budget, memory limit and shared-memory capacity: the cgroup parser against fixture
trees (v1, v2, hybrid, nested, namespaced mounts), a real cgroup quota applied to a child
process, and `colo-data doctor` through the installed console script."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from colo_data.errors import ConfigError
from colo_data.resources import CpuBudget, cpu_budget, memory_limit
from colo_data.cli import main
from colo_data.runtime.budget import auto_workers, shm_capacity
from colo_data.workers.settings import WAITING_PER_CPU, WorkerChoice, auto_most, choose_workers

from real_cgroup import cpu_cgroup
from start_gate import tmpfs

AFFINITY = 8
ROOTFS = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"
V1_CPU = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:9 - cgroup cgroup rw,cpu,cpuacct"
V1_CPUSET = "34 31 0:31 / /sys/fs/cgroup/cpuset rw,nosuid shared:11 - cgroup cgroup rw,cpuset"
V1_MEMORY = "35 31 0:32 / /sys/fs/cgroup/memory rw,nosuid shared:12 - cgroup cgroup rw,memory"
V2_HYBRID = "41 31 0:38 / /sys/fs/cgroup/unified rw,nosuid shared:20 - cgroup2 cgroup2 rw,nsdelegate"
V2_ONLY = "30 22 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot"
GIB = 2**30
REAL_AFFINITY = os.sched_getaffinity


@pytest.fixture(autouse=True)
def fixed_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests see 8 CPUs in the affinity mask and no override, whatever the machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(AFFINITY)))
    monkeypatch.delenv("COLO_DATA_CPUS", raising=False)


def tree(tmp_path: Path, cgroup: list[str], mountinfo: list[str], files: dict[str, str]) -> dict[str, str]:
    """Write a fake /proc/self and cgroup file system under tmp_path; return cpu_budget's kwargs."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("".join(f"{line}\n" for line in cgroup))
    (proc / "mountinfo").write_text("".join(f"{line}\n" for line in mountinfo))
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n")
    return {"proc": str(proc), "root": str(tmp_path)}


def v1_quota(directory: str, quota: int, period: int = 100_000) -> dict[str, str]:
    return {f"{directory}/cpu.cfs_quota_us": str(quota), f"{directory}/cpu.cfs_period_us": str(period)}


def test_v1_quota(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["4:cpu,cpuacct:/job", "3:cpuset:/job", "0::/"],
        [ROOTFS, V1_CPU, V1_CPUSET],
        {
            **v1_quota("sys/fs/cgroup/cpu,cpuacct/job", 50_000),
            **v1_quota("sys/fs/cgroup/cpu,cpuacct", -1),
            # the cpuset hierarchy has no CPU quota ("cpu" is not "cpuset"): these must not count
            **v1_quota("sys/fs/cgroup/cpuset/job", 10_000),
        },
    )
    budget = cpu_budget(**where)
    assert budget == CpuBudget(
        cpus=0.5,
        workers=0,
        source=f"cgroup v1 cpu quota 50000/100000 at {tmp_path}/sys/fs/cgroup/cpu,cpuacct/job",
        affinity=AFFINITY,
        quota=0.5,
    )


def test_v2_quota(tmp_path: Path) -> None:
    where = tree(tmp_path, ["0::/job"], [ROOTFS, V2_ONLY], {"sys/fs/cgroup/job/cpu.max": "150000 100000"})
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.quota, budget.workers) == (1.5, 1.5, 1)
    assert budget.source == f"cgroup v2 cpu.max 150000 100000 at {tmp_path}/sys/fs/cgroup/job"


@pytest.mark.parametrize(("v1_cpus", "v2_cpus", "winner"), [(3, 2, "cgroup v2"), (2, 3, "cgroup v1")])
def test_hybrid_smaller_quota_wins(tmp_path: Path, v1_cpus: int, v2_cpus: int, winner: str) -> None:
    where = tree(
        tmp_path,
        ["4:cpu,cpuacct:/job", "0::/job"],
        [ROOTFS, V1_CPU, V2_HYBRID],
        {
            **v1_quota("sys/fs/cgroup/cpu,cpuacct/job", v1_cpus * 100_000),
            "sys/fs/cgroup/unified/job/cpu.max": f"{v2_cpus * 100_000} 100000",
        },
    )
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.quota, budget.workers) == (2.0, 2.0, 1)
    assert budget.source.startswith(winner)


def test_v2_parent_tighter_than_own_cgroup(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["0::/a/b/c"],
        [ROOTFS, V2_ONLY],
        {
            "sys/fs/cgroup/a/b/c/cpu.max": "400000 100000",
            "sys/fs/cgroup/a/b/cpu.max": "max 100000",
            "sys/fs/cgroup/a/cpu.max": "125000 50000",
        },
    )
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.workers) == (2.5, 2)
    assert budget.source == f"cgroup v2 cpu.max 125000 50000 at {tmp_path}/sys/fs/cgroup/a"


def test_v1_parent_tighter_than_own_cgroup(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["4:cpu,cpuacct:/kubepods/pod1/c1"],
        [ROOTFS, V1_CPU],
        {
            **v1_quota("sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1", -1),
            **v1_quota("sys/fs/cgroup/cpu,cpuacct/kubepods/pod1", 30_000),
            **v1_quota("sys/fs/cgroup/cpu,cpuacct/kubepods", 400_000),
        },
    )
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.workers, budget.quota) == (0.3, 0, 0.3)
    assert budget.source.endswith("/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1")


def test_unlimited_quotas_leave_the_affinity_mask(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["4:cpu,cpuacct:/job", "0::/job"],
        [ROOTFS, V1_CPU, V2_HYBRID],
        {**v1_quota("sys/fs/cgroup/cpu,cpuacct/job", -1), "sys/fs/cgroup/unified/job/cpu.max": "max 100000"},
    )
    assert cpu_budget(**where) == CpuBudget(
        cpus=8.0, workers=7, source="affinity mask: 8 CPUs", affinity=AFFINITY, quota=None
    )


def test_affinity_mask_below_the_quota_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 6})
    where = tree(tmp_path, ["0::/job"], [V2_ONLY], {"sys/fs/cgroup/job/cpu.max": "400000 100000"})
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.workers, budget.affinity, budget.quota) == (3.0, 2, 3, 4.0)
    assert budget.source == "affinity mask: 3 CPUs"


def test_missing_files_are_skipped(tmp_path: Path) -> None:
    # a v1 period without its quota, a v2 cgroup without cpu.max, and a hierarchy not mounted
    where = tree(
        tmp_path,
        ["4:cpu,cpuacct:/job", "0::/job", "7:pids:/job"],
        [ROOTFS, V1_CPU, V2_HYBRID],
        {"sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000"},
    )
    assert cpu_budget(**where).source == "affinity mask: 8 CPUs"
    assert memory_limit(**where) is None
    nothing = {"proc": str(tmp_path / "no-proc"), "root": str(tmp_path / "no-root")}
    assert cpu_budget(**nothing) == CpuBudget(8.0, 7, "affinity mask: 8 CPUs", AFFINITY, None)
    assert memory_limit(**nothing) is None


def test_mount_whose_root_is_the_containers_own_cgroup(tmp_path: Path) -> None:
    # The container's /sys/fs/cgroup shows host cgroup /kubepods/pod1: the process's cgroup
    # /kubepods/pod1/c1 is <mount>/c1, and the walk stops at the mount point.
    mount = "30 22 0:26 /kubepods/pod1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw"
    where = tree(
        tmp_path,
        ["0::/kubepods/pod1/c1"],
        [ROOTFS, mount],
        {
            "sys/fs/cgroup/c1/cpu.max": "max 100000",
            "sys/fs/cgroup/cpu.max": "75000 100000",
            # what a parser that ignored the mount root would read instead
            "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "10000 100000",
        },
    )
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.workers) == (0.75, 0)
    assert budget.source == f"cgroup v2 cpu.max 75000 100000 at {tmp_path}/sys/fs/cgroup"


def test_cgroup_outside_the_mount_is_ignored(tmp_path: Path) -> None:
    mount = "30 22 0:26 /kubepods/pod1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw"
    where = tree(
        tmp_path,
        ["0::/kubepods/pod2"],
        [mount],
        {"sys/fs/cgroup/cpu.max": "10000 100000", "sys/fs/cgroup/kubepods/pod2/cpu.max": "10000 100000"},
    )
    assert cpu_budget(**where).source == "affinity mask: 8 CPUs"


def test_escaped_mount_point(tmp_path: Path) -> None:
    mount = r"32 31 0:29 / /cg\040v1 rw - cgroup cgroup rw,cpu"
    where = tree(tmp_path, ["4:cpu:/"], [mount], v1_quota("cg v1", 250_000))
    assert cpu_budget(**where).cpus == 2.5


@pytest.mark.parametrize(
    ("override", "cpus", "source"),
    [("0.25", 0.25, "COLO_DATA_CPUS=0.25"), ("3", 0.5, "cgroup v1"), ("100", 0.5, "cgroup v1")],
)
def test_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str, cpus: float, source: str) -> None:
    where = tree(tmp_path, ["4:cpu,cpuacct:/job"], [V1_CPU], v1_quota("sys/fs/cgroup/cpu,cpuacct/job", 50_000))
    monkeypatch.setenv("COLO_DATA_CPUS", override)
    budget = cpu_budget(**where)
    assert (budget.cpus, budget.workers, budget.quota) == (cpus, 0, 0.5)
    assert budget.source.startswith(source)


def test_override_below_the_affinity_mask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLO_DATA_CPUS", "3")
    budget = cpu_budget(proc=str(tmp_path), root=str(tmp_path))
    assert (budget.cpus, budget.workers, budget.source, budget.quota) == (3.0, 2, "COLO_DATA_CPUS=3", None)


@pytest.mark.parametrize("override", ["", "abc", "0", "-2", "nan", "inf"])
def test_bad_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str) -> None:
    monkeypatch.setenv("COLO_DATA_CPUS", override)
    with pytest.raises(ConfigError, match="COLO_DATA_CPUS"):
        cpu_budget(proc=str(tmp_path), root=str(tmp_path))


def test_memory_limit_v1_smallest_over_the_hierarchy(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["5:memory:/a/b", "0::/a/b"],
        [ROOTFS, V1_MEMORY, V2_HYBRID],
        {
            "sys/fs/cgroup/memory/a/b/memory.limit_in_bytes": str(4 * GIB),
            "sys/fs/cgroup/memory/a/memory.limit_in_bytes": str(3 * GIB),
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        },
    )
    assert memory_limit(**where) == 3 * GIB


def test_memory_limit_v2(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["0::/a/b"],
        [V2_ONLY],
        {"sys/fs/cgroup/a/b/memory.max": str(2 * GIB), "sys/fs/cgroup/a/memory.max": "max"},
    )
    assert memory_limit(**where) == 2 * GIB


def test_memory_limit_hybrid_smaller_wins(tmp_path: Path) -> None:
    where = tree(
        tmp_path,
        ["5:memory:/job", "0::/job"],
        [V1_MEMORY, V2_HYBRID],
        {
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": str(6 * GIB),
            "sys/fs/cgroup/unified/job/memory.max": str(5 * GIB),
        },
    )
    assert memory_limit(**where) == 5 * GIB


@pytest.mark.parametrize(
    ("cgroup", "mount", "files"),
    [
        ("5:memory:/job", V1_MEMORY, {"sys/fs/cgroup/memory/job/memory.limit_in_bytes": "9223372036854771712"}),
        ("0::/job", V2_ONLY, {"sys/fs/cgroup/job/memory.max": "max"}),
    ],
)
def test_memory_unlimited(tmp_path: Path, cgroup: str, mount: str, files: dict[str, str]) -> None:
    assert memory_limit(**tree(tmp_path, [cgroup], [mount], files)) is None


def test_shm_capacity(tmp_path: Path) -> None:
    """The free bytes of a real 16 MiB tmpfs (its own: the free space of a disk that other
    tests write to changes between two looks)."""
    with tmpfs(tmp_path / "shm", "16m") as mount:
        assert shm_capacity(str(mount)) == 16 * 2**20
    with pytest.raises(ConfigError, match="no-such-dir"):
        shm_capacity(str(tmp_path / "no-such-dir"))


# ---------------------------------------------------------------- a real cgroup

CHILD = """
import dataclasses, json, os, sys
import colo_data
with open(sys.argv[1], "w") as procs:  # join the cgroup, then measure
    procs.write(str(os.getpid()))
print(json.dumps(dataclasses.asdict(colo_data.resources.cpu_budget())))
"""


def _own_quota(version: int, directory: Path) -> float:
    """The CPU quota written in one cgroup directory (inf for none), read without colo_data."""
    if version == 1:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        return float("inf") if quota < 0 else quota / int((directory / "cpu.cfs_period_us").read_text())
    if not (directory / "cpu.max").exists():  # the root of a v2 hierarchy
        return float("inf")
    quota, period = (directory / "cpu.max").read_text().split()
    return float("inf") if quota == "max" else int(quota) / int(period)


def _run_child(procs: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "COLO_DATA_CPUS"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(procs)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_real_cgroup_quota_reaches_a_child_process() -> None:
    with cpu_cgroup(50_000) as group:
        limited = _run_child(group.procs)
        assert (limited["cpus"], limited["workers"], limited["quota"]) == (0.5, 0, 0.5)
        quota_text = "cpu quota 50000/100000" if group.version == 1 else "cpu.max 50000 100000"
        assert limited["source"] == f"cgroup v{group.version} {quota_text} at {group.path}"

        # The same child in the hierarchy's root cgroup: none of our quota, only the mask (and
        # the mount point's own quota where that is a container's cgroup rather than the root).
        affinity = len(REAL_AFFINITY(0))
        expected = min(affinity, _own_quota(group.version, group.mount))
        free = _run_child(group.mount / "cgroup.procs")
        assert (free["cpus"], free["affinity"]) == (expected, affinity)


# ---------------------------------------------------------------- colo-data doctor

def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the installed console script next to this interpreter."""
    environment = {k: v for k, v in os.environ.items() if k != "COLO_DATA_CPUS"}
    environment |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=3", **env}
    script = Path(sys.executable).parent / "colo-data"
    return subprocess.run([str(script), "doctor", *args], env=environment, capture_output=True, text=True, timeout=120)


def test_doctor_json_reports_what_this_process_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", REAL_AFFINITY)  # as the subprocess sees it
    out = _doctor("--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"cpu", "memory_limit", "shm", "jax", "versions", "warnings", "workers"}
    assert report["workers"]["most"] == auto_most(cpu_budget()) and report["workers"]["why"].startswith("auto: up to")
    assert report["warnings"] == []  # off Pathways there are none
    assert report["cpu"] == dataclasses.asdict(cpu_budget())
    assert report["memory_limit"] == memory_limit()
    assert report["shm"]["directory"] == "/dev/shm" and report["shm"]["free_bytes"] > 0
    assert report["jax"] == {"backend": "cpu", "devices": ["cpu:0", "cpu:1", "cpu:2"], "pathways": False, "error": None}
    assert report["versions"]["colo-data"] == importlib.metadata.version("colo-data")
    assert report["versions"]["python"] == platform.python_version()
    packages = {"colo-data", "jax", "jaxlib", "grain", "pyarrow", "pathwaysutils", "numpy", "python"}
    assert set(report["versions"]) == packages and all(report["versions"].values())


def test_doctor_text() -> None:
    out = _doctor(COLO_DATA_CPUS="0.5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = {label: value.strip() for label, value in (line.split("  ", 1) for line in lines)}
    assert rows["cpu budget"] == "0.5 CPUs (COLO_DATA_CPUS=0.5)"
    # what a sidecar's "auto" allows on half a CPU (one busy CPU's worth of waiting workers),
    # as the sidecar says it, and apart, what Grain's multiprocessing gets: none
    assert rows["workers"].startswith(f"auto: up to {WAITING_PER_CPU} ({WAITING_PER_CPU} a CPU of the budget of 0.5 (COLO_DATA_CPUS=0.5)")
    assert rows["grain workers"].startswith("0 (")
    assert rows["jax backend"] == "cpu"
    assert rows["jax devices"].startswith("3: ")
    assert rows["pathways proxy"] == "no"
    assert rows["shm /dev/shm"].endswith("bytes) free")
    assert {"affinity mask", "cgroup cpu quota", "memory limit", "version colo-data", "version jax"} <= set(rows)
    assert len({len(line) - len(value) for line, value in zip(lines, rows.values())}) == 1  # one column


def test_doctor_bad_override_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLO_DATA_CPUS", "lots")
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 1
    assert "COLO_DATA_CPUS='lots'" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("cpus", "workers"), [(0.5, 0), (1.0, 0), (1.5, 1), (2.0, 1), (2.5, 2), (8.0, 7), (64.0, 63)])
def test_auto_workers_are_the_cpus_less_the_hosts_own_thread(cpus: float, workers: int) -> None:
    assert auto_workers(cpus) == workers


def test_the_worker_choice_says_why() -> None:
    """"auto" allows 16 workers a CPU of the budget (records that wait make more pay than
    there are CPUs), at most 256 and a share of the memory; the policy counts how many work."""
    budget = CpuBudget(cpus=2.0, workers=1, source="affinity mask: 2 CPUs", affinity=2, quota=None)
    chosen = choose_workers("auto", budget)
    assert chosen.count == min(32, auto_most(budget)) and chosen.ray is None
    assert chosen.reason.startswith(f"auto: up to {chosen.count} (16 a CPU of the budget of 2 (affinity mask: 2 CPUs)")
    assert "as many at work as the worker policy counts" in chosen.reason
    big = CpuBudget(224.0, 223, "affinity mask: 224 CPUs", 224, None)
    assert auto_most(big, memory=2**40) == 256  # at most 256 processes
    assert auto_most(big, memory=8 * 2**30) == 32  # half of 8 GiB at 128 MiB a worker
    assert auto_most(CpuBudget(0.5, 0, "COLO_DATA_CPUS=0.5", 2, None), memory=2**40) == 16  # a part of a CPU counts as one
    assert choose_workers(3, budget) == WorkerChoice(3, "up to 3, as configured; as many at work as the worker policy counts")
    assert choose_workers(0, budget) == WorkerChoice(0, "none configured (workers=0): the host's own thread computes every batch")