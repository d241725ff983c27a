"""Data-quality metrics against an independent count from the batches the loader yielded
and the corpus's known records: packing fill from `segment_ids`, padding from the pad
value, the filter's keep rate from a known `keep` over a known corpus, truncations and
length percentiles from the records' known lengths (numpy's percentiles, within the
histogram's bucket resolution), mixture shares from the component column. In process with
two simulated hosts (each counts its own rows: the sums must be the batch's), once through
a sidecar and once through worker processes; and the Grafana dashboard queries only metrics
that a real loader's Prometheus endpoint exports."""

from __future__ import annotations

import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

import cloudpickle
import numpy as np
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

import colo_data as cd
from colo_data import demo
from colo_data.bench import report, runs
from colo_data.host.chunk_work import ChunkWork
from colo_data.runtime.lifecycle import Lifecycle
from colo_data.telemetry.quality import ColumnQuality, Lost, Quality, quality
from colo_data.testing import to_numpy
from colo_data.workers.processes import WorkerPool

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the sidecar and the workers cannot import this module

ROOT = Path(__file__).parent.parent
PAD, LENGTH = -1, 128  # the pad value (no token is negative) and the padded length
PACK = 32  # packed row length
WEIGHTS = {"web": 3, "code": 1}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A corpus of 120 records of 1..300 tokens (lengths past the histogram's exact range),
    and the mixture's two components of 1..40 tokens; ids are each corpus's record indices."""
    root = tmp_path_factory.mktemp("quality")
    return {
        "long": demo.write_corpus(root / "long", files=2, rows_per_file=60, row_group_size=10, min_tokens=1, max_tokens=300),
        "web": demo.write_corpus(root / "web", files=1, rows_per_file=60, row_group_size=10, min_tokens=1, max_tokens=40, seed=1),
        "code": demo.write_corpus(
            root / "code", files=1, rows_per_file=30, row_group_size=10, min_tokens=1, max_tokens=40, seed=2
        ),
    }


def lengths_of(corpus: Path) -> np.ndarray:
    """Each record's token count, by id."""
    table = pq.read_table(corpus)
    lengths = np.zeros(table.num_rows, np.int64)
    lengths[table["id"].to_numpy()] = [len(t) for t in table["tokens"].to_pylist()]
    return lengths


def keep_two_of_three(columns: dict) -> np.ndarray:
    """The filter: every record whose id is not a multiple of 3."""
    return np.asarray(columns["id"]) % 3 != 0


def filtered(corpus: Path) -> cd.Pipeline:
    """The long corpus in stream order (position = id), filtered, padded to LENGTH with PAD."""
    return cd.Pipeline(
        source=cd.ArrowSource(str(corpus), columns=["id", "tokens"]),
        order=cd.Order(shuffle="none"),
        transforms=[cd.pad_or_truncate("tokens", LENGTH, pad_value=PAD)],
        global_batch_size=12,
        keep=keep_two_of_three,
    )


def mixture(corpora: dict[str, Path], **pack: object) -> cd.Pipeline:
    """The two components mixed 3:1, packed into rows of PACK tokens (`pack`: more `cd.Pack` settings)."""
    components = {name: cd.ArrowSource(str(corpora[name]), columns=["id", "tokens"]) for name in WEIGHTS}
    return cd.Pipeline(
        source=cd.Mix(components, WEIGHTS),
        global_batch_size=8,
        epochs=None,
        index_column="_index",
        pack=cd.Pack("tokens", PACK, max_segments=4, **pack),  # type: ignore[arg-type]
        partitions=1,  # one stream: the counts are those of the batches read (partitions count theirs by plan)
    )


def assert_lengths(column: ColumnQuality, lengths: np.ndarray, length: int) -> None:
    """The column's record count, truncations and percentiles against the records' known
    lengths: each percentile is the top of the bucket holding numpy's (at most 1/16 above)."""
    assert column.records == len(lengths) and column.length_sum == lengths.sum()
    assert column.truncated == (lengths > length).sum() > 0
    for q, got in ((50, column.length_p50), (90, column.length_p90), (99, column.length_p99)):
        exact = np.percentile(lengths, q, method="inverted_cdf")
        assert exact <= got <= exact + exact / 16, (q, exact, got)
    assert dict(column.length_buckets)[512] == len(lengths)


def check_filtered(quality: Quality, batches: list[dict], lengths: np.ndarray) -> None:
    """The quality of the whole `filtered` stream against its batches and the corpus's `lengths`."""
    ids = np.concatenate([b["id"] for b in batches])
    tokens = np.concatenate([b["tokens"] for b in batches])
    consumed = int(ids.max()) + 1  # in stream order, the batches end at the last record kept
    assert quality.judged == consumed and quality.kept == len(ids)
    assert quality.keep_rate == len(ids) / consumed
    assert quality.dropped == (Lost("keep", int((np.arange(consumed) % 3 == 0).sum())),)
    (column,) = quality.columns
    assert (column.column, column.kind, column.length) == ("tokens", "padded", LENGTH)
    assert column.rows == len(ids) and column.tokens == (tokens != PAD).sum()
    assert column.padding_share == pytest.approx((tokens == PAD).mean())
    assert_lengths(column, lengths[ids], LENGTH)
    assert quality.truncated == (Lost(f"longer than {LENGTH}", column.truncated, "tokens"),)


def test_filtered_and_padded_in_process(corpora: dict[str, Path]) -> None:
    """Two hosts, each judging its slice of every batch's records and padding its rows."""
    with cd.Loader(filtered(corpora["long"]), hosts=2) as loader:
        batches = [to_numpy(b) for b in loader]
        telemetry = loader.telemetry()
    assert len(batches) == 6  # 80 of the 120 records kept: 6 batches, the 8 after them too few for one
    check_filtered(telemetry.quality, batches, lengths_of(corpora["long"]))
    assert telemetry.as_dict()["quality"]["keep_rate"] == telemetry.quality.keep_rate


def test_filtered_and_padded_through_a_sidecar(corpora: dict[str, Path]) -> None:
    """The counts made in the sidecar process come back with its slot announcements."""
    shm = Path(tempfile.mkdtemp(prefix="ring-test-", dir="/dev/shm"))
    try:
        with cd.Loader(filtered(corpora["long"]), backend=cd.Sidecar(workers=0, shm_dir=str(shm))) as loader:
            batches = [to_numpy(b) for b in loader]
            telemetry = loader.telemetry()
    finally:
        shm.rmdir()
    assert telemetry.hosts[0].runs_in.startswith("sidecar ")
    check_filtered(telemetry.quality, batches, lengths_of(corpora["long"]))


def test_worker_processes_send_their_counts_with_their_shares(corpora: dict[str, Path]) -> None:
    """Two worker processes each compute their share of a chunk and send its counts back
    with it: merged, they are the chunk's, as computed here and as its rows show."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(corpora["long"]), columns=["id", "tokens"]),
        transforms=[cd.pad_or_truncate("tokens", LENGTH, pad_value=PAD)],
        global_batch_size=12,
        epochs=None,
    )
    owner = Lifecycle("test")
    try:
        feed = WorkerPool(2, owner).feed(cloudpickle.dumps(pipeline), 0, 1, 0)
        feed.ask(12, 15, 2)  # 15 batches from the second on, shared by both workers
        chunk = feed.take()
    finally:
        owner.close()
    here = ChunkWork(pipeline)
    here.compute(12, 15)
    assert quality(chunk.quality or {}) == quality(here.quality.values)
    (column,) = quality(chunk.quality or {}).columns
    assert column.rows == len(chunk.columns["id"]) == 180 and column.tokens == (chunk.columns["tokens"] != PAD).sum()
    assert_lengths(column, lengths_of(corpora["long"])[chunk.columns["id"]], LENGTH)


def test_packed_mixture_in_process(corpora: dict[str, Path]) -> None:
    """Two hosts each count their packed rows; the shares are the placed records' components."""
    lengths = {name: lengths_of(corpora[name]) for name in WEIGHTS}
    names = list(WEIGHTS)
    # prefetch=0: the hosts make each batch when it is asked for, so the counts are those of the batches read
    with cd.Loader(mixture(corpora), hosts=2, prefetch=0) as loader:
        batches = [to_numpy(next(loader)) for _ in range(12)]
        got = loader.telemetry().quality
    segments = np.concatenate([b["segment_ids"] for b in batches])
    index, component = (np.concatenate([b[name] for b in batches]) for name in ("_index", "_component"))
    placed = index >= 0
    (column,) = got.columns
    assert (column.column, column.kind, column.length) == ("tokens", "packed", PACK)
    assert column.rows == len(segments) and column.tokens == (segments > 0).sum()
    assert column.fill == pytest.approx((segments > 0).mean()) and column.padding_share == pytest.approx(1 - column.fill)
    known = [lengths[names[c]][i] for c, i in zip(component[placed].tolist(), index[placed].tolist(), strict=True)]
    assert_lengths(column, np.array(known), PACK)
    assert got.keep_rate is None and got.dropped == ()
    counts = np.bincount(component[placed], minlength=len(names))
    for share, name, count in zip(got.mixture, names, counts, strict=True):
        assert (share.component, share.records) == (name, count)  # nothing dropped: the records read are those placed
        assert share.share == count / placed.sum() and share.weight == WEIGHTS[name] / sum(WEIGHTS.values())


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "filtered"])
def test_partitioned_pipelines_add_up_over_hosts(corpora: dict[str, Path], packed: bool) -> None:
    """Each host filters (and packs) its own partitions: the counts are the same for 2, 3 and
    4 hosts (3 share a partition at their boundaries: each counts its own rows, and one of them
    its verdicts), and those of the batches (read to the end of a plan: verdicts count by plan)."""
    how: dict = (
        {"pack": cd.Pack("tokens", LENGTH, max_segments=4, keep=keep_two_of_three)}
        if packed
        else {"keep": keep_two_of_three, "transforms": [cd.pad_or_truncate("tokens", LENGTH, pad_value=PAD)]}
    )
    source = cd.ArrowSource(str(corpora["long"]), columns=["id", "tokens"])
    pipeline = cd.Pipeline(source=source, global_batch_size=12, epochs=None, partitions=4, index_column="_index", **how)
    got = []
    for hosts in (2, 3, 4):
        with cd.Loader(pipeline, hosts=hosts, prefetch=0) as loader:
            batches = [to_numpy(next(loader)) for _ in range(2 * pipeline.plan_batches)]
            got.append(loader.telemetry().quality)
    assert got[0] == got[1] == got[2]
    index, tokens = (np.concatenate([b[name] for b in batches]) for name in ("_index", "segment_ids" if packed else "tokens"))
    placed = index[index >= 0]
    (column,) = got[0].columns
    assert column.rows == len(tokens) and column.tokens == ((tokens > 0) if packed else (tokens != PAD)).sum()
    assert_lengths(column, lengths_of(corpora["long"])[placed], LENGTH)
    assert keep_two_of_three({"id": placed}).all() and got[0].kept == len(placed) < got[0].judged
    assert got[0].dropped == (Lost("keep", got[0].judged - got[0].kept),)


