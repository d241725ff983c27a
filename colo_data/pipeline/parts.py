"""A partitioned pipeline's position: one int64 array, `[phase, own_0, ..., own_{P-1}]`.
`own_k` is where partition k's current packing plan starts in its own stream (filtered:
where its next batch starts); `phase` is how many of the plans' batches have been handed
out (every partition plans the same number of batches at once, so they share it; always 0
for filtered pipelines). A host's share of it is the phase and its own partitions' entries;
-1 marks a partition that another process's hosts own.

In a loader state the own positions are saved as the smallest and each one's distance above
it, in the fewest bytes that hold the largest (byte by byte: the high bytes, mostly equal,
compress), zlib-compressed, base64 text. The positions of a run's partitions stay close
together (each consumes about the same records a batch): 1,024 partitions spread over 300
records take about 1.8 kB, where a JSON list of them takes 10 kB."""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from colo_data.errors import StateError
from colo_data.pipeline.state_format import MAX_POSITION
from colo_data.setting_checks import as_int

_WIDTHS = (1, 2, 4, 8)


def start(own: np.ndarray | Sequence[int], phase: int = 0) -> np.ndarray:
    """The position of partitions at own positions `own`, `phase` batches into their plans."""
    return np.concatenate([[phase], np.asarray(own, dtype=np.int64)]).astype(np.int64)


def share(position: np.ndarray, owned: range) -> tuple[int, np.ndarray]:
    """The phase and the own positions of partitions `owned` (a host's)."""
    return int(position[0]), position[1 + owned.start : 1 + owned.stop]


def joined(phase: int, pieces: dict[int, np.ndarray], partitions: int) -> np.ndarray:
    """The position after a batch from hosts' own positions (first partition -> its
    host's positions): -1 for the partitions no piece holds."""
    out = np.full(1 + partitions, -1, np.int64)
    out[0] = phase
    for first, own in pieces.items():
        out[1 + first : 1 + first + len(own)] = own
    return out


def advance(position: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, int]:
    """`position` moved to a batch's `end` (-1: unknown here, kept), and the records the
    known partitions consumed, scaled to all of them (a multi-controller process sees its
    own hosts' partitions only)."""
    known = np.flatnonzero(end[1:] >= 0) + 1
    records = int((end[known] - position[known]).sum()) * (len(end) - 1) // max(1, len(known))
    moved = position.copy()
    moved[0], moved[known] = end[0], end[known]
    return moved, records


def encode_parts(position: np.ndarray) -> dict[str, Any]:
    """The state's `parts` entry for a partitioned pipeline's `position`."""
    own = np.asarray(position[1:], dtype=np.int64)
    base = int(own.min())
    deltas = own - base
    width = next(w for w in _WIDTHS if int(deltas.max()) < 256**w)
    data = deltas.astype(f"<u{width}").view(np.uint8).reshape(-1, width).T.tobytes()  # byte planes: high bytes compress
    return {
        "count": len(own),
        "phase": int(position[0]),
        "base": base,
        "width": width,
        "deltas": base64.b64encode(zlib.compress(data, 9)).decode(),
    }


def saved_count(parts: Any) -> int | None:
    """The partition count a state's `parts` entry names (None when it names none), read
    before its positions are: they are inflated only for the pipeline's own count."""
    count = parts.get("count") if isinstance(parts, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else None


def decode_parts(parts: Any) -> np.ndarray:
    """The position a state's `parts` entry holds; StateError when it is not one. Its numbers
    must be ints (not floats, which `int()` would take), at most `count` positions' bytes
    are inflated, and every number must fit an int64."""
    try:
        fields = {k: parts[k] for k in ("count", "phase", "base", "width")}
        wrong = [f"{k}={v!r:.40}" for k, v in fields.items() if as_int(v) is None]
        if wrong:  # a float (1e30, inf) or a string is no count of partitions or records
            raise ValueError(f"{', '.join(wrong)}: not an int")
        count, phase, base, width = (int(v) for v in fields.values())
        if width not in _WIDTHS or count < 1 or not 0 <= base <= MAX_POSITION or not 0 <= phase <= MAX_POSITION:
            raise ValueError(f"count={count}, phase={phase}, base={base}, width={width}")
        inflate = zlib.decompressobj()
        data = inflate.decompress(base64.b64decode(parts["deltas"], validate=True), count * width + 1)
        if len(data) != count * width or not inflate.eof:
            raise ValueError(f"more or fewer than the {count * width} bytes of {count} partitions of {width} bytes")
        deltas = np.frombuffer(data, np.uint8).reshape(width, count).T.copy().view(f"<u{width}").ravel()
        if base + int(deltas.max()) > MAX_POSITION:
            raise ValueError(f"a position past 2**62 (base {base}, largest distance {int(deltas.max())})")
    except (KeyError, TypeError, ValueError, binascii.Error, zlib.error) as e:
        raise StateError(
            f"the loader state's partition positions (`parts`) are damaged ({type(e).__name__}: {e}): pass the dict "
            "that Loader.get_state() returned, unchanged"
        ) from None
    return start(base + deltas.astype(np.int64), phase)
