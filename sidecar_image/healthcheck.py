"""The sidecar image's health check: healthy (exit 0) when the sidecar listens on
$COLO_DATA_SOCKET. A non-blocking connect, with the standard library only, so it costs a
bare interpreter start, not colo-data's imports. A full backlog (EAGAIN: the sidecar is busy
with a trainer and has probes queued) still means a listening sidecar; a missing socket or
a refused connection (nobody listens) is unhealthy."""

from __future__ import annotations

import errno
import os
import socket
import sys

SCHEME = "unix://"


def probe(address: str) -> str | None:
    """None when a sidecar listens at `address`, else why not."""
    path = address[len(SCHEME) :] if address.startswith(SCHEME) else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        code = sock.connect_ex(path)
    if code in (0, errno.EAGAIN, errno.EINPROGRESS):
        return None
    return f"no sidecar listens on {path}: {os.strerror(code)}"


def main() -> int:
    address = os.environ.get("COLO_DATA_SOCKET", "/run/colo/sidecar.sock")
    problem = probe(address)
    print(problem or f"a sidecar listens on {address}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
