"""`WorkerPool`: processes that compute a host pipeline's chunks. Each is a fresh
interpreter running this module, which imports only colo-data's host side (no JAX, no
Grain: about 0.3 s) and never the user's `__main__` (the pipeline arrives pickled by
value), so scripts need no `if __name__ == "__main__":` guard for it. Grain's
multiprocessing spawns new processes for every iterator, each importing Grain and JAX
(seconds). A pool outlives streams: a loader or a sidecar starts it once and every run or
trainer session reuses it.

Chunk i of a stream goes to worker i mod n and comes back in order, so the stream is the
same for any worker count. A worker exits when its pipe closes (its parent is gone); the
pool's `close()` ends them within a deadline, killing what does not stop.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from colo_data import errors
from colo_data.errors import ColoDataError, TransformError
from colo_data.host.chunk import HostChunk
from colo_data.runtime.child_env import child_env
from colo_data.runtime.lifecycle import DEFAULT_TIMEOUT_S, Lifecycle

AHEAD = 2  # chunks in flight per worker
_POLL_S = 0.5


def _serve(conn: Connection) -> None:
    """A worker: take a job (a pickled host pipeline and where its stream starts), then
    compute the chunks asked for, until the pipe closes."""
    from colo_data.host.pipeline import ChunkAt, HostPipeline

    jobs: dict[int, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or died
            return
        if message[0] == "job":
            _, job, payload, host, hosts, start, total = message
            jobs.clear()  # one stream at a time: a new job ends the last one
            jobs[job] = ChunkAt(HostPipeline(cloudpickle.loads(payload), host, hosts), start, total, in_worker=True)
            continue
        _, job, index = message
        try:
            reply: Any = jobs[job](index)
        except BaseException as e:  # handed to the parent, raised there
            reply = (type(e).__name__, str(e), "".join(traceback.format_exception(e)))
        try:
            conn.send((job, reply))
        except (BrokenPipeError, OSError):
            return


class WorkerPool:
    """`count` worker processes, owned by `owner`.

    Args:
        count: worker processes.
        owner: stops them when it closes.
    """

    def __init__(self, count: int, owner: Lifecycle) -> None:
        self._conns: list[Connection] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._jobs = itertools.count()
        try:
            for _ in range(count):
                ours, theirs = socket.socketpair()
                command = [sys.executable, "-m", "colo_data.host.workers", str(theirs.fileno())]
                process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=child_env())
                theirs.close()
                self._conns.append(Connection(ours.detach()))
                self._processes.append(process)
        except BaseException:
            self.close(0.0)
            raise
        self._key = owner.add(f"{count} worker processes", self.close)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def chunks(
        self, payload: bytes, host: int, hosts: int, start: int, total: int | None, indices: range
    ) -> Iterator[HostChunk]:
        """Chunks `indices` of host `host` of `hosts` of the pickled pipeline `payload`, whose
        stream starts at position `start` (`total` batches from there, None: endless), in
        order, computed by the workers. The first requests go out now, before the iterator
        is first read. A pool serves one stream at a time."""
        job = next(self._jobs)
        for conn in self._conns:
            self._send(conn, ("job", job, payload, host, hosts, start, total))
        ahead = iter(indices)
        for index in itertools.islice(ahead, AHEAD * len(self._conns)):
            self._send(self._conns[index % len(self._conns)], ("chunk", job, index))
        return self._results(job, indices, ahead)

    def _results(self, job: int, indices: range, ahead: Iterator[int]) -> Iterator[HostChunk]:
        for index in indices:
            chunk = self._receive(index % len(self._conns), job)
            following = next(ahead, None)
            if following is not None:
                self._send(self._conns[following % len(self._conns)], ("chunk", job, following))
            yield chunk

    def _send(self, conn: Connection, message: tuple[Any, ...]) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, OSError) as e:
            raise self._died() from e

    def _receive(self, worker: int, job: int) -> HostChunk:
        """The worker's next reply for `job` (replies for a stream that was left early are
        passed over)."""
        conn, process = self._conns[worker], self._processes[worker]
        try:
            while True:
                while not conn.poll(_POLL_S):
                    if process.poll() is not None:
                        raise EOFError
                replied, reply = conn.recv()
                if replied == job:
                    break
        except (EOFError, OSError) as e:
            raise self._died() from e
        if isinstance(reply, HostChunk):
            return reply
        kind, message, remote = reply
        error = getattr(errors, kind, None)
        if not (isinstance(error, type) and issubclass(error, ColoDataError)):
            error = TransformError
        raise error(f"{message}\n--- raised in a worker process ---\n{remote}")

    def _died(self) -> ColoDataError:
        codes = [p.poll() for p in self._processes]
        return ColoDataError(
            f"a worker process died (exit codes {codes}; -9 is a kill, e.g. out of memory): check the memory "
            "limit and the transforms; restart the loader to go on from its state"
        )

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """End the workers: close their pipes (they exit), wait up to `timeout` seconds,
        then kill what is left; safe to call twice."""
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + timeout
        for process in self._processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._conns, self._processes = [], []


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
