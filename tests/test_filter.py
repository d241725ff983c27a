"""`cd.Pipeline(keep=...)`: a filter that keeps every column, with exact positions: each
global batch is the next `global_batch_size` accepted records of the stream, the rejected
ones consumed, never placed; the same batches for any host count and on every backend;
a state restores on another host count; with a mixture and with packing too."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh

import colo_data as cd
from colo_data.host.host_pipeline import HostPipeline
from colo_data.testing import assert_batches_equal, read_all, to_numpy

from pipelines import BATCH, MIX_SIZES, make_pipeline

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # sidecars get its functions by value
RECORDS = 120


def odd_ids(columns: dict) -> np.ndarray:
    return np.asarray(columns["id"]) % 2 == 1


def not_thirds(columns: dict) -> np.ndarray:
    return np.asarray(columns["_index"]) % 3 != 0


def filtered(corpus: Path, **overrides: object) -> cd.Pipeline:
    return dataclasses.replace(make_pipeline(corpus, "global"), **{"keep": odd_ids, **overrides})


def loader_on(pipeline: cd.Pipeline, backend: str, hosts: int, **options: object) -> cd.Loader:
    if backend == "colocated":
        return cd.Loader(pipeline, backend=backend, mesh=Mesh(np.array(jax.devices()[:hosts]), ("data",)), **options)
    return cd.Loader(pipeline, backend=backend, hosts=hosts, **options)


@pytest.mark.parametrize("backend", ["inprocess", "sidecar", "colocated"])
def test_every_accepted_record_once_with_every_column_on_every_backend(token_corpus: Path, backend: str) -> None:
    pipeline = filtered(token_corpus)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    assert set(reference[0]) == {"id", "tokens", "_index"}, "every column kept"
    ids = np.concatenate([b["id"] for b in reference])
    assert sorted(ids.tolist()) == list(range(1, RECORDS, 2)), "the accepted records, each once"
    stream = HostPipeline(pipeline).indices_at(np.arange(RECORDS))
    np.testing.assert_array_equal(ids, stream[stream % 2 == 1], "in stream order")
    assert_batches_equal(reference, read_all(loader_on(pipeline, backend, 2)), f"{backend}, 2 hosts")


def test_the_state_counts_the_rejected_records_and_restores_on_other_host_counts(token_corpus: Path) -> None:
    pipeline = filtered(token_corpus, epochs=None, partitions=1)  # one position in the state
    with cd.Loader(pipeline, hosts=1) as loader:
        first = [to_numpy(next(loader)) for _ in range(3)]
        state = loader.get_state()
        rest = [to_numpy(next(loader)) for _ in range(4)]
    stream = HostPipeline(pipeline).indices_at(np.arange(RECORDS))
    taken = np.concatenate([b["_index"] for b in first])
    assert state["position"] == int(np.flatnonzero(stream == taken[-1])[0]) + 1, "the position after the last accepted"
    for hosts, backend in ((2, "inprocess"), (3, "inprocess"), (2, "colocated")):
        with loader_on(pipeline, backend, hosts, state=state) as resumed:
            again = [to_numpy(next(resumed)) for _ in range(4)]
        assert_batches_equal(rest, again, f"resumed on {hosts} hosts, {backend}")


def test_a_filtered_mixture_passes_verify(mix_corpora: dict[str, Path]) -> None:
    """A mixture filtered on its index column: every accepted (component, record) once per
    component epoch, in the mixture's order, on 1 and 2 hosts, and resumed on another."""
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}
    pipeline = cd.Pipeline(
        source=cd.Mix(components, {"web": 0.5, "code": 0.3, "math": 0.2}), order=cd.Order(shuffle="global", seed=3),
        transforms=[cd.pad_or_truncate("tokens", 8)], global_batch_size=BATCH, epochs=None, index_column="_index",
        keep=not_thirds, partitions=1,  # one stream: its batches' positions are checked
    )
    checks = {c.name: c for c in cd.verify.verify(pipeline, hosts=(1, 2), steps=8)}
    assert not any(c.failed for c in checks.values()), checks
    assert checks["shares"].status == "SKIP" and "keep rejects" in checks["exactly once"].detail, checks
    with cd.Loader(pipeline, hosts=2) as loader:
        batch = to_numpy(next(loader))
    assert (batch["_index"] % 3 != 0).all() and set(batch) == {"id", "tokens", "_index", "_component"}
    assert sum(MIX_SIZES.values()) > BATCH


