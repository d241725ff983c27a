"""`GrainPipeline`: a user's own Grain dataset, unchanged, run as each host's share of the
stream. colo-data gives each host its shard (from the mesh, never `jax.process_index()`),
runs the dataset where the backend says, and checkpoints each host's Grain iterator state
with the batch it belongs to. Its promises are Grain's: resume on the same host count, and
on another only through Grain's own `ElasticIterator`. It answers what the loader asks of a
pipeline kind (`colo_data.pipeline.kinds.PipelineKind`) with its hosts' Grain states."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar, Literal

from colo_data.errors import ConfigError, StateError
from colo_data.pipeline.order import Position
from colo_data.pipeline.state_format import FORMAT
from colo_data.setting_checks import as_int

KIND = "grain"
# Grain's ElasticIterator state: the same on every host, valid for any host count
_ELASTIC_KEYS = {"global_next_index"}


@dataclass(frozen=True)
class GrainPipeline:
    """A Grain dataset per host, as one frozen, picklable value.

    Args:
        make_dataset: `make_dataset(shard)` with a `grain.sharding.ShardOptions` (this host's
            place on the mesh's data axis and the host count) returns the host's
            `grain.IterDataset` or `grain.MapDataset`. It runs where the host's share runs
            (the trainer, the sidecar, the colocated sidecar), so it must be importable
            there (or picklable by value with cloudpickle). The one argument that may be
            given by position.
        global_batch_size: rows of each global batch, over all hosts.
        records: False: each element is one host's batch, a dict of arrays whose leading
            size is `global_batch_size / hosts`; True: each element is one record (a dict
            of arrays or scalars) and colo-data stacks `global_batch_size / hosts` of them.
    """

    make_dataset: Callable[[Any], Any]
    _: KW_ONLY
    global_batch_size: int
    records: bool = False
    # Set by `resumed`: each host's saved entry (`{"data": fingerprint, "workers": mp_prefetch's, "state": Grain's}`, None
    # for a host that starts at its beginning) and the position (records) they continue from.
    resume: tuple[dict[str, Any] | None, ...] | None = dataclasses.field(default=None, repr=False)
    resume_position: int = dataclasses.field(default=0, repr=False)

    # What the transports ask of every pipeline kind: a Grain pipeline's data, order, packing
    # and end live inside its datasets.
    source = None
    pack = None
    keep = None
    index_column = None
    variable_batches = False
    partitioned = False
    position_partitioning = None
    # its records are its datasets' own, not a function of a position that colo-data computes
    positional: ClassVar[Literal[False]] = False

    def __post_init__(self) -> None:
        if not callable(self.make_dataset):
            raise ConfigError(
                f"make_dataset={self.make_dataset!r}: give a function of a grain.sharding.ShardOptions that returns the "
                "host's grain.IterDataset or grain.MapDataset"
            )
        size = as_int(self.global_batch_size)
        if size is None or size < 1:
            raise ConfigError(f"global_batch_size={self.global_batch_size!r}: must be a positive int")
        object.__setattr__(self, "global_batch_size", size)
        if not isinstance(self.records, bool):
            raise ConfigError(f"records={self.records!r}: True (elements are records) or False (host batches)")

    def at(self, position: int) -> int:
        """The position itself: a Grain pipeline has one."""
        return position

    def batches_from(self, position: int) -> int | None:
        """None: a Grain dataset's length is known only to it; its stream ends when the
        hosts' datasets do."""
        return None

    def check_run(self, hosts: int, processes: int) -> None:
        """Nothing to refuse: each host's dataset is its own shard, on any host count."""

    def state_at(self, position: Position, hosts: int, host_states: dict[int, Any]) -> dict[str, Any]:
        """The loader state after `position` records: each host's Grain state at the last
        batch delivered (or where the stream started; None for a host at its beginning),
        as one small JSON dict.

        Raises:
            StateError: a host's state is not known here (its batches were computed by
                another process).
        """
        position = int(position)
        missing = [h for h in range(hosts) if h not in host_states]
        if missing and position > 0:
            raise StateError(
                f"get_state: the Grain states of host(s) {missing} of {hosts} are not known in this process; save the "
                "state in a process that reads every host's batches"
            )
        return {
            "format": FORMAT,
            "kind": KIND,
            "position": position,
            "global_batch_size": self.global_batch_size,
            "hosts": [host_states.get(h) for h in range(hosts)],
        }

    def resumed(self, state: dict[str, Any], hosts: int) -> tuple[GrainPipeline, int]:
        """This pipeline set to continue from `state` on `hosts` hosts, and the position it
        continues from. Each host checks its data's fingerprint when it starts.

        Raises:
            StateError: not a Grain pipeline's state, another batch size, or another host
                count (unless every host's state is an `ElasticIterator`'s).
        """
        if state.get("kind") != KIND:
            raise StateError(
                "the loader state was saved from a native cd.Pipeline; this is a cd.GrainPipeline: restore it into "
                "the pipeline that saved it, or start without a state"
            )
        saved, position = state.get("hosts"), state.get("position")
        if not (isinstance(saved, list) and saved and all(s is None or (isinstance(s, dict) and "state" in s) for s in saved)):
            raise StateError(f"the Grain loader state has hosts={saved!r}: not one entry per host")
        if not (isinstance(position, int) and position >= 0):
            raise StateError(f"the Grain loader state has position={position!r}: not a global position (records delivered)")
        if state.get("global_batch_size") != self.global_batch_size:
            raise StateError(
                f"the Grain loader state was saved with global_batch_size={state.get('global_batch_size')!r}, this "
                f"pipeline has {self.global_batch_size}: a Grain pipeline continues with the batch size it saved"
            )
        if len(saved) != hosts:
            if not _elastic(saved):
                raise StateError(
                    f"the Grain loader state was saved on {len(saved)} host(s); this loader has {hosts}. A Grain "
                    "iterator's state restores on the host count that saved it: restore on "
                    f"{len(saved)} host(s), or make the pipeline elastic with grain.experimental.ElasticIterator over "
                    "a MapDataset (see docs/grain.md)"
                )
            saved = [saved[0]] * hosts
        return dataclasses.replace(self, resume=tuple(saved), resume_position=position), position

    def with_global_batch_size(self, size: int) -> GrainPipeline:
        """This pipeline at another global batch size (only a state saved at that size
        restores into it: a Grain pipeline continues with the batch size it saved)."""
        return dataclasses.replace(self, global_batch_size=size)

    def continues(self, running: object) -> bool:
        """True: whatever state it restored, its hosts start again from the Grain states it
        carries, in a transport of their own (`host_states`)."""
        return True

    def host_states(self) -> dict[int, Any]:
        """Each host's Grain state where this pipeline starts (`resumed`'s; none before a
        state is restored, or for a host at its beginning), which only a new transport's
        hosts take."""
        return dict(enumerate(self.resume or ()))

    def mixture_records(self, first: Position, position: Position) -> None:
        """None: a Grain pipeline's records have no components that colo-data counts."""
        return None


def _elastic(saved: list[dict[str, Any]]) -> bool:
    """Every host saved the same `ElasticIterator` state (valid for any host count)."""
    if any(s is None for s in saved):
        return all(s is None for s in saved)  # nothing delivered yet: every host starts at its beginning
    first = saved[0]["state"]
    return isinstance(first, dict) and set(first) == _ELASTIC_KEYS and all(s["state"] == first for s in saved)
