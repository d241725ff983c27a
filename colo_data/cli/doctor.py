"""`colo-data doctor`: print what this host gives an input pipeline (CPU budget and why,
workers, memory, shared memory) and what JAX sees, to check a container before a run.
Given a CONFIG it also sizes the sidecar's shared-memory ring as the sidecar will, and
exits non-zero (after the report) when the ring cannot fit, and, with or without one, when
the shared-memory directory cannot hold a ring at all (a file, read-only): the sidecar image runs it
before the sidecar and refuses to start on that. Where the trainer is a Pathways client
(`JAX_PLATFORMS=proxy`) it also warns about settings of its environment that do not reach
Pathways' compiler; warnings do not change the exit status."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping
from typing import Any

import click

from colo_data import defaults
from colo_data.backends.sidecar.shm import check_directory
from colo_data.cli.sidecar import check_config_ring, hosts_option, slots_option
from colo_data.config import CONFIG_IS_CODE, Config, load_config
from colo_data.errors import ColoDataError, ShmError
from colo_data.runtime.budget import CpuBudget, cpu_budget, memory_limit, shm_capacity
from colo_data.workers.ray_options import RayWorkers
from colo_data.workers.settings import Workers, choose_workers

PACKAGES = ("colo-data", "jax", "jaxlib", "grain", "pyarrow", "pathwaysutils", "numpy")
CLIENT_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # read by the process that compiles
# Where the Pathways servers keep their files, the persistent compilation cache among them
# (under its compilation_cache/): their --gcs_scratch_location, which colo-data's JobSet
# also gives the trainer in this variable.
SCRATCH_ENV = "COLO_DATA_PATHWAYS_SCRATCH"


@click.command(epilog=CONFIG_IS_CODE)
@click.argument("config", required=False, envvar="COLO_DATA_CONFIG", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--shm-dir", default=None, envvar="COLO_DATA_SHM_DIR", help="The sidecar's shared-memory directory [config, else /dev/shm]."
)
@slots_option("Slots of the ring [config, else 4].")
@hosts_option("The trainer's host count [1: the largest ring].")
@click.option(
    "--ray",
    "ray_address",
    default=None,
    help='Check the Ray cluster of cd.RayWorkers at this address ("auto", HOST:PORT, ray://HOST:PORT) [the config\'s '
    "[sidecar] workers, if Ray workers].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of aligned text.")
def doctor(
    config: str | None, shm_dir: str | None, slots: int | None, hosts: int, ray_address: str | None, as_json: bool
) -> None:
    """Report the CPU budget, memory, shared memory, JAX backend and package versions; with
    CONFIG, also the ring its sidecar needs, failing when it does not fit; with Ray workers,
    whether their cluster is reachable and runs this Ray and Python, failing when not."""
    try:
        settings = load_config(config) if config else None
        options = settings.sidecar if settings else {}
        directory = shm_dir or options.get("shm_dir", defaults.SHM_DIR)
        report = _report(directory, settings.deploy if settings else {})
        report["workers"] = _workers(options.get("workers", "auto"), CpuBudget(**report["cpu"]))
        if settings is not None:
            report["ring"] = _ring(settings, directory, slots or int(options.get("slots", defaults.SLOTS)), hosts)
        ray = RayWorkers(address=ray_address) if ray_address is not None else RayWorkers.of(options.get("workers"))
        if ray is not None:
            report["ray"] = _ray(ray, hosts)
    except ColoDataError as error:
        if as_json:  # stdout stays one JSON object, a fatal finding included
            click.echo(json.dumps({"error": str(error), "type": type(error).__name__}, indent=2))
        raise click.ClickException(str(error)) from error
    click.echo(json.dumps(report, indent=2) if as_json else _text(report))
    for finding in (report["shm"], report.get("ring", {}), report.get("ray", {})):
        if finding.get("error"):
            raise click.ClickException(finding["error"])


def _ring(settings: Config, shm_dir: str, slots: int, hosts: int) -> dict[str, Any]:
    """The ring CONFIG's sidecar needs (the sidecar's own computation) and whether it fits."""
    # imports the pipeline machinery: only with a CONFIG
    from colo_data.backends.sidecar.ring_plan import plan_ring

    plan = plan_ring(settings.build(), shm_dir, slots, hosts)
    try:
        check_config_ring(settings, shm_dir, slots, hosts, plan)
        error = None
    except ShmError as failure:
        error = str(failure)
    return {
        "config": settings.path,
        "hosts": hosts,
        "slots": plan.slots,
        "batches_per_slot": plan.per_slot,
        "slot_bytes": plan.slot_size,
        "needed_bytes": plan.needed,
        "free_bytes": plan.free,
        "memory_limit": plan.memory_limit,
        "fits": error is None,
        "error": error,
    }


def _ray(workers: RayWorkers, hosts: int) -> dict[str, Any]:
    """Whether `workers`' Ray cluster is reachable from here and runs this Ray and Python
    (Ray refuses a driver of another version), its live nodes and CPUs, and the CPUs that
    `hosts` host pipelines' actors reserve (a shared pool's, once); an `error` when it cannot be used."""
    import ray  # noqa: PLC0415 - only for Ray workers

    from colo_data.workers.ray_pool import connect

    needed = workers.actors * workers.num_cpus * (1 if workers.pool else hosts)
    finding: dict[str, Any] = {
        "address": workers.address,
        "hosts": hosts,
        "pool": workers.pool,
        "actors_need_cpus": needed,
        "error": None,
    }
    try:
        connected = connect(workers.address, workers.connect_timeout)
    except ColoDataError as error:
        return {**finding, "reachable": False, "error": str(error)}
    try:
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        cpus = float(ray.cluster_resources().get("CPU", 0))
    finally:
        if connected:
            ray.shutdown()
    return {
        **finding,
        "reachable": True,
        "ray": ray.__version__,
        "python": platform.python_version(),
        "nodes": len(nodes),
        "cpus": cpus,
    }


def _workers(setting: Workers, budget: CpuBudget) -> dict[str, Any]:
    """The most worker processes (or Ray actors) the config's `[sidecar] workers` (read by
    `load_config`; without a config, "auto") allows a sidecar on `budget` (the report's),
    and why, as the sidecar itself would say."""
    choice = choose_workers(setting, budget)
    return {"most": choice.count, "why": choice.reason}


def _report(shm_dir: str = defaults.SHM_DIR, deploy: Mapping[str, Any] | None = None) -> dict[str, Any]:
    jax_info = _jax()
    return {
        "cpu": dataclasses.asdict(cpu_budget()),
        "memory_limit": memory_limit(),
        "shm": _shm(shm_dir),
        "jax": jax_info,
        "versions": {**{name: _version(name) for name in PACKAGES}, "python": platform.python_version()},
        "warnings": _pathways_warnings(deploy or {}) if jax_info["pathways"] else [],
    }


def _shm(shm_dir: str) -> dict[str, Any]:
    """The shared-memory directory's free bytes, and an `error` when no ring can be made in
    it (a file, not writable): a fatal finding, like a ring that does not fit."""
    shm: dict[str, Any] = {"directory": shm_dir, "free_bytes": shm_capacity(shm_dir)}
    try:
        check_directory(shm_dir)
    except ShmError as error:
        shm["error"] = str(error)
    return shm


def _jax() -> dict[str, Any]:
    """What JAX sees: its backend, devices and whether they are Pathways'. JAX is imported
    here, not with the module, so that the rest of the command line starts without it. On
    Pathways the proxy backend is registered first (`pathwaysutils.initialize()`, as the
    Loader does); a backend that cannot start (no proxy at JAX_BACKEND_TARGET, a platform
    this host lacks) is reported in `error`, with no backend and no devices."""
    import jax

    pathways = _pathways_used()
    try:
        if pathways:
            import pathwaysutils

            pathwaysutils.initialize()
        backend, devices, error = jax.default_backend(), [str(device) for device in jax.devices()], None
    except RuntimeError as e:  # jax.errors.JaxRuntimeError is one
        backend, devices, error = None, [], str(e)
    return {"backend": backend, "devices": devices, "pathways": pathways, "error": error}


def _pathways_warnings(deploy: Mapping[str, Any]) -> list[str]:
    """Settings of a Pathways client's environment (`JAX_PLATFORMS=proxy`) that do nothing
    there: compiler flags, read by the process that compiles (the pathways-proxy, not the
    client), and JAX's own compilation cache, which pathwaysutils turns off under Pathways
    (Pathways keeps its own); and a Pathways compilation cache location that is missing
    (neither `SCRATCH_ENV` nor the config's `[deploy] gcs_scratch`) or not on GCS. Asked
    only on Pathways."""
    found = []
    for name in CLIENT_FLAG_VARIABLES:
        flags = " ".join(os.environ.get(name, "").split())
        if flags:
            found.append(
                f"{name} is set in this JAX client's environment ({flags}), but under Pathways (JAX_PLATFORMS=proxy) "
                "the pathways-proxy compiles, not this process: those flags do not reach the compiler. Put them on the "
                f"proxy: colo-data manifest CONFIG --target pathways --set xla_flags='{flags}' (or [deploy] xla_flags), "
                f"and unset {name} here."
            )
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache:
        found.append(
            f"JAX_COMPILATION_CACHE_DIR is set ({cache}), but under Pathways JAX's own compilation cache is off: "
            "pathwaysutils.initialize() (which the Loader calls) turns it off, because Pathways handles its own "
            "compilation cache. Nothing is cached there; unset it."
        )
    scratch = os.environ.get(SCRATCH_ENV) or deploy.get("gcs_scratch")
    if not scratch:
        found.append(
            "no Pathways persistent compilation cache location is set for this job: Pathways keeps its compilation "
            "cache under its servers' --gcs_scratch_location (in compilation_cache/), and without a lasting one every "
            "restart compiles from scratch. Give one with [deploy] gcs_scratch or colo-data manifest CONFIG --target "
            f"pathways --set gcs_scratch=gs://BUCKET/pathways, which also sets {SCRATCH_ENV} for the trainer "
            "(run colo-data doctor with that CONFIG, or in the trainer's container)."
        )
    elif not str(scratch).startswith("gs://"):
        found.append(
            f"the Pathways persistent compilation cache location is {scratch!r}, not a gs:// location: the Pathways "
            "servers keep their compilation cache there (--gcs_scratch_location), on GCS; give gs://BUCKET/PATH."
        )
    return found


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
        ("workers", report["workers"]["why"]),
        ("grain workers", f"{cpu['workers']} (grain_multiprocessing_options: a CPU of the budget each, less one)"),
        ("memory limit", memory),
        (f"shm {shm['directory']}", f"{_bytes(shm['free_bytes'])} free" + (" (UNUSABLE: see below)" if "error" in shm else "")),
        ("jax backend", jax_info["backend"] or f"unavailable: {jax_info['error']}"),
        ("jax devices", f"{len(jax_info['devices'])}: {', '.join(jax_info['devices'])}" if jax_info["devices"] else "none"),
        ("pathways proxy", "yes" if jax_info["pathways"] else "no"),
        *((f"version {name}", version or "not installed") for name, version in report["versions"].items()),
    ]
    if "ring" in report:
        ring = report["ring"]
        rows += [
            ("ring config", f"{ring['config']} (host 0 of {ring['hosts']})"),
            (
                "ring needs",
                f"{ring['slots']} slots x {ring['slot_bytes']} bytes ({ring['batches_per_slot']} batch(es) a slot) = "
                f"{ring['needed_bytes'] / 2**20:.1f} MiB ({ring['needed_bytes']} bytes)",
            ),
            ("ring fits", "yes" if ring["fits"] else "NO (see the error below)"),
        ]
    if "ray" in report:
        found = report["ray"]
        if found["reachable"]:
            seen = f"reachable: Ray {found['ray']}, Python {found['python']} (the same here); {found['nodes']} node(s), "
            whose = f"the pool {found['pool']!r} of {found['hosts']} host(s)" if found["pool"] else f"{found['hosts']} host(s)"
            seen += f"{found['cpus']:g} CPUs; the actors of {whose} reserve "
            rows.append(("ray cluster " + found["address"], seen + f"{found['actors_need_cpus']:g}"))
        else:
            rows.append(("ray cluster " + found["address"], "UNREACHABLE (see the error below)"))
    rows += [("warning", warning) for warning in report["warnings"]]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _bytes(count: int) -> str:
    return f"{count / 2**30:.1f} GiB ({count} bytes)"
