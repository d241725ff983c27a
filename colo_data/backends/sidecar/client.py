"""The trainer side of a sidecar: connects to one host's sidecar, opens a stream at a global
position, and yields host batches as numpy views into shared memory. A slot (one or more
batches) is released when the batch after its last one is asked for, so the consumer must
be done with a batch (copied to the devices) by then; or, with `copy=True`, the slot is
copied out and released at once."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Any

import cloudpickle
import numpy as np
import psutil

from colo_data.backends.sidecar.auth import KEY_ENV, key_path, read_key
from colo_data.backends.sidecar.protocol import FAMILY, raise_remote, socket_path
from colo_data.backends.sidecar.shm import ArraySpec, ShmReader
from colo_data.errors import SidecarError
from colo_data.host.chunk import HostChunk, split_rows
from colo_data.spec.pipeline import Pipeline
from colo_data.telemetry.counters import HANDOFF, StageTimes

_POLL_S = 0.5
CLOSE_S = 5.0


class SidecarClient:
    """One connection to the sidecar at `address`. `pid`, when known (a local sidecar),
    lets a dead sidecar be told apart from a slow one while waiting for a batch. `stats`
    holds the sidecar's latest telemetry counters (sent with each slot), `handoff` the time
    this side spends mapping (or copying out) the slots."""

    def __init__(self, address: str, pid: int | None = None, connect_timeout: float = 60.0) -> None:
        self.address, self.pid = address, pid
        deadline = time.monotonic() + connect_timeout
        path = socket_path(address)
        while True:
            try:
                key = read_key(path)
                if key is None:  # the sidecar writes its key before it binds its socket
                    raise FileNotFoundError(errno.ENOENT, "no key file beside the socket", key_path(path))
                self._conn: Connection = Client(path, FAMILY, authkey=key)
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() > deadline or not self._alive():
                    raise SidecarError(
                        f"no sidecar answers at {address} ({e.strerror}): start one with "
                        "`colo-data sidecar serve CONFIG --socket PATH`, or check the path"
                    ) from e
                time.sleep(0.1)
            except PermissionError as e:
                raise SidecarError(
                    f"no permission to connect to the sidecar at {address}: run the trainer as the sidecar's user, "
                    "or give the sidecar a --socket-mode that lets its group in (e.g. 660)"
                ) from e
            except AuthenticationError as e:
                raise SidecarError(
                    f"the sidecar at {address} refused this trainer's key ({e}): the key file beside its socket is "
                    f"from another sidecar, or {KEY_ENV} differs between the two sides"
                ) from e
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] | None = None
        self.handoff = StageTimes()
        self._reader: ShmReader | None = None

    def _alive(self) -> bool:
        if self.pid is None:
            return True
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _died(self, doing: str) -> SidecarError:
        self._sweep()
        return SidecarError(
            f"the sidecar at {self.address} died or closed the connection while the trainer {doing}; "
            "its shared-memory slots were removed. Check its log (an out-of-memory kill?) and restart it."
        )

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._conn.send(message)
        except OSError as e:
            raise self._died(f"sent {message['op']!r}") from e

    def _receive(self, waiting_for: str, deadline: float | None = None) -> dict[str, Any]:
        """The sidecar's next message, telling a dead sidecar from a slow one; a
        SidecarError past `deadline` (monotonic seconds) too."""
        try:
            while not self._conn.poll(_POLL_S):
                if not self._alive():
                    raise EOFError
                if deadline is not None and time.monotonic() > deadline:
                    raise SidecarError(
                        f"the sidecar at {self.address} did not answer in time while the trainer waited for {waiting_for}"
                    )
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died(f"waited for {waiting_for}") from e

    def _checked(self, reply: dict[str, Any]) -> dict[str, Any]:
        if "error" in reply:
            raise_remote(reply, self.address)
        return reply

    def _sweep(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader.unlink_all()
            self._reader = None

    def batches(
        self, pipeline: Pipeline | None, host: int, hosts: int, position: int, copy: bool = False
    ) -> Iterator[HostChunk]:
        """Open a stream and yield this host's batches: views valid until the next one, or,
        with `copy`, arrays of the trainer's own (for a consumer that keeps them)."""
        try:
            self._send(
                {
                    "op": "open",
                    "pipeline": None if pipeline is None else cloudpickle.dumps(pipeline),
                    "host": host,
                    "hosts": hosts,
                    "position": position,
                }
            )
            self.info = self._checked(self._receive("the stream to open"))
            self._reader = ShmReader(self.info["shm_dir"], self.info["names"])
            while True:
                announced = self._checked(self._receive("a batch"))
                if announced.get("end"):
                    return
                t0 = time.perf_counter()
                slot = announced["slot"]
                self.stats = announced.get("stats", self.stats)
                group = self._reader.view(slot, [ArraySpec.from_wire(spec) for spec in announced["layout"]])
                if copy:
                    group = {name: np.array(array) for name, array in group.items()}
                    self._send({"op": "release", "slot": slot})
                self.handoff.add(HANDOFF, time.perf_counter() - t0, 0, 0)  # the Loader counts the records and bytes
                yield from split_rows(iter([HostChunk(group, announced.get("after"))]), self.info["rows"])
                if not copy:
                    self._send({"op": "release", "slot": slot})
        finally:
            self._finish()

    def _finish(self) -> None:
        """End the session (the sidecar then removes its ring) and the connection, waiting
        at most `CLOSE_S` for the sidecar to confirm."""
        try:
            if self._reader is not None:
                self._send({"op": "close"})
                deadline = time.monotonic() + CLOSE_S
                while not self._receive("the stream to close", deadline).get("closed"):
                    pass  # announcements that were already on their way
                self._reader.close()
                self._reader = None
        except SidecarError:
            pass
        finally:
            self.close()

    def close(self, timeout: float = 0.0) -> None:
        """Close the connection (the sidecar then ends the session); safe to call twice."""
        try:
            self._conn.close()
        except OSError:  # closed already, from another thread
            pass

