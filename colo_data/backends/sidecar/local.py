"""Sidecar processes that a trainer starts for itself (the `sidecar` backend without an
address): one per host pipeline, each exiting with the trainer that started it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

from colo_data import defaults
from colo_data.backends.sidecar.protocol import MAX_PATH_BYTES
from colo_data.backends.sidecar.shm import check_directory, sweep_stale
from colo_data.errors import ConfigError
from colo_data.runtime.child_env import child_command, child_env
from colo_data.workers.settings import Workers, workers_text

_SOCKET = "sidecar.sock"
_STOP_S = 10.0
_KILL_AFTER_S = 0.5  # even with no time left, a sidecar gets this long to remove its ring


class LocalSidecar:
    """`colo-data sidecar serve` in a child process, on a socket in a private temp dir (the
    sidecar removes it when this process dies without `stop()`)."""

    def __init__(self, shm_dir: str, workers: Workers, slots: int) -> None:
        check_directory(shm_dir)  # here, in the trainer: the sidecar would only say so in its log
        self._shm_dir = shm_dir
        self._dir = socket_dir()
        self.address = os.path.join(self._dir, _SOCKET)
        command = [*child_command("colo_data.cli"), "sidecar", "serve", "--socket", self.address]
        command += ["--shm-dir", shm_dir, "--slots", str(slots), "--exit-with", str(os.getpid())]
        command += ["--workers", workers_text(workers)]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=child_env())

    def stop(self, timeout: float = _STOP_S) -> None:
        """Terminate the sidecar (it removes its ring), killing it if it has not exited
        within `timeout` seconds, then remove what a killed one leaves (its ring: a sidecar
        busy in a transform of its session was killed before it could) and its socket
        directory; safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)  # a stopped sidecar (SIGSTOP) handles the SIGTERM too
            try:
                self.process.wait(max(timeout, _KILL_AFTER_S))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                sweep_stale(self._shm_dir)
        shutil.rmtree(self._dir, ignore_errors=True)


def socket_dir() -> str:
    """A private new directory for a trainer's own sidecar's socket: in the temp dir
    (`TMPDIR`) where the socket's path fits in a Unix socket's address, else in /tmp (a
    deep `TMPDIR`, as a job scheduler's per-job one can be, would make the sidecar fail to
    listen).

    Raises:
        ConfigError: the path is too long in both (names `TMPDIR` and the byte counts).
    """
    tried = []
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        # mkdtemp adds 8 characters to the prefix
        path = os.path.join(base, defaults.LOCAL_SIDECAR_DIR_PREFIX + "x" * 8, _SOCKET)
        size = len(os.fsencode(path))
        if size <= MAX_PATH_BYTES and os.path.isdir(base):
            return tempfile.mkdtemp(prefix=defaults.LOCAL_SIDECAR_DIR_PREFIX, dir=base)
        tried.append(f"{size} bytes under {base}" if os.path.isdir(base) else f"{base} is not a directory")
    raise ConfigError(
        f"the sidecar that this trainer starts needs a socket path of at most {MAX_PATH_BYTES} bytes, and it would be "
        f"{' and '.join(tried)}: set TMPDIR to a shorter directory, or start a sidecar with `colo-data sidecar serve "
        "--socket PATH` and give cd.Sidecar(address=PATH)"
    )
