"""Errors that cross a boundary keep their cause: a user's exception raised in a worker
process, in a sidecar or in a colocated host arrives as the same colo-data error type, with
the user's exception (rebuilt, or a stand-in naming its type where it cannot be) as its
`__cause__`, and the remote traceback printed once."""

from __future__ import annotations

import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import cloudpickle
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import colo_data as cd
from colo_data.errors import RemoteError
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.workers.processes import WorkerPool

from pipelines import make_pipeline

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers and the sidecar cannot import this module
PAD = cd.pad_or_truncate("tokens", 8)


def bad_record_7(batch: dict) -> dict:
    """A user's transform that fails on record 7."""
    if 7 in batch["_index"]:
        raise ValueError("bad record 7")
    return batch


class NeedsCode(Exception):
    """A user's exception that pickles but does not unpickle: its class takes two arguments,
    its `args` hold one."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class HoldsLock(Exception):
    """A user's exception that does not pickle: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def needs_code(batch: dict) -> dict:
    """A user's transform that raises a `NeedsCode`."""
    raise NeedsCode(7, "bad record 7")


def holds_lock(batch: dict) -> dict:
    """A user's transform that raises a `HoldsLock`."""
    raise HoldsLock("bad record 7")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm for a sidecar's ring."""
    with tempfile.TemporaryDirectory(prefix="ring-test-", dir="/dev/shm") as directory:
        yield Path(directory)


def failure(loader: cd.Loader, kind: type[cd.ColoDataError]) -> cd.ColoDataError:
    """The error that `loader`'s first batch ends with."""
    with loader, pytest.raises(kind) as raised:
        next(loader)
    return raised.value


def assert_printed_once(error: BaseException, frame: str) -> None:
    """`error` as `traceback` prints it shows the remote frame of function `frame` once."""
    printed = "".join(traceback.format_exception(error))
    assert printed.count(f", in {frame}\n") == 1, printed


def test_a_users_error_in_a_worker_process_arrives_as_its_cause(token_corpus: Path) -> None:
    """The pool's own feed, which a worker computes for certain (a host pipeline hands its
    workers chunks only while CPU goes unused: on a busy machine, none)."""
    pipeline = make_pipeline(token_corpus, "none", transforms=[bad_record_7, PAD])
    owner = Lifecycle("test")
    try:
        feed = WorkerPool(1, owner).feed(cloudpickle.dumps(pipeline), 0, 1, 0)
        feed.ask(0, 1, 1)
        with pytest.raises(cd.errors.TransformError) as raised:
            feed.take()
    finally:
        owner.close()
    error = raised.value
    assert "--- raised in a worker process ---" in str(error) and "ValueError: bad record 7" in str(error)
    assert type(error.__cause__) is ValueError and str(error.__cause__) == "bad record 7"
    assert_printed_once(error, "bad_record_7")


def test_a_users_error_in_a_sidecar_arrives_as_its_cause(token_corpus: Path, shm_dir: Path) -> None:
    pipeline = make_pipeline(token_corpus, "none", transforms=[bad_record_7, PAD])
    error = failure(cd.Loader(pipeline, hosts=1, backend=cd.Sidecar(workers=0, shm_dir=str(shm_dir))), cd.errors.TransformError)
    assert "--- raised in the sidecar at " in str(error) and "ValueError: bad record 7" in str(error)
    assert type(error.__cause__) is ValueError and str(error.__cause__) == "bad record 7"
    assert_printed_once(error, "bad_record_7")


def test_a_users_error_in_a_colocated_host_arrives_as_its_cause(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "none", transforms=[bad_record_7, PAD])
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    error = failure(cd.Loader(pipeline, backend=cd.Colocated(), mesh=mesh), cd.errors.TransformError)
    assert "--- raised in the colocated-Python sidecar of host 1 of 2 ---" in str(error)
    assert type(error.__cause__) is ValueError and str(error.__cause__) == "bad record 7"
    assert_printed_once(error, "bad_record_7")


@pytest.mark.parametrize(
    "transform, kind", [(needs_code, NeedsCode), (holds_lock, HoldsLock)], ids=["unpickles-not", "pickles-not"]
)
def test_an_exception_that_cannot_be_rebuilt_is_named_with_its_traceback(
    token_corpus: Path, transform: Callable[[dict], dict], kind: type[Exception]
) -> None:
    """A stand-in takes its place: its text names the type and the message; the traceback shows once."""
    pipeline = make_pipeline(token_corpus, "none", transforms=[transform, PAD])
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    error = failure(cd.Loader(pipeline, backend=cd.Colocated(), mesh=mesh), cd.errors.TransformError)
    cause = error.__cause__
    assert type(cause) is RemoteError and str(cause) == f"{__name__}.{kind.__qualname__}: bad record 7"
    assert_printed_once(error, transform.__name__)
