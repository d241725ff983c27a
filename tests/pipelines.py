"""The test pipeline over the small token corpus: 120 records in uneven row groups,
block-shuffled in windows of 2 row groups, tokens padded to 8, with the record index."""

from __future__ import annotations

from pathlib import Path

import colo_data as cd

BATCH = 12  # divisible by 1, 2, 3 and 4 hosts and by the 4 test devices
MIX_SIZES = {"web": 60, "code": 25, "math": 7}  # the mixture tests' components; math: fewer records than a batch


def make_pipeline(corpus: Path, shuffle: str = "block", **overrides) -> cd.Pipeline:
    settings = dict(
        source=cd.ArrowSource(str(corpus), columns=["id", "tokens"]),
        order=cd.Order(shuffle=shuffle, seed=7, window=2),
        transforms=[cd.pad_or_truncate("tokens", 8)],
        global_batch_size=BATCH,
        index_column="_index",
    )
    settings.update(overrides)
    return cd.Pipeline(**settings)


def backend_of(name: str, workers: int = 0, shm_dir: Path | str | None = None) -> cd.InProcess | cd.Sidecar | cd.Colocated:
    """The backend called `name` with `workers` worker processes (a sidecar's ring in
    `shm_dir`, if given)."""
    if name == "sidecar":
        return cd.Sidecar(workers=workers, **({"shm_dir": str(shm_dir)} if shm_dir is not None else {}))
    return cd.InProcess(workers=workers) if name == "inprocess" else cd.Colocated(workers=workers)
