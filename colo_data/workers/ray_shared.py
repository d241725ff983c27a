"""A pool of Ray actors shared by host pipelines (`cd.RayWorkers(pool=NAME)`): those of any
job on the cluster that give the same name use one set of actors, not a set each. Its
keeper, a detached actor named NAME, owns the actors: the first host to come starts it (and
it the actors), every host joins and leaves, and once no host is left the keeper stops the
actors and itself. It gives each host its share of the actors (`PoolKeeper.share`), so that
hosts do not queue at the same actors and none takes more than its part. A host whose
process dies without leaving is dropped as soon as Ray marks its job dead, so the pool
never outlives the last job that uses it; a keeper that dies (its process, its node) takes
its actors with it, and the hosts join the pool again (`Membership`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import ray
import ray._private.state
import ray.exceptions
from ray.util.placement_group import PlacementGroup, remove_placement_group

from colo_data.errors import RayClusterError
from colo_data.workers.ray_actor import reserved, spawn
from colo_data.workers.ray_options import RayWorkers

_LOG = logging.getLogger(__name__)
NAMESPACE = "colo-data"  # Ray's namespace of the pools' keepers
JOBS_PER_ACTOR = 64  # the hosts' jobs a pooled actor keeps set up at once (more are set up again in turn)
WATCH_S = 1.0  # how often the keeper looks for hosts whose job died
ALONE_S = 60.0  # a keeper that no host joined stops after this long
SHARE_S = 1.0  # how often a host asks the keeper for its share of the actors
JOIN_S = 120.0  # a host waits this long for the pool's keeper: a Ray worker process to start, on a busy cluster


class PoolKeeper:
    """The detached actor that owns a shared pool's actors; a threaded actor, so that hosts
    join and leave while it watches for dead jobs."""

    def __init__(self, options: RayWorkers) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, tuple[str, int]] = {}  # a host's pool -> its Ray job, and when it joined (0, 1, ...)
        self._joins = 0  # hosts that joined so far
        self._stopping = False
        self._group: PlacementGroup | None = None
        self._actors: list[Any] = []
        self._failed: str | None = None  # why the pool could not start (its placement group not reserved)
        try:
            self._group = reserved(options) if options.placement else None
            self._actors = spawn(options, self._group, JOBS_PER_ACTOR)
        except RayClusterError as e:
            self._failed = str(e)
        self._started = time.monotonic()
        threading.Thread(target=self._watch, name="colo-data-pool-keeper", daemon=True).start()

    def join(self, member: str, job: str) -> tuple[list[Any], tuple[int, int]] | str | None:
        """The pool's actors, and the share of them (`share`) of host pool `member` of Ray
        job `job`. None if the keeper is stopping (the host starts the next one), or why the
        pool could not start."""
        with self._lock:
            if self._stopping or self._failed:
                return self._failed
            self._members[member] = (job, self._joins)
            self._joins += 1
        return self._actors, self.share(member)

    def share(self, member: str) -> tuple[int, int]:
        """The actors host pool `member` should use now, as (first, count) of the pool's
        actors in a ring: the pool split evenly among the hosts in it, in the order they
        joined (with more hosts than actors, each actor serves the same number of hosts, give
        or take one). Hosts ask again every `SHARE_S` seconds, so that shares follow the
        hosts that come and go. Hosts that split one actor among them take turns at it; a
        host that used more actors than the rest would take more turns."""
        with self._lock:
            order = sorted(self._members, key=lambda m: self._members[m][1])
            rank, hosts, actors = order.index(member) if member in order else 0, max(1, len(order)), len(self._actors)
        first = rank * actors // hosts
        return first, max(1, (rank + 1) * actors // hosts - first)

    def leave(self, member: str) -> None:
        """`member` is done with the pool (the keeper stops it within `WATCH_S` once none is left)."""
        with self._lock:
            self._members.pop(member, None)

    def members(self) -> int:
        """How many host pools use the pool now."""
        with self._lock:
            return len(self._members)

    def _watch(self) -> None:
        """Drop the hosts whose Ray job died; stop the pool once no host uses it (or none came)."""
        while True:
            time.sleep(WATCH_S)
            try:  # Ray's job table (its public state API needs the dashboard, which a cluster may not run)
                dead = {job["JobID"] for job in ray._private.state.jobs() if job["IsDead"]}
            except Exception as e:  # the job table unreadable for once: look again
                _LOG.warning("colo-data pool keeper: cannot read Ray's jobs (%s)", e)
                continue
            with self._lock:
                for member, (job, _) in list(self._members.items()):
                    if job in dead:
                        del self._members[member]
                alone = time.monotonic() - self._started > ALONE_S
                self._stopping = not self._members and (self._joins > 0 or bool(self._failed) or alone)
            if self._stopping:
                break
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self._group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
        ray.kill(ray.get_runtime_context().current_actor)  # which frees its name for the next


_Keeper = ray.remote(PoolKeeper)


def join(options: RayWorkers, member: str) -> tuple[Any, list[Any], tuple[int, int]]:
    """The keeper of the pool `options.pool` (started now if there is none), its actors and
    the share of them of `member` (`PoolKeeper.share`), joined as `member`.

    Raises:
        RayClusterError: the pool could not start (its placement group not reserved), or
            no keeper answered within `JOIN_S` seconds.
    """
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + JOIN_S
    why = "it kept stopping as this host joined"
    while time.monotonic() < deadline:
        keeper = _Keeper.options(
            name=options.pool, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=4
        ).remote(options)
        try:
            joined = ray.get(keeper.join.remote(member, job), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError as e:  # it stopped as this host came, or could not start
            joined, why = None, f"its keeper died: {e}"
        except ray.exceptions.GetTimeoutError:
            joined, why = None, f"its keeper did not answer (is the cluster short of resources for {options.describe()}?)"
        if isinstance(joined, str):
            raise RayClusterError(joined)
        if joined is not None:
            return keeper, *joined
        time.sleep(0.1)
    raise RayClusterError(
        f"RayWorkers(pool={options.pool!r}): could not join the pool in {JOIN_S:g} s: {why}; `ray status` "
        "shows the cluster's resources"
    )


class Membership:
    """A host pool's place in a shared pool: the keeper, its actors and this host's share of
    them (asked again every `SHARE_S` seconds). A keeper that dies takes its actors with it
    (Ray's owner rule): the host then joins the pool again on a thread of its own (the first
    host back starts a new keeper and actors), computing its chunks itself meanwhile."""

    def __init__(self, options: RayWorkers, member: str) -> None:
        self._options, self._member = options, member
        self.keeper, self.actors, self.share = join(options, member)
        self.joins = 1  # how many times this host joined (a new keeper's actors: its feeds are set up again)
        self._asking: ray.ObjectRef | None = None  # the keeper asked for this host's share
        self._asked_at = time.monotonic()
        self._lock = threading.Lock()  # the hand-over of a join again, and `leave`
        self._rejoining: threading.Thread | None = None
        self._rejoined: tuple[Any, list[Any], tuple[int, int]] | None = None  # a join again, done, not yet taken on
        self._left = False

    def refresh(self) -> None:
        """On the host's thread: take on a join again that is done, or this host's share as
        the keeper last said it, and ask the keeper again when it is time; a keeper found
        dead starts the join again."""
        with self._lock:
            rejoined, self._rejoined = self._rejoined, None
        if rejoined is not None:
            self.keeper, self.actors, self.share = rejoined
            self.joins += 1
            self._asking, self._asked_at = None, time.monotonic()
            _LOG.warning("colo-data host pool %s: joined the Ray pool %r again (a new keeper)", self._member, self._options.pool)
        if self._rejoining is not None and self._rejoining.is_alive():
            return
        if self._asking is None:
            if time.monotonic() - self._asked_at >= SHARE_S:
                with contextlib.suppress(ray.exceptions.RayError, ConnectionError):
                    self._asking = self.keeper.share.remote(self._member)
            return
        try:
            done, _ = ray.wait([self._asking], timeout=0)
            if done:
                self.share, self._asking, self._asked_at = ray.get(done[0]), None, time.monotonic()
        except ray.exceptions.RayActorError as e:  # the keeper died, and its actors with it
            self._asking, self._asked_at = None, time.monotonic()
            _LOG.warning(
                "colo-data host pool %s: the keeper of the Ray pool %r died (%s): this host computes its chunks itself "
                "while it joins the pool again", self._member, self._options.pool, type(e).__name__,
            )
            self._rejoining = threading.Thread(target=self._join_again, name="colo-data-pool-join", daemon=True)
            self._rejoining.start()
        except (ray.exceptions.RayError, ConnectionError):  # the keeper did not answer this time (or the cluster is lost)
            self._asking, self._asked_at = None, time.monotonic()

    def leave(self) -> None:
        """Leave the pool (its keeper stops it once no host is in it); a join again under way
        leaves as soon as it is done."""
        with self._lock:
            self._left = True
            rejoined, self._rejoined = self._rejoined, None
        for keeper in [self.keeper] + ([rejoined[0]] if rejoined else []):
            with contextlib.suppress(Exception):  # the keeper is gone already: so is the pool
                ray.get(keeper.leave.remote(self._member), timeout=10)

    def _join_again(self) -> None:
        """Join the pool again (a thread's work): handed over to `refresh`, or left at once if
        the host left meanwhile."""
        try:
            joined = join(self._options, self._member)
        except Exception as e:  # the pool could not start again, or Ray went as the host closed: try at the next look
            _LOG.warning("colo-data host pool %s: could not join the Ray pool %r again: %s", self._member, self._options.pool, e)
            return
        with self._lock:
            if not self._left:
                self._rejoined = joined
                return
        with contextlib.suppress(Exception):
            ray.get(joined[0].leave.remote(self._member), timeout=10)
