"""An endless padded pipeline that names no partitions is partitioned by the same rule as a
packed one (`colo_data.pipeline.native.default_partitions`), so that host h of H reads
about 1/H of the row groups: its batches are the same on every host count and backend, a
state resumes exactly on any of them (through the sidecar and colocated backends:
tests/test_partitioned.py), and, since a padded partition takes its own records in turn
whatever its rows a batch, at any batch size its partitions divide
(`Partitioning.origin`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipelines import assert_state_refused, make_pipeline

import colo_data as cd
from colo_data import demo
from colo_data.host.host_pipeline import HostPipeline
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all

pytestmark = pytest.mark.unit


def endless(corpus: Path, **overrides) -> cd.Pipeline:
    """The tests' padded pipeline, repeating forever, no partitions named."""
    return make_pipeline(corpus, **{"epochs": None, **overrides})


def rows_of(batches: list[dict[str, np.ndarray]], partitions: int) -> list[list[int]]:
    """Each partition's records, batch after batch (partition k is rows [k*R, (k+1)*R) of
    every batch of R * partitions rows)."""
    own: list[list[int]] = [[] for _ in range(partitions)]
    for batch in batches:
        for k, rows in enumerate(np.split(np.asarray(batch["_index"]).ravel(), partitions)):
            own[k].extend(rows.tolist())
    return own


def test_an_endless_padded_pipeline_chooses_partitions_and_a_host_reads_its_share(
    token_corpus: Path, tmp_path: Path
) -> None:
    """Batches of 12: 12 partitions, the same batches on every host count that divides 12.
    Over row groups of 8 in shuffle windows of 4, each host of 4 decodes its own row group
    of each window: the 4 hosts together decode what one host decodes (with one partition,
    every host decodes every row group its rows fall in: all of them)."""
    pipeline = endless(token_corpus)
    assert pipeline.partitions is None and pipeline.partitioning.partitions == 12
    expected = read_all(cd.Loader(pipeline), 10)
    seen = np.concatenate([b["_index"] for b in expected]).tolist()
    assert sorted(seen) == list(range(120)), "12 partitions of 10 records: their epochs end together, at batch 10"
    for hosts in (2, 3, 4, 6, 12):
        assert_batches_equal(expected, read_all(cd.Loader(pipeline, hosts=hosts), 10), f"{hosts} hosts")

    even = demo.write_corpus(tmp_path, files=4, rows_per_file=48, row_group_size=8)

    def decoded(partitions: int | None, host: int, hosts: int) -> int:
        p = endless(even, order=cd.Order(shuffle="block", seed=5, window=4), partitions=partitions)
        for _ in zip(HostPipeline(p, host, hosts).chunks(0, batches=1), range(10), strict=False):
            pass
        return int(p.source.read_stats()[5])

    chosen, one = (sum(decoded(p, h, 4) for h in range(4)) / decoded(p, 0, 1) for p in (None, 1))
    assert chosen <= 1.3, f"the chosen partitions: 4 hosts decode {chosen:.2f}x one host's row groups"
    assert 3.0 <= one <= 4.0, f"one partition: 4 hosts decode {one:.2f}x one host's row groups"


def test_a_state_resumes_across_host_counts(token_corpus: Path) -> None:
    """Under the global shuffle too, saved on 3 hosts and resumed on 1 and 4."""
    pipeline = endless(token_corpus, order=cd.Order(shuffle="global", seed=3))
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=3),
        lambda k, state: cd.Loader(pipeline, hosts=(1, 4)[k % 2], state=state),
        steps=6,
    )


def test_a_state_resumes_at_any_batch_size_its_partitions_divide(token_corpus: Path) -> None:
    """Saved after 5 batches of 12 (60 records, 5 each of 12 partitions), resumed in
    batches of 24 (from position 60, which batches of 24 do not reach: the
    partitions turn from there), then saved and resumed again on another host count: each
    partition's records go on exactly where they stood, as one loader at 12 reads them. A
    batch size the 12 partitions do not divide is a StateError that names them, and so is a
    position they cannot have taken evenly."""
    pipeline = endless(token_corpus)
    straight = rows_of(read_all(cd.Loader(pipeline), 5 + 2 * 6), 12)
    with cd.Loader(pipeline) as loader:
        first = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(5)]
        state = json.loads(json.dumps(loader.get_state()))
    bigger = endless(token_corpus, global_batch_size=24)
    assert bigger.partitioning.partitions == 12
    with cd.Loader(bigger, hosts=2, state=state) as loader:
        assert loader.pipeline.partition_origin == 60 % 24
        middle = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(3)]
        later = json.loads(json.dumps(loader.get_state()))
    last = read_all(cd.Loader(bigger, hosts=4, state=later), 3)
    got = [a + b + c for a, b, c in zip(rows_of(first, 12), rows_of(middle, 12), rows_of(last, 12), strict=True)]
    assert got == straight
    with pytest.raises(cd.errors.StateError, match=r"saved with 12 partitions .* do not divide global_batch_size=8"):
        cd.Loader(endless(token_corpus, global_batch_size=8), state=state)
    crafted = {**state, "position": state["position"] + 1}  # at no batch boundary of the 12 partitions
    with pytest.raises(cd.errors.StateError, match=r"position 61, which its 12 partitions cannot have taken evenly"):
        cd.Loader(bigger, state=crafted)


