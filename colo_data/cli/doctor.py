"""`colo-data doctor`: print what this host gives an input pipeline (CPU budget and why,
workers, memory, shared memory) and what JAX sees, to check a container before a run."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
from typing import Any

import click
import jax

from colo_data.errors import ColoDataError
from colo_data.resources import cpu_budget, memory_limit, shm_capacity

SHM_DIR = "/dev/shm"
PACKAGES = ("colo-data", "jax", "jaxlib", "grain", "pyarrow", "pathwaysutils", "numpy")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of aligned text.")
def doctor(as_json: bool) -> None:
    """Report the CPU budget, memory, shared memory, JAX backend and package versions."""
    try:
        report = _report()
    except ColoDataError as error:
        raise click.ClickException(str(error)) from error
    click.echo(json.dumps(report, indent=2) if as_json else _text(report))


def _report() -> dict[str, Any]:
    return {
        "cpu": dataclasses.asdict(cpu_budget()),
        "memory_limit": memory_limit(),
        "shm": {"directory": SHM_DIR, "free_bytes": shm_capacity(SHM_DIR)},
        "jax": {
            "backend": jax.default_backend(),
            "devices": [str(device) for device in jax.devices()],
            "pathways": _pathways_used(),
        },
        "versions": {**{name: _version(name) for name in PACKAGES}, "python": platform.python_version()},
    }


def _pathways_used() -> bool:
    """Whether JAX talks to the Pathways proxy (pathwaysutils returns None/"" for no)."""
    try:
        import pathwaysutils
    except ImportError:
        return False
    return bool(pathwaysutils.is_pathways_backend_used())


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _text(report: dict[str, Any]) -> str:
    cpu, shm, jax_info = report["cpu"], report["shm"], report["jax"]
    quota = "unlimited" if cpu["quota"] is None else f"{cpu['quota']:g} CPUs"
    memory = "unlimited" if report["memory_limit"] is None else _bytes(report["memory_limit"])
    rows = [
        ("cpu budget", f"{cpu['cpus']:g} CPUs ({cpu['source']})"),
        ("affinity mask", f"{cpu['affinity']} CPUs"),
        ("cgroup cpu quota", quota),
        ("workers", str(cpu["workers"])),
        ("memory limit", memory),
        (f"shm {shm['directory']}", f"{_bytes(shm['free_bytes'])} free"),
        ("jax backend", jax_info["backend"]),
        ("jax devices", f"{len(jax_info['devices'])}: {', '.join(jax_info['devices'])}"),
        ("pathways proxy", "yes" if jax_info["pathways"] else "no"),
        *((f"version {name}", version or "not installed") for name, version in report["versions"].items()),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _bytes(count: int) -> str:
    return f"{count / 2**30:.1f} GiB ({count} bytes)"
