"""The sidecar: one process per host that owns the host's CPU budget, runs its share of the
pipeline in worker processes and writes each host batch once into a shared-memory slot
(small batches several to a slot), from which the trainer reads it without a copy. It
serves one trainer session at a time over a Unix socket (see
`colo_data.backends.sidecar.protocol`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from typing import Any, NamedTuple, NoReturn

import cloudpickle
import numpy as np
import psutil

from colo_data import defaults
from colo_data.backends.sidecar.auth import KEY_ENV, admit, key_path, make_key, peer_pid
from colo_data.backends.sidecar.protocol import FAMILY, SESSION_END_S, check_path_length
from colo_data.backends.sidecar.ring_plan import RingPlan
from colo_data.backends.sidecar.shm import ShmRing, check_directory
from colo_data.errors import ConfigError, SidecarError, to_wire
from colo_data.host.chunk import HostChunk, split_rows
from colo_data.host.chunk_work import ChunkPool
from colo_data.host.shares import host_pipeline
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.budget import CpuBudget, cpu_budget
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import close_iterator
from colo_data.telemetry.counters import SHM_WRITE, CpuMeter
from colo_data.workers.pools import start_pool
from colo_data.workers.settings import Workers, choose_workers

_WATCH_S = 0.5
_LEAVE_S = 5.0  # a thread inside the session's batches is waited for this long when it closes
_HANDSHAKE_S = 5.0  # a peer that has not passed the key challenge by then is dropped
_GREETERS = 16  # connections in the key challenge at once, each on a thread of its own; the next wait in the queue
_BACKLOG = 64  # connections waiting in the socket's queue to be let in; one more is refused (EAGAIN)
_RACE_S = 1.0  # a trainer that has just died may not have been noticed yet: wait this long before `busy`
_PROBE_S = 2.0  # a live sidecar accepts a connection at once, even mid-session (the backlog)


def copy_threads(budget: CpuBudget) -> int:
    """Threads that copy a large batch into its slot: the budget's whole CPUs (the copy is
    the sidecar's work between two batches; its workers wait for a free slot meanwhile)."""
    return max(1, int(budget.cpus))


