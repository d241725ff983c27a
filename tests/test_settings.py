"""Integer settings (issue 26): one check for every count a user gives. Numpy integers are
accepted and stored as Python ints; `True`, floats and strings are a `ConfigError` that
names the setting and the value (`hosts=2.0` was a raw TypeError, `True` was taken for 1,
and `prefetch=np.int64(1)` was refused)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipelines import BATCH, make_pipeline

import colo_data as cd

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

LOADER_SETTINGS = [("hosts", True), ("hosts", 2.0), ("hosts", "2"), ("hosts", 0), ("prefetch", True), ("warmup", True)]
SOURCE_SETTINGS = ["cache_bytes", "io_concurrency", "retries"]


@pytest.mark.parametrize(("setting", "value"), LOADER_SETTINGS, ids=lambda v: repr(v))
def test_a_loader_setting_that_is_not_an_int_is_a_config_error_naming_it(
    token_corpus: Path, setting: str, value: object
) -> None:
    """A bool, a float, a string or a count below the least is refused before anything starts."""
    with pytest.raises(cd.errors.ConfigError, match=rf"^{setting}={value!r}: give an int >= [01] \("):
        cd.Loader(make_pipeline(token_corpus), **{setting: value})  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_as_loader_settings(token_corpus: Path) -> None:
    """Taken as Python ints: the loader's options and state serialise."""
    pipeline = make_pipeline(token_corpus)
    backend = cd.InProcess(workers=np.int64(0))  # type: ignore[arg-type]
    with cd.Loader(pipeline, backend=backend, hosts=np.int64(2), prefetch=np.int64(1), warmup=np.uint8(0)) as loader:  # type: ignore[arg-type]
        assert np.asarray(next(loader)["_index"]).shape == (BATCH,)
        assert loader.hosts == 2 and type(loader.hosts) is int
        assert all(type(loader.options[name]) is int for name in ("hosts", "prefetch", "warmup")), loader.options
        json.dumps(loader.get_state())


@pytest.mark.parametrize("setting", SOURCE_SETTINGS)
def test_an_arrow_source_setting_that_is_a_bool_is_a_config_error(token_corpus: Path, setting: str) -> None:
    """`True` is not a count of bytes, reads or retries."""
    with pytest.raises(cd.errors.ConfigError, match=rf"^{setting}=True: give an int >= [01] \("):
        cd.ArrowSource(str(token_corpus), **{setting: True})  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_as_arrow_source_settings(token_corpus: Path) -> None:
    """A numpy integer is a count like any other."""
    source = cd.ArrowSource(str(token_corpus), **{name: np.int64(3) for name in SOURCE_SETTINGS})  # type: ignore[arg-type]
    assert source.take([0, 1]).num_rows == 2


def test_a_pad_length_is_an_int_not_a_bool() -> None:
    """`pad_or_truncate`'s length: `True` is refused, a numpy integer is stored as an int."""
    with pytest.raises(cd.errors.TransformError, match=r"length=True\): length must be an int >= 1"):
        cd.pad_or_truncate("tokens", True)
    padded = cd.pad_or_truncate("tokens", np.int64(4))  # type: ignore[arg-type]
    assert type(padded.length) is int
    assert padded({"tokens": np.arange(6).reshape(2, 3)})["tokens"].shape == (2, 4)
