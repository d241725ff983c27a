"""`GrainHost`: one host's share of a `GrainPipeline`: the user's Grain dataset for the
host's shard, iterated here, each host batch handed on with the host's Grain iterator
state after it (the state travels with its batch through any prefetch, ring or colocated
call, so a checkpoint holds the state of exactly the batch the trainer last received)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from colo_data.errors import ColoDataError, GrainError, StateError
from colo_data.host.chunk import HostBatch, HostChunk
from colo_data.host.grain_stats import GrainStages
from colo_data.host.host_pipeline import owning, same_schema
from colo_data.host.pool_schedule import Downstream
from colo_data.io.content import file_digest
from colo_data.io.record_source import grain_stages
from colo_data.pipeline.grain_pipeline import GrainPipeline
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.runtime.prefetch import Prefetcher, close_iterator
from colo_data.telemetry.counters import BATCH, TRANSFORM, CpuMeter, StageTimes, metered
from colo_data.telemetry.quality import QualityCounts


class GrainHost:
    """Host `host` of `hosts` of a `GrainPipeline`: rows `rows` of each global batch.

    Args:
        pipeline: the Grain pipeline.
        host: this host's index along the mesh's data axis (its Grain shard index).
        hosts: the host count (the Grain shard count).
        pool: unused: a Grain pipeline's parallelism is its own (`mp_prefetch`); accepted so
            that every transport makes host pipelines of either kind alike.
        ahead: iterate the dataset on a thread of its own, one batch ahead.
    """

    chunk = 1  # host batches per chunk: a Grain iterator makes them one at a time

    def __init__(self, pipeline: GrainPipeline, host: int = 0, hosts: int = 1, pool: Any = None, ahead: bool = False) -> None:
        size = pipeline.global_batch_size
        self.pipeline, self.host, self.hosts = pipeline, host, hosts
        self.rows = range(host * size // hosts, (host + 1) * size // hosts)
        self.stages = StageTimes()
        self.worker_stages: list[StageTimes] = []  # Grain's own workers are not counted apart
        self.quality = QualityCounts()  # a Grain dataset's rows are opaque: none counted
        self.pool = pool
        self.ahead = ahead
        self.cpu: CpuMeter | None = None
        self.downstream = Downstream()  # what a consumer tells a native pipeline's host; a Grain dataset does not ask

    def workers_now(self) -> tuple[int, str]:
        """A Grain dataset's workers are its own (`mp_prefetch`): none of colo-data's."""
        return 0, "no workers of colo-data's: a Grain dataset runs its own (mp_prefetch)"

    def chunks(self, start_position: int, owner: Lifecycle | None = None, batches: int | None = None) -> Iterator[HostChunk]:
        """This host's batches from `start_position` on (0, or where the pipeline's
        `resume` state points), one a chunk, each with its Grain state in `states`.

        Raises:
            TransformError: a batch's columns, dtypes or row shapes differ from the first's.
        """
        run = Lifecycle(f"Grain host {self.host} of {self.hosts}") if owner is None else owner
        # every batch with the first one's columns, dtypes and row shapes, as a native pipeline's
        size = self.pipeline.global_batch_size
        feed = same_schema(self._batches(start_position), start_position, self.host, self.hosts, len(self.rows), size)
        if self.ahead:
            self.cpu = CpuMeter("thread")
            feed = Prefetcher(metered(feed, self.cpu), 1, run, f"colo-data-grain-host{self.host}")
        return feed if owner is not None else owning(feed, run)

    def _where(self) -> str:
        return f"host {self.host} of {self.hosts}"

    def _batches(self, start_position: int) -> Iterator[HostChunk]:
        """The batches; the Grain iterator (and its mp_prefetch processes) is closed on the
        thread that iterates it, when this generator is closed (closing it from another
        thread while that one waits in its `next` left the wait hanging)."""
        iterator, data, workers = self._iterator(start_position)
        grain_stages = GrainStages(iterator)  # Grain's own stage times, where it keeps them
        position = start_position
        try:
            while True:
                t0 = time.perf_counter()
                stacked = self.stages.values[3 * BATCH]  # the stacking time so far, apart from Grain's own
                columns = self._next_batch(iterator, position)
                if columns is None:
                    return
                if grain_stages.on:
                    grain_stages.add_new(self.stages)
                else:  # Grain's next() counted as one transform
                    seconds = time.perf_counter() - t0 - (self.stages.values[3 * BATCH] - stacked)
                    self.stages.add(TRANSFORM, seconds, len(self.rows), sum(c.nbytes for c in columns.values()))
                state = _checked_state(iterator.get_state(), self._where())
                yield HostChunk(columns, states=[{"data": data, "workers": workers, "state": state}])
                position += self.pipeline.global_batch_size
        finally:
            close_iterator(iterator)

    def _iterator(self, start_position: int) -> tuple[Any, str, int]:
        """The host's Grain iterator, at the start or at its saved state, its data's
        fingerprint and its count of Grain worker processes."""
        from absl import flags  # noqa: PLC0415 - Grain (and JAX) load only where a Grain pipeline runs
        from grain.sharding import ShardOptions  # noqa: PLC0415

        if not flags.FLAGS.is_parsed():  # Grain reads absl flags, and fails where no one parsed them
            flags.FLAGS.mark_as_parsed()

        shard = ShardOptions(shard_index=self.host, shard_count=self.hosts)
        try:
            dataset = self.pipeline.make_dataset(shard)
        except Exception as e:
            raise GrainError(
                f"{self._where()}: make_dataset({shard}) raised {type(e).__name__}: {e} (its traceback: this "
                "error's cause)"
            ) from e
        if not (hasattr(dataset, "__iter__") and hasattr(dataset, "parents")):
            raise GrainError(
                f"{self._where()}: make_dataset returned a {type(dataset).__name__}; return the host's grain.IterDataset "
                "or grain.MapDataset (not an iterator or a DataLoader: see docs/grain.md)"
            )
        data = fingerprint(dataset)
        pipeline = self.pipeline
        resume = pipeline.resume
        saved = resume[self.host] if resume is not None and start_position == pipeline.resume_position else None
        workers = workers_of(dataset)
        if saved is not None:
            self._check_workers(saved, workers)
            if saved["data"] != data:
                raise StateError(
                    f"{self._where()}: the loader state was saved over other data (fingerprint {saved['data']}, this "
                    f"host's dataset has {data}: other files, other content or record counts, or another pipeline); restore it "
                    "into the pipeline that saved it, or start without a state"
                )
        elif start_position != 0:
            raise StateError(
                f"{self._where()}: a Grain pipeline starts at its beginning or at a saved state, not at position "
                f"{start_position}: continue with cd.Loader(pipeline, state=loader.get_state())"
            )
        iterator = iter(dataset)
        if saved is not None:
            self._restore(iterator, saved["state"])
        return iterator, data, workers

    def _check_workers(self, saved: dict[str, Any], workers: int) -> None:
        """A state saved with another count of Grain worker processes is refused, naming both:
        mp_prefetch gives each worker its own slice of the dataset, so its state (and, with
        filters or packing, its stream) belongs to its count. A state of an earlier
        colo-data does not record the count."""
        before = saved.get("workers", workers)
        if before != workers:
            raise StateError(
                f"{self._where()}: the loader state was saved with {before} Grain worker process(es) (mp_prefetch's "
                f"MultiprocessingOptions(num_workers=...)); this host's dataset has {workers}. A Grain iterator's state "
                f"restores with the worker count that saved it: build the dataset with mp_prefetch(MultiprocessingOptions("
                f"num_workers={before})) "
                "(cd.resources.grain_multiprocessing_options() sizes it from the CPU budget, which may differ after a restart), "
                "or start without a state"
            )

    def _restore(self, iterator: Any, state: Any) -> None:
        """The iterator set to a saved Grain state; a state Grain cannot restore is a
        StateError (the iterator, and any worker processes it started, closed first). Grain
        takes some such states and fails when next asked for its state: that is asked here."""
        try:
            iterator.set_state(state)
            iterator.get_state()
        except Exception as e:
            close_iterator(iterator)
            raise StateError(
                f"{self._where()}: Grain could not restore the saved iterator state ({type(e).__name__}: {e}): the "
                "dataset differs from the one that saved it in a way the state cannot follow (its worker count, its "
                "stages). Restore it into the pipeline that saved it, with its worker count, or start without a state"
            ) from e

    def _next_batch(self, iterator: Iterator[Any], position: int) -> HostBatch | None:
        """The next host batch, the one of the global batch at `position`: an element,
        or `len(rows)` records stacked; None at the end (a trailing partial batch of records
        is dropped)."""
        rows = len(self.rows)
        if not self.pipeline.records:
            element = self._next(iterator, position)
            return None if element is _END else _host_batch(element, rows, self._where())
        records = []
        for _ in range(rows):
            record = self._next(iterator, position)
            if record is _END:
                return None
            records.append(_columns(record, self._where(), "record"))
        t0 = time.perf_counter()
        names = records[0].keys()
        for i, record in enumerate(records):
            if record.keys() != names:
                raise GrainError(
                    f"{self._where()}: record {i} of a batch has the keys {sorted(record)}, the first {sorted(names)}: "
                    "every record must have the same keys"
                )
        try:
            batch = {name: np.stack([r[name] for r in records]) for name in names}
        except ValueError as e:
            raise GrainError(
                f"{self._where()}: the records of a batch cannot be stacked ({e}): pad every record's arrays to one "
                "shape (e.g. in a .map before they come out)"
            ) from e
        self.stages.add(BATCH, time.perf_counter() - t0, rows, 0)
        return batch

    def _next(self, iterator: Iterator[Any], position: int) -> Any:
        """The iterator's next element, `_END` at its end. An exception the dataset raises (a
        map's, a source's) is a GrainError naming the host, the batch and the exception's type
        and message, with the exception as its cause (also from a sidecar or a colocated host)."""
        try:
            return next(iterator, _END)
        except ColoDataError:
            raise
        except Exception as e:
            size = self.pipeline.global_batch_size
            raise GrainError(
                f"{self._where()}: the Grain dataset raised, making global batch {position // size} (position "
                f"{position}): {type(e).__name__}: {e}\nFix it in the dataset's code (its traceback: this error's "
                "cause) or the record it names."
            ) from e


_END = object()  # the end of a Grain iterator (an element may be None: it is a GrainError, not the end)


def _columns(element: Any, where: str, what: str) -> HostBatch:
    """An element's columns: a dict of names to arrays (or scalars, for records)."""
    if not isinstance(element, dict) or not element:
        raise GrainError(
            f"{where}: the Grain dataset gave a {type(element).__name__} {what}; colo-data batches dicts of arrays "
            "(name -> numpy array): end the dataset with a .map that returns one"
        )
    out = {}
    for name, value in element.items():
        array = np.asarray(value)
        if not isinstance(name, str) or array.dtype == object or array.dtype.kind in "USV":
            raise GrainError(
                f"{where}: the Grain dataset's {what} has {name!r}: {type(value).__name__}; every value must be a numeric "
                "or bool array under a str name (turn text into token ids, drop other values in a .map)"
            )
        out[name] = array
    return out


