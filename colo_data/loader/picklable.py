"""`check_picklable`: a pipeline that its backend sends to other processes (a sidecar, the
colocated hosts, worker processes or Ray actors) with cloudpickle is checked when the
`Loader` is made, so that a part that cannot be pickled is a `ConfigError` naming it before
anything starts, not a failure at the first batch or when the workers start, maybe hundreds
of batches in."""

from __future__ import annotations

import dataclasses

import cloudpickle

from colo_data.backends.options import BackendOptions
from colo_data.errors import ConfigError
from colo_data.pipeline.kinds import AnyPipeline


def _shipped_to(pipeline: AnyPipeline, backend: BackendOptions) -> str | None:
    """Where `backend` sends `pipeline` pickled (with cloudpickle), or None: a sidecar and a
    colocated host always get it; worker processes and Ray actors a positional pipeline's
    work (a Grain pipeline's parallelism is its own)."""
    if backend.ships_to is not None:
        return backend.ships_to
    if backend.workers != 0 and pipeline.positional:
        return "its worker processes"
    return None


def _unpicklable(value: object, path: str) -> tuple[str, object, Exception] | None:
    """The innermost part of `value` (through dataclass fields and tuple or list items)
    that cloudpickle cannot pickle, with its path from `path` and the error; None when
    `value` pickles."""
    try:
        cloudpickle.dumps(value)
        return None
    except Exception as e:  # noqa: BLE001 - whatever pickling raises is the reason to report
        error = e
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = [(f"{path}.{f.name}" if path else f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, tuple | list):
        inner = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    else:
        inner = []
    return next((found for part, item in inner if (found := _unpicklable(item, part)) is not None), (path, value, error))


def _named(value: object) -> str:
    """A function or object as a user finds it in their code: its name and where it is defined."""
    function = getattr(value, "func", value)  # a functools.partial: the function it wraps
    code = getattr(function, "__code__", None)
    name = getattr(function, "__qualname__", type(function).__qualname__)
    where = f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{'partial of ' if function is not value else ''}{name}{where}"


def check_picklable(pipeline: AnyPipeline, backend: BackendOptions) -> None:
    """A ConfigError, before anything starts, for a pipeline that the backend must pickle
    and that cannot be pickled: otherwise it fails at the first batch (a sidecar) or when
    the workers start, maybe hundreds of batches in."""
    where = _shipped_to(pipeline, backend)
    found = None if where is None else _unpicklable(pipeline, "")
    if found is None:
        return
    path, value, error = found
    raise ConfigError(
        f"{path or 'the pipeline'} ({_named(value)}) cannot be pickled, and backend={backend!r} sends the pipeline to "
        f"{where} with cloudpickle: {type(error).__name__}: {error}. Define the function at module level or import it "
        "from a module (a lambda or nested function is pickled by value, with everything it captures), and capture no "
        "lock, open file, socket or thread in it (open or make them inside the function); or run the pipeline in this "
        "process: backend=cd.InProcess(workers=0)"
    )
