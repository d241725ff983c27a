"""`cd.resources`: what this host may spend, as colo-data reads it from the container
(cgroup CPU quotas, affinity, memory limit) rather than from `os.cpu_count()`, and Grain's
multiprocessing options sized from it."""

from colo_data.runtime.budget import CpuBudget, cpu_budget, memory_limit
from colo_data.workers.settings import grain_multiprocessing_options

__all__ = ["CpuBudget", "cpu_budget", "grain_multiprocessing_options", "memory_limit"]
