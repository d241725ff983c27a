"""Messages between a worker process and its parent over a Unix socket (a socketpair's:
bytes, no message bounds), with the numpy arrays in them sent out of band (pickle protocol
5): the array bytes go from the worker's memory into the socket and from the socket into
the buffer the parent's array will use, one kernel copy each way and no pickling of the
data. `multiprocessing.connection` copies a message four or five times, which cost workers
more than a light pipeline's whole work."""

from __future__ import annotations

import pickle
import select
import socket
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

_COUNT = struct.Struct("<II")  # buffers, header bytes
_SIZE = struct.Struct("<Q")


def send(sock: socket.socket, message: Any) -> None:
    """Send `message` (anything picklable); its contiguous arrays travel as raw bytes."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sock.sendall(_COUNT.pack(len(raws), len(header)) + b"".join(_SIZE.pack(r.nbytes) for r in raws) + header)
    for raw in raws:
        sock.sendall(raw)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise EOFError("the other end closed the socket")
        view = view[got:]


def _read(sock: socket.socket, size: int) -> bytearray:
    out = bytearray(size)
    _read_into(sock, memoryview(out))
    return out


def _read_buffer(sock: socket.socket, size: int) -> np.ndarray:
    """An out-of-band buffer: in memory that is not zeroed first, as a bytearray's is."""
    out = np.empty(size, np.uint8)
    _read_into(sock, out.data)
    return out


def receive(sock: socket.socket, alive: Callable[[], bool], poll_s: float) -> Any:
    """The next message; EOFError once the other end is gone (closed, or `alive()` says so
    while waiting)."""
    while not select.select([sock], [], [], poll_s)[0]:
        if not alive():
            raise EOFError("the other end died")
    count, header_size = _COUNT.unpack(_read(sock, _COUNT.size))
    sizes = [_SIZE.unpack_from(_read(sock, _SIZE.size))[0] for _ in range(count)]
    header = _read(sock, header_size)
    return pickle.loads(header, buffers=[_read_buffer(sock, size) for size in sizes])
