"""One host's share of the pipeline: order, read, transform, batch; worker processes; CPU and memory budgets."""

from typing import Any

from colo_data._moved import old_names


def __getattr__(name: str) -> Any:
    """The names of the module `colo_data.host` was before it became this package."""
    return old_names(__name__, ('colo_data.host.pipeline', 'colo_data.host.chunk'), name)
