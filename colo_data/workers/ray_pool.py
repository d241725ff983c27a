"""`RayPool`: a host pipeline's chunk work computed by Ray actors (`cd.RayWorkers`), as a
`ChunkPool`: each actor computes its share of every chunk (the records of its own row
groups, as a worker process does), the shares come back through Ray's object store, and
the host puts them together in stream order, so the batches are those of local workers.
Actors cost the cluster's CPUs, not the host's. A share whose actor (or node) died is
computed again here, and the actor, restarted by Ray, sets its job up again from the
pipeline it is sent with every share: no record is lost or repeated. The actors are the
host's own, or those of a pool shared by hosts (`ray_shared`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import sys
import time
import uuid
from collections import deque
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import cloudpickle
import grpc  # type: ignore[import-untyped]  # Ray's own dependency, without type hints
import ray
import ray.exceptions
from ray._private.grpc_utils import init_grpc_channel
from ray.util.placement_group import PlacementGroup, remove_placement_group

from colo_data.errors import RayClusterError, TransformError, Wire, from_wire
from colo_data.host import slices
from colo_data.host.chunk import HostChunk, merge_shares
from colo_data.host.chunk_work import ChunkWork, Resume, Share
from colo_data.runtime import process
from colo_data.runtime.budget import cpu_budget
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.telemetry.counters import TRANSFER, StageTimes
from colo_data.workers import ray_shared
from colo_data.workers.processes import READY
from colo_data.workers.ray_actor import FeedKey, reserved, spawn
from colo_data.workers.ray_options import RayWorkers

_LOG = logging.getLogger(__name__)
_SERVER_FAILED = "Initialization failure from server"  # Ray Client: the head did not start this client's server
# on the head: its Ray Client server then starts client server processes reliably (docs/ray.md, Faults)
_FORK_FIX = "GRPC_ENABLE_FORK_SUPPORT=false in the head's environment"
_AGAIN_S = 1.0  # between connection attempts after `_SERVER_FAILED`
# what a share meets when its actor or its node dies, or its result is lost with them
_GONE = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
)
# what Ray Client (a "ray://" address) raises once the cluster is gone for good, after
# retrying for its reconnect grace period (RAY_CLIENT_RECONNECT_GRACE_PERIOD, 30 s)
_LOST = (ConnectionError,)
_RAY = process.connection("ray")  # the last pool open on a connection a pool made disconnects it


def _reachable(address: str, timeout: float) -> None:
    """Raise RayClusterError unless the Ray head at `address` ("HOST:PORT", its GCS, or
    "ray://HOST:PORT", its Ray Client server) accepts a TCP connection and answers gRPC's
    handshake within `timeout` seconds in all. Ray itself retries an unreachable cluster for
    minutes, and waits on a head that accepts connections but does not answer (stopped,
    hung, or another program on its port) for minutes too (30 s through Ray Client), whatever
    the timeout."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    host, port = parts.hostname, parts.port
    if not host or not port:
        return  # not host:port: Ray reads it (e.g. a cluster's file of addresses)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RayClusterError(
                    f"RayWorkers(address={address!r}): cannot reach the Ray cluster ({e.strerror or e}) in {timeout:g} s: "
                    "check that its head node runs and that this machine can reach that port "
                    "(`ray status` on the head; `colo-data doctor` here)"
                ) from e
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    _answers(address, parts.netloc.rpartition("@")[2], deadline, timeout)


def _answers(address: str, target: str, deadline: float, timeout: float) -> None:
    """Raise RayClusterError unless the gRPC server at `target` ("HOST:PORT") completes its
    handshake by `deadline` (a channel as Ray makes it: with TLS and a token where Ray's
    settings say so)."""
    channel = init_grpc_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=max(0.0, deadline - time.monotonic()))
    except grpc.FutureTimeoutError as e:
        raise RayClusterError(
            f"RayWorkers(address={address!r}): the port accepts connections but does not answer as a Ray head "
            f"(no gRPC handshake in {timeout:g} s): the head may be stopped or hung, or another program listens there. "
            "Check it (`ray status` on the head; `colo-data doctor` here), or give a larger connect_timeout if it is "
            "only slow to answer"
        ) from e
    finally:
        channel.close()


