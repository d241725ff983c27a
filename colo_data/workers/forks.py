"""`ForkServer`: the process that worker processes are forked from. A fresh interpreter
spends a good part of a second importing numpy, pyarrow, cloudpickle and colo-data's chunk work before a
worker can take a job, which a CPU-bound pipeline's first second runs without. A pool
therefore starts one server with its first feed (a fresh interpreter that imports exactly
what a worker does, and never JAX or the user's `__main__`), in the background, at the
workers' priority; each worker is then forked from it, ready in milliseconds. Forking the trainer
itself would copy JAX's threads and locks into the worker: the server holds no thread of
Python's and no state of the trainer's.

`multiprocessing`'s fork server does not fit: its children import the parent's `__main__`
(scripts would need an `if __name__ == "__main__":` guard again), its preload list is one
setting for the whole process, and it hands a child its own pipes, where a worker talks to
its pool over a socket of the pool's (colo_data/workers/frames.py). This one takes that socket
over its control connection (`SCM_RIGHTS`), forks, and answers with the worker's pid, then
with its exit code once it has reaped it.

A sidecar is such an interpreter itself: at its start it has imported what a worker needs,
holds no trainer's state and runs one thread. Its pool's server is therefore
a fork of it (`from_here`), ready at once, where a fresh one would take a fraction of a second of a CPU
while the sidecar makes its first batches; a process running more than one thread (a
trainer: JAX's) gets a fresh interpreter.

Who stops what: the pool's owner stops the server (`stop`); the server stops its workers
(each ends when its socket closes, the server kills what is still running at the deadline
and reaps them all) and then exits. A worker dies with the server (`PR_SET_PDEATHSIG`), and
the server with its parent: when the control connection closes without `stop`, it stops
its workers as `stop` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy.random  # a worker reseeds it, and the chunk work's orders use it: preloaded with the rest
import psutil
import setproctitle

from colo_data.errors import ColoDataError

WORKER_NICE = 10  # the workers' scheduling priority: below the trainer's and the host's threads, never starved (see `lower`)
EXIT_S = 0.5  # a worker still running this long after its pool stopped (or the pool's process died) is killed
_POLL_S = 0.5  # how often the server reaps its workers while it waits for requests
_REAP_S = 1.0  # beyond a stop's seconds, what the server gets to kill and reap its workers before it is killed
_PR_SET_PDEATHSIG = 1
_TITLE = "colo-data worker fork server"  # its command line (`ps`), where its workers show the module they run
_JEMALLOC = "jemalloc_bg_thd"  # the name of the background thread of Arrow's jemalloc
_in_worker = False  # this process is a worker forked by a fork server (set in `_worker`)


def in_worker() -> bool:
    """Whether this process is a worker forked by a pool's fork server (a fresh server's,
    whose `__main__` its workers share, or a sidecar's forked one, whose is the sidecar's)."""
    return _in_worker


def lower(pid: int) -> None:
    """Put process `pid` at `WORKER_NICE`, and the session it leads too where the kernel
    schedules sessions as groups (autogroup, for processes outside a container's cgroup).
    Below the trainer and the host's own thread, a worker takes the CPU that those leave.
    Where sessions are grouped, nice ranks processes only within a session, and a nice
    worker in the trainer's session would hold up the trainer's threads' wake-ups (its two
    threads hand the GIL to each other thousands of times a second): hence a session of
    its own. Not nice 19, the lowest: beside a busy process at nice 0 the kernel gives a
    process at 19 about 1.5% of a CPU (weights 15 and 1,024), at 10 about 10% (110): a
    loaded host slows its workers and must not stop them. Any user may lower a process's
    priority."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, WORKER_NICE)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as group:
        group.write(str(WORKER_NICE))  # no such file: the kernel has no autogroup


