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


def wait_until_reading(loader: cd.Loader) -> None:
    """Return once a thread is inside the loader's `next()`."""
    deadline = time.monotonic() + 10
    while not loader._runner._reading.locked():
        assert time.monotonic() < deadline
        time.sleep(0.01)


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
        wait_until_reading(loader)
        with pytest.raises(cd.errors.LoaderBusyError, match="another thread is in next"):
            next(loader)  # raised, not waited: a next() that waited would have returned a batch
        reader.join(60)
        got += [to_numpy(batch) for batch in loader]
    assert_batches_equal(expected, got, f"{backend}: the stream after a refused next()")


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_set_state_from_another_thread_never_ends_the_readers_stream(
    token_corpus: Path, tmp_path: Path, backend: str
) -> None:
    """`set_state` while the reader waits in `next()` is a LoaderBusyError (the waiting batch
    belongs to the old position), and the reader's loop still gets every batch; between
    batches it works from any thread. (It used to end the reader's loop silently.)"""
    pipeline = make_pipeline(token_corpus, transforms=[slow, cd.pad_or_truncate("tokens", 8)])
    expected = read_all(cd.Loader(pipeline))
    with cd.Loader(pipeline, backend=cd.Sidecar(shm_dir=str(tmp_path)) if backend == "sidecar" else backend) as loader:
        start = loader.get_state()
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(to_numpy(batch) for batch in loader))
        reader.start()
        wait_until_reading(loader)
        with pytest.raises(cd.errors.LoaderBusyError, match="set_state while another thread is in next"):
            loader.set_state(start)
        reader.join(120)
        assert not reader.is_alive()
        assert_batches_equal(expected, got, f"{backend}: the reader's stream after a refused set_state")
        jumper = threading.Thread(target=loader.set_state, args=(start,))  # between batches: from any thread
        jumper.start()
        jumper.join(60)
        again = [to_numpy(batch) for batch in loader]
    assert_batches_equal(expected, again, f"{backend}: the stream after set_state from another thread")
