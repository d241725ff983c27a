"""Record filtering (`cd.Pipeline(keep=...)`) with exact positions: a global batch is the
next `global_batch_size` records of the stream that `keep` accepts, every column kept; the
rejected ones in between are consumed, never placed. Every host evaluates `keep` on the
whole batch's records (H hosts H times) to agree on where the batch ends, and builds only
its own rows; the batch's end is a position like any other, so a state restores on
any host count."""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter
from typing import NoReturn

import numpy as np
import pyarrow as pa

from colo_data.errors import TransformError
from colo_data.host.chunk import HostBatch
from colo_data.host.chunk_work import ChunkWork
from colo_data.io.columns import Columns, table_to_columns
from colo_data.io.record_source import ReadAhead
from colo_data.telemetry.counters import ORDER, READ

READ_RECORDS = 512  # records read at once, at least a global batch's
# Records in a row that `keep` may reject, none accepted, before an endless stream is refused
# (or two epochs' records, if fewer: two epochs in a row hold every record); of a partitioned
# stream, those a host reads of all its partitions together, however many they are. A filter
# that accepts one record in 10,000 rejects this many in a row with a chance of about e**-100.
REJECTED_RECORDS = 1_000_000


def kept(work: ChunkWork, columns: Columns, rows: int) -> np.ndarray | None:
    """`keep`'s verdict on `rows` records (the pipeline's and, packed, the pack's: a record
    must pass both); None when there is no filter. A verdict is a bool: anything else (the
    string "False", NaN, a null) is a TransformError, where truthiness would keep it."""
    pipeline, verdict = work.pipeline, None
    for where, keep in (("cd.Pipeline", pipeline.keep), ("cd.Pack", getattr(pipeline.pack, "keep", None))):
        if keep is None:
            continue
        got = np.asarray(keep(columns))
        if got.shape != (rows,):
            raise TransformError(f"{where} keep={keep!r} returned shape {got.shape} for {rows} records; give one bool a record")
        if got.dtype != np.bool_ and rows:
            raise TransformError(
                f"{where} keep={keep!r} returned {got.dtype} values for {rows} records (the first: {got[:3].tolist()!r}); "
                "give one bool a record: a numpy bool array (`column > 0`, say), a list of bools or a pyarrow boolean "
                "array without nulls. Other values are not read as verdicts: the string 'False' and NaN would be true"
            )
        got = got.astype(bool, copy=False)  # no records: `np.array([])` of none is float64
        verdict = got if verdict is None else verdict & got
    return verdict


def filters(work: ChunkWork) -> bool:
    """Whether the pipeline has a `keep` (its own or its pack's)."""
    return work.pipeline.keep is not None or getattr(work.pipeline.pack, "keep", None) is not None


