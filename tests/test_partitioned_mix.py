"""Mixtures with partitions (`cd.Pipeline(source=cd.Mix(...), partitions=P)`): each
partition runs the mixture's schedule over its own positions and reads its own partition
of every component (its slice of each window), so a host reads its own row groups of each
component; the global batches do not depend on the host count or the backend, padded,
packed and filtered, and a state resumes exactly on other host counts. Real Parquet
corpora, real loaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipelines import MIX_SIZES, backend_of, row_groups_decoded

import colo_data as cd
from colo_data import demo
from colo_data.pipeline.order import Partitioning
from colo_data.testing import assert_batches_equal, assert_resumes_identically, to_numpy

BATCH, PARTITIONS = 12, 4
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def short(columns: dict) -> np.ndarray:
    """The filter: records of 4 tokens or fewer."""
    return np.array([len(t) <= 4 for t in columns["tokens"].to_pylist()])


def mixture(corpora: dict[str, Path], kind: str = "padded", partitions: int = PARTITIONS, **overrides) -> cd.Pipeline:
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in corpora.items()}
    settings: dict = dict(
        source=cd.Mix(components, overrides.pop("weights", WEIGHTS)),
        order=cd.Order(shuffle=overrides.pop("shuffle", "block"), seed=3, window=2),
        transforms=[cd.pad_or_truncate("tokens", 6)],
        global_batch_size=BATCH,
        epochs=None,
        index_column="_index",
        partitions=partitions,
    )
    if kind == "packed":
        settings.update(transforms=[], pack=cd.Pack("tokens", 12))
    elif kind == "filtered":
        settings.update(keep=short)
    settings.update(overrides)
    return cd.Pipeline(**settings)


def first(loader: cd.Loader, steps: int) -> list[dict[str, np.ndarray]]:
    with loader:
        return [to_numpy(next(loader)) for _ in range(steps)]


@pytest.mark.parametrize("kind", ["padded", "packed", "filtered"])
def test_batches_are_the_same_for_every_host_count(mix_corpora: dict[str, Path], kind: str) -> None:
    pipeline = mixture(mix_corpora, kind)
    expected = first(cd.Loader(pipeline), 12)
    for hosts in (2, 4):
        assert_batches_equal(expected, first(cd.Loader(pipeline, hosts=hosts), 12), f"{kind}, {hosts} hosts")
    if kind == "padded":  # 3 hosts do not divide the partitions: they share some partitions' slices
        assert_batches_equal(expected, first(cd.Loader(pipeline, hosts=3), 12), "padded, 3 hosts")


def test_each_batch_keeps_the_weights_and_each_partition_its_components_epochs(mix_corpora: dict[str, Path]) -> None:
    """A global batch's rows are 12 slots in a row of the schedule: each component's count
    is within 2 of its share. Partition k's records of a component run through that
    component's partition k, an epoch at a time: its first `size/P` records are distinct,
    and the partitions' first epochs together are the whole component."""
    batches = first(cd.Loader(mixture(mix_corpora)), 40)
    for batch in batches:
        counts = np.bincount(batch["_component"], minlength=3)
        assert (np.abs(counts - BATCH * np.array(list(WEIGHTS.values()))) <= 2).all(), counts
    rows = BATCH // PARTITIONS
    for c, (name, size) in enumerate(MIX_SIZES.items()):
        firsts = []
        for k in range(PARTITIONS):
            mine = np.concatenate([b["_index"][k * rows : (k + 1) * rows][b["_component"][k * rows : (k + 1) * rows] == c] for b in batches])
            epoch = int(Partitioning(PARTITIONS, 1).epoch_records(size, k))
            assert len(mine) >= epoch and len(set(mine[:epoch].tolist())) == epoch, (name, k, mine[:epoch])
            firsts.append(mine[:epoch])
        np.testing.assert_array_equal(np.sort(np.concatenate(firsts)), np.arange(size), err_msg=name)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_a_state_resumes_exactly_on_other_host_counts(mix_corpora: dict[str, Path], kind: str) -> None:
    pipeline = mixture(mix_corpora, kind)
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=2),
        lambda k, state: cd.Loader(pipeline, hosts=(1, 4)[k % 2], state=state),
        steps=8,
    )


@pytest.mark.parametrize("backend", ["sidecar", "colocated"])
def test_every_backend_gives_the_same_batches_and_resumes(mix_corpora: dict[str, Path], backend: str) -> None:
    for kind in ("padded", "packed"):
        pipeline = mixture(mix_corpora, kind)
        expected = first(cd.Loader(pipeline), 6)
        with cd.Loader(pipeline, hosts=4, backend=backend_of(backend)) as loader:
            got = [to_numpy(next(loader)) for _ in range(3)]
            state = json.loads(json.dumps(loader.get_state()))
        assert_batches_equal(expected[:3], got, f"{kind}, {backend}")
        assert_batches_equal(expected[3:], first(cd.Loader(pipeline, hosts=2, state=state), 3), f"{kind}, resumed")


