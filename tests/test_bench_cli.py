"""`colo-data bench` through the installed console script, on the small token corpus: the
report, --json, --plot and --compare grain end to end; bad config values; and a real
Ctrl-C (SIGINT to the whole process group, as a terminal sends it) that leaves no process
and no shared-memory segment behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from colo_data.cli import main
from colo_data.cli.bench import builtin_config
from colo_data.config import load_config

COLO = Path(sys.executable).parent / "colo-data"
ROOT = Path(__file__).resolve().parents[1]


def config(tmp_path: Path, corpus: Path, sidecar: str = "", **args: object) -> Path:
    """A config for the demo pipeline over `corpus` (10 batches an epoch), 3 epochs."""
    values = {"data_dir": str(corpus), "seq_len": 8, "global_batch_size": 12, "epochs": 3, **args}
    lines = ['pipeline = "colo_data.demo:pipeline"', "[args]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]
    path = tmp_path / "bench.toml"
    path.write_text("\n".join([*lines, *(["[sidecar]", sidecar] if sidecar else [])]) + "\n")
    return path


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(COLO), "bench", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


BAD_VALUES = {  # the key the error names: the config's [sidecar] lines, its [args]
    "shuffle": ("", {"shuffle": "sideways"}),
    "global_batch_size": ("", {"global_batch_size": 0}),
    "workers": ('workers = "many"', {}),
    "slots": ("slots = 1", {}),
}


def bench_args(test: str, directory: Path, corpus: Path) -> list[str]:
    """The `colo-data bench` arguments of `test` (a test's name below), its files in `directory`."""
    if test == "test_bench_end_to_end_with_json_plot_and_grain":
        outputs = ["--json", str(directory / "report.json"), "--plot", str(directory / "report.png")]
        return [str(config(directory, corpus)), "--warmup", "3", "--step-time", "1", "--compare", "grain", *outputs]
    if test == "test_bench_with_no_step_reports_capacity_not_a_verdict":
        return [str(config(directory, corpus)), "--warmup", "3"]
    sidecar, args = BAD_VALUES[test.removeprefix("test_bad_config_values_are_one_error_line[").removesuffix("]")]
    return [str(config(directory, corpus, sidecar, **args)), "--steps", "2"]


@pytest.fixture(scope="module")
def bench_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, token_corpus: Path
) -> Iterator[dict[str, Future[tuple[subprocess.CompletedProcess[str], Path]]]]:
    """The bench runs of the selected tests that only read a run's output, a process a CPU at
    a time in the order of their tests (each spends seconds importing JAX, and Grain, on one
    CPU): a test waits for its own run while the next one runs. The Ctrl-C test runs alone."""

    def run(test: str, directory: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
        return bench(*bench_args(test, directory, token_corpus)), directory

    tests = [item.name for item in request.session.items if item.path == request.path and "ctrl_c" not in item.name]
    tests = [t for t in tests if t.startswith(("test_bench_end_to_end", "test_bench_with_no_step", "test_bad_config_values"))]
    directories = [tmp_path_factory.mktemp("bench") for _ in tests]
    with ThreadPoolExecutor(max(1, min(4, len(os.sched_getaffinity(0))))) as pool:
        futures = {test: pool.submit(run, test, directory) for test, directory in zip(tests, directories, strict=True)}
        yield futures
        for future in futures.values():
            future.cancel()  # those not started (a run stopped early): the rest finish before the pool closes


def bench_run(
    request: pytest.FixtureRequest, runs: dict, corpus: Path, directory: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """This test's bench run: started by `bench_runs`, or here when that did not start it."""
    test = request.node.name
    return runs[test].result() if test in runs else (bench(*bench_args(test, directory, corpus)), directory)


def test_bench_end_to_end_with_json_plot_and_grain(
    request: pytest.FixtureRequest, bench_runs: dict, token_corpus: Path, tmp_path: Path
) -> None:
    run, directory = bench_run(request, bench_runs, token_corpus, tmp_path)
    out_json, out_png = directory / "report.json", directory / "report.png"
    assert run.returncode == 0, run.stderr
    for text in ("records/s", "input wait, share of wall time", "wait p50 / p90 / p99 (ms)", "transform", "hand-off", "CPU budget", "verdict: "):
        assert text in run.stdout, text
    assert "Grain" in run.stdout and "ratio" in run.stdout
    assert "no training step was simulated" not in run.stdout  # a step was: the verdict answers
    report = json.loads(out_json.read_text())
    assert report["colo-data"]["steps"] == 30 and report["grain"]["steps"] == 30  # 3 epochs of 10 batches
    assert report["colo-data"]["steady"]["steps"] == 27 and report["ratio_records_per_s"] > 0
    assert report["colo-data"]["verdict"] and report["settings"]["step_time_ms"] == 1
    assert {s["name"] for s in report["colo-data"]["hosts"][0]["stages"]} >= {"order", "read", "transform", "batch"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_no_step_reports_capacity_not_a_verdict(
    request: pytest.FixtureRequest, bench_runs: dict, token_corpus: Path, tmp_path: Path
) -> None:
    """With no simulated step every loader waits for input all the time: the report says so
    and gives the pipeline's capacity and what limits it, not "input-bound"."""
    run, _ = bench_run(request, bench_runs, token_corpus, tmp_path)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "no training step was simulated" in out and "verdict: " not in out and "input-bound" not in out, out
    capacity = re.search(r"capacity: ([\d,]+) records/s, ([\d,.]+) batches/s \(one every ([\d.]+) ms\): a training step", out)
    assert capacity, out
    records, batches, every = (float(g.replace(",", "")) for g in capacity.groups())
    assert records > 0 and batches > 0 and every == pytest.approx(1000 / batches, abs=0.006)  # both printed rounded
    assert re.search(r"what limits it: the (order|read|transform|batch|hand-off) stage; the host's own thread", out), out
    assert "add --step-time MS" in out
    # workers="auto" in process (its default): the header says so, the host says who computes its batches now
    # (for a light pipeline, its own thread), and the worker policy's sentence why, and the bound
    assert "workers auto, 30 steps, warm-up 3 steps" in out.splitlines()[0], out  # 3 epochs of 10
    assert re.search(r"^host 0: trainer process; (the host's own thread|\d+ worker process)", out, re.MULTILINE), out
    assert re.search(r"^  (no workers|\d+ workers?)\b.*$", out, re.MULTILINE), out
    assert re.search(r"^  at most: auto: up to \d+ \(16 a CPU of the budget", out, re.MULTILINE), out
    steps = [line for line in out.splitlines() if line.startswith("next: ")]
    assert len(steps) <= 1 and all("Ray" not in s for s in steps if len(os.sched_getaffinity(0)) >= 2), steps


def test_a_pipeline_that_repeats_forever_runs_a_set_count_of_steps(token_corpus: Path) -> None:
    """Without --steps: one pass over a finite pipeline's epochs, `ENDLESS_STEPS` of one that
    repeats forever (it was an error), to the end of a Grain one; --steps wins over each."""
    from pipelines import BATCH, make_pipeline

    import colo_data as cd
    from colo_data.bench.runs import ENDLESS_STEPS, steps_to_run

    finite = make_pipeline(token_corpus, epochs=2)
    assert steps_to_run(finite, None) == finite.batches_from(0) == 2 * (len(finite.source) // BATCH)
    assert steps_to_run(make_pipeline(token_corpus, epochs=None), None) == ENDLESS_STEPS == 500
    assert steps_to_run(make_pipeline(token_corpus, epochs=None), 7) == 7
    grain = cd.GrainPipeline(make_dataset=lambda shard: None, global_batch_size=BATCH)
    assert steps_to_run(grain, None) is None


@pytest.mark.parametrize("key", BAD_VALUES)
def test_bad_config_values_are_one_error_line(
    request: pytest.FixtureRequest, bench_runs: dict, token_corpus: Path, tmp_path: Path, key: str
) -> None:
    run, _ = bench_run(request, bench_runs, token_corpus, tmp_path)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error")]  # not a library's import warning
    assert len(errors) == 1 and errors[0].startswith("Error: ") and key in errors[0], run.stderr
    assert "Traceback" not in run.stderr


def test_a_config_module_that_raises_at_import_shows_the_end_of_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: bench printed "the end of its traceback:" and then nothing. It shows the
    user's frames (not importlib's) and the error, as verify and doctor do."""
    (tmp_path / "bench_broken_at_import.py").write_text("def load():\n    raise OSError('no bucket')\n\nload()\n")
    (tmp_path / "broken.toml").write_text('pipeline = "bench_broken_at_import:pipeline"\n')
    monkeypatch.chdir(tmp_path)  # where the config's module is imported from
    result = CliRunner().invoke(main, ["bench", "broken.toml", "--steps", "1"])
    assert result.exit_code == 1, result.output
    end = result.stderr.split("the end of its traceback:\n", 1)[1].splitlines()
    assert [line.strip() for line in end] == [
        f'File "{tmp_path}/bench_broken_at_import.py", line 4, in <module>', "load()",
        f'File "{tmp_path}/bench_broken_at_import.py", line 2, in load', "raise OSError('no bucket')",
        "OSError: no bucket",
    ], result.stderr


def test_the_built_in_config_is_configs_demo_toml() -> None:
    builtin, on_disk = builtin_config(), load_config(ROOT / "configs" / "demo.toml")
    assert (builtin.pipeline, builtin.args, builtin.sidecar) == (on_disk.pipeline, on_disk.args, on_disk.sidecar)


def test_ctrl_c_stops_cleanly(token_corpus: Path, tmp_path: Path) -> None:
    shm = Path(tempfile.mkdtemp(prefix="ring-test-", dir="/dev/shm"))
    try:
        path = config(tmp_path, token_corpus, f"shm_dir = {json.dumps(str(shm))}", epochs=1000)
        process = subprocess.Popen(
            [str(COLO), "bench", str(path), "--backend", "sidecar", "--step-time", "20", "--steps", "100000"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while not any(shm.iterdir()):  # the ring exists: the sidecar serves batches
            assert process.poll() is None and time.monotonic() < deadline, "bench never started serving"
            time.sleep(0.1)
        time.sleep(1.0)
        started = psutil.Process(process.pid).children(recursive=True)
        assert started, "no sidecar process"
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, err = process.communicate(timeout=60)
        assert process.returncode == 128 + signal.SIGINT, err
        assert "interrupted (Ctrl-C): partial report after" in out and "verdict: " in out, out + err
        assert "Traceback" not in err, err
        gone, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert sorted(p.name for p in shm.iterdir()) == []
    finally:
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()
