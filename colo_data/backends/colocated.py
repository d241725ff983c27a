"""The Pathways transport: each host's `HostPipeline` runs inside the colocated-Python
sidecar of that host (`jax.experimental.colocated_python`), on the CPU device colocated
with the host's accelerators, and its rows come back as the shards of global `jax.Array`s
on those CPU devices. Host h is the h-th CPU device of the mesh, never `jax.process_index()`
(always 0 under Pathways). On a CPU-only JAX the same calls run in this process.

What goes wrong on a host reaches the trainer: an exception as the same colo-data error
type naming the host, with the exception beneath it as its cause and the host's traceback
once (`errors.to_wire`); warnings raised in the sidecar's process (which
would stay in its log) in a note beside each call's batches, re-issued in the trainer
naming their host. Warnings of worker processes (`workers` > 0) stay in the sidecar's log.
A Grain pipeline's host states come back the same way, beside each call's batches."""

from __future__ import annotations

import itertools
import json
import sys
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from time import perf_counter
from typing import Any, cast

import jax
import numpy as np
from jax.experimental.colocated_python import (
    colocated_cpu_devices,
    colocated_python_class,
)
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from colo_data.backends.base import GlobalBatch, ended_early, same_columns, told
from colo_data.backends.placement import Placement
from colo_data.errors import ColoDataError, ConfigError, GrainError, SidecarError, Wire, from_wire, named_in, to_wire
from colo_data.host.chunk import HostChunk
from colo_data.host.dtypes import jax_ready
from colo_data.host.shares import HostShare, host_pipeline
from colo_data.host.worker_policy import bounded
from colo_data.pipeline import parts
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.budget import cpu_budget
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import close_iterator
from colo_data.telemetry.counters import HANDOFF, StageTimes
from colo_data.telemetry.report import HostCounters, HostInfo
from colo_data.workers.pools import start_pool
from colo_data.workers.settings import Workers, check_workers, choose_workers

_AXIS = "hosts"
_LOW_BITS = 31  # a position travels as two int32 words: JAX's default has no int64
NOTE_BYTES = 4096  # a host's warnings of one call, as zero-padded JSON: fetched by the trainer each call
STATE_BYTES = 16384  # a Grain pipeline host's states of one call's batches, as zero-padded JSON
_MESSAGE_CHARS = 1000  # of one warning's message in a note
_PROCESS = uuid.uuid4().hex  # this interpreter: a colocated object compares it with its controller's


def colocated_hosts(mesh: Mesh) -> list[jax.Device]:
    """The CPU devices colocated with `mesh`'s devices, one per host, in the order in which
    the mesh's devices first name them: host h is the h-th. CPU devices stand for
    themselves (JAX's CPU-only fallback of `colocated_cpu_devices` renumbers them)."""
    devices = tuple(mesh.devices.flat)
    cpus = devices if all(d.platform == "cpu" for d in devices) else colocated_cpu_devices(devices)
    return list(dict.fromkeys(cpus))


def _encode(positions: np.ndarray) -> np.ndarray:
    return np.stack([positions >> _LOW_BITS, positions & (2**_LOW_BITS - 1)], axis=-1).astype(np.int32)


def _decode(words: np.ndarray) -> np.ndarray:
    return (words[..., 0].astype(np.int64) << _LOW_BITS) | words[..., 1].astype(np.int64)


