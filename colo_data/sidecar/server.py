"""The sidecar: one process per host that owns the host's CPU budget, runs its share of the
pipeline in worker processes and writes each host batch once into a shared-memory slot,
from which the trainer reads it without a copy. It serves one trainer session at a time
over a Unix socket (see `colo_data.sidecar.protocol`)."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, Listener
from typing import Any

import cloudpickle
import psutil

from colo_data.errors import ConfigError
from colo_data.host import HostBatch, HostPipeline
from colo_data.pipeline import Pipeline
from colo_data.resources import cpu_budget, memory_limit
from colo_data.shm import ShmRing, slot_bytes
from colo_data.sidecar.protocol import FAMILY, error_reply

_WATCH_S = 0.5


class _Session:
    """One trainer's stream: the host pipeline, the ring, and a producer thread that keeps
    every free slot filled ahead of the trainer's requests."""

    def __init__(self, pipeline: Pipeline, host: int, hosts: int, position: int, workers: int, shm_dir: str, slots: int):
        # One worker runs here, on the producer thread: the sidecar already is a process of
        # its own, and a single worker process would only add a hop (measured: half the rate).
        processes = workers if workers > 1 else 0
        self._batches: Iterator[HostBatch] = HostPipeline(pipeline, host, hosts, processes).batches(position)
        try:
            first = next(self._batches, None)
            size = slot_bytes(first) if first is not None else 1
            self.ring = ShmRing.create(shm_dir, slots, size, memory_limit())  # sweeps stale rings, checks room
        except BaseException:
            self._close_batches()
            raise
        self._free: queue.Queue[int] = queue.Queue()
        self._ready: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        for slot in range(slots):
            self._free.put(slot)
        self._thread = threading.Thread(target=self._produce, args=(first,), name="colo-data-sidecar-produce", daemon=True)
        self._thread.start()

    def _produce(self, first: HostBatch | None) -> None:
        try:
            batch = first
            while batch is not None and not self._stop.is_set():
                slot = self._free.get()
                if slot < 0:
                    return
                layout = self.ring.write(slot, batch)
                self._ready.put({"slot": slot, "layout": [spec.to_wire() for spec in layout]})
                batch = next(self._batches, None)
            self._ready.put({"end": True})
        except BaseException as e:  # sent to the trainer at its next request
            self._ready.put(error_reply(e))

    def next(self) -> dict[str, Any]:
        return self._ready.get()

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        self._free.put(-1)
        self._thread.join()
        self._close_batches()
        self.ring.close()

    def _close_batches(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class SidecarServer:
    """Serves trainer sessions on `socket_path` until stopped. `pipeline` (from a config) is
    used when the trainer sends none; `workers=None` takes the CPU budget's worker count,
    re-read at start. With `exit_with`, the server exits when that process dies."""

    def __init__(
        self,
        socket_path: str,
        *,
        pipeline: Pipeline | None = None,
        shm_dir: str = "/dev/shm",
        workers: int | None = None,
        slots: int = 4,
        exit_with: int | None = None,
    ) -> None:
        if slots < 2:
            raise ConfigError(f"slots={slots}: the ring needs at least 2 slots (one read, one written)")
        self.socket_path = socket_path
        self.pipeline = pipeline
        self.shm_dir = shm_dir
        self.budget = cpu_budget()
        self.workers = self.budget.workers if workers is None else workers
        self.slots = slots
        self._session: _Session | None = None
        if exit_with is not None:
            threading.Thread(target=self._watch, args=(exit_with,), name="colo-data-sidecar-watch", daemon=True).start()

    def _watch(self, pid: int) -> None:
        """Exit, removing the ring, once the trainer that started this sidecar is gone."""
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(_WATCH_S)
        if self._session is not None:
            self._session.ring.close()
        for child in psutil.Process().children(recursive=True):
            if "resource_tracker" not in " ".join(child.cmdline()):  # it cleans up after us once we are gone
                child.kill()
        os._exit(0)

    def _open(self, request: dict[str, Any]) -> dict[str, Any]:
        pipeline = cloudpickle.loads(request["pipeline"]) if request.get("pipeline") else self.pipeline
        if pipeline is None:
            raise ConfigError("the trainer sent no pipeline and this sidecar was started without a CONFIG")
        self._session = _Session(
            pipeline, request["host"], request["hosts"], request["position"], self.workers, self.shm_dir, self.slots
        )
        ring = self._session.ring
        return {
            "names": ring.names,
            "shm_dir": self.shm_dir,
            "slots": self.slots,
            "workers": self.workers,
            "budget": {"cpus": self.budget.cpus, "workers": self.budget.workers, "source": self.budget.source},
        }

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    request = conn.recv()
                except EOFError:  # the trainer went away
                    return
                op = request.get("op")
                if op == "release":
                    if self._session is not None:
                        self._session.release(request["slot"])
                    continue
                try:
                    if op == "open":
                        reply = self._open(request)
                    elif op == "next":
                        reply = self._session.next()
                    elif op == "close":
                        self._end_session()
                        conn.send({"closed": True})
                        return
                    else:
                        reply = error_reply(ConfigError(f"unknown sidecar request {op!r}"))
                except Exception as e:
                    reply = error_reply(e)
                conn.send(reply)
        finally:
            self._end_session()

    def _end_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def serve_forever(self) -> None:
        with Listener(self.socket_path, FAMILY) as listener:
            while True:
                with listener.accept() as conn:
                    self._serve(conn)

