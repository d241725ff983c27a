"""A standalone sidecar (`colo-data sidecar serve`) as a service: it outlives every way a
trainer's session can end and goes back to listening, and it restarts on the socket of a
sidecar that was killed. Real `colo-data sidecar serve` processes and real trainer
processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import colo_data as cd
from colo_data.backends.sidecar.auth import connect, read_key
from colo_data.runtime.child_env import process_settings
from colo_data.testing import assert_batches_equal, read_all

from leftovers import left_behind
from pipelines import idle_host, make_pipeline, until_workers_made

COLO = Path(sys.executable).parent / "colo-data"
TESTS = Path(__file__).parent

TRAINER = """
import sys, time
sys.path.insert(0, {tests!r})
from absl import flags
flags.FLAGS.mark_as_parsed()
import colo_data as cd
from pipelines import make_pipeline
loader = cd.Loader(make_pipeline({corpus!r}, epochs=None), backend=cd.Sidecar(address="unix://{socket}"))
for _ in range(int(sys.argv[1])):
    next(loader)
print("took", sys.argv[1], flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""  # a trainer that takes N batches and then ends without close(), or waits to be killed


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


def serve(socket: Path, shm_dir: Path) -> subprocess.Popen[bytes]:
    """`colo-data sidecar serve` on `socket`, returned once it listens (its banner comes
    after it has bound the socket)."""
    server = subprocess.Popen(
        [str(COLO), "sidecar", "serve", "--socket", str(socket), "--shm-dir", str(shm_dir), "--workers", "0"],
        stderr=subprocess.PIPE,
    )
    banner = server.stderr.readline().decode()
    assert banner.startswith(f"colo-data sidecar on {socket}"), banner + server.stderr.read().decode()
    assert "workers: none configured (workers=0)" in banner, banner
    return server


@pytest.fixture
def sidecar(tmp_path: Path, shm_dir: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    socket = tmp_path / "host0.sock"
    server = serve(socket, shm_dir)
    try:
        yield socket, server
    finally:
        server.kill()
        server.wait(10)


def trainer(tmp_path: Path, corpus: Path, socket: Path, batches: int, then: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER).format(tests=str(TESTS), corpus=str(corpus), socket=str(socket)))
    return subprocess.Popen(
        [sys.executable, str(script), str(batches), then], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def assert_serves(socket: Path, corpus: Path, what: str) -> None:
    pipeline = make_pipeline(corpus)
    expected = read_all(cd.Loader(pipeline))
    assert_batches_equal(expected, read_all(cd.Loader(pipeline, backend=cd.Sidecar(address=f"unix://{socket}"))), what)


def test_the_sidecar_outlives_trainers_that_end_without_close_or_are_killed(
    tmp_path: Path, token_corpus: Path, shm_dir: Path, sidecar: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    socket, server = sidecar
    for batches in (1, 60):  # a script that ends after one batch, and after many
        done = trainer(tmp_path, token_corpus, socket, batches, "exit")
        out, err = done.communicate(timeout=120)
        assert done.returncode == 0 and out.split() == [b"took", str(batches).encode()], err.decode()
        assert server.poll() is None, f"the sidecar died with its trainer: {server.stderr.read().decode()}"
    killed = trainer(tmp_path, token_corpus, socket, 3, "wait")
    assert killed.stdout.readline().split() == [b"took", b"3"]
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    assert_serves(socket, token_corpus, "after trainers that left without close(), one of them killed")
    assert server.poll() is None, server.stderr.read().decode()
    deadline = time.monotonic() + 10
    while any(shm_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(shm_dir.iterdir()), "every session's ring is removed when it ends"


def test_a_sidecar_restarts_on_the_socket_of_a_killed_one(tmp_path: Path, token_corpus: Path, shm_dir: Path) -> None:
    socket = tmp_path / "host0.sock"
    first = serve(socket, shm_dir)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert socket.exists(), "a killed sidecar leaves its socket file"
    second = serve(socket, shm_dir)
    try:
        assert_serves(socket, token_corpus, "a sidecar started on a dead sidecar's socket")
    finally:
        second.terminate()
        second.wait(10)


def test_a_socket_that_a_live_sidecar_holds_is_a_clear_error(
    token_corpus: Path, shm_dir: Path, sidecar: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    socket, server = sidecar
    second = subprocess.run(
        [str(COLO), "sidecar", "serve", "--socket", str(socket), "--shm-dir", str(shm_dir), "--workers", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert second.returncode != 0
    assert "Traceback" not in second.stderr, second.stderr
    assert f"a sidecar already listens on {socket}" in second.stderr, second.stderr
    assert server.poll() is None, "the live sidecar keeps serving"
    assert_serves(socket, token_corpus, "the first sidecar, after a second one was refused")


@pytest.mark.parametrize("request_", ["not a dict", b"not a pickle", {"op": "release"}, {"op": "open"}, {"op": "dance"}])
def test_a_request_that_breaks_the_protocol_ends_its_session_not_the_sidecar(
    token_corpus: Path, sidecar: tuple[Path, subprocess.Popen[bytes]], request_: object
) -> None:
    """A peer that knows the key but sends what no trainer sends: an error reply or the
    end of its session, and the sidecar goes on serving."""
    socket, server = sidecar
    key = read_key(str(socket))
    assert key is not None
    with connect(str(socket), key, 10) as conn:
        assert conn.recv() == {"ready": True}
        if isinstance(request_, bytes):
            conn.send_bytes(request_)
        else:
            conn.send(request_)
        if conn.poll(10):  # an error reply, or the end of the connection
            with contextlib.suppress(EOFError):
                reply = conn.recv()
                assert "error" in reply, reply
    assert_serves(socket, token_corpus, f"after a session that sent {request_!r}")
    assert server.poll() is None, server.stderr.read().decode()


@pytest.mark.parametrize("where", ["missing directory", "not a socket"])
def test_a_socket_path_that_cannot_be_used_is_a_clear_error(tmp_path: Path, shm_dir: Path, where: str) -> None:
    if where == "missing directory":
        socket, expected = tmp_path / "no-such-dir" / "host0.sock", "does not exist; create it"
    else:
        socket, expected = tmp_path / "notes.txt", "exists and is not a socket"
        socket.write_text("keep me")
    result = subprocess.run(
        [str(COLO), "sidecar", "serve", "--socket", str(socket), "--shm-dir", str(shm_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert expected in result.stderr and "colo-data sidecar on" not in result.stderr, result.stderr
    if where == "not a socket":
        assert socket.read_text() == "keep me", "a file that is not a socket is never removed"


def posix_ipc_files() -> set[str]:
    """Files in /dev/shm that multiprocessing's shared memory and semaphores leave."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return alive


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget")
@pytest.mark.parametrize("settings", [False, True], ids=["as-a-shell-starts-it", "with-the-process-settings"])
def test_a_killed_sidecar_leaves_no_workers_and_no_ipc_files(
    tmp_path: Path, token_corpus: Path, shm_dir: Path, settings: bool
) -> None:
    """Started from a shell, a sidecar runs numpy's OpenBLAS threads and its workers' fork
    server is a fresh interpreter; with the process settings (as the image and a trainer's
    own sidecar start it) it runs one thread, and the server is a fork of it."""
    if not settings and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("on one CPU numpy's OpenBLAS starts no thread: a sidecar from a shell forks its server too")
    socket = tmp_path / "host0.sock"
    ipc_before = posix_ipc_files()
    env = {**process_settings(), **os.environ} if settings else {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    server = subprocess.Popen(
        [str(COLO), "sidecar", "serve", "--socket", str(socket), "--shm-dir", str(shm_dir), "--workers", "2"],
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert server.stderr.readline().startswith(b"colo-data sidecar on")
        pipeline = make_pipeline(token_corpus, epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
        with cd.Loader(pipeline, backend=cd.Sidecar(address=f"unix://{socket}"), prefetch=0) as loader:
            until_workers_made(loader)  # they start once the sidecar hands them work
            (fork_server,) = psutil.Process(server.pid).children()
            forked = Path(f"/proc/{fork_server.pid}/environ").read_bytes() == Path(f"/proc/{server.pid}/environ").read_bytes()
            assert forked == settings, f"the fork server is {'a fork of the sidecar' if forked else 'a fresh interpreter'}"
            workers = [c.pid for c in psutil.Process(server.pid).children(recursive=True)]
            assert 1 <= len([p for p in workers if "colo_data.workers.processes" in " ".join(psutil.Process(p).cmdline())]) <= 2
            server.send_signal(signal.SIGKILL)
            with pytest.raises(cd.errors.SidecarError):
                for _ in range(10_000):
                    next(loader)
        assert not wait_gone(workers, 10), "worker processes outlived their sidecar"
    finally:
        server.kill()
        server.wait(10)
    assert not left_behind(ipc_before, posix_ipc_files()), sorted(left_behind(ipc_before, posix_ipc_files()))
    assert not any(shm_dir.iterdir()), "the trainer removes the dead sidecar's ring"


WORKER_TRAINER = """
import sys
import tempfile
sys.path.insert(0, {tests!r})
import colo_data as cd
from pipelines import idle_host, make_pipeline, until_workers_made
pipeline = make_pipeline({corpus!r}, epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
loader = cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2))
until_workers_made(loader)
print("running", flush=True)
import time; time.sleep(600)
"""


@pytest.mark.serial
@pytest.mark.usefixtures("own_cpu_budget")  # the trainer's workers start where its CPU goes unused, not the machine's
def test_a_killed_trainer_leaves_no_worker_processes(tmp_path: Path, token_corpus: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(WORKER_TRAINER).format(tests=str(TESTS), corpus=str(token_corpus)))
    ipc_before = posix_ipc_files()
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    try:
        assert trainer.stdout.readline().strip() == b"running"
        workers = [c.pid for c in psutil.Process(trainer.pid).children(recursive=True)]
        assert workers, "the trainer's workers run"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        assert not wait_gone(workers, 10), "worker processes outlived their trainer"
    finally:
        trainer.kill()
    assert not left_behind(ipc_before, posix_ipc_files()), sorted(left_behind(ipc_before, posix_ipc_files()))


ATTACK = """
import os, pickle, socket, struct, sys
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
data = pickle.dumps({"op": "open", "pipeline": Payload()})
conn = socket.socket(socket.AF_UNIX)
try:
    conn.connect(sys.argv[1])
except PermissionError:
    print("no permission")
    sys.exit(0)
conn.sendall(struct.pack("!i", len(data)) + data)  # multiprocessing.connection's framing
conn.settimeout(10)
try:
    while conn.recv(1024):  # whatever the sidecar answers, until it hangs up
        pass
except OSError:
    pass
print("sent")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the sidecar as root and the other user with runuser: needs root")
@pytest.mark.parametrize("mode", [None, "666"])
def test_another_user_cannot_run_code_in_the_sidecar(token_corpus: Path, shm_dir: Path, mode: str | None) -> None:
    """A sidecar started under umask 000: by default its socket is owner-only, so `nobody`
    cannot connect; with a world-writable --socket-mode, `nobody` connects but fails the key
    challenge, and the pickle it sends is never loaded. The sidecar goes on serving."""
    place = Path(tempfile.mkdtemp(prefix="colo-data-test-", dir="/tmp"))
    try:
        place.chmod(0o755)  # the other user reaches the socket, not the key
        socket, marker, attack = place / "host0.sock", place / "pwned", place / "attack.py"
        attack.write_text(textwrap.dedent(ATTACK))
        attack.chmod(0o644)
        command = f'umask 000; exec "{COLO}" sidecar serve --socket {socket} --shm-dir {shm_dir} --workers 0'
        server = subprocess.Popen(["sh", "-c", command + (f" --socket-mode {mode}" if mode else "")], stderr=subprocess.PIPE)
        try:
            assert server.stderr.readline().startswith(b"colo-data sidecar on")
            assert stat.S_IMODE(socket.stat().st_mode) == (int(mode, 8) if mode else 0o600)
            assert stat.S_IMODE(Path(f"{socket}.key").stat().st_mode) == (0o640 if mode else 0o600)
            other = subprocess.run(
                ["runuser", "-u", "nobody", "--", "sh", "-c", f"umask 000; /usr/bin/python3 {attack} {socket} {marker}"],
                capture_output=True, text=True, timeout=60,
            )
            assert other.returncode == 0, other.stderr
            assert other.stdout.strip() == ("sent" if mode else "no permission"), other.stdout
            assert_serves(socket, token_corpus, "after another user's connection")  # it went on serving
            assert not marker.exists(), "the other user's pickle ran inside the sidecar"
        finally:
            server.terminate()
            _, err = server.communicate(timeout=10)
        if mode:
            assert b"refused a connection" in err, (err.decode(), other.stdout, other.stderr)
        assert not Path(f"{socket}.key").exists(), "the sidecar removes its key file when it stops"
    finally:
        shutil.rmtree(place, ignore_errors=True)


def test_a_trainer_with_another_key_gets_a_clear_error(
    token_corpus: Path, monkeypatch: pytest.MonkeyPatch, sidecar: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    socket, server = sidecar
    monkeypatch.setenv("COLO_DATA_SIDECAR_KEY", "ab" * 32)  # the sidecar wrote its own key file
    with pytest.raises(cd.errors.SidecarError, match="refused this trainer's key"):
        read_all(cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(address=f"unix://{socket}")))
    monkeypatch.delenv("COLO_DATA_SIDECAR_KEY")
    assert_serves(socket, token_corpus, "the right key, after a wrong one")
    assert server.poll() is None


@pytest.mark.parametrize("value", ["0", "2", "lots", "150%"])
def test_a_bad_input_wait_target_is_refused_at_start(tmp_path: Path, shm_dir: Path, value: str) -> None:
    """`COLO_DATA_INPUT_WAIT` that is not a share of the time: one line naming it, before
    the sidecar listens, not at the first feed."""
    result = subprocess.run(
        [str(COLO), "sidecar", "serve", "--socket", str(tmp_path / "host0.sock"), "--shm-dir", str(shm_dir)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLO_DATA_INPUT_WAIT": value},
    )  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert f"COLO_DATA_INPUT_WAIT={value!r}: give the trainer's input wait" in result.stderr, result.stderr
    assert "colo-data sidecar on" not in result.stderr and not (tmp_path / "host0.sock").exists(), result.stderr
