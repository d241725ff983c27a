"""Object storage for tests and benchmarks: local S3 (moto server) and GCS (gcp-storage-emulator)
servers started as subprocesses on 127.0.0.1, and a TCP proxy that adds latency to every request
and injects faults on a schedule.

Remote reads behave unlike local ones in two ways that matter to an input pipeline: every request
costs a round trip, and requests fail (resets, 503s, hangs). The proxy gives both, with real sockets
and the real pyarrow clients, on a machine without netem: it delays client-to-server data as netem
delays packets, and answers chosen requests with a fault instead of forwarding them. It runs in a
child process (this file run as a script), not on a thread: pyarrow's GCS file opens its download
while holding the GIL (`NativeFile.closed` does it), so a proxy in the reader's own process
would deadlock it. moto and gcp-storage-emulator are test extras, launched only by the functions here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow.fs as pafs

FAULTS = ("reset", "503", "stall")
GCS_RETRY_LIMIT = timedelta(seconds=10)  # how long GcsFileSystem retries a transient error (whole seconds)
_REQUEST_LINE = re.compile(rb"[A-Z]+ (\S+) HTTP/1\.[01]\r\n")
_CHUNK = 2**18  # bytes read from a socket at a time
_BACKLOG = 1024  # connections waiting to be accepted, for the proxy and the GCS emulator
_GCS_MAIN = (  # the gcp-storage-emulator command with a longer listen backlog (see gcs_server)
    f"import socketserver, sys; socketserver.TCPServer.request_queue_size = {_BACKLOG}; "
    "from gcp_storage_emulator.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it: port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _executable(name: str) -> str:
    """The console script `name` installed next to this Python (the test extras' servers)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install the test extras (moto[server], gcp-storage-emulator) here")
    return str(path)


class ObjectStore:
    """A running object-storage server process (S3 or GCS) on 127.0.0.1; `stop()` (or leaving the
    `with` block) kills it and waits for it.

    Args:
        kind: "s3" or "gcs".
        process: the server process.
        endpoint: "127.0.0.1:PORT" the server listens on.
        log: the file that takes the server's output (a line per request: a pipe nobody reads
            would fill up and hang the server).
    """

    def __init__(self, kind: str, process: subprocess.Popen[bytes], endpoint: str, log: IO[bytes]) -> None:
        self.kind = kind
        self.process = process
        self.endpoint = endpoint
        self.log = log
        self.client = "pyarrow"  # or "fsspec": `filesystem()` is then gcsfs (GCS)

    def filesystem(self, endpoint: str | None = None, *, retries: bool = True) -> Any:
        """The filesystem a source reads the store through, talking to `endpoint` (a
        FaultProxy's, say), by default the server's own: pyarrow's, or gcsfs where the client
        is fsspec.

        Args:
            endpoint: "host:port" to connect to; None is the server itself.
            retries: whether the client retries transient errors as it does by default (S3: 3
                attempts; GCS: for `GCS_RETRY_LIMIT`, not its default 15 minutes). Without, S3
                makes one attempt and GCS retries for 1 s, its least (a limit of 0 makes no attempt).
                gcsfs always retries, 6 times over about 30 s.
        """
        target = endpoint or self.endpoint
        return _gcsfs(target) if self.client == "fsspec" else self.pyarrow_filesystem(target, retries=retries)

    def pyarrow_filesystem(self, endpoint: str | None = None, *, retries: bool = True) -> pafs.FileSystem:
        """The server kind's own pyarrow filesystem (what `filesystem()` is unless the client
        is fsspec), talking to `endpoint`, by default the server's own: it also writes."""
        import pyarrow.fs as pafs

        target = endpoint or self.endpoint
        if self.kind == "s3":
            once = {} if retries else {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1)}
            return pafs.S3FileSystem(
                access_key="testing", secret_key="testing", region="us-east-1", endpoint_override=target, scheme="http",
                allow_bucket_creation=True, **once,
            )
        return pafs.GcsFileSystem(
            anonymous=True, project_id="test", endpoint_override=target, scheme="http",
            retry_time_limit=GCS_RETRY_LIMIT if retries else timedelta(seconds=1),
        )

    def upload(self, local_dir: str | os.PathLike[str], bucket: str) -> str:
        """Copy every file under `local_dir` (keeping relative paths) into `bucket`, created if
        needed, straight to the server; returns the path of the copy inside `filesystem()`."""
        fs = self.pyarrow_filesystem()
        fs.create_dir(bucket)
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            with fs.open_output_stream(f"{bucket}/{path.relative_to(root).as_posix()}") as out:
                out.write(path.read_bytes())
        return bucket

    def uri(self, bucket_path: str) -> str:
        """The URI of a path inside the store: "s3://bucket/..." or "gs://bucket/..."."""
        return f"{'s3' if self.kind == 's3' else 'gs'}://{bucket_path}"

    def stop(self) -> None:
        """Kill the server process, wait for it to end and drop its log."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _start(kind: str, command: list[str], port: int, timeout_s: float = 60.0) -> ObjectStore:
    """Start a server process and wait until it answers HTTP on 127.0.0.1:`port`."""
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    store = ObjectStore(kind, process, f"127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://{store.endpoint}/", timeout=5).close()
            return store
        except urllib.error.HTTPError:  # an HTTP error status is an answer
            return store
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            log.seek(0)
            output = log.read().decode(errors="replace")[-2000:]
            log.close()
            what = f"{' '.join(command)} did not answer on {store.endpoint} (exit status {process.returncode})"
            raise RuntimeError(f"{what}: {output}")
        time.sleep(0.1)


def s3_server() -> ObjectStore:
    """A moto S3 server on a free port of 127.0.0.1, answering."""
    port = _free_port()
    return _start("s3", [_executable("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port)


def gcs_server() -> ObjectStore:
    """A gcp-storage-emulator GCS server (in memory) on a free port of 127.0.0.1, answering.

    It is `gcp-storage-emulator start`, run with a listen backlog of `_BACKLOG` connections instead
    of http.server's 5: the emulator answers one request at a time, and a parallel reader's
    connections beyond 5 would have their SYNs dropped and retried by TCP a second later, a stall
    that real GCS does not have."""
    port = _free_port()
    command = [sys.executable, "-c", _GCS_MAIN, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    return _start("gcs", command, port)


def gcsfs_server() -> ObjectStore:
    """`gcs_server()`, whose `filesystem()` is gcsfs (an fsspec filesystem) instead of
    pyarrow's GcsFileSystem; `upload` goes through pyarrow's all the same."""
    store = gcs_server()
    store.client = "fsspec"
    return store


def _gcsfs(endpoint: str) -> Any:
    """A gcsfs filesystem talking to the GCS server at `endpoint`, anonymous, a new instance
    (fsspec would hand out one cached per arguments, with its listings). gcsfs retries a
    transient error by itself, 6 times over about 30 s; that cannot be set per instance. It
    first asks a bucket's type over gRPC, which the emulator does not answer (a 60 s wait):
    `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` turns that off, set here before gcsfs loads."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import gcsfs

    return gcsfs.GCSFileSystem(endpoint_url=f"http://{endpoint}", token="anon", project="test", skip_instance_cache=True)


