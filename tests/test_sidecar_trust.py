"""Issue 26: the trainer trusts nothing at its socket address, and connecting says what is
wrong. A socket and key that another user (`nobody`, a real listener started with
`runuser`) put in a world-writable directory are refused before anything is read from
them; so are a socket, key or directory owned by another user or writable by others. With
no sidecar the wait is the Sidecar timeout, a missing key file is named, and a socket path
too long for a Unix socket says so. Real sockets, real users, real files."""

from __future__ import annotations

import os
import pwd
import shutil
import socket as sockets
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import colo_data as cd
from colo_data.backends.sidecar.client import SidecarClient
from colo_data.backends.sidecar.server import SidecarServer

from pipelines import make_pipeline

NOBODY = pwd.getpwnam("nobody").pw_uid
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="makes files of another user (nobody): needs root")

# Another user's "sidecar": it writes its own key beside its socket and, once a trainer has
# passed the key challenge, sends a pickle that runs a command in the trainer. It ends when
# its stdin closes, saying whether anyone connected. Standard library only (it runs as nobody,
# who cannot read the test's virtual environment).
IMPOSTOR = """
import os, select, socket, sys
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
path, marker = sys.argv[1], sys.argv[2]
key = os.urandom(32)
with open(path + ".key", "w") as f:
    f.write(key.hex())
server = socket.socket(socket.AF_UNIX)
server.bind(path)
os.chmod(path, 0o666)
server.listen()
print("listening", flush=True)
if server not in select.select([server, sys.stdin], [], [])[0]:
    print("nobody connected", flush=True)
    sys.exit(0)
conn = Connection(server.accept()[0].detach())
print("connected", flush=True)
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + marker,))
deliver_challenge(conn, key)
answer_challenge(conn, key)
conn.send(Payload())
conn.recv_bytes()
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable directory with the sticky bit, like /tmp, that `nobody` can use."""
    place = Path(tempfile.mkdtemp(prefix="colo-data-trust-", dir="/tmp"))
    place.chmod(0o1777)
    try:
        yield place
    finally:
        shutil.rmtree(place, ignore_errors=True)


@needs_root
def test_a_root_trainer_refuses_another_users_sidecar_before_reading_from_it(shared_dir: Path) -> None:
    """The attack of the issue: `nobody` listens at /tmp-like path with a key of its own;
    the root trainer connected, passed the challenge and unpickled its payload. Now it
    refuses at once, and the impostor never sees a connection."""
    socket, marker = shared_dir / "colo.sock", shared_dir / "pwned"
    impostor = subprocess.Popen(
        ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", textwrap.dedent(IMPOSTOR), str(socket), str(marker)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert impostor.stdout.readline().strip() == "listening", impostor.stderr.read()
        assert socket.stat().st_uid == Path(f"{socket}.key").stat().st_uid == NOBODY
        with pytest.raises(cd.errors.SidecarError) as raised:
            SidecarClient(f"unix://{socket}", timeout=2)
    finally:
        out, err = impostor.communicate(timeout=30)
    message = str(raised.value)
    assert message.startswith(f"refusing to connect: the directory of the sidecar's socket {shared_dir} is writable by"), message
    assert "mode 1777" in message and "sticky bit" in message and "chmod go-w" in message, message
    assert out == "nobody connected\n", (out, err)  # after "listening": no trainer ever connected
    assert not marker.exists(), "the impostor's pickle ran in the trainer"


def _bound(path: Path) -> sockets.socket:
    """A socket file at `path` that nothing listens on (root's)."""
    sock = sockets.socket(sockets.AF_UNIX)
    sock.bind(str(path))
    return sock


@needs_root
@pytest.mark.parametrize(
    "case", ["directory of nobody", "group-writable directory", "socket of nobody", "key of nobody", "key writable by others"]
)
def test_a_socket_that_another_user_could_have_placed_is_refused(tmp_path: Path, case: str) -> None:
    """Each way another user could have put the socket or the key there is named."""
    place = tmp_path / "run"
    place.mkdir(mode=0o755)
    socket, key = place / "host0.sock", place / "host0.sock.key"
    if case == "directory of nobody":
        os.chown(place, NOBODY, -1)
        expected = f"the directory of the sidecar's socket {place} belongs to uid {NOBODY}, not to this trainer's user"
    elif case == "group-writable directory":
        place.chmod(0o775)
        expected = f"the directory of the sidecar's socket {place} is writable by its group (mode 775)"
    else:
        bound = _bound(socket)
        key.write_text("ab" * 32)
        key.chmod(0o600)
        if case == "socket of nobody":
            os.chown(socket, NOBODY, -1)
            expected = f"the sidecar's socket {socket} belongs to uid {NOBODY}"
        elif case == "key of nobody":
            os.chown(key, NOBODY, -1)
            expected = f"the sidecar's key {key} belongs to uid {NOBODY}"
        else:
            key.chmod(0o666)
            expected = f"the sidecar's key {key} is writable by its group and others (mode 666)"
    with pytest.raises(cd.errors.SidecarError) as raised:
        SidecarClient(f"unix://{socket}", timeout=2)
    assert str(raised.value).startswith(f"refusing to connect: {expected}"), str(raised.value)
    assert "run the sidecar as the trainer's user or root" in str(raised.value)
    if case.startswith(("socket", "key")):
        bound.close()


def test_with_no_sidecar_the_wait_is_the_sidecar_timeout(tmp_path: Path, token_corpus: Path) -> None:
    """It was a fixed 61 s, whatever `cd.Sidecar(timeout=...)` said."""
    socket = tmp_path / "none.sock"
    loader = cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(address=f"unix://{socket}", timeout=2))
    started = time.monotonic()
    with pytest.raises(cd.errors.SidecarError, match=rf"no sidecar answers at unix://{socket} after 2\.\d s"):
        next(loader)
    waited = time.monotonic() - started
    loader.close()
    assert 2 <= waited < 2 + 5, f"waited {waited:.1f} s for a sidecar with timeout=2"


def test_a_missing_key_file_is_named_not_a_missing_sidecar(tmp_path: Path) -> None:
    """A listening socket without its key beside it was "no sidecar answers"."""
    socket = tmp_path / "host0.sock"
    with _bound(socket) as listening:
        listening.listen()  # a socket that answers, without its key beside it
        with pytest.raises(cd.errors.SidecarError) as raised:
            SidecarClient(f"unix://{socket}", timeout=2)
    message = str(raised.value)
    assert message.startswith(f"the sidecar's key file {socket}.key is missing, though its socket {socket} is there"), message
    assert "COLO_DATA_SIDECAR_KEY" in message and "no sidecar answers" not in message


def test_a_socket_path_too_long_is_named_with_its_length(tmp_path: Path) -> None:
    """It was "cannot listen on ...: None" in the sidecar, and a failed key challenge in the trainer."""
    socket = tmp_path / ("s" * max(1, 120 - len(str(tmp_path)))) / "host0.sock"
    socket.parent.mkdir()
    size = len(os.fsencode(str(socket)))
    expected = rf"socket path {socket} is {size} bytes, longer than the limit of 107 bytes .*: choose a shorter path"
    server = SidecarServer(str(socket), shm_dir=str(tmp_path), workers=0)
    with pytest.raises(cd.errors.ConfigError, match=expected):
        server.listen()
    assert not any(socket.parent.iterdir()), "nothing is made for a path that cannot be used"
    with pytest.raises(cd.errors.ConfigError, match=expected):
        SidecarClient(f"unix://{socket}", timeout=2)
