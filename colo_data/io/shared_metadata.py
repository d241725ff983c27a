"""Metadata read once per job: in a `jax.distributed` job of several processes, process 0
lists a source's files and reads their metadata (or their dataset index), and the other
processes take its result from JAX's distributed key-value store, so that the requests a
job makes at start-up do not grow with its process count (1,000 hosts each reading 10,000
footers would be 10 million requests to one bucket in the same minute). Every process must
make the same sources in the same order, as every other step of such a job."""

from __future__ import annotations

import hashlib
import pickle
import sys
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from colo_data.errors import SourceError, from_wire, to_wire

WAIT_S = 600.0  # how long a process waits for process 0's metadata (10,000 objects at 100 ms: about a minute)
_made: Counter[str] = Counter()  # sources made so far in this process, by what they read
T = TypeVar("T")


def _client() -> tuple[Any, int, int] | None:
    """JAX's distributed client, this process's id and the process count, in a job of two
    or more processes; None otherwise (JAX is never imported here for it)."""
    if "jax" not in sys.modules:
        return None
    from jax._src import distributed  # the client that jax.distributed.initialize made; no public accessor

    state = distributed.global_state
    if state.client is None or (state.num_processes or 1) < 2:
        return None
    return state.client, int(state.process_id), int(state.num_processes)


def read_once(what: str, key: str, read: Callable[[], T]) -> T:
    """`read()` in process 0 of a `jax.distributed` job, its result (or its error) handed to
    every other process; in a process alone, `read()`.

    Args:
        what: what is read, for a message (the source's paths).
        key: the same in every process for the same source (its filesystem, paths, columns).
        read: makes the value; it and its errors must pickle.

    Raises:
        SourceError: process 0 did not publish the metadata within `WAIT_S` seconds; or its
            error, as the same colo-data type.
    """
    joined = _client()
    if joined is None:
        return read()
    client, process, processes = joined
    _made[key] += 1
    name = f"colo_data/metadata/{hashlib.sha256(key.encode()).hexdigest()[:16]}/{_made[key]}"
    if process == 0:
        try:
            value = read()
        except Exception as e:
            client.key_value_set_bytes(name, _packed("error", to_wire(e)))
            raise
        client.key_value_set_bytes(name, _packed("value", value))  # 10,000 files: 0.8 MB pickled, 29 kB compressed
        return value
    try:
        blob = client.blocking_key_value_get_bytes(name, int(WAIT_S * 1000))
    except Exception as e:
        raise SourceError(
            f"process {process} of {processes} waited {WAIT_S:.0f} s for process 0 to read the metadata of {what} "
            f"({type(e).__name__}: {e}). In a jax.distributed job process 0 reads it for all: every process "
            "must make the same sources in the same order; process 0's log says whether it failed."
        ) from e
    kind, value = pickle.loads(zlib.decompress(blob))
    if kind == "error":
        raise from_wire(value, "process 0 of the jax.distributed job, reading the metadata for every process", SourceError)
    return value


def _packed(kind: str, value: object) -> bytes:
    """What the other processes read: `(kind, value)` pickled and compressed (the files'
    paths repeat their directories)."""
    return zlib.compress(pickle.dumps((kind, value)))
