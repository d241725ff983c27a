"""The set-up pins one set of versions everywhere: `uv.lock` matches `pyproject.toml`, the
pip fallback's `requirements/*.txt` hold exactly the lock's pins, and what `make bench`
installs (the project without extras) runs the bench. uv is the pinned copy the Makefile
puts into `.uv/`, else one on PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def uv() -> str:
    found = ROOT / ".uv" / "bin" / "uv"
    path = str(found) if found.exists() else shutil.which("uv")
    if path is None:
        pytest.skip("no uv here (neither .uv/bin/uv, which `make` installs, nor one on PATH): the lock cannot be checked")
    return path


def run_uv(uv: str, *args: str) -> str:
    done = subprocess.run(
        [uv, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"uv {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout


def test_the_lock_matches_pyproject(uv: str) -> None:
    """`uv lock --check`: the lock resolves what pyproject.toml asks for (else: `make lock`)."""
    run_uv(uv, "lock", "--check", "--offline")


@pytest.mark.parametrize("name, extras", [("bench", []), ("test", ["--extra", "test"]), ("train", ["--extra", "train"])])
def test_the_pip_fallbacks_requirements_are_the_locks_pins(uv: str, name: str, extras: list[str]) -> None:
    exported = run_uv(uv, "export", "-q", "--frozen", "--no-hashes", "--no-emit-project", *extras)
    committed = (ROOT / "requirements" / f"{name}.txt").read_text()

    def pins(text: str) -> list[str]:
        return [line for line in text.splitlines() if line and not line.startswith(("#", " "))]

    assert pins(committed) == pins(exported), f"requirements/{name}.txt differs from uv.lock: run `make lock`"


def test_every_dependency_has_a_tested_lower_bound_that_the_lock_meets() -> None:
    """Each dependency in pyproject.toml names a lower bound (`>=`), and the locked version is
    at least that: the bounds are versions the suite ran with."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    locked = {package["name"]: package["version"] for package in lock["package"]}
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?>=([0-9][^,;]*)", requirement)
        assert match, f"{requirement!r}: name a tested lower bound, e.g. 'package>=1.2'"
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        assert name in locked, f"{name} is not in uv.lock: run `make lock`"
        assert _version(locked[name]) >= _version(match.group(3)), f"{name}: locked {locked[name]} < {match.group(3)}"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:4])


def test_the_makefile_installs_from_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "sync -q --locked --inexact" in makefile and "sync -q --locked --extra test --compile-bytecode" in makefile
    assert re.search(r"^\.venv/\.installed-bench|\$\(VENV\)/\.installed-bench: pyproject\.toml uv\.lock", makefile, re.M)
    assert "pip install -q -r requirements/$*.txt -e ." in makefile  # SETUP=pip
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), "CI runs the README's test command"
    # and then checks the set-up as the README gives it: after `make test`, `make bench` and
    # `make train` install nothing, and the README's next line puts `colo-data` on PATH
    assert "make -q .venv/.installed-bench .venv/.installed-train" in ci and "source .venv/bin/activate" in ci
