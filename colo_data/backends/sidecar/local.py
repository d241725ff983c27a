"""Sidecar processes that a trainer starts for itself (the `sidecar` backend without an
address): one per host pipeline, each exiting with the trainer that started it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

from colo_data import defaults
from colo_data.backends.sidecar.shm import check_directory, sweep_stale
from colo_data.runtime.child_env import child_command, child_env
from colo_data.workers.settings import Workers, workers_text

_STOP_S = 10.0
_KILL_AFTER_S = 0.5  # even with no time left, a sidecar gets this long to remove its ring


class LocalSidecar:
    """`colo-data sidecar serve` in a child process, on a socket in a private temp dir (the
    sidecar removes it when this process dies without `stop()`)."""

    def __init__(self, shm_dir: str, workers: Workers, slots: int) -> None:
        check_directory(shm_dir)  # here, in the trainer: the sidecar would only say so in its log
        self._shm_dir = shm_dir
        self._dir = tempfile.mkdtemp(prefix=defaults.LOCAL_SIDECAR_DIR_PREFIX)
        self.address = os.path.join(self._dir, "sidecar.sock")
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
