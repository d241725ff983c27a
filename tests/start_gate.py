"""Helpers for the start-up gate tests (doctor CONFIG, serve CONFIG, the container) and the
sidecar's shared-memory tests: a config file over the demo pipeline, and a real tmpfs of a
given size (root only)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def demo_config(directory: Path, corpus: Path, seq_len: int, global_batch_size: int) -> Path:
    """A config of `colo_data.demo:pipeline` over `corpus` (importable in the sidecar image too)."""
    config = directory / f"seq{seq_len}-batch{global_batch_size}.toml"
    config.write_text(
        f'pipeline = "colo_data.demo:pipeline"\n[args]\ndata_dir = "{corpus}"\n'
        f"seq_len = {seq_len}\nglobal_batch_size = {global_batch_size}\n"
    )
    return config


@contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "64m") at `mount`, as a container's /dev/shm or a trainer
    host's shared-memory dir; the test fails if a ring segment is left in it."""
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]).returncode:
        pytest.skip(f"cannot mount a {size} tmpfs here (needs root and mount)")
    try:
        yield mount
        left = sorted(p.name for p in mount.iterdir())
        assert not left, f"segments left behind: {left}"
    finally:
        subprocess.run(["umount", str(mount)], check=True)
