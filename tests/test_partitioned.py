"""Partitioned packed and filtered pipelines (`cd.Pipeline(partitions=P, pack=... or keep=...)`):
each partition reads, filters and packs its own records at its own pace, a host only its own
partitions'. The global batches are the same for every host count that divides P, on every
backend; a state (one position per partition) resumes exactly on any of them; every record
comes at most once an epoch; and a host reads only its partitions' row groups."""

from __future__ import annotations

import itertools
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pipelines import IdleHost, assert_state_refused, backend_of, make_pipeline, row_groups_decoded, until_workers_made

import colo_data as cd
from colo_data import demo
from colo_data.host.host_pipeline import HostPipeline
from colo_data.pipeline import parts
from colo_data.pipeline.state import make_state
from colo_data.testing import assert_batches_equal, assert_resumes_identically, read_all, to_numpy


def not_third(columns: dict) -> np.ndarray:
    """Keeps the records whose id is not a multiple of 3."""
    return np.asarray(columns["id"]) % 3 != 0


def accept_all(columns: dict) -> np.ndarray:
    return np.ones(len(columns["id"]), bool)


def with_targets(columns: dict) -> dict:
    """A second list column to pack beside `tokens`: each record's tokens plus one, and one more."""
    tokens = columns["tokens"]
    tokens = tokens.combine_chunks() if isinstance(tokens, pa.ChunkedArray) else tokens
    targets = [[t + 1 for t in row] + [0] for row in tokens.to_pylist()]
    return {**columns, "targets": pa.array(targets, pa.list_(pa.int32()))}


KINDS: dict[str, Callable[[Path], cd.Pipeline]] = {
    "packed best_fit": lambda corpus: make_pipeline(
        corpus, transforms=[], pack=cd.Pack("tokens", 16), partitions=4, epochs=2
    ),
    "packed first_fit, two columns": lambda corpus: make_pipeline(
        corpus,
        transforms=[],
        pack=cd.Pack(columns=("tokens", "targets"), length=20, method="first_fit", prepare=[with_targets]),
        partitions=12,
        epochs=2,
    ),
    "packed next_fit with the pack's keep": lambda corpus: make_pipeline(
        corpus, transforms=[], pack=cd.Pack("tokens", 16, method="next_fit", keep=not_third), partitions=6, epochs=2
    ),
    "filtered": lambda corpus: make_pipeline(corpus, keep=not_third, partitions=12, epochs=2),
    "filtered, global shuffle": lambda corpus: make_pipeline(corpus, "global", keep=not_third, partitions=4, epochs=2),
}