class FaultProxy:
    """A TCP proxy to `target` on a free port of 127.0.0.1 that delays every chunk of
    client-to-server data by `delay_s` (as netem delays packets, order kept on each connection;
    server-to-client data passes at once) and injects the faults `fail()` schedules. It runs in a
    child process (an asyncio loop); `close()` (or leaving the `with` block) ends it, and with it
    every connection.

    Args:
        target: "host:port" of the server.
        delay_s: seconds added to every client-to-server chunk; settable at any time.
    """

    def __init__(self, target: str, delay_s: float = 0.0) -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__, target], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lock = threading.Lock()
        self.endpoint: str = self._reply()["endpoint"]
        self.delay_s = delay_s

    @property
    def delay_s(self) -> float:
        """Seconds added to every client-to-server chunk from now on."""
        return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        self._command(op="delay", seconds=value)
        self._delay_s = value

    @property
    def requests(self) -> int:
        """HTTP requests seen so far, faulted ones included."""
        return int(self._command(op="stats")["requests"])

    @property
    def faults(self) -> int:
        """Faults injected so far."""
        return int(self._command(op="stats")["faults"])

    def fail(self, kind: str, times: int = 1, after: int = 0) -> None:
        """Answer the `times` requests after the next `after` ones with a fault: "reset" (a TCP RST,
        request not forwarded), "503" (Service Unavailable, connection closed), "stall" (no answer,
        connection held until `heal()`); `times=-1` is every request until `heal()`."""
        if kind not in FAULTS:
            raise ValueError(f"fault {kind!r}: must be one of {FAULTS}")
        self._command(op="fail", kind=kind, times=times, after=after)

    def heal(self) -> None:
        """No more faults; stalled connections are closed."""
        self._command(op="heal")

    def close(self) -> None:
        """End the proxy process (it closes every connection and the listening socket) and wait for it."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()  # the child ends at the end of its input
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def _command(self, **command: Any) -> dict[str, Any]:
        """Send one command to the proxy process; its answer (the counters)."""
        with self._lock:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(command) + "\n")
            self._process.stdin.flush()
            return self._reply()

    def _reply(self) -> dict[str, Any]:
        """The proxy process's next answer line."""
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the FaultProxy process ended (exit status {self._process.wait()})")
        return dict(json.loads(line))

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _error_response(path: bytes, head: bool) -> bytes:
    """A 503 answer the client understands: GCS's JSON error for its JSON API paths, else S3's XML."""
    if b"/storage/v1/" in path:
        kind = b"application/json"
        body = (
            b'{"error": {"code": 503, "message": "Service Unavailable (injected by FaultProxy)", '
            b'"errors": [{"reason": "backendError", "domain": "global", "message": "Service Unavailable"}]}}'
        )
    else:
        kind = b"application/xml"
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate '
            b"(injected by FaultProxy).</Message><RequestId>faultproxy</RequestId></Error>"
        )
    headers = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return headers % (kind, 0 if head else len(body)) + (b"" if head else body)


