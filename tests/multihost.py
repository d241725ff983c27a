"""Run a function in several `jax.distributed` processes on this machine and collect what
each process could address of its global batches.

`run(worker, processes, args, tmp_path)` starts `processes` Python processes. Each one sets
up JAX before anything else uses it (`devices` CPU devices, gloo collectives), joins the
distributed runtime on a free localhost port, imports `worker` by name (a module-level
function in a module on `tests/`) and calls `worker(args)`, which returns
`{"batches": [record(batch), ...], "info": <JSON-able>}`. `record` keeps only the rows a
process holds: for every column, each addressable shard's global index and values. The
child writes its result to a file; `run` reads them back, one `Result` per process.

`merge(results)` puts the processes' rows back together into whole global batches (numpy),
failing if a row is held by no device or if two devices hold different values for it.

Every child runs in its own session (process group): on a failure, a timeout or an error
in the test, the whole group (the child's sidecars and workers too) is terminated and
reaped; a failure names the reason and shows the end of every child's output."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

GRACE_S = 10.0  # how long the others may run on after one process failed (they may be blocked on it)
LINGER_S = 10.0  # how long a child's own children may outlive it
STOP_S = 3.0  # SIGTERM to SIGKILL (jax.distributed catches SIGTERM for its preemption notice)
LOG_TAIL = 4000  # characters of each child's output in a failure message

# What `record` makes of one global batch: column -> (global shape, dtype, shards), each
# shard ((start, stop) per dimension, device id, values).
Shard = tuple[tuple[tuple[int, int], ...], int, np.ndarray]
Recorded = dict[str, tuple[tuple[int, ...], str, list[Shard]]]


@dataclasses.dataclass
class Result:
    """What one process reported: its JAX identity, the worker's `info` and its batches."""

    process: int
    info: Any
    batches: list[Recorded]
    local_devices: list[int]


def record(batch: dict[str, Any]) -> Recorded:
    """The rows of `batch` (`dict[str, jax.Array]`) that this process holds, copied out."""
    out: Recorded = {}
    for name, array in batch.items():
        shards = []
        for shard in array.addressable_shards:
            index = tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape))
            shards.append((index, shard.device.id, np.array(shard.data)))
        out[name] = (tuple(array.shape), str(array.dtype), shards)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # the test process forces its own CPU device count through XLA_FLAGS; the child sets its own
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    tests = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists but is not ours to signal
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(process: subprocess.Popen) -> bool:
    """End the child and everything in its process group; True if any of it was still running."""
    pgid = process.pid  # start_new_session: the child leads its own group
    running = process.poll() is None or _group_alive(pgid)
    if running:
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        while (process.poll() is None or _group_alive(pgid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + STOP_S
    while _group_alive(pgid) and time.monotonic() < deadline:  # SIGKILLed grandchildren are reaped by init
        time.sleep(0.05)
    return running


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output file)"
    return text if len(text) <= LOG_TAIL else "...\n" + text[-LOG_TAIL:]


def run(
    worker: Callable[[dict[str, Any]], dict[str, Any]],
    processes: int,
    args: dict[str, Any],
    tmp_path: Path,
    *,
    devices: int = 2,
    timeout: float = 120.0,
    grace: float = GRACE_S,
) -> list[Result]:
    """Run `worker(args)` in `processes` jax.distributed processes with `devices` CPU
    devices each; their results, by process index. The whole run is bounded by `timeout`
    seconds; once a process has failed the others get `grace` seconds to end (they may be
    blocked on it); a child's processes still alive `LINGER_S` seconds after it exited
    fail the run (they are killed either way)."""
    name = f"{worker.__module__}:{worker.__qualname__}"
    directory = Path(tmp_path) / f"multihost-{processes}p-{time.monotonic_ns()}"
    directory.mkdir(parents=True)
    spec = dict(
        worker=name,
        args=args,
        coordinator=f"127.0.0.1:{free_port()}",
        processes=processes,
        devices=devices,
        out=str(directory),
    )
    (directory / "spec.json").write_text(json.dumps(spec))
    children: list[subprocess.Popen] = []
    logs = [directory / f"process-{i}.log" for i in range(processes)]
    problem = None
    started = time.monotonic()
    try:
        for i, log in enumerate(logs):
            with open(log, "wb") as out:
                children.append(
                    subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), str(directory / "spec.json"), str(i)],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=_child_env(),
                        start_new_session=True,
                    )
                )
        failed_at = None
        while None in (codes := [c.poll() for c in children]):  # poll every child, not just up to a running one
            now = time.monotonic()
            if now - started > timeout:
                problem = f"timed out after {timeout:.0f} s"
                break
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > grace:
                problem = f"a process failed and the others were still running {grace:.0f} s later"
                break
            time.sleep(0.05)
        exited = time.monotonic()
        # a loader's sidecars and workers exit shortly after it
        while problem is None and any(_group_alive(c.pid) for c in children) and time.monotonic() - exited < LINGER_S:
            time.sleep(0.1)
    finally:
        left = [i for i, c in enumerate(children) if _stop(c)]
    codes = [c.returncode for c in children]
    if problem is None and any(codes):
        problem = "a process failed"
    if problem is None and left:
        problem = f"processes left behind by process(es) {left} (killed)"
    if problem is None:
        missing = [i for i in range(processes) if not (directory / f"result-{i}.json").exists()]
        if missing:
            problem = f"no result from process(es) {missing}"
    if problem is not None:
        report = [f"{processes} jax.distributed processes running {name}: {problem} ({time.monotonic() - started:.1f} s)"]
        for i, (code, log) in enumerate(zip(codes, logs)):
            report.append(f"----- process {i}: exit code {code}, output:\n{_tail(log)}")
        raise AssertionError("\n".join(report))
    return [_load(directory, i) for i in range(processes)]


