"""The test run's lock, shared by its processes (pytest-xdist's workers, in the run's
directory, conftest.py): a `serial` test holds it alone, any other work holds it with the
others. So a serial test starts once the work in hand elsewhere ends, and no other starts
until it ends."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held(alone: bool, queue: bool = True) -> Iterator[None]:
    """The run's lock, alone or shared. One waiting to hold it alone holds the gate, so that
    the others cannot keep it from ever getting it; `queue=False` passes the gate: for work
    that a running test waits for (which holds the lock, so a serial test that holds the
    gate waits for it: queueing there would wait forever)."""
    run = os.environ["COLO_DATA_TEST_RUN"]
    with open(os.path.join(run, "gate"), "a") as gate, open(os.path.join(run, "lock"), "a") as lock:
        if queue:
            fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if queue:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