def _host_batch(element: Any, rows: int, where: str) -> HostBatch:
    columns = _columns(element, where, "element")
    for name, column in columns.items():
        if column.ndim == 0 or len(column) != rows:
            got = "a scalar" if column.ndim == 0 else f"leading size {len(column)}"
            raise GrainError(
                f"{where}: the Grain dataset's element has {name!r} with {got}; a host's batch is global_batch_size / "
                f"hosts = {rows} rows: batch by {rows} in make_dataset (e.g. .batch({rows}, drop_remainder=True)), or "
                "give records=True to have colo-data stack the records"
            )
    return columns


def _checked_state(state: Any, where: str) -> Any:
    """A Grain state that goes into the loader's JSON checkpoint as it is."""
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise GrainError(f"{where}: the Grain iterator's state is not JSON ({e}); colo-data saves it as JSON") from e


def workers_of(dataset: Any) -> int:
    """The count of worker processes Grain's `mp_prefetch` runs in a dataset (0 without it):
    its interleave of one process-prefetch dataset per worker."""
    for node in grain_stages(dataset):
        shards = getattr(node, "_datasets", None)
        if shards and all(type(s).__name__ == "ProcessPrefetchIterDataset" for s in shards):
            return len(shards)
    return 0


def fingerprint(dataset: Any) -> str:
    """A short hash of a Grain dataset's graph (each stage's type) and data: for an
    ArrayRecord source its files' names, content (`file_digest`) and record ranges, for a source with a
    `fingerprint()` that, for any other its type and length. The same on every host of a
    pipeline whose hosts read the same files."""
    parts: list[str] = []
    for node in grain_stages(dataset):
        parts.append(type(node).__qualname__)
        source = getattr(node, "_source", None)
        if source is not None:
            parts.append(_source_identity(source))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _source_identity(source: Any) -> str:
    own = getattr(source, "fingerprint", None)
    if callable(own):
        return str(own())
    instructions = getattr(source, "_read_instructions", None)  # ArrayRecord's data source
    if instructions is not None:
        return ";".join(
            f"{os.path.basename(i.filename)}:{_digest(i.filename)}:{i.start}:{i.end}" for i in instructions
        )
    return f"{type(source).__qualname__}:{len(source)}"


def _digest(path: str) -> str:
    """The file's `file_digest` (its size and a few windows of its bytes); "missing" when it cannot be read."""
    try:
        return file_digest(path)
    except OSError:
        return "missing"
