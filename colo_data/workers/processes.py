"""`WorkerPool`: processes that compute a host pipeline's chunks. Each is forked from the
pool's fork server (colo_data/workers/forks.py), started when the pool's first worker is
asked for: a fresh interpreter that runs this module and imports only colo-data's chunk
work (no JAX, no Grain) and never the user's `__main__` (cloudpickle sends the script's
functions by value), so scripts need no `if __name__ == "__main__":` guard for it, and a
worker is ready in milliseconds once the server is; a sidecar's pool forks its server from
the sidecar itself, which has imported all that already. Grain's multiprocessing spawns new
processes for every iterator, each importing Grain and JAX. A pool outlives feeds: a
loader or a sidecar starts it once and every run or trainer session reuses it.

A chunk is cut into one share per worker asked for: an equal run of the chunk's records in
reading order (`Share`), so the shares are balanced and a row group is decoded by as few
workers as that allows; the shares go to the workers as each has room (`ProcessFeed`).
The parent puts the shares back in their places, in chunk order, so the batches are the
same for any worker count. A worker exits when its
socket closes (its parent is gone) or its fork server dies; the pool's `close()` ends them
within a deadline, killing what does not stop.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import cloudpickle

from colo_data.errors import ColoDataError, TransformError, from_wire, to_wire
from colo_data.host import slices
from colo_data.host.chunk import HostChunk, merge_shares
from colo_data.host.chunk_work import ChunkWork, Resume, Share
from colo_data.runtime.budget import CpuBudget, cpu_budget
from colo_data.runtime.child_env import child_command, child_env
from colo_data.runtime.lifecycle import DEFAULT_TIMEOUT_S, Lifecycle
from colo_data.workers import forks, frames
from colo_data.workers.cpu_use import CpuUse
from colo_data.workers.forks import EXIT_S, WORKER_NICE, ForkServer

__all__ = ["READY", "WORKER_NICE", "ProcessFeed", "WorkerPool"]

READY = "ready"  # a worker's reply to a job it has set up
_POLL_S = 0.5
_GONE: Any = (-1, None)  # a reader's last word: its worker is gone
_CODES_S = 2.0  # how long a worker's end waits for the fork server to tell its exit code (it reaps at once)
DEPTH = 2  # shares in a worker's hands at most: it starts the next as it sends the last
_Shares = list[HostChunk | None]  # a chunk's shares, in share order, None until each comes back


def _serve(conn: socket.socket) -> None:
    """A worker: take a job (a pickled pipeline, the host and the position it starts
    near), set it up and warm it, say it is ready, then compute the share of each chunk
    asked of it, until the socket closes."""
    jobs: dict[int, ChunkWork] = {}
    while True:
        try:
            message = frames.receive(conn, lambda: True, _POLL_S)
        except (EOFError, OSError):  # the parent closed the socket or died
            return
        reply: Any
        if message[0] == "job":
            _, job, payload, host, hosts, position = message
            jobs.clear()  # one feed at a time: a new job ends the last one
            try:
                jobs[job] = ChunkWork(cloudpickle.loads(payload), host, hosts).warmed(position)
                reply = READY
            except BaseException as e:  # e.g. a module of the pipeline that this process cannot import
                reply = to_wire(e)
        else:
            _, job, position, count, share = message
            if job not in jobs:  # a request of a feed that a newer job ended
                continue
            try:
                reply = slices.compute(jobs[job], position, count, Share(*share))
            except BaseException as e:  # handed to the parent, raised there
                reply = to_wire(e)
        try:
            frames.send(conn, (job, reply))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    """One worker process, forked by `server`, its socket, and the thread that receives its
    replies as they come (so that a worker finishing ahead of the consumer is never blocked
    on a full socket) and tells `replied` of each (a worker gone: `_GONE`)."""

    def __init__(self, server: ForkServer, replied: Callable[[_Worker, Any], None]) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.number = server.fork(theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._server = server
        self.sock = ours
        self.replies: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._replied, self._sending = replied, threading.Lock()  # (sent to from the host's thread and this one's)
        self.gone = False  # its socket closed: it died (or the pool closed it)
        self.reader = threading.Thread(target=self._read, name=f"colo-data-worker-{self.number}", daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int:
        """Its pid (waiting for the server to fork it)."""
        return self._server.pid(self.number)

    def poll(self) -> int | None:
        """Its exit code, None while it runs."""
        return self._server.exit_code(self.number)

    def _read(self) -> None:
        try:
            while True:
                reply = frames.receive(self.sock, lambda: self.poll() is None, _POLL_S)
                self.replies.put(reply)
                self._replied(self, reply)
        except (EOFError, OSError, ValueError):  # the worker died or the pool closed the socket
            self.gone = True
            self.replies.put(_GONE)
            self._replied(self, _GONE)

    def send(self, message: tuple[Any, ...]) -> None:
        with self._sending:
            frames.send(self.sock, message)

    def hang_up(self) -> None:
        """Close the socket: an idle worker exits at once, a busy one when it next replies."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class WorkerPool:
    """Up to `count` worker processes, owned by `owner`, on the CPUs of `budget`, below
    everything else's scheduling priority. Each is forked when a feed first asks for it
    (as many as the worker-count policy counts), and serves every feed after.

    Args:
        count: worker processes, at most.
        owner: stops them when it closes.
        budget: the CPU budget they share with the host (default: this process's).
        also: pids of other processes that spend the same budget (a trainer beside its own
            sidecar), for `cpus_used`.
        from_here: the fork server is a fork of this process, made now, where it runs one
            thread (a sidecar: see colo_data/workers/forks.py), not a fresh interpreter.
    """

    remote = False  # its processes share the host's CPUs

    def __init__(
        self, count: int, owner: Lifecycle, budget: CpuBudget | None = None, also: Sequence[int] = (), from_here: bool = False
    ) -> None:
        self.count = count
        self._workers: list[_Worker] = []
        self.arrived = threading.Event()  # a worker replied (or is gone) since a feed last looked
        self._feed: ProcessFeed | None = None  # the feed in use (one at a time)
        self._jobs = itertools.count()
        budget = budget or cpu_budget()
        self.budget = budget.cpus
        self._use = CpuUse(budget, also)
        self._closed = False
        threads = max(1, math.ceil(budget.cpus) // count)  # each worker's share, for its native thread pools
        self._command, self._env = child_command("colo_data.workers.processes"), child_env(threads)
        self._server: ForkServer | None = ForkServer(self._command, self._env, _serve) if from_here else None
        self._server_seen: tuple[float, float] | None = None  # (monotonic seconds, its CPU seconds) at the last `cpus_used`
        self._key = owner.add(f"{count} worker processes", self.close)

    def _fork_server(self) -> ForkServer:
        """The fork server, started now if it is not (a fresh interpreter, at the workers'
        priority: its imports take a good part of a second of one CPU)."""
        if self._server is None:
            self._server = ForkServer(self._command, self._env)
        return self._server

    def _grow(self, count: int, job: tuple[Any, ...]) -> None:
        """Start workers until `count` run, each handed `job` (the feed's set-up)."""
        if self._closed:
            raise ColoDataError("the worker processes were stopped: their loader or sidecar was closed")
        try:
            while len(self._workers) < count:
                self._workers.append(_Worker(self._fork_server(), self._replied))
                self._send(self._workers[-1], job)
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pids(self) -> list[int]:
        """The workers' pids (waiting for the server to fork those asked for)."""
        return [w.pid for w in self._workers]

    def cpus_used(self) -> float | None:
        """CPUs of the budget in use since the last call (None at the first), the fork
        server's own left out: its start (its imports, at the lowest priority, while the
        first batches are made) is over before its workers work."""
        used = self._use.read()
        now, spent = time.monotonic(), 0.0 if self._server is None else self._server.cpu_seconds()
        last, self._server_seen = self._server_seen, (now, spent)
        if used is None or last is None or now <= last[0]:
            return used
        return max(0.0, used - max(0.0, spent - last[1]) / (now - last[0]))

    def feed(self, payload: bytes, host: int, hosts: int, position: int) -> ProcessFeed:
        """A feed of chunks of host `host` of `hosts` of the pickled pipeline `payload`,
        near `position`, which the workers set up in the background (`ProcessFeed.ready`). Workers start
        when a feed first needs them, one by one: each costs a start (imports, the
        pipeline's set-up) that a pipeline working at full speed beside it feels. A pool
        serves one feed at a time: a new one ends the last. The fork server starts with the
        first feed, its imports beside the host's first chunks, so that the workers, once
        counted, start in a fraction of a second. A worker that has died is a ColoDataError
        here, as the fork server tells it, whether or not its socket has told yet."""
        if self.count:
            self._fork_server()
        self._check_alive()
        job = ("job", next(self._jobs), payload, host, hosts, position)
        for worker in self._workers:
            self._send(worker, job)
        self._feed = ProcessFeed(self, job)
        return self._feed

    def _replied(self, worker: _Worker, reply: Any) -> None:
        """On `worker`'s reader thread, at each reply: wake the feed waiting for one, and let
        it send that worker its next share at once (not when the host's thread next looks)."""
        feed = self._feed
        if feed is not None and reply is not _GONE:
            feed._freed(worker, reply)
        self.arrived.set()

    def _send(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        try:
            worker.send(message)
        except (BrokenPipeError, OSError) as e:
            raise self._died() from e

    def _receive(self, worker: _Worker, job: int, block: bool = True) -> HostChunk | str | None:
        """The worker's next reply for `job` (replies for a feed that was left early are
        passed over): its share of a chunk, or `READY`; None when `block` is False and none
        has come yet. A worker's error is raised here, as the same colo-data type."""
        while True:
            try:
                reply = worker.replies.get(block)
            except queue.Empty:
                return None
            if reply is _GONE:
                worker.replies.put(_GONE)  # for the next caller too
                raise self._died()
            replied, result = reply
            if replied == job:
                break
        if isinstance(result, HostChunk) or result == READY:
            return result
        raise from_wire(result, "a worker process", TransformError)

    def _check_alive(self) -> None:
        """Raise `_died`'s error where a worker has died (its socket closed, or the fork server
        told its exit)."""
        if any(worker.gone or worker.poll() is not None for worker in self._workers):
            raise self._died()

    def _died(self) -> ColoDataError:
        """The error for a worker gone: how each gone worker ended (its exit code or the
        signal that killed it), once the fork server has told (it reaps them at once)."""
        deadline = time.monotonic() + _CODES_S
        while True:
            codes = [w.poll() for w in self._workers]
            gone = [(i, code) for i, (w, code) in enumerate(zip(self._workers, codes, strict=True)) if w.gone or code is not None]
            if all(code is not None for _, code in gone) or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        ended = "; ".join(f"worker {i} {_ended(code)}" for i, code in gone) or "a worker closed its socket"
        return ColoDataError(
            f"a worker process died ({ended}): check the memory limit (a kill is often the out-of-memory killer's) and "
            "the transforms; restart the loader to go on from its state"
        )

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """End the workers and their fork server: close all their sockets (idle ones exit
        at once), have the server wait up to `EXIT_S` (at most `timeout`) seconds, then kill
        what is left, so that a worker busy with a long chunk does not hold the close for its
        whole timeout; safe to call twice."""
        self._closed = True
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.hang_up()
        seconds = min(timeout, EXIT_S)
        deadline = time.monotonic() + seconds
        if self._server is not None:
            self._server.stop(seconds)
        for worker in workers:
            worker.reader.join(max(0.0, deadline - time.monotonic()))


def _ended(code: int | None) -> str:
    """How a worker ended, in words: its exit code, or the signal that killed it."""
    if code is None:
        return "closed its socket (its exit code is not known yet)"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


class ProcessFeed:
    """One feed's requests to a `WorkerPool`: each chunk asked for by position is cut into
    shares, one per worker asked for, that go to the workers ready as each has room (at most
    `DEPTH` shares in a worker's hands; a worker's reply sends it the next at once, from its
    reader thread), worker k first offered share k (its read-ahead guessed that one): a
    worker that starts late or runs slow takes fewer, and a new one is busy within a share's
    time of its set-up. A partitioned pipeline's slices (a `Resume`) stay with the worker
    asked for, which keeps their partitions' state. Chunks are handed back whole, in the
    order asked for."""

    def __init__(self, pool: WorkerPool, job: tuple[Any, ...]) -> None:
        self._pool, self._set_up, self._job = pool, job, job[1]
        self._lock = threading.Lock()  # what the host's thread and the workers' reader threads share
        self._ready: list[int] = []  # the workers that have set the job up, in the order they did
        self._asked: deque[_Shares] = deque()  # each chunk not taken yet: its shares, filled in as they come back
        self._pending: deque[tuple[_Shares, int, tuple[Any, ...]]] = deque()  # shares not sent: whose, which, the message
        self._hands: dict[int, deque[tuple[_Shares, int]]] = {}  # by worker: the shares sent to it not taken back, in order
        self._busy: dict[int, int] = {}  # by worker: the shares sent to it that it has not replied to
        self._chosen: list[int] = []  # the workers the last chunk was asked of, those ready first

    def ready(self, workers: int) -> int:
        """How many of the first `workers` workers have set the job up (without waiting;
        those not started yet start now). A worker that could not (a module of the pipeline
        that it cannot import, say) raises its error here, and a worker that died is a
        ColoDataError here, whether the feed uses the pool at the moment or not."""
        self._pool._grow(workers, self._set_up)
        self._pool._check_alive()
        for i, worker in enumerate(self._pool._workers[:workers]):
            if i not in self._ready and self._pool._receive(worker, self._job, block=False) == READY:
                self._set_ready(i)
        return sum(1 for i in self._ready if i < workers)

    def ask(self, position: int | Resume, count: int, workers: int) -> None:
        """Ask for the chunk of `count` global batches at `position`, cut into `workers`
        shares for the first `workers` workers: those that have set the feed up first, in
        the order they did, then (where fewer have) others, which set it up first (those not
        started yet start now)."""
        self._pool._grow(workers, self._set_up)
        with self._lock:
            self._chosen = [*self._ready, *(i for i in range(workers) if i not in self._ready)][:workers]
            shares: _Shares = [None] * len(self._chosen)
            for share, i in enumerate(self._chosen):
                message = ("chunk", self._job, position, count, (share, len(self._chosen)))
                if isinstance(position, Resume):  # (its partitions' state is that worker's)
                    self._send(i, shares, share, message)
                else:
                    self._pending.append((shares, share, message))
            self._asked.append(shares)
            self._deal()

    def take(self) -> HostChunk:
        """The chunk asked for first of those not taken yet (waiting for it), put together
        from its shares."""
        shares = self._asked[0]
        while any(share is None for share in shares):
            self._pool.arrived.clear()
            if not self._collect():
                self._pool.arrived.wait(_POLL_S)
        self._asked.popleft()
        return merge_shares(cast(list[HostChunk], shares))

    def _freed(self, worker: _Worker, reply: tuple[int, Any]) -> None:
        """On `worker`'s reader thread: its reply to a share of this feed leaves it room for
        the next share, sent now."""
        job, result = reply
        if job != self._job or result == READY:
            return
        with self._lock:
            i = next((n for n, w in enumerate(self._pool._workers) if w is worker), None)
            if i is None or not self._busy.get(i):  # (a pool closed; an error setting the job up, before any share)
                return
            self._busy[i] -= 1
            with contextlib.suppress(ColoDataError):  # (it died: the host's thread finds it gone)
                self._deal()

    def _set_ready(self, i: int) -> None:
        with self._lock:
            self._ready.append(i)
            self._deal()

    def _deal(self) -> None:
        """Send the shares not sent yet to the chosen workers that have set the feed up (to
        all of them while none has) and have room, each offered its own numbered share first
        (the lock held)."""
        ready = [i for i in self._chosen if i in self._ready] or self._chosen
        for place, i in enumerate(self._chosen):
            while self._pending and i in ready and self._busy.get(i, 0) < DEPTH:
                own = next((n for n, (_, share, _) in enumerate(self._pending) if share == place), 0)
                shares, share, message = self._pending[own]
                del self._pending[own]
                self._send(i, shares, share, message)

    def _send(self, i: int, shares: _Shares, share: int, message: tuple[Any, ...]) -> None:
        self._hands.setdefault(i, deque()).append((shares, share))
        self._busy[i] = self._busy.get(i, 0) + 1
        self._pool._send(self._pool._workers[i], message)

    def _collect(self) -> bool:
        """Take the replies that have come (without waiting) from the workers with shares in
        hand; whether a share came."""
        came = False
        for i in list(self._hands):
            while self._hands[i]:
                reply = self._pool._receive(self._pool._workers[i], self._job, block=False)
                if reply is None:
                    break
                if reply == READY:  # before its share: `ready` had not seen it
                    self._set_ready(i)
                    continue
                with self._lock:
                    shares, share = self._hands[i].popleft()
                shares[share], came = cast(HostChunk, reply), True
        return came


if __name__ == "__main__":  # the pool's fork server; its workers, forked from it, have this module as `__main__`
    forks.serve(socket.socket(fileno=int(sys.argv[1])), _serve)
