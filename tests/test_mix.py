"""`cd.Mix` (issue 13, mixtures): shares within one record in every prefix, the same
batches for any host count and backend, each component's records once per component
epoch and reshuffled between them, a component's sequence independent of the weights,
and a state saved under some weights and host count that restores under others with every
component continuing exactly. Real Parquet corpora, real loaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipelines import MIX_SIZES, backend_of

import colo_data as cd
from colo_data import demo
from colo_data.pipeline.mix import DENOMINATOR, integer_shares, schedule
from colo_data.testing import to_numpy

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

BATCH = 12


def mix_pipeline(mix_corpora: dict[str, Path], weights: dict[str, float], shuffle: str = "global") -> cd.Pipeline:
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}
    return cd.Pipeline(
        source=cd.Mix(components, weights),
        order=cd.Order(shuffle=shuffle, seed=3, window=2),
        transforms=[cd.pad_or_truncate("tokens", 4)],
        global_batch_size=BATCH,
        epochs=None,
        index_column="_index",
    )


def read(loader: cd.Loader, steps: int) -> dict[str, np.ndarray]:
    """`steps` global batches, their columns concatenated."""
    batches = [to_numpy(next(loader)) for _ in range(steps)]
    loader.close()
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def sequences(rows: dict[str, np.ndarray]) -> dict[int, list[int]]:
    """Each component's record indices in stream order."""
    return {c: rows["_index"][rows["_component"] == c].tolist() for c in np.unique(rows["_component"]).tolist()}


@pytest.mark.parametrize(
    "weights",
    [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [0, 3, 1], [1, 1e-4, 5], list(np.random.default_rng(0).random(16))],
)
def test_every_prefix_gives_each_component_its_share_within_one_record(weights: list[float]) -> None:
    shares = integer_shares(weights)
    assert sum(shares) == DENOMINATOR and all(s > 0 for s, w in zip(shares, weights, strict=True) if w > 0)
    comp, rank = schedule(shares)
    for c, share in enumerate(shares):
        mine = comp == c
        counts = np.cumsum(mine)
        exact = np.arange(1, DENOMINATOR + 1) * share / DENOMINATOR
        assert np.abs(counts - exact).max() <= 1, f"component {c} of {shares}"
        assert np.array_equal(rank[mine], np.arange(share)), "ranks count each component's slots in order"


def test_shares_hold_in_the_loader_stream(mix_corpora: dict[str, Path]) -> None:
    rows = read(cd.Loader(mix_pipeline(mix_corpora, {"web": 0.6, "code": 0.3, "math": 0.1})), 25)
    shares = integer_shares([0.6, 0.3, 0.1])
    for c, share in enumerate(shares):
        counts = np.cumsum(rows["_component"] == c)
        assert np.abs(counts - np.arange(1, len(counts) + 1) * share / DENOMINATOR).max() <= 1
    assert rows["_component"].dtype == np.int32


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_each_component_runs_through_its_own_epochs(mix_corpora: dict[str, Path], shuffle: str) -> None:
    """Every record of a component once per component epoch, in another order each epoch
    (math, 7 records, goes through many epochs)."""
    rows = read(cd.Loader(mix_pipeline(mix_corpora, {"web": 1, "code": 1, "math": 1}, shuffle)), 30)
    assert np.array_equal(rows["id"], rows["_index"]), "the index column is the record's index in its component"
    for c, (name, size) in enumerate(MIX_SIZES.items()):
        seq = sequences(rows)[c]
        epochs = [seq[i : i + size] for i in range(0, len(seq) - size + 1, size)]
        assert epochs, name
        for epoch in epochs:
            assert sorted(epoch) == list(range(size)), f"{name}: each record once per epoch"
        if shuffle != "none" and len(epochs) > 1:
            assert epochs[0] != epochs[1], f"{name}: reshuffled between its epochs"


