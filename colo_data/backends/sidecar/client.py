"""The trainer side of a sidecar: connects to one host's sidecar, opens a session at a global
position, and yields host batches as numpy views into shared memory. A slot (one or more
batches) is released when the batch after its last one is asked for, so the consumer must
be done with a batch (copied to the devices) by then; or, with `copy=True`, the slot is
copied out and released at once."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any, cast

import cloudpickle
import numpy as np
import psutil

from colo_data import defaults
from colo_data.backends.sidecar.auth import KEY_ENV, QueueFull, check_trusted, connect, key_path, read_key
from colo_data.backends.sidecar.protocol import SESSION_END_S, check_path_length, socket_path
from colo_data.backends.sidecar.shm import ArraySpec, ShmReader
from colo_data.errors import SidecarError, Wire, from_wire
from colo_data.host.chunk import HostChunk, split_rows
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.order import Position
from colo_data.telemetry.counters import HANDOFF, StageTimes

_POLL_S = 0.5
CLOSE_S = 5.0
_LOCAL_START_S = 60.0  # a sidecar this process started is waited for this long (or `timeout`) while it starts


class SidecarClient:
    """One connection to the sidecar at `address`. `pid`, when known (a local sidecar),
    lets a dead sidecar be told apart from a slow one while waiting for a batch. A sidecar
    that sends nothing, not even its heartbeat, for `timeout` seconds while the trainer
    waits is taken for frozen (a `SidecarError`). A sidecar given by address is waited for
    `connect_timeout` seconds, by default `timeout`; one this process started (`pid`), as
    long as it lives, up to `_LOCAL_START_S` or `timeout` (its imports take seconds on a
    busy host). A sidecar whose queue of waiting connections is full is retried as long,
    then reported busy. `stats` holds the sidecar's latest
    telemetry counters (sent with each slot), `handoff` the time this side spends mapping
    (or copying out) the slots."""

    def __init__(
        self,
        address: str,
        pid: int | None = None,
        connect_timeout: float | None = None,
        timeout: float = defaults.SIDECAR_TIMEOUT_S,
    ) -> None:
        self.address, self.pid, self.timeout = address, pid, timeout
        self._frozen = self._closed = False
        if connect_timeout is None:
            connect_timeout = timeout if pid is None else max(timeout, _LOCAL_START_S)
        self._conn: Connection = self._connect(connect_timeout)
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] | None = None
        self.handoff = StageTimes()
        self._reader: ShmReader | None = None
        # the sidecar admits this trainer, or says that it serves another (after waiting
        # for a session that is ending, `SESSION_END_S`, without heartbeats)
        try:
            self._checked(self._receive("the sidecar to admit it", silence=SESSION_END_S + timeout))
        except BaseException:
            self.close()
            raise

    def _connect(self, connect_timeout: float) -> Connection:
        """Connect once the socket and its key are there and trusted (`check_trusted`:
        nothing is read from a socket another user could have put there), waiting up to
        `connect_timeout` seconds for them."""
        path = socket_path(self.address)
        check_path_length(path)
        started = time.monotonic()
        while True:
            try:
                check_trusted(path)
                key = read_key(path)
                if key is None:  # the sidecar writes its key before it binds its socket
                    raise FileNotFoundError(errno.ENOENT, "no key file beside the socket", key_path(path))
                return connect(path, key, self.timeout)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() - started > connect_timeout or not self._alive():
                    raise self._absent(path, time.monotonic() - started, e) from e
                time.sleep(0.1)
            except QueueFull as e:  # room comes as the sidecar lets the connections before this one in
                if time.monotonic() - started > connect_timeout:
                    raise self._queue_full(time.monotonic() - started) from e
                time.sleep(0.1)
            except PermissionError as e:
                raise SidecarError(
                    f"no permission to connect to the sidecar at {self.address}: run the trainer as the sidecar's "
                    "user, or give the sidecar a --socket-mode that lets its group in (e.g. 660)"
                ) from e
            except AuthenticationError as e:
                raise SidecarError(
                    f"the sidecar at {self.address} refused this trainer's key ({e}): the key file beside its socket "
                    f"is from another sidecar, or {KEY_ENV} differs between the two sides"
                ) from e
            except (BlockingIOError, TimeoutError) as e:
                self._frozen = True
                raise self._silent("connected") from e
            except (EOFError, OSError) as e:
                raise SidecarError(
                    f"the sidecar at {self.address} closed the connection during the key challenge ({e!r}): check its log"
                ) from e

    def _absent(self, path: str, waited: float, error: OSError) -> SidecarError:
        """The error for a sidecar not found within `waited` seconds: its key file missing
        beside its socket, or no sidecar at all."""
        key = key_path(path)
        if error.filename == key and os.path.exists(path):
            return SidecarError(
                f"the sidecar's key file {key} is missing, though its socket {path} is there: a sidecar writes its key "
                "there before it listens and removes both when it stops. Restart the sidecar if this socket is a killed "
                f"one's; mount the same directory {os.path.dirname(path)} in the trainer and the sidecar; or set "
                f"{KEY_ENV} to the same key on both sides"
            )
        if not os.path.lexists(path):
            why = "nothing is at that path"
        elif isinstance(error, ConnectionRefusedError):
            why = "nothing listens on the socket there: a sidecar that was killed leaves it"
        else:
            why = str(error.strerror)
        return SidecarError(
            f"no sidecar answers at {self.address} after {waited:.1f} s ({why}): start one with "
            "`colo-data sidecar serve CONFIG --socket PATH`, or check the path (the trainer waits for a sidecar as "
            "long as cd.Sidecar(timeout=...) says)"
        )

    def _queue_full(self, waited: float) -> SidecarError:
        """The error for a sidecar whose queue of waiting connections stayed full for `waited`
        seconds: it is there, so not absent, and the socket refused at once, so not silent."""
        return SidecarError(
            f"the sidecar at {self.address} is busy: its queue of connections waiting to be let in stayed full for "
            f"{waited:.1f} s, so this trainer could not connect. A sidecar serves one trainer session at a time: give "
            "each trainer a sidecar of its own (another --socket), and find what else connects to it so often. A "
            "sidecar that is stopped (SIGSTOP) or hung lets nobody in either: check its process and its log"
        )

    def _alive(self) -> bool:
        if self.pid is None:
            return True
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _died(self, doing: str) -> SidecarError:
        if self._closed:  # by this trainer (a close from another thread): the sidecar and its ring are fine
            return SidecarError(f"the connection to the sidecar at {self.address} was closed while the trainer {doing}")
        self._sweep()
        return SidecarError(
            f"the sidecar at {self.address} died or closed the connection while the trainer {doing}; "
            "its shared-memory slots were removed. Check its log (an out-of-memory kill?) and restart it."
        )

    def _silent(self, doing: str, silence: float | None = None) -> SidecarError:
        """The error for a sidecar that has stopped answering; a local one's slots are swept
        (the loader stops it), a standalone one removes its own when it goes on."""
        state = ""
        if self.pid is not None:
            with contextlib.suppress(psutil.Error):
                status = psutil.Process(self.pid).status()
                state = f" Its process {self.pid} is {status}"
                state += f" (SIGSTOP? `kill -CONT {self.pid}` resumes it)." if status == psutil.STATUS_STOPPED else "."
            self._sweep()
        return SidecarError(
            f"the sidecar at {self.address} sent nothing for {silence or self.timeout:g} s while the trainer {doing}, not even "
            f"the heartbeat it sends every {defaults.HEARTBEAT_S:g} s while it works: it is stopped or hung, or its "
            f"host is overloaded.{state} If its pipeline is only slow, a batch is not the cause (the heartbeat goes "
            "on while it works); if its host is that busy, give it a larger cd.Sidecar(timeout=...)."
        )

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._conn.send(message)
        except (BlockingIOError, TimeoutError) as e:
            self._frozen = True
            raise self._silent(f"sent {message['op']!r}") from e
        except OSError as e:
            raise self._died(f"sent {message['op']!r}") from e

    def _receive(self, waiting_for: str, deadline: float | None = None, silence: float | None = None) -> dict[str, Any]:
        """The sidecar's next message other than a heartbeat, telling a dead sidecar and a
        frozen one (silent for `silence` seconds, default `timeout`) from a slow one; a
        SidecarError past `deadline` (monotonic seconds) too."""
        silence = self.timeout if silence is None else silence
        heard = time.monotonic()
        try:
            while True:
                while not self._conn.poll(_POLL_S):
                    now = time.monotonic()
                    if not self._alive():
                        raise EOFError
                    if now - heard > silence:
                        self._frozen = True
                        raise self._silent(f"waited for {waiting_for}", silence)
                    if deadline is not None and now > deadline:
                        raise SidecarError(
                            f"the sidecar at {self.address} did not answer in time while the trainer waited for {waiting_for}"
                        )
                message = self._conn.recv()
                heard = time.monotonic()
                if not message.get("alive"):
                    return message
        except (BlockingIOError, TimeoutError) as e:  # a message that stopped half-way
            self._frozen = True
            raise self._silent(f"waited for {waiting_for}") from e
        except (EOFError, OSError) as e:
            raise self._died(f"waited for {waiting_for}") from e

    def _checked(self, reply: dict[str, Any]) -> dict[str, Any]:
        if "error" in reply:
            raise from_wire(cast(Wire, reply), f"the sidecar at {self.address}", SidecarError)
        return reply

    def _sweep(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader.unlink_all()
            self._reader = None

    def batches(
        self,
        pipeline: AnyPipeline | None,
        host: int,
        hosts: int,
        position: Position,
        copy: bool = False,
    ) -> Iterator[HostChunk]:
        """Open a session and yield this host's batches: views valid until the next one, or,
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
            self.info = self._checked(self._receive("the session to open"))
            self._reader = ShmReader(self.info["shm_dir"], self.info["names"])
            while True:
                began = time.monotonic()
                announced = self._checked(self._receive("a batch"))
                waited = time.monotonic() - began  # the trainer's wait for input: the sidecar's worker policy reads it
                if announced.get("end"):
                    return
                t0 = time.perf_counter()
                slot = announced["slot"]
                self.stats = announced.get("stats", self.stats)
                group = self._reader.view(slot, [ArraySpec.from_wire(spec) for spec in announced["layout"]])
                if copy:
                    group = {name: np.array(array) for name, array in group.items()}
                    self._send({"op": "release", "slot": slot, "waited": waited})
                self.handoff.add(HANDOFF, time.perf_counter() - t0, 0, 0)  # the Loader counts the records and bytes
                chunk = HostChunk(group, announced.get("after"), states=announced.get("states"))
                yield from split_rows(iter([chunk]), self.info["rows"])
                if not copy:
                    self._send({"op": "release", "slot": slot, "waited": waited})
        finally:
            self._finish()

    def _finish(self) -> None:
        """End the session (the sidecar then removes its ring) and the connection, waiting
        at most `CLOSE_S` for the sidecar to confirm (not at all for a frozen one)."""
        try:
            if self._reader is not None and not self._frozen:
                self._send({"op": "close"})
                deadline = time.monotonic() + CLOSE_S
                while not self._receive("the session to close", deadline).get("closed"):
                    pass  # announcements that were already on their way
        except SidecarError:
            pass
        finally:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            self.close()

    def close(self, timeout: float = 0.0) -> None:
        """Close the connection (the sidecar then ends the session); safe to call twice."""
        self._closed = True
        try:
            self._conn.close()
        except OSError:  # closed already, from another thread
            pass
