"""Real containers for tests (root, podman with runc, debootstrap): a private podman store
under a temporary directory, a local Debian base image made with debootstrap (no image
registry is reachable), wheels of colo-data and its dependencies built on the host (a
container has no route to the package index) and the sidecar image built from
`sidecar_image/Dockerfile` on that base, with Ray in its requirements as docs/ray.md says
(`ray[client]==` this venv's Ray). Everything is removed afterwards. Skips, saying
why, where the machine cannot do it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"  # python3 is 3.11 there, like the test venv: the host's wheels fit
BASE_PACKAGES = "python3,python3-venv"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# within the machine's hard limits (podman's defaults exceed them here)
ULIMITS = ("--ulimit", "nofile=10000:10000", "--ulimit", "nproc=10000:10000")
TOOLS = ("podman", "runc", "debootstrap")
# no systemd timers for the image's HEALTHCHECK (there may be no systemd): checks run on demand
NO_HEALTH_TIMER = ("--health-interval", "disable")


def unavailable() -> str | None:
    """Why real containers cannot be run here, or None."""
    if os.geteuid() != 0:
        return f"container tests need root (debootstrap, podman's overlay store, tmpfs mounts); uid is {os.geteuid()}"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"container tests need {', '.join(missing)} (.ci/run installs podman, runc and debootstrap with apt-get)"
    return None


@dataclass
class Podman:
    """`podman` on a private store (overlay, under `root`), always with the runc runtime
    (crun fails on hybrid cgroup hosts), cgroupfs and file events (no systemd needed)."""

    root: Path
    names: list[str] = field(default_factory=list)

    def command(self, *args: str) -> list[str]:
        return [
            "podman",
            "--root", str(self.root / "storage"),
            "--runroot", str(self.root / "run"),
            "--storage-driver", "overlay",
            "--runtime", "runc",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "file",
            *args,
        ]  # fmt: skip

    def __call__(self, *args: str, check: bool = True, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and result.returncode:
            raise AssertionError(f"podman {' '.join(args[:3])} ... failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result

    def run(self, image: str, *args: str, options: Sequence[str] = (), timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`podman run --rm` of `image` with `args`, no network, the ulimits; the result."""
        return self(
            "run", "--rm", "--network", "none", *ULIMITS, *NO_HEALTH_TIMER, *options, image, *args, check=False, timeout=timeout
        )

    def start(self, image: str, *args: str, options: Sequence[str] = (), network: str = "none") -> str:
        """`podman run -d`: a named container on `network` ("host": the host's), removed by
        `cleanup()` at the latest."""
        name = f"colo-data-test-{secrets.token_hex(4)}"
        self.names.append(name)
        self("run", "-d", "--name", name, "--network", network, *ULIMITS, *NO_HEALTH_TIMER, *options, image, *args)
        return name

    def remove(self, name: str) -> None:
        self("rm", "--force", "--time", "10", name, check=False)

    def cleanup(self) -> None:
        """Remove every container and image of the private store, then the store (not
        `podman system reset`: that also drops the machine's network definitions)."""
        for name in self.names:
            self.remove(name)
        self("rm", "--all", "--force", check=False)
        self("rmi", "--all", "--force", check=False, timeout=300)
        unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def build_rootfs(rootfs: Path) -> None:
    """A minimal Debian with python3 and venv (about a minute, from the Debian mirror)."""
    _run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, str(rootfs)], 600, "debootstrap")


def build_wheels(wheels: Path) -> None:
    """Wheels of colo-data and of every runtime dependency, Ray's (the `ray` extra) too, at
    the versions this venv has (so the container computes with the same libraries as the
    host, and its Ray is the host cluster's), from pip's cache where it has them."""
    pins = wheels.parent / "pins.txt"
    frozen = _run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], 120, "pip freeze")
    pins.write_text(frozen)
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-c", str(pins), "-w", str(wheels),
         f"{REPO}[ray]"],
        600,
        "pip wheel",
    )


def build_context(context: Path, wheels: Path) -> None:
    """The build context: `sidecar_image/`, the wheels (no sources: colo-data comes as a
    wheel) and the requirements: Ray's client at this venv's Ray version."""
    import ray

    shutil.copytree(REPO / "sidecar_image", context / "sidecar_image")
    shutil.move(str(wheels), context / "wheels")
    (context / "requirements.txt").write_text(f"ray[client]=={ray.__version__}\n")


