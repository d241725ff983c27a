"""The environment for a child process of ours (a worker, a local sidecar): this process's,
with `PYTHONPATH` set to its `sys.path`, so that the child imports the same modules the
pipeline's functions come from (cloudpickle sends importable functions by name), and with
`PROCESS_DEFAULTS` (and jemalloc for Arrow) where the user has not set them."""

from __future__ import annotations

import os
import sys

import pyarrow as pa

# Settings for processes that only move and transform data, measured on the demo pipeline
# (benchmarks/startup.py): about a third of a light pipeline's CPU time went to them.
PROCESS_DEFAULTS = {
    # numpy asks for transparent huge pages for arrays of 4 MiB and more: every new batch
    # buffer then faults in 2 MiB pages that the kernel zeroes (or compacts memory for).
    "NUMPY_MADVISE_HUGEPAGE": "0",
    # A pipeline never multiplies matrices; numpy's OpenBLAS thread pool (one thread per
    # core) only spins and takes CPU from the workers.
    "OPENBLAS_NUM_THREADS": "1",
}
# Arrow's default allocator (mimalloc) hands freed pages back within milliseconds and takes
# them again as huge pages for the next batch, zeroed each time (a fifth of a worker's CPU
# time); jemalloc keeps them. Only where this pyarrow build has it.
_ARROW_POOL = "jemalloc"


def process_settings() -> dict[str, str]:
    """`PROCESS_DEFAULTS`, and `ARROW_DEFAULT_MEMORY_POOL=jemalloc` where this pyarrow build
    has jemalloc: the settings our child processes start with (and the sidecar image sets)."""
    settings = dict(PROCESS_DEFAULTS)
    if _ARROW_POOL in pa.supported_memory_backends():
        settings["ARROW_DEFAULT_MEMORY_POOL"] = _ARROW_POOL
    return settings


def child_command(module: str) -> list[str]:
    """The command that runs `module` in a child process of ours, with this interpreter.
    `-P`: `-m` alone puts the working directory first on the import path, where a module
    left there (a `tokenizers.py` in a shared directory) shadows an installed one; the
    child imports from this process's path instead, which `child_env` passes on."""
    return [sys.executable, "-P", "-m", module]


def child_env(threads: int | None = None) -> dict[str, str]:
    """`os.environ` with `PYTHONPATH` = this process's import path, and `process_settings()`
    under the names the user has not set. `threads` (a worker's share of the CPU budget)
    sizes the Rayon pool of Rust libraries such as `tokenizers` (`RAYON_NUM_THREADS`, also
    only where unset): each process's pool would otherwise take every CPU, so N workers
    ran N times as many tokenizer threads as CPUs (2 workers on 2 CPUs: 0.58x the
    records/s of one thread each, benchmarks/lm.py's pipeline)."""
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    settings = process_settings()
    if threads is not None:
        settings["RAYON_NUM_THREADS"] = str(threads)
    return {**settings, **os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
