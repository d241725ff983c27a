"""Backends: the option objects a `Loader` takes (`InProcess`, `Sidecar`, `Colocated`) and
the transports behind one `Transport` protocol."""
