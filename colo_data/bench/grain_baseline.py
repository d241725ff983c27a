"""Grain's own `DataLoader`, the baseline colo-data is measured against: `data_loader` starts
it as a user would, with Grain's default worker count, for `colo-data bench --compare grain`
(`grain_loader`: the same logical pipeline as a colo-data one) and for the scripts in
benchmarks/ alike, so that every comparison runs the same Grain settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from colo_data.errors import ConfigError
from colo_data.host.chunk_work import check_batch
from colo_data.io.columns import from_records
from colo_data.pipeline.kinds import AnyPipeline

GRAIN_DEFAULT_WORKERS = None  # grain.DataLoader(worker_count=None): Grain picks os.cpu_count()


def data_loader(
    source: Any, operations: Sequence[Any], *, shuffle: bool = True, seed: int = 0, epochs: int | None = 1
) -> grain.DataLoader:
    """Grain's `DataLoader` over a random-access `source` as a user starts it: an
    `IndexSampler` (a global shuffle seeded by `seed`, or the source's order; `epochs`
    passes, None: endless), `operations` on its records and batches, and Grain's default
    worker count (`worker_count=None`: os.cpu_count() processes)."""
    return grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(num_records=len(source), shuffle=shuffle, seed=seed, num_epochs=epochs),
        operations=operations,
        worker_count=GRAIN_DEFAULT_WORKERS,
    )


class _Indexed:
    """A record source whose records also carry their index (the pipeline's `index_column`)."""

    def __init__(self, source: Any, index_column: str | None) -> None:
        self.source, self.index_column = source, index_column

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.source[index]
        if self.index_column is not None:
            record[self.index_column] = np.int64(index)
        return record


class _TransformedBatch:
    """Grain's batch function for the pipeline: stack the records into columns, then run
    the pipeline's batch transforms on them, as colo-data does."""

    def __init__(self, transforms: Sequence[Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
        self.transforms = tuple(transforms)

    def __call__(self, records: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
        columns = from_records(records)
        for transform in self.transforms:
            columns = transform(columns)
        return check_batch(columns, len(records))


def grain_loader(pipeline: AnyPipeline) -> tuple[grain.DataLoader, list[str]]:
    """The same logical pipeline with Grain alone: its `DataLoader` over the pipeline's
    random-access source, its own global shuffle, the pipeline's transforms on each batch,
    its default worker count (`worker_count=None`: os.cpu_count())."""
    if not pipeline.positional:
        raise ConfigError(
            "--compare grain: the pipeline is a cd.GrainPipeline, Grain's own already; benchmarks/grain_pipeline.py compares it "
            "iterated in the trainer's process with the sidecar"
        )
    if pipeline.variable_batches:
        raise ConfigError("--compare grain: packed or filtered pipelines (cd.Pack, keep=) have no Grain equivalent here")
    order = pipeline.order
    notes = []
    if order.shuffle == "block":
        notes.append("Grain has no block shuffle: it shuffles globally")
    batch = _TransformedBatch(pipeline.transforms)
    loader = data_loader(
        _Indexed(pipeline.source, pipeline.index_column),
        [grain.transforms.Batch(pipeline.global_batch_size, drop_remainder=True, batch_fn=batch)],
        shuffle=order.shuffle != "none",
        seed=order.seed,
        epochs=pipeline.epochs,
    )
    notes.insert(0, f"DataLoader(worker_count=None): {loader.multiprocessing_options.num_workers} worker processes")
    return loader, notes
