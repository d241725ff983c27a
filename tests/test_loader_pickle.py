"""A pipeline that a backend must pickle (to a sidecar, worker processes or Ray actors) and
that cannot be pickled is a ConfigError when the Loader is made, naming the function and
why, before any process starts: not an error at the first batch, or when the workers
start, hundreds of batches in."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import psutil
import pytest

import colo_data as cd
from colo_data.testing import read_all

import grain_pipelines as gp
from pipelines import make_pipeline


def _children() -> list[psutil.Process]:
    """Live child processes other than multiprocessing's resource tracker."""
    return [
        c
        for c in psutil.Process().children(recursive=True)
        if c.is_running() and c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())
    ]


def test_a_transform_capturing_a_lock_with_worker_processes(token_corpus: Path) -> None:
    lock = threading.Lock()
    locked = lambda batch: (lock, batch)[1]  # noqa: E731 - a lambda is what such a transform usually is
    pipeline = make_pipeline(token_corpus, transforms=[cd.pad_or_truncate("tokens", 8), locked])
    before = _children()
    named = r"(?s)transforms\[1\] \(\S*<lambda> at \S*test_loader_pickle.py:\d+\)"
    with pytest.raises(cd.errors.ConfigError, match=rf"{named}.*worker processes.*cannot pickle '_thread.lock'.*module level") as raised:
        cd.Loader(pipeline, backend=cd.InProcess(workers=2))
    assert not isinstance(raised.value, TypeError)
    assert _children() == before, "a process was started"
    with pytest.warns(UserWarning, match=rf"{named}.*cannot be pickled.*workers='auto' runs it on the host's own thread"):
        loader = cd.Loader(pipeline)  # workers="auto", the default: none, which need nothing pickled
    assert loader.backend == cd.InProcess(workers=0)
    assert read_all(loader), "in the trainer's own process nothing is pickled: it runs"


def test_a_keep_capturing_an_open_file_with_worker_processes(token_corpus: Path, tmp_path: Path) -> None:
    with (tmp_path / "log").open("w") as log:

        def keep_logged(columns: cd.sources.Columns) -> object:
            log.write(".")
            return columns["id"] >= 0

        pipeline = make_pipeline(token_corpus, keep=keep_logged)
        with pytest.raises(
            cd.errors.ConfigError, match=r"(?s)keep \(.*keep_logged at .*\).*Cannot pickle files that are not opened for reading"
        ):
            cd.Loader(pipeline, backend=cd.InProcess(workers=2))


def test_an_unpicklable_make_dataset_with_a_sidecar(tmp_path: Path) -> None:
    paths = gp.write_records(tmp_path)
    lock = threading.Lock()
    make = functools.partial(lambda shard, lock: gp.records_of(shard, paths), lock=lock)
    pipeline = cd.GrainPipeline(make_dataset=make, global_batch_size=gp.BATCH, records=True)
    before = _children()
    with pytest.raises(cd.errors.ConfigError, match=r"(?s)make_dataset \(.*partial.*\).*sidecar.*cannot pickle '_thread.lock'"):
        cd.Loader(pipeline, backend=cd.Sidecar(workers=0))
    assert _children() == before, "a sidecar was started"
