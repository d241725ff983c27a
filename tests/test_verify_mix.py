"""`verify` of a `cd.Mix` (issue 13, mixtures): it passes on a sound mixture, checking the
shares in every prefix, each component's records once per epoch of its component and the
mixture's order; it fails naming the component on transforms that break the mixture (one
that relabels a component, one that copies a row over another on one host count); and a
transform that drops the component column is a ConfigError that names it. Real Parquet
corpora, real loaders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import colo_data as cd
from colo_data.host.host_pipeline import HostPipeline
from colo_data.pipeline import mix as mix_module
from colo_data.verification.verify import Check, verify

BATCH = 12
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
Transform = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def mix_pipeline(
    mix_corpora: dict[str, Path], transforms: tuple[Transform, ...] = (), weights: dict[str, float] = WEIGHTS
) -> cd.Pipeline:
    """The mixture of the three mix_corpora by `weights`, endless, padded to 4 tokens."""
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}
    return cd.Pipeline(
        source=cd.Mix(components, weights),
        order=cd.Order(shuffle="global", seed=3, window=2),
        transforms=[cd.pad_or_truncate("tokens", 4), *transforms],
        global_batch_size=BATCH,
        epochs=None,
        index_column="_index",
    )


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def test_a_sound_mixture_passes_every_check(mix_corpora: dict[str, Path]) -> None:
    """The default run: until every component has run through its first epoch (web, 60
    records at half the stream, is the last: 120 positions, 10 batches)."""
    checks = verify(mix_pipeline(mix_corpora), hosts=(1, 2, 3))
    assert [(c.name, c.status) for c in checks] == [
        ("identical batches", "PASS"), ("shares", "PASS"), ("exactly once", "PASS"), ("seed order", "PASS"),
        ("resume", "PASS"),
    ], "\n".join(map(str, checks))
    found = by_name(checks)
    assert found["identical batches"].detail.startswith("hosts 1, 2, 3 give the same 10 batches")
    assert found["shares"].detail == (
        "in every prefix of positions 0-119 each component is within one record of its share "
        "('web' 32768/65536, 'code' 19661/65536, 'math' 13107/65536), with hosts 1, 2, 3"
    )
    assert found["exactly once"].detail == (
        "each record once per epoch of its component over positions 0-119: 'web' epoch 0, "
        "'code' epoch 0 and 11 of epoch 1's 25, 'math' epochs 0-2 and 3 of epoch 3's 7, with hosts 1, 2, 3"
    )
    assert found["resume"].detail.startswith("state after 5 batches with 1 host, restored with 3 hosts")


def test_the_default_run_is_capped(mix_corpora: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A component of tiny weight would make the default run long: it stops at the cap."""
    monkeypatch.setattr(mix_module, "_VERIFY_RECORDS", 4 * BATCH)
    checks = by_name(verify(mix_pipeline(mix_corpora, weights={"web": 1, "code": 1e-3, "math": 1}), hosts=(1, 2)))
    assert checks["identical batches"].detail.startswith("hosts 1, 2 give the same 4 batches")
    assert "'web' 24 of epoch 0's 60, 'code' none, " in checks["exactly once"].detail
    assert not any(c.failed for c in checks.values())


