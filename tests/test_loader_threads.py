"""One loader read from two threads at once (issue 12, finding 4, in part): the second
`next()` is a `LoaderBusyError` at once, never a hang or a batch delivered twice, and the
stream goes on unchanged for the thread that was reading."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

import colo_data as cd
from colo_data.testing import assert_batches_equal, read_all, to_numpy

from pipelines import make_pipeline

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # sidecars cannot import this test module


def slow(batch: dict) -> dict:
    time.sleep(0.5)  # every call: the first next() takes at least this long
    return batch


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_a_second_thread_in_next_is_an_error_not_a_hang_or_a_duplicate(
    token_corpus: Path, tmp_path: Path, backend: str
) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[slow, cd.pad_or_truncate("tokens", 8)])
    expected = read_all(cd.Loader(pipeline))
    with cd.Loader(pipeline, backend=cd.Sidecar(shm_dir=str(tmp_path)) if backend == "sidecar" else backend) as loader:
        got: list = []
        reader = threading.Thread(target=lambda: got.append(to_numpy(next(loader))))
        reader.start()
        deadline = time.monotonic() + 10
        while not loader._runner._reading.locked():  # the reader is inside next()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(cd.LoaderBusyError, match="another thread is in next"):
            next(loader)  # raised, not waited: a next() that waited would have returned a batch
        reader.join(60)
        got += [to_numpy(batch) for batch in loader]
    assert_batches_equal(expected, got, f"{backend}: the stream after a refused next()")
