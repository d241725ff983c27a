"""Errors that used to come out raw or pointing the wrong way (issue 12, finding 8): each
is now a named colo-data error whose message says what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.testing import read_all

from pipelines import BATCH, make_pipeline

COLO = Path(sys.executable).parent / "colo-data"


@pytest.mark.parametrize("value", [True, False, 2.0, "32"])
def test_a_batch_size_epoch_count_or_seed_must_be_an_integer_not_a_bool(token_corpus: Path, value: object) -> None:
    with pytest.raises(cd.errors.ConfigError, match="global_batch_size"):
        make_pipeline(token_corpus, global_batch_size=value)
    with pytest.raises(cd.errors.ConfigError, match="epochs"):
        make_pipeline(token_corpus, epochs=value)
    with pytest.raises(cd.errors.ConfigError, match="seed"):
        cd.Order(shuffle="global", seed=value)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_and_stored_as_ints(token_corpus: Path) -> None:
    order = cd.Order(shuffle="block", seed=np.uint64(7), window=np.int32(2))  # type: ignore[arg-type]
    pipeline = make_pipeline(token_corpus, global_batch_size=np.int64(BATCH), epochs=np.int64(1), order=order)
    assert type(pipeline.global_batch_size) is int and type(pipeline.epochs) is int
    assert type(order.seed) is int and type(order.window) is int
    pack = cd.Pack("tokens", np.int64(16))
    assert type(pack.length) is int
    with cd.Loader(pipeline) as loader:
        next(loader)
        json.dumps(loader.get_state())  # numpy integers in the state would not serialise


def returns_none(batch: dict) -> None:
    batch["tokens"] = batch["tokens"]  # edits in place and forgets to return


def test_a_transform_that_returns_none_is_named(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, transforms=[returns_none, cd.pad_or_truncate("tokens", 8)])
    with pytest.raises(cd.errors.TransformError, match=r"returns_none.*returned NoneType, not a dict of columns"):
        read_all(cd.Loader(pipeline))


def exits(batch: dict) -> dict:
    sys.exit(5)


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_a_transform_that_calls_sys_exit_is_a_transform_error(token_corpus: Path, tmp_path: Path, backend: str) -> None:
    """A `SystemExit` from a transform would end the trainer (in process) or the sidecar (a
    misleading 'sidecar died'): it is the transform's error, named, and the loader closes."""
    pipeline = make_pipeline(token_corpus, transforms=[exits, cd.pad_or_truncate("tokens", 8)])
    chosen = cd.Sidecar(shm_dir=str(tmp_path), workers=0) if backend == "sidecar" else cd.InProcess()
    with pytest.raises(cd.errors.TransformError, match=r"transform <function exits .*> called sys.exit\(5\) on host 0 of 1"):
        read_all(cd.Loader(pipeline, backend=chosen))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_unreadable_file_is_a_permission_error_not_a_damaged_file(tmp_path: Path) -> None:
    """Root reads any file; without the DAC capabilities (setpriv) a mode-000 file is
    EACCES, as it is for any other user."""
    pq.write_table(pa.table({"x": np.arange(10)}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": np.arange(10)}), tmp_path / "b.parquet")
    (tmp_path / "b.parquet").chmod(0)
    caps = "-dac_override,-dac_read_search"
    script = f"import colo_data as cd\ncd.ArrowSource({str(tmp_path)!r})"
    result = subprocess.run(
        ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "SourceError" in result.stderr and "b.parquet: permission denied" in result.stderr, result.stderr
    assert "rewrite" not in result.stderr.lower(), "the file is not damaged"


def test_one_slot_on_the_sidecar_backend_is_a_config_error() -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"Sidecar\(slots=1\): a sidecar's ring needs at least 2 slots"):
        cd.Sidecar(slots=1)


BROKEN = {
    "raises": "raise RuntimeError('the bucket is not mounted')\n",
    "imports a missing package": "import colo_data_no_such_dependency\n",
    "imports a missing package named like its start": "import broken\n",  # the module is broken_pipes
}
EXPECTED = {
    "raises": "RuntimeError: the bucket is not mounted",
    "imports a missing package": "colo_data_no_such_dependency",
    "imports a missing package named like its start": "No module named 'broken'",
}


COMMANDS = [["doctor"], ["doctor", "--json"], ["verify"], ["bench", "--steps", "2"], ["sidecar", "serve", "--socket", "S"]]


def run_with_broken_config(case: str, command: list[str], directory: Path) -> subprocess.CompletedProcess[str]:
    """`colo-data COMMAND` with a config, in `directory`, whose module fails at import as `case` says."""
    (directory / "broken_pipes.py").write_text(BROKEN[case] + "def pipeline():\n    pass\n")
    config = directory / "broken.toml"
    config.write_text('pipeline = "broken_pipes:pipeline"\n')
    if command[0] == "sidecar":
        args = [str(COLO), *command[:2], str(config), *command[2:]]
    else:
        args = [str(COLO), command[0], str(config), *command[1:]]
    args = [a if a != "S" else str(directory / "s.sock") for a in args]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=directory)


@pytest.fixture(scope="module")
def broken_config_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[str, str], Future]]:
    """The selected (case, command) runs, a process a CPU at a time in the order of their
    tests (each spends its seconds on imports on one CPU): a test waits for its own run
    while the next one runs."""
    runs = [
        (item.callspec.params["case"], item.callspec.params["command"])
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_a_config_module_that_fails_at_import_is_a_clear_error"
        and hasattr(item, "callspec")
    ]
    directories = [tmp_path_factory.mktemp("broken") for _ in runs]
    with ThreadPoolExecutor(max(1, min(4, len(os.sched_getaffinity(0))))) as pool:
        futures = {
            (case, " ".join(command)): pool.submit(run_with_broken_config, case, command, directory)
            for (case, command), directory in zip(runs, directories, strict=True)
        }
        yield futures
        for future in futures.values():
            future.cancel()  # those not started (a run stopped early): the rest finish before the pool closes


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_config_module_that_fails_at_import_is_a_clear_error(
    case: str, command: list[str], broken_config_runs: dict[tuple[str, str], Future], tmp_path: Path
) -> None:
    key = (case, " ".join(command))
    result = broken_config_runs[key].result() if key in broken_config_runs else run_with_broken_config(case, command, tmp_path)
    expected = EXPECTED[case]
    assert result.returncode != 0
    assert "Traceback (most recent call last)" not in result.stderr, result.stderr
    assert "importing module 'broken_pipes' raised" in result.stderr and expected in result.stderr, result.stderr
    assert 'broken_pipes.py", line 1, in <module>' in result.stderr, "the end of its traceback: " + result.stderr
    if "--json" in command:
        assert json.loads(result.stdout)["type"] == "ConfigError", result.stdout
