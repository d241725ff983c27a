"""The colo-data exception types: every message names the file, column or setting at
fault and says what to do, so that a user never has to read a traceback to act."""

import pickle
import re
import traceback
from typing import TypedDict

__all__ = [  # `cd.errors`: the exception types; the rest carries errors across boundaries
    "ColoDataError",
    "SourceError",
    "CorruptFileError",
    "SchemaError",
    "StaleIndexError",
    "RecordIndexError",
    "ResourceError",
    "ConfigError",
    "StateError",
    "TransformError",
    "GrainError",
    "ShmError",
    "SidecarError",
    "RayClusterError",
    "LoaderClosedError",
    "LoaderBusyError",
    "RemoteError",
]


class ColoDataError(Exception):
    """Base class of every error colo-data raises on purpose."""


class SourceError(ColoDataError):
    """A data file or path cannot be used: nothing matches, unreadable, wrong format."""


class CorruptFileError(SourceError):
    """A file's metadata or a row group cannot be decoded; the message names both."""


class ResourceError(ColoDataError):
    """The process ran out of a resource while reading (file descriptors, memory), or of
    disk room for a dataset index: the data is fine; the message names the limit and what
    to change."""


class SchemaError(SourceError):
    """Requested columns are missing, or files disagree on a column's type."""


class StaleIndexError(SourceError):
    """A dataset index that the files no longer match (one added, removed or changed since
    it was written), or that cannot be read: write it again with `colo-data index`."""


class RecordIndexError(SourceError, IndexError):
    """A global record index outside `[0, len(source))`."""


class ConfigError(ColoDataError, ValueError):
    """An impossible setting: the message names the setting and the values allowed."""


class StateError(ColoDataError, ValueError):
    """A saved loader state that does not belong to this pipeline or format version."""


class TransformError(ColoDataError):
    """A transform failed or returned something that cannot become a batch."""


class GrainError(ColoDataError):
    """A user's Grain dataset failed (in `make_dataset` or while iterated) or gave elements
    that cannot become host batches; the message names the host and what to change."""


class ShmError(ColoDataError):
    """The shared-memory directory cannot hold the ring, or a segment is missing."""


class SidecarError(ColoDataError):
    """A sidecar is unreachable or died; the message says where and what to check."""


class RayClusterError(ColoDataError):
    """`cd.RayWorkers`' Ray cluster is unreachable, lost, or runs another Ray or Python
    version; the message names the address and what to check."""


class LoaderClosedError(ColoDataError, RuntimeError):
    """`next()` or `set_state()` on a closed `Loader`: make a new one from its state."""


class LoaderBusyError(ColoDataError, RuntimeError):
    """`next()` on a `Loader` that another thread is reading: a loader feeds one consumer
    (two would each get some of the batches, or wait on each other)."""


class RemoteError(Exception):
    """Stands in for an exception raised across a boundary whose class cannot be rebuilt
    here (it does not pickle, or does not unpickle): its text names the original type and
    holds its message."""


class Wire(TypedDict):
    """An exception as it crosses a boundary (`to_wire`, `from_wire`)."""

    type: str  # the colo-data type's name, or the exception's own type name
    error: str  # its message
    traceback: str  # where the exception beneath was raised (or this one, if none is), once; may be empty
    cause: bytes | None  # the exception beneath, cloudpickled; None: there is none, or it does not pickle
    cause_text: str  # its qualified type name and message, for a stand-in where it cannot be rebuilt ("": none)


# One way for every error that crosses a boundary (a worker process, a sidecar, a colocated
# host): `to_wire` sends the type as a field, the message, the exception beneath it (the
# user's, or the library's that colo-data wrapped) pickled, and that exception's traceback
# once; `from_wire` raises the same colo-data type here (any other exception: the boundary's
# default), with the exception beneath as its `__cause__` carrying that traceback as a note.
# A Pathways controller gets only an error's text: `named_in` finds the type in it there.
_ERROR_NAME = re.compile(r"\b([A-Z]\w*Error)\b")


def _error_type(name: str | None) -> type[ColoDataError] | None:
    """The colo-data error class called `name`, or None."""
    found = globals().get(name or "")
    return found if isinstance(found, type) and issubclass(found, ColoDataError) else None


def _beneath(e: BaseException) -> BaseException | None:
    """The exception that `e` is about: `e` itself if it is not colo-data's own, else the
    first of its causes that is not (None: colo-data's all the way down)."""
    found: BaseException | None = e
    while isinstance(found, ColoDataError):
        found = found.__cause__
    return found


def _traceback(e: BaseException) -> str:
    """`e`'s traceback (its own causes and context included) without its closing
    "Type: message" lines, which travel apart; empty for an exception never raised."""
    shown = traceback.TracebackException.from_exception(e)
    lines = list(shown.format())
    return "".join(lines[: len(lines) - len(list(shown.format_exception_only()))])


def _qualified(kind: type) -> str:
    """A type's name as a traceback writes it: module and qualified name, but builtins'."""
    return kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"


def to_wire(e: BaseException) -> Wire:
    """`e` as plain data to send across a process boundary (`Wire`)."""
    import cloudpickle  # noqa: PLC0415 - only when an error crosses a boundary (0.1 s to import)

    beneath = _beneath(e)
    try:
        pickled = None if beneath is None else cloudpickle.dumps(beneath)
    except Exception:  # e.g. it holds a lock or an open file: a stand-in names it
        pickled = None
    return {
        "type": type(e).__name__,
        "error": str(e),
        "traceback": _traceback(e if beneath is None else beneath),
        "cause": pickled,
        "cause_text": "" if beneath is None else f"{_qualified(type(beneath))}: {beneath}",
    }


def _rebuilt(wire: Wire) -> BaseException | None:
    """The exception beneath the sent one, unpickled, or a `RemoteError` naming it where it
    does not unpickle (a class with required arguments, or one this process cannot import)."""
    if not wire["cause_text"]:
        return None
    if wire["cause"] is not None:
        try:
            cause = pickle.loads(wire["cause"])
        except Exception:
            cause = None
        if isinstance(cause, BaseException):
            return cause
    return RemoteError(wire["cause_text"])


def from_wire(wire: Wire, where: str, default: type[ColoDataError]) -> ColoDataError:
    """The error that `to_wire` sent, as the same colo-data type (any other exception:
    `default`, its message led by the exception's type), saying where it was raised. The
    exception beneath is its `__cause__`; the remote traceback is a note on that cause (on
    the error itself when there is none), so that it is printed once. Whatever this side
    was handling when it raised the error is not part of its story: it is not shown.

    Args:
        wire: what `to_wire` made.
        where: where it was raised, e.g. "a worker process".
        default: the type of an error that is not colo-data's own.
    """
    kind = _error_type(wire["type"])
    text = wire["error"] if kind is not None else f"{wire['type']}: {wire['error']}"
    error = (kind or default)(f"{text}\n--- raised in {where} ---")
    cause = _rebuilt(wire)
    if wire["traceback"]:
        (cause or error).add_note(f"--- its traceback, in {where} ---\n{wire['traceback'].rstrip()}")
    error.__cause__ = cause
    error.__suppress_context__ = True
    return error


def named_in(text: str) -> str | None:
    """The last colo-data error type that `text` names, or None. Only for an error that
    arrives as nothing but text (a Pathways controller's view of a colocated host's
    failure); everywhere else the type travels as a field (`to_wire`)."""
    return next((name for name in reversed(_ERROR_NAME.findall(text)) if _error_type(name)), None)
