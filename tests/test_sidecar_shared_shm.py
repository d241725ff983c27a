"""A sidecar in a shared /dev/shm, where names like its ring's segments belong to someone
else: another user's file, a directory, a FIFO, a symbolic link. Its start-up sweep removes
only the stale segments of its own kind (regular files of its own user that no live writer
locks), never opens anything else in a way that can block, and starts anyway. A planted
directory once stopped the start with a raw errno, another user's file was removed, and a
FIFO hung the trainer for minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import colo_data as cd
from colo_data.testing import read_all

SOMEONE_ELSE = 65534  # nobody: the owner of what is planted
TRAINER = """
import json, sys
from absl import flags
flags.FLAGS.mark_as_parsed()
import colo_data as cd

corpus, shm_dir = sys.argv[1:]
pipeline = cd.Pipeline(source=cd.ArrowSource(corpus), transforms=[cd.pad_or_truncate("tokens", 8)], global_batch_size=12)
with cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=shm_dir)) as loader:
    print(json.dumps([batch["id"].tolist() for batch in loader]), flush=True)
"""


@pytest.fixture
def shared_shm() -> Iterator[Path]:
    """A directory in /dev/shm (a tmpfs) that every user may write, as /dev/shm itself."""
    directory = Path(tempfile.mkdtemp(prefix="shared-shm-test-", dir="/dev/shm"))
    directory.chmod(0o1777)
    yield directory
    subprocess.run(["rm", "-rf", str(directory)], check=True)


KINDS = ("file", "directory", "fifo", "symlink")


def plant(directory: Path, kind: str, elsewhere: Path) -> Path:
    """Something of someone else's named like a ring segment (pid 1, a dead writer's token)."""
    path = directory / f"colo-data-1-0badc0de-{KINDS.index(kind)}"
    if kind == "file":
        path.write_bytes(b"someone else's")
        os.chown(path, SOMEONE_ELSE, SOMEONE_ELSE)
        path.chmod(0o600)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"someone else's")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        target = elsewhere / "symlink-target"
        target.write_bytes(b"someone else's")
        path.symlink_to(target)
    return path


def snapshot(path: Path) -> tuple:
    """What must not change about a planted thing: its inode, type, owner and content."""
    info = os.lstat(path)
    content: object = None
    if path.is_symlink():
        content = (os.readlink(path), path.read_bytes())
    elif path.is_dir():
        content = sorted((p.name, p.read_bytes()) for p in path.iterdir())
    elif path.is_file():
        content = path.read_bytes()
    return info.st_ino, info.st_mode, info.st_uid, content


def test_a_sidecar_starts_beside_someone_elses_names_and_leaves_them(
    token_corpus: Path, shared_shm: Path, tmp_path: Path
) -> None:
    """Beside a file of another user's, a directory, a FIFO and a symlink, all named like
    ring segments, the trainer's own sidecar starts, serves the whole epoch and sweeps a
    stale segment of its own (a killed writer's, unlocked); each planted thing is as it was."""
    planted = {kind: plant(shared_shm, kind, tmp_path) for kind in KINDS}
    before = {kind: snapshot(path) for kind, path in planted.items()}
    stale = shared_shm / "colo-data-2-0badc0de-0"  # a killed sidecar's slot: this user's regular file, unlocked
    stale.write_bytes(b"\0" * 64)
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    done = subprocess.run(
        [sys.executable, str(script), str(token_corpus), str(shared_shm)], capture_output=True, text=True, timeout=120
    )  # a sidecar that blocks on the FIFO ends here, as a failure, not a hang
    assert done.returncode == 0, done.stderr
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus)), transforms=[cd.pad_or_truncate("tokens", 8)], global_batch_size=12
    )
    assert json.loads(done.stdout) == [batch["id"].tolist() for batch in read_all(cd.Loader(pipeline, backend="inprocess"))]
    for kind, path in planted.items():
        assert os.path.lexists(path), f"the planted {kind} was removed"
        assert snapshot(path) == before[kind], f"the planted {kind} was changed"
    # the stale segment swept, the ring removed
    assert sorted(p.name for p in shared_shm.iterdir()) == sorted(path.name for path in planted.values())