def _run(command: list[str], timeout: float, what: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise AssertionError(f"{what} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


@dataclass(frozen=True)
class SidecarImage:
    """The built image, the podman that holds it, and how long each build step took."""

    podman: Podman
    tag: str
    timings: dict[str, float]


def build(work: Path) -> SidecarImage:
    """The base image (debootstrap, `podman import`) and the sidecar image on it, in the
    podman store under `work`."""
    podman = Podman(work / "podman")
    token = secrets.token_hex(4)
    base, tag = f"localhost/colo-data-test-base:{token}", f"localhost/colo-data-sidecar-test:{token}"
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:  # the mirror and the package index in parallel
        rootfs = pool.submit(build_rootfs, work / "rootfs")
        wheels = pool.submit(build_wheels, work / "wheels")
        wheels.result()
        timings["wheels"] = time.perf_counter() - t0
        rootfs.result()
        timings["debootstrap"] = time.perf_counter() - t0
    tar = subprocess.Popen(["tar", "-C", str(work / "rootfs"), "-c", "."], stdout=subprocess.PIPE)
    podman("import", "--change", f"ENV {PATH_ENV}", "-", base, stdin=tar.stdout, timeout=300)
    assert tar.wait() == 0, "tar of the root file system failed"
    shutil.rmtree(work / "rootfs")
    timings["import"] = time.perf_counter() - t0
    build_context(work / "context", work / "wheels")
    podman(
        "build", "--pull=never", "--format", "docker", "--network", "none", *ULIMITS,
        "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "WHEELS=wheels", "--build-arg", "REQUIREMENTS=requirements.txt",
        "-f", str(work / "context" / "sidecar_image" / "Dockerfile"), "-t", tag, str(work / "context"),
        timeout=900,
    )  # fmt: skip
    timings["build"] = time.perf_counter() - t0
    shutil.rmtree(work / "context")
    return SidecarImage(podman, tag, timings)


class ImageBuild:
    """The images, built by a detached process that starts with the test run (conftest.py),
    so that the build's minutes of downloading and unpacking overlap the other tests.
    Detached (`setsid -f`: not a child of a test process), so that tests that count their
    process's children see none of the build's. One build a run, in `work`: the first test
    process to ask starts it (`start`), the others (pytest-xdist's workers) find it by the
    run's link to it. `result()` waits for it, `cleanup()` removes everything."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.podman = Podman(work / "podman")
        self.outcome = work / "outcome.json"

    @classmethod
    def start(cls, link: Path) -> ImageBuild:
        """The build that `link` points to, started now (in a new directory, short enough
        for podman's paths) unless another test process started it."""
        work = Path(tempfile.mkdtemp(prefix="colo-data-container-"))
        try:
            link.symlink_to(work)
        except FileExistsError:
            work.rmdir()
            return cls(link.resolve())
        with open(work / "build.log", "w") as log:
            subprocess.run(
                ["setsid", "-f", sys.executable, __file__, "build", str(work)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True,
            )  # fmt: skip
        return cls(work)

    def _wait(self, timeout: float = 1200) -> dict:
        deadline = time.monotonic() + timeout
        while not self.outcome.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"the image build did not finish in {timeout:.0f} s; see {self.work / 'build.log'}")
            time.sleep(0.5)
        return json.loads(self.outcome.read_text())

    def result(self) -> SidecarImage:
        waited = time.perf_counter()
        outcome = self._wait()
        if "error" in outcome:
            raise AssertionError(f"the image build failed:\n{outcome['error']}")
        steps = ", ".join(f"{k} {v:.0f}" for k, v in outcome["timings"].items())
        print(f"sidecar image built (seconds from the start): {steps}; the tests waited {time.perf_counter() - waited:.0f} s for it")
        return SidecarImage(self.podman, outcome["tag"], outcome["timings"])

    def cleanup(self) -> None:
        try:
            self._wait()
        finally:
            self.podman.cleanup()
            unmount_under(self.work)  # what a failed debootstrap left mounted (proc, sys) in the root fs
            shutil.rmtree(self.work, ignore_errors=True)


_build: ImageBuild | None = None


def build_link() -> Path:
    """The link to this test run's image build, in the run's shared directory (conftest.py)."""
    return Path(os.environ["COLO_DATA_TEST_RUN"]) / "image-build"


def start_build() -> None:
    """Start building the images, once per test run, where the machine can."""
    global _build
    if _build is None and unavailable() is None:
        _build = ImageBuild.start(build_link())


def finish_build() -> None:
    """Remove what the build made (at the end of the test run, once every test process is done)."""
    if build_link().is_symlink():
        ImageBuild(build_link().resolve()).cleanup()


def sidecar_image() -> SidecarImage:
    """The built sidecar image (started now if the session did not start it); skips, saying
    why, where the machine cannot build it."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    start_build()
    assert _build is not None
    return _build.result()


def unmount_under(directory: Path) -> None:
    """Unmount every mount below `directory`, deepest first."""
    prefix = str(directory.resolve()) + "/"
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


def _build_main(work: Path) -> None:
    """The detached build: its outcome (tag and timings, or the error) as JSON in `work`."""
    try:
        image = build(work)
        outcome: dict = {"tag": image.tag, "timings": image.timings}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    partial = work / "outcome.json.partial"
    partial.write_text(json.dumps(outcome))
    partial.rename(work / "outcome.json")


if __name__ == "__main__" and sys.argv[1:2] == ["build"]:
    _build_main(Path(sys.argv[2]))
