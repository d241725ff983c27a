"""Backends as option objects: `cd.InProcess`, `cd.Sidecar` and `cd.Colocated` validate
their settings once, when made (numpy integers accepted, bools and other types refused,
each error naming the setting); names still work and stand for the default settings;
`auto_backend()` reads the environment; and a new backend is one class that the
Loader takes as it is."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import colo_data as cd
from colo_data.backends.options import auto_backend
from colo_data.backends.base import GlobalBatch, Transport
from colo_data.backends.options import BackendOptions, resolve
from colo_data.testing import assert_batches_equal, read_all

from pipelines import make_pipeline

KINDS = [cd.InProcess, cd.Sidecar, cd.Colocated]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [0, 3, np.int64(2), np.int32(1), "auto"])
def test_workers_take_counts_of_any_integer_type_or_auto(kind: type, workers: object) -> None:
    made = kind(workers=workers)
    assert made.workers == workers and type(made.workers) is (str if workers == "auto" else int)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [-1, True, False, 1.0, "2", "Auto", None])
def test_other_worker_values_are_a_config_error_naming_the_setting(kind: type, workers: object) -> None:
    with pytest.raises(cd.errors.ConfigError, match=rf"{kind.__name__}\(workers={workers!r}\): give an int >= 0"):
        kind(workers=workers)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"slots": 1}, r"Sidecar\(slots=1\): a sidecar's ring needs at least 2 slots"),
        ({"slots": True}, r"Sidecar\(slots=True\)"),
        ({"slots": 2.0}, r"Sidecar\(slots=2.0\)"),
        ({"timeout": 1}, r"Sidecar\(timeout=1\): must be a number of seconds >= 2"),
        ({"timeout": "20"}, r"Sidecar\(timeout='20'\)"),
        ({"address": ""}, r"Sidecar\(address=''\): give a socket address"),
        ({"address": []}, r"Sidecar\(address=\[\]\)"),
        ({"address": ["unix:///a.sock", 3]}, r"Sidecar\(address=\['unix:///a.sock', 3\]\)"),
        ({"shm_dir": None}, r"Sidecar\(shm_dir=None\): give a directory path"),
    ],
)
def test_sidecar_settings_are_checked_when_made(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(cd.errors.ConfigError, match=match):
        cd.Sidecar(**settings)


def test_option_objects_are_frozen_comparable_and_picklable() -> None:
    sidecar = cd.Sidecar(address=["unix:///run/colo/host0.sock"], slots=np.int64(3), timeout=5)
    assert sidecar.address == ("unix:///run/colo/host0.sock",) and type(sidecar.slots) is int
    assert sidecar == cd.Sidecar(address="unix:///run/colo/host0.sock", slots=3, timeout=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sidecar.slots = 4  # type: ignore[misc]
    for made in (sidecar, cd.InProcess(workers=2), cd.Colocated()):
        assert pickle.loads(pickle.dumps(made)) == made


def test_names_stand_for_the_default_settings(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    for name, default in [("inprocess", cd.InProcess()), ("sidecar", cd.Sidecar()), ("colocated", cd.Colocated())]:
        assert resolve(name) == default and default.name == name
    assert resolve(cd.Sidecar(slots=3)) == cd.Sidecar(slots=3)
    with cd.Loader(pipeline, backend="inprocess") as loader:
        assert loader.backend == cd.InProcess(workers="auto")  # as many as the worker policy counts
    with pytest.raises(cd.errors.ConfigError, match=r"backend='tpu': give cd.InProcess\(...\), cd.Sidecar\(...\) or cd.Colocated"):
        cd.Loader(pipeline, backend="tpu")
    with pytest.raises(cd.errors.ConfigError, match="backend=<class"):
        cd.Loader(pipeline, backend=cd.InProcess)  # type: ignore[arg-type]  # the class, not an object of it


def test_auto_backend_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLO_DATA_SIDECAR", raising=False)
    assert auto_backend() == cd.InProcess()
    monkeypatch.setenv("COLO_DATA_SIDECAR", "unix:///run/colo/a.sock, /run/colo/b.sock")
    assert auto_backend() == cd.Sidecar()
    assert cd.Sidecar().addresses() == ("unix:///run/colo/a.sock", "/run/colo/b.sock")
    assert cd.Sidecar(address="/x.sock").addresses() == ("/x.sock",)  # given beats the environment


def test_addresses_must_match_the_hosts_of_this_process(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = make_pipeline(token_corpus)
    with pytest.raises(cd.errors.ConfigError, match=r"Sidecar\(address=...\): 1 address\(es\), but this process computes 2 host"):
        cd.Loader(pipeline, backend=cd.Sidecar(address="unix:///tmp/x.sock"), hosts=2)
    monkeypatch.setenv("COLO_DATA_SIDECAR", "/a.sock,/b.sock,/c.sock")
    with pytest.raises(cd.errors.ConfigError, match=r"COLO_DATA_SIDECAR='/a.sock,/b.sock,/c.sock': 3 address\(es\)"):
        cd.Loader(pipeline, backend="sidecar", hosts=2)


@dataclass(frozen=True)
class Counting:
    """A backend of its own: the in-process transport, noting each position it opens at."""

    workers: int = 0
    name: ClassVar[str] = "counting"
    ships_to: ClassVar[str | None] = None  # it runs the hosts in the trainer: nothing is pickled
    opened: list[int] = dataclasses.field(default_factory=list, compare=False)

    def host_count(self, mesh: Any, requested: int | None) -> int:
        return 2 if requested is None else requested

    def start(self, pipeline: cd.Pipeline, placement: Any, prefetch: int, owner: Any) -> Transport:
        transport = cd.InProcess(workers=self.workers).start(pipeline, placement, prefetch, owner)
        opened = self.opened

        class Opening:
            name, local_hosts, on_trainer_thread = "counting", transport.local_hosts, transport.on_trainer_thread

            def open(self, position: int, run: Any) -> Iterator[GlobalBatch]:
                opened.append(position)
                return transport.open(position, run)

            def __getattr__(self, attribute: str) -> Any:
                return getattr(transport, attribute)

        return Opening()  # type: ignore[return-value]


def test_a_new_backend_is_one_class(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    counting = Counting()
    assert isinstance(counting, BackendOptions)
    with cd.Loader(pipeline, backend=counting) as loader:
        got = read_all(loader)
        assert loader.hosts == 2 and loader.telemetry().backend == "counting"
    assert counting.opened == [0]
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=2)), got, "a backend of its own")
