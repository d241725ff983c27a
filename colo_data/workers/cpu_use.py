"""`CpuUse`: how much of a CPU budget is in use, read between two moments: what the
worker-count policy takes from the budget as used by the trainer and everything else
before it counts CPUs for workers."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import psutil

from colo_data.runtime.budget import CpuBudget


class CpuUse:
    """CPUs of `budget` in use since the last `read`. Where the affinity mask sets the
    budget, the mask's CPUs as the whole machine used them (other tenants count as busy);
    under a quota, the CPU time of this process, its descendants and the processes `also`
    (a trainer that shares the quota with its own sidecar).

    Args:
        budget: the CPU budget whose use is measured.
        also: pids of other processes that spend the same budget.
    """

    def __init__(self, budget: CpuBudget, also: Sequence[int] = ()) -> None:
        self.budget = budget
        self._also = tuple(also)
        self._machine = budget.source.startswith("affinity mask")
        self._cpus = sorted(os.sched_getaffinity(0))
        self._last: tuple[float, float] | None = None  # (monotonic seconds, busy CPU seconds)

    def _busy(self) -> float:
        """Busy CPU seconds so far (only differences mean anything)."""
        if self._machine:
            per_cpu = psutil.cpu_times(percpu=True)
            return sum(_busy(per_cpu[i]) for i in self._cpus if i < len(per_cpu))
        me = psutil.Process()
        processes = [me, *me.children(recursive=True)]
        for pid in self._also:
            try:
                processes.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:  # a child that ended meanwhile
                continue
            total += times.user + times.system
        return total

    def read(self) -> float | None:
        """CPUs busy on average since the last call (None at the first call)."""
        now, busy = time.monotonic(), self._busy()
        last, self._last = self._last, (now, busy)
        if last is None or now <= last[0]:
            return None
        return max(0.0, busy - last[1]) / (now - last[0])


def _busy(times: object) -> float:
    """A CPU's busy seconds in one `psutil.cpu_times` entry: all but idle and I/O wait."""
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