class _ProxyServer:
    """The proxy process's event loop side: connections, delays, the fault schedule and the
    commands read from stdin, one JSON object a line, each answered with the counters."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._delay_s = 0.0
        self._requests = 0
        self._faults = 0
        self._rules: list[tuple[str, int, float]] = []  # (kind, first request index, end index)
        self._stalled: set[asyncio.Future[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, commands: IO[str], answers: IO[str]) -> None:
        """Serve until `commands` ends, then close every connection."""
        loop = asyncio.get_running_loop()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_CHUNK, backlog=_BACKLOG)
        self._answer(answers, endpoint=f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), commands)
        while line := await reader.readline():
            self._apply(json.loads(line))
            self._answer(answers, requests=self._requests, faults=self._faults)
        server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    @staticmethod
    def _answer(answers: IO[str], **values: Any) -> None:
        answers.write(json.dumps(values) + "\n")
        answers.flush()

    def _apply(self, command: dict[str, Any]) -> None:
        """Carry out one command: "delay", "fail", "heal" or "stats" (nothing to do)."""
        if command["op"] == "delay":
            self._delay_s = float(command["seconds"])
        elif command["op"] == "fail":
            first = self._requests + command["after"]
            self._rules.append((command["kind"], first, float("inf") if command["times"] == -1 else first + command["times"]))
        elif command["op"] == "heal":
            self._rules.clear()
            for waiter in self._stalled:
                if not waiter.done():
                    waiter.set_result(None)
            self._stalled.clear()

    def _fault(self) -> str | None:
        """Count one request; the fault it gets, if any."""
        index = self._requests
        self._requests += 1
        kind = next((k for k, first, end in self._rules if first <= index < end), None)
        self._faults += kind is not None
        return kind

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        """One client connection: pipe it to a new connection to the target until either side ends."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target, limit=_CHUNK)
            pipes = {
                asyncio.create_task(self._upstream(client_reader, client_writer, upstream_writer)),
                asyncio.create_task(self._downstream(upstream_reader, client_writer)),
            }
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        except (OSError, asyncio.CancelledError):  # the target refused, or the proxy is closing
            pass
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()
            self._tasks.discard(task)

    async def _upstream(
        self, client: asyncio.StreamReader, client_writer: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        """Client-to-server data, each chunk sent `delay_s` after it arrived (never before the chunk
        before it), until the client ends or a request gets a fault."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, upstream))
        due = 0.0
        try:
            while data := await client.read(_CHUNK):
                request = _REQUEST_LINE.match(data)
                fault = self._fault() if request else None
                if fault is not None and request is not None:
                    await self._inject(fault, request[1], data.startswith(b"HEAD "), client_writer)
                    return
                due = max(loop.time() + self._delay_s, due)
                queue.put_nowait((due, data))
            await queue.join()
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    @staticmethod
    async def _send(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        """Write each queued chunk to `writer` once it is due."""
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            queue.task_done()

    @staticmethod
    async def _downstream(upstream: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        """Server-to-client data, at once, until the server ends."""
        while data := await upstream.read(_CHUNK):
            client.write(data)
            await client.drain()

    async def _inject(self, fault: str, path: bytes, head: bool, client: asyncio.StreamWriter) -> None:
        """Give the client `fault` instead of forwarding its request; the caller then closes the connection."""
        if fault == "reset":
            client.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.transport.abort()
        elif fault == "503":
            client.write(_error_response(path, head))
            await client.drain()
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._stalled.add(waiter)
            await waiter


if __name__ == "__main__":  # the FaultProxy process: `python storage.py HOST:PORT`
    asyncio.run(_ProxyServer(sys.argv[1]).run(sys.stdin, sys.stdout))
