"""Kubernetes manifests for a colo-data deployment, rendered from the YAML templates in
`colo_data/deploy/templates/` (package data) and a config's `[sidecar]` and `[deploy]`
tables: a Pathways JobSet whose TPU hosts run colo-data in the colocated-Python sidecar,
or an Indexed Job of multi-controller JAX pods with a colo-data sidecar next to each
trainer; with `[deploy] ray_nodes`, beside either, a KubeRay RayCluster whose actors
compute the host pipelines' chunks (`cd.RayWorkers`, docs/ray.md).

A template is plain YAML. A string that is exactly `${key}` becomes the key's value, of
any type (a key whose value is None is left out; a list item whose value is a list is
replaced by that list's items, none for an empty list); `${key}` inside a longer string is
replaced by the value's text and `$$` by `$`. The sidecar's CPU limit is chosen so that
its CPU budget gives the expected workers, and the shared-memory volume is sized from one
measured host batch unless `[deploy] shm_size` says otherwise.
"""

from __future__ import annotations

import math
import re
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from colo_data import defaults
from colo_data.config import Config
from colo_data.deploy import versions
from colo_data.errors import ColoDataError, ConfigError
from colo_data.workers.ray_options import RayWorkers
from colo_data.workers.settings import Workers, workers_text

if TYPE_CHECKING:
    pass

TEMPLATES = Path(__file__).resolve().parent / "templates"  # package data
TEMPLATE_FILES = {"pathways": "pathways-jobset.yaml", "multi-controller": "multi-controller.yaml"}
RAY_TEMPLATE = "ray-cluster.yaml"  # rendered beside the target's objects when [deploy] ray_nodes > 0
SOCKET_DIR = "/run/colo"  # the socket's emptyDir mount
# A trainer refuses a socket whose directory others may write, and an emptyDir is 0777: the
# socket lives in a subdirectory that the image's entrypoint creates (0755, the sidecar's).
SOCKET = f"{SOCKET_DIR}/sidecar/sidecar.sock"
WORKERS_ENV = "COLO_DATA_WORKERS"  # `colo-data sidecar serve --workers`
# The shared-memory mount when [sidecar] shm_dir is unset: /dev/shm for colo-data's ring,
# pathwaysutils' default for the Pathways sidecar's transfer directory.
SHM_DIRS = {"pathways": "/tmp/shared-memory", "multi-controller": "/dev/shm"}
DEFAULT_SIDECAR_CPUS = 4
MEMORY_PER_CPU = 2**30  # the sidecar's memory beyond shared memory: per worker and main loop
_MIB = 2**20
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# Pathways pod host names add `-pathways-worker-<slice>-<host>` to the name, within 63.
_NAME_MAX = 40
_TOPOLOGY = re.compile(r"[1-9]\d*(x[1-9]\d*){1,2}")
_QUANTITY = re.compile(r"([1-9]\d*)(Ki|Mi|Gi|Ti|K|M|G|T)?")
_UNITS = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_WHOLE = re.compile(r"\$\{(\w+)\}")
_FLAG = re.compile(r"--[A-Za-z_]\w*(=\S*)?")  # what XLA's flag parsers take: --name or --name=value
_CHIPS_PER_HOST = 4
# The RayCluster of [deploy] ray_nodes: KubeRay names its head's Service `<cluster>-head-svc`,
# where the head's Ray Client server listens on 10001.
RAY_SUFFIX = "-ray"
RAY_CLIENT_PORT = 10001
# KubeRay cuts a head Service name longer than 50 characters (from the front): the name
# the sidecars are given must be the one it makes.
_RAY_SERVICE_MAX = 50
RAY_ACTORS = 2  # actors per host pipeline, RayWorkers' default
RAY_CPUS = 4  # Ray's num-cpus of a worker pod
RAY_MEMORY_PER_CPU = 2 * 2**30  # a worker pod's memory: its actors' processes and Ray's object store (30% of it)
# The head runs no actors (num-cpus 0) but Ray's GCS and, per connected host pipeline, a
# Ray Client server process through which that host's chunks pass.
RAY_HEAD_CPUS = 2
RAY_HEAD_MEMORY = 4 * 2**30
RAY_HEAD_MEMORY_PER_HOST = 512 * _MIB
# The cluster is created with the job: its head may still be starting (pulling the image)
# when a sidecar first connects, so a sidecar waits this long for it (RayWorkers' default: 20 s).
RAY_CONNECT_TIMEOUT = 300.0
RAY_KEYS = ("ray_cpus", "ray_memory", "ray_image", "ray_actors")  # meaningful with ray_nodes only


