"""The one place where a pipeline kind meets its host side: `host_pipeline` makes the
`HostShare` of any kind (`HostPipeline` for a native pipeline, `GrainHost` for a Grain
one); transports use only what `HostShare` names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from colo_data.host.chunk import HostChunk
from colo_data.host.chunk_work import ChunkPool
from colo_data.host.grain_host import GrainHost
from colo_data.host.host_pipeline import HostPipeline
from colo_data.host.pool_schedule import Downstream
from colo_data.pipeline.grain_pipeline import GrainPipeline
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.telemetry.counters import CpuMeter, StageTimes
from colo_data.telemetry.quality import QualityCounts


class HostShare(Protocol):
    """One host's share of a pipeline of any kind, as the transports see it."""

    host: int
    hosts: int
    rows: range
    stages: StageTimes
    worker_stages: list[StageTimes]  # by worker: the stages of the shares it made (none without workers)
    quality: QualityCounts  # data-quality counts of the rows it made (none for a Grain pipeline)
    cpu: CpuMeter | None
    downstream: Downstream  # where the consumer tells the seconds it worked on the chunks on their thread

    @property
    def chunk(self) -> int: ...

    def workers_now(self) -> tuple[int, str]: ...

    def chunks(
        self, start_position: Position, owner: Lifecycle | None = None, batches: int | None = None
    ) -> Iterator[HostChunk]: ...


_KINDS: dict[type, Any] = {Pipeline: HostPipeline, GrainPipeline: GrainHost}


def host_pipeline(
    pipeline: AnyPipeline, host: int = 0, hosts: int = 1, pool: ChunkPool | None = None, ahead: bool = False
) -> HostShare:
    """Host `host` of `hosts` of `pipeline`, of the class its kind runs as."""
    share: HostShare = _KINDS[type(pipeline)](pipeline, host, hosts, pool, ahead)
    return share
