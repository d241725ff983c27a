"""`IdleCpus`: how much of a CPU budget goes unused, read between two moments. Worker
processes only pay with CPU that nothing else uses: on 2 CPUs a light pipeline through a
sidecar kept both busy on its own (the sidecar's thread and the trainer, 1.9 CPUs), and two
workers beside them ran at half its rate; in process (1.2 CPUs busy) or CPU-bound (1.1),
they doubled it."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import psutil

from colo_data.runtime.budget import CpuBudget


class IdleCpus:
    """CPUs of `budget` left unused since the last `read`. Where the affinity mask sets the
    budget, the mask's CPUs as the whole machine used them (other tenants count as busy);
    under a quota, the CPU time of this process, its descendants and the processes `also`
    (a trainer that shares the quota with its own sidecar) against the quota.

    Args:
        budget: the CPU budget whose idle part is measured.
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
        """CPUs idle on average since the last call (at least 0; None at the first call)."""
        now, busy = time.monotonic(), self._busy()
        last, self._last = self._last, (now, busy)
        if last is None or now <= last[0]:
            return None
        return max(0.0, self.budget.cpus - (busy - last[1]) / (now - last[0]))


def _busy(times: object) -> float:
    """A CPU's busy seconds in one `psutil.cpu_times` entry: all but idle and I/O wait."""
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
