"""`cd.RayWorkers` where the workers package names it, beside the pool that uses it
(`ray_pool.RayPool`). The options are defined in `colo_data.host.ray_workers`, in the layer
of the host's resources, which read them from a `--workers` spec."""

from colo_data.host.ray_workers import RayWorkers

__all__ = ["RayWorkers"]