def test_a_components_sequence_does_not_depend_on_the_weights(mix_corpora: dict[str, Path]) -> None:
    a = sequences(read(cd.Loader(mix_pipeline(mix_corpora, {"web": 0.7, "code": 0.2, "math": 0.1})), 20))
    b = sequences(read(cd.Loader(mix_pipeline(mix_corpora, {"web": 0.1, "code": 0.5, "math": 0.4})), 20))
    for c in a:
        n = min(len(a[c]), len(b[c]))
        assert n > 5 and a[c][:n] == b[c][:n], f"component {c}"


@pytest.mark.parametrize("hosts", [2, 3])
def test_batches_are_the_same_for_any_host_count(mix_corpora: dict[str, Path], hosts: int) -> None:
    pipeline = mix_pipeline(mix_corpora, {"web": 0.5, "code": 0.3, "math": 0.2})
    one = read(cd.Loader(pipeline), 12)
    many = read(cd.Loader(pipeline, hosts=hosts), 12)
    for k in one:
        assert np.array_equal(one[k], many[k]), k


@pytest.mark.parametrize("backend, workers", [("inprocess", 2), ("sidecar", 0), ("colocated", 0)])
def test_batches_are_the_same_on_every_backend(mix_corpora: dict[str, Path], tmp_path: Path, backend: str, workers: int) -> None:
    pipeline = mix_pipeline(mix_corpora, {"web": 0.5, "code": 0.3, "math": 0.2}, "block")
    one = read(cd.Loader(pipeline), 12)
    other = read(cd.Loader(pipeline, backend=backend_of(backend, workers, tmp_path)), 12)
    for k in one:
        assert np.array_equal(one[k], other[k]), f"{backend}: {k}"