def connect(address: str, timeout: float) -> bool:
    """Connect this process to the Ray cluster at `address` (a Ray already initialised is
    used as it is); whether this call connected it. A Ray Client head that could not start
    this client's server process (`_SERVER_FAILED`: a head without `_FORK_FIX` does so at
    random while other clients keep it busy) is asked again until `timeout`; Ray Client
    reports each such failure only after about 40 s. A failed attempt is undone
    (`ray.shutdown()`): Ray Client leaves its client mode on after one, and this process's
    next `ray.init` would then fail with a bare AssertionError.

    Raises:
        RayClusterError: the cluster cannot be reached in `timeout` seconds, or runs another
            Ray or Python version than this process (named).
    """
    if ray.is_initialized():
        return False
    deadline = time.monotonic() + timeout
    _reachable(address, timeout)
    while True:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
            return True
        except Exception as e:
            ray.shutdown()
            if _SERVER_FAILED not in str(e) or time.monotonic() >= deadline:
                raise _not_connected(address, e) from e
            _LOG.warning(
                "colo-data: the Ray Client head at %s could not start this client's server process (set %s); asking again",
                address, _FORK_FIX,
            )  # fmt: skip
            time.sleep(_AGAIN_S)


def _not_connected(address: str, error: Exception) -> RayClusterError:
    """The RayClusterError for `ray.init`'s `error`: a version mismatch, with both versions,
    a Ray Client head that did not start this client's server process, with its fix, or what
    Ray said."""
    text = str(error).strip()
    if _SERVER_FAILED in text:
        return RayClusterError(
            f"RayWorkers(address={address!r}): the Ray Client head could not start this client's server process: "
            f"{text}. Set {_FORK_FIX} (its Ray Client server forks that process while its gRPC threads run), or "
            "give a connect_timeout that leaves room to ask again (Ray Client reports each such failure after about 40 s)"
        )
    if "version mismatch" in text.lower():
        return RayClusterError(
            f"RayWorkers(address={address!r}): the cluster runs another Ray or Python version than this process "
            f"(Ray {ray.__version__}, Python {sys.version.split()[0]} here): {text}. Install the cluster's "
            "versions here (or run the cluster with these)"
        )
    return RayClusterError(
        f"RayWorkers(address={address!r}): cannot connect to the Ray cluster: {type(error).__name__}: {text}. "
        'Start one (`ray start --head`), or give its address ("HOST:6379" or "ray://HOST:10001")'
    )


