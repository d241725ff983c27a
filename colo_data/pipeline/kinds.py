"""The pipeline kinds a `Loader` runs: a native `Pipeline` (every chunk a pure function of
position) and a `GrainPipeline` (a user's own Grain dataset per host). Each answers what the
loader, its state and the tools ask through `PipelineKind`, in its own module, so that
nothing else asks which kind a pipeline is."""

from __future__ import annotations

from typing import Any, Protocol, Self

from colo_data.pipeline.grain_pipeline import GrainPipeline
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Position

AnyPipeline = Pipeline | GrainPipeline


class PipelineKind(Protocol):
    """What a pipeline of any kind answers. A new kind is one class with these members,
    added to `AnyPipeline`, and its host side (`colo_data.host.shares`)."""

    @property
    def global_batch_size(self) -> int:
        """Rows of each global batch, over all hosts."""
        ...

    @property
    def variable_batches(self) -> bool:
        """Whether a global batch takes other than `global_batch_size` records of the stream."""
        ...

    @property
    def positional(self) -> bool:
        """Whether every record is a function of its position, computed by colo-data
        (source, order, index): what `skip`, `lineage`, `verify`'s record checks and worker
        pools need. A literal of each kind, so that a check of it narrows `AnyPipeline`."""
        ...

    def at(self, position: int) -> Position:
        """Where the stream stands after `position` records."""
        ...

    def check_run(self, hosts: int, processes: int) -> None:
        """Raise ConfigError when it cannot run on `hosts` hosts in `processes` processes."""
        ...

    def state_at(self, position: Position, hosts: int, host_states: dict[int, Any]) -> dict[str, Any]:
        """The loader state after `position` on `hosts` hosts, whose own states at
        the last batch delivered are `host_states` (where the kind has them)."""
        ...

    def resumed(self, state: dict[str, Any], hosts: int) -> tuple[Self, Position]:
        """This pipeline set to continue from `state` on `hosts` hosts, and the position it
        continues from; a StateError when the state is not one of its own."""
        ...

    def with_global_batch_size(self, size: int) -> Self:
        """This pipeline at another global batch size, for a state to be restored into:
        without what a restore derived for its own batch size."""
        ...

    def continues(self, running: object) -> bool:
        """Whether this pipeline, restored from a state, continues the stream of `running`,
        so that a loader running it can jump to the state without a new loader."""
        ...

    def host_states(self) -> dict[int, Any] | None:
        """Each host's own state where this pipeline starts, which only a new transport's
        hosts take; None when its state is one global position, the same on every host."""
        ...

    def mixture_records(self, first: Position, position: Position) -> tuple[dict[str, int], tuple[int, ...]] | None:
        """A mixture's records of each component from position `first` to
        `position`, and the weights' shares; None for any other stream."""
        ...
