"""The controller-side `Loader`, its telemetry bookkeeping, Orbax checkpoints and elastic rebuilds."""