def test_a_state_saved_under_some_weights_restores_under_others(mix_corpora: dict[str, Path]) -> None:
    """Saved under weights A on 2 hosts, restored under weights B on 3: every component
    continues exactly where it stopped, and the shares follow B from there."""
    a = mix_pipeline(mix_corpora, {"web": 0.7, "code": 0.2, "math": 0.1})
    b = mix_pipeline(mix_corpora, {"web": 0.1, "code": 0.3, "math": 0.6})
    loader = cd.Loader(a, hosts=2)
    before = read_open(loader, 9)
    state = json.loads(json.dumps(loader.get_state()))
    loader.close()
    after = read(cd.Loader(b, hosts=3, state=state), 15)
    for c, name in enumerate(MIX_SIZES):
        seen = sequences(before).get(c, []) + sequences(after).get(c, [])
        alone = {n: float(n == name) for n in MIX_SIZES}  # this component's own sequence: weight 1, the others 0
        own = read(cd.Loader(mix_pipeline(mix_corpora, alone)), -(-len(seen) // BATCH))["_index"].tolist()
        assert len(seen) > 20 and seen == own[: len(seen)], f"{name} continues exactly where it stopped"
    shares = integer_shares([0.1, 0.3, 0.6])
    for c, share in enumerate(shares):
        counts = np.cumsum(after["_component"] == c)
        assert np.abs(counts - np.arange(1, len(counts) + 1) * share / DENOMINATOR).max() <= 1, "shares follow B"


def read_open(loader: cd.Loader, steps: int) -> dict[str, np.ndarray]:
    batches = [to_numpy(next(loader)) for _ in range(steps)]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_a_state_restores_the_same_stream_under_the_same_weights(mix_corpora: dict[str, Path]) -> None:
    pipeline = mix_pipeline(mix_corpora, {"web": 0.5, "code": 0.3, "math": 0.2})
    whole = read(cd.Loader(pipeline), 20)
    loader = cd.Loader(pipeline, hosts=3)
    read_open(loader, 7)
    state = loader.get_state()
    loader.close()
    rest = read(cd.Loader(pipeline, hosts=2, state=state), 13)
    for k in whole:
        assert np.array_equal(whole[k][7 * BATCH :], rest[k]), k
    with cd.Loader(pipeline) as again:  # set_state on an open loader, same weights
        next(again)
        again.set_state(state)
        assert np.array_equal(to_numpy(next(again))["_index"], whole["_index"][7 * BATCH : 8 * BATCH])


def test_a_state_names_a_component_added_removed_or_changed(mix_corpora: dict[str, Path], tmp_path: Path) -> None:
    pipeline = mix_pipeline(mix_corpora, {"web": 1, "code": 1, "math": 1})
    loader = cd.Loader(pipeline)
    next(loader)
    state = loader.get_state()
    loader.close()
    fewer = mix_pipeline({k: mix_corpora[k] for k in ("web", "code")}, {"web": 1, "code": 1})
    with pytest.raises(cd.errors.StateError, match="component 'math' of the state is not in the pipeline"):
        cd.Loader(fewer, state=state)
    other = demo.write_corpus(tmp_path / "other", files=1, rows_per_file=9, row_group_size=5, min_tokens=1, max_tokens=6)
    changed = mix_pipeline({**mix_corpora, "math": other}, {"web": 1, "code": 1, "math": 1})
    with pytest.raises(cd.errors.StateError, match="component 'math' has other data"):
        cd.Loader(changed, state=state)
    more = mix_pipeline({**mix_corpora, "more": other}, {"web": 1, "code": 1, "math": 1, "more": 1})
    with pytest.raises(cd.errors.StateError, match="component 'more' is not in the state"):
        cd.Loader(more, state=state)
    with pytest.raises(cd.errors.StateError, match="make a new loader"):
        with cd.Loader(mix_pipeline(mix_corpora, {"web": 3, "code": 1, "math": 1})) as open_loader:
            open_loader.set_state(state)


def test_the_state_stays_small_for_16_components(tmp_path: Path) -> None:
    corpus = demo.write_corpus(tmp_path / "c", files=1, rows_per_file=30, row_group_size=10, min_tokens=1, max_tokens=4)
    components = {f"c{i:02d}": cd.ArrowSource(str(corpus), columns=["id", "tokens"]) for i in range(16)}
    pipeline = cd.Pipeline(
        source=cd.Mix(components, {n: 1 for n in components}), global_batch_size=4, epochs=None,
        transforms=[cd.pad_or_truncate("tokens", 4)],
    )
    loader = cd.Loader(pipeline)
    for _ in range(100):
        next(loader)
    state = loader.get_state()
    loader.close()
    assert len(json.dumps(state, separators=(",", ":"))) < 512, json.dumps(state)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda c: cd.Pipeline(source=cd.Mix(c, {"web": 1, "code": 1, "math": 1}), global_batch_size=4), "endless"),
        (lambda c: cd.Mix(c, {"web": 1, "code": 1}), "one weight for each component"),
        (lambda c: cd.Mix(c, {"web": -1, "code": 1, "math": 1}), "'web' is -1"),
        (lambda c: cd.Mix(c, {"web": 0, "code": 0, "math": 0}), "every weight is 0"),
        # near the float maximum: the sum overflowed (shares of 4 slots, not 65,536: a raw IndexError), and an int
        # past it raised a raw TypeError
        (
            lambda c: cd.Mix(c, {"web": 1e308, "code": 1e308, "math": 1}),
            r"add up past the largest float.*'web' is 1e\+308.*divide them all",
        ),
        (
            lambda c: cd.Mix(c, {"web": 2**1100, "code": 1, "math": 1}),
            r"'web' is an int of 1101 bits; give a number from 0 to the largest float",
        ),
        (lambda c: cd.Mix(c, {"web": float("nan"), "code": 1, "math": 1}), r"'web' is nan; give a number from 0"),
        (  # more weighted components than the schedule's slots: refused, none left out silently
            lambda c: cd.Mix(dict.fromkeys(map(str, range(DENOMINATOR + 1)), c["web"]), dict.fromkeys(map(str, range(DENOMINATOR + 1)), 1)),
            r"65,537 components have a weight above 0; a mixture's schedule has 65,536 slots",
        ),
    ],
)
def test_bad_mixtures_are_config_errors(mix_corpora: dict[str, Path], make: object, match: str) -> None:
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}
    with pytest.raises(cd.errors.ConfigError, match=match):
        make(components)  # type: ignore[operator]


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_a_packed_mixture_names_each_segments_component_and_index(
    mix_corpora: dict[str, Path], tmp_path: Path, backend: str
) -> None:
    """Packed rows of a mixture: the index and component columns say, per segment, which
    record of which component it holds, and the records come in the mixture's order."""
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    packed = cd.Pipeline(
        source=cd.Mix(components, weights), order=cd.Order(shuffle="global", seed=3), global_batch_size=BATCH,
        epochs=None, index_column="_index", pack=cd.Pack("tokens", 8, max_segments=4),
        partitions=1,  # one stream, in the mixture's order (an endless packed pipeline would choose partitions)
    )
    rows = read(cd.Loader(packed, backend=backend_of(backend, 0, tmp_path)), 6)
    placed = rows["_component"] >= 0
    assert np.array_equal(placed, rows["_index"] >= 0) and placed.any()
    plain = read(cd.Loader(mix_pipeline(mix_corpora, weights)), 6 * 4)  # the same mixture, unpacked: 4 records a row at most
    want = list(zip(plain["_component"].tolist(), plain["_index"].tolist(), strict=True))
    taken = 0
    for b in range(6):  # each batch holds the mixture's next records (in its rows by fit)
        mine = slice(b * BATCH, (b + 1) * BATCH)
        got = list(zip(rows["_component"][mine][placed[mine]].tolist(), rows["_index"][mine][placed[mine]].tolist(), strict=True))
        assert sorted(got) == sorted(want[taken : taken + len(got)]), f"batch {b}: not the mixture's next records"
        taken += len(got)
    assert taken > BATCH


