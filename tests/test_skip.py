"""`cd.skip(pipeline, state, batches=N)`: the state N global batches later, without a
loader producing them. A loader from it yields exactly what the original would have
yielded from batch N on, for padded, packed, filtered and mixture pipelines, with and
without partitions, on another host count than the one that saved the state. Real Parquet
corpora, real loaders."""

from __future__ import annotations

import functools
from pathlib import Path

import grain_pipelines as gp
from pipelines import assert_state_refused
import numpy as np
import pytest

import colo_data as cd
from colo_data.testing import assert_batches_equal, to_numpy

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

SAVED, SKIPPED, AFTER = 3, 5, 4  # batches read before the state, skipped, compared after
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def short(columns: dict) -> np.ndarray:
    """The filter: records of 6 tokens or fewer."""
    return np.array([len(t) <= 6 for t in columns["tokens"].to_pylist()])


def pipeline_of(kind: str, token_corpus: Path, mix_corpora: dict[str, Path], partitions: int = 1) -> cd.Pipeline:
    """A pipeline of `kind` ("padded", "packed", "filtered", "mixture", "packed mixture")."""
    if "mixture" in kind:
        source = cd.Mix({n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}, WEIGHTS)
    else:
        source = cd.ArrowSource(str(token_corpus), columns=["id", "tokens"])
    settings: dict = dict(
        source=source,
        order=cd.Order(shuffle="block", seed=5, window=2),
        transforms=[cd.pad_or_truncate("tokens", 8)],
        global_batch_size=8,
        epochs=None,
        index_column="_index",
        partitions=partitions,
    )
    if "packed" in kind:
        settings.update(transforms=[], pack=cd.Pack("tokens", 16))
    if kind == "filtered":
        settings.update(keep=short)
    return cd.Pipeline(**settings)


def read(pipeline: cd.Pipeline, count: int, **loader: object) -> tuple[list[dict[str, np.ndarray]], dict]:
    """`count` batches of a loader, and its state after them."""
    with cd.Loader(pipeline, **loader) as source:  # type: ignore[arg-type]
        batches = [to_numpy(next(source)) for _ in range(count)]
        return batches, source.get_state()


@pytest.mark.parametrize(
    "kind, partitions",
    [("padded", 1), ("packed", 1), ("packed", 4), ("filtered", 4), ("mixture", 1), ("packed mixture", 4)],
)
def test_a_loader_from_a_skipped_state_yields_the_batches_after_the_skip(
    token_corpus: Path, mix_corpora: dict[str, Path], kind: str, partitions: int
) -> None:
    """Saved on 1 host after 3 batches; 5 skipped; read on 2 hosts: batches 8 to 11 of the
    stream straight through."""
    pipeline = pipeline_of(kind, token_corpus, mix_corpora, partitions)
    straight, _ = read(pipeline, SAVED + SKIPPED + AFTER)
    _, state = read(pipeline, SAVED)
    skipped = cd.skip(pipeline, state, batches=SKIPPED)
    after, _ = read(pipeline, AFTER, hosts=2, state=skipped)
    assert_batches_equal(straight[SAVED + SKIPPED :], after, f"{kind}, {partitions} partitions, after the skip")