def test_bench_plot_draws_the_fill_and_the_shares(corpora: dict[str, Path], tmp_path: Path) -> None:
    """`colo-data bench --plot` of a packed mixture: a panel for the fill, one for the shares."""
    run = runs.run_loader(mixture(corpora), steps=30, warmup=2, step_s=0, loader_options={"backend": "inprocess"})
    assert len(run.quality) == 30 and run.quality[-1][1].mixture
    titles = report.plot([run], str(tmp_path / "bench.png"), "quality")
    assert titles[2:] == ["fill of packed and padded columns, between samples", "mixture shares so far (dashed: weights)"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def queried_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers once label values,
    matchers, ranges and grouping label lists are taken out, less functions and keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {name for name in re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", expr) if name not in KEYWORDS}


def test_the_grafana_dashboard_queries_exported_metrics(corpora: dict[str, Path]) -> None:
    """Every metric a panel of configs/grafana/colo-data.json queries is one that a packed,
    filtered mixture's loader serves; every panel reads the dashboard's Prometheus variable."""
    dashboard = json.loads((ROOT / "configs" / "grafana" / "colo-data.json").read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    queried = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${" + variable["name"] + "}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = queried_metrics(target["expr"])
            assert names and all(n.startswith("colo_data_") for n in names), target["expr"]
            queried |= names
    export = cd.telemetry.TelemetryExport(prometheus_port=0, prometheus_addr="127.0.0.1")
    pipeline = mixture(corpora, keep=keep_two_of_three)
    with cd.Loader(pipeline, warmup=2, telemetry_export=export) as loader:
        for _ in range(12):
            next(loader)
        text = urllib.request.urlopen(f"http://127.0.0.1:{loader.prometheus_port}/metrics", timeout=10).read().decode()
    exported = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    assert queried <= exported, f"queried, not exported: {sorted(queried - exported)}"
    assert {"colo_data_input_wait_share", "colo_data_packing_fill", "colo_data_keep_rate", "colo_data_component_share"} <= queried