def count_verdicts(work: ChunkWork, accepted: np.ndarray) -> None:
    """Count `keep`'s verdicts on the records a global batch consumed (`accepted`, in stream
    order), which every host has: each counts its own slice of them, so that the hosts'
    counts add up to the batch's."""
    count, host, hosts = len(accepted), work.host, work.hosts
    mine = accepted[count * host // hosts : count * (host + 1) // hosts]
    work.quality.judged(len(mine), int(mine.sum()))


def rejected_run(verdict: np.ndarray, before: int) -> int:
    """Records rejected in a row at the end of `verdict`, following `before` rejected ones."""
    accepted = np.flatnonzero(verdict)
    return before + len(verdict) if not len(accepted) else len(verdict) - 1 - int(accepted[-1])


def check_accepting(work: ChunkWork, rejected: int, where: str) -> None:
    """A TransformError when `keep` has rejected `rejected` records in a row of an endless
    stream (`where`: which), `REJECTED_RECORDS` or two epochs' records: it would read on
    forever (and a packing window grow with it)."""
    if refused(work, rejected):
        refuse(work, rejected, f"of {where}")


def check_partitions_accepting(work: ChunkWork, rejected: int, partitions: np.ndarray, read: np.ndarray) -> None:
    """`check_accepting` for partitions read together (their global numbers `partitions`,
    read up to their own positions `read`): `rejected` counts the records that all of them
    read in a row, so that one limit holds whatever their number. Counted a partition at
    a time, 256 partitions (a batch of 4,096) read 256 times one partition's records before
    the error."""
    if not refused(work, rejected):
        return
    count, first, last, low, high = len(partitions), int(partitions[0]), int(partitions[-1]), int(read.min()), int(read.max())
    if count == 1:
        where = f"partition {first}, up to its own position {high:,}"
    else:
        at = f"each up to its own position {low:,}" if low == high else f"up to their own positions {low:,} to {high:,}"
        where = f"partitions {first} {'and' if count == 2 else 'to'} {last}, {at}"
    refuse(work, rejected, f"read in all, over {count} partition{'s' * (count > 1)} ({where})")


def refused(work: ChunkWork, rejected: int) -> bool:
    """Whether `rejected` records in a row are too many: an endless stream's `rejection_limit`."""
    return work.pipeline.epochs is None and rejected >= rejection_limit(work)


def rejection_limit(work: ChunkWork) -> int:
    """Records `keep` may reject in a row of an endless stream: `REJECTED_RECORDS` or two
    epochs' records (which hold every record), the smaller."""
    return min(REJECTED_RECORDS, 2 * work.pipeline.records_per_epoch)


def refuse(work: ChunkWork, rejected: int, records: str) -> NoReturn:
    """The TransformError of a `keep` that accepted none of `rejected` `records` in a row."""
    pipeline = work.pipeline
    keeps = [
        f"{owner}(keep={getattr(keep, '__qualname__', repr(keep))})"
        for owner, keep in (("cd.Pipeline", pipeline.keep), ("cd.Pack", getattr(pipeline.pack, "keep", None)))
        if keep is not None
    ]
    raise TransformError(
        f"{' and '.join(keeps)} accepted none of the last {rejected:,} records {records}: an endless stream would read "
        f"on forever. The limit is {rejection_limit(work):,} records in a row, the smaller of "
        f"colo_data.host.filtering.REJECTED_RECORDS ({REJECTED_RECORDS:,}) and two epochs' records (which hold every "
        "record). Check the filter on some of the source's records; one that accepts fewer than one record in 10,000 is "
        "better applied once, writing the records it accepts to files of their own"
    )


def with_index(work: ChunkWork, table: pa.Table, indices: np.ndarray) -> pa.Table:
    """The records read, with the pipeline's index column (from a `cd.Mix`: the index
    within the component, and the component column), as the transforms see them."""
    pipeline = work.pipeline
    for name, column in pipeline.stream.record_columns(indices, pipeline.index_column).items():
        table = table.append_column(name, pa.array(column))
    return table


def filtered_batches(work: ChunkWork, start_position: int) -> Iterator[tuple[HostBatch, int]]:
    """Host `work.host`'s rows of each filtered global batch from `start_position`
    on, transformed, with the position after the batch. A trailing batch of fewer
    accepted records than a global batch is dropped, as an unfiltered stream's is. Only the
    accepted records are kept between reads; in an endless stream, a `keep` that rejects
    too many records in a row is a TransformError (`check_accepting`)."""
    pipeline = work.pipeline
    size, first_row, stop_row = pipeline.global_batch_size, work.rows.start, work.rows.stop
    total = pipeline.total_records
    position, read = start_position, start_position  # the batch's first position; the first not read yet
    tables: list[pa.Table] = []  # the accepted records read, in stream order
    places: list[np.ndarray] = []  # their positions
    rejected = 0  # records rejected in a row, up to the last read
    while True:
        have = sum(len(p) for p in places)
        if have < size:
            stop = read + max(READ_RECORDS, size) if total is None else min(read + max(READ_RECORDS, size), total)
            if stop <= read:
                return
            table = _read(work, read, stop, total)
            verdict = verdict_of(work, table)
            tables.append(table.filter(pa.array(verdict)))
            places.append(read + np.flatnonzero(verdict))
            read = stop
            rejected = rejected_run(verdict, rejected)
            check_accepting(work, rejected, f"the stream, up to position {read}")
            continue
        window, at = pa.concat_tables(tables) if len(tables) > 1 else tables[0], np.concatenate(places)
        positions = at[first_row:stop_row]
        keys = work.order.record_keys(positions, work.indices_at(positions)) if work.draws else None
        mine = table_to_columns(window.slice(first_row, stop_row - first_row))
        end = int(at[size - 1]) + 1
        accepted = np.zeros(end - position, bool)
        accepted[at[:size] - position] = True
        count_verdicts(work, accepted)
        yield work.transformed(mine, position, keys=keys), end
        position = end
        tables, places = [window.slice(size)], [at[size:]]


def _read(work: ChunkWork, first: int, stop: int, total: int | None) -> pa.Table:
    """Positions `[first, stop)`'s records with the index columns, the read after
    them started (a source that reads ahead)."""
    ahead = stop + (stop - first) if total is None else min(stop + (stop - first), total)
    return read_at(work, np.arange(first, stop, dtype=np.int64), np.arange(stop, ahead, dtype=np.int64))


def read_at(work: ChunkWork, positions: np.ndarray, ahead: np.ndarray) -> pa.Table:
    """The records at positions `positions` with the index columns; a source that reads
    ahead starts on `ahead`'s meanwhile."""
    indices, table = taken(work, positions, ahead)
    return with_index(work, table, indices)


def taken(work: ChunkWork, positions: np.ndarray, ahead: np.ndarray) -> tuple[np.ndarray, pa.Table]:
    """The record indices at positions `positions` and their records, read (the order
    and read stages counted); a source that reads ahead starts on `ahead`'s meanwhile."""
    t0 = perf_counter()
    indices = work.indices_at(positions)
    t1 = perf_counter()
    source = work.pipeline.source
    if isinstance(source, ReadAhead) and len(ahead):  # the next read's row groups decode meanwhile
        source.prefetch(work.indices_at(ahead))
    table = source.take(indices)
    work.stages.add(ORDER, t1 - t0, len(indices), indices.nbytes)
    work.stages.add(READ, perf_counter() - t1, len(indices), table.nbytes)
    work.count_reads(work.stages)
    return indices, table


def verdict_of(work: ChunkWork, table: pa.Table) -> np.ndarray:
    """`keep`'s verdict on the records of `table` (the pipeline has a filter)."""
    verdict = kept(work, table_to_columns(table), table.num_rows)
    assert verdict is not None  # filtered batches are made only for a pipeline with a keep
    return verdict
