"""The sidecar's connection key. Every message on the socket is unpickled, so a connection
proves that it knows the key (the standard library's `multiprocessing.connection` challenge,
which reads raw bytes, never a pickle) before anything is read from it. The key comes from
`COLO_DATA_SIDECAR_KEY` (hex, the same on both sides), else from a file beside the socket
that the sidecar writes at start, readable by its owner (and its group, with a group-
readable `--socket-mode`)."""

from __future__ import annotations

import os
import secrets

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
        SidecarError: the key file exists but this process may not read it.
    """
    key = _from_env()
    if key is not None:
        return key
    path = key_path(socket_path)
    try:
        with open(path) as f:
            return bytes.fromhex(f.read().strip())
    except FileNotFoundError:
        return None
    except PermissionError as e:
        raise SidecarError(
            f"cannot read the sidecar's key {path} ({e.strerror}): run the trainer as the sidecar's user, give the "
            f"sidecar a group-readable --socket-mode (e.g. 660), or set {KEY_ENV} to the same key on both sides"
        ) from e