class ForkServer:
    """A fork server, started now at `WORKER_NICE` in a session of its own: as `command`
    (which runs `serve` on the file descriptor it is given as its last argument) with the
    environment `env`, or, with `from_here` (the function its workers run) where this
    process runs only one thread, as a fork of this process that runs `serve` with it, its
    workers showing `command` as theirs and running with `env`. It ignores Ctrl-C, which is
    its trainer's to handle."""

    def __init__(
        self, command: list[str], env: dict[str, str], from_here: Callable[[socket.socket], None] | None = None
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # SPT_NOENV: `setproctitle` writes its titles over the arguments alone, never over the
        # environment after them, so /proc/PID/environ still shows the environment each began with
        env = {**env, "SPT_NOENV": "1"}
        self.process: subprocess.Popen[bytes] | _Fork
        try:
            if from_here is not None and _one_thread():
                self.process = _Fork.serving(ours, theirs, from_here, env, " ".join(command))
            else:
                self.process = subprocess.Popen(
                    [*command, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
                lower(self.process.pid)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._forks = 0
        self._pids: dict[int, int] = {}  # by worker
        self._codes: dict[int, int] = {}  # by worker, once it has exited

    def cpu_seconds(self) -> float:
        """The CPU time the server itself has used (its workers' not counted; 0 once it is gone)."""
        try:
            times = psutil.Process(self.process.pid).cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return times.user + times.system

    def fork(self, conn: socket.socket) -> int:
        """Ask for a worker serving `conn` (the server takes a copy: close it after); its
        number, for `pid` and `exit_code`. Does not wait: a server still importing forks it
        once it is ready."""
        with self._lock:
            worker = self._forks
            self._forks += 1
            try:
                socket.send_fds(self._sock, [pickle.dumps(("fork", worker))], [conn.fileno()])
            except OSError as e:
                raise ColoDataError(
                    f"the worker processes' fork server exited (code {self.process.poll()}): restart the loader"
                ) from e
        return worker

    def _take(self, wait: bool) -> None:
        """Note the server's messages that have come (a fork's pid, an exit code); with
        `wait`, wait up to `_POLL_S` for the first."""
        timeout = _POLL_S if wait else 0.0
        while self._sock.fileno() >= 0 and select.select([self._sock], [], [], timeout)[0]:  # not after `stop`
            try:
                message = self._sock.recv(256)
            except OSError:  # the server is gone
                return
            if not message:
                return
            kind, worker, value = pickle.loads(message)
            (self._pids if kind == "forked" else self._codes)[worker] = value
            timeout = 0.0

    def pid(self, worker: int) -> int:
        """The pid of `worker`, waiting for the server to fork it."""
        with self._lock:
            while worker not in self._pids:
                if self.process.poll() is not None:
                    raise ColoDataError(f"the worker processes' fork server exited (code {self.process.poll()})")
                self._take(wait=True)
            return self._pids[worker]

    def exit_code(self, worker: int) -> int | None:
        """`worker`'s exit code (negative: the signal that ended it), None while it runs.
        When the server is gone its workers were killed with it."""
        with self._lock:
            self._take(wait=False)
            if worker not in self._codes and self.process.poll() is not None:
                return -signal.SIGKILL
            return self._codes.get(worker)

    def stop(self, seconds: float) -> None:
        """Have the server stop its workers, killing those still running after `seconds`
        (their sockets should be closed first: idle ones then exit at once), and exit; kill
        it if it has not within `_REAP_S` more (its workers die with it); one that forked
        none is killed at once (it may still be importing). Safe to call twice."""
        with self._lock:
            with contextlib.suppress(OSError):
                self._sock.send(pickle.dumps(("stop", seconds)))
            self._sock.close()
            if not self._forks and self.process.poll() is None:
                self.process.kill()
        try:
            self.process.wait(seconds + _REAP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Fork:
    """A server forked from this process, read as `subprocess.Popen` reads a spawned one
    (`pid`, `poll`, `wait`, `kill`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # one reaper at a time

    @classmethod
    def serving(
        cls, ours: socket.socket, theirs: socket.socket, work: Callable[[socket.socket], None], env: dict[str, str], title: str
    ) -> _Fork:
        """Fork this process into a server on `theirs` whose workers run `work` with `env`
        and show `title`. The fork holds none of this process's end (`ours`): it sees the
        connection close when this process dies, and it never returns into this process's code."""
        pid = os.fork()
        if pid:
            return cls(pid)
        code = 1
        try:
            os.setsid()
            lower(os.getpid())  # here, once in its own session (the parent's could still be its session)
            ours.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this process's handler is its own, not the server's
            # `setproctitle` sets itself up where it first runs, and finds no room for a title
            # once the environment has changed: first SPT_NOENV alone, then the rest
            os.environ["SPT_NOENV"] = env["SPT_NOENV"]
            setproctitle.getproctitle()
            os.environ.update(env)
            serve(theirs, work, title)
            code = 0
        except BaseException:  # noqa: BLE001 - a fork's error must not run this process's code after it
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def poll(self) -> int | None:
        """Its exit code, None while it runs."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by another waiter of this process's: it is gone
                    pid, status = self.pid, signal.SIGKILL
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has exited; `subprocess.TimeoutExpired` after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(_TITLE, timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        """SIGKILL it, unless it has exited."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _one_thread() -> bool:
    """Whether this process runs one thread, beside at most the background thread of Arrow's
    jemalloc: only then is a fork of it safe to run on (no lock is held by a thread the fork
    lacks; jemalloc's own fork handlers take its locks across a fork, as every worker forked
    from a server that has imported pyarrow relies on)."""
    try:
        threads = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    except OSError:  # no /proc, or a thread that ended meanwhile: unknown
        return False
    return threading.active_count() == 1 and len([name for name in threads if name != _JEMALLOC]) == 1


def serve(control: socket.socket, work: Callable[[socket.socket], None], title: str | None = None) -> None:
    """The server: fork a worker that runs `work(conn)` for each socket that comes over
    `control`, report each one's pid and exit code, until told to stop or the control
    connection closes (its pool's process died); then stop the workers and return. Its
    workers show `title` as their command line (default: the server's own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle: it stops the pool
    title = title or setproctitle.getproctitle()  # what its workers show: they are the workers
    setproctitle.setproctitle(_TITLE)
    me = os.getpid()
    workers: dict[int, int] = {}  # worker number by pid

    def report(*message: object) -> None:
        with contextlib.suppress(OSError):  # the pool has gone: nobody is waiting
            control.send(pickle.dumps(message))

    def reap() -> None:
        while workers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                return
            report("exited", workers.pop(pid), os.waitstatus_to_exitcode(status))

    deadline = None
    while deadline is None:
        if select.select([control], [], [], _POLL_S)[0]:
            try:
                message, fds, _, _ = socket.recv_fds(control, 256, 1)
            except ConnectionResetError:  # the pool's process died with a message unread
                message = b""
            if not message:  # the pool's process died
                deadline = time.monotonic() + EXIT_S
                break
            kind, value = pickle.loads(message)
            if kind == "stop":
                deadline = time.monotonic() + value
                break
            pid = os.fork()
            if pid == 0:
                control.close()
                os._exit(_worker(me, title, socket.socket(fileno=fds[0]), work))
            os.close(fds[0])
            workers[pid] = value
            report("forked", value, pid)
        reap()
    while workers and time.monotonic() < deadline:
        time.sleep(0.01)
        reap()
    for pid in workers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in workers:
        os.waitpid(pid, 0)


def _worker(server: int, title: str, conn: socket.socket, work: Callable[[socket.socket], None]) -> int:
    """A forked worker: in a session of its own at `WORKER_NICE` (see `lower`), killed
    with its server, with numpy's global random state of its own (as a fresh interpreter
    has), showing the server's own command line (`title`); runs `work(conn)`. Its exit code."""
    global _in_worker
    _in_worker = True
    try:
        os.setsid()
        lower(os.getpid())
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # the server died before the line above
            return 1
        numpy.random.seed()
        setproctitle.setproctitle(title)
        work(conn)
        return 0
    except BaseException:  # noqa: BLE001 - a fork's error must not run the server's code after it
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
