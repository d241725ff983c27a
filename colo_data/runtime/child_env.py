"""The environment for a child process of ours (a worker, a local sidecar): this process's,
with `PYTHONPATH` set to its `sys.path` less the directories that another user may write,
so that the child imports the same modules the pipeline's functions come from (cloudpickle
sends importable functions by name) and nothing another user left, and with
`PROCESS_DEFAULTS` (and jemalloc for Arrow) where the user has not set them."""

from __future__ import annotations

import grp
import os
import pwd
import stat
import sys

import pyarrow as pa

# Settings for processes that only move and transform data: without them a light pipeline
# spends a large share of its CPU time on what they switch off (benchmarks/startup.py).
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


def _others_may_write(path: str) -> bool:
    """Whether a user other than this process's and root may write `path`: its owner is
    another user, others may write it (a sticky bit, /tmp's kind, stops them from
    replacing a file, not from adding one), or a group that is not its owner's own may."""
    info = os.stat(path)
    if info.st_uid not in (os.geteuid(), 0) or info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and not _private_group(info.st_uid, info.st_gid)


def _private_group(uid: int, gid: int) -> bool:
    """Whether `gid` is the private group of user `uid`: the user's primary group, named
    after it, with no other member. A umask of 002 (Debian's and Ubuntu's, for such groups)
    leaves a user's checkout group-writable, and nobody else is in that group."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:  # a user or group this machine does not name: nothing says who is in it
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _import_path() -> list[str]:
    """`sys.path` as a child's `PYTHONPATH`: the entries that exist, less those that another
    user may write. `-P` keeps the working directory off a child's path, but `site` still
    imports a `sitecustomize.py` from any `PYTHONPATH` directory at start, and a module not
    installed (pyarrow's optional `pandas`) is looked for along it: a trainer script's
    directory in a shared one (/tmp's kind) would run what another user left there. The
    interpreter's own directories and site-packages come back without `PYTHONPATH`."""
    paths = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        try:
            if not _others_may_write(path):
                paths.append(path)
        except OSError:  # gone, or not a path (an editable install's import hook): nothing to import from
            continue
    return list(dict.fromkeys(paths))


def child_env(threads: int | None = None) -> dict[str, str]:
    """`os.environ` with `PYTHONPATH` = `_import_path()`, and `process_settings()`
    under the names the user has not set. `threads` (a worker's share of the CPU budget)
    sizes the Rayon pool of Rust libraries such as `tokenizers` (`RAYON_NUM_THREADS`, also
    only where unset): each process's pool would otherwise take every CPU, so N workers
    would run N times as many tokenizer threads as CPUs, slower than one thread each."""
    settings = process_settings()
    if threads is not None:
        settings["RAYON_NUM_THREADS"] = str(threads)
    return {**settings, **os.environ, "PYTHONPATH": os.pathsep.join(_import_path())}