def _save(directory: Path, process: int, result: dict[str, Any], header: dict[str, Any]) -> None:
    arrays: dict[str, np.ndarray] = {}
    batches = []
    for step, recorded in enumerate(result["batches"]):
        columns = {}
        for name, (shape, dtype, shards) in recorded.items():
            entries = []
            for k, (index, device, values) in enumerate(shards):
                key = f"{step}/{name}/{k}"
                arrays[key] = values
                entries.append(dict(index=index, device=device, key=key))
            columns[name] = dict(shape=shape, dtype=dtype, shards=entries)
        batches.append(columns)
    np.savez(directory / f"result-{process}.npz", **arrays)
    body = dict(header, info=result.get("info"), batches=batches)
    tmp = directory / f"result-{process}.json.tmp"
    tmp.write_text(json.dumps(body))
    tmp.rename(directory / f"result-{process}.json")  # last: its presence means the result is whole


def _load(directory: Path, process: int) -> Result:
    body = json.loads((directory / f"result-{process}.json").read_text())
    with np.load(directory / f"result-{process}.npz") as arrays:
        batches = [
            {
                name: (
                    tuple(column["shape"]),
                    column["dtype"],
                    [(tuple(map(tuple, s["index"])), s["device"], arrays[s["key"]]) for s in column["shards"]],
                )
                for name, column in recorded.items()
            }
            for recorded in body["batches"]
        ]
    return Result(body["process"], body["info"], batches, body["local_devices"])


def merge(results: list[Result]) -> list[dict[str, np.ndarray]]:
    """Whole global batches from the processes' rows. Every process must have seen the same
    number of batches with the same columns, global shapes and dtypes; every element must be
    held by some device, and copies held by several devices must agree."""
    counts = {r.process: len(r.batches) for r in results}
    assert len(set(counts.values())) == 1, f"batches seen by each process differ: {counts}"
    merged = []
    for step in range(len(results[0].batches)):
        names = {r.process: sorted(r.batches[step]) for r in results}
        assert len({tuple(n) for n in names.values()}) == 1, f"batch {step}: columns differ by process: {names}"
        batch = {}
        for name in names[results[0].process]:
            layouts = {r.process: r.batches[step][name][:2] for r in results}
            assert len(set(layouts.values())) == 1, f"batch {step}, column {name!r}: (shape, dtype) by process: {layouts}"
            shape, dtype = layouts[results[0].process]
            full = np.zeros(shape, dtype)
            filled = np.zeros(shape, bool)
            holder = np.full(shape[:1], -1)
            for r in results:
                for index, device, values in r.batches[step][name][2]:
                    where = tuple(slice(a, b) for a, b in index)
                    assert values.shape == full[where].shape, (
                        f"batch {step}, column {name!r}: process {r.process} device {device} holds {values.shape} "
                        f"for global index {index}"
                    )
                    same = full[where] == values
                    if values.dtype.kind in "fc":  # NaN is the same as NaN here
                        same |= np.isnan(full[where]) & np.isnan(values)
                    differ = filled[where] & ~same
                    if differ.any():
                        rows = np.unique(np.nonzero(differ)[0] + index[0][0])
                        raise AssertionError(
                            f"batch {step}, column {name!r}, global rows {index[0][0]}..{index[0][1] - 1}: process "
                            f"{r.process} device {device} holds other values than process(es) "
                            f"{sorted(set(holder[rows].tolist()))} for rows {rows.tolist()}:\n{values}\nvs\n{full[where]}"
                        )
                    full[where] = values
                    filled[where] = True
                    holder[index[0][0] : index[0][1]] = r.process
            missing = np.unique(np.nonzero(~filled)[0])
            assert not len(missing), f"batch {step}, column {name!r}: global rows {missing.tolist()} held by no device"
            batch[name] = full
        merged.append(batch)
    return merged


def _child(spec_path: str, process: int) -> None:
    """One process of a `run`: set up JAX, join the others, run the worker, save its result."""
    spec = json.loads(Path(spec_path).read_text())
    from absl import flags  # Grain's multiprocessing reads absl flags

    flags.FLAGS.mark_as_parsed()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", spec["devices"])
    jax.distributed.initialize(spec["coordinator"], num_processes=spec["processes"], process_id=process)
    assert jax.process_index() == process and jax.process_count() == spec["processes"]
    assert jax.local_device_count() == spec["devices"], jax.local_devices()
    module, _, qualname = spec["worker"].partition(":")
    worker = importlib.import_module(module)
    for part in qualname.split("."):
        worker = getattr(worker, part)
    result = worker(spec["args"])
    header = dict(process=process, local_devices=[d.id for d in jax.local_devices()])
    _save(Path(spec["out"]), process, result, header)
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        _child(sys.argv[1], int(sys.argv[2]))
    except BaseException:
        # at once: a normal exit would wait in jax.distributed's shutdown for the others
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
