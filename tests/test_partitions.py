"""Partitions of the stream (`cd.Pipeline(partitions=P)`): partition k is rows
`[k*B/P, (k+1)*B/P)` of every global batch, and the `block` and `global` orders give each
partition its own slice of every window's records, so that host h of H (H dividing P) reads
only its partitions' row groups. Each partition runs through epochs of its own, together
a permutation of the records; one partition is the
plain order; the batches do not depend on the host or worker count; a state records the
partitions and resumes exactly on any host count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pipelines import BATCH, backend_of, make_pipeline, row_groups_decoded

import colo_data as cd
from colo_data.pipeline.order import Partitioning
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all

SIZES = [37, 0, 50, 50, 13, 64, 64, 64, 1, 40, 50, 50, 29, 47, 64, 30]  # 16 row groups, one empty


@pytest.mark.parametrize("shuffle", ["block", "global"])
@pytest.mark.parametrize("partitions, rows", [(2, 8), (4, 1), (16, 3), (64, 1)])
def test_every_epoch_is_a_permutation(shuffle: str, partitions: int, rows: int) -> None:
    bound = cd.Order(shuffle, seed=11, window=4).bind(np.array(SIZES), Partitioning(partitions, rows))
    n = sum(SIZES)
    for epoch in range(3):
        got = bound.indices(epoch, np.arange(n))
        np.testing.assert_array_equal(np.sort(got), np.arange(n))
        some = np.array([5, n - 1, 0, 300, 17])  # any positions, in any order: the same records
        np.testing.assert_array_equal(bound.indices(epoch, some), got[some])
    positions = np.arange(2 * n + 3 * partitions * rows)
    records, epochs = bound.indices_at(positions), bound.epochs_at(positions)
    for epoch in (0, 1):  # each partition in epochs of its own, together each record once
        np.testing.assert_array_equal(np.sort(records[epochs == epoch]), np.arange(n))


@pytest.mark.parametrize("shuffle", ["none", "block", "global"])
def test_one_partition_is_the_plain_order(shuffle: str) -> None:
    """One partition is the order without partitions; file order is file order with any."""
    plain = cd.Order(shuffle, seed=5, window=3).bind(np.array(SIZES))
    one = cd.Order(shuffle, seed=5, window=3).bind(np.array(SIZES), Partitioning(1, 12))
    positions = np.arange(3 * sum(SIZES))
    np.testing.assert_array_equal(plain.indices_at(positions), one.indices_at(positions))
    many = cd.Order(shuffle, seed=5, window=3).bind(np.array(SIZES), Partitioning(4, 3)).indices_at(positions)
    assert np.array_equal(many, plain.indices_at(positions)) == (shuffle == "none")


def _groups_per_host(partitions: int, shuffle: str, hosts: int, batch: int = 48) -> list[set[tuple[int, int]]]:
    """The (epoch window, row group) pairs each host's rows read over an epoch."""
    sizes = np.full(64, 50)  # 64 row groups of 50 records; windows of 8
    bound = cd.Order(shuffle, seed=3, window=8).bind(sizes, Partitioning(partitions, batch // partitions))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    n = int(starts[-1])
    per_host = batch // hosts
    out = []
    for h in range(hosts):
        positions = (np.arange(n // batch)[:, None] * batch + h * per_host + np.arange(per_host)).ravel()
        groups = np.searchsorted(starts, bound.indices_at(positions), side="right") - 1
        windows = positions // (8 * 50) if shuffle == "block" else np.zeros_like(positions)
        out.append(set(zip(windows.tolist(), groups.tolist(), strict=True)))
    return out


@pytest.mark.parametrize("shuffle", ["block", "global"])
def test_a_host_reads_its_own_row_groups(shuffle: str) -> None:
    """With 4 to 48 partitions, the 4 hosts' rows of an epoch fall in a quarter of the row
    groups each, none read by two hosts: each partition takes its even slice of every window
    (of 8 row groups: 2 a host), whatever the batch's rows make of the window's stream
    positions. Windows that do not split at row-group boundaries cost at most a row group
    more per host boundary. With one partition every host's rows fall in every row group."""
    total = 64
    for partitions in (48, 12, 4):
        read = sum(len({g for _, g in host}) for host in _groups_per_host(partitions, shuffle, 4))
        assert read == total, f"{partitions} partitions: the 4 hosts read {read} row groups of {total}"
    uneven = sum(len({g for _, g in host}) for host in _groups_per_host(48, shuffle, 3))  # 400 records a window: 133.3 a host
    windows = 8 if shuffle == "block" else 1
    assert total < uneven <= total + 2 * windows, f"3 hosts: {uneven} row groups of {total}"
    plain = sum(len({g for _, g in host}) for host in _groups_per_host(1, shuffle, 4))
    assert plain >= 3.5 * total, f"one partition: the 4 hosts read {plain} row groups of {total}"


@pytest.mark.parametrize("shuffle", ["block", "global"])
def test_batches_are_the_same_for_every_host_and_worker_count(token_corpus: Path, shuffle: str) -> None:
    pipeline = make_pipeline(token_corpus, shuffle, partitions=BATCH, epochs=2)
    expected = read_all(cd.Loader(pipeline))
    assert len(expected) == 2 * 120 // BATCH
    for epoch in (expected[:10], expected[10:]):  # every record once an epoch
        np.testing.assert_array_equal(np.sort(np.concatenate([b["_index"] for b in epoch])), np.arange(120))
    for hosts, workers in ((2, 0), (3, 0), (4, 1), (12, 0)):
        got = read_all(cd.Loader(pipeline, hosts=hosts, backend=cd.InProcess(workers=workers)))
        assert_batches_equal(expected, got, f"{shuffle}, {hosts} hosts, {workers} workers")
    four = make_pipeline(token_corpus, shuffle, partitions=4, epochs=2)  # 3 hosts: a host holds parts of partitions
    assert_batches_equal(read_all(cd.Loader(four)), read_all(cd.Loader(four, hosts=3)), f"{shuffle}, 4 partitions, 3 hosts")
    plain = read_all(cd.Loader(make_pipeline(token_corpus, shuffle, epochs=2)))
    assert any(not np.array_equal(a["_index"], b["_index"]) for a, b in zip(expected, plain, strict=True))


def test_a_finite_stream_ends_with_the_shortest_partitions_epochs(tmp_path: Path) -> None:
    """130 records in 4 partitions: two run through epochs of 33 records, two of 32. Three
    epochs are 96 batches of 4 rows (the shortest partitions' 3 x 32 records), where 390
    records would make 97: every record comes twice or three times, the 6 left out are
    the longer partitions' last of their third epoch, and 2 and 4 hosts read the same."""
    ids = np.arange(130)
    pq.write_table(pa.table({"id": ids, "tokens": pa.array([[int(i)] for i in ids], pa.list_(pa.int32()))}), tmp_path / "d.parquet", row_group_size=10)
    for shuffle in ("block", "global"):
        pipeline = make_pipeline(tmp_path, shuffle, global_batch_size=4, partitions=4, epochs=3, transforms=[cd.pad_or_truncate("tokens", 1)])
        assert pipeline.batches_from(0) == 96
        batches = read_all(cd.Loader(pipeline))
        assert len(batches) == 96
        counts = np.bincount(np.concatenate([b["_index"] for b in batches]), minlength=130)
        assert counts.min() == 2 and counts.max() == 3 and (counts == 2).sum() == 6, shuffle
        for hosts in (2, 4):
            assert_batches_equal(batches, read_all(cd.Loader(pipeline, hosts=hosts)), f"{shuffle}, {hosts} hosts")


def test_a_state_resumes_on_other_host_counts_and_names_the_partitions(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "block", partitions=4, epochs=None)
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=1),
        lambda k, state: cd.Loader(pipeline, hosts=(2, 4)[k % 2], state=state),
        steps=12,
    )
    with cd.Loader(make_pipeline(token_corpus, "block", epochs=None, partitions=1)) as loader:
        next(loader)
        unpartitioned = loader.get_state()
    with pytest.raises(cd.errors.StateError, match=r"order: state has 'block:2', pipeline has 'block:2/4x3 dealt'.*partitions=1"):
        cd.Loader(pipeline, state=unpartitioned)
    with cd.Loader(pipeline) as loader:
        next(loader)
        state = loader.get_state()
    assert state["order"] == "block:2/4x3 dealt"
    state["order"] = "block:2/4x3"  # as saved before partitions had epochs of their own: other records
    with pytest.raises(cd.errors.StateError, match=r"shared each shuffle window by global position.*'block:2/4x3 dealt'"):
        cd.Loader(pipeline, state=state)
    state["order"] = "block:2/4x3 own"  # as saved while a partition's windows fell on other row groups each epoch
    with pytest.raises(cd.errors.StateError, match=r"other row groups every epoch.*same row groups \('block:2/4x3 dealt'\).*colo-data that saved it"):
        cd.Loader(pipeline, state=state)


def test_partitions_must_divide_the_batch(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"partitions=5: give a divisor of global_batch_size=12"):
        make_pipeline(token_corpus, partitions=5)


def test_each_host_process_decodes_its_share_of_the_row_groups(tmp_path: Path) -> None:
    """Each of 4 host pipelines with a source of its own (as in a process of its own)
    decodes, over an epoch of a block shuffle, a quarter of the row groups with a partition
    per batch row, though a window (800 records) is not a whole number of batches (64 rows):
    each partition takes its slice of the window; every row group with one partition."""
    ids = np.arange(6400)
    table = pa.table({"id": ids, "tokens": pa.array([[int(i)] * 3 for i in ids], pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=100)  # 64 row groups

    def decoded(partitions: int) -> int:
        pipeline = cd.Pipeline(
            source=cd.ArrowSource(str(tmp_path / "data.parquet")),
            order=cd.Order(shuffle="block", seed=1, window=8),
            transforms=[cd.pad_or_truncate("tokens", 3)],
            global_batch_size=64,
            partitions=partitions,
        )
        return row_groups_decoded(pipeline, 4)

    assert decoded(64) == 64, decoded(64)
    assert decoded(1) >= 3.5 * 64, decoded(1)


@pytest.mark.parametrize("backend", ["sidecar", "colocated"])
def test_every_backend_gives_the_same_batches(token_corpus: Path, backend: str) -> None:
    """4 hosts through sidecars (a process each, a source each) and through the colocated
    backend read the one-host batches of a partitioned pipeline."""
    pipeline = make_pipeline(token_corpus, "block", partitions=BATCH)
    expected = read_all(cd.Loader(pipeline))
    assert_batches_equal(expected, read_all(cd.Loader(pipeline, hosts=4, backend=backend_of(backend))), backend)


def test_a_thousand_and_twenty_four_hosts_make_the_one_host_batches() -> None:
    """Hosts 0..1023 of a 1,024-host job over the 8 files of the demo corpus, one row a
    batch each and a partition each: their rows, put together, are the one-host batches,
    block and global shuffle."""
    from colo_data import demo
    from colo_data.host.chunk_work import ChunkWork

    source = cd.ArrowSource(demo.corpus(), columns=["id", "tokens"])
    assert len(source.files) == 8
    for shuffle in ("block", "global"):
        pipeline = cd.Pipeline(
            source=source,
            order=cd.Order(shuffle=shuffle, seed=4),
            transforms=[cd.pad_or_truncate("tokens", 4)],
            global_batch_size=1024,
            index_column="_index",
            partitions=1024,
        )
        start = 37 * 1024  # the epoch's last batches and the next epoch's first
        one = ChunkWork(pipeline).compute(start, 3).columns
        hosts = [ChunkWork(pipeline, h, 1024).compute(start, 3).columns for h in range(1024)]
        for name in one:
            together = np.stack([host[name] for host in hosts], axis=1)  # (batch, host, ...)
            np.testing.assert_array_equal(together.reshape(one[name].shape), one[name], err_msg=f"{shuffle}: {name}")
        assert len(np.unique(one["_index"][:1024])) == 1024