@dataclass(frozen=True)
class Tpu:
    """A Cloud TPU type: its GKE node label and the Pathways instance type prefix."""

    accelerator: str
    pathways: str


TPUS = {
    "v5e": Tpu("tpu-v5-lite-podslice", "tpuv5e"),
    "v5p": Tpu("tpu-v5p-slice", "tpuv5"),
    "v6e": Tpu("tpu-v6e-slice", "tpuv6e"),
    "tpu7x": Tpu("tpu7x", "tpu7x"),
}


@dataclass(frozen=True)
class Deploy:
    """The `[deploy]` table: what the manifests need beyond the pipeline. `image` is the
    colo-data sidecar image (default: the target's build of `sidecar_image/`, see
    `versions`), `trainer_image`/`command` the trainer's (default: the sidecar image
    running `colo-data bench CONFIG`); `hosts` the trainer pods (multi-controller);
    `tpu_type`/`topology`/`slices` the TPU slices; `gcs_scratch` Pathways' scratch bucket;
    `sidecar_cpus`/`sidecar_memory` the sidecar's limits; `shm_size` the shared-memory
    volume (default: measured); `xla_flags` the compiler's flags ("--a=1 --b" or a list of
    flags): under Pathways the args of the `pathways-proxy` container, which compiles, else
    the trainer's `LIBTPU_INIT_ARGS` (TPU hosts) or `XLA_FLAGS`. `ray_nodes` > 0 adds a
    KubeRay RayCluster of that many Ray worker pods (`ray_cpus` CPUs and `ray_memory`
    each, image `ray_image`, default: the sidecar's) whose `ray_actors` actors per host
    pipeline take the place of `[sidecar] workers`; 0: no cluster."""

    name: str = "colo-data"
    image: str | None = None
    trainer_image: str | None = None
    command: tuple[str, ...] | None = None
    hosts: int | None = None
    tpu_type: str | None = None
    topology: str | None = None
    slices: int = 1
    gcs_scratch: str | None = None
    sidecar_cpus: float | None = None
    sidecar_memory: str | None = None
    shm_size: str | None = None
    xla_flags: str | tuple[str, ...] | None = None
    ray_nodes: int | None = None
    ray_cpus: int | None = None
    ray_memory: str | None = None
    ray_image: str | None = None
    ray_actors: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name) or len(self.name) > _NAME_MAX:
            _bad("name", self.name, f"lower-case letters, digits and '-', starting with a letter, at most {_NAME_MAX} characters")
        for key in ("image", "trainer_image", "ray_image"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
                _bad(key, value, "an image reference such as registry/name:tag")
        if self.command is not None and (
            not isinstance(self.command, tuple) or not self.command or not all(isinstance(a, str) for a in self.command)
        ):
            _bad("command", self.command, 'a non-empty list of strings, e.g. ["python", "train.py"]')
        for key in ("hosts", "slices"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                _bad(key, value, "an int >= 1")
        if self.tpu_type is not None and (not isinstance(self.tpu_type, str) or self.tpu_type not in TPUS):
            _bad("tpu_type", self.tpu_type, ", ".join(TPUS))
        if self.topology is not None and (not isinstance(self.topology, str) or not _TOPOLOGY.fullmatch(self.topology)):
            _bad("topology", self.topology, 'chips along each axis, e.g. "2x2" or "2x2x4"')
        if (self.tpu_type is None) != (self.topology is None):
            raise ConfigError("[deploy] tpu_type and topology: give both or neither")
        if self.gcs_scratch is not None and (not isinstance(self.gcs_scratch, str) or not self.gcs_scratch.startswith("gs://")):
            _bad("gcs_scratch", self.gcs_scratch, 'a Cloud Storage path, e.g. "gs://bucket/pathways"')
        cpus = self.sidecar_cpus
        if cpus is not None and (
            isinstance(cpus, bool) or not isinstance(cpus, int | float) or not math.isfinite(cpus) or cpus < 0.001
        ):
            _bad("sidecar_cpus", cpus, "a number of CPUs >= 0.001, e.g. 4 or 2.5")
        for key in ("sidecar_memory", "shm_size"):
            if getattr(self, key) is not None:
                quantity_bytes(key, getattr(self, key))
        flags = self.xla_flags
        written = list(flags) if isinstance(flags, tuple) else flags  # from_table makes a TOML list a tuple
        allowed = 'flags "--name=value" or "--name" in one string separated by spaces, or a list of them'
        if flags is not None and not (
            isinstance(flags, str) or (isinstance(flags, tuple) and all(isinstance(f, str) for f in flags))
        ):
            _bad("xla_flags", written, allowed)
        example = '"--xla_tpu_enable_latency_hiding_scheduler=true"'
        for flag in self.xla_flag_list:
            if not _FLAG.fullmatch(flag):
                _bad("xla_flags", written, f"{allowed} ({flag!r} is not one), e.g. {example}")
        self._check_ray()

    def _check_ray(self) -> None:
        """The Ray keys: counts >= their minimum, a memory quantity, and none of `RAY_KEYS`
        without `ray_nodes` (a setting that would be silently ignored)."""
        nodes = self.ray_nodes
        if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0):
            _bad("ray_nodes", nodes, "an int >= 0: the Ray worker pods of a RayCluster beside the job (0: no cluster)")
        for key, what in (("ray_cpus", "Ray's num-cpus of each Ray worker pod"), ("ray_actors", "Ray actors per host pipeline")):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                _bad(key, value, f"an int >= 1 ({what})")
        if self.ray_memory is not None:
            quantity_bytes("ray_memory", self.ray_memory)
        longest = _RAY_SERVICE_MAX - len(self.ray_service) + len(self.name)
        if nodes and len(self.name) > longest:
            why = f"KubeRay shortens a head Service name longer than {_RAY_SERVICE_MAX} ({self.ray_service!r})"
            _bad("name", self.name, f"at most {longest} characters with ray_nodes: {why}, and the sidecars must find it")
        given = [key for key in RAY_KEYS if getattr(self, key) is not None]
        if given and nodes is None:
            raise ConfigError(
                f"[deploy] {', '.join(given)} without ray_nodes: set ray_nodes, the Ray worker pods of the RayCluster "
                "that the manifest adds (0: no cluster), or leave these out"
            )

    @property
    def ray_cluster(self) -> str:
        """The RayCluster's name."""
        return self.name + RAY_SUFFIX

    @property
    def ray_service(self) -> str:
        """The Service that KubeRay makes for the RayCluster's head."""
        return f"{self.ray_cluster}-head-svc"

    @property
    def ray_workers(self) -> RayWorkers | None:
        """The sidecars' workers on the RayCluster (through its head's Ray Client port), or
        None without one."""
        if not self.ray_nodes:
            return None
        return RayWorkers(
            address=f"ray://{self.ray_service}:{RAY_CLIENT_PORT}",
            actors=self.ray_actors or RAY_ACTORS,
            connect_timeout=RAY_CONNECT_TIMEOUT,
        )

    @property
    def xla_flag_list(self) -> list[str]:
        """`xla_flags` one flag an item: a string is split at whitespace; none: []."""
        if self.xla_flags is None:
            return []
        return self.xla_flags.split() if isinstance(self.xla_flags, str) else list(self.xla_flags)

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> Deploy:
        """The settings of a `[deploy]` table; unknown keys are an error."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(table) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in [deploy]; allowed: {allowed}")
        values = dict(table)
        for key in ("command", "xla_flags"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        return cls(**values)


def _bad(key: str, value: Any, allowed: str) -> NoReturn:
    raise ConfigError(f"[deploy] {key} = {value!r}: give {allowed}")


def quantity_bytes(key: str, quantity: Any) -> int:
    """Bytes of a Kubernetes memory quantity such as "512Mi", "16Gi" or "1G"."""
    match = _QUANTITY.fullmatch(quantity) if isinstance(quantity, str) else None
    if match is None:
        _bad(key, quantity, 'a memory size such as "512Mi" or "16Gi" (units Ki Mi Gi Ti, K M G T)')
    return int(match.group(1)) * _UNITS[match.group(2)]


def mebibytes(size: int) -> str:
    """`size` bytes rounded up to a whole MiB, as a Kubernetes quantity."""
    return f"{-(-size // _MIB)}Mi"


def cpu_quantity(cpus: float) -> str:
    """A CPU count as a Kubernetes quantity: "4", or millicores ("2500m")."""
    millis = round(cpus * 1000)
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def sidecar_cpus(deploy: Deploy, workers: Workers) -> float:
    """The sidecar's CPU limit: `[deploy] sidecar_cpus`, else enough for `[sidecar] workers`
    plus the main loop, else `DEFAULT_SIDECAR_CPUS` (also for Ray workers, whose CPUs are the
    cluster's). A limit too small for the worker processes that `[sidecar] workers` asks
    for, beside the sidecar's own thread, is an error."""
    if not isinstance(workers, int):
        return deploy.sidecar_cpus if deploy.sidecar_cpus is not None else DEFAULT_SIDECAR_CPUS
    if deploy.sidecar_cpus is None:
        return workers + 1
    if workers > 1 and math.ceil(deploy.sidecar_cpus) < workers + 1:  # 0 or 1: the sidecar's own thread
        raise ConfigError(
            f"[deploy] sidecar_cpus = {deploy.sidecar_cpus!r} leaves CPUs for {max(0, math.ceil(deploy.sidecar_cpus) - 1)} "
            f"worker process(es) beside the sidecar's own thread, but [sidecar] workers = {workers}: "
            f"set sidecar_cpus = {workers + 1} or workers = \"auto\""
        )
    return deploy.sidecar_cpus


def shm_bytes(config: Config, hosts: int, slots: int) -> int:
    """The shared-memory volume's size: twice a ring of `slots` slots of the size a sidecar
    with room uses, because a sidecar lets shared slots take at most half of the room it
    finds."""
    from colo_data.backends.sidecar.ring_plan import roomy_slot_size

    try:
        return 2 * slots * roomy_slot_size(config.build(), hosts)
    except (ColoDataError, OSError) as e:  # OSError: data out of reach from here
        raise ConfigError(f"cannot measure a host batch to size shared memory ({e}); set [deploy] shm_size") from e


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    """The template tree `node` with its placeholders replaced (see the module docstring)."""
    if isinstance(node, dict):
        filled = {key: _fill(value, values) for key, value in node.items()}
        return {key: value for key, value in filled.items() if value is not None}
    if isinstance(node, list):
        filled_items: list[Any] = []
        for item in node:
            whole = _WHOLE.fullmatch(item) if isinstance(item, str) else None
            if whole and isinstance(values[whole.group(1)], list):
                filled_items.extend(values[whole.group(1)])
            else:
                filled_items.append(_fill(item, values))
        return filled_items
    if isinstance(node, str):
        whole = _WHOLE.fullmatch(node)
        if whole:
            return values[whole.group(1)]
        return string.Template(node).substitute({key: str(value) for key, value in values.items()})
    return node


def render(config: Config, target: str, overrides: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Kubernetes objects for `target` ("pathways" or "multi-controller"), from
    `config` with `overrides` taking the place of its `[deploy]` keys; with `ray_nodes`,
    the RayCluster last."""
    if target not in TEMPLATE_FILES:
        raise ConfigError(f"target {target!r}: allowed: {', '.join(TEMPLATE_FILES)}")
    try:
        deploy = Deploy.from_table({**config.deploy, **(overrides or {})})
        values = _pathways(config, deploy) if target == "pathways" else _multi_controller(config, deploy)
    except ConfigError as e:
        raise ConfigError(f"{config.path}: {e}") from None
    objects = _documents(TEMPLATE_FILES[target], values)
    if deploy.ray_nodes:
        objects += _documents(RAY_TEMPLATE, values)
    return objects


def _documents(name: str, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The objects of the template file `name`, filled with `values`."""
    path = TEMPLATES / name
    if not path.is_file():
        raise ConfigError(
            f"no manifest template at {path}: the templates ship inside the colo-data package (colo_data/deploy/templates/, "
            "package data); this installation lacks them, so reinstall colo-data (pip install --force-reinstall colo-data)"
        )
    return [_fill(document, values) for document in yaml.safe_load_all(path.read_text())]


def to_yaml(objects: list[dict[str, Any]], header: str) -> str:
    """The objects as one multi-document YAML (what `kubectl apply -f -` reads), after `header`
    as comment lines."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump_all(objects, sort_keys=False)


def _sidecar_values(config: Config, deploy: Deploy, target: str, hosts: int) -> dict[str, Any]:
    """Placeholders both templates share: images, command, sidecar limits, shared memory;
    with `ray_nodes`, the RayCluster's, whose Ray workers replace `[sidecar] workers`."""
    workers: Workers = deploy.ray_workers or config.sidecar.get("workers", "auto")
    default_image = versions.SIDECAR_COLOCATED_IMAGE if target == "pathways" else versions.SIDECAR_IMAGE
    image = deploy.image or default_image
    ray = _ray_values(deploy, hosts, image) if deploy.ray_nodes else {}  # its checks before measuring a batch
    slots = config.sidecar.get("slots", defaults.SLOTS)
    cpus = sidecar_cpus(deploy, workers)
    shm = quantity_bytes("shm_size", deploy.shm_size) if deploy.shm_size else shm_bytes(config, hosts, slots)
    if deploy.sidecar_memory is None:
        memory = shm + math.ceil(cpus) * MEMORY_PER_CPU
    else:
        memory = quantity_bytes("sidecar_memory", deploy.sidecar_memory)
        if memory <= shm:
            raise ConfigError(
                f"[deploy] sidecar_memory = {deploy.sidecar_memory!r} must exceed the shared memory "
                f"({mebibytes(shm)}): the ring's pages count against the sidecar's memory limit"
            )
    return ray | {
        "name": deploy.name,
        "image": image,
        "trainer_image": deploy.trainer_image or deploy.image or versions.SIDECAR_IMAGE,
        "command": list(deploy.command or ("colo-data", "bench", config.path)),
        "sidecar_cpu": cpu_quantity(cpus),
        "sidecar_memory": deploy.sidecar_memory or mebibytes(memory),
        "shm_dir": config.sidecar.get("shm_dir") or SHM_DIRS[target],
        "shm_size": deploy.shm_size or mebibytes(shm),
        "workers": workers_text(workers),  # a count, "auto", or Ray workers' spec: what --workers reads
        "slots": str(slots),
    }


def _ray_values(deploy: Deploy, hosts: int, image: str) -> dict[str, Any]:
    """The RayCluster's placeholders: its name, image, worker pods and their resources, and
    the head's resources. A cluster without a CPU for every actor of `hosts` host pipelines
    is an error: the actors it cannot place would never start."""
    assert deploy.ray_workers is not None and deploy.ray_nodes  # called with ray_nodes only
    cpus = deploy.ray_cpus or RAY_CPUS
    actors = deploy.ray_workers.actors
    needed = math.ceil(hosts * actors * deploy.ray_workers.num_cpus)
    if deploy.ray_nodes * cpus < needed:
        raise ConfigError(
            f"[deploy] ray_nodes = {deploy.ray_nodes} of ray_cpus = {cpus} give {deploy.ray_nodes * cpus} CPU(s), but "
            f"{hosts} host pipeline(s) x ray_actors = {actors} actor(s) of {deploy.ray_workers.num_cpus:g} CPU need {needed}: "
            f"set ray_nodes = {math.ceil(needed / cpus)}, raise ray_cpus or lower ray_actors"
        )
    return {
        "ray_cluster": deploy.ray_cluster,
        "ray_image": deploy.ray_image or image,  # the sidecar's: a Ray Client needs the cluster's Ray and Python
        "ray_nodes": deploy.ray_nodes,
        "ray_cpus": str(cpus),  # rayStartParams are strings; also the pods' CPU quantity
        "ray_memory": deploy.ray_memory or f"{cpus * RAY_MEMORY_PER_CPU // 2**30}Gi",
        "ray_head_cpu": str(RAY_HEAD_CPUS),
        "ray_head_memory": mebibytes(RAY_HEAD_MEMORY + hosts * RAY_HEAD_MEMORY_PER_HOST),
    }


def _slice_shape(topology: str) -> tuple[int, int]:
    """(TPU hosts, chips per host) of one slice of `topology`: hosts of up to 4 chips."""
    chips = math.prod(int(d) for d in topology.split("x"))
    return max(1, chips // _CHIPS_PER_HOST), min(chips, _CHIPS_PER_HOST)


def _pathways(config: Config, deploy: Deploy) -> dict[str, Any]:
    """The JobSet's placeholders: a TPU slice (required) and Pathways' scratch bucket."""
    for key in ("tpu_type", "gcs_scratch"):
        if getattr(deploy, key) is None:
            raise ConfigError(f"[deploy] {key} is needed for --target pathways")
    assert deploy.tpu_type is not None and deploy.topology is not None  # Deploy gives both or neither
    if deploy.hosts is not None:
        raise ConfigError("[deploy] hosts: under Pathways the hosts are the TPU VMs of tpu_type, topology and slices")
    per_slice, chips = _slice_shape(deploy.topology)
    values = _sidecar_values(config, deploy, "pathways", per_slice * deploy.slices)
    tpu = TPUS[deploy.tpu_type]
    # The colocated sidecars take their workers from the trainer (cd.Colocated(workers=...)),
    # not from their environment: Ray workers go to the trainer, and to the default command.
    ray_env = [{"name": WORKERS_ENV, "value": values["workers"]}] if deploy.ray_nodes else []
    if deploy.ray_nodes and deploy.command is None:
        values["command"] += ["--workers", values["workers"]]
    return values | {
        "ray_workers_env": ray_env,
        "slices": deploy.slices,
        "hosts_per_slice": per_slice,
        "gcs_scratch": deploy.gcs_scratch,
        "instance_type": f"{tpu.pathways}:{deploy.topology}",
        "tpu_accelerator": tpu.accelerator,
        "topology": deploy.topology,
        "chips_per_host": str(chips),
        "server_image": versions.PATHWAYS_SERVER_IMAGE,
        "proxy_image": versions.PATHWAYS_PROXY_IMAGE,
        "xla_flags": deploy.xla_flag_list,  # the proxy's args: it compiles, not the trainer (the JAX client)
    }


def _multi_controller(config: Config, deploy: Deploy) -> dict[str, Any]:
    """The Service's and Job's placeholders: `hosts` pods, or one per TPU host of a slice."""
    if deploy.slices != 1:
        raise ConfigError(
            f"[deploy] slices = {deploy.slices}: multi-controller manifests are for one slice; use --target pathways"
        )
    if deploy.gcs_scratch is not None:
        raise ConfigError("[deploy] gcs_scratch: used by --target pathways only")
    hosts = deploy.hosts or 1
    node_selector = resources = None
    if deploy.tpu_type is not None:
        assert deploy.topology is not None  # Deploy gives tpu_type and topology together
        per_slice, chips = _slice_shape(deploy.topology)
        if deploy.hosts is not None and deploy.hosts != per_slice:
            raise ConfigError(f"[deploy] hosts = {deploy.hosts}, but topology {deploy.topology!r} has {per_slice} TPU host(s)")
        hosts = per_slice
        node_selector = {
            "cloud.google.com/gke-tpu-accelerator": TPUS[deploy.tpu_type].accelerator,
            "cloud.google.com/gke-tpu-topology": deploy.topology,
        }
        resources = {"limits": {"google.com/tpu": str(chips)}}
    values = _sidecar_values(config, deploy, "multi-controller", hosts)
    # Here the trainer compiles: TPU flags go to libtpu, which reads LIBTPU_INIT_ARGS.
    flags_variable = "XLA_FLAGS" if deploy.tpu_type is None else "LIBTPU_INIT_ARGS"
    flags = deploy.xla_flag_list
    return values | {
        "hosts": hosts,
        "xla_flags_env": [{"name": flags_variable, "value": " ".join(flags)}] if flags else [],
        "socket": SOCKET,
        "socket_dir": SOCKET_DIR,
        "node_selector": node_selector,
        "trainer_resources": resources,
    }


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line: VALUE as a TOML value (2, 2.5, ["a", "b"],
    "text"), else as the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: give KEY=VALUE, e.g. --set tpu_type=v6e")
    try:
        return key, tomllib.loads(f"value = {value}")["value"]
    except tomllib.TOMLDecodeError:
        return key, value
