"""The partitions a pipeline gets when it names none (`colo_data.pipeline.native.default_partitions`):
an endless pipeline is partitioned from its own settings alone, so that each host computes
about its share of every batch, with the batches the same on every host count; finite
pipelines and padded mixtures keep one partition; a state saved with one partition
continues with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
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