def _records(batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    indices = np.concatenate([b["_index"].ravel() for b in batches])
    return indices[indices >= 0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_batches_are_the_same_for_every_host_count(token_corpus: Path, kind: str) -> None:
    """1 host and every other count that divides the batch give the same batches: those that
    divide the partitions own whole partitions, the others (3 hosts of 4 partitions, 12 of 6)
    share a partition at their boundaries, each computing it and keeping its own rows. Over
    2 epochs no record comes more than twice, and most come (a finite stream ends at the first
    batch one partition cannot make: the other partitions' last records do not come, and each
    partition reads the same records every epoch, so the one with the fewest runs out first)."""
    pipeline = KINDS[kind](token_corpus)
    expected = read_all(cd.Loader(pipeline))
    assert len(expected) >= 5, f"{kind}: {len(expected)} batches"
    for hosts in (2, 3, 4, 6, 12):
        assert_batches_equal(expected, read_all(cd.Loader(pipeline, hosts=hosts)), f"{kind}, {hosts} hosts")
    values, counts = np.unique(_records(expected), return_counts=True)
    assert counts.max() <= 2, f"{kind}: records {values[counts > 2].tolist()} came more than once an epoch"
    kept = 120 if pipeline.pack is None or pipeline.pack.keep is None else 80
    kept = kept if pipeline.keep is None else 80
    assert counts.sum() >= 0.6 * 2 * kept, f"{kind}: {counts.sum()} records of {2 * kept} came"


@pytest.mark.parametrize("kind", ["packed best_fit", "filtered"])
def test_a_state_resumes_exactly_on_other_host_counts(token_corpus: Path, kind: str) -> None:
    pipeline = KINDS[kind](token_corpus)
    assert_resumes_identically(
        lambda: cd.Loader(pipeline, hosts=2),
        lambda k, state: cd.Loader(pipeline, hosts=(1, 4)[k % 2], state=state),
        steps=7,
    )


@pytest.mark.parametrize("backend", ["sidecar", "colocated"])
def test_every_backend_gives_the_same_batches_and_resumes(token_corpus: Path, backend: str) -> None:
    """4 hosts through sidecars (a process and a source each) and through the colocated
    backend read the one-host batches of a packed and a filtered partitioned pipeline, and
    a state saved there resumes in process on 2 hosts."""
    for kind in ("packed best_fit", "filtered"):
        pipeline = KINDS[kind](token_corpus)
        expected = read_all(cd.Loader(pipeline))
        with cd.Loader(pipeline, hosts=4, backend=backend_of(backend)) as loader:
            got = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(3)]
            state = json.loads(json.dumps(loader.get_state()))
        assert_batches_equal(expected[:3], got, f"{kind}, {backend}")
        assert_batches_equal(expected[3:], read_all(cd.Loader(pipeline, hosts=2, state=state)), f"{kind}, resumed")


@pytest.mark.parametrize("backend", ["sidecar", "colocated"])
def test_a_padded_pipeline_that_names_none_on_every_backend(token_corpus: Path, backend: str) -> None:
    """An endless padded pipeline that names no partitions (12 chosen): 4 hosts through
    sidecars and through the colocated backend read the one-host batches, and a state saved
    there (through JSON) resumes in process on 2 hosts (tests/test_padded_partitions.py)."""
    pipeline = make_pipeline(token_corpus, epochs=None)
    assert pipeline.partitioning.partitions == 12
    expected = read_all(cd.Loader(pipeline), 8)
    with cd.Loader(pipeline, hosts=4, backend=backend_of(backend)) as loader:
        got = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(3)]
        state = json.loads(json.dumps(loader.get_state()))
    assert_batches_equal(expected[:3], got, backend)
    assert_batches_equal(expected[3:], read_all(cd.Loader(pipeline, hosts=2, state=state), 5), f"{backend}, resumed")


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """40 texts in row groups of 7 and a tokenizer trained on the text demo."""
    root = tmp_path_factory.mktemp("text")
    demo.write_text_corpus(root, files=1, rows_per_file=40, row_group_size=7)
    return root / "web", demo.train_tokenizer(root, vocab_size=400)


def test_tokenized_then_packed(text_corpus: tuple[Path, Path]) -> None:
    """Texts tokenized as they are read (`Pack(prepare=...)`), then packed, partition by
    partition: the same batches on 1, 2 and 4 hosts, and through a resume."""
    corpus, tokenizer = text_corpus
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(corpus), columns=["text"]),
        order=cd.Order("block", seed=3, window=2),
        global_batch_size=8,
        index_column="_index",
        pack=cd.Pack("tokens", 64, prepare=[cd.tokenize("text", str(tokenizer), output="tokens")]),
        partitions=4,
        epochs=None,
    )
    expected = read_all(cd.Loader(pipeline), 6)
    assert (expected[0]["segment_ids"] > 0).mean() > 0.5  # rows of tokens, not padding
    for hosts in (2, 4):
        assert_batches_equal(expected, read_all(cd.Loader(pipeline, hosts=hosts), 6), f"{hosts} hosts")
    with cd.Loader(pipeline, hosts=4) as loader:
        next(loader), next(loader)
        state = loader.get_state()
    assert_batches_equal(expected[2:], read_all(cd.Loader(pipeline, state=state), 4), "resumed on 1 host")


def test_a_filter_that_keeps_everything_is_the_padded_pipeline(token_corpus: Path) -> None:
    """Partition by partition, a filter that rejects nothing gives each partition its next
    rows: a filtered pipeline's partitions take turns of the one order (`shared`), so these
    are the batches of the pipeline without the filter, of one partition. A state that
    pipeline saved (one position) restores into the filtered one where each
    partition stood."""
    padded = make_pipeline(token_corpus, partitions=1, epochs=None)
    filtered = make_pipeline(token_corpus, keep=accept_all, partitions=4, epochs=None)
    expected = read_all(cd.Loader(padded), 12)
    assert_batches_equal(expected, read_all(cd.Loader(filtered, hosts=2), 12), "keep everything")
    with cd.Loader(padded) as loader:
        for _ in range(5):
            next(loader)
        state = loader.get_state()
    assert "parts" not in state
    assert_batches_equal(expected[5:], read_all(cd.Loader(filtered, hosts=4, state=state), 7), "from a position")


