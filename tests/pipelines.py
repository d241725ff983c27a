"""The test pipeline over the small token corpus: 120 records in uneven row groups,
block-shuffled in windows of 2 row groups, tokens padded to 8, with the record index."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import cloudpickle

import colo_data as cd
from colo_data.workers.forks import in_worker

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # worker processes and sidecars get its functions by value

BATCH = 12  # divisible by 1, 2, 3 and 4 hosts and by the 4 test devices
MIX_SIZES = {"web": 60, "code": 25, "math": 7}  # the mixture tests' components; math: fewer records than a batch


def make_pipeline(corpus: Path, shuffle: str = "block", **overrides) -> cd.Pipeline:
    settings = dict(
        source=cd.ArrowSource(str(corpus), columns=["id", "tokens"]),
        order=cd.Order(shuffle=shuffle, seed=7, window=2),
        transforms=[cd.pad_or_truncate("tokens", 8)],
        global_batch_size=BATCH,
        index_column="_index",
    )
    settings.update(overrides)
    return cd.Pipeline(**settings)


def in_worker_process() -> bool:
    """Whether this process is a worker process of a pool."""
    return in_worker()


class IdleHost:
    """A transform that sleeps `seconds` a chunk, and `per_record` seconds a record, where a
    host's own thread computes it (in the trainer or a sidecar), not in a worker process: a
    host's thread that waits (as one waiting on remote reads does) whatever else the machine
    runs, beside workers that do not. Put it first in the transforms of tests that need the
    workers at work (longer for heavier pipelines). `idle_records` waits 1 ms a record: its
    host's thread alone makes under 1,000 records a second, fewer than any test's loop takes
    on a loaded machine, so the worker policy counts workers for it wherever they may work."""

    def __init__(self, seconds: float = 0.02, per_record: float = 0.0) -> None:
        self.seconds, self.per_record = seconds, per_record

    def __call__(self, batch: dict) -> dict:
        if not in_worker_process():
            time.sleep(self.seconds + self.per_record * len(next(iter(batch.values()))))
        return batch


idle_host = IdleHost()
idle_records = IdleHost(0.0, 0.001)


class IdleWorkers:
    """A transform that sleeps `per_record` seconds a record in a worker process only: work
    that waits, so that one worker makes at most `1 / per_record` records a second. At 1 ms,
    fewer than any test's loop takes, also on a loaded machine: the worker policy counts a
    second worker (and, the work waiting, whatever CPUs the machine has left)."""

    def __init__(self, per_record: float = 0.001) -> None:
        self.per_record = per_record

    def __call__(self, batch: dict) -> dict:
        if in_worker_process():
            time.sleep(self.per_record * len(next(iter(batch.values()))))
        return batch


class OnArrival:
    """A transform that does nothing to the batch and calls `arrived()` as a worker process
    unpickles it (its job has just come), and only there: what a test needs to see or do at
    a worker's set-up, in a subclass, with its settings in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self, batch: dict) -> dict:
        return batch

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if in_worker_process():
            self.arrived()

    def arrived(self) -> None:
        """What the subclass does in a worker process whose job has just come."""
        raise NotImplementedError


class SlowToStart(OnArrival):
    """A transform (doing nothing to the batch) that holds up the set-up of every worker
    process but the first, as a slow start would, until the file `go` exists (2 minutes at
    most); each writes `waiting` while it waits. The host's own thread is not held up."""

    def arrived(self) -> None:
        """Hold up every worker but the first until `go` exists."""
        try:
            (self.directory / "first").open("x").close()
        except FileExistsError:
            (self.directory / "waiting").touch()
            stop = time.monotonic() + 120
            while not (self.directory / "go").exists() and time.monotonic() < stop:
                time.sleep(0.05)


class InWorkers:
    """A transform (doing nothing to the batch) that, in a worker process, appends the
    record indices (`_index`) of each batch it sees to the file named by the process's pid
    in `directory`, and raises on a batch holding record `fail_on`."""

    def __init__(self, directory: Path, fail_on: int | None = None) -> None:
        self.directory, self.fail_on = directory, fail_on

    def __call__(self, batch: dict) -> dict:
        if in_worker_process():
            with (self.directory / str(os.getpid())).open("a") as seen:
                seen.write(" ".join(map(str, batch["_index"].tolist())) + "\n")
            if self.fail_on in batch["_index"].tolist():
                raise ValueError(f"record {self.fail_on}")
        return batch


