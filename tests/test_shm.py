"""The shared-memory ring on real files: batches round-trip as views without a copy, a
directory too small fails before anything is made (on a real 64 MiB tmpfs), and no segment
outlives its writer: close, interpreter exit and the stale sweep after a SIGKILL."""

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import colo_data as cd
from colo_data.backends.sidecar import shm
from colo_data.backends.sidecar.server import SidecarServer
from colo_data.errors import ConfigError, ShmError
from colo_data.backends.sidecar.shm import ArraySpec, ShmReader, ShmRing, check_capacity, ring_bytes, slot_bytes, sweep_stale

from pipelines import make_pipeline

MIB = 2**20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[str]:
    """A real 64 MiB tmpfs, mounted for the test and unmounted after it."""
    directory = tmp_path / "shm"
    directory.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the capacity tests need a real 64 MiB tmpfs")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(directory)], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a 64 MiB tmpfs (root needed): {result.stderr.decode().strip()}")
    try:
        yield str(directory)
    finally:  # a failed test may still map it; detach it then, freed when the maps go
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode:
            subprocess.run(["umount", "--lazy", str(directory)], check=True)


def _free(directory: str) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, 50_000, (4, 9), dtype=np.int32),
        "weights": rng.random(5, dtype=np.float32),
        "mask": rng.random((3, 3)) < 0.5,
        "ids": rng.integers(-(2**40), 2**40, 7, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float32),
        "step": np.array(seed, np.int16),
    }


