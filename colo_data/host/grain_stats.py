"""Grain's own stage times as colo-data's stages. A Grain dataset that turns on Grain's
stage timing (`grain.experimental.DatasetOptions(execution_tracking_mode=STAGE_TIMING)`,
or Grain's debug mode) keeps an execution summary: each node's time, elements and bytes.
`GrainStages` reads it and adds what is new to the host's `StageTimes`, each node under
the stage it does (its sources under read, shuffles and slices under order, its batch under
batch, the rest under transform), so that the telemetry of a Grain pipeline says where its
time goes as a native pipeline's does. Without stage timing the host counts a Grain
`next()` as one transform."""

from __future__ import annotations

import time
from typing import Any

from colo_data.telemetry.counters import BATCH, ORDER, READ, TRANSFORM, StageTimes

EVERY_S = 1.0  # the summary is read at most this often (Grain folds its timings into it every 5 s)
_ORDER = ("Shuffle", "Slice", "Repeat")


def stage_of(node_name: str, leaf: bool) -> int | None:
    """The colo-data stage of a Grain summary node, by its name (`leaf`: it has no inputs,
    a source); None for a prefetch node, whose time is waiting for the nodes before it."""
    if "Prefetch" in node_name:
        return None
    if leaf:
        return READ
    if any(word in node_name for word in _ORDER):
        return ORDER
    return BATCH if node_name.startswith("Batch") else TRANSFORM


class GrainStages:
    """The new part of a Grain iterator's execution summary, added to `StageTimes` at most
    every `EVERY_S` seconds. `on` is False where the iterator keeps no summary, and where it
    runs Grain's worker processes (`mp_prefetch`: reading their summaries waits up to 2 s a
    worker, on the thread that makes the batches)."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        stats = getattr(iterator, "_stats", None)  # none on a wrapper such as Grain's ElasticIterator
        self._get = _summary_function() if stats is not None and not _in_processes(stats) else None
        self.on = self._get is not None and self._summary() is not None
        self._seen: dict[int, tuple[float, int, int]] = {}  # node id -> its seconds, elements and bytes so far
        self._last = time.monotonic()

    def add_new(self, stages: StageTimes) -> None:
        """Add each node's time, elements and bytes since the last time to `stages`, if
        `EVERY_S` have passed."""
        if not self.on or time.monotonic() - self._last < EVERY_S:
            return
        self._last = time.monotonic()
        summary = self._summary()
        if summary is None:
            return
        added: dict[int, list[float]] = {}
        for node_id, node in summary.nodes.items():
            stage = stage_of(node.name, not node.inputs)
            if stage is None:
                continue
            seen = self._seen.get(node_id, (0.0, 0, 0))
            now_at = (node.total_processing_time_ns / 1e9, node.num_produced_elements, node.bytes_produced)
            self._seen[node_id] = now_at
            seconds, items, nbytes = (now_at[i] - seen[i] for i in range(3))
            into = added.setdefault(stage, [0.0, 0, 0])
            into[0] += seconds
            into[1], into[2] = max(into[1], items), max(into[2], nbytes)  # a stage's items: its busiest node's
        for stage, (seconds, items, nbytes) in added.items():
            stages.add(stage, seconds, int(items), int(nbytes))

    def _summary(self) -> Any:
        try:
            return self._get(self._iterator) if self._get is not None else None
        except ValueError:  # the iterator keeps no summary (Grain's stage timing is off)
            return None


def _summary_function() -> Any:
    """Grain's `get_execution_summary` (public in newer Grain, internal in 0.2)."""
    import grain  # noqa: PLC0415 - only where a Grain pipeline runs

    public = getattr(grain.experimental, "get_execution_summary", None)
    if public is not None:
        return public
    from grain._src.python.dataset import dataset  # noqa: PLC0415

    return getattr(dataset, "get_execution_summary", None)


def _in_processes(stats: Any) -> bool:
    """Whether a Grain iterator's stats graph has a multiprocessing prefetch node."""
    pending = [stats]
    while pending:
        node = pending.pop()
        if "MPPrefetch" in type(node).__name__:
            return True
        pending.extend(getattr(node, "_parents", ()))
    return False
