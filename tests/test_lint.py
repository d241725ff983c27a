"""The linter (ruff, over the library and the benchmarks) and the type checker (mypy) pass, with the settings in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Both tools keep a cache in the repository (.ruff_cache, .mypy_cache): mypy takes about
# 12 s without one (JAX not followed: see pyproject.toml), 1 s with it.
COMMANDS = {
    "ruff": ["-m", "ruff", "check", "colo_data", "benchmarks"],
    "mypy": ["-m", "mypy", "colo_data"],
}


@pytest.mark.parametrize("tool", sorted(COMMANDS))
def test_clean(tool: str) -> None:
    result = subprocess.run(
        [sys.executable, *COMMANDS[tool]], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{tool} found problems:\n{result.stdout}{result.stderr}"
