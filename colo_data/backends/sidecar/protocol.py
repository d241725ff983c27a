"""The sidecar control channel: Python dicts over a Unix socket, framed and pickled by the
standard library's `multiprocessing.connection` (length-prefixed messages, no extra
dependency). Pickles run code, so a connection first passes the key challenge (`auth.py`)
and the socket is owner-only unless configured otherwise. The data itself never
crosses the socket: it sits in shared-memory slots, and messages carry slot numbers and
array layouts.

A connection first gets {"ready": True} once the sidecar serves it, or an error reply when
the sidecar serves another trainer (busy), then:

Messages, trainer -> sidecar:
  {"op": "open", "pipeline": bytes | None, "host": h, "hosts": H, "position": p}
      -> {"rows": r, "names": [...], "shm_dir": str, "slots": n, "workers": w, "workers_chosen": why,
          "remote_workers": bool, "copy_threads": t,
          "batches_per_slot": k, "slot_bytes": b, "budget": {...}}, then, unasked, one
         {"slot": i, "layout": [...], "after": e | None, "states": [...] | None, "stats": {...}} per filled
         slot, in order (the slot holds k batches of r rows one after the other, the session's
         last slot maybe fewer; "after" is the position after its last batch for packed
         pipelines; "states" a Grain pipeline's host state after each of its batches), and
         {"end": True} after the last batch. "stats" are the session's cumulative telemetry
         counters (stage values, CPU sample, ring fill, stage values by worker, data-quality counts,
         the workers at work and why): telemetry without a message of its own
  {"op": "release", "slot": i, "waited": s}   (no answer: the slot may be written again; s: the
         seconds the trainer waited for the slot's announcement, which the worker policy reads)
  {"op": "close"}           -> {"closed": True} (after any announcements still in flight)
Any of these may instead be an error: {"type": class name, "error": message, "traceback": text,
"cause": the exception beneath it, pickled, or None, "cause_text": its type and message}
(`colo_data.errors.Wire`, made by `to_wire`).
While the sidecar works for the trainer (opening, computing a batch) and has sent nothing
for `defaults.HEARTBEAT_S`, it sends {"alive": True}: a trainer that hears nothing at all
for its timeout while it waits knows the sidecar is frozen, not slow.
Announcing filled slots unasked spares the trainer a round trip per batch; the ring's
slot count bounds how far the sidecar runs ahead.
"""

from __future__ import annotations

import os

from colo_data.errors import ConfigError

FAMILY = "AF_UNIX"
SCHEME = "unix://"
SESSION_END_S = 30.0  # a trainer that comes while the last one's session ends waits at most this long for it
MAX_PATH_BYTES = 107  # a Unix socket's path: Linux's sun_path holds 108 bytes with the terminating NUL


def socket_path(address: str) -> str:
    """`unix:///run/colo/host0.sock` or a plain path -> the socket's path."""
    return address[len(SCHEME) :] if address.startswith(SCHEME) else address


def check_path_length(path: str) -> None:
    """Raise ConfigError for a socket path longer than a Unix socket's address can hold
    (the system's own error says only "AF_UNIX path too long")."""
    size = len(os.fsencode(path))
    if size > MAX_PATH_BYTES:
        raise ConfigError(
            f"the sidecar socket path {path} is {size} bytes, longer than the limit of {MAX_PATH_BYTES} bytes "
            f"(108 with the terminating NUL on Linux): choose a shorter path, e.g. /run/colo/host0.sock"
        )