def test_telemetry_counts_each_components_records(mix_corpora: dict[str, Path]) -> None:
    with cd.Loader(mix_pipeline(mix_corpora, {"web": 0.5, "code": 0.3, "math": 0.2})) as loader:
        rows = read_open(loader, 10)
        counts = loader.telemetry().components
    assert counts == {name: int((rows["_component"] == c).sum()) for c, name in enumerate(MIX_SIZES)}, counts
    with cd.Loader(cd.Pipeline(source=cd.ArrowSource(str(mix_corpora["web"])), global_batch_size=4)) as single:
        assert single.telemetry().components is None


def test_the_checkpointing_page_says_how_many_components_a_state_array_holds(token_corpus: Path) -> None:
    """docs/checkpointing.md named only Grain pipelines as the states that outgrow
    `STATE_ARRAY_LENGTH`; a mixture's grows by its name and 18 bytes a component, and the
    page's count of components named in 4 characters is where it passes 4,096 bytes."""
    import json
    import re

    from colo_data.pipeline.state import make_state

    source = cd.ArrowSource(str(token_corpus), columns=["id", "tokens"])

    def size(count: int) -> int:
        names = [f"c{i:03d}" for i in range(count)]
        mixture = cd.Mix(dict.fromkeys(names, source), dict.fromkeys(names, 1))
        pipeline = cd.Pipeline(source=mixture, order=cd.Order("block", seed=1), transforms=[cd.pad_or_truncate("tokens", 8)],
                               global_batch_size=8, epochs=None)
        return len(json.dumps(make_state(pipeline, pipeline.at(8)), separators=(",", ":")))

    each = (size(200) - size(100)) / 100
    fits = int((4096 - (size(100) - 100 * each)) // each)
    page = (Path(__file__).resolve().parents[1] / "docs" / "checkpointing.md").read_text()
    said = re.search(r"`cd.Mix`'s of many components \(its name and (\d+) bytes each: some (\d+)\s+components named in 4", page)
    assert said, "docs/checkpointing.md does not say how far a mixture's state grows"
    assert int(said[1]) + 4 == each and abs(int(said[2]) - fits) <= 10, (each, fits, said.groups())

