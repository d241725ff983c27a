"""examples/train_lm.py, a real training job: 40 steps straight through, and the same job
stopped by SIGTERM near step 20 and run again, give the same 40 losses, bitwise, in process
and through a sidecar (whose batches are the in-process ones: the same losses too).

Bitwise holds on CPU: the resumed job compiles the same train step for the same shapes and
shardings, restores the same float32 model and optimizer state from Orbax, and is fed the
same batches from the restored loader state; XLA's CPU kernels are deterministic for a
fixed program on one machine."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
STEPS = 40
STOP_AT = 20  # SIGTERM once the log holds this step
SMALL = ["--seq-len", "64", "--batch-size", "4", "--save-every", "10"]  # the default model, at a shorter row
ARGS = [sys.executable, "-m", "colo_data.cli"]  # `colo-data`, from this interpreter
WAIT_S = 300  # for a job of 40 small steps: a bound on a hang, not a timing


def command(directory: Path, backend: str) -> list[str]:
    """The job, its checkpoints and log in `directory`."""
    return [
        sys.executable, str(SCRIPT), "--steps", str(STEPS), "--checkpoint-dir", str(directory / "checkpoints"),
        "--log", str(directory / "log.jsonl"), "--backend", backend, *SMALL,
    ]  # fmt: skip


def logged(directory: Path) -> list[dict[str, float]]:
    """The job's log lines so far."""
    path = directory / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_to_end(directory: Path, backend: str) -> subprocess.CompletedProcess[str]:
    """The job, run until it ends by itself."""
    done = subprocess.run(command(directory, backend), capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def stopped_near(directory: Path, backend: str, step: int) -> int:
    """The job, sent SIGTERM once its log holds `step`; the step its log ends at."""
    job = subprocess.Popen(command(directory, backend), stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + WAIT_S
        while len(logged(directory)) < step:
            assert job.poll() is None, f"the job ended before step {step}: {job.stderr.read()[-3000:] if job.stderr else ''}"
            assert time.monotonic() < deadline, f"no step {step} in {WAIT_S} s"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=WAIT_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, f"SIGTERM: exit {job.returncode}, not 0: {err[-3000:]}"
    last = logged(directory)[-1]["step"]
    assert "saved: run again to resume" in err and f"at step {last}" in err, err[-3000:]
    return int(last)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 steps in one go, in process: the run's directory (checkpoints, log)."""
    directory = tmp_path_factory.mktemp("straight")
    done = run_to_end(directory, "inprocess")
    (directory / "stdout.txt").write_text(done.stdout)
    (directory / "stderr.txt").write_text(done.stderr)
    return directory


@pytest.fixture(scope="module")
def straight(straight_run: Path) -> list[dict[str, float]]:
    """The straight run's log."""
    return logged(straight_run)


def test_forty_steps_log_a_line_each_and_learn(straight: list[dict[str, float]]) -> None:
    """A line a step, with the loss, the input wait and the fill; the loss falls."""
    assert [line["step"] for line in straight] == list(range(1, STEPS + 1))
    assert all({"loss", "input_wait_s", "step_s", "fill"} <= line.keys() for line in straight)
    assert all(line["input_wait_s"] >= 0 and 0 < line["fill"] <= 1 for line in straight)
    first, last = straight[0]["loss"], straight[-1]["loss"]
    assert last < 0.7 * first, f"the loss went from {first} to {last} in {STEPS} steps: the model did not learn"


def test_it_prints_a_mean_loss_that_falls_no_blank_line_and_how_to_go_on(straight_run: Path) -> None:
    """A line every 20 steps with the smoothed loss, which falls (one step's loss is too
    noisy to tell); no blank line on either stream; at the end, where the checkpoints
    went and the command that trains on from them."""
    out, err = ((straight_run / name).read_text().splitlines() for name in ("stdout.txt", "stderr.txt"))
    assert all(line.strip() for line in out + err), f"a blank line: {out + err}"
    means = [float(m.group(1)) for line in out if (m := re.match(r"step \d+/\d+: loss ([0-9.]+) \(smoothed\), input wait", line))]
    assert len(means) == STEPS // 20 and means[-1] < means[0], out
    assert (
        out[-2]
        == f"trained {STEPS} steps; checkpoints in {straight_run / 'checkpoints'}, a line a step in {straight_run / 'log.jsonl'}"
    )
    again = f"to train on from step {STEPS}: python examples/train_lm.py --steps {2 * STEPS} "
    assert out[-1].startswith(again) and f"--checkpoint-dir {straight_run / 'checkpoints'}" in out[-1], out[-1]


def test_a_finished_run_run_again_says_there_is_nothing_to_do(straight_run: Path, tmp_path: Path) -> None:
    """The job run again once it has trained its steps (a second `make train`): exit 0, no
    step trained or logged, and it says so and what to do instead (it said only "resumed at
    step 40")."""
    import shutil

    shutil.copytree(straight_run, tmp_path / "run")
    again = run_to_end(tmp_path / "run", "inprocess")
    assert f"nothing to do: the run already trained its {STEPS} steps" in again.stderr, again.stderr[-3000:]
    assert "--steps N" in again.stderr and "to start over" in again.stderr, again.stderr[-3000:]
    assert len(logged(tmp_path / "run")) == STEPS and not again.stdout, again.stdout


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_stopped_by_sigterm_and_run_again_gives_the_same_losses(
    straight: list[dict[str, float]], backend: str, tmp_path: Path
) -> None:
    """SIGTERM near step 20: exit 0 after a save at that step; run again: steps 21 to 40, and
    the straight run's 40 losses, bitwise."""
    saved = stopped_near(tmp_path, backend, STOP_AT)
    assert STOP_AT <= saved < STEPS, f"stopped at step {saved}"
    again = run_to_end(tmp_path, backend)
    assert f"resumed at step {saved}" in again.stderr
    resumed = logged(tmp_path)
    assert [line["step"] for line in resumed] == list(range(1, STEPS + 1)), "a step missing or done twice"
    assert [line["loss"] for line in resumed] == [line["loss"] for line in straight]


def test_lineage_of_the_steps_after_a_checkpoint_names_what_the_job_read(straight_run: Path) -> None:
    """`colo-data lineage configs/lm.toml` with the job's checkpoint at step 30 (its row
    length and batch size given as --arg): steps 30 and 31, row by row, segment by segment,
    are the records a loader restored from that checkpoint reads next."""
    import colo_data as cd
    from colo_data.config import load_config
    from colo_data.testing import to_numpy

    settings = load_config(ROOT / "configs" / "lm.toml")
    pipeline = dataclasses.replace(settings, args={**settings.args, "seq_len": 64, "global_batch_size": 4}).build()
    state = json.loads((straight_run / "checkpoints" / "30" / "data" / "loader_state.json").read_text())
    with cd.Loader(pipeline, state=state) as loader:
        batches = [to_numpy(next(loader)) for _ in range(2)]
    lineage = [
        *ARGS, "lineage", str(ROOT / "configs" / "lm.toml"), "--state", str(straight_run / "checkpoints" / "30"),
        "--arg", "seq_len=64", "--arg", "global_batch_size=4",
    ]  # fmt: skip
    done = subprocess.run([*lineage, "--steps", "30:32", "--json"], capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in done.stdout.splitlines()]
    assert [step["step"] for step in steps] == [30, 31]
    names = pipeline.stream.names
    for step, batch in zip(steps, batches, strict=True):
        read = [
            [(names[c], int(i)) for c, i in zip(components, row, strict=True) if i >= 0]
            for components, row in zip(batch["_component"], batch["_index"], strict=True)
        ]
        assert [[(o["component"], o["index"]) for o in row] for row in step["rows"]] == read
        assert all(o["file"].endswith(".parquet") and o["row"] >= 0 for row in step["rows"] for o in row)
    table = subprocess.run([*lineage, "--steps", "30"], capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT)
    assert table.returncode == 0, table.stderr[-3000:]
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["step", "row", "segment", "component", "file", "file", "row", "index"]
    assert len(lines) == 1 + sum(len(row) for row in steps[0]["rows"])