class RayPool:
    """The actors of `options` (`cd.RayWorkers`) that compute one host pipeline's chunks;
    owned by `owner`, which kills them (and disconnects Ray, if this pool connected it)
    when it closes."""

    remote = True  # the actors use the cluster's CPUs: asked for from the start

    def __init__(self, options: RayWorkers, owner: Lifecycle) -> None:
        self.budget = cpu_budget().cpus  # the host's (its own thread's work is the host's)
        # counted when a pool made the connection (one the user made is the user's to end)
        self._user = _RAY.acquire(lambda: connect(options.address, options.connect_timeout))
        self._id = uuid.uuid4().hex  # names this pool's feeds on the cluster (and it in a shared pool)
        self._keys = itertools.count()
        self._closed = False
        self.lost = False  # a feed found the cluster gone: nothing to kill or remove there
        self._own: list[Any] = []  # the host's own actors
        self._group: PlacementGroup | None = None
        self._member: ray_shared.Membership | None = None  # in a shared pool (`options.pool`), whose keeper owns the actors
        owner.add(options.describe(), self.close)  # from here, whatever fails below
        try:
            if options.pool:
                self._member = ray_shared.Membership(options, self._id)
            else:
                self._group = reserved(options) if options.placement else None
                self._own = spawn(options, self._group, jobs=1)
        except BaseException:
            self.close()
            raise

    @property
    def actors(self) -> list[Any]:
        """The actors: the host's own, or the shared pool's (new ones once its keeper died
        and the host joined it again: `joins`)."""
        return self._own if self._member is None else self._member.actors

    @property
    def joins(self) -> int:
        """How many times the host joined its shared pool (1 for its own actors)."""
        return 1 if self._member is None else self._member.joins

    @property
    def count(self) -> int:
        """The actors this host may use now: all its own, or its share of a shared pool
        (which falls as hosts join it and rises as they leave)."""
        return len(self._own) if self._member is None else self._member.share[1]

    def chosen(self, workers: int) -> list[int]:
        """Which of `actors` the first `workers` of this host are: its own first ones, or
        those of its share of a shared pool (asked of the keeper again every
        `ray_shared.SHARE_S` seconds, without waiting for the answer)."""
        if self._member is None:
            return list(range(workers))
        if not self.lost:
            self._member.refresh()
        first = self._member.share[0]
        return [(first + i) % len(self._member.actors) for i in range(workers)]

    def cpus_used(self) -> None:
        """The actors' CPUs are the cluster's, not the host's: the policy counts none of the host's for them."""
        return None

    def feed(self, payload: bytes, host: int, hosts: int, position: int) -> RayFeed:
        """A feed of host `host` of `hosts` of the pickled pipeline `payload`, which the
        actors set up (and warm at `position`) in the background."""
        return RayFeed(self, (self._id, next(self._keys)), payload, host, hosts, position)

    def close(self, timeout: float = 0.0) -> None:
        """Kill the actors (at once: `timeout` is not needed), or leave a shared pool (its
        keeper stops it once no host uses it); disconnect Ray if a pool connected it and no
        other pool of this process still uses it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._member is not None and not self.lost:
            self._member.leave()
        for actor in [] if self.lost else self._own:
            try:
                ray.kill(actor)
            except Exception:  # the cluster is gone already: so are its actors
                pass
        if self._group is not None and not self.lost:
            with contextlib.suppress(Exception):  # the cluster is gone already: so is the group
                remove_placement_group(self._group)
        # also a Ray Client connection whose cluster was lost (is_initialized() says False) is shut down
        _RAY.release(self._user, ray.shutdown)


class _Asked(NamedTuple):
    """One chunk asked for: where, how many global batches, the actors its shares were
    asked of (of the pool's `actors`), and their results (None: not asked, the cluster
    being lost: computed here)."""

    position: int | Resume
    batches: int
    actors: list[int]
    shares: list[ray.ObjectRef | None]


class RayFeed:
    """One feed's chunks asked of a `RayPool`'s actors, handed back whole in the order
    asked for. Once the cluster is lost (Ray Client's connection gone for good), every
    chunk is computed here, with a warning: the feed goes on, at the host's own speed."""

    def __init__(self, pool: RayPool, key: FeedKey, payload: bytes, host: int, hosts: int, position: int) -> None:
        self._pool, self._key, self._host, self._hosts = pool, key, host, hosts
        self._payload = payload
        self._ready = [False] * len(pool.actors)
        self._asked: deque[_Asked] = deque()
        self._here: ChunkWork | None = None  # computes the shares of actors that died, and all once the cluster is lost
        self._gone: set[int] = set()  # actors whose last share failed (warned about once, until one comes)
        self._lost = False  # the cluster is gone: nothing is asked of it any more
        self._position = position
        self._joins = pool.joins  # the actors' generation whose set-ups are below
        # the actors asked to set the feed up: this host's (all its own, or its share of a shared pool's,
        # whose other actors would each hold every host's feed), and others once its share moves to them
        self._set_up: dict[int, ray.ObjectRef] = {}
        try:
            self._boxed = [ray.put(payload)]  # in a list: sent to the actors as a reference, fetched only to set up
            for i in pool.chosen(pool.count):
                self._start_set_up(i)
        except _LOST as e:
            self._lose(e)

    def _follow(self) -> None:
        """Once the host joined its shared pool again (its keeper died), the new actors have
        set nothing up, and none of them failed yet."""
        if self._joins != self._pool.joins:
            self._joins = self._pool.joins
            self._ready, self._set_up, self._gone = [False] * len(self._pool.actors), {}, set()

    def _start_set_up(self, actor: int) -> None:
        """Ask actor `actor` to set the feed up (and warm it where it starts)."""
        job = (self._key, self._boxed, self._host, self._hosts, self._position)
        self._set_up[actor] = self._pool.actors[actor].set_up.remote(*job)

    def ready(self, workers: int) -> int:
        """How many of the first `workers` actors of this host (`RayPool.chosen`), in order,
        have set the job up (those not asked to yet are asked now). An actor that could not
        raises its error here; one that died counts as ready (restarted, it sets the job up
        with its first share), and so do all once the cluster is lost."""
        chosen = self._pool.chosen(workers)
        self._follow()
        first_not = None  # the first of them not ready
        for n, i in enumerate(chosen):
            if not (self._ready[i] or self._lost or self._set_up_done(i)) and first_not is None:
                first_not = n
        return workers if first_not is None else first_not

    def _set_up_done(self, actor: int) -> bool:
        """Whether actor `actor` has set the job up, asking it to where it was not asked."""
        try:
            if actor not in self._set_up:
                self._start_set_up(actor)
                return False
            done, _ = ray.wait([self._set_up[actor]], timeout=0)
            if not done:
                return False
            reply = ray.get(done[0])
        except _GONE:
            reply = READY
        except _LOST as e:
            self._lose(e)
            return True
        if reply != READY:
            raise self._raised(reply, actor)
        self._ready[actor] = True
        return True

    def ask(self, position: int | Resume, count: int, workers: int) -> None:
        """Ask for the chunk of `count` global batches at `position`, shared out to the
        first `workers` actors of this host (`RayPool.chosen`)."""
        chosen = self._pool.chosen(workers)
        self._follow()
        shares: list[ray.ObjectRef | None] = [None] * workers
        if not self._lost:
            try:
                for i, actor in enumerate(chosen):
                    job = (self._key, self._boxed, self._host, self._hosts, position, count, (i, workers))
                    shares[i] = self._pool.actors[actor].compute.remote(*job)
            except _LOST as e:
                self._lose(e)
        self._asked.append(_Asked(position, count, chosen, shares))

    def take(self) -> HostChunk:
        """The chunk asked for first of those not taken yet (waiting for it), put together
        from the actors' shares; a share whose actor died is computed here, and every share
        once the cluster is lost. Its stages count the time fetching the shares once
        computed (`transfer`), their records and bytes."""
        asked = self._asked.popleft()
        if not self._lost:
            try:  # computed (or failed) where they ran
                ray.wait(asked.shares, num_returns=len(asked.shares), fetch_local=False)
            except _LOST as e:
                self._lose(e)
        shares = []
        for i, (actor, ref) in enumerate(zip(asked.actors, asked.shares, strict=True)):
            if self._lost or ref is None:
                shares.append(self._computed_here(asked, Share(i, len(asked.shares))))
                continue
            try:
                fetch = time.perf_counter()
                reply = ray.get(ref)
                if isinstance(reply, HostChunk):  # (an empty share has no columns)
                    nbytes = sum(column.nbytes for column in reply.columns.values())
                    stages = StageTimes(reply.stages)
                    stages.add(TRANSFER, time.perf_counter() - fetch, reply.rows if reply.columns else 0, nbytes)
                    reply.stages = stages.values
                self._gone.discard(actor)
            except _GONE as e:
                if actor not in self._gone:
                    self._gone.add(actor)
                    said = "Ray actor %d of host %d died (%s): its shares are computed here until it is back"
                    _LOG.warning(said, actor, self._host, type(e).__name__)
                reply = self._computed_here(asked, Share(i, len(asked.shares)))
            except _LOST as e:
                self._lose(e)
                reply = self._computed_here(asked, Share(i, len(asked.shares)))
            if not isinstance(reply, HostChunk):
                raise self._raised(reply, actor)
            shares.append(reply)
        return merge_shares(shares)

    def _lose(self, error: BaseException) -> None:
        """The cluster is gone: say so once; from here every chunk is computed here."""
        if not self._lost:
            self._lost = self._pool.lost = True
            _LOG.warning(
                "Ray workers of host %d: the Ray cluster is lost (%s: %s): this host computes every chunk itself from "
                "here, at its own speed (the batches are the same); restart the job to use a cluster again",
                self._host, type(error).__name__, error,
            )

    def _raised(self, wire: Wire, actor: int) -> Exception:
        """The error that actor `actor` sent, as the same colo-data type (others: a
        TransformError); one of an import says how to make the module reach the actors."""
        if wire["type"] == "ModuleNotFoundError":
            wire = {**wire, "error": f"{wire['error']}: the Ray actors cannot import a module of the pipeline; install it on "
                    "the cluster or ship it: cd.RayWorkers(runtime_env={'py_modules': [module]})"}
        return from_wire(wire, f"Ray actor {actor} of host {self._host}", TransformError)

    def _computed_here(self, asked: _Asked, share: Share) -> HostChunk:
        """`share` of the chunk `asked`, computed in this process."""
        if self._here is None:
            self._here = ChunkWork(cloudpickle.loads(self._payload), self._host, self._hosts)
        chunk = slices.compute(self._here, asked.position, asked.batches, share, read_ahead=False)
        chunk.cost = None  # this thread's time, not an actor's: the worker policy must not count it as one's
        return chunk
