"""colo-data as a user gets it: a wheel built from this checkout (offline, without build
isolation), installed non-editable into a fresh venv outside the repository, runs
`colo-data manifest` for both targets (from the templates shipped as package data) and
`colo-data doctor`, importing colo_data from that venv and never from the checkout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import yaml

import colo_data as cd

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = {
    f"colo_data/deploy/templates/{name}.yaml" for name in ("multi-controller", "pathways-jobset", "ray-cluster")
}
SLICE = ("--set", "tpu_type=v6e", "--set", "topology=2x2", "--set", "gcs_scratch=gs://bucket/pathways")


def run(command: list[str], cwd: Path, timeout: float = 120) -> str:
    """Run `command` in `cwd` with no PYTHONPATH (nothing may point back at the checkout)."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    result = subprocess.run(
        command, check=False, cwd=cwd, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the checkout's package sources (so that no `build/` of an
    earlier build is packed, and the checkout is left as it is), built by this venv's
    setuptools (the test extra installs one that builds wheels by itself)."""
    try:
        setuptools = tuple(int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        setuptools = (0, 0)
    assert setuptools >= (70, 1), "this venv's setuptools cannot build wheels without network: pip install -e '.[test]'"
    source = tmp_path / "source"
    shutil.copytree(ROOT / "colo_data", source / "colo_data", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)]
    run([sys.executable, "-m", "pip", *build], tmp_path)
    (wheel,) = wheels.glob("colo_data-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv with `wheel` installed in it; the dependencies come from this test's venv,
    whose site-packages is appended to the new one's path by a .pth line (a path line:
    the .pth files in that directory, such as an editable colo-data's, do not run)."""
    target = tmp_path / "venv"
    venv.create(target, with_pip=False)
    python = target / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path)
    return target


def demo_config(tmp_path: Path, corpus: Path) -> Path:
    """configs/demo.toml reading `corpus` instead of the built-in demo corpus."""
    demo = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    args = {**demo["args"], "data_dir": str(corpus)}
    lines = [f"pipeline = {json.dumps(demo['pipeline'])}", "[args]", *(f"{k} = {json.dumps(v)}" for k, v in args.items())]
    lines += ["[sidecar]", *(f"{k} = {json.dumps(v)}" for k, v in demo["sidecar"].items())]
    path = tmp_path / "demo.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_installed_wheel_renders_manifests_and_runs_doctor(tmp_path: Path, token_corpus: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert TEMPLATES <= names, "the manifest templates are not in the wheel (see [tool.setuptools.package-data])"
    assert "colo_data/telemetry/prometheus.py" in names and "colo_data/cli/__main__.py" in names

    target = fresh_venv(tmp_path, wheel)
    work = tmp_path / "work"  # outside the checkout: the current directory cannot shadow the install
    work.mkdir()
    where = run([str(target / "bin" / "python"), "-c", "import colo_data; print(colo_data.__file__)"], work).strip()
    assert Path(where).is_relative_to(target), f"colo_data imported from {where}, not from the new venv"
    colo = str(target / "bin" / "colo-data")
    config = demo_config(tmp_path, token_corpus)

    (job_service, job) = yaml.safe_load_all(run([colo, "manifest", str(config), "--target", "multi-controller"], work))
    assert (job_service["kind"], job["kind"]) == ("Service", "Job")
    pod = job["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    assert images["colo-data-sidecar"] == "colo-data-sidecar:0.1.0"  # the installed distribution's version
    assert "trainer" in images
    (jobset,) = yaml.safe_load_all(run([colo, "manifest", str(config), "--target", "pathways", *SLICE], work))
    assert jobset["kind"] == "JobSet"
    assert '"colo-data-sidecar:0.1.0-colocated"' in json.dumps(jobset)

    report = json.loads(run([colo, "doctor", "--json"], work))
    assert report["versions"]["colo-data"] == "0.1.0"
    assert report["jax"]["backend"] == "cpu" and report["jax"]["devices"]
    assert report["cpu"]["workers"] == cd.resources.cpu_budget().workers  # what this process, in the same cgroup, sees
    doctor_text = run([colo, "doctor"], work)
    assert "jax devices" in doctor_text and "version colo-data" in doctor_text
