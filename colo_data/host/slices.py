"""Slices of a host's partitions for its worker pool: a partitioned packed or filtered
pipeline's work is shared out by partitions, a slice of them to each worker (`cut`), and
a worker goes on ahead with its slice on its own (`SliceFeed`), asked by `Resume`s;
since each partition's rows depend on its own records only, the batches are the same for
any slicing."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import numpy as np

from colo_data.host.chunk import HostBatch, HostChunk, WorkCost
from colo_data.host.chunk_work import ChunkWork, Resume, Share
from colo_data.host.partitioned import partitioned_batches
from colo_data.runtime.thread_time import ThreadTime
from colo_data.telemetry.counters import StageTimes
from colo_data.telemetry.quality import QualityCounts, difference


def cut(owned: range, workers: int, part: int) -> range:
    """Slice `part` of a host's partitions `owned` shared evenly among `workers` workers
    (empty where there are fewer partitions than slices)."""
    count = len(owned)
    return range(owned.start + part * count // workers, owned.start + (part + 1) * count // workers)


class SliceFeed:
    """A worker's slice of a host's partitions (`cut`), computed on as the pool is asked for
    it (`compute` with a `Resume`): it goes on from where it stands while the requests
    follow on, and computes it from the start again (the same batches) when one does not
    (another slicing, a lost worker's share computed elsewhere)."""

    def __init__(self, work: ChunkWork) -> None:
        self.work = work
        self._at: tuple[Resume, int] | None = None  # the feed's request (skip: made so far), and its slice
        self._batches: Iterator[tuple[HostBatch, np.ndarray]] = iter(())

    def compute(self, resume: Resume, count: int, stages: StageTimes, part: int, quality: QualityCounts) -> HostChunk:
        """`count` batches of worker `part`'s slice (`cut`) of the host's partitions among
        `resume.parts` workers, `resume.skip` batches after `resume.start`, stacked; `places`
        are their rows among the host's, and `end` the slice's position after each batch (a
        row a batch). Fewer batches at the stream's end. Their stage counters go to `stages`,
        their data-quality counts to `quality`."""
        owned = self.work.pipeline.partitioning.owned(self.work.host, self.work.hosts)
        mine = cut(owned, resume.parts, part)
        at = self._at
        if at is None or at[1] != part or at[0][1:] != resume[1:] or not np.array_equal(at[0].start, resume.start):
            self._batches = partitioned_batches(self.work, resume.start, mine)
            for _ in itertools.islice(self._batches, resume.skip):
                pass
        before, counted = list(self.work.stages.values), self.work.quality.snapshot()
        made = list(itertools.islice(self._batches, count))
        self._at = (resume._replace(skip=resume.skip + len(made)), part)
        if stages is not self.work.stages:
            stages.merge([a - b for a, b in zip(self.work.stages.values, before, strict=True)])
        if quality is not self.work.quality:
            quality.merge(difference(self.work.quality.values, counted))
        partitioning, host, hosts = self.work.pipeline.partitioning, self.work.host, self.work.hosts
        rows = len(partitioning.kept(host, hosts, mine))  # the host's rows among the slice's
        every = len(partitioning.kept(host, hosts, owned))  # the host's rows a batch
        first = len(partitioning.kept(host, hosts, range(owned.start, mine.start)))
        places = (np.arange(len(made))[:, None] * every + first + np.arange(rows)).ravel()
        end = np.array([e for _, e in made], np.int64).reshape(len(made), 1 + len(mine))
        if not made or not rows:
            return HostChunk({}, end, places=places[:0])
        columns = {name: np.concatenate([batch[name] for batch, _ in made]) for name in made[0][0]}
        return HostChunk(columns, end, places=places)


_FEEDS: weakref.WeakKeyDictionary[ChunkWork, SliceFeed] = weakref.WeakKeyDictionary()  # a worker's, by its work


def compute(work: ChunkWork, position: int | Resume, count: int, share: Share, read_ahead: bool = True) -> HostChunk:
    """What a worker computes when asked: `work.compute` at a position, or for a
    partitioned pipeline's `Resume` the slice that `share` numbers (its `SliceFeed`,
    kept as long as `work`); the chunk carries its stage and data-quality counters, and
    what it cost this thread."""
    began = ThreadTime.now()
    stages, quality = StageTimes(), QualityCounts()
    if isinstance(position, Resume):
        feed = _FEEDS.get(work)
        if feed is None:
            feed = _FEEDS[work] = SliceFeed(work)
        chunk = feed.compute(position, count, stages, share.worker, quality)
    else:
        chunk = work.compute(position, count, stages, share, read_ahead, quality)
    spent = ThreadTime.now().since(began)
    chunk.stages, chunk.quality = stages.values, quality.values
    chunk.cost = WorkCost(chunk.rows if chunk.columns else 0, spent.work, spent.cpu)
    return chunk
