"""The colo-data exception types: every message names the file, column or setting at
fault and says what to do, so that a user never has to read a traceback to act."""


class ColoDataError(Exception):
    """Base class of every error colo-data raises on purpose."""


class SourceError(ColoDataError):
    """A data file or path cannot be used: nothing matches, unreadable, wrong format."""


class CorruptFileError(SourceError):
    """A file's metadata or a row group cannot be decoded; the message names both."""


class SchemaError(SourceError):
    """Requested columns are missing, or files disagree on a column's type."""


class RecordIndexError(SourceError, IndexError):
    """A global record index outside `[0, len(source))`."""


class ConfigError(ColoDataError, ValueError):
    """An impossible setting: the message names the setting and the values allowed."""


class StateError(ColoDataError, ValueError):
    """A saved loader state that does not belong to this pipeline or format version."""


class TransformError(ColoDataError):
    """A transform failed or returned something that cannot become a batch."""


class ShmError(ColoDataError):
    """The shared-memory directory cannot hold the ring, or a segment is missing."""


class SidecarError(ColoDataError):
    """A sidecar is unreachable or died; the message says where and what to check."""


class LoaderClosedError(ColoDataError, RuntimeError):
    """`next()` or `set_state()` on a closed `Loader`: make a new one from its state."""


class LoaderBusyError(ColoDataError, RuntimeError):
    """`next()` on a `Loader` that another thread is reading: a loader feeds one consumer
    (two would each get some of the batches, or wait on each other)."""
