"""Data-quality counters: what the host pipelines made of the records. Each host counts its
own rows where it builds them (never from the global arrays), as sums and fixed-bucket
histograms that add up over worker processes, sidecars and hosts, so that a fleet's numbers
are the sum of its hosts' and its percentiles come from the merged histogram.
`QualityCounts` is the host side; `quality` turns merged counts into the `Quality` of
`Telemetry.quality`, and `mixture_shares` adds a mixture's shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

PACKED, PADDED = "packed", "padded"  # a column of `cd.Pack` rows, of `cd.pad_or_truncate` rows
KEEP = "keep"  # the key of the filter's verdicts, and the reason of the records it drops
# Token-length buckets by their top (inclusive): one a length up to 32, then 16 a doubling,
# each at most 1/16 of its lengths wide, up to 2**24; one more bucket holds longer records.
# Every power of two is a top, so the Prometheus buckets (`le` a power of two) are exact.
TOPS = np.unique(np.r_[np.arange(33), [2**k + j * 2 ** (k - 4) for k in range(5, 24) for j in range(16)], 2**24])
POWERS = tuple(2**k for k in range(25))
ROWS, RECORDS, TOKENS, TRUNCATED, LENGTH_SUM, HISTOGRAM = range(6)  # a column's counts, the histogram last
QUANTILES = (0.5, 0.9, 0.99)


def length_buckets(lengths: np.ndarray) -> np.ndarray:
    """Records of each token-length bucket (`TOPS`, then one for longer ones)."""
    return np.bincount(np.searchsorted(TOPS, lengths), minlength=len(TOPS) + 1)


class QualityCounts:
    """Cumulative data-quality counts of a host (or of a worker's share of a chunk), by key:
    each packed or padded column (`"packed 1024 tokens"`: kind, row length, name) has its
    rows, records, the tokens they hold, records truncated, the records' total length as
    read and their `length_buckets`; a filter (`"keep"`) has the records it judged and
    those it kept. An int64 array a key: cheap to add to, copy, pickle and send, as
    `StageTimes` are (about 25 us a chunk of 512 records on the 2-core development machine,
    the histogram vectorised; a 2.7 KiB array a column in a sidecar's slot announcement).

    Args:
        values: counts to start from (another `QualityCounts.values`); None starts empty.
    """

    __slots__ = ("values",)

    def __init__(self, values: Mapping[str, np.ndarray] | None = None) -> None:
        self.values: dict[str, np.ndarray] = {}
        if values:
            self.merge(values)

    def column(self, kind: str, name: str, length: int, lengths: np.ndarray, rows: int) -> None:
        """Count `rows` rows of `length` tokens of column `name` (`kind`: `PACKED` or
        `PADDED`) holding records of `lengths` tokens (as read: a record longer than
        `length` kept its first `length` tokens)."""
        key = f"{kind} {length} {name}"
        counts = self.values.get(key)
        if counts is None:
            counts = self.values[key] = np.zeros(HISTOGRAM + len(TOPS) + 1, np.int64)
        lengths = np.asarray(lengths, np.int64)
        counts[:HISTOGRAM] += (rows, len(lengths), np.minimum(lengths, length).sum(), (lengths > length).sum(), lengths.sum())
        counts[HISTOGRAM:] += length_buckets(lengths)

    def judged(self, records: int, kept: int) -> None:
        """Count a filter's verdicts on `records` records, `kept` of them kept."""
        counts = self.values.get(KEEP)
        if counts is None:
            counts = self.values[KEEP] = np.zeros(2, np.int64)
        counts += (records, kept)

    def merge(self, values: Mapping[str, np.ndarray]) -> None:
        """Add other counts (a worker's chunk, a sidecar's, another host's)."""
        for key, counts in list(values.items()):
            mine = self.values.get(key)
            if mine is None:
                self.values[key] = np.array(counts, np.int64)
            else:
                mine += counts

    def snapshot(self) -> dict[str, np.ndarray]:
        """A copy, safe to take while another thread counts."""
        return {key: counts.copy() for key, counts in list(self.values.items())}


def difference(now: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The counts added between two snapshots."""
    return {key: counts - before[key] if key in before else counts.copy() for key, counts in now.items()}


@dataclass(frozen=True)
class ColumnQuality:
    """A packed (`cd.Pack`) or padded (`cd.pad_or_truncate`) column over the batches made
    so far: its `rows` of `length` tokens, the `records` in them, the share of its token
    places that hold their tokens (`fill`; the rest is padding, `padding_share`), the
    records longer than `length` that kept only their first tokens (`truncated`), and the
    records' lengths as read: p50/p90/p99 from the histogram (each the top of its bucket:
    exact up to 32 tokens, at most 1/16 above beyond), their sum, and for each power of two
    the records of at most that many tokens (`length_buckets`, for Prometheus)."""

    column: str
    kind: str
    length: int
    rows: int
    records: int
    tokens: int
    fill: float
    padding_share: float
    truncated: int
    length_p50: int
    length_p90: int
    length_p99: int
    length_sum: int
    length_buckets: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Lost:
    """Records dropped or truncated for one `reason`: `keep` (the pipeline's or the pack's
    `keep` rejected them: dropped), or `longer than N` (records of `column` longer than its
    row or pad length N that kept their first N tokens: truncated)."""

    reason: str
    records: int
    column: str = ""


@dataclass(frozen=True)
class ComponentShare:
    """A mixture component's records since the loader started, their share of all the
    mixture's records, and the component's weight (normalised, as the schedule rounds it)."""

    component: str
    records: int
    share: float
    weight: float


@dataclass(frozen=True)
class Quality:
    """What the batches are made of, counted on the hosts as they make them (so a few
    prefetched batches ahead of the trainer), since the loader started: each packed or
    padded column (`columns`), the filter's verdicts (`judged` records, `kept`, and
    `keep_rate`, None without a filter), the records `dropped` and `truncated` by reason,
    and a mixture's component shares against their weights (`mixture`)."""

    columns: tuple[ColumnQuality, ...] = ()
    judged: int = 0
    kept: int = 0
    keep_rate: float | None = None
    dropped: tuple[Lost, ...] = ()
    truncated: tuple[Lost, ...] = ()
    mixture: tuple[ComponentShare, ...] = ()


def _quantile(cumulative: np.ndarray, q: float) -> int:
    """The top of the bucket holding the smallest length with at least `q` of the records
    at or below it (0 with no records)."""
    if not cumulative[-1]:
        return 0
    i = int(np.searchsorted(cumulative, q * cumulative[-1] - 1e-9))
    return int(TOPS[min(i, len(TOPS) - 1)])


def _column(key: str, counts: np.ndarray) -> ColumnQuality:
    kind, length_text, name = key.split(" ", 2)
    length = int(length_text)
    rows, records, tokens, truncated, length_sum = (int(c) for c in counts[:HISTOGRAM])
    cumulative = np.cumsum(counts[HISTOGRAM:])
    fill = tokens / (rows * length) if rows else 0.0
    at_powers = np.searchsorted(TOPS, POWERS)
    p50, p90, p99 = (_quantile(cumulative, q) for q in QUANTILES)
    return ColumnQuality(
        column=name,
        kind=kind,
        length=length,
        rows=rows,
        records=records,
        tokens=tokens,
        fill=fill,
        padding_share=1.0 - fill if rows else 0.0,
        truncated=truncated,
        length_p50=p50,
        length_p90=p90,
        length_p99=p99,
        length_sum=length_sum,
        length_buckets=tuple((power, int(cumulative[i])) for power, i in zip(POWERS, at_powers.tolist(), strict=True)),
    )


def quality(values: Mapping[str, np.ndarray]) -> Quality:
    """The `Quality` of merged counts (every host's `QualityCounts.values` added up)."""
    columns = tuple(_column(key, counts) for key, counts in sorted(values.items()) if key != KEEP)
    judged, kept = (int(c) for c in values.get(KEEP, (0, 0)))
    return Quality(
        columns=columns,
        judged=judged,
        kept=kept,
        keep_rate=kept / judged if judged else None,
        dropped=(Lost(KEEP, judged - kept),) if KEEP in values else (),
        truncated=tuple(Lost(f"longer than {c.length}", c.truncated, c.column) for c in columns),
    )


def mixture_shares(counts: Mapping[str, int], slots: Sequence[int]) -> tuple[ComponentShare, ...]:
    """Each component's share of a mixture's records (`counts`, by name, in the mixture's
    order) against its weight (`slots`: its slots of the schedule's period)."""
    total, period = sum(counts.values()), sum(slots)
    return tuple(
        ComponentShare(name, records, records / total if total else 0.0, share / period)
        for (name, records), share in zip(counts.items(), slots, strict=True)
    )