def test_a_state_resumed_at_another_batch_size_names_the_one_it_was_saved_at(token_corpus: Path) -> None:
    """A filtered partition's rows are part of a shuffled order: a state saved at one global
    batch size with the same partitions is a StateError that names the batch size it was
    saved at (not "give the partitions it was saved with": they are the same), and resuming
    there works. (A padded one resumes at any batch size its partitions divide:
    tests/test_padded_partitions.py.)"""
    def filtered(batch: int) -> cd.Pipeline:
        return make_pipeline(token_corpus, "global", keep=not_third, partitions=4, global_batch_size=batch, epochs=None)

    with cd.Loader(filtered(16)) as loader:
        next(loader)
        state = loader.get_state()
    with pytest.raises(cd.errors.StateError, match=r"same 4 partitions, of 4 rows a batch each.*global_batch_size=16\.") as raised:
        cd.Loader(filtered(32), state=state)
    assert "partitions it was saved with" not in str(raised.value)
    read_all(cd.Loader(filtered(16), state=state), 1)
    # the same partitions and batch size, another seed: the error names the seed, and nothing of partitions
    other_seed = {**state, "seed": state["seed"] + 1}
    with pytest.raises(cd.errors.StateError, match=r"different pipeline \(seed: state has \d+, pipeline has \d+\)") as raised:
        cd.Loader(filtered(16), state=other_seed)
    assert "partition" not in str(raised.value), raised.value


def test_states_name_what_they_need(token_corpus: Path) -> None:
    def packed(shuffle: str, partitions: int) -> cd.Pipeline:
        return make_pipeline(token_corpus, shuffle, transforms=[], pack=cd.Pack("tokens", 16), partitions=partitions, epochs=2)

    with cd.Loader(packed("none", 4)) as loader:
        next(loader)
        state = loader.get_state()
    assert state["parts"]["count"] == 4 and state["parts"]["phase"] == 1
    with pytest.raises(cd.errors.StateError, match=r"positions of 4 partitions.*this pipeline is of one partition.*partitions=4"):
        cd.Loader(packed("none", 1), state=state)
    with pytest.raises(cd.errors.StateError, match=r"4 partitions.*partitions=6.*give it the partitions=4"):
        cd.Loader(packed("none", 6), state=state)
    with pytest.raises(cd.errors.StateError, match=r"order: state has 'block:2/4x3 dealt', pipeline has 'block:2'.*saved with 4 partitions of 3 rows a batch each.*partitions=4 and global_batch_size=12"):
        cd.Loader(packed("block", 1), state={**state, "order": "block:2/4x3 dealt"})
    damaged = {**state, "parts": {**state["parts"], "deltas": "not base64!"}}
    with pytest.raises(cd.errors.StateError, match=r"partition positions \(`parts`\) are damaged"):
        cd.Loader(packed("none", 4), state=damaged)
    with pytest.raises(cd.errors.StateError, match=r"5 batches into its partitions' packing plans, which span 4"):
        cd.Loader(packed("none", 4), state={**state, "parts": {**state["parts"], "phase": 5}})
    checks = cd.verify.verify(packed("none", 4))  # each partition's own stream
    assert [c.status for c in checks] == ["PASS"] * 4, checks