def test_round_trip_gives_views_into_the_slot() -> None:
    first, second, third = _batch(1), _batch(2), _batch(3)
    with ShmRing.create("/dev/shm", 2, 4096) as ring:
        layout = ring.write(0, first)
        assert [spec.offset % shm.ALIGN for spec in layout] == [0] * len(first)
        wire = json.loads(json.dumps([spec.to_wire() for spec in layout]))
        assert [ArraySpec.from_wire(w) for w in wire] == layout
        reader = ShmReader("/dev/shm", ring.names)
        views = reader.view(0, [ArraySpec.from_wire(w) for w in wire])
        for name, array in first.items():
            assert views[name].dtype == array.dtype and views[name].shape == array.shape, name
            np.testing.assert_array_equal(views[name], array)
            assert not views[name].flags.writeable, name
        again = reader.view(0, layout)
        assert np.shares_memory(views["tokens"], again["tokens"])

        other = reader.view(1, ring.write(1, second))
        for name, array in first.items():  # slot 1 does not touch slot 0
            np.testing.assert_array_equal(views[name], array)
            np.testing.assert_array_equal(other[name], second[name])
        assert not np.shares_memory(views["tokens"], other["tokens"])

        assert ring.write(0, third) == layout  # same shapes, same layout
        for name, array in third.items():  # the old views show the slot's new bytes: no copy
            np.testing.assert_array_equal(views[name], array)
        reader.close()
    assert not any(os.path.exists(os.path.join("/dev/shm", name)) for name in ring.names)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(3 * MIB // 8 + 5, dtype=np.int64),  # 3 MiB and a bit: 3 pieces of uneven rows
        np.arange(6 * MIB // 4, dtype=np.int32).reshape(-1, 1024)[:, ::2],  # a strided view
        np.arange(4 * MIB // 2, dtype=np.int16).reshape(1, -1),  # one row: not split
        np.arange(1000, dtype=np.float32),  # small: one copy
    ],
    ids=["rows", "strided", "one-row", "small"],
)
def test_copy_threads_write_the_same_bytes(tmp_path: Path, array: np.ndarray) -> None:
    batch = {"head": np.arange(3, dtype=np.uint8), "x": array}
    with ShmRing.create(str(tmp_path), 2, slot_bytes(batch), copy_threads=3) as ring:
        reader = ShmReader(str(tmp_path), ring.names)
        for slot in range(2):
            views = reader.view(slot, ring.write(slot, batch))
            for name, expected in batch.items():
                np.testing.assert_array_equal(views[name], expected, err_msg=name)
        reader.close()
    assert not any(tmp_path.iterdir())


def test_batch_larger_than_a_slot_is_refused(tmp_path: Path) -> None:
    with ShmRing.create(str(tmp_path), 1, 4096) as ring:
        kept = {"x": np.arange(10, dtype=np.int64)}
        layout = ring.write(0, kept)
        with pytest.raises(ShmError, match=r"needs 5000 bytes.*'x': 5000.*holds 4096 bytes.*slot_size >= 5000"):
            ring.write(0, {"x": np.zeros(5000, np.uint8)})
        # 100 bytes, then 4000 bytes at offset 128: the alignment pushes it past the end.
        aligned = {"a": np.zeros(100, np.uint8), "b": np.zeros(4000, np.uint8)}
        assert slot_bytes(aligned) == 4128
        with pytest.raises(ShmError, match=r"needs 4128 bytes.*'a': 100, 'b': 4000.*holds 4096 bytes"):
            ring.write(0, aligned)
        np.testing.assert_array_equal(ShmReader(str(tmp_path), ring.names).view(0, layout)["x"], kept["x"])


def test_ring_bytes_rejects_an_empty_ring() -> None:
    assert ring_bytes(3, 5) == 15
    for slots, slot_size in [(0, 4096), (2, 0)]:
        with pytest.raises(ConfigError, match=f"slots={slots}, slot_size={slot_size}"):
            ring_bytes(slots, slot_size)


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-dir")
    assert sweep_stale(missing) == []
    with pytest.raises(ConfigError, match=missing):
        ShmRing.create(missing, 1, 4096)


def test_a_ring_too_large_for_the_directory_fails_before_creating_anything(tmpfs: str) -> None:
    free = _free(tmpfs)
    assert 60 * MIB < free <= 64 * MIB
    needed = 5 * 16 * MIB
    message = rf"needs {needed} bytes \(80.0 MiB\), but {tmpfs} has {free} bytes .* free: .*--shm-size.*emptyDir"
    with pytest.raises(ShmError, match=message):
        check_capacity(tmpfs, 5, 16 * MIB)
    with pytest.raises(ShmError, match=message):
        ShmRing.create(tmpfs, 5, 16 * MIB)
    assert os.listdir(tmpfs) == []

    limit = rf"needs {2 * MIB} bytes \(2.0 MiB\), but the memory limit is {MIB} bytes"
    with pytest.raises(ShmError, match=limit):
        check_capacity(tmpfs, 2, MIB, memory_limit=MIB)
    with pytest.raises(ShmError, match=limit):
        ShmRing.create(tmpfs, 2, MIB, memory_limit=MIB)
    assert os.listdir(tmpfs) == []
    check_capacity(tmpfs, 2, MIB, memory_limit=2 * MIB)


def test_a_ring_that_fits_reserves_its_memory_and_leaves_nothing(tmpfs: str) -> None:
    free = _free(tmpfs)
    ring = ShmRing.create(tmpfs, 3, 16 * MIB)
    assert sorted(os.listdir(tmpfs)) == sorted(ring.names)
    assert free - _free(tmpfs) >= 48 * MIB  # reserved now, not at the first write
    reader = ShmReader(tmpfs, ring.names)
    for slot in range(3):
        batch = {"bytes": np.full(16 * MIB, slot + 1, np.uint8)}
        np.testing.assert_array_equal(reader.view(slot, ring.write(slot, batch))["bytes"], batch["bytes"])
    reader.close()
    ring.close()
    ring.close()
    assert os.listdir(tmpfs) == []
    assert _free(tmpfs) == free


def test_creation_failing_part_way_removes_what_it_made(tmpfs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_check = shm.check_capacity

    def check_then_fill(directory: str, slots: int, slot_size: int, memory_limit: int | None = None) -> None:
        real_check(directory, slots, slot_size, memory_limit)  # 48 MiB fit in 64 MiB ...
        fd = os.open(os.path.join(directory, "filler"), os.O_RDWR | os.O_CREAT)
        os.posix_fallocate(fd, 0, 40 * MIB)  # ... until another tenant takes 40 MiB
        os.close(fd)

    monkeypatch.setattr(shm, "check_capacity", check_then_fill)
    full = rf"slot 1 of 3 \({16 * MIB} bytes each\) in {tmpfs}: No space left on device; mount a larger"
    with pytest.raises(ShmError, match=full):
        ShmRing.create(tmpfs, 3, 16 * MIB)
    assert os.listdir(tmpfs) == ["filler"]


def test_a_restart_reclaims_the_space_of_a_crashed_writer(tmpfs: str) -> None:
    stale = "colo-data-999999-deadbeef-0"  # a crashed writer's 40 MiB segment: nobody holds it
    fd = os.open(os.path.join(tmpfs, stale), os.O_RDWR | os.O_CREAT)
    os.posix_fallocate(fd, 0, 40 * MIB)
    os.close(fd)
    with ShmRing.create(tmpfs, 3, 16 * MIB) as ring:  # 48 MiB: fits only once it is swept
        assert sorted(os.listdir(tmpfs)) == sorted(ring.names)
    assert os.listdir(tmpfs) == []


def test_a_sweep_racing_creation_does_not_take_a_new_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_flock, swept = fcntl.flock, []

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_SH and not swept:  # another writer's start-up sweep, just before the lock
            swept.extend(sweep_stale(str(tmp_path)))
        real_flock(fd, operation)

    monkeypatch.setattr(shm.fcntl, "flock", flock_after_a_sweep)
    with ShmRing.create(str(tmp_path), 2, 4096) as ring:
        assert swept == [ring.names[0]]
        assert sorted(os.listdir(tmp_path)) == ring.names and sweep_stale(str(tmp_path)) == []
        layout = ring.write(0, {"x": np.arange(6)})
        reader = ShmReader(str(tmp_path), ring.names)
        np.testing.assert_array_equal(reader.view(0, layout)["x"], np.arange(6))  # the file the writer maps
        reader.close()


def test_two_sweeps_at_once_remove_each_stale_segment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = ["colo-data-999999-deadbeef-0", "colo-data-999999-deadbeef-1"]
    for name in stale:
        Path(tmp_path, name).write_text("x")
    real_flock, inner = fcntl.flock, []

    def flock_after_another_sweep(fd: int, operation: int) -> None:
        if not inner:  # the other sweep runs between this one's open and its lock
            inner.append(None)
            inner.extend(sweep_stale(str(tmp_path)))
        real_flock(fd, operation)

    monkeypatch.setattr(shm.fcntl, "flock", flock_after_another_sweep)
    outer = sweep_stale(str(tmp_path))
    assert sorted(outer + inner[1:]) == stale and os.listdir(tmp_path) == []


def test_close_is_idempotent_and_views_outlive_it(tmp_path: Path) -> None:
    ring = ShmRing.create(str(tmp_path), 2, 4096)
    batch = _batch(4)
    reader = ShmReader(str(tmp_path), ring.names)
    views = reader.view(0, ring.write(0, batch))
    reader.close()
    ring.close()
    ring.close()
    assert os.listdir(tmp_path) == []
    for name, array in batch.items():  # the mapping lives as long as its views
        np.testing.assert_array_equal(views[name], array)
    with pytest.raises(IndexError, match="has 0 open slots"):
        ring.write(0, batch)


def test_a_missing_segment_is_named(tmp_path: Path) -> None:
    with ShmRing.create(str(tmp_path), 2, 4096) as ring:
        layout = ring.write(0, {"x": np.arange(4)})
        reader = ShmReader(str(tmp_path), ring.names)
        mapped = reader.view(0, layout)["x"]
        reader.unlink_all()  # what the trainer does when the writer died
        assert os.listdir(tmp_path) == []
        np.testing.assert_array_equal(reader.view(0, layout)["x"], mapped)  # mapped before: still there
        with pytest.raises(ShmError, match=rf"segment {tmp_path}/{ring.names[1]} is missing: .*pid {os.getpid()}"):
            reader.view(1, layout)
        reader.close()


def _python(script: str, *args: str) -> subprocess.Popen[str]:
    """`script` running in a new interpreter, its stdout piped."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], stdout=subprocess.PIPE, text=True)


def test_sweep_removes_exactly_the_segments_of_dead_writers(tmp_path: Path) -> None:
    directory = str(tmp_path)
    own = ShmRing.create(directory, 1, 4096)
    child = _python(
        """
        import json, sys, time
        from colo_data.backends.sidecar.shm import ShmRing
        ring = ShmRing.create(sys.argv[1], 2, 4096)
        print(json.dumps(ring.names), flush=True)
        time.sleep(120)
        """,
        directory,
    )
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the writer process failed (exit code {child.wait()})"
        names = json.loads(line)
        unrelated = ["colo-data-notes.txt", "colo-data-12-nothex!-0", "other-file"]
        # Left by an earlier process that had this pid (a restarted container's writer is
        # pid 1 again): the pid is alive, but no writer holds the file.
        reused = f"colo-data-{os.getpid()}-0badf00d-0"
        for name in [*unrelated, reused]:
            Path(directory, name).write_text("x")
        assert sweep_stale(directory) == [reused]  # the live writer's segments stay
        assert all(os.path.exists(os.path.join(directory, name)) for name in names)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
    assert all(os.path.exists(os.path.join(directory, name)) for name in names)  # a crash leaves them
    assert sweep_stale(directory) == sorted(names)
    assert sorted(os.listdir(directory)) == sorted([*unrelated, *own.names])
    own.close()
    assert sorted(os.listdir(directory)) == sorted(unrelated)


def test_exit_removes_the_ring_but_a_forked_child_exit_does_not(tmp_path: Path) -> None:
    child = _python(
        """
        import os, sys
        from colo_data.backends.sidecar.shm import ShmRing, sweep_stale
        ring = ShmRing.create(sys.argv[1], 2, 4096)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs the atexit handlers inherited from the parent
        os.waitpid(pid, 0)
        present = all(os.path.exists(os.path.join(sys.argv[1], name)) for name in ring.names)
        print(present, sweep_stale(sys.argv[1]), flush=True)
        """,
        str(tmp_path),
    )
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    assert out.strip().splitlines()[-1] == "True []"  # still there and still held after the child's exit
    assert os.listdir(tmp_path) == []  # removed at the writer's exit, without close()


def test_a_sigterm_while_the_ring_closes_leaves_no_segment(tmp_path: Path) -> None:
    """A sidecar's SIGTERM raises SystemExit wherever its main thread is: here while close()
    waits for a copy thread that is still busy. The ring's files must still all go."""
    child = _python(
        """
        import os, signal, sys, threading, time
        from colo_data.backends.sidecar.shm import ShmRing
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as `colo-data sidecar serve` does
        ring = ShmRing.create(sys.argv[1], 4, 4096, copy_threads=2)
        ring._pool.submit(time.sleep, 2)  # a copy still under way when the ring closes
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        ring.close()
        print("close was not interrupted", flush=True)
        """,
        str(tmp_path),
    )
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and "not interrupted" not in out, (child.returncode, out)
    assert os.listdir(tmp_path) == []


@contextmanager
def read_only_tmpfs(path: Path) -> Iterator[Path]:
    """A tmpfs mounted read-only at `path`: a directory that not even root may write."""
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs (root needed): {result.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("kind", ["regular file", "read-only mount"])
def test_an_shm_dir_that_cannot_hold_a_ring_is_named_where_it_is_set(tmp_path: Path, token_corpus: Path, kind: str) -> None:
    """Issue 26: a raw errno message before; now a ShmError naming the path, the setting and
    the fix, from the ring, from a sidecar at its start, and from a loader that would start one."""
    with contextlib.ExitStack() as stack:
        if kind == "regular file":
            shm_dir = tmp_path / "shm"
            shm_dir.write_text("not a directory")
            expected = rf"is {shm_dir}, which is a regular file, not a directory: point it at a memory-backed directory"
        else:
            shm_dir = stack.enter_context(read_only_tmpfs(tmp_path / "shm"))
            expected = rf"{shm_dir} is not writable by this process \(uid 0; .*, on a read-only mount\): mount it read-write"
        with pytest.raises(ShmError, match=rf"^the shm dir \(cd\.Sidecar\(shm_dir=\.\.\.\), --shm-dir, .*{expected}"):
            ShmRing.create(str(shm_dir), 2, 4096)
        with pytest.raises(ShmError, match=expected):
            SidecarServer(str(tmp_path / "host0.sock"), shm_dir=str(shm_dir), workers=0)
        with pytest.raises(ShmError, match=expected):
            cd.Loader(make_pipeline(token_corpus), backend=cd.Sidecar(shm_dir=str(shm_dir), workers=0))
        if kind == "read-only mount":
            assert os.listdir(shm_dir) == []
    if kind == "regular file":
        assert shm_dir.read_text() == "not a directory"


ANOTHER_USER = """
import os, sys
from colo_data.backends.sidecar.shm import ArraySpec, ShmReader
os.setgroups([])
os.setgid(int(sys.argv[4]))
os.setuid(int(sys.argv[3]))  # from here on, a trainer running as another user
try:
    ShmReader(sys.argv[1], [sys.argv[2]]).view(0, [ArraySpec("x", "<i8", (4,), 0)])
except Exception as e:
    print(type(e).__name__, e, flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="reads the ring as another user (nobody): needs root")
def test_a_trainer_of_another_user_is_told_to_share_the_sidecars_uid() -> None:
    """Issue 26: a trainer under another uid than the sidecar's got a raw PermissionError
    on the slot files; a process that drops to `nobody` now gets a ShmError naming both."""
    nobody = pwd.getpwnam("nobody")
    directory = tempfile.mkdtemp(prefix="colo-data-test-", dir="/dev/shm")
    os.chmod(directory, 0o755)  # the other user reaches the slot files, which are the sidecar's own
    try:
        with ShmRing.create(directory, 1, 4096) as ring:
            ring.write(0, {"x": np.arange(4)})
            child = _python(ANOTHER_USER, directory, ring.names[0], str(nobody.pw_uid), str(nobody.pw_gid))
            out, _ = child.communicate(timeout=60)
        path = os.path.join(directory, ring.names[0])
        assert out.startswith(
            f"ShmError cannot read shared-memory segment {path} (Permission denied): it belongs to uid 0 and this "
            f"process runs as uid {nobody.pw_uid}"
        ), out
        assert "run the trainer and the sidecar as the same user (uid)" in out, out
    finally:
        shutil.rmtree(directory, ignore_errors=True)
