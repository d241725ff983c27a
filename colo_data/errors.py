"""The colo-data exception types: every message names the file, column or setting at
fault and says what to do, so that a user never has to read a traceback to act."""

import re
import traceback


class ColoDataError(Exception):
    """Base class of every error colo-data raises on purpose."""


class SourceError(ColoDataError):
    """A data file or path cannot be used: nothing matches, unreadable, wrong format."""


class CorruptFileError(SourceError):
    """A file's metadata or a row group cannot be decoded; the message names both."""


class ResourceError(ColoDataError):
    """The process ran out of a resource while reading (file descriptors, memory): the
    data is fine; the message names the limit and what to change."""


class SchemaError(SourceError):
    """Requested columns are missing, or files disagree on a column's type."""


class StaleIndexError(SourceError):
    """A dataset index that the files no longer match (one added, removed or changed since
    it was written), or that cannot be read: write it again with `colo-data index`."""


class RecordIndexError(SourceError, IndexError):
    """A global record index outside `[0, len(source))`."""


class ConfigError(ColoDataError, ValueError):
    """An impossible setting: the message names the setting and the values allowed."""


class ArgumentError(ConfigError, TypeError):
    """A keyword argument that `Loader` does not take: a removed one names its replacement.
    Also a `TypeError`, which is what Python raises for an unknown keyword."""


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


# One way for every error that crosses a boundary (a worker process, a sidecar, a colocated
# host): it travels as text (`to_wire`) and is raised on this side as the same colo-data
# type, or the boundary's default, with where it was raised and its traceback (`from_wire`).
# A Pathways controller gets only an error's text: `named_in` finds the type in it.
_ERROR_NAME = re.compile(r"\b([A-Z]\w*Error)\b")


def _error_type(name: str | None) -> type[ColoDataError] | None:
    """The colo-data error class called `name`, or None."""
    found = globals().get(name or "")
    return found if isinstance(found, type) and issubclass(found, ColoDataError) else None


def to_wire(e: BaseException) -> dict[str, str]:
    """`e` as plain text to send across a process boundary: its message, type name and traceback."""
    return {"error": str(e), "type": type(e).__name__, "traceback": "".join(traceback.format_exception(e))}


def from_wire(wire: dict[str, str], where: str, default: type[ColoDataError]) -> ColoDataError:
    """The error that `to_wire` sent, as the same colo-data type (any other exception:
    `default`), its message followed by where it was raised and its traceback.

    Args:
        wire: what `to_wire` made (a "traceback" may be empty).
        where: where it was raised, e.g. "a worker process".
        default: the type of an error that is not colo-data's own.
    """
    text = f"{wire['error']}\n--- raised in {where} ---"
    if wire.get("traceback"):
        text += f"\n{wire['traceback']}"
    return (_error_type(wire.get("type")) or default)(text)


def named_in(text: str) -> str | None:
    """The last colo-data error type that `text` names (`from_wire`'s type for an error
    that arrives as text only), or None."""
    return next((name for name in reversed(_ERROR_NAME.findall(text)) if _error_type(name)), None)
