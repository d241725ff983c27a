"""The sidecar's connection key and handshake. Every message on the socket is unpickled, so
a connection proves that it knows the key (the standard library's `multiprocessing.connection`
challenge, which reads raw bytes, never a pickle) before anything is read from it, within a
time limit on both sides (on the sidecar's, for the whole challenge: a silent peer, or one
that answers a byte at a time, cannot hold its door; a frozen sidecar cannot hold the
trainer). The key comes from `COLO_DATA_SIDECAR_KEY` (hex, the same on both sides), else
from a file beside the socket that the sidecar writes at start, readable by its owner (and
its group, with a group-readable `--socket-mode`).

Who may serve: the trainer unpickles what the sidecar sends, so before it connects it checks
that nobody but itself and root could have put the socket and the key there
(`check_trusted`): another user's sidecar at its address would otherwise run code in it."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from colo_data.errors import ConfigError, SidecarError

KEY_ENV = "COLO_DATA_SIDECAR_KEY"
_KEY_BYTES = 32


def key_path(socket_path: str) -> str:
    """The key file of the sidecar listening on `socket_path`."""
    return socket_path + ".key"


def _from_env() -> bytes | None:
    text = os.environ.get(KEY_ENV)
    if text is None:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ConfigError(f"{KEY_ENV} must be at least 16 bytes in hex (e.g. `openssl rand -hex 32`), got {text!r}")
    return key


def make_key(socket_path: str, socket_mode: int) -> bytes:
    """The sidecar's key: `COLO_DATA_SIDECAR_KEY`, else a new random one written to
    `key_path(socket_path)` (replacing a dead sidecar's), readable by those of the socket's
    owner and group who may connect (`socket_mode`), never by others."""
    key = _from_env()
    if key is not None:
        return key
    key = secrets.token_bytes(_KEY_BYTES)
    path = key_path(socket_path)
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key.hex().encode())
        os.fchmod(fd, socket_mode & 0o640)
    finally:
        os.close(fd)
    return key


def read_key(socket_path: str) -> bytes | None:
    """The key to connect to the sidecar on `socket_path` with: `COLO_DATA_SIDECAR_KEY`, else
    its key file; None while the file is not there yet (the sidecar is starting).

    Raises:
        SidecarError: the key file exists but this process may not read it, or another
            user could have written it (see `check_trusted`).
    """
    key = _from_env()
    if key is not None:
        return key
    path = key_path(socket_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except PermissionError as e:
        raise SidecarError(
            f"cannot read the sidecar's key {path} ({e.strerror}): run the trainer as the sidecar's user, give the "
            f"sidecar a group-readable --socket-mode (e.g. 660), or set {KEY_ENV} to the same key on both sides"
        ) from e
    except OSError as e:  # ELOOP: a symbolic link, which O_NOFOLLOW refuses
        raise _untrusted(path, "the sidecar's key", f"cannot be opened as a plain file ({e.strerror})") from e
    with open(fd) as f:
        _check_owner(path, "the sidecar's key", os.fstat(fd), _OTHERS_WRITE)
        return bytes.fromhex(f.read().strip())


_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _untrusted(path: str, what: str, why: str) -> SidecarError:
    return SidecarError(
        f"refusing to connect: {what} {path} {why}. The trainer unpickles what the sidecar sends, so whoever can put "
        f"a socket or key there can run code in this trainer (uid {os.geteuid()}). Keep the socket in a directory "
        "owned by the trainer's user or root and writable by its owner only (e.g. `mkdir -m 755 /run/colo` as root, "
        "or `chmod go-w DIR`), not in a shared one such as /tmp (its sticky bit does not stop another user from "
        "taking a free name), and run the sidecar as the trainer's user or root"
    )


def _check_owner(path: str, what: str, info: os.stat_result, forbidden: int) -> None:
    """Raise SidecarError unless `info` (of `path`) belongs to this process's user or root
    and has none of the write bits `forbidden`."""
    if info.st_uid not in (os.geteuid(), 0):
        raise _untrusted(path, what, f"belongs to uid {info.st_uid}, not to this trainer's user (uid {os.geteuid()}) or root")
    if info.st_mode & forbidden:
        who = {stat.S_IWOTH: "others", stat.S_IWGRP: "its group"}.get(info.st_mode & forbidden, "its group and others")
        raise _untrusted(path, what, f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})")


def check_trusted(socket_path: str) -> None:
    """Before connecting: refuse a socket that another user owns, or whose directory
    another user could write (they could put their own sidecar and key there). What is not
    there yet passes (the sidecar is starting); the key file is checked as it is read
    (`read_key`). The socket's own write bit is the right to connect (a group's, with
    `--socket-mode 660`), not to replace it: the key guards that.

    Raises:
        SidecarError: naming the path, why it is not trusted, and how to fix it.
    """
    holders = (os.path.dirname(os.path.abspath(socket_path)), os.path.dirname(os.path.realpath(socket_path)))
    for directory in dict.fromkeys(holders):  # the link's and, for a symbolic link, its target's
        try:
            _check_owner(directory, "the directory of the sidecar's socket", os.stat(directory), _OTHERS_WRITE)
        except FileNotFoundError:
            continue
    try:
        _check_owner(socket_path, "the sidecar's socket", os.stat(socket_path), 0)
    except FileNotFoundError:
        pass


def set_timeout(conn: Connection, seconds: float) -> None:
    """Bound each blocking read and write on `conn` to `seconds` (0: unbounded): past it,
    they raise `BlockingIOError` instead of waiting for a peer that has stopped."""
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as duplicate:  # same socket, own fd
        duplicate.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        duplicate.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def peer_pid(conn: Connection) -> int:
    """The pid of the process at the other end of a Unix socket (0 when it is in another
    pid namespace, e.g. another container)."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as duplicate:
        pid, _, _ = struct.unpack("3i", duplicate.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid)


