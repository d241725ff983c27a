"""The object-storage harness (`colo_data.testing.storage`) with real servers, real sockets and the
real pyarrow clients: files uploaded to the local S3 (moto) and GCS (gcp-storage-emulator) servers
read back identically through the FaultProxy, its request count follows the reads, its faults
reach pyarrow as the OSErrors real stores give (and are retried when the client retries),
`heal()` ends them, and closing the proxy and stopping a server leave no process, thread or
listening socket behind. No assertion is on time: the delay only has to be harmless."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from colo_data.testing.storage import FaultProxy, ObjectStore, gcs_server, s3_server

SERVERS = {"s3": s3_server, "gcs": gcs_server}
# What pyarrow 26 raises when every attempt fails (a row group read, GetObject / ReadObject):
#   S3, 503:   "AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate (injected by FaultProxy).
#               (Request ID: faultproxy)", or as often, the same answer unread: "AWS Error SERVICE_UNAVAILABLE during
#               GetObject operation: " (a HEAD has no body: "AWS Error UNKNOWN (HTTP status 503) during HeadObject ...")
#   S3, reset: "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data from the
#               peer; Details: Recv failure: Connection reset by peer"
#   GCS, 503:  "google::cloud::Status(UNAVAILABLE: Retry policy exhausted, with a last message of Service Unavailable
#               (injected by FaultProxy) error_info={reason=backendError, ..., http_status_code=503}})"
#   GCS, reset: "google::cloud::Status(UNAVAILABLE: Retry policy exhausted, with a last message of PerformWork() - CURL
#               error [56]=Failure when receiving data from the peer error_info={...}})"
ERRORS = {
    ("s3", "503"): r"AWS Error (SLOW_DOWN|SERVICE_UNAVAILABLE) during GetObject operation",
    ("s3", "reset"): r"AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56.*Connection reset by peer",
    ("gcs", "503"): r"UNAVAILABLE: Retry policy exhausted, with a last message of Service Unavailable.*http_status_code=503",
    ("gcs", "reset"): r"UNAVAILABLE: Retry policy exhausted, with a last message of PerformWork\(\) - CURL error \[56\]",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    """A directory with one Parquet file in a sub-directory (10 row groups) and its table."""
    root = tmp_path_factory.mktemp("objects")
    rng = np.random.default_rng(0)
    table = pa.table({"id": np.arange(20_000), "value": rng.random(20_000)})
    (root / "part").mkdir()
    pq.write_table(table, root / "part" / "data.parquet", row_group_size=2_000)
    return root, table


@pytest.fixture(scope="module", params=sorted(SERVERS))
def store(request: pytest.FixtureRequest, data: tuple[Path, pa.Table]) -> Iterator[ObjectStore]:
    """Each server in turn, with `data` uploaded to the bucket "bucket"."""
    with SERVERS[request.param]() as running:
        assert running.upload(data[0], "bucket") == "bucket"
        yield running


@pytest.fixture
def proxy(store: ObjectStore) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the store, no delay, no faults."""
    with FaultProxy(store.endpoint) as running:
        yield running


def test_files_read_back_identically_through_the_delaying_proxy(
    store: ObjectStore, proxy: FaultProxy, data: tuple[Path, pa.Table]
) -> None:
    """An uploaded file reads back as written with 0 and 25 ms added, each read counted."""
    assert store.uri("bucket/part") == f"{'s3' if store.kind == 's3' else 'gs'}://bucket/part"
    fs = store.filesystem(proxy.endpoint)
    assert proxy.requests == 0
    for delay_s in (0.0, 0.025):
        proxy.delay_s = delay_s
        before = proxy.requests
        assert pq.read_table("bucket/part/data.parquet", filesystem=fs).equals(data[1])
        assert proxy.requests > before, "the reads went past the proxy"
    assert proxy.faults == 0


def test_a_lasting_503_is_an_oserror_until_healed(store: ObjectStore, proxy: FaultProxy, data: tuple[Path, pa.Table]) -> None:
    """Every request a 503: a read of an open file is the store's OSError; healed, it reads."""
    fs = store.filesystem(proxy.endpoint, retries=False)
    reader = pq.ParquetFile(fs.open_input_file("bucket/part/data.parquet"))
    proxy.fail("503", times=-1)
    with pytest.raises(OSError, match=ERRORS[store.kind, "503"]):
        reader.read_row_group(3)
    assert proxy.faults >= 1
    proxy.heal()
    assert reader.read_row_group(3).equals(data[1].slice(6_000, 2_000))
    assert pq.read_table("bucket/part/data.parquet", filesystem=fs).equals(data[1])


