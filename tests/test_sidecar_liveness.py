"""Issue 12, finding 4: a sidecar never makes a trainer hang. A frozen sidecar (SIGSTOP)
is a named `SidecarError` within the sidecar timeout (20 s by default; `TIMEOUT_S` here, so
that the suite does not wait out the default), while a pipeline with a batch of twice that
is no error (the sidecar's heartbeat goes on while it works); a second trainer is
told at once that the sidecar serves another, and so is each of several that come together
(trust round 6, item 3), or told it is busy when the socket's queue is full; a peer that
connects and says nothing, or answers the key challenge a byte at a time (item 4), does
not hold the door. Real `colo-data sidecar serve` processes, real trainer processes, raw
sockets for the peers."""

from __future__ import annotations

import os
import select
import signal
import socket as sockets
import struct
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
from colo_data.backends.sidecar.client import SidecarClient

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
    script.write_text(
        textwrap.dedent(TRAINER).format(tests=str(TESTS), corpus=str(corpus), socket=str(socket), timeout=TIMEOUT_S)
    )
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
        ((_, pid),) = loader._runner.transport._targets
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


HANG_S = 60.0  # the hang detector of the tests below: far beyond any wait they expect


def test_trainers_that_arrive_together_are_each_told_the_sidecar_is_busy(
    token_corpus: Path, standalone: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    """Trust round 6, item 3: six trainers connecting at once to a sidecar that serves one.
    With a backlog of one, three were refused by the socket (EAGAIN) and told at once that
    the sidecar had sent nothing for the timeout; each must be told it is busy."""
    socket, server = standalone
    first = cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(address=f"unix://{socket}", timeout=HANG_S))
    next(first)  # a session is open
    together = threading.Barrier(6)
    outcomes: list[BaseException | None] = [None] * 6

    def arrive(i: int) -> None:
        together.wait()
        try:
            SidecarClient(f"unix://{socket}", timeout=HANG_S).close()
        except BaseException as e:  # handed to the test's thread
            outcomes[i] = e

    arrivals = [threading.Thread(target=arrive, args=(i,)) for i in range(6)]
    for thread in arrivals:
        thread.start()
    for thread in arrivals:
        thread.join(HANG_S + 120)
    assert not any(thread.is_alive() for thread in arrivals), "a trainer still waits to be let in"
    for i, outcome in enumerate(outcomes):
        assert isinstance(outcome, cd.errors.SidecarError), f"trainer {i}: {outcome!r}"
        assert f"busy serving the trainer with pid {os.getpid()}" in str(outcome), f"trainer {i}: {outcome}"
    assert len(list(first)) == 9, "the first trainer's session goes on"
    first.close()
    assert server.poll() is None


def test_a_trainer_that_finds_the_sidecars_queue_full_is_told_so_not_that_it_hung(
    token_corpus: Path, standalone: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    """A sidecar whose queue of connections waiting to be let in is full (filled by raw
    connections while it is stopped, so that it lets none in) refuses a connection with
    EAGAIN: the trainer waits for room up to its connect timeout, then is told the sidecar is
    busy, not that it sent nothing."""
    socket, server = standalone
    server.send_signal(signal.SIGSTOP)
    queued: list[sockets.socket] = []
    try:
        for _ in range(10_000):
            peer = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            peer.setblocking(False)
            if peer.connect_ex(str(socket)) != 0:  # EAGAIN: the queue is full
                peer.close()
                break
            queued.append(peer)
        else:
            pytest.fail("the sidecar's queue took 10,000 connections")
        with pytest.raises(cd.errors.SidecarError) as raised:
            SidecarClient(f"unix://{socket}", connect_timeout=2, timeout=HANG_S)
        message = str(raised.value)
        assert f"the sidecar at unix://{socket} is busy" in message and "queue" in message, message
        assert "sent nothing" not in message, message
    finally:
        for peer in queued:
            peer.close()
        server.send_signal(signal.SIGCONT)
    with cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(address=f"unix://{socket}", timeout=HANG_S)) as loader:
        assert len(list(loader)) == 10, "served once the queue has room"
    assert server.poll() is None


def test_a_peer_that_answers_the_challenge_a_byte_at_a_time_does_not_hold_the_door(
    token_corpus: Path, standalone: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    """Trust round 6, item 4: a peer without the key that answers the key challenge one
    byte a second (inside the limit on each read) held the sidecar's one door; a trainer that
    came next waited until it was told that the sidecar had hung. The trainer is served while
    that peer is still connected, and the peer is dropped before it has sent its answer."""
    socket, server = standalone
    answer = struct.pack("!i", 64) + b"x" * 64  # a well-framed answer, a byte a second: over a minute
    challenged, dropped = threading.Event(), threading.Event()
    sent = [0]

    def trickle() -> None:
        with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as peer:
            peer.connect(str(socket))
            (size,) = struct.unpack("!i", peer.recv(4, sockets.MSG_WAITALL))
            peer.recv(size, sockets.MSG_WAITALL)  # the sidecar's challenge: the door is busy with this peer
            challenged.set()
            try:
                for byte in answer:
                    peer.send(bytes([byte]))
                    sent[0] += 1
                    if select.select([peer], [], [], 1.0)[0] and not peer.recv(1):  # the sidecar hung up
                        dropped.set()
                        return
            except OSError:  # the sidecar hung up mid-send
                dropped.set()

    peer = threading.Thread(target=trickle)
    peer.start()
    try:
        assert challenged.wait(HANG_S), "the sidecar never challenged the peer"
        trainer = SidecarClient(f"unix://{socket}", timeout=HANG_S)  # let in
        assert not dropped.is_set(), "the trainer was let in only once the slow peer was gone"
        batches = trainer.batches(make_pipeline(token_corpus), 0, 1, 0, copy=True)
        try:
            assert next(batches).columns, "the trainer is served"
        finally:
            batches.close()  # ends the session and the connection
    finally:
        peer.join(len(answer) * 2 + HANG_S)
    assert dropped.is_set() and sent[0] < len(answer), f"the peer sent {sent[0]} of {len(answer)} bytes and was not dropped"
    assert server.poll() is None
    server.terminate()
    _, err = server.communicate(timeout=30)
    assert b"Traceback" not in err and b"refused a connection" not in err, err.decode()  # dropped quietly, as a silent peer
