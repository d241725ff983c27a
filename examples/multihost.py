"""Multi-controller JAX with colo-data: one trainer process per host, each computing only
its own host's rows of every global batch. On one machine this starts 2 processes with 2
CPU devices each, which stand for 2 hosts:

    python examples/multihost.py --processes 2 --steps 5

On a real cluster, run `worker(...)` once per host with your coordinator address and
process id (or let `jax.distributed.initialize()` find them, as on Cloud TPU), and drop
the CPU settings.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys


def say(line: str) -> None:
    """Print `line` in one write: the processes share one terminal, where a line written in
    two parts (as `print` does with PYTHONUNBUFFERED set) can interleave with another's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def worker(coordinator: str, processes: int, process_id: int, steps: int, state: str | None) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU stand-in for the accelerators
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)

    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    import colo_data as cd
    from colo_data import demo

    pipeline = demo.pipeline(demo.corpus(), seq_len=128, global_batch_size=8 * processes)
    mesh = Mesh(np.array(jax.devices()), ("data",))  # every device of every process, in id order
    loader = cd.Loader(
        pipeline,
        mesh=mesh,
        partition_spec=PartitionSpec("data"),
        state=json.loads(state) if state else None,
    )  # hosts = jax.process_count(); this process computes only the hosts its devices hold
    say(f"process {process_id} computes host(s) {loader.placement.local_hosts} of {loader.hosts}")
    for step, batch in zip(range(steps), loader):
        tokens = batch["tokens"]  # a global jax.Array: (global_batch_size, 128), sharded over all devices
        rows = sorted({s.index[0].start for s in tokens.addressable_shards})
        say(f"process {process_id} step {step}: global {tokens.shape}, holds rows starting at {rows}")
    if process_id == 0:
        say("state: " + json.dumps(loader.get_state()))
    loader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--state", help="a state printed by an earlier run (JSON), to continue from")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        worker(args.coordinator, args.processes, args.process_id, args.steps, args.state)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    common = [sys.executable, __file__, "--processes", str(args.processes), "--steps", str(args.steps)]
    common += ["--coordinator", coordinator] + (["--state", args.state] if args.state else [])
    children = [subprocess.Popen(common + ["--process-id", str(i)]) for i in range(args.processes)]
    try:
        codes = [child.wait(timeout=300) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    if any(codes):
        sys.exit(f"a process failed: exit codes {codes}")


if __name__ == "__main__":
    main()
