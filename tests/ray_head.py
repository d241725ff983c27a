"""A real Ray head node started with `ray start --head --block` (a venv's `ray`), for tests
that need a cluster outside this process: one of another Ray version, or one that a
container reaches through Ray Client. Its own temp dir (a `ray.init()` elsewhere must not
find it), no token authentication and gRPC's fork handlers off, as docs/ray.md says for a
head, killed by process group at the end. A block that fails prints the tail of the head's
Ray Client server log."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from multihost import free_port

RAY_WORKER_PORTS = range(10002, 20000)  # `ray start`'s default --min/max-worker-port


def ray_port() -> int:
    """A free port for a head's GCS or Ray Client server, between Ray's worker ports and the
    kernel's ephemeral ones: the head's other services bind ephemeral ports at random, and
    one of them could take an ephemeral port chosen here before the server binds it (its
    log then says "Address already in use", and a client waits 30 s for nothing)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = range(RAY_WORKER_PORTS.stop, low)
    for port in random.sample(ports, min(100, len(ports))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()  # no port there (a kernel whose ephemeral range starts low)


@contextmanager
def head_node(ray: Path, client_port: int | None = None, cpus: int = 1) -> Iterator[int]:
    """A head node of the `ray` command's Ray with `cpus` CPUs (and a Ray Client server on
    `client_port`), up with its node, until the block ends; its GCS port. Needs
    RAY_AUTH_MODE=disabled in the caller's environment too, to connect."""
    port = ray_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit
    client = [f"--ray-client-server-port={client_port}"] if client_port else []
    head = subprocess.Popen(
        [str(ray), "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}", f"--temp-dir={temp}",
         "--include-dashboard=false", "--disable-usage-stats", *client],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )  # fmt: skip
    try:
        status = [str(ray), "status", f"--address=127.0.0.1:{port}"]
        deadline = time.monotonic() + 120
        while subprocess.run(status, capture_output=True, timeout=60).returncode:  # its own CLI: up, with its node
            assert head.poll() is None and time.monotonic() < deadline, f"the Ray head ({ray}) did not start"
            time.sleep(1)
        yield port
    except BaseException:
        print(f"the Ray head's Ray Client server log:\n{client_log(temp)}")
        raise
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)
        shutil.rmtree(temp, ignore_errors=True)


def client_log(temp: str, lines: int = 40) -> str:
    """The last `lines` of the Ray Client server's log (its proxy) under the head's `temp`."""
    log = Path(temp, "session_latest", "logs", "ray_client_server.err")
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(none)"
