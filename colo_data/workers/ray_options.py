"""`RayWorkers`: a host pipeline's chunk work computed by actors on a Ray cluster, for when
the host's own CPUs are the limit. The options only (validated once, cheap to import), here
beside the host's resources that read them from a `--workers` spec; the pool that uses
them, `colo_data.workers.ray_pool.RayPool`, imports Ray when a backend starts one."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from colo_data.errors import ConfigError
from colo_data.setting_checks import as_int

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement group strategies
SPEC_PREFIX = "ray:"  # `--workers 'ray:{"actors": 4}'`: RayWorkers on a command line or in a sidecar's config


@dataclass(frozen=True)
class RayWorkers:
    """Each host pipeline hands its chunks to `actors` Ray actors, which compute them as
    worker processes do (each its share of every chunk) and send them back through Ray's
    object store; the host delivers them in the same global order, so batches are the same
    as with local workers. Give it as `workers=` of `cd.InProcess`, `cd.Sidecar` or
    `cd.Colocated`, or to `colo-data sidecar serve --workers`.

    Args:
        address: the cluster: "auto" (`RAY_ADDRESS`, else the cluster this machine runs),
            "HOST:PORT" (its GCS), or "ray://HOST:PORT" (Ray Client). A Ray already
            initialised in the process is used as it is.
        actors: actors per host pipeline.
        num_cpus: CPUs each actor reserves on the cluster.
        resources: custom Ray resources each actor reserves, e.g. {"preprocess": 1}, to
            place the actors on the nodes that have them.
        placement: where a host pipeline's actors go: None spreads them over the cluster's
            nodes; "PACK", "SPREAD", "STRICT_PACK" or "STRICT_SPREAD" reserves a placement
            group per host pipeline (one bundle of `num_cpus` and `resources` per actor),
            with Ray's strategy of that name: reserved together, or not at all.
        pool: a name, for `actors` actors shared by every host pipeline (of any job on the
            cluster) that gives it, instead of `actors` for each; the first host to come
            starts them (with its options), and they stop once no host uses them
            (`ray_shared`). A placement group is then reserved for the pool.
        runtime_env: the actors' Ray runtime environment, e.g. {"py_modules": [my_pkg]} or
            {"env_vars": {"PYTHONPATH": ...}}, so that they can import what the pipeline's
            functions use (a script's own functions travel by value without it).
        connect_timeout: seconds to reach the cluster before a `RayClusterError`.
    """

    address: str = "auto"
    actors: int = 2
    num_cpus: float = 1.0
    resources: Mapping[str, float] = field(default_factory=dict)
    placement: str | None = None
    pool: str | None = None
    runtime_env: Mapping[str, Any] = field(default_factory=dict)
    connect_timeout: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ConfigError(f'RayWorkers(address={self.address!r}): give "auto", "HOST:PORT" or "ray://HOST:PORT"')
        actors = as_int(self.actors)
        if actors is None or actors < 1:
            raise ConfigError(f"RayWorkers(actors={self.actors!r}): give an int >= 1 (actors per host pipeline)")
        object.__setattr__(self, "actors", actors)
        for name in ("num_cpus", "connect_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"RayWorkers({name}={value!r}): give a number > 0")
        resources = self.resources
        if not isinstance(resources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for k, v in resources.items()
        ):
            raise ConfigError(f"RayWorkers(resources={resources!r}): give a dict of resource names to amounts > 0")
        object.__setattr__(self, "resources", dict(resources))
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise ConfigError(
                f"RayWorkers(placement={self.placement!r}): give None (actors spread over the nodes) or one of Ray's "
                f"placement group strategies {', '.join(map(repr, PLACEMENTS))} (a group per host pipeline)"
            )
        if self.pool is not None and (not isinstance(self.pool, str) or not self.pool.strip()):
            raise ConfigError(f"RayWorkers(pool={self.pool!r}): give None (each host's own actors) or the shared pool's name")
        if not isinstance(self.runtime_env, Mapping):
            raise ConfigError(f"RayWorkers(runtime_env={self.runtime_env!r}): give a dict (Ray's runtime_env)")
        object.__setattr__(self, "runtime_env", dict(self.runtime_env))

    @classmethod
    def of(cls, workers: object) -> RayWorkers | None:
        """`workers` when they are Ray actors' options, else None (a count, "auto"): for what
        only Ray's own code asks, its pool and `colo-data doctor`'s check of its cluster."""
        return workers if isinstance(workers, cls) else None

    def describe(self) -> str:
        """The options in words, for reports."""
        extra = f", resources {dict(self.resources)}" if self.resources else ""
        extra += f", a {self.placement} placement group {'for the pool' if self.pool else 'per host'}" if self.placement else ""
        extra += f", in the pool {self.pool!r} shared by hosts" if self.pool else ""
        return f"{self.actors} Ray actor(s) of {self.num_cpus:g} CPU at {self.address}{extra}"

    def to_spec(self) -> str:
        """The options as one string (`from_spec` reads it back): a command line's `--workers`."""
        return SPEC_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_spec(cls, spec: str | Mapping[str, Any], where: str) -> RayWorkers:
        """RayWorkers from `to_spec`'s string ("ray" alone: the defaults) or a config's table
        (`workers = { ray = "auto", actors = 4 }`); anything else is a ConfigError naming `where`."""
        if isinstance(spec, Mapping):
            settings = dict(spec)
            if "ray" not in settings:
                raise ConfigError(f"{where} = {spec!r}: a table of Ray workers needs ray = ADDRESS (e.g. \"auto\")")
            settings["address"] = settings.pop("ray")
        else:
            text = spec[len(SPEC_PREFIX) :] if spec.startswith(SPEC_PREFIX) else "" if spec == "ray" else None
            if text is None:
                raise ConfigError(f"{where} = {spec!r}: not Ray workers (give 'ray' or 'ray:{{\"actors\": 4}}')")
            try:
                settings = json.loads(text) if text else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} = {spec!r}: after 'ray:' give a JSON object of RayWorkers' options ({e})") from e
            if not isinstance(settings, dict):
                raise ConfigError(f"{where} = {spec!r}: after 'ray:' give a JSON object of RayWorkers' options")
        unknown = set(settings) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"{where} = {spec!r}: unknown RayWorkers option(s) {sorted(unknown)}")
        return cls(**settings)
