"""Benchmark runs in fresh child processes, each in a session of its own and with a mark in
its environment, so that whatever a run starts (a sidecar, worker processes, which start
sessions of their own) is found and reported if it outlives the run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil

CHILD_TIMEOUT_S = 300
LEFT_GRACE_S = 10.0  # a sidecar notices that its trainer is gone within a second or two
MARK = "COLO_DATA_BENCH_RUN"  # in a run's environment, and so in that of every process it starts


def run_processes(sid: int, mark: str) -> list[psutil.Process]:
    """The processes of session `sid`, and those whose environment has `MARK` = `mark`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid or proc.environ().get(MARK) == mark:
                found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


def stop_run(sid: int, mark: str, grace: float) -> list[str]:
    """Processes of a child's run (`run_processes`) still alive `grace` seconds after the
    child ended (its sidecar, workers): 'pid cmdline' of each, then killed."""
    deadline = time.monotonic() + grace
    while (left := run_processes(sid, mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    said = []
    for proc in left:
        try:
            said.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.Error:
            pass
    return said


def run(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str, str, list[str]]:
    """Run `command` in `cwd` (the tree: `python -c` imports from the working directory
    first), in a session of its own; returns the time.monotonic() readings at its start and
    end, its stdout and stderr, and the processes it left behind. Raises RuntimeError when it
    fails."""
    started = time.monotonic()
    mark = uuid.uuid4().hex
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, MARK: mark},
        start_new_session=True,
        cwd=cwd,
    )
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
    ended = time.monotonic()
    left = stop_run(child.pid, mark, LEFT_GRACE_S)
    if child.returncode:
        at = err.rfind("Traceback")
        why = err[at:] if at >= 0 else err[-3000:]
        raise RuntimeError(f"{' '.join(command)[:300]} failed (exit {child.returncode}):\n{why[-4000:]}")
    return started, ended, out, err, left
