"""Grain's `index_shuffle` (a per-index bijection with O(1) memory, C++), loaded without
importing the `grain` package: `import grain` imports JAX, orbax and prometheus-client
(about 1 s), which a sidecar or worker process that only orders records does not need.
Falls back to the public `grain.experimental.index_shuffle` where the compiled module is
not found where Grain 0.2 keeps it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from collections.abc import Callable
from pathlib import Path

_MODULE = "grain._src.python.experimental.index_shuffle.python.index_shuffle_module"
_shuffle: Callable[..., int] | None = None


def _load() -> Callable[..., int]:
    spec = importlib.util.find_spec("grain")  # finds the package without running its __init__
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)), *_MODULE.split(".")[1:-1])
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = folder / f"index_shuffle_module{suffix}"
            if path.is_file():
                module_spec = importlib.util.spec_from_file_location(_MODULE, path)
                assert module_spec is not None and module_spec.loader is not None
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                return module.index_shuffle
    from grain.experimental import index_shuffle as public

    return public


def index_shuffle() -> Callable[..., int]:
    """Grain's `index_shuffle(index, max_index=, seed=, rounds=)`: the position `index` maps
    to in a permutation of `[0, max_index]` fixed by `seed`. Loaded once, on first use."""
    global _shuffle
    if _shuffle is None:
        _shuffle = _load()
    return _shuffle
