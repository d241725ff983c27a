"""The partitions a pipeline gets when it names none (`colo_data.pipeline.native.default_partitions`):
an endless pipeline is partitioned from its own settings alone, so that each host computes
about its share of every batch, with the batches the same on every host count; finite
pipelines and padded mixtures keep one partition; a state saved with one partition
continues with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.host.host_pipeline import HostPipeline
from colo_data.pipeline.native import default_partitions
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all

from pipelines import make_pipeline

pytestmark = pytest.mark.unit


def not_third(columns: dict) -> np.ndarray:
    """Keeps the records whose id is not a multiple of 3."""
    return np.asarray(columns["id"]) % 3 != 0


def packed(corpus: Path, **overrides) -> cd.Pipeline:
    return make_pipeline(corpus, **{"transforms": [], "pack": cd.Pack("tokens", 16), "epochs": None, **overrides})


@pytest.mark.parametrize(
    ("batch", "chosen"), [(7, 7), (12, 12), (16, 16), (64, 16), (96, 16), (100, 10), (256, 16), (512, 32), (1024, 64)]
)
def test_an_endless_packed_pipeline_gets_the_largest_divisor_up_to_the_rule(batch: int, chosen: int) -> None:
    """16 partitions at most up to batches of 256, a partition per 16 rows above; always a
    divisor of the batch. The declared value stays None, so a copy with another batch size
    chooses again."""
    source = [{"id": i, "tokens": np.arange(1 + i % 5, dtype=np.int32)} for i in range(2048)]
    pipeline = cd.Pipeline(source=source, global_batch_size=batch, epochs=None, pack=cd.Pack("tokens", 16))
    assert pipeline.partitioning.partitions == chosen and pipeline.partitioned
    assert pipeline.partitions is None and default_partitions(pipeline) == chosen
    assert dataclasses.replace(pipeline, global_batch_size=24).partitioning.partitions == 12


def test_finite_and_named_pipelines_and_padded_mixtures_keep_their_partitions(
    token_corpus: Path, mix_corpora: dict[str, Path]
) -> None:
    assert make_pipeline(token_corpus, epochs=None).partitioning.partitions == 12  # padded, endless
    assert make_pipeline(token_corpus, epochs=2).partitioning.partitions == 1  # padded, finite
    assert packed(token_corpus, epochs=2).partitioning.partitions == 1  # finite
    sources = {name: cd.ArrowSource(str(path), columns=["id", "tokens"]) for name, path in mix_corpora.items()}
    mixture = cd.Mix(sources, {name: 1.0 for name in sources})
    assert make_pipeline(token_corpus, source=mixture, epochs=None).partitioning.partitions == 1  # padded mixture
    assert packed(token_corpus, source=mixture).partitioning.partitions > 1  # packed mixture
    assert make_pipeline(token_corpus, keep=not_third, epochs=None).partitioning.partitions == 12  # filtered, endless
    assert packed(token_corpus, partitions=1).partitioning.partitions == 1
    assert packed(token_corpus, partitions=4).partitioning.partitions == 4


def test_a_mixture_gets_no_more_than_its_smallest_weighted_component(mix_corpora: dict[str, Path]) -> None:
    from pipelines import MIX_SIZES

    sources = {name: cd.ArrowSource(str(path), columns=["id", "tokens"]) for name, path in mix_corpora.items()}
    smallest = min(MIX_SIZES.values())
    pipeline = cd.Pipeline(
        source=cd.Mix(sources, {name: 1.0 for name in sources}),
        order=cd.Order(shuffle="block", seed=1, window=2),
        global_batch_size=64,
        epochs=None,
        pack=cd.Pack("tokens", 16),
    )
    partitions = pipeline.partitioning.partitions
    assert partitions <= min(16, smallest) and 64 % partitions == 0


def test_default_partitions_give_the_same_batches_on_every_host_count(token_corpus: Path) -> None:
    """The packed pipeline of batch 12 (12 partitions) and the filtered one give the batches of
    one host on 2, 3, 4, 6 and 12 hosts, and a host of 4 computes only its 3 partitions."""
    for pipeline in (packed(token_corpus), make_pipeline(token_corpus, keep=not_third, epochs=None)):
        expected = read_all(cd.Loader(pipeline), 8)
        for hosts in (2, 3, 4, 6, 12):
            assert_batches_equal(expected, read_all(cd.Loader(pipeline, hosts=hosts), 8), f"{hosts} hosts")
        chunk = next(HostPipeline(pipeline, 1, 4).chunks(pipeline.at(0), batches=1))
        assert len(chunk.end) == 1 + 3, "host 1 of 4 computes its 3 partitions of 12 alone"


def test_a_state_resumes_across_host_counts(token_corpus: Path) -> None:
    pipeline = packed(token_corpus)
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=3),
        lambda k, state: cd.Loader(pipeline, hosts=(1, 4)[k % 2], state=state),
        steps=6,
    )


def test_a_state_saved_with_one_partition_continues_with_it(token_corpus: Path) -> None:
    """A state that the pipeline saved before it chose partitions (one partition) continues
    the stream of one partition under a shuffled order (the pipeline it continues with names
    partitions=1); restored into a pipeline that names other partitions it is a StateError
    that says to give partitions=1; under file order a state saved with one
    partition continues with the chosen ones (each partition after its records before the
    saved position: every record once)."""
    with cd.Loader(packed(token_corpus, partitions=1)) as loader:
        next(loader)
        state = loader.get_state()
    with cd.Loader(packed(token_corpus), state=state) as loader:
        assert loader.pipeline.partitions == 1
        batches = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(3)]
    assert_batches_equal(read_all(cd.Loader(packed(token_corpus, partitions=1), state=state), 3), batches, "partitions=1")
    with pytest.raises(cd.errors.StateError, match=r"saved without partitions: give the pipeline partitions=1"):
        cd.Loader(packed(token_corpus, partitions=12), state=state)

    many = [{"id": i, "tokens": np.arange(1 + i % 5, dtype=np.int32)} for i in range(2400)]  # no partition wraps an epoch
    in_file_order = packed(token_corpus, source=many, order=cd.Order(shuffle="none"), partitions=1)
    with cd.Loader(in_file_order) as loader:
        first = np.asarray(next(loader)["_index"]).ravel()
        state = loader.get_state()
    resumed = packed(token_corpus, source=many, order=cd.Order(shuffle="none"))
    later = np.concatenate([np.asarray(b["_index"]).ravel() for b in read_all(cd.Loader(resumed, state=state), 3)])
    seen = first[first >= 0]
    assert not set(seen.tolist()) & set(later[later >= 0].tolist()), "a record came again after the resume"


DOMAINS = {"one domain": (5,), "two domains": (2, 5)}  # the domains (files) a filter keeps, of 8


@pytest.fixture(scope="module")
def domain_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 Parquet files of 64 records, a domain each (`domain`: the file's number; `id`: the
    record's index), in row groups of 16: 32 row groups, 4 windows of the block order."""
    root = tmp_path_factory.mktemp("domains")
    for domain in range(8):
        ids = np.arange(domain * 64, (domain + 1) * 64)
        table = pa.table({"id": ids, "domain": np.full(64, domain, np.int32)})
        pq.write_table(table, root / f"domain-{domain}.parquet", row_group_size=16)
    return root


