"""Shared fixtures. JAX gets 4 CPU devices (set before JAX starts) so that meshes with a
real data axis exist on a CPU-only machine."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()

from colo_data.ops import demo  # noqa: E402


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


@pytest.fixture
def own_cpu_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU budget given as COLO_DATA_CPUS, a hundredth of a CPU under the affinity mask:
    a host pipeline then counts only the CPU its own process tree uses against the budget
    (not the whole machine's), so that other work on the machine (the container build these
    tests start in the background, a neighbour's job) does not keep its workers from
    starting. For the tests that need worker processes at work."""
    monkeypatch.setenv("COLO_DATA_CPUS", f"{len(os.sched_getaffinity(0)) - 0.01:g}")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The container tests run last, and their image is built by a detached process from
    now on, so that its minutes of downloads and unpacking overlap the other tests."""
    containers = [item for item in items if item.path.name == "test_container.py"]
    if containers:
        items[:] = [item for item in items if item.path.name != "test_container.py"] + containers
        import container

        container.start_build()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import container

    container.finish_build()