def test_resets_are_retried_by_the_client_and_an_oserror_without_retries(
    store: ObjectStore, proxy: FaultProxy, data: tuple[Path, pa.Table]
) -> None:
    """One reset costs a retrying client nothing; lasting resets are an OSError without retries."""
    retrying = pq.ParquetFile(store.filesystem(proxy.endpoint).open_input_file("bucket/part/data.parquet"))
    proxy.fail("reset")
    assert retrying.read_row_group(0).equals(data[1].slice(0, 2_000)), "one reset, then the retry's answer"
    assert proxy.faults == 1
    once = pq.ParquetFile(store.filesystem(proxy.endpoint, retries=False).open_input_file("bucket/part/data.parquet"))
    proxy.fail("reset", times=-1)
    with pytest.raises(OSError, match=ERRORS[store.kind, "reset"]):
        once.read_row_group(1)
    proxy.heal()
    assert once.read_row_group(1).equals(data[1].slice(2_000, 2_000))


def address(endpoint: str) -> tuple[str, int]:
    """("host", port) of "host:port"."""
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def test_the_server_keeps_answering_past_64_kib_of_request_log(store: ObjectStore) -> None:
    """1,500 requests (over 64 KiB of the server's request log lines, a pipe's buffer) all answered."""
    host, port = address(store.endpoint)
    path = "/" if store.kind == "s3" else "/storage/v1/b"
    connection = http.client.HTTPConnection(host, port, timeout=30)
    for _ in range(1_500):
        connection.request("GET", path)
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 200
        if answer.version == 10 or answer.getheader("Connection", "").lower() == "close":  # the GCS emulator: HTTP/1.0
            connection.close()
            connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.close()


def http_get(endpoint: str, path: str = "/") -> tuple[int, bytes]:
    """The status and body of one GET on a new connection."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}{path}", timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_faults_follow_the_schedule_and_503s_carry_the_stores_error(store: ObjectStore, proxy: FaultProxy) -> None:
    """`after` requests pass, then `times` get the fault, then requests pass again; the body is
    S3's XML error or, on GCS's JSON API, its JSON error."""
    path = "/" if store.kind == "s3" else "/storage/v1/b/bucket/o"
    proxy.fail("503", times=2, after=1)
    statuses = [http_get(proxy.endpoint, path) for _ in range(4)]
    assert [status for status, _ in statuses] == [200, 503, 503, 200]
    assert (proxy.requests, proxy.faults) == (4, 2)
    body = statuses[1][1]
    if store.kind == "s3":
        assert b"<Code>SlowDown</Code>" in body
    else:
        assert json.loads(body)["error"]["code"] == 503


def test_a_reset_is_a_tcp_rst_and_a_stall_holds_the_connection_until_healed(proxy: FaultProxy) -> None:
    """A reset request's connection ends in an RST; a stalled one gets nothing until heal() closes it."""
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    proxy.fail("reset")
    with socket.create_connection(address(proxy.endpoint), timeout=30) as connection:
        connection.sendall(request)
        with pytest.raises(ConnectionResetError):
            connection.recv(1024)
    proxy.fail("stall")
    with socket.create_connection(address(proxy.endpoint), timeout=0.5) as connection:
        connection.sendall(request)
        with pytest.raises(TimeoutError):  # nothing comes: the request waits for heal()
            connection.recv(1024)
        connection.settimeout(30)
        proxy.heal()
        assert connection.recv(1024) == b"", "healing closes the stalled connection"
    assert proxy.faults == 2


def refused(endpoint: str) -> bool:
    """Whether nothing listens on `endpoint` any more."""
    try:
        socket.create_connection(address(endpoint), timeout=30).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_close_and_stop_leave_nothing_behind(kind: str) -> None:
    """close() ends the proxy's connections and socket, stop() the server; no thread is left."""
    threads = set(threading.enumerate())
    store = SERVERS[kind]()
    proxy = FaultProxy(store.endpoint)
    proxy.fail("stall")
    held = socket.create_connection(address(proxy.endpoint), timeout=30)
    held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    proxy.close()
    assert held.recv(1024) == b"", "closing the proxy closes its connections"
    held.close()
    assert refused(proxy.endpoint)
    store.stop()
    assert store.process.poll() is not None
    assert refused(store.endpoint)
    assert not set(threading.enumerate()) - threads, "a thread of the proxy or the server is left"  # others may end meanwhile
