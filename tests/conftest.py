"""Shared fixtures. JAX gets 4 CPU devices (set before JAX starts) so that meshes with a
real data axis exist on a CPU-only machine. `make test` runs the tests in 2 processes
(pytest-xdist, a module to a process); a test marked `serial` runs while no other test does."""

import os
import shutil
import tempfile
from collections.abc import Iterator

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()

from colo_data import demo  # noqa: E402


@pytest.fixture(scope="session")
def token_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small demo-like corpus: 3 Parquet files of 40 rows, row groups of 7 (uneven: the
    last group of each file is short), token lists of 1..12 items, ids = global indices."""
    return demo.write_corpus(
        tmp_path_factory.mktemp("tokens"), files=3, rows_per_file=40, row_group_size=7, min_tokens=1, max_tokens=12
    )


@pytest.fixture(scope="session")
def mix_corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small token corpus per component of the mixture tests (`MIX_SIZES` records; ids =
    the record's index in its component)."""
    from pipelines import MIX_SIZES

    root = tmp_path_factory.mktemp("mix")
    return {
        name: demo.write_corpus(root / name, files=1, rows_per_file=rows, row_group_size=5, min_tokens=1, max_tokens=6)
        for name, rows in MIX_SIZES.items()
    }


def pytest_configure(config: pytest.Config) -> None:
    """The run's directory, shared by its test processes (pytest-xdist's workers inherit the
    environment of the process that starts them): the locks of `serial` tests, the image
    build, and each test process's Ray directory (`RAY_TMPDIR`: a `ray.init()` connects to
    the cluster last started in its directory, so each process has its own)."""
    config.addinivalue_line("markers", "serial: runs while no other test does (it reads the machine's state or its timing)")
    config.addinivalue_line("markers", "unit: the fast tier (`make test-fast`): in this process, seconds a module")
    if not hasattr(config, "workerinput"):
        os.environ["COLO_DATA_TEST_RUN"] = tempfile.mkdtemp(prefix="colo-data-run-")
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    os.environ["RAY_TMPDIR"] = os.path.join(os.environ["COLO_DATA_TEST_RUN"], worker)  # short: Ray's sockets live below
    os.makedirs(os.environ["RAY_TMPDIR"])


@pytest.fixture(autouse=True)
def serial_tests_run_alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked `serial` holds the run's lock alone, the others share it (`run_lock`):
    with the test processes of `make test`, a serial test waits for the test now running
    elsewhere, and no other starts until it ends."""
    from run_lock import held

    with held(alone=request.node.get_closest_marker("serial") is not None):
        yield


@pytest.fixture
def own_cpu_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU budget given as COLO_DATA_CPUS, a hundredth of a CPU under the affinity mask:
    a host pipeline then counts only the CPU its own process tree uses against the budget
    (not the whole machine's), so that other work on the machine (the container build these
    tests start in the background, a neighbour's job) does not keep its workers from
    starting. For the tests that need worker processes at work."""
    monkeypatch.setenv("COLO_DATA_CPUS", f"{len(os.sched_getaffinity(0)) - 0.01:g}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m unit` (`make test-fast`) a module outside the unit tier is not even
    imported: collecting the whole suite imports Ray, Orbax and the rest, and would start
    the container image's build, which the run would then wait for."""
    if config.getoption("markexpr") != "unit" or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    return "pytest.mark.unit" not in collection_path.read_text()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The container tests run last, and their image is built by a detached process from
    now on (by the first test process to get here), so that its minutes of downloads and
    unpacking overlap the other tests."""
    containers = [item for item in items if item.path.name == "test_container.py"]
    if containers:
        items[:] = [item for item in items if item.path.name != "test_container.py"] + containers
        import container

        container.start_build()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Once every test process is done (in the one that started them): the image build and
    the run's directory are removed."""
    if hasattr(session.config, "workerinput"):
        return
    import container

    try:
        container.finish_build()
    finally:
        shutil.rmtree(os.environ["COLO_DATA_TEST_RUN"], ignore_errors=True)