def backend_of(
    name: str, workers: int | cd.RayWorkers = 0, shm_dir: Path | str | None = None
) -> cd.InProcess | cd.Sidecar | cd.Colocated:
    """The backend called `name` with `workers` (worker processes, or Ray workers; a sidecar's
    ring in `shm_dir`, if given)."""
    if name == "sidecar":
        return cd.Sidecar(workers=workers, **({"shm_dir": str(shm_dir)} if shm_dir is not None else {}))
    return cd.InProcess(workers=workers) if name == "inprocess" else cd.Colocated(workers=workers)


# How long a test waits for worker processes to make something: a bound for a loaded machine (the workers
# run at nice 10, below busy neighbours, and start only where the CPU budget goes unused), not a timing
WORKERS_S = 300.0


def until_workers_made(loader: cd.Loader, deadline_s: float = WORKERS_S) -> list[dict]:
    """The loader's batches (as numpy) until its worker processes have made some records,
    as its telemetry's `pool_wait` stage counts them (looked at every 50 ms: the loop takes
    batches as fast as a trainer that waits for them). A host counts workers where its own
    thread alone would leave the trainer waiting: tests that need them put `idle_host` or
    `idle_records` in the pipeline's transforms."""
    import time

    import numpy as np

    batches, stop, look = [], time.monotonic() + deadline_s, 0.0
    while True:
        if time.monotonic() >= look:
            if pool_records(loader):
                return batches
            look = time.monotonic() + 0.05
        assert time.monotonic() < stop, f"the workers made nothing in {deadline_s:g} s"
        batches.append({name: np.asarray(a) for name, a in next(loader).items()})


def pool_records(loader: cd.Loader) -> int:
    """Records the loader's worker pool has made so far (its telemetry's `pool_wait` items)."""
    return next(s for s in loader.telemetry().stages if s.name == "pool_wait").items


def read_while_given_up(loader: cd.Loader, quiet_s: float = 2.0, watched_s: float = 3.0, deadline_s: float = 60.0) -> list[dict]:
    """The loader's batches (as numpy) until its pool has made records, then until it has
    made no more for `quiet_s` seconds (its trial over, the chunks it had in hand taken:
    `deadline_s` at most, as a pool that is kept goes on making them), then for `watched_s`
    seconds more, over which it must make none: it is given up."""
    import time

    from colo_data.testing import to_numpy

    got = until_workers_made(loader)
    made, last, stop = pool_records(loader), time.monotonic(), time.monotonic() + deadline_s
    while time.monotonic() - last < quiet_s:
        assert time.monotonic() < stop, f"the pool was not given up: it made records for {deadline_s:g} s"
        got.append(to_numpy(next(loader)))
        if pool_records(loader) != made:
            made, last = pool_records(loader), time.monotonic()
    watched = time.monotonic()
    while time.monotonic() - watched < watched_s:
        got.append(to_numpy(next(loader)))
    assert pool_records(loader) == made, f"the pool made records again after {quiet_s:g} s without"
    return got


def row_groups_decoded(pipeline: cd.Pipeline, hosts: int, batches: int | None = None) -> int:
    """The row groups the `hosts` host pipelines of `pipeline` decode over its stream (or
    its first `batches` batches), each with a source (and row-group cache) of its own, as in
    a process of its own; summed."""
    import itertools
    import pickle
    from contextlib import closing

    from colo_data.host.host_pipeline import HostPipeline

    total = 0
    for h in range(hosts):
        own = pickle.loads(pickle.dumps(pipeline))
        with closing(HostPipeline(own, h, hosts).chunks(0, batches=None if batches is None else 1)) as chunks:
            for _ in itertools.islice(chunks, batches):
                pass
        total += int(own.source.read_stats()[4])  # row groups decoded
    return total


def assert_state_refused(pipeline: cd.Pipeline, state: dict, match: str, set_state: bool = True) -> None:
    """A StateError matching `match` for `state` wherever a state goes in: `Loader(state=)`,
    `set_state` (unless not `set_state`), `cd.skip` and `cd.lineage`."""
    import pytest

    with pytest.raises(cd.errors.StateError, match=match):
        cd.Loader(pipeline, state=state)
    if set_state:
        with cd.Loader(pipeline) as loader, pytest.raises(cd.errors.StateError, match=match):
            loader.set_state(state)
    with pytest.raises(cd.errors.StateError, match=match):
        cd.skip(pipeline, state, batches=1)
    step = max(1, int(state.get("step") or 1))  # a step the state has reached
    with pytest.raises(cd.errors.StateError, match=match):
        cd.lineage(pipeline, state, steps=range(step, step + 1))