class InDomains:
    """A filter that follows the files: it keeps the records of some domains."""

    def __init__(self, domains: tuple[int, ...]) -> None:
        self.domains = domains

    def __call__(self, columns: dict) -> np.ndarray:
        return np.isin(np.asarray(columns["domain"]), self.domains)


def on(pipeline: cd.Pipeline, hosts: int = 1, **options) -> cd.Loader:
    """A loader of `pipeline` on `hosts` hosts, in process, without worker processes (the
    order is what these tests check, and a pool's start would cost most of their time)."""
    return cd.Loader(pipeline, backend=cd.InProcess(workers=0), hosts=hosts, **options)


def by_domain(corpus: Path, kept: str, shuffle: str, seed: int, **overrides) -> cd.Pipeline:
    """Batches of 64 of the domain corpus under `shuffle`, keeping the `kept` domains, endless."""
    return cd.Pipeline(
        source=cd.ArrowSource(str(corpus)),
        order=cd.Order(shuffle, seed=seed),
        global_batch_size=64,
        keep=InDomains(DOMAINS[kept]),
        epochs=None,
        **overrides,
    )


@pytest.mark.parametrize("shuffle", ["block", "global"])
@pytest.mark.parametrize("kept", list(DOMAINS))
def test_a_filter_that_follows_the_files_runs_with_the_chosen_partitions(domain_corpus: Path, kept: str, shuffle: str) -> None:
    """A filter that keeps 1 or 2 of 8 files, one domain a file, on batches of 64 (16
    partitions chosen). Partitions of a slice of their own starved here: most slices hold
    no kept record, and the loader stopped at its first batch with a TransformError
    ("accepted none of the last 1,024 records of partition ..."). A filtered pipeline's
    partitions take turns of the one order (`Partitioning.shared`), so each accepts as the
    whole stream does: 3 epochs' batches hold only the kept domains, each kept record about
    once an epoch (3 times, give or take the partitions' paces), the same on 1, 2 and 4
    hosts, with `partitions=16` named too, and a state resumes exactly on other host counts."""
    domains = DOMAINS[kept]
    epochs = 3
    for seed in range(3):
        pipeline = by_domain(domain_corpus, kept, shuffle, seed)
        assert pipeline.partitions is None and pipeline.partitioning.partitions == 16
        expected = read_all(on(pipeline), epochs * len(domains))  # an epoch holds 64 kept records a domain
        ids = np.concatenate([b["id"] for b in expected])
        assert set((ids // 64).tolist()) == set(domains), f"seed {seed}: the kept domains only, each"
        counts = np.bincount(ids, minlength=512)[np.isin(np.arange(512) // 64, domains)]
        assert epochs - 2 <= counts.min() and counts.max() <= epochs + 2, (seed, counts.min(), counts.max())
        for hosts in (2, 4):
            assert_batches_equal(expected, read_all(on(pipeline, hosts), len(expected)), f"{hosts} hosts")
        named = by_domain(domain_corpus, kept, shuffle, seed, partitions=16)
        assert_batches_equal(expected, read_all(on(named, 2), len(expected)), "partitions=16 named")
    assert_resumes_identically(
        lambda: on(pipeline),
        lambda k, state: on(pipeline, (2, 4)[k % 2], state=state),
        steps=4,
    )


def test_a_filtered_state_names_its_shared_partitions(domain_corpus: Path) -> None:
    """A filtered pipeline's state names its partitions `shared` (part of the order, with
    their rows); a state of one position (one partition's) continues with them, each
    partition taking its next kept records of the one order after that position. Restored
    into a pipeline whose partitions read slices of their own, or saved with them (by an
    earlier colo-data), a state is a StateError that says which to give."""
    pipeline = by_domain(domain_corpus, "two domains", "global", 1)
    with on(pipeline) as loader:
        next(loader)
        state = loader.get_state()
    assert state["order"] == "global/16x4 shared" and state["parts"]["count"] == 16
    with on(by_domain(domain_corpus, "two domains", "global", 1, partitions=1)) as loader:
        next(loader)
        one = loader.get_state()
    assert one["order"] == "global" and one["epoch"] == 0 and "parts" not in one
    with on(pipeline, state=one) as loader:
        assert loader.pipeline.partitioning.partitions == 16
        later = np.asarray(next(loader)["id"])
    # partition k's rows: its first 4 kept records at its positions of the one order from the saved one on
    positions = np.arange(one["position"], one["position"] + 2048)
    records = pipeline.stream.bind(pipeline.order).indices_at(positions)  # ids are record indices
    kept = np.isin(records // 64, DOMAINS["two domains"])
    partition = pipeline.partitioning.of(positions)
    expected = np.concatenate([records[kept & (partition == k)][:4] for k in range(16)])
    np.testing.assert_array_equal(later, expected)
    padded = cd.Pipeline(source=pipeline.source, order=pipeline.order, global_batch_size=64, epochs=None, partitions=16)
    with pytest.raises(cd.errors.StateError, match=r"took turns of the one order.*give it the keep= it was saved with"):
        on(padded, state=state)
    older = {**state, "order": "global/16x4 own"}
    with pytest.raises(cd.errors.StateError, match=r"each read a slice of their own.*with the colo-data that saved it"):
        on(pipeline, state=older)
