"""The environment for a child process of ours (a worker, a local sidecar): this process's,
with `PYTHONPATH` set to its `sys.path`, so that the child imports the same modules the
pipeline's functions come from (cloudpickle sends importable functions by name)."""

from __future__ import annotations

import os
import sys


def child_env() -> dict[str, str]:
    """`os.environ` with `PYTHONPATH` = this process's import path."""
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
