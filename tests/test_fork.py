"""A trainer that forks (a helper process, a checkpoint writer, `multiprocessing` with the
fork start method) keeps what its loader started: the child's exit runs the exit hooks it
inherited, and what they would stop (a local sidecar and its socket directory, worker
processes and their sockets) is the parent's, so the child leaves it alone. A child's exit
once deleted the parent's sidecar socket directory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import colo_data as cd
from colo_data.testing import read_all

HOW = ["returns", "sys.exit", "multiprocessing"]  # how the child ends: at the script's end, by sys.exit, or as multiprocessing's

TRAINER = """
import json, multiprocessing, os, sys
from absl import flags
flags.FLAGS.mark_as_parsed()
import psutil
import colo_data as cd

corpus, shm_dir, how = sys.argv[1:]
pipeline = cd.Pipeline(source=cd.ArrowSource(corpus), transforms=[cd.pad_or_truncate("tokens", 8)], global_batch_size=12)
loader = cd.Loader(pipeline, backend=cd.Sidecar(workers=0, shm_dir=shm_dir))
ids = [next(loader)["id"].tolist()]
sidecar = next(c for c in psutil.Process().children() if "--socket" in c.cmdline())
socket = sidecar.cmdline()[sidecar.cmdline().index("--socket") + 1]
if how == "multiprocessing":
    child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
    child.start()
    child.join()
    pid = child.pid
else:
    pid = os.fork()
if pid == 0:
    print("child", flush=True)
    if how == "sys.exit":
        sys.exit(0)
else:  # with "returns", the child leaves the script at its end, like any program
    if how != "multiprocessing":
        os.waitpid(pid, 0)
    there = os.path.exists(socket)
    alive = sidecar.is_running() and sidecar.status() != psutil.STATUS_ZOMBIE
    ids += [batch["id"].tolist() for batch in loader]
    loader.close()
    print(json.dumps({"ids": ids, "socket": there, "sidecar": alive}), flush=True)
"""

OWNER = """
import os, sys
from colo_data.runtime.lifecycle import Lifecycle

how = sys.argv[1]
parent = os.getpid()
owner = Lifecycle("a part of the parent's")
owner.add("part", lambda timeout: print("stopped in", "the parent" if os.getpid() == parent else "the child", flush=True))
pid = os.fork()
if pid == 0:
    if how == "close":
        owner.close()
    sys.exit(0)
os.waitpid(pid, 0)
print("the child has exited", flush=True)
"""


def run(script: str, *args: str, where: Path) -> list[str]:
    """`script`'s output lines, run with `args` (it must exit 0 within 2 minutes)."""
    path = where / "script.py"
    path.write_text(textwrap.dedent(script))
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("how", HOW)
def test_a_forked_child_that_exits_leaves_the_trainers_sidecar(token_corpus: Path, tmp_path: Path, how: str) -> None:
    """The child of a trainer with a local sidecar exits; the parent's sidecar and its socket
    are still there, and the parent reads the rest of the epoch."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    lines = run(TRAINER, str(token_corpus), str(shm_dir), how, where=tmp_path)
    assert lines.count("child") == 1, lines
    report = json.loads(lines[-1])
    assert report["socket"] and report["sidecar"], report
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus)), transforms=[cd.pad_or_truncate("tokens", 8)], global_batch_size=12
    )
    assert report["ids"] == [batch["id"].tolist() for batch in read_all(cd.Loader(pipeline, backend="inprocess"))]
    assert not any(shm_dir.iterdir())


@pytest.mark.parametrize("how", ["exit", "close"])
def test_a_lifecycles_parts_are_stopped_by_the_process_that_made_it(tmp_path: Path, how: str) -> None:
    """A forked child that exits (its exit hook closes every lifecycle) or closes the
    lifecycle stops none of the parent's parts; the parent's exit stops them."""
    assert run(OWNER, how, where=tmp_path) == ["the child has exited", "stopped in the parent"]
