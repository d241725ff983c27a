"""`check_picklable`: a pipeline that its backend sends to other processes (a sidecar, the
colocated hosts, worker processes or Ray actors) with cloudpickle is checked when the
`Loader` is made, so that a part that cannot be pickled is a `ConfigError` naming it before
anything starts, not a failure at the first batch or when the workers start, maybe hundreds
of batches in. In process, `workers="auto"` (the default) only may send it: such a pipeline
runs there on the host's own thread, with a warning that says why."""

from __future__ import annotations

import dataclasses
import warnings

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


def check_picklable(pipeline: AnyPipeline, backend: BackendOptions) -> BackendOptions:
    """The backend to run `pipeline` with: `backend`, or where it would only send the
    pipeline to worker processes as "auto" and the pipeline cannot be pickled, the same with
    no workers (warned). A ConfigError, before anything starts, for a pipeline that the
    backend must pickle and that cannot be pickled: otherwise it fails at the first batch (a
    sidecar) or when the workers start, maybe hundreds of batches in."""
    where = _shipped_to(pipeline, backend)
    found = None if where is None else _unpicklable(pipeline, "")
    if found is None:
        return backend
    path, value, error = found
    fix = (
        "Define the function at module level or import it from a module (a lambda or nested function is pickled by "
        "value, with everything it captures), and capture no lock, open file, socket or thread in it (open or make "
        "them inside the function)"
    )
    what = f"{path or 'the pipeline'} ({_named(value)}) cannot be pickled"
    if backend.ships_to is None and backend.workers == "auto":
        warnings.warn(
            f"{what} ({type(error).__name__}: {error}), so worker processes cannot run it: workers='auto' runs it on the "
            f"host's own thread. {fix}, to let worker processes help; or give backend=cd.InProcess(workers=0)",
            stacklevel=3,
        )
        return dataclasses.replace(backend, workers=0)  # type: ignore[type-var]  # every backend's options are a dataclass
    raise ConfigError(
        f"{what}, and backend={backend!r} sends the pipeline to {where} with cloudpickle: {type(error).__name__}: "
        f"{error}. {fix}; or run the pipeline in this process: backend=cd.InProcess(workers=0)"
    )
