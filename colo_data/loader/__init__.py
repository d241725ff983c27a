"""The controller-side `Loader`, its telemetry bookkeeping, Orbax checkpoints and elastic rebuilds."""

from typing import Any

from colo_data._moved import old_names


def __getattr__(name: str) -> Any:
    """The names of the module `colo_data.loader` was before it became this package."""
    return old_names(__name__, ('colo_data.loader.loader',), name)