def relabel_math_as_code(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The bug: every 'math' row (component 2) is marked as 'code' (component 1)."""
    component = batch["_component"].copy()
    component[component == 2] = 1
    return {**batch, "_component": component}


def test_a_relabelled_component_fails_naming_it(mix_corpora: dict[str, Path]) -> None:
    """'code' is so rare that the order puts none of its records in these 6 batches, so
    every relabelled row names a record the run should not hold, whatever the shuffle."""
    weights = {"web": 1, "code": 1e-3, "math": 1}
    checks = by_name(verify(mix_pipeline(mix_corpora, (relabel_math_as_code,), weights), hosts=(1, 2, 3), steps=6))
    assert checks["identical batches"].status == "PASS"  # every host count relabels the same way
    assert checks["shares"].failed and checks["shares"].detail.startswith("1 host: component 'math' has 0 of the first ")
    exactly_once = checks["exactly once"]
    assert exactly_once.failed and "'code' record" in exactly_once.detail, exactly_once
    assert "but the order puts it at none of the positions 0-71" in exactly_once.detail, exactly_once.detail
    assert "'math' record" in exactly_once.detail and " is missing (the order puts it at batch " in exactly_once.detail
    assert checks["seed order"].failed and "where the seed's order has 'math' record" in checks["seed order"].detail
    assert checks["resume"].status == "PASS"


class CopyOver:
    """The bug: in a host piece of `rows` rows that holds `component`'s `record`, the next
    row (all its columns) is copied over it; `rows` picks the host count (its pieces grow
    from one batch, doubling: their sizes are the stream's alone)."""

    def __init__(self, component: int, record: int, rows: int) -> None:
        self.component, self.record, self.rows = component, record, rows

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        at = np.flatnonzero((batch["_component"] == self.component) & (batch["_index"] == self.record))
        if len(batch["_index"]) != self.rows or not len(at):
            return batch
        out = {}
        for name, column in batch.items():
            column = column.copy()
            column[at[0]] = column[at[0] + 1]
            out[name] = column
        return out


def test_a_record_lost_on_one_host_count_fails_naming_its_component(mix_corpora: dict[str, Path]) -> None:
    """Host 1 of 2 copies its next row over a 'web' record of batch 3 (rows 6-10: the next
    row is in the same host piece); the run completes web's epoch 0, so the record is
    missing from it. Hosts 1 and 3 transform batch 3 in pieces of other sizes and are sound."""
    pipeline = mix_pipeline(mix_corpora)
    mix = pipeline.source
    assert isinstance(mix, cd.Mix)
    order = mix.bind(pipeline.order)
    components, own = order.components_at(np.arange(3 * BATCH + 6, 3 * BATCH + 11))
    row = int(np.flatnonzero(components == 0)[0])
    record = int(order.orders[0].indices_at(own[row : row + 1])[0])
    made, rows = 0, 0  # host 1 of 2's batches before the piece that holds batch 3, and that piece's rows
    for piece in HostPipeline(pipeline, 1, 2).chunks(0):
        made, rows = made + piece.rows // (BATCH // 2), piece.rows
        if made > 3:
            break
    checks = by_name(verify(mix_pipeline(mix_corpora, (CopyOver(0, record, rows),)), hosts=(1, 2, 3), resume_at=2))
    identical = checks["identical batches"].detail
    assert identical.startswith(f"batch 3 row {6 + row} differs in ") and identical.endswith(" with 2 hosts")
    assert f": 'web' record {record} with 1 host, " in identical
    exactly_once = checks["exactly once"].detail
    assert exactly_once.startswith("2 hosts: ") and "(fails with" not in exactly_once, exactly_once
    assert f"'web' record {record} is missing (the order puts it at batch 3 row {6 + row})" in exactly_once
    assert checks["seed order"].detail.startswith(f"2 hosts: batch 3 row {6 + row} holds ")
    assert checks["seed order"].detail.endswith(f"where the seed's order has 'web' record {record}")
    assert checks["resume"].status == "PASS"  # restored with 3 hosts, which are sound


def drop_component(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The bug: the component column is left out of the output."""
    return {name: column for name, column in batch.items() if name != "_component"}


def test_a_dropped_component_column_is_a_config_error(mix_corpora: dict[str, Path]) -> None:
    with pytest.raises(cd.errors.ConfigError, match=r"Mix\(component_column='_component'\): the batches have no such column"):
        verify(mix_pipeline(mix_corpora, (drop_component,)), hosts=(1, 2), steps=3)


@pytest.mark.parametrize("partitions", [1, None], ids=["one-stream", "chosen-partitions"])
@pytest.mark.parametrize("keep", [False, True])
def test_a_packed_mixture_passes(mix_corpora: dict[str, Path], keep: bool, partitions: int | None) -> None:
    """Packed: every segment's (component, record) checked; with a keep that rejects
    records the delivered shares are not the weights', so that check is skipped. With the
    partitions it chooses, each partition's own stream is checked (its shares within two
    records in every prefix of it)."""
    components = {n: cd.ArrowSource(str(p), columns=["id", "tokens"]) for n, p in mix_corpora.items()}
    pack = cd.Pack("tokens", 8, max_segments=4, keep=(lambda columns: np.asarray(columns["id"]) % 3 != 0) if keep else None)
    pipeline = cd.Pipeline(
        source=cd.Mix(components, WEIGHTS), order=cd.Order(shuffle="global", seed=3), global_batch_size=BATCH,
        epochs=None, index_column="_index", pack=pack, partitions=partitions,
    )
    assert (pipeline.partitioning.partitions > 1) == (partitions is None)
    checks = by_name(verify(pipeline, hosts=(1, 2)))
    assert not any(c.failed for c in checks.values()), checks
    assert checks["shares"].status == ("SKIP" if keep else "PASS")
    assert ("that the pack's keep rejects" in checks["exactly once"].detail) == (keep and partitions == 1)
    assert ("epoch of its partition" in checks["exactly once"].detail) == (partitions is None)