class _Session:
    """One trainer's session: the host pipeline, the ring, and a producer thread that fills
    every free slot with the next `per_slot` host batches and announces it to the trainer
    unasked (so a slot costs the trainer one release message, not a round trip). Each
    announcement carries the session's cumulative telemetry counters (`stats`)."""

    def __init__(
        self,
        pipeline: AnyPipeline,
        host: int,
        hosts: int,
        position: Position,
        shm_dir: str,
        slots: int,
        copy_threads: int,
        pool: ChunkPool | None,
        server: Lifecycle,
    ) -> None:
        host_share = host_pipeline(pipeline, host, hosts, pool)
        self.stages, self.worker_stages, self.quality = host_share.stages, host_share.worker_stages, host_share.quality
        self._host = host_share
        self.cpu = CpuMeter("children" if pool is not None else "thread")  # sampled on the producer thread
        self.slots = slots
        self._in_use = [0.0, 0.0]  # sum of the slots in use at each announcement, announcements
        self.rows = len(host_share.rows)
        self._owner = server.child(f"sidecar session of host {host} of {hosts}")
        self._chunks: Iterator[HostChunk] = host_share.chunks(position, self._owner)
        try:
            first = next(self._chunks, None)
            chunks = iter(()) if first is None else itertools.chain([first], self._chunks)
            total = None if isinstance(position, np.ndarray) else pipeline.batches_from(position)
            if first is None:  # no batch at all: a ring of one-byte slots announces the end
                self.per_slot, size, limit = 1, 1, None
            else:
                plan = RingPlan.of(first.columns, self.rows, host_share.chunk, total, shm_dir, slots)
                self.per_slot, size, limit = plan.per_slot, plan.slot_size, plan.memory_limit
            self._groups = split_rows(chunks, self.rows * self.per_slot)
            self._first = next(self._groups, None)
            self.ring = ShmRing.create(shm_dir, slots, size, limit, copy_threads)  # sweeps stale rings, checks room
        except BaseException:
            self._close_batches()
            raise
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(slot)
        self._rows = [0] * slots  # of the batches in each slot, told to the worker policy as the trainer releases it
        self._thread: threading.Thread | None = None
        self.working = True  # computing a batch (heartbeats go out), not waiting for a free slot or done

    def start(self, send: Callable[[Mapping[str, Any]], None]) -> None:
        """Start filling slots; each filled one, the end and any error go out through `send`."""
        self._thread = threading.Thread(target=self._produce, args=(send,), name="colo-data-sidecar-produce", daemon=True)
        self._thread.start()

    def _stats(self, now: float) -> dict[str, Any]:
        """The cumulative counters an announcement carries: stage values, the CPU sample
        (seconds since the session's first, CPU seconds of its workers since then), the
        ring's fill (sum of slots in use at each announcement, announcements), each
        worker's stage values, the data-quality counts, and the workers at work now and why."""
        self.cpu.maybe_sample(now)
        self._in_use[0] += self.slots - self._free.qsize()
        self._in_use[1] += 1
        workers = [list(w.values) for w in self.worker_stages]
        return {
            "stages": list(self.stages.values),
            "cpu": self.cpu.sample,
            "ring": tuple(self._in_use),
            "workers": workers,
            "quality": self.quality.snapshot(),
            "at_work": self._host.workers_now(),
        }

    def _produce(self, send: Callable[[Mapping[str, Any]], None]) -> None:
        try:
            try:
                self.cpu.take()
                batch, self._first = self._first, None
                while batch is not None:
                    self.working = False
                    slot = self._free.get()
                    self.working = True
                    if slot < 0:
                        return
                    t0 = time.perf_counter()
                    layout = self.ring.write(slot, batch.columns)
                    self._rows[slot] = batch.rows
                    t1 = time.perf_counter()
                    self.stages.add(SHM_WRITE, t1 - t0, batch.rows, sum(array.nbytes for array in batch.columns.values()))
                    wire = [spec.to_wire() for spec in layout]
                    send({"slot": slot, "layout": wire, "after": batch.end, "states": batch.states, "stats": self._stats(t1)})
                    self._host.downstream.worked(time.perf_counter() - t0)  # not a wait for room: the worker policy's to know
                    batch = next(self._groups, None)
                send({"end": True})
            except Exception as e:
                send(to_wire(e))
        except OSError:  # the trainer is gone; the session is being closed
            return
        finally:
            self.working = False

    def release(self, slot: int, waited: float | None = None) -> None:
        """The trainer is done with `slot`, which it had waited `waited` seconds for (a
        trainer of an earlier version does not say): the worker policy is told both."""
        if waited is not None:
            self._host.downstream.trainer_waited(waited)
            self._host.downstream.trainer_took(self._rows[slot])
        self._free.put(slot)

    def close(self) -> None:
        self._free.put(-1)
        if self._thread is not None:
            self._thread.join()
        self._close_batches()
        self.ring.close()

    def _close_batches(self) -> None:
        """Close the session's batches: a thread of the pipeline still inside them (stopping
        with the workers) is waited for, up to `_LEAVE_S`, so that nothing is left open for
        the interpreter's exit to close (a traceback there, Grain's iterators' included)."""
        deadline = time.monotonic() + _LEAVE_S
        while True:
            try:
                close_iterator(self._chunks)
                break
            except ValueError:  # "generator already executing": another thread is inside it
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        self._owner.close()


class _Active(NamedTuple):
    """The trainer being served: its pid (0 if unknown), since when (epoch seconds), and
    whether its session is ending (it closed it, or went away)."""

    pid: int
    since: float
    ending: bool = False


