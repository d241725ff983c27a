"""The demo pipeline's pad, as each kind of contender writes it: its settings (`SEQ_LEN`,
`BATCH`), the vectorised numpy pad of the hand-written Arrow references, and Grain's
per-record `PadRecord`. Shared, so that every benchmark's contenders do the same work.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

SEQ_LEN, BATCH = 1024, 32  # the demo pipeline: `tokens` padded or cut to 1024, batches of 32


def numpy_pad(offsets: np.ndarray, values: np.ndarray, length: int) -> np.ndarray:
    """Pad/truncate every list of a row group at once: one 2-D take and one select."""
    starts, lengths = offsets[:-1].astype(np.int64), np.diff(offsets)
    steps = np.arange(length)
    taken = np.take(values, starts[:, None] + steps[None, :], mode="clip")
    return np.where(steps[None, :] < lengths[:, None], taken, 0)


class PadRecord(grain.transforms.Map):
    """Grain's per-record pad: one record's `tokens` padded or cut to `SEQ_LEN`."""

    def map(self, record: dict[str, Any]) -> dict[str, Any]:
        tokens = np.zeros(SEQ_LEN, dtype=np.int32)
        row = np.asarray(record["tokens"][:SEQ_LEN], dtype=np.int32)
        tokens[: len(row)] = row
        return {"id": record["id"], "tokens": tokens}
