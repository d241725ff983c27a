"""Issue 12, finding 4: a sidecar never makes a trainer hang. A frozen sidecar (SIGSTOP)
is a named `SidecarError` within the sidecar timeout (20 s by default; `TIMEOUT_S` here, so
that the suite does not wait out the default), while a pipeline with a batch of twice that
is no error (the sidecar's heartbeat goes on while it works); a second trainer is
told at once that the sidecar serves another; a peer that connects and says nothing does
not hold the door. Real `colo-data sidecar serve` processes, real trainer processes."""

from __future__ import annotations

import os
import signal
import socket as sockets
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

import colo_data as cd

from pipelines import make_pipeline
from test_sidecar_service import serve

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # sidecars cannot import this test module

TESTS = Path(__file__).parent
TIMEOUT_S = 6.0  # the sidecar timeout these tests give (the mechanism is the default's, 20 s)
SLOW_S = 2 * TIMEOUT_S  # longer than the timeout: a batch this slow must not look like a frozen sidecar
TRAINER = """
import sys
sys.path.insert(0, {tests!r})
from absl import flags
flags.FLAGS.mark_as_parsed()
import colo_data as cd
from pipelines import make_pipeline
loader = cd.Loader(make_pipeline({corpus!r}), backend=cd.Sidecar(address="unix://{socket}", timeout={timeout}))
try:
    next(loader)
except cd.errors.SidecarError as e:
    print("SidecarError:", e, flush=True)
    sys.exit(3)
print("took a batch", flush=True)
"""  # a trainer that takes a batch and ends


class SlowSecondChunk:
    """A transform that sleeps `SLOW_S` on its second call in the process that runs it: the
    sidecar computes the stream's first chunk (42 batches) at once and the second one takes
    `SLOW_S`, so a batch in the middle of the stream waits that long. (A marker file the test
    touched later raced the sidecar, which computes chunks ahead as its ring allows.)"""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, columns: dict) -> dict:
        self.calls += 1
        if self.calls == 2:
            time.sleep(SLOW_S)
        return columns


def run_trainer(tmp_path: Path, corpus: Path, socket: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER).format(tests=str(TESTS), corpus=str(corpus), socket=str(socket), timeout=TIMEOUT_S))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    socket = tmp_path / "host0.sock"
    server = serve(socket, shm)
    try:
        yield socket, server
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)


@pytest.mark.serial
def test_a_frozen_sidecar_is_an_error_within_its_timeout_and_a_batch_twice_as_long_is_not(
    token_corpus: Path, tmp_path: Path
) -> None:
    """Side by side: a sidecar stopped with SIGSTOP mid-stream, and one whose pipeline
    takes twice the timeout for a batch in the middle of its stream."""
    frozen_shm, slow_shm = tmp_path / "frozen", tmp_path / "slow"
    frozen_shm.mkdir()
    slow_shm.mkdir()
    slow_pipeline = make_pipeline(token_corpus, epochs=None, transforms=[cd.pad_or_truncate("tokens", 8), SlowSecondChunk()])
    slow_result: dict[str, object] = {}

    def read_through_the_slow_batch() -> None:
        try:
            with cd.Loader(slow_pipeline, backend=cd.Sidecar(shm_dir=str(slow_shm), workers=0, timeout=TIMEOUT_S)) as loader:
                next(loader)
                longest = 0.0
                for _ in range(60):  # the first chunk is 42 batches: the 43rd waits for the slow second
                    started = time.monotonic()
                    next(loader)
                    longest = max(longest, time.monotonic() - started)
                slow_result["longest wait"] = longest
        except BaseException as e:  # handed to the test's thread
            slow_result["error"] = e

    slow = threading.Thread(target=read_through_the_slow_batch)
    slow.start()
    frozen = make_pipeline(token_corpus, epochs=None)
    with cd.Loader(frozen, backend=cd.Sidecar(shm_dir=str(frozen_shm), workers=0, timeout=TIMEOUT_S)) as loader:
        next(loader)
        (_, pid), = loader._runner.backend._targets
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(cd.errors.SidecarError) as raised:
            for _ in range(10_000):  # what the ring and the prefetch hold, then the wait
                next(loader)
        waited = time.monotonic() - stopped
    message = str(raised.value)
    assert waited < TIMEOUT_S + 10, f"a frozen sidecar must be an error within {TIMEOUT_S:g} s, took {waited:.0f} s"
    assert f"sent nothing for {TIMEOUT_S:g} s" in message and f"kill -CONT {pid}" in message, message
    assert not any(frozen_shm.iterdir()), "the frozen sidecar's ring is removed"
    slow.join(SLOW_S + 120)
    assert "error" not in slow_result, f"a {SLOW_S:g} s batch was taken for a frozen sidecar: {slow_result.get('error')}"
    assert slow_result["longest wait"] >= SLOW_S - 2, f"the slow batch never came: {slow_result}"


@pytest.mark.serial
def test_a_sidecar_frozen_before_the_trainer_connects_is_an_error(
    token_corpus: Path, tmp_path: Path, standalone: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    socket, server = standalone
    server.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    done = run_trainer(tmp_path, token_corpus, socket)
    waited = time.monotonic() - started
    assert done.returncode == 3 and "sent nothing for" in done.stdout, done.stdout + done.stderr
    assert waited < 60, f"took {waited:.0f} s (includes the trainer's start)"
    server.send_signal(signal.SIGCONT)
    done = run_trainer(tmp_path, token_corpus, socket)
    assert done.returncode == 0, f"the sidecar serves again once resumed: {done.stdout}{done.stderr}"


def test_a_second_trainer_is_told_the_sidecar_is_busy_and_who_holds_it(
    token_corpus: Path, tmp_path: Path, standalone: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    socket, server = standalone
    first = cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(address=f"unix://{socket}"))
    next(first)  # a session is open
    second = run_trainer(tmp_path, token_corpus, socket)
    assert second.returncode == 3, second.stdout + second.stderr
    assert f"busy serving the trainer with pid {os.getpid()}" in second.stdout, second.stdout
    assert "one trainer session at a time" in second.stdout, second.stdout
    assert len(list(first)) == 9, "the first trainer's session goes on"
    first.close()
    again = run_trainer(tmp_path, token_corpus, socket)
    assert again.returncode == 0, f"served once the first session has ended: {again.stdout}{again.stderr}"
    assert server.poll() is None


def test_a_peer_that_connects_and_says_nothing_does_not_hold_the_door(
    token_corpus: Path, tmp_path: Path, standalone: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    socket, server = standalone
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as silent:
        silent.connect(str(socket))  # and never answers the key challenge
        done = run_trainer(tmp_path, token_corpus, socket)
        assert done.returncode == 0, done.stdout + done.stderr
    assert server.poll() is None


@pytest.mark.parametrize("value", [0, 1.5, -3, True, "20"])
def test_a_sidecar_timeout_below_two_heartbeats_is_a_config_error(value: object) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"Sidecar\(timeout=.*twice the sidecar's heartbeat"):
        cd.Sidecar(timeout=value)  # type: ignore[arg-type]