def test_a_state_saved_with_one_partition_continues_with_it(token_corpus: Path) -> None:
    """A padded state saved before the pipeline chose partitions (one partition) continues
    the stream of one partition, as `partitions=1` does."""
    one = endless(token_corpus, partitions=1)
    with cd.Loader(one) as loader:
        next(loader)
        state = loader.get_state()
    assert state["order"] == "block:2"
    with cd.Loader(endless(token_corpus), state=state) as loader:
        assert loader.pipeline.partitions == 1
        got = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(4)]
    assert_batches_equal(read_all(cd.Loader(one, state=state), 4), got, "one partition")


def test_set_state_from_another_batch_size_says_to_make_a_new_loader(token_corpus: Path) -> None:
    """A running loader cannot jump to a state whose partitions turn from elsewhere."""
    with cd.Loader(endless(token_corpus)) as loader:
        for _ in range(5):
            next(loader)
        state = loader.get_state()
    with cd.Loader(endless(token_corpus, global_batch_size=24)) as loader:
        next(loader)
        message = r"partitions saved at another batch size.*cd.Loader\(pipeline, state=state"
        with pytest.raises(cd.errors.StateError, match=message):
            loader.set_state(state)
        loader.set_state(loader.get_state())  # its own state continues in place


def test_a_state_whose_order_names_no_partitions_is_a_state_error(token_corpus: Path) -> None:
    """A state whose order names 0 partitions, made up or damaged, is a StateError that
    names its order and says what to pass, in `Loader(state=)`, `set_state`, `cd.skip` and
    `cd.lineage`: where the pipeline chooses its partitions it divided by them (a raw
    ZeroDivisionError), and where it names them the message said to give it partitions=0.
    A pipeline that chooses its partitions refuses 0 rows a batch too (one that names them
    continues a padded state at any rows a batch, so it does not read them)."""
    with cd.Loader(endless(token_corpus)) as loader:
        next(loader)
        state = loader.get_state()
    assert state["order"] == "block:2/12x1 dealt"
    choosing, naming = endless(token_corpus), endless(token_corpus, partitions=12)
    cases = [
        (pipeline, order, f"{count} partitions of 1 rows")
        for pipeline in (choosing, naming)
        for order, count in (("block:2/0x1 dealt", "0"), ("block:2/00x1 dealt", "00"))
    ]
    for pipeline, order, named in [*cases, (choosing, "block:2/12x0 dealt", "12 partitions of 0 rows")]:
        match = rf"the loader state's order '{order}' names {named} a batch.*damaged or made up.*Loader.get_state\(\)"
        assert_state_refused(pipeline, {**state, "order": order}, match)


def test_a_partition_origin_given_by_hand_is_refused_where_the_stream_before_it_is_read(token_corpus: Path) -> None:
    """`partition_origin` is a restore's, and the stream before it is not the pipeline's.
    Given by hand (16 or 48, batches of 64 in 16 partitions), a loader's first batch and
    `cd.lineage` from the stream's start are a ConfigError that names it, where numpy's
    seeding raised a raw ValueError (a packed pipeline's loader refuses it when made); one
    at the batch size or past it is refused when the pipeline is made. A pipeline restored
    at another batch size reads on from its state, and refuses the stream's start alike."""
    for origin in (16, 48):
        pipeline = endless(token_corpus, global_batch_size=64, partitions=16, partition_origin=origin)
        match = rf"partition_origin={origin}: position 0 comes before it.*give partition_origin=0"
        with cd.Loader(pipeline) as loader, pytest.raises(cd.errors.ConfigError, match=match):
            next(loader)
        with pytest.raises(cd.errors.ConfigError, match=match):
            cd.lineage(pipeline, None, steps=range(0, 1))
        packed = endless(
            token_corpus, global_batch_size=64, partitions=16, partition_origin=origin, transforms=[], pack=cd.Pack("tokens", 16)
        )
        with pytest.raises(cd.errors.ConfigError, match=match):
            cd.Loader(packed)
    for origin in (64, 128):
        with pytest.raises(cd.errors.ConfigError, match=rf"partition_origin={origin}: a restore sets it.*leave it 0"):
            endless(token_corpus, global_batch_size=64, partitions=16, partition_origin=origin)
    with cd.Loader(endless(token_corpus)) as loader:
        next(loader)
        state = loader.get_state()
    with cd.Loader(endless(token_corpus, global_batch_size=24), state=state) as loader:
        restored = loader.pipeline
        assert restored.partition_origin == 12
        next(loader)
    with pytest.raises(cd.errors.ConfigError, match=r"partition_origin=12: position 0 comes before it"):
        cd.lineage(restored, None, steps=range(0, 1))