class SidecarServer:
    """Serves trainer sessions on `socket_path` until stopped. `pipeline` (from a config) is
    used when the trainer sends none; `workers="auto"` picks the count from the CPU budget,
    read at start, less the sidecar's own thread and, for a trainer's own sidecar (the
    trainer on the same CPUs), the trainer's. With `exit_with` (a trainer's own sidecar),
    the server exits when that process dies. The socket
    gets `socket_mode` (owner-only by default), and a connection must prove it knows the
    key (`auth.py`) before anything it sends is unpickled."""

    def __init__(
        self,
        socket_path: str,
        *,
        pipeline: AnyPipeline | None = None,
        shm_dir: str = defaults.SHM_DIR,
        workers: Workers = "auto",
        slots: int = defaults.SLOTS,
        exit_with: int | None = None,
        socket_mode: int = 0o600,
    ) -> None:
        if slots < 2:
            raise ConfigError(f"slots={slots}: the ring needs at least 2 slots (one read, one written)")
        self.socket_path = socket_path
        self.socket_mode = socket_mode
        self.pipeline = pipeline
        check_directory(shm_dir)  # a file or a read-only directory fails here, not at the first trainer's open
        self.shm_dir = shm_dir
        self.budget = cpu_budget()
        self.choice = choose_workers(workers, self.budget)
        self.workers = self.choice.count
        self.slots = slots
        self._session: _Session | None = None
        self._listener: Listener | None = None
        self._key = b""
        self._admitted: queue.Queue[Connection | None] = queue.Queue()  # from the door thread to the serving one
        self._stopping = threading.Event()  # `stop()`: the loop ends after the session in hand
        self._turn = threading.Condition()  # guards `_active`
        self._active: _Active | None = None  # the trainer admitted last, until its session has ended
        self._owner = Lifecycle("sidecar server")
        # One pool for every session (its processes start with the first session that hands
        # them work); the producer thread works beside them. Its fork server is a fork of this
        # process, which has imported what a worker needs, where it runs one thread yet.
        also = () if exit_with is None else (exit_with,)  # a trainer's own sidecar shares the trainer's CPUs
        self._pool = start_pool(self.choice, self._owner, self.budget, also, from_here=True)
        if exit_with is not None:
            threading.Thread(target=self._watch, args=(exit_with,), name="colo-data-sidecar-watch", daemon=True).start()

    def _watch(self, pid: int) -> None:
        """Exit once the trainer that started this sidecar is gone, removing the ring, the
        socket and, if the trainer made it for this sidecar, the socket's directory."""
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(_WATCH_S)
        self.leave(0)

    def leave(self, code: int) -> NoReturn:
        """Exit with `code` now: the open session's ring, the key, the socket (and a trainer's
        own socket directory) are removed and the processes left below this one killed, but
        the interpreter's exit is skipped: it would finalize a pipeline that a thread may still
        be closing (two closes of one Grain iterator raced there, and printed a traceback)."""
        if self._session is not None:
            self._session.ring.close()
        directory = os.path.dirname(self.socket_path)
        self._remove_key()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
            if os.path.basename(directory).startswith(defaults.LOCAL_SIDECAR_DIR_PREFIX):
                os.rmdir(directory)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):  # one that has just ended
                if "resource_tracker" not in " ".join(child.cmdline()):  # it cleans up after us once we are gone
                    child.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _open(self, request: dict[str, Any]) -> dict[str, Any]:
        pipeline = cloudpickle.loads(request["pipeline"]) if request.get("pipeline") else self.pipeline
        if pipeline is None:
            raise ConfigError("the trainer sent no pipeline and this sidecar was started without a CONFIG")
        self._session = _Session(
            pipeline,
            request["host"],
            request["hosts"],
            request["position"],
            self.shm_dir,
            self.slots,
            copy_threads(self.budget),
            self._pool,
            self._owner,
        )
        ring = self._session.ring
        return {
            "rows": self._session.rows,
            "names": ring.names,
            "shm_dir": self.shm_dir,
            "slots": self.slots,
            "workers": self.workers,
            "workers_chosen": self.choice.reason,
            "remote_workers": self.choice.ray is not None,
            "copy_threads": copy_threads(self.budget),
            "batches_per_slot": self._session.per_slot,
            "slot_bytes": ring.slot_size,
            "budget": {"cpus": self.budget.cpus, "workers": self.budget.workers, "source": self.budget.source},
        }

    def _serve(self, conn: Connection) -> None:
        """Answer one trainer's requests until it closes its session or goes away. While
        the sidecar works for it (opening the session, computing a batch) and has sent
        nothing for `HEARTBEAT_S`, a heartbeat goes out, so that the trainer can tell a slow
        pipeline from a frozen sidecar."""
        lock = threading.Lock()  # the producer, the heartbeat and this thread all send
        sent = [time.monotonic()]
        opening = [False]

        def send(message: Mapping[str, Any]) -> None:
            with lock:
                conn.send(message)
                sent[0] = time.monotonic()

        def beat(stop: threading.Event) -> None:
            while not stop.wait(defaults.HEARTBEAT_S / 2):
                session = self._session
                working = opening[0] or (session is not None and session.working)
                if working and time.monotonic() - sent[0] >= defaults.HEARTBEAT_S:
                    try:
                        send({"alive": True})
                    except OSError:  # the trainer is gone
                        return

        stop = threading.Event()
        heart = threading.Thread(target=beat, args=(stop,), name="colo-data-sidecar-heartbeat", daemon=True)
        heart.start()
        try:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, ConnectionResetError):  # the trainer went away
                    return
                op = request.get("op")
                if op == "release":
                    if self._session is not None:
                        self._session.release(request["slot"], request.get("waited"))
                    continue
                if op == "close":
                    self._ending()
                    self._end_session()  # the producer has stopped sending
                    send({"closed": True})
                    return
                try:
                    if op != "open":
                        raise ConfigError(f"unknown sidecar request {op!r}")
                    opening[0] = True
                    try:
                        reply = self._open(request)
                    finally:
                        opening[0] = False
                    send(reply)
                    assert self._session is not None  # `_open` made it
                    self._session.start(send)
                except Exception as e:
                    send(to_wire(e))
        finally:
            stop.set()
            heart.join()

    def _end_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def listen(self) -> None:
        """Bind the socket. A socket file that nobody listens on (left by a sidecar that was
        killed) is taken over; one that a live sidecar holds, a missing directory or a file
        that is not a socket are errors that say what to do.

        Raises:
            SidecarError: a sidecar already listens on the socket.
            ConfigError: the socket's directory is missing, its path is another file or too long.
        """
        path = self.socket_path
        check_path_length(path)
        directory = os.path.dirname(path) or os.curdir
        if not os.path.isdir(directory):
            raise ConfigError(
                f"--socket {path}: the directory {directory} does not exist; create it (mkdir -p {directory}) "
                "or choose another path"
            )
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise ConfigError(f"--socket {path} exists and is not a socket: remove it or choose another path")
            if _answers(path):
                raise SidecarError(f"a sidecar already listens on {path}: stop it, or give this one another --socket")
            os.unlink(path)  # a dead sidecar's
        self._key = make_key(path, self.socket_mode)  # before the socket: a client that finds the socket finds the key
        umask = os.umask(0o177)  # owner-only from the start; then the mode asked for
        try:
            self._listener = Listener(path, FAMILY, backlog=_BACKLOG)  # no authkey: `_greet` runs the challenge, timed
            os.chmod(path, self.socket_mode)
        except OSError as e:  # another sidecar took the path meanwhile
            self._remove_key()
            raise SidecarError(f"cannot listen on {path}: {e.strerror or e}; is another sidecar starting on it?") from e
        finally:
            os.umask(umask)

    def _remove_key(self) -> None:
        if KEY_ENV not in os.environ:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(key_path(self.socket_path))

    def serve_forever(self) -> None:
        """Serve trainer sessions, one at a time, until the process is stopped. A door
        thread accepts connections and each takes the key challenge on a thread of its own
        (`_greet`), so that trainers that come together, or behind a slow peer, are not
        held up by one another."""
        if self._listener is None:
            self.listen()
        assert self._listener is not None  # `listen` made it
        door = threading.Thread(target=self._door, args=(self._listener,), name="colo-data-sidecar-door", daemon=True)
        door.start()
        try:
            with self._listener:
                while not self._stopping.is_set():
                    conn = self._admitted.get()
                    if conn is None:  # woken by `stop()`
                        break
                    try:
                        with conn:
                            conn.send({"ready": True})
                            self._serve(conn)
                    except OSError:  # the trainer left before or during its session
                        pass
                    except Exception as e:  # a request that breaks the protocol: its session ends, not the sidecar
                        print(f"colo-data sidecar: ended a session on a bad request: {e!r}", file=sys.stderr)
                    except BaseException:  # stopping (SIGTERM) mid-session: the session ends below, without waiting
                        self._stop_workers()  # for workers busy with a chunk that nobody will take
                        raise
                    finally:
                        self._ending()
                        self._end_session()
                        with self._turn:
                            self._active = None
                            self._turn.notify_all()
        finally:
            self._stop_workers()
            self._end_session()
            self._remove_key()

    def stop(self) -> None:
        """Ask `serve_forever` to end (a SIGTERM, whose handler also raises SystemExit): it
        ends after the session in hand even where that exception, raised at any point of a
        session, is swallowed on its way (it was once, and the sidecar served on)."""
        self._stopping.set()
        self._admitted.put(None)

    def _stop_workers(self) -> None:
        """End the worker processes at once (the server is stopping): a session's producer
        waiting on them then ends, and so can the session."""
        if self._pool is not None:
            self._pool.close()

    def _door(self, listener: Listener) -> None:
        """Accept connections and start a `_greet` thread for each, at most `_GREETERS` at
        once: a flood of peers costs a bounded number of threads, each for at most
        `_HANDSHAKE_S`, while the next connections wait in the socket's queue."""
        greeters = threading.BoundedSemaphore(_GREETERS)
        while True:
            greeters.acquire()
            try:
                conn = listener.accept()
            except OSError:  # the listener was closed: the server is stopping
                return
            greet = threading.Thread(target=self._greet, args=(conn, greeters), name="colo-data-sidecar-greet", daemon=True)
            greet.start()

    def _greet(self, conn: Connection, greeters: threading.BoundedSemaphore) -> None:
        """Let `conn` in (`_admit`) once it has passed the key challenge within `_HANDSHAKE_S`
        in all. One that answers wrongly is dropped and logged to stderr; one that leaves,
        stays silent or is too slow (a health check, which cannot be told from a peer that
        gives up) is dropped quietly."""
        try:
            admit(conn, self._key, _HANDSHAKE_S)
        except AuthenticationError as e:
            print(f"colo-data sidecar: refused a connection on {self.socket_path}: {e}", file=sys.stderr)
            conn.close()
            return
        except (EOFError, OSError):  # left, or was silent or slow
            conn.close()
            return
        finally:
            greeters.release()  # a trainer that waits in `_admit` holds no place in the challenge
        try:
            self._admit(conn)
        except Exception as e:  # the next trainer must still be let in
            print(f"colo-data sidecar: could not admit a connection: {e!r}", file=sys.stderr)
            conn.close()

    def _admit(self, conn: Connection) -> None:
        """Hand `conn` to the serving thread, or tell its trainer that another is being
        served: at once (after `_RACE_S`, the time for a trainer that has just died to be
        noticed) while that trainer is connected, after at most `SESSION_END_S` while its
        session ends. Trainers that come together wait here side by side, each on its
        `_greet` thread; `_turn` lets one in."""
        now = time.monotonic()
        with self._turn:
            while self._active is not None:
                limit = now + (SESSION_END_S if self._active.ending else _RACE_S)
                if time.monotonic() >= limit:
                    break
                self._turn.wait(limit - time.monotonic())
            active = self._active
            if active is None:
                self._active = _Active(peer_pid(conn), time.time())
                self._admitted.put(conn)
                return
        who = f"the trainer with pid {active.pid}" if active.pid else "a trainer in another pid namespace"
        waiting = f"{time.time() - active.since:.0f} s"
        if active.ending:
            message = (
                f"the sidecar on {self.socket_path} is still ending the last session ({who}) after "
                f"{SESSION_END_S:g} s: its pipeline may be finishing a batch that takes that long; try again"
            )
        else:
            message = (
                f"the sidecar on {self.socket_path} is busy serving {who} since "
                f"{time.strftime('%H:%M:%S', time.localtime(active.since))} ({waiting}): a sidecar serves one "
                "trainer session at a time; close that loader first, or give this trainer a sidecar of its own "
                "(another --socket)"
            )
        with contextlib.suppress(OSError), conn:
            conn.send(to_wire(SidecarError(message)))

    def _ending(self) -> None:
        """The trainer being served has closed its session or gone: a trainer that comes
        now waits for the session to end instead of being told the sidecar is busy."""
        with self._turn:
            if self._active is not None:
                self._active = self._active._replace(ending=True)
                self._turn.notify_all()


def _answers(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_S)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # EAGAIN (or a timeout): a listener whose queue is full is still alive
        return True
    finally:
        probe.close()
    return True
