"""`WorkerPool`: processes that compute a host pipeline's chunks. Each is a fresh
interpreter running this module, which imports only colo-data's chunk work (no JAX, no
Grain: about 0.3 s) and never the user's `__main__` (cloudpickle sends the script's
functions by value), so scripts need no `if __name__ == "__main__":` guard for it. Grain's
multiprocessing spawns new processes for every iterator, each importing Grain and JAX
(seconds). A pool outlives streams: a loader or a sidecar starts it once and every run or
trainer session reuses it.

Every worker computes its share of every chunk: the records whose row groups are its own
(`Share`), so no two workers decode the same row group (when each took whole chunks in turn,
each decoded every row group of a shuffle window, and two workers were slower than none on
a light pipeline). The parent puts the shares back in their places, in chunk order, so the
stream is the same for any worker count. A worker exits when its socket closes (its parent
is gone); the pool's `close()` ends them within a deadline, killing what does not stop.
"""

from __future__ import annotations

import itertools
import math
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle

from colo_data.errors import ColoDataError, TransformError, from_wire, to_wire
from colo_data.host import frames
from colo_data.host.chunk import HostChunk, merge_shares
from colo_data.host.chunk_work import ChunkAt, ChunkWork, Share
from colo_data.host.resources import cpu_budget
from colo_data.runtime.child_env import child_env
from colo_data.runtime.lifecycle import DEFAULT_TIMEOUT_S, Lifecycle

AHEAD = 3  # chunks in flight (each is shared out to every worker)
_POLL_S = 0.5
_GONE: Any = (-1, None)  # a reader's last word: its worker is gone


def _serve(conn: socket.socket) -> None:
    """A worker: take a job (a pickled host pipeline and where its stream starts), then
    compute the chunks asked for, until the socket closes."""
    jobs: dict[int, Any] = {}
    while True:
        try:
            message = frames.receive(conn, lambda: True, _POLL_S)
        except (EOFError, OSError):  # the parent closed the socket or died
            return
        if message[0] == "job":
            _, job, payload, host, hosts, start, total, batches, share = message
            jobs.clear()  # one stream at a time: a new job ends the last one
            try:
                work = ChunkWork(cloudpickle.loads(payload), host, hosts)
                jobs[job] = ChunkAt(work, start, total, batches, Share(*share))
            except BaseException as e:  # e.g. a module of the pipeline that this process cannot import
                jobs[job] = _raising(e)
            continue
        _, job, index = message
        try:
            reply: Any = jobs[job](index)
        except BaseException as e:  # handed to the parent, raised there
            reply = to_wire(e)
        try:
            frames.send(conn, (job, reply))
        except (BrokenPipeError, OSError):
            return


def _raising(error: BaseException) -> Any:
    """A chunk maker that fails every chunk with `error` (the job could not be set up)."""

    def chunk(index: int) -> Any:
        raise error

    return chunk


class _Worker:
    """One worker process, its socket, and the thread that receives its replies as they come
    (so that a worker finishing ahead of the consumer is never blocked on a full socket)."""

    def __init__(self, threads: int) -> None:
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "colo_data.workers.processes", str(theirs.fileno())]
        env = child_env(threads)
        try:
            self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.replies: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name=f"colo-data-worker-{self.process.pid}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            while True:
                self.replies.put(frames.receive(self.sock, lambda: self.process.poll() is None, _POLL_S))
        except (EOFError, OSError, ValueError):  # the worker died or the pool closed the socket
            self.replies.put(_GONE)

    def send(self, message: tuple[Any, ...]) -> None:
        frames.send(self.sock, message)

    def stop(self, deadline: float) -> None:
        """Close the socket (the worker exits), wait until `deadline`, then kill it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(max(0.0, deadline - time.monotonic()))


class WorkerPool:
    """`count` worker processes, owned by `owner`.

    Args:
        count: worker processes.
        owner: stops them when it closes.
    """

    def __init__(self, count: int, owner: Lifecycle) -> None:
        self._workers: list[_Worker] = []
        self._jobs = itertools.count()
        threads = max(1, math.ceil(cpu_budget(reserve=0).cpus) // count)  # each worker's share, for its native thread pools
        try:
            for _ in range(count):
                self._workers.append(_Worker(threads))
        except BaseException:
            self.close(0.0)
            raise
        self._key = owner.add(f"{count} worker processes", self.close)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def chunks(
        self, payload: bytes, host: int, hosts: int, start: int, total: int | None, batches: int, indices: range
    ) -> Iterator[HostChunk]:
        """Chunks `indices` of `batches` global batches each, of host `host` of `hosts` of the
        pickled pipeline `payload`, whose stream starts at position `start` (`total` batches
        from there, None: endless), in order, each put together from the workers' shares of
        it, `AHEAD` chunks in flight or waiting. The first requests go out now, before the
        iterator is first read. A pool serves one stream at a time."""
        job = next(self._jobs)
        count = len(self._workers)
        for share, worker in enumerate(self._workers):
            self._send(worker, ("job", job, payload, host, hosts, start, total, batches, (share, count)))
        ahead = iter(indices)
        for index in itertools.islice(ahead, AHEAD):
            self._ask(job, index)
        return self._results(job, indices, ahead)

    def _ask(self, job: int, index: int) -> None:
        for worker in self._workers:
            self._send(worker, ("chunk", job, index))

    def _results(self, job: int, indices: range, ahead: Iterator[int]) -> Iterator[HostChunk]:
        for _ in indices:
            shares = [self._receive(worker, job) for worker in self._workers]
            following = next(ahead, None)
            if following is not None:
                self._ask(job, following)
            yield merge_shares(shares)

    def _send(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        try:
            worker.send(message)
        except (BrokenPipeError, OSError) as e:
            raise self._died() from e

    def _receive(self, worker: _Worker, job: int) -> HostChunk:
        """The worker's next reply for `job` (replies for a stream that was left early are
        passed over)."""
        while True:
            reply = worker.replies.get()
            if reply is _GONE:
                worker.replies.put(_GONE)  # for the next caller too
                raise self._died()
            replied, result = reply
            if replied == job:
                break
        if isinstance(result, HostChunk):
            return result
        raise from_wire(result, "a worker process", TransformError)

    def _died(self) -> ColoDataError:
        codes = [w.process.poll() for w in self._workers]
        return ColoDataError(
            f"a worker process died (exit codes {codes}; -9 is a kill, e.g. out of memory): check the memory "
            "limit and the transforms; restart the loader to go on from its state"
        )

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """End the workers: close their sockets (they exit), wait up to `timeout` seconds,
        then kill what is left; safe to call twice."""
        deadline = time.monotonic() + timeout
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop(deadline)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle: it stops the workers
    _serve(socket.socket(fileno=int(sys.argv[1])))