def test_with_packing_a_record_must_pass_both_filters(token_corpus: Path) -> None:
    def short(columns: dict) -> np.ndarray:
        return np.array([len(t) <= 8 for t in columns["tokens"].to_pylist()])

    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus), columns=["id", "tokens"]), order=cd.Order(shuffle="global", seed=3),
        pack=cd.Pack("tokens", 16, keep=short), global_batch_size=4, index_column="_index", keep=odd_ids,
    )
    batches = read_all(cd.Loader(pipeline, hosts=2))
    placed = np.concatenate([b["_index"][b["_index"] >= 0] for b in batches])
    lengths = [len(t) for t in pq.read_table(sorted(str(p) for p in token_corpus.glob("*.parquet")))["tokens"].to_pylist()]
    assert sorted(placed.tolist()) == [i for i in range(RECORDS) if i % 2 == 1 and lengths[i] <= 8]


def test_bad_filters_are_named_errors(token_corpus: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"keep=3: give a function of the records' columns"):
        filtered(token_corpus, keep=3)
    with pytest.raises(cd.errors.TransformError, match=r"cd.Pipeline keep=.* returned shape \(\) for \d+ records"):
        next(cd.Loader(filtered(token_corpus, keep=lambda columns: True)))
    nothing = filtered(token_corpus, keep=lambda columns: np.zeros(len(columns["id"]), bool))
    assert read_all(cd.Loader(nothing)) == [], "a finite stream that keeps nothing ends"
    with pytest.raises(cd.errors.TransformError, match=r"keep=\S*<lambda>\) accepted none of the last [\d,]+ records of the stream"):
        next(cd.Loader(dataclasses.replace(nothing, epochs=None, partitions=1)))  # an endless one is told, not read forever


def marked(true: object, false: object) -> Callable[[dict], np.ndarray]:
    """A filter that marks the odd ids with `true` and the others with `false`."""

    def verdicts(columns: dict) -> np.ndarray:
        return np.where(np.asarray(columns["id"]) % 2 == 1, true, false)

    return verdicts


@pytest.mark.parametrize(("true", "false", "dtype"), [("True", "False", "<U5"), (1.0, np.nan, "float64"), (1, 0, "int64")])
def test_a_keep_that_returns_other_than_bools_is_named(token_corpus: Path, true: object, false: object, dtype: str) -> None:
    """Read by truthiness, the string "False" and NaN would keep every record: a verdict
    that is not a bool is a TransformError that names the filter and the dtype, for the
    pipeline's keep and the pack's, one partition or several."""
    for overrides in (
        dict(keep=marked(true, false)),
        dict(keep=marked(true, false), partitions=4, epochs=None),
        dict(keep=None, pack=cd.Pack("tokens", 16, keep=marked(true, false))),
    ):
        where = "cd.Pack" if overrides["keep"] is None else "cd.Pipeline"
        with pytest.raises(
            cd.errors.TransformError,
            match=rf"{where} keep=.*verdicts.* returned {dtype} values for \d+ records .*give one bool a record",
        ):
            read_all(cd.Loader(filtered(token_corpus, **overrides)), 1)


def test_a_list_of_bools_and_a_pyarrow_boolean_array_are_verdicts(token_corpus: Path) -> None:
    """A keep may return a list of Python bools or a pyarrow BooleanArray (no nulls): the
    batches of the numpy bool array."""

    def as_list(columns: dict) -> list[bool]:
        return [bool(i % 2) for i in np.asarray(columns["id"]).tolist()]

    def as_arrow(columns: dict) -> pa.Array:
        return pa.array(as_list(columns), pa.bool_())

    expected = read_all(cd.Loader(filtered(token_corpus)))
    for keep in (as_list, as_arrow):
        assert_batches_equal(expected, read_all(cd.Loader(filtered(token_corpus, keep=keep))), keep.__name__)
