"""What belongs to the whole process, in one place: the one exit hook, which runs what
colo-data registered for the interpreter's exit (closing every live lifecycle, unmapping
shared-memory rings) before JAX, XLA, Arrow and Ray tear down their own threads; and the
connections that the process's loaders share (the Ray connection), counted so that the
last user ends one that colo-data opened.

`atexit` runs the newest hook first, and a library imported or started after colo-data
(JAX's backends, `ray.init`) registers hooks of its own; so the hook is registered again
when a new part starts, but only when another hook has been registered since (each
registration takes a slot of `atexit`'s that is never given back)."""

from __future__ import annotations

import atexit
import itertools
import threading
from collections.abc import Callable

_lock = threading.Lock()
_stops: dict[int, tuple[Callable[[], object], bool]] = {}  # by key, oldest first, with `first`
_keys = itertools.count()
_hooks_seen: int | None = None  # atexit's hook count just after ours was registered last


def at_exit(stop: Callable[[], object], first: bool = False) -> int:
    """Run `stop()` at interpreter exit, before other libraries' exit hooks: the `first`
    ones (closing the live lifecycles, which stops the threads that may still use what the
    others release, such as a shared-memory ring's mappings), then the others, newest
    first. Returns a key for `forget`."""
    with _lock:
        key = next(_keys)
        _stops[key] = (stop, first)
    run_first_at_exit()
    return key


def forget(key: int) -> None:
    """Do not run what `at_exit` registered under `key` (it has been done)."""
    with _lock:
        _stops.pop(key, None)


def run_first_at_exit() -> None:
    """Register the exit hook again if another hook was registered after it, so that it
    runs first: before the hooks of libraries that were started since."""
    global _hooks_seen
    count = getattr(atexit, "_ncallbacks", None)  # CPython's; elsewhere registered every time
    with _lock:
        if count is not None and _hooks_seen == count():
            return
        atexit.unregister(_run_at_exit)
        atexit.register(_run_at_exit)
        _hooks_seen = count() if count is not None else None


def _run_at_exit() -> None:
    """Run every registered stop, the `first` ones first, newest first; one failing does
    not keep the others from running."""
    with _lock:
        stops = sorted(reversed(_stops.values()), key=lambda entry: not entry[1])
        _stops.clear()
    for stop, _ in stops:
        try:
            stop()
        except Exception:  # noqa: BLE001, S110 - at exit there is no one left to tell; the others must still run
            pass


class SharedConnection:
    """A connection that this process's parts share (the Ray connection): the first part
    that needs it opens it, or finds it open (made by the user, who ends it), and the last
    part to let go of one that a part opened ends it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ours = False  # opened by a part (so the last part ends it)
        self._users = 0  # parts using the connection a part opened

    def acquire(self, connect: Callable[[], bool]) -> bool:
        """Use the connection, opening it with `connect()` (which says whether it opened
        it) if needed; whether this use is counted (it is a connection a part opened)."""
        with self._lock:
            self._ours = connect() or self._ours
            self._users += self._ours
            return self._ours

    def release(self, counted: bool, end: Callable[[], None]) -> None:
        """Let go of a use that `acquire` returned; the last counted one calls `end()`."""
        with self._lock:
            self._users -= counted
            if counted and not self._users:
                self._ours = False
                end()


_connections: dict[str, SharedConnection] = {}


def connection(name: str) -> SharedConnection:
    """The process's shared connection called `name` ("ray"), made on first use."""
    with _lock:
        return _connections.setdefault(name, SharedConnection())
