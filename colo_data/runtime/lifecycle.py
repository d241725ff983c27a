"""`Lifecycle`: the one owner of everything a loader starts (threads, worker processes,
sidecar processes and their sockets, shared-memory readers). Each part registers how to
stop it; `close()` stops them newest first within one deadline (parts registered with
`first`, such as a connection that a thread of a newer part reads, before the others, so
that the thread is not waited for while what would wake it stays open), and runs exactly once:
when the user calls it, when the loader becomes unreachable (`weakref.finalize`), or at
interpreter exit, before JAX, XLA and Arrow tear down their own threads. The parts belong
to the process that made the lifecycle: a forked child's exit (or close) stops none of them.

Why exit matters: a daemon thread that is inside C++ (an XLA transfer, an Arrow
decode) when the interpreter finalises is killed by CPython with a forced
unwind through C++ frames that do not allow it, and the process aborts (SIGABRT). The
exit hook closes every live lifecycle first, so no thread of ours is left running.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Literal

from colo_data.runtime import process

State = Literal["new", "running", "closed"]
Stop = Callable[[float], object]
DEFAULT_TIMEOUT_S = 10.0

_live: dict[int, Lifecycle] = {}
_live_lock = threading.Lock()
_ids = itertools.count()


def _close_all_at_exit() -> None:
    """Close every lifecycle still open: the interpreter is about to finalise."""
    with _live_lock:
        owners = list(_live.values())
    for owner in reversed(owners):
        owner.close()


process.at_exit(_close_all_at_exit, first=True)


class Lifecycle:
    """Stops what was registered with `add`, newest first, in `close(timeout)`.

    Args:
        name: what owns it, for messages (e.g. "Loader(backend='sidecar')").
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._id = next(_ids)
        self._pid = os.getpid()  # the process whose parts these are
        self._lock = threading.RLock()
        self._parts: dict[int, tuple[str, Stop, bool]] = {}
        self._keys = itertools.count()
        self._state: State = "new"
        self._parent: tuple[Lifecycle, int] | None = None
        with _live_lock:
            _live[self._id] = self
        process.run_first_at_exit()  # before the hooks of what started since (JAX's backends, Ray)

    @property
    def state(self) -> State:
        """`new` (nothing started yet), `running` (parts registered) or `closed` (final)."""
        return self._state

    def add(self, what: str, stop: Stop, first: bool = False) -> int:
        """Register a part; returns a key for `discard`. A part added after `close()` is
        stopped at once (a thread that raced the close).

        Args:
            what: the part, for messages ("prefetch thread", "sidecar pid 123").
            stop: stops it within the seconds it is given; must be safe to call twice.
            first: stop it before the parts without `first`: for a part whose stop is
                instant and wakes threads of newer parts (closing a connection they read).
        """
        with self._lock:
            if self._state != "closed":
                key = next(self._keys)
                self._parts[key] = (what, stop, first)
                self._state = "running"
                return key
        stop(DEFAULT_TIMEOUT_S)
        return -1

    def discard(self, key: int) -> None:
        """Forget a part that stopped by itself (its stop will not be called)."""
        with self._lock:
            self._parts.pop(key, None)

    def child(self, name: str) -> Lifecycle:
        """A lifecycle of its own for a shorter-lived group of parts (one run of a loader,
        one sidecar session), stopped with this one if it is still open then."""
        child = Lifecycle(name)
        key = self.add(name, child.close)
        child._parent = (self, key)
        return child

    def close(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
        """Stop every part and close for good; a second call does nothing. Returns the parts
        that did not stop within `timeout` seconds (empty when all did). In a forked child
        (its exit hook runs this) nothing is stopped: the sidecar, its socket directory,
        the worker processes and their sockets are the parent's, which goes on using them,
        and the parent's threads are not in the child.

        Args:
            timeout: seconds for all parts together.
        """
        if os.getpid() != self._pid:  # before the lock, which a thread of the parent may have held at the fork
            return []
        with self._lock:
            if self._state == "closed":
                return []
            self._state = "closed"
            parts = sorted(reversed(self._parts.values()), key=lambda part: not part[2])  # newest first, `first` ones before
            self._parts.clear()
        deadline = time.monotonic() + timeout
        late = []
        for what, stop, _ in parts:
            try:
                stop(max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - one part failing to stop must not keep the others running
                late.append(f"{what} ({e})")
        with _live_lock:
            _live.pop(self._id, None)
        if self._parent is not None:
            parent, key = self._parent
            parent.discard(key)
        return late


def join_thread(thread: threading.Thread, timeout: float) -> None:
    """Join `thread` within `timeout` seconds, unless it is the calling thread (a finalizer
    that runs on one of the owner's own threads must not wait for itself); TimeoutError if
    it is still running then."""
    if thread is threading.current_thread() or thread.ident is None:
        return
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"thread {thread.name} still running after {timeout:.1f} s")