def test_a_hostile_parts_entry_is_a_state_error_in_bounded_memory(token_corpus: Path) -> None:
    """A state whose `parts.deltas` inflates to 256 MB (from 250 kB), claims a billion
    partitions, or holds positions past 2**62 (int64, with room for what follows) is a StateError, in process (Loader, skip and
    lineage), before anything the size of the inflated bytes is held."""
    import base64
    import tracemalloc
    import zlib

    pipeline = make_pipeline(token_corpus, "none", transforms=[], pack=cd.Pack("tokens", 16), partitions=4, epochs=None)
    with cd.Loader(pipeline) as loader:
        next(loader)
        state = loader.get_state()
    bomb = base64.b64encode(zlib.compress(bytes(256 * 2**20), 9)).decode()
    hostile = {
        "bomb": ({"deltas": bomb}, r"partition positions \(`parts`\) are damaged.*bytes of 4 partitions"),
        "a billion partitions": ({"count": 10**9, "deltas": bomb}, r"positions of 1000000000 partitions.*partitions=4"),
        "base past 2**62": ({"base": 2**62 + 1}, r"damaged.*base=4611686018427387905"),
        "phase past int64": ({"phase": 2**64}, r"damaged.*phase=18446744073709551616"),
        "a position past 2**62": ({"base": 2**62 - 1, "width": 1, "deltas": base64.b64encode(zlib.compress(bytes([0, 1, 2, 3]))).decode()},
                                  r"damaged.*past 2\*\*62"),
    }
    tracemalloc.start()  # the process's own peak may already be past the bomb's size: count this test's allocations
    for name, (change, match) in hostile.items():
        assert_state_refused(pipeline, {**state, "parts": {**state["parts"], **change}}, match, set_state=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 100 * 2**20, f"the checks allocated up to {peak / 2**20:.0f} MB at once"


def test_a_parts_entry_of_floats_is_a_state_error_that_names_the_field(token_corpus: Path) -> None:
    """`parts` numbers that are floats (a count of 1e30 or Infinity, which passed the count
    check, a phase, width or base of Infinity: JSON reads them back so) are a StateError
    that names the field and its value, in `Loader(state=)`, `cd.skip` and `cd.lineage`,
    where `int()` of them raised a raw OverflowError; an integral float (4.0) is no int of
    a state either."""
    pipeline = make_pipeline(token_corpus, "none", transforms=[], pack=cd.Pack("tokens", 16), partitions=4, epochs=None)
    with cd.Loader(pipeline) as loader:
        next(loader)
        state = loader.get_state()
    inf = float("inf")
    for field, value in (("count", 1e30), ("count", inf), ("count", 4.0), ("phase", inf), ("width", inf), ("base", inf)):
        bad = json.loads(json.dumps({**state, "parts": {**state["parts"], field: value}}))
        named = re.escape(f"{field}={value!r}: not an int")
        match = rf"partition positions \(`parts`\) are damaged \(ValueError: {named}\): pass the dict that Loader.get_state\(\)"
        assert_state_refused(pipeline, bad, match, set_state=False)


def test_the_state_of_a_thousand_partitions_is_small() -> None:
    """1,024 partitions' own positions, spread over 300 records, take under a fifth of
    their JSON list in a state (about 8.2 bits each at the least), and come back as they were."""
    rng = np.random.default_rng(0)
    position = parts.start(10_000_000 + rng.integers(0, 300, 1024), phase=17)
    encoded = parts.encode_parts(position)
    assert len(json.dumps(encoded)) < len(json.dumps(position.tolist())) / 5, len(json.dumps(encoded))
    np.testing.assert_array_equal(parts.decode_parts(json.loads(json.dumps(encoded))), position)


def test_each_host_process_reads_its_share_of_the_row_groups(tmp_path: Path) -> None:
    """Each of 4 host pipelines of a packed pipeline, with a source of its own (as in a
    process of its own), decodes about a quarter of the row groups over the epoch with 16
    partitions (and a row group more at each host boundary of a window: two partitions'
    slices of a window meet inside a row group), and every row group with one partition."""
    ids = np.arange(6400)
    lengths = 1 + ids % 7
    tokens = pa.array([[int(i)] * int(n) for i, n in zip(ids, lengths, strict=True)], pa.list_(pa.int32()))
    pq.write_table(pa.table({"id": ids, "tokens": tokens}), tmp_path / "data.parquet", row_group_size=100)

    def decoded(partitions: int) -> int:
        pipeline = cd.Pipeline(
            source=cd.ArrowSource(str(tmp_path / "data.parquet")),
            order=cd.Order(shuffle="block", seed=1, window=8),
            global_batch_size=64,
            pack=cd.Pack("tokens", 16),
            partitions=partitions,
        )
        return row_groups_decoded(pipeline, 4)

    assert 64 <= decoded(16) <= 64 + 3 * 8, decoded(16)
    assert decoded(1) >= 3.5 * 64, decoded(1)


@pytest.mark.parametrize("kind", ["packed", "filtered"])
def test_a_host_reads_the_same_row_groups_epoch_after_epoch(tmp_path: Path, kind: str) -> None:
    """An endless packed pipeline that names no partitions (16 chosen), over 4 epochs: 4
    host pipelines, each with a source of its own (a cache that holds the corpus), decode
    the corpus about once between them, as one host does: each window's groups are dealt to
    the same places every epoch, so a host's slices stay on its own row groups. (A window
    dealt anew each epoch had them decode it about 2.7 times.) A filtered one's partitions
    take turns of the one order (`Partitioning.shared`), so each host decodes every row
    group, as hosts of one partition do: the cost that docs/scaling.md gives."""
    ids = np.arange(6400)
    lengths = 1 + ids % 7
    tokens = pa.array([[int(i)] * int(n) for i, n in zip(ids, lengths, strict=True)], pa.list_(pa.int32()))
    pq.write_table(pa.table({"id": ids, "tokens": tokens}), tmp_path / "data.parquet", row_group_size=100)
    settings: dict = dict(source=cd.ArrowSource(str(tmp_path / "data.parquet")), order=cd.Order("block", seed=1, window=8),
                          global_batch_size=64, epochs=None)
    if kind == "packed":
        pipeline, epoch = cd.Pipeline(**settings, pack=cd.Pack("tokens", 16)), 25  # about 256 records a batch
    else:
        pipeline, epoch = cd.Pipeline(**settings, transforms=[cd.pad_or_truncate("tokens", 7)], keep=not_third), 67
    assert pipeline.partitioning.partitions == 16
    assert row_groups_decoded(pipeline, 1, batches=4 * epoch) == 64
    if kind == "packed":
        assert row_groups_decoded(pipeline, 4, batches=4 * epoch) <= 1.3 * 64
    else:
        assert row_groups_decoded(pipeline, 4, batches=4 * epoch) == 4 * 64


def test_a_thousand_and_twenty_four_hosts_make_the_one_host_batches(tmp_path: Path) -> None:
    """A packed (next fit) and a filtered pipeline of 1,024 partitions over 8 files: hosts
    0, 511 and 1023 of 1,024, each alone, make their rows of the one-host batches, and host 3
    of 8 its 128 partitions' rows."""
    corpus = demo.write_corpus(tmp_path, files=8, rows_per_file=5000, row_group_size=1000, min_tokens=1, max_tokens=6)
    source = cd.ArrowSource(str(corpus), columns=["id", "tokens"])
    assert len(source.files) == 8
    common = dict(source=source, order=cd.Order("block", seed=4), global_batch_size=1024, index_column="_index")
    for pipeline in (
        cd.Pipeline(**common, pack=cd.Pack("tokens", 8, method="next_fit"), partitions=1024, epochs=None),
        cd.Pipeline(**common, transforms=[cd.pad_or_truncate("tokens", 6)], keep=not_third, partitions=1024, epochs=None),
    ):
        start = pipeline.at(37 * 1024)
        one = [c.columns for c, _ in zip(HostPipeline(pipeline).chunks(start), range(2), strict=False)]
        for host, hosts in ((0, 1024), (511, 1024), (1023, 1024), (3, 8)):
            own = pickle.loads(pickle.dumps(pipeline))
            got = [c.columns for c, _ in zip(HostPipeline(own, host, hosts).chunks(start), range(2), strict=False)]
            rows = slice(host * 1024 // hosts, (host + 1) * 1024 // hosts)
            for batch, (want, have) in enumerate(zip(one, got, strict=True)):
                for name in want:
                    np.testing.assert_array_equal(have[name], want[name][rows], err_msg=f"host {host} of {hosts}, {batch}: {name}")
        assert len(make_state(pipeline, start)["parts"]["deltas"]) < 100


@pytest.mark.usefixtures("own_cpu_budget")
@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_worker_processes_compute_slices_of_the_partitions(token_corpus: Path, backend: str) -> None:
    """With 2 workers, a host's partitions are cut into slices that the workers compute
    (each going on ahead on its own) beside the host's thread: the batches of no workers, for
    a packed pipeline on 3 hosts (of 4 partitions: two hosts share each middle partition, and
    each keeps its rows of the slices) and a filtered one on 2, and a state saved meanwhile
    resumes exactly."""
    def pipelines(first: list) -> tuple[cd.Pipeline, cd.Pipeline]:
        common = dict(epochs=None, global_batch_size=48)
        return (
            make_pipeline(token_corpus, transforms=first, pack=cd.Pack("tokens", 16), partitions=4, **common),
            make_pipeline(
                token_corpus, transforms=[*first, cd.pad_or_truncate("tokens", 8)], keep=not_third, partitions=12, **common
            ),
        )

    # the host's thread leaves CPU unused: the workers are taken on (the batches are the same without it); 50 ms a
    # chunk: beside four busy processes this test took 88 s with 10 ms, 45 s with 50 (the same, 15 s, on an idle machine)
    for pipeline, plain in zip(pipelines([IdleHost(0.05)]), pipelines([]), strict=True):
        hosts = 3 if pipeline.pack is not None else 2
        with cd.Loader(pipeline, hosts=hosts, backend=backend_of(backend, 2)) as loader:
            got = until_workers_made(loader)
            got += [to_numpy(next(loader)) for _ in range(30)]
            state = loader.get_state()
        kind = "packed" if pipeline.pack is not None else "filtered"
        want = read_all(cd.Loader(plain), len(got) + 5)
        assert_batches_equal(want[: len(got)], got, f"{kind}, 2 workers, {backend}, {len(got)} batches")
        assert_batches_equal(want[len(got) :], read_all(cd.Loader(plain, state=state), 5), f"{kind}, resumed")


@pytest.mark.usefixtures("own_cpu_budget")
def test_a_count_of_workers_moving_mid_stream_keeps_the_batches(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the worker count moving at every decision (none, 1, 2, 3, 1, ...; each change
    drops the chunks asked and cuts the slices again from where the stream stands), the
    batches are those of no workers, and a state saved meanwhile resumes."""
    from colo_data.host import worker_policy

    counts = itertools.cycle([0, 1, 2, 3, 1])
    moves = []

    def decide(self: worker_policy.WorkerPolicy) -> int:
        if self.due():
            self.count = next(counts)
            moves.append(self.count)
            self._start = self._clock()
        return self.count

    monkeypatch.setattr(worker_policy.WorkerPolicy, "decide", decide)
    monkeypatch.setattr(worker_policy, "DECIDE_S", 0.02)
    pipeline = make_pipeline(token_corpus, transforms=[], pack=cd.Pack("tokens", 16), partitions=12, epochs=None, global_batch_size=48)
    with cd.Loader(pipeline, backend=cd.InProcess(workers=3)) as loader:
        got = until_workers_made(loader)
        while len(moves) < 12:
            got += [to_numpy(next(loader)) for _ in range(10)]
            assert len(got) < 5000, f"the count moved {len(moves)} times in {len(got)} batches"
        state = loader.get_state()
    want = read_all(cd.Loader(pipeline, backend=cd.InProcess(workers=0)), len(got) + 5)
    assert_batches_equal(want[: len(got)], got, f"{len(got)} batches, the count moved through {moves}")
    resumed = read_all(cd.Loader(pipeline, state=state, backend=cd.InProcess(workers=0)), 5)
    assert_batches_equal(want[len(got) :], resumed, "resumed")


def reject_all(columns: dict) -> np.ndarray:
    return np.zeros(len(columns["id"]), bool)


def test_a_filter_that_rejects_everything_is_named_not_read_forever(token_corpus: Path) -> None:
    """An endless partitioned stream whose filter rejects two epochs' worth of records in a
    row, those of the host's partitions together, is a TransformError naming them, not a
    read that never ends."""
    pipeline = make_pipeline(token_corpus, keep=reject_all, partitions=4, epochs=None)
    with pytest.raises(cd.errors.TransformError, match=r"keep=reject_all\) accepted none of the last [\d,]+ records read in all, over 2 partitions \(partitions 0 and 1, .*two epochs.*Check the filter"):
        read_all(cd.Loader(pipeline, hosts=2), 1)
