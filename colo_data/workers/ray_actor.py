"""`ChunkActor`: the Ray actor that computes shares of a host pipeline's chunks, as a worker
process does, and how a pool of them is placed on the cluster (`spawn`). An actor holds the
jobs (a pipeline, a host) of the feeds it serves, set up from the pickled pipeline that
comes with every share, so one restarted by Ray, or one that let a job go, sets it up again."""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from typing import Any

import cloudpickle
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colo_data.errors import RayClusterError, to_wire
from colo_data.host import slices
from colo_data.host.chunk_work import ChunkWork, Resume, Share
from colo_data.workers.processes import READY
from colo_data.workers.ray_options import RayWorkers

FeedKey = tuple[str, int]  # (the pool that opened the feed, its number there): unique on the cluster
IDLE_S = 60.0  # a job no share asked for in this long is let go (its host left, or a shared pool's host moved on)


class ChunkActor:
    """One Ray actor: the jobs of the last `jobs` feeds it served (1 for a host's own
    actors; a pool shared by hosts keeps one a host) and used in the last `IDLE_S` seconds,
    each set up from the pickled pipeline it is sent (at `set_up`, or again with a share
    after a restart or once let go): a job holds its pipeline's readers and buffers, so a
    pooled actor's memory follows the hosts it serves now."""

    def __init__(self, jobs: int) -> None:
        self._limit = jobs
        self._jobs: OrderedDict[FeedKey, tuple[ChunkWork, float]] = OrderedDict()  # oldest use first

    def set_up(self, key: FeedKey, payload: list[ray.ObjectRef], host: int, hosts: int, position: int) -> Any:
        """Set the job up and warm it at `position` (`ChunkWork.warmed`): READY, or
        the error as text (a module of the pipeline that this actor cannot import, say)."""
        try:
            self._keep(key, ChunkWork(cloudpickle.loads(ray.get(payload[0])), host, hosts).warmed(position))
            return READY
        except BaseException as e:
            self._jobs.pop(key, None)
            return to_wire(e)

    def compute(
        self,
        key: FeedKey,
        payload: list[ray.ObjectRef],
        host: int,
        hosts: int,
        position: int | Resume,
        count: int,
        share: Share,
    ) -> Any:
        """Share `share` of the chunk of `count` global batches at `position`, with its stage
        times and data-quality counts, or the error as text."""
        try:
            work = self._jobs[key][0] if key in self._jobs else None
            if work is None:  # restarted, let go, or its set-up did not run
                work = ChunkWork(cloudpickle.loads(ray.get(payload[0])), host, hosts)
            self._keep(key, work)
            return slices.compute(work, position, count, Share(*share))
        except BaseException as e:
            stop = e if isinstance(e, SystemExit) else e.__context__
            if isinstance(stop, SystemExit):
                # Ray stops an actor (its pool's keeper gone, `ray.kill`) by raising SystemExit
                # wherever it runs, a transform included (where the transform's guard makes it a
                # TransformError): the SystemExit itself goes on, so that the actor ends, and the
                # host computes the share itself (a transform that calls sys.exit fails there, named)
                raise stop from None
            return to_wire(e)

    def versions(self) -> tuple[str, str]:
        """This actor's Ray and Python versions."""
        return ray.__version__, sys.version.split()[0]

    def _keep(self, key: FeedKey, work: ChunkWork) -> None:
        """`work` as the job of feed `key`, used now; the oldest beyond the limit, and those
        idle for `IDLE_S`, let go."""
        now = time.monotonic()
        self._jobs[key] = (work, now)
        self._jobs.move_to_end(key)
        while len(self._jobs) > self._limit or now - next(iter(self._jobs.values()))[1] > IDLE_S:
            self._jobs.popitem(last=False)


_Actor = ray.remote(ChunkActor)


def reserved(options: RayWorkers) -> PlacementGroup:
    """A placement group of one bundle per actor of `options`, with its strategy, once the
    cluster has reserved it.

    Raises:
        RayClusterError: the cluster could not reserve it within `connect_timeout` seconds.
    """
    bundle = {"CPU": options.num_cpus, **options.resources}
    group = placement_group([dict(bundle) for _ in range(options.actors)], strategy=options.placement)
    done, _ = ray.wait([group.ready()], timeout=options.connect_timeout)
    if not done:
        remove_placement_group(group)
        free = ray.available_resources()
        raise RayClusterError(
            f"RayWorkers(placement={options.placement!r}): the cluster did not reserve {options.actors} bundle(s) of "
            f"{bundle} in {options.connect_timeout:g} s (it has {free.get('CPU', 0):g} CPUs free, on "
            f"{sum(1 for n in ray.nodes() if n.get('Alive'))} node(s)): ask for fewer or smaller actors, another "
            "strategy, or a larger cluster"
        )
    return group


def spawn(options: RayWorkers, group: PlacementGroup | None, jobs: int) -> list[Any]:
    """The `options.actors` actors, each keeping `jobs` jobs, in `group`'s bundles or
    spread over the nodes; restarted by Ray where one dies (a node gone)."""
    settings: dict[str, Any] = {"num_cpus": options.num_cpus, "max_restarts": -1, "max_task_retries": 0}
    if options.resources:
        settings["resources"] = dict(options.resources)
    if options.runtime_env:
        settings["runtime_env"] = dict(options.runtime_env)
    actors = []
    for i in range(options.actors):
        where = "SPREAD" if group is None else PlacementGroupSchedulingStrategy(group, i)
        actors.append(_Actor.options(**settings, scheduling_strategy=where).remote(jobs))
    return actors
