"""The pipeline kinds a `Loader` runs: a native `Pipeline` (every chunk a pure function of
position) and a `GrainPipeline` (a user's own Grain dataset per host)."""

from __future__ import annotations

from colo_data.spec.grain_pipeline import GrainPipeline
from colo_data.spec.pipeline import Pipeline

AnyPipeline = Pipeline | GrainPipeline