def test_each_host_reads_its_share_of_every_components_row_groups(tmp_path: Path) -> None:
    """Two components of 4,000 and 2,000 records in row groups of 250, windows of 4 row
    groups, 4 hosts, each host pipeline with sources of its own over the same stream (its
    first 20 batches and what it reads ahead): with 4 partitions a host decodes one row
    group of each window of each component, with one partition all four (each host's rows
    of a batch are spread over the window)."""
    corpora = {
        name: demo.write_corpus(tmp_path / name, files=1, rows_per_file=rows, row_group_size=250, min_tokens=1, max_tokens=6)
        for name, rows in (("web", 4000), ("code", 2000))
    }

    def decoded(partitions: int) -> int:
        order = cd.Order("block", seed=3, window=4)
        pipeline = mixture(corpora, partitions=partitions, weights={"web": 2, "code": 1}, global_batch_size=48, order=order)
        return row_groups_decoded(pipeline, 4, batches=20)

    partitioned, plain = decoded(PARTITIONS), decoded(1)
    assert 2 * partitioned <= plain, (partitioned, plain)


def test_states_and_settings_name_what_they_need(mix_corpora: dict[str, Path]) -> None:
    pipeline = mixture(mix_corpora, "packed")
    with cd.Loader(pipeline) as loader:
        for _ in range(pipeline.plan_batches + 1):  # past the first plans: the components' records are counted
            next(loader)
        state = loader.get_state()
    assert state["parts"]["count"] == PARTITIONS and state["order"] == "block:2/4x3 dealt"
    assert sum(q for _, _, q in state["mix"]) > 0
    with pytest.raises(cd.errors.StateError, match=r"other weights.*partitions=4 continues under the weights it was saved with"):
        cd.Loader(mixture(mix_corpora, "packed", weights={"web": 1, "code": 1, "math": 1}), state=state)
    with pytest.raises(cd.errors.StateError, match=r"order: state has 'block:2/4x3 dealt', pipeline has 'block:2'"):
        cd.Loader(mixture(mix_corpora, "packed", partitions=1), state=state)
    with pytest.raises(cd.errors.StateError, match=r"other row groups every epoch.*colo-data that saved it"):
        cd.Loader(pipeline, state={**state, "order": "block:2/4x3 own"})
    with pytest.raises(cd.errors.ConfigError, match=r"component 'math' has 7 records.*partitions=12"):
        mixture(mix_corpora, partitions=12)


def test_verify_passes_on_a_partitioned_mixture(mix_corpora: dict[str, Path]) -> None:
    """`verify` checks each partition's shares (within two records in every prefix of its
    own records), each record once per component epoch, the order and resumes, on 1, 2
    and 4 hosts."""
    from colo_data.verification.verify import verify

    checks = {c.name: c for c in verify(mixture(mix_corpora), hosts=(1, 2, 4), steps=30)}
    assert {name: c.status for name, c in checks.items()} == dict.fromkeys(
        ("identical batches", "shares", "exactly once", "seed order", "resume"), "PASS"
    ), checks
    assert "each of the 4 partitions" in checks["shares"].detail


def test_a_padded_mixture_of_partitions_resumes_at_its_batch_size_only(mix_corpora: dict[str, Path]) -> None:
    """Partition k's schedule starts k times its rows a batch slots on, so a padded mixture of
    partitions (unlike a padded pipeline over one source) resumes at the batch size it was
    saved at only: at another it is a StateError that says so and names the one, and there
    it continues exactly on other host counts. A padded mixture that names no partitions
    keeps one, and resumes at another batch size: the stream after the saved position."""
    pipeline = mixture(mix_corpora)
    expected = first(cd.Loader(pipeline), 4)
    with cd.Loader(pipeline) as loader:
        next(loader), next(loader)
        state = json.loads(json.dumps(loader.get_state()))
    for batch in (24, 8):
        with pytest.raises(
            cd.errors.StateError,
            match=r"under the weights and at the global batch size it was saved at.*continues neither under other weights "
            r"nor at another batch size.*global_batch_size=12\.",
        ):
            cd.Loader(mixture(mix_corpora, global_batch_size=batch), state=state)
    assert_batches_equal(expected[2:], first(cd.Loader(pipeline, hosts=4, state=state), 2), "resumed at 12, 4 hosts")

    one = mixture(mix_corpora, partitions=None)
    assert one.partitioning.partitions == 1
    plain = first(cd.Loader(one), 4)
    with cd.Loader(one) as loader:
        next(loader), next(loader)
        state = json.loads(json.dumps(loader.get_state()))
    (resumed,) = first(cd.Loader(mixture(mix_corpora, partitions=None, global_batch_size=24), hosts=2, state=state), 1)
    for name in resumed:
        np.testing.assert_array_equal(resumed[name], np.concatenate([plain[2][name], plain[3][name]]), err_msg=name)
