"""The runs of `colo-data bench`: a pipeline through `cd.Loader` with a simulated training
step, and the same logical pipeline through Grain alone for comparison, each timed at the
trainer the same way. The report is `colo_data.bench.report`; the command line
`colo_data.cli.bench`."""

from __future__ import annotations

import gc
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from colo_data.bench.grain_baseline import grain_loader
from colo_data.loader.loader import Loader
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.telemetry.counters import STAGES, StepClock
from colo_data.telemetry.quality import Quality
from colo_data.telemetry.report import StepTrace, Telemetry, summarize

ENDLESS_STEPS = 500  # steps a run reads of a pipeline that repeats forever, unless --steps says
QUALITY_SAMPLES = 100  # data-quality samples a run takes for the plot (every 10 steps where its length is unknown)


@dataclass
class Run:
    """One contender's result: its telemetry, its steps one by one, whether Ctrl-C cut it
    short, and its data quality every few steps (steps done, `Telemetry.quality` then)."""

    name: str
    telemetry: Telemetry
    trace: StepTrace
    interrupted: bool
    notes: list[str] = field(default_factory=list)
    quality: list[tuple[int, Quality]] = field(default_factory=list)


class _Interrupted:
    """A first Ctrl-C asks the run to stop after the step in progress (`hit`, which the loop
    reads), so that it never lands inside the loader's or Grain's own code half-way through
    a hand-off; a second one interrupts at once. After a Ctrl-C, Ctrl-C stays ignored, so
    that the clean-up (closing the loader, its sidecars and workers) runs to the end."""

    def __init__(self) -> None:
        self.hit = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self) -> _Interrupted:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        signal.signal(signal.SIGINT, signal.SIG_IGN if self.hit else self._previous)
        return kind is KeyboardInterrupt


class _Shielded:
    """Ctrl-C is ignored inside the block (a clean-up that must finish), then restored."""

    def __enter__(self) -> None:
        self._previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


def steps_to_run(pipeline: AnyPipeline, steps: int | None) -> int | None:
    """The steps to run: `steps`, else the stream's global batches (one pass over the
    pipeline's epochs), `ENDLESS_STEPS` where it repeats forever, else None (run to the
    end: packed and Grain pipelines)."""
    if steps is not None:
        return steps
    if not pipeline.positional:  # a Grain pipeline's datasets say where it ends
        return None
    if pipeline.total_records is None:
        return ENDLESS_STEPS
    return pipeline.batches_from(0)


def _bar(total: int | None, name: str) -> tqdm:
    return tqdm(total=total, desc=name, unit="step", file=sys.stderr, mininterval=0.5, leave=True)


def run_loader(
    pipeline: AnyPipeline, *, steps: int | None, warmup: int, step_s: float, loader_options: dict[str, Any]
) -> Run:
    """Read `steps` global batches through `cd.Loader`, sleeping `step_s` after each one
    (the simulated training step), with a progress bar, and the data quality
    `QUALITY_SAMPLES` times (after a step, outside the input wait). Ctrl-C ends the run
    early; the loader (its sidecars, workers and shared memory) is closed either way."""
    total = steps_to_run(pipeline, steps)
    every = max(1, total // QUALITY_SAMPLES) if total else 10
    loader = Loader(pipeline, warmup=warmup, **loader_options)
    samples: list[tuple[int, Quality]] = []
    try:
        count = 0
        with _Interrupted() as stop, _bar(total, "colo-data") as bar:
            for batch in loader:
                jax.block_until_ready(batch)
                if step_s:
                    time.sleep(step_s)  # the simulated training step
                count += 1
                bar.update()
                if count % every == 0:
                    samples.append((count, loader.telemetry().quality))
                if count == total or stop.hit:
                    break
    finally:
        with _Shielded():
            loader.close()  # also takes the last CPU samples
    return Run("colo-data", loader.telemetry(), loader.step_trace(), stop.hit, quality=samples)


def run_grain(pipeline: AnyPipeline, *, steps: int | None, warmup: int, step_s: float) -> Run:
    """The Grain equivalent, timed the same way at the trainer: each batch put on the
    devices (batch dimension sharded over all of them, as the Loader's default)."""
    total = steps_to_run(pipeline, steps)
    clock = StepClock(warmup)
    loader, notes = grain_loader(pipeline)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    shardings: dict[int, NamedSharding] = {}
    iterator: Iterator[dict[str, np.ndarray]] | None = None
    try:
        with _Interrupted() as stop, _bar(total, "Grain") as bar:
            iterator = iter(loader)
            while clock.count != total and not stop.hit:
                start = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                placed = {
                    name: jax.device_put(a, shardings.setdefault(a.ndim, NamedSharding(mesh, PartitionSpec("data"))))
                    for name, a in batch.items()
                }
                jax.block_until_ready(placed)
                done = time.perf_counter()
                clock.batch_bytes = clock.batch_bytes or sum(a.nbytes for a in batch.values())
                clock.record(start, done, pipeline.global_batch_size)
                if step_s:
                    time.sleep(step_s)
                bar.update()
    finally:
        with _Shielded():
            del iterator  # Grain stops its worker processes when its iterator is collected
            gc.collect()
    telemetry = summarize(
        backend="grain",
        clock=clock,
        prefetch=0,
        queue_depth_known=False,
        handoff=[0.0] * 3 * len(STAGES),
        handoff_at_warmup=None,
        infos=[],
        now=[],
        at_warmup_hosts=None,
        shared_thread=False,
    )
    return Run("Grain", telemetry, StepTrace.of(clock), stop.hit, notes)