def test_skipping_from_the_start_and_nothing(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """No state: from the stream's start; 0 batches: the same position."""
    pipeline = pipeline_of("packed", token_corpus, mix_corpora, 4)
    straight, state = read(pipeline, 6)
    from_start, _ = read(pipeline, 2, state=cd.skip(pipeline, None, batches=4))
    assert_batches_equal(straight[4:], from_start, "skipped from the start")
    assert cd.skip(pipeline, state, batches=0) == state


def test_skips_add_up(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """Two skips of 2 and 3 are one of 5, mixture shares and all."""
    pipeline = pipeline_of("mixture", token_corpus, mix_corpora)
    _, state = read(pipeline, 1)
    assert cd.skip(pipeline, cd.skip(pipeline, state, batches=2), batches=3) == cd.skip(pipeline, state, batches=5)


def test_bad_skips_are_named_errors(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """Past a finite stream's end (to its very end is fine), a negative count, a state of another pipeline."""
    finite = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus), columns=["id", "tokens"]),
        transforms=[cd.pad_or_truncate("tokens", 8)],
        global_batch_size=8,
        epochs=1,
    )  # 120 records: 15 batches
    _, state = read(finite, 2)
    with pytest.raises(cd.errors.ConfigError, match=r"batches=14: the stream has only 13 more global batches"):
        cd.skip(finite, state, batches=14)
    end = cd.skip(finite, state, batches=13)
    assert (end["epoch"], end["position"]) == (1, 0), end  # the stream's end: nothing left to read
    with cd.Loader(finite, state=end) as loader:
        assert next(loader, None) is None
    for bad in (-1, 2.0, True):
        with pytest.raises(cd.errors.ConfigError, match=f"batches={bad!r}: give an int >= 0"):
            cd.skip(finite, state, batches=bad)
    assert cd.skip(finite, state, batches=np.int64(3)) == cd.skip(finite, state, batches=3)
    packed = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus), columns=["id", "tokens"]),
        global_batch_size=4,
        epochs=1,
        pack=cd.Pack("tokens", 64),
    )
    with pytest.raises(cd.errors.ConfigError, match=r"batches=1000: the stream has only \d+ more global batches"):
        cd.skip(packed, None, batches=1000)
    other = pipeline_of("padded", token_corpus, mix_corpora)
    with pytest.raises(cd.errors.StateError):
        cd.skip(other, state, batches=1)


def test_counts_and_states_past_what_a_position_holds_are_named(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """A skip whose position would pass 2**62 is a ConfigError that says so, and a state
    whose epoch puts it there a StateError (in `Loader(state=)`, `set_state`, `skip`,
    `lineage`), where both were a raw OverflowError; a skip just short of it still gives a
    state the loader reads from. A mixture's positions past it are a StateError too."""
    pipeline = pipeline_of("padded", token_corpus, mix_corpora)
    _, state = read(pipeline, 1)
    with pytest.raises(cd.errors.ConfigError, match=r"batches=2305843009213693952: .* past the 2\*\*62 that a position may reach"):
        cd.skip(pipeline, state, batches=2**61)
    far = cd.skip(pipeline, state, batches=2**58)  # record 2**61 + 8
    with cd.Loader(pipeline, state=far) as loader:
        assert to_numpy(next(loader))["tokens"].shape == (8, 8)
    for epoch in (2**59, 2**63, 2**70):
        match = rf"epoch={epoch}, position=8: record .* past the 2\*\*62"
        assert_state_refused(pipeline, {**state, "epoch": epoch}, match)
    mixture = pipeline_of("mixture", token_corpus, mix_corpora)
    _, mixed = read(mixture, 1)
    with pytest.raises(cd.errors.StateError, match=r"position=9223372036854775808, .*not a position of a mixture \(at most 2\*\*62\)"):
        cd.Loader(mixture, state={**mixed, "position": 2**63})
    huge = {**mixed, "mix": [[name, print_, 2**64] for name, print_, _ in mixed["mix"]]}
    with pytest.raises(cd.errors.StateError, match=r"component positions .*: each must be an int from 0 to 2\*\*62"):
        cd.Loader(mixture, state=huge)


def test_a_grain_pipeline_is_refused_with_what_to_do_instead(tmp_path: Path) -> None:
    """A Grain pipeline's position is its iterators' state: no skip without reading."""
    paths = gp.write_records(tmp_path)
    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)
    with pytest.raises(cd.errors.ConfigError, match=r"cd.skip takes a cd.Pipeline, not GrainPipeline.*next\(loader\)"):
        cd.skip(pipeline, None, batches=1)