class _ColocatedHost:
    """The object that lives in the colocated-Python sidecar: one per host under Pathways,
    one for every host on a CPU-only JAX. A request is an int32 array of shape
    `(hosts, count, 2)`, sharded over the hosts' CPU devices, holding the positions
    of `count` consecutive global batches; the shard a host holds says which host it is.
    Consecutive requests continue each host's feed of chunks (its worker processes and
    row-group cache); any other position, or another count (`ColocatedHosts.batches_per_call`,
    which its first call bounds by bytes) but the stream's last, restarts it. `controller` is
    the controller's `_PROCESS`: in another process (a sidecar's) this object carries each
    host's warnings back in the calls' notes; in the controller's own they show there."""

    def __init__(self, pipeline: AnyPipeline, workers: Workers, controller: str) -> None:
        self.pipeline = pipeline
        self.choice = choose_workers(workers, cpu_budget())
        self.carries_warnings = controller != _PROCESS
        self._pipelines: dict[int, HostShare] = {}
        self._feeds: dict[int, _Feed] = {}
        self._owner = Lifecycle("colocated host")

    @staticmethod
    def _host(shard: Any, hosts: int) -> int:
        """The host whose CPU device holds `shard`: the request's row on that device."""
        return shard.index[0].indices(hosts)[0]

    def _chunk(self, host: int, hosts: int, position: Position, count: int) -> tuple[HostChunk | None, list[Any] | None]:
        """The host's next `count` batches from `position` as one chunk (None at the stream's
        end), and for a packed or filtered pipeline the position after each of them
        (fewer at the stream's end): its batches take as many records as fit or pass (a
        partitioned one's: its partitions' own positions)."""
        variable = self.pipeline.variable_batches  # each batch ends where the hosts say
        cut = None if variable else count  # batches of the feed's chunks (None: one each, taken `count` at a time)
        current = self._feeds.get(host)
        key = self._key(host, hosts, position)
        if current is None or not self._continues(current, key, cut):
            if current is not None:
                _close(current)
            if host not in self._pipelines:  # its worker processes are kept across feeds
                pool = start_pool(self.choice, self._owner)
                self._pipelines[host] = host_pipeline(self.pipeline, host, hosts, pool)
            run = self._owner.child(f"host {host} feed")
            share = self._pipelines[host]  # the controller waits while its chunks are computed: its wait for input
            chunks = told(share.chunks(position, run, batches=None if variable else count), share.downstream, True)
            current = (key, chunks, run, cut)
        try:
            if not variable:
                chunk = next(current[1], None)
                self._feeds[host] = (int(position) + count * self.pipeline.global_batch_size, *current[1:])
                return chunk, None
            parts = list(itertools.islice(current[1], count))  # one batch each, with the position after it
        except BaseException:  # a feed whose chunk failed has ended: the next call starts another
            self._feeds.pop(host, None)
            _close(current)
            raise
        ends = [part.end if isinstance(part.end, np.ndarray) else int(cast(int, part.end)) for part in parts]
        self._feeds[host] = (ends[-1] if ends else key, current[1], current[2], cut)
        if not parts:
            return None, None
        columns = {name: np.concatenate([part.columns[name] for part in parts]) for name in parts[0].columns}
        return HostChunk(columns, ends[-1]), ends

    def _continues(self, feed: _Feed, key: Position, cut: int | None) -> bool:
        """Whether `feed` continues at `key` in chunks of `cut` batches: its own, or fewer
        where they are what is left of the stream (its last chunk holds them)."""
        if not np.array_equal(feed[0], key):
            return False
        if feed[3] is None or cut is None or cut >= feed[3]:
            return feed[3] == cut
        return cut == self.pipeline.batches_from(cast(int, key))

    def _key(self, host: int, hosts: int, position: Position) -> Position:
        """What a host's feed continues from: the position, or a partitioned pipeline's
        phase and own positions of the host's partitions (what its chunks end at)."""
        if not isinstance(position, np.ndarray):
            return position
        phase, own = parts.share(position, cast(Pipeline, self.pipeline).partitioning.owned(host, hosts))
        return parts.start(own, phase)

    def _position(self, words: np.ndarray, count: int) -> Position:
        """The position a host's row of a request holds: the first of its batches', or
        (after them) a partitioned pipeline's own positions."""
        positions = _decode(words)
        return positions[count:] if self.pipeline.partitioned else int(positions[0])

    def open(self, request: jax.Array) -> jax.Array:
        """Each host's index as its CPU device sees it, for the controller to check."""
        hosts = request.shape[0]
        pieces = [
            jax.device_put(np.array([self._host(s, hosts)], np.int32), s.device) for s in request.addressable_shards
        ]
        return jax.make_array_from_single_device_arrays((hosts,), _batch_sharding(request), pieces)

    def batches(
        self, request: jax.Array
    ) -> tuple[list[dict[str, jax.Array]], jax.Array | None, jax.Array | None, jax.Array | None]:
        """The requested global batches, each a dict of arrays of shape (global batch size,
        ...) whose shard on host h's CPU device is host h's rows (none at the stream's end),
        the hosts' notes: a (hosts, NOTE_BYTES) uint8 array whose row h holds host h's
        warnings of this call (`_note`), None when this object runs in the controller's
        process, a Grain pipeline's host states: a (hosts, STATE_BYTES) uint8 array, row h
        host h's state after each batch as JSON (None for a native pipeline), and a packed or
        filtered pipeline's position after each batch: a (hosts, batches, 2) int32
        array (`_encode`; every host plans the same batches; None for other pipelines). Such
        a call may give fewer batches than asked, at the stream's end. In JAX's 32-bit mode a
        64-bit column is cast to 32 bits, or is a TransformError when a value would change."""
        hosts, count = request.shape[:2]
        partitioned = self.pipeline.partitioned
        if partitioned:  # the partitions' own positions follow the batches' words
            count -= 1 + cast(Pipeline, self.pipeline).partitioning.partitions
        size = self.pipeline.global_batch_size
        chunks: list[tuple[int, Any, HostChunk | None]] = []
        positions: dict[int, Position] = {}
        ends: dict[int, list[Any] | None] = {}
        caught: dict[int, list[warnings.WarningMessage]] = {}
        for shard in request.addressable_shards:
            host = self._host(shard, hosts)
            with self._work_of(host, hosts, caught):
                positions[host] = self._position(np.asarray(shard.data)[0], count)
                chunk, ends[host] = self._chunk(host, hosts, positions[host], count)
                chunks.append((host, shard.device, chunk))
        ended = [h for h, _, c in chunks if c is None]
        if len(ended) == len(chunks) or (ended and partitioned):  # a partitioned stream ends with a partition
            return [], None, None, None
        if ended:
            raise ended_early(ended, [h for h, _, c in chunks if c is not None])
        planned = {h: e for h, e in ends.items() if e is not None}
        if partitioned:  # each host its own partitions' positions; the hosts' fewest batches are the call's
            count = min(len(e) for e in planned.values())
            chunks = [(h, d, _first_batches(c, count, size // hosts)) for h, d, c in chunks]
        elif len({tuple(e) for e in planned.values()}) > 1:
            raise SidecarError(f"the hosts planned other batches (their positions after each: {planned})")
        if planned:
            count = len(next(iter(planned.values()))) if not partitioned else count
        per_host = [(h, d, c.columns) for h, d, c in chunks if c is not None]
        same_columns([h for h, _, _ in per_host], [c for _, _, c in per_host])
        x64 = jax.enable_x64.value  # read here: this process's JAX makes the arrays (and would narrow)
        ready = []
        for h, d, c in per_host:
            with self._work_of(h, hosts, caught):
                ready.append((h, d, jax_ready(c, x64, f"host {h}, batches from position {positions[h]}")))
        sharding = _batch_sharding(request)
        out: list[dict[str, jax.Array]] = [{} for _ in range(count)]
        for name, first in ready[0][2].items():
            shape = (size, *first.shape[1:])
            pieces = [jax.device_put(np.split(c[name], count), [d] * count) for _, d, c in ready]  # one call per host
            for i in range(count):
                out[i][name] = jax.make_array_from_single_device_arrays(shape, sharding, [p[i] for p in pieces])
        states = None
        if any(c is not None and c.states is not None for _, _, c in chunks):
            rows = [jax.device_put(_states(c, h)[None], d) for h, d, c in chunks if c is not None]
            states = jax.make_array_from_single_device_arrays((hosts, STATE_BYTES), sharding, rows)
        after = None
        if planned:
            words = [jax.device_put(_encode(np.array(planned[h][:count], np.int64))[None], d) for h, d, _ in ready]
            shape = (hosts, count, *np.shape(planned[ready[0][0]][0]), 2)
            after = jax.make_array_from_single_device_arrays(shape, sharding, words)
        if not self.carries_warnings:  # they showed in this process, the controller's
            return out, None, states, after
        notes = [jax.device_put(_note(caught.get(h, []))[None], d) for h, d, _ in ready]
        return out, jax.make_array_from_single_device_arrays((hosts, NOTE_BYTES), sharding, notes), states, after

    @contextmanager
    def _work_of(self, host: int, hosts: int, caught: dict[int, list[warnings.WarningMessage]]) -> Iterator[None]:
        """Host `host`'s part of a call. An exception leaves it as a `_HostFailure`;
        warnings are kept in `caught` when this object carries them (not thread-safe, as
        `warnings.catch_warnings`: a warning of another thread meanwhile is taken for the host's)."""
        recording: AbstractContextManager[list[warnings.WarningMessage] | None] = (
            warnings.catch_warnings(record=True) if self.carries_warnings else nullcontext()
        )
        with recording as records:
            try:
                yield
            except Exception as e:
                raise _HostFailure(to_wire(e), f"the colocated-Python sidecar of host {host} of {hosts}") from None
            finally:
                if records:
                    caught.setdefault(host, []).extend(records)

    def close(self, request: jax.Array) -> jax.Array:
        """Stop every host's feed and the hosts' worker processes; final."""
        for feed in self._feeds.values():
            _close(feed)
        self._feeds.clear()
        self._pipelines.clear()
        self._owner.close()
        return self.open(request)


def _first_batches(chunk: HostChunk | None, count: int, rows: int) -> HostChunk | None:
    """A chunk's first `count` batches of `rows` rows."""
    if chunk is None or chunk.rows == count * rows:
        return chunk
    return HostChunk({name: column[: count * rows] for name, column in chunk.columns.items()}, chunk.end)


def _ends(after: np.ndarray) -> list[Any]:
    """The position after each batch of a call, from the hosts' (hosts, batches)
    positions (every host plans the same), or a partitioned pipeline's own positions from
    the hosts' (hosts, batches, partitions of a host): the hosts' put together."""
    if after.ndim == 2:
        return after[0].tolist()
    phases, own = after[0, :, 0], np.moveaxis(after[:, :, 1:], 1, 0).reshape(after.shape[1], -1)
    return [parts.start(o, int(p)) for o, p in zip(own, phases, strict=True)]


class _HostFailure(Exception):
    """What leaves a host's work in a colocated call: the error as `to_wire` made it, raised
    in the controller as the same colo-data type (`ColocatedHosts._call`). Its text, all that
    a Pathways controller is handed, holds the traceback and ends with the type's name and
    the message, where `named_in` finds the type."""

    def __init__(self, wire: Wire, where: str) -> None:
        super().__init__(wire, where)
        self.wire, self.where = wire, where

    def __str__(self) -> str:
        return f"{self.wire['traceback']}{self.wire['type']}: {self.wire['error']}\n--- raised in {self.where} ---"


def _note(records: Sequence[warnings.WarningMessage]) -> np.ndarray:
    """A host's warnings of one call as `NOTE_BYTES` of zero-padded JSON (category, message,
    where), as many as fit with the count of the others, which go to this process's
    stderr (the sidecar's log); all zeros for none."""
    note = np.zeros(NOTE_BYTES, np.uint8)
    if not records:
        return note
    items, room = [], NOTE_BYTES - len('{"warnings": [], "dropped": 00000000}')
    for w in records:
        item = json.dumps([w.category.__module__, w.category.__qualname__, str(w.message)[:_MESSAGE_CHARS], w.filename, w.lineno])
        room -= len(item) + 2
        if room < 0:
            break
        items.append(item)
    for w in records[len(items) :]:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    data = f'{{"warnings": [{", ".join(items)}], "dropped": {len(records) - len(items)}}}'.encode()
    note[: len(data)] = np.frombuffer(data, np.uint8)
    return note


def _states(chunk: HostChunk, host: int) -> np.ndarray:
    """A chunk's Grain states as `STATE_BYTES` of zero-padded JSON."""
    data = json.dumps(chunk.states).encode()
    if len(data) > STATE_BYTES:
        raise GrainError(
            f"host {host}: the Grain iterator's state is {len(data):,} bytes as JSON; the colocated backend carries at "
            f"most {STATE_BYTES:,} a call: use fewer mp_prefetch workers, or the sidecar backend"
        )
    row = np.zeros(STATE_BYTES, np.uint8)
    row[: len(data)] = np.frombuffer(data, np.uint8)
    return row


def _unpacked_states(states: np.ndarray) -> list[list[Any]]:
    """Each host's states of a call's batches, from `_states`' rows."""
    return [json.loads(row.tobytes().rstrip(b"\0")) for row in states]


def _reissue(notes: np.ndarray) -> None:
    """Issue here the warnings that the hosts' notes (`_note`, row h from host h) carry,
    each naming its host and where it was raised."""
    for host, note in enumerate(notes):
        data = note.tobytes().rstrip(b"\0")
        if not data:
            continue
        carried = json.loads(data)
        prefix = f"host {host} of {len(notes)}, in its colocated-Python sidecar: "
        for module, name, message, filename, lineno in carried["warnings"]:
            warnings.warn(f"{prefix}{message} ({filename}:{lineno})", _category(module, name), stacklevel=2)
        if carried["dropped"]:
            warnings.warn(
                f"{prefix}{carried['dropped']} more warning(s) did not fit the note the sidecar sends; its log has them",
                RuntimeWarning,
                stacklevel=2,
            )


def _category(module: str, name: str) -> type[Warning]:
    """The warning class `module`.`name` if this process has imported it, else UserWarning."""
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning


def _batch_sharding(request: jax.Array) -> NamedSharding:
    """Leading dimension over the hosts' CPU devices, as the request's."""
    mesh = cast(NamedSharding, request.sharding).mesh  # `ColocatedHosts._request` makes it a NamedSharding
    return NamedSharding(mesh, PartitionSpec(_AXIS))


# a host's feed: the position it continues from, its chunks, what it started, the batches of its chunks
_Feed = tuple[Position, Iterator[HostChunk], Lifecycle, int | None]


def _close(feed: _Feed) -> None:
    """End a host's feed and whatever it started (worker processes, read-ahead)."""
    close_iterator(feed[1])
    feed[2].close()


def _as_colo_data_error(e: Exception, hosts: Sequence[jax.Device]) -> ColoDataError:
    """A failure of a colocated call that arrives as text only (under Pathways the sidecar
    sends the text, not the exception) as a colo-data error: the colo-data error type named
    in the text, else a SidecarError that says where to look."""
    message = str(e)
    kind = named_in(message)
    if kind is not None:
        wire: Wire = {"type": kind, "error": message, "traceback": "", "cause": None, "cause_text": ""}
        return from_wire(wire, f"the colocated-Python sidecar of {len(hosts)} hosts", SidecarError)
    return SidecarError(
        f"the colocated-Python call on {len(hosts)} hosts ({', '.join(map(str, hosts[:4]))}"
        f"{', ...' if len(hosts) > 4 else ''}) failed: {type(e).__name__}: {message}\n"
        "Check the colocated-Python sidecar's log; its image must have colo-data and the pipeline's "
        "modules installed (the pipeline is shipped with cloudpickle)."
    )


class ColocatedHosts:
    """The hosts of `mesh` (the CPU devices colocated with its devices) each running their
    share of `pipeline` (with `workers` processes, 0: in the sidecar's own process) in the
    colocated-Python sidecar. `batches(position)` yields global batches as `jax.Array`s on
    those CPU devices, the batch dimension sharded over the hosts, for the caller to move
    onto the accelerators with `jax.device_put`."""

    def __init__(self, pipeline: AnyPipeline, mesh: Mesh, workers: Workers = 0) -> None:
        self.pipeline, self.workers = pipeline, check_workers("ColocatedHosts", workers)
        self.hosts = colocated_hosts(mesh)
        size, count = pipeline.global_batch_size, len(self.hosts)
        if size % count:
            raise ConfigError(
                f"global_batch_size={size} is not divisible by the {count} hosts of the mesh (the CPU devices "
                f"colocated with its {mesh.devices.size} devices): use a multiple of {count}, "
                f"e.g. {size - size % count or count} or {size - size % count + count}"
            )
        self.sharding = NamedSharding(Mesh(np.array(self.hosts), (_AXIS,)), PartitionSpec(_AXIS))
        self.batches_per_call = host_pipeline(pipeline, 0, count).chunk  # by records; by bytes too after a call
        self._bounded = False  # whether a call told a record's bytes (until then, calls of one batch)
        self._remote: Any = None
        self._open()

    def _request(self, position: Position, count: int) -> jax.Array:
        if isinstance(position, np.ndarray):  # a partitioned pipeline's own positions, after `count` words
            positions = np.concatenate([np.zeros(count, np.int64), position])
        else:
            positions = position + self.pipeline.global_batch_size * np.arange(count, dtype=np.int64)
        words = np.broadcast_to(_encode(positions), (len(self.hosts), len(positions), 2))
        return jax.device_put(words, self.sharding)

    def _call(self, method: str, request: jax.Array) -> Any:
        try:
            return jax.block_until_ready(getattr(self._remote, method)(request))
        except ColoDataError:
            raise
        except _HostFailure as e:  # the exception itself came back (JAX ran the call in this process)
            error = from_wire(e.wire, e.where, SidecarError)
            raise error from error.__cause__
        except Exception as e:
            raise _as_colo_data_error(e, self.hosts) from e

    def _open(self) -> None:
        # The first call creates the objects. It must succeed: a colocated object lives only
        # as long as a compiled method holds it, and a first call that fails holds nothing
        # (every later call would find no object), so this one cannot fail on the data.
        # jax types the wrapper `type[object]`, though it takes `_ColocatedHost`'s arguments
        self._remote = colocated_python_class(_ColocatedHost)(self.pipeline, self.workers, _PROCESS)
        try:
            seen = np.asarray(self._call("open", self._request(0, 1)))
        except BaseException:
            self._remote = None
            raise
        if not np.array_equal(seen, np.arange(len(self.hosts))):
            self.close()
            raise SidecarError(
                f"the colocated hosts {self.hosts} report host indices {seen.tolist()}: the sharding lost the host order"
            )

    def batches(self, start_position: Position) -> Iterator[dict[str, jax.Array]]:
        """Global batches from position `start_position` on (a trailing partial batch is
        dropped), `batches_per_call` computed per colocated call (the first call, one: it tells
        a record's bytes, which bound the rest). Reopens the hosts' objects after `close()`."""
        for batch, _, _ in self.batches_and_ends(start_position):
            yield batch

    def batches_and_ends(
        self, start_position: Position
    ) -> Iterator[tuple[dict[str, jax.Array], dict[int, Any] | None, Position | None]]:
        """As `batches`, each global batch with where it ends: a Grain pipeline's host states
        after it (host -> state; None for a native pipeline) and a packed or filtered
        pipeline's position after it (None for others)."""
        if self._remote is None:
            self._open()
        left = None if isinstance(start_position, np.ndarray) else self.pipeline.batches_from(start_position)
        position, size = start_position, self.pipeline.global_batch_size
        while left is None or left > 0:
            if self._remote is None:
                raise SidecarError("ColocatedHosts was closed while its batches were read: call batches() again")
            most = self.batches_per_call if self._bounded else 1
            count = most if left is None else min(most, left)
            batches, notes, states, after = self._call("batches", self._request(position, count))
            if notes is not None:
                _reissue(np.asarray(notes))
            if not batches:
                return
            self._bound(batches[0])
            per_host = None if states is None else _unpacked_states(np.asarray(states))
            ends = None if after is None else _ends(_decode(np.asarray(after)))
            for i, batch in enumerate(batches):
                host_states = None if per_host is None else {h: s[i] for h, s in enumerate(per_host)}
                yield batch, host_states, None if ends is None else ends[i]
            position = int(position) + count * size if ends is None else ends[-1]
            left = None if left is None else left - count

    def _bound(self, batch: dict[str, jax.Array]) -> None:
        """`batches_per_call` bounded by bytes as well as records (`worker_policy.bounded`),
        a record's bytes told by a global `batch`: a call holds its batches on the hosts
        twice over (their chunk and the arrays), 4 GiB for 512 records of 4 MiB without it."""
        if not self._bounded:
            size = self.pipeline.global_batch_size
            record = sum(column.nbytes for column in batch.values()) / size
            self.batches_per_call = bounded(self.batches_per_call, record, size // len(self.hosts))
            self._bounded = True

    def close(self) -> None:
        """Stop the hosts' feeds and release the colocated objects."""
        if self._remote is None:
            return
        try:
            self._call("close", self._request(0, 1))
        finally:
            self._remote = None

    def __enter__(self) -> ColocatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ColocatedTransport:
    """The Pathways transport behind the `Transport` protocol: `ColocatedHosts` computes the
    global batches on the hosts' CPU devices, and each is moved onto the mesh here.

    Args:
        pipeline: the dataset definition, shipped to the colocated sidecars.
        placement: the mesh placement (one host per CPU device colocated with the mesh).
        workers: worker processes per host in its sidecar (0: its own process).
        owner: releases the colocated objects when it closes.
    """

    name = "colocated"
    on_trainer_thread = False

    def __init__(self, pipeline: AnyPipeline, placement: Placement, workers: Workers, owner: Lifecycle) -> None:
        self.placement = placement
        self.local_hosts = placement.local_hosts
        self.handoff = StageTimes()
        self._hosts = ColocatedHosts(pipeline, placement.mesh, workers)
        owner.add("colocated hosts", lambda timeout: self._hosts.close())

    def open(self, position: Position, run: Lifecycle) -> Iterator[GlobalBatch]:
        return self._placed(self._hosts.batches_and_ends(position))

    def _placed(
        self, batches: Iterator[tuple[dict[str, jax.Array], dict[int, Any] | None, Position | None]]
    ) -> Iterator[GlobalBatch]:
        """The hosts' global batches, moved from their CPU devices onto the mesh."""
        rows = self.placement.global_batch_size
        try:
            for batch, states, end in batches:
                start = perf_counter()
                placed = jax.device_put(batch, {name: self.placement.sharding(a.ndim) for name, a in batch.items()})
                self.handoff.add(HANDOFF, perf_counter() - start, rows, 0)
                yield GlobalBatch(placed, end=end, states=states)
        finally:
            close_iterator(batches)

    def counters(self) -> tuple[list[float], list[HostCounters]]:
        return list(self.handoff.values), []  # the hosts' own counters stay in their sidecars

    def infos(self) -> list[HostInfo]:
        return []

    def run_ended(self) -> None:
        pass
