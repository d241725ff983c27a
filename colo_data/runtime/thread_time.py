"""`ThreadTime`: what a piece of work cost the thread that did it: seconds on a CPU, and
seconds of work (on a CPU, or waiting for a fetch, a lock, a sleep), which leave out the time
it waited for a CPU in the run queue. On a host whose CPUs are all busy a worker's wall time
grows with the queue, not with the work: counted as work, that wait would look like a reason
for more workers. Linux reports the run queue per thread in /proc/thread-self/schedstat;
elsewhere the wall time is the work."""

from __future__ import annotations

import time
from typing import NamedTuple

_SCHEDSTAT = "/proc/thread-self/schedstat"  # "<ns on a CPU> <ns waiting in the run queue> <timeslices>"


class ThreadTime(NamedTuple):
    """A moment of the calling thread: its seconds on a CPU so far, and its wall seconds
    less those it waited for a CPU. Differences of two moments are what the work between
    them cost (`since`)."""

    cpu: float
    work: float

    @classmethod
    def now(cls) -> ThreadTime:
        wall = time.perf_counter()
        try:
            with open(_SCHEDSTAT, "rb") as stat:
                on_cpu, queued = stat.read().split()[:2]
            return cls(int(on_cpu) / 1e9, wall - int(queued) / 1e9)
        except (OSError, ValueError):  # no schedstat (another OS, a kernel without it): the wall time is the work
            return cls(time.thread_time(), wall)

    def since(self, before: ThreadTime) -> ThreadTime:
        """What the thread spent from `before` to this moment."""
        return ThreadTime(max(0.0, self.cpu - before.cpu), max(0.0, self.work - before.work))