def admit(conn: Connection, key: bytes, timeout: float) -> None:
    """The sidecar's side of the handshake: the peer must answer the challenge, and pass
    one of its own, within `timeout` seconds in all: a timer shuts the socket at the deadline,
    and a read or write blocked on it returns at once. (A limit on each read let a peer that
    sends a byte at a time hold the handshake as long as it liked.) Past the handshake, reads
    and writes wait as long as a session lasts.

    Raises:
        multiprocessing.AuthenticationError: the peer does not know the key.
        OSError, EOFError: it was silent, or slow, for `timeout` seconds, or left.
    """
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as duplicate:  # same socket, own fd
            with contextlib.suppress(OSError):  # the peer has gone meanwhile: the handshake fails on its own
                duplicate.shutdown(socket.SHUT_RDWR)

    deadline = threading.Timer(timeout, expire)
    deadline.daemon = True
    deadline.start()
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
    finally:
        deadline.cancel()
        deadline.join()  # a shut that has begun ends before the caller uses or closes `conn`
    if expired.is_set():  # it passed just as the time ran out: the socket is shut all the same
        raise TimeoutError(f"the key challenge took longer than {timeout:g} s")


class QueueFull(ConnectionError):
    """The socket refused a connection with EAGAIN: the queue of connections waiting for the
    sidecar to let them in is full. The sidecar is there (busy with many connections, or
    stopped); it has not been silent."""


def connect(path: str, key: bytes, timeout: float) -> Connection:
    """The trainer's side: a connection to the sidecar on `path`, whose reads and writes
    stay bounded by `timeout` seconds (a sidecar that stops answering is an OSError, not a
    hang).

    Raises:
        QueueFull: the sidecar's queue of waiting connections is full; try again.
        multiprocessing.AuthenticationError: the sidecar has another key.
        OSError, EOFError: nobody listens, or the sidecar did not answer in time.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except BlockingIOError as e:  # with a timeout the socket is non-blocking: a full queue is EAGAIN at once
            raise QueueFull(e.errno, f"the queue of connections waiting for the sidecar on {path} is full") from e
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    conn = Connection(sock.detach())
    try:
        set_timeout(conn, timeout)
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn
