"""`colo-data verify` and `colo_data.verify.verify`: they pass on a sound pipeline, fail on
deliberately broken ones (a transform that duplicates a record in place of another on one
host, one that swaps two rows, hidden state that a checkpoint does not hold, a packed
batch that loses a record) naming the batch, row and record, and explain what to do with
a pipeline that cannot be verified."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import colo_data as cd
from colo_data.cli import main
from colo_data.config import load_config
from colo_data.host.host_pipeline import HostPipeline
from colo_data.testing import to_numpy
from colo_data.verification.verify import Check, verify

COLO_DATA = Path(sys.executable).parent / "colo-data"  # the console script installed next to this Python
CONFIGS = Path(__file__).parent.parent / "configs"
BATCH, RECORDS = 12, 120
_config_numbers = itertools.count()

# The dataset definitions the tests' configs name, written next to them (as a user's
# module would be) so that the CLI imports them from its working directory.
PIPELINES = '''
"""Pipelines over the token corpus for test_verify: a sound one and broken variants."""
import numpy as np
import colo_data as cd


def tokens(corpus, batch=12, transforms=(), index=True):
    return cd.Pipeline(
        source=cd.ArrowSource(corpus, columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=7, window=2),
        transforms=[cd.pad_or_truncate("tokens", 8), *transforms],
        global_batch_size=batch,
        index_column="_index" if index else None,
    )


class CopyOver:
    """The bug: in a host piece that holds `record` and its `mates` but not `other`, the next
    row (all its columns) is copied over it; the records a piece holds pick the host count
    and the host (a piece holds whole host batches, as many as the host computes at a time)."""

    def __init__(self, record, mates, other, swap=False):
        self.record, self.mates, self.other, self.swap = record, mates, other, swap

    def __call__(self, batch):
        index = batch["_index"]
        at = np.flatnonzero(index == self.record)
        if not len(at) or not np.isin(self.mates, index).all() or self.other in index:
            return batch
        rows = [at[0] + 1, at[0]] if self.swap else [at[0] + 1]
        out = {}
        for name, column in batch.items():
            column = column.copy()
            column[at[0] : at[0] + len(rows)] = column[rows]
            out[name] = column
        return out


def broken(corpus, record, mates, other, swap=False):
    return tokens(corpus, transforms=[CopyOver(record, mates, other, swap)])


class Calls:
    """Hidden state that no checkpoint holds: a running count of the rows transformed."""

    def __init__(self):
        self.seen = 0

    def __call__(self, batch):
        rows = len(batch["_index"])
        self.seen += rows
        return {**batch, "seen": np.arange(self.seen - rows, self.seen)}


def stateful(corpus):
    return tokens(corpus, transforms=[Calls()])


class LoseRecord:
    """Drops `record` from its packed row's index (as if its tokens were lost)."""

    def __init__(self, record):
        self.record = record

    def __call__(self, batch):
        return {**batch, "_index": np.where(batch["_index"] == self.record, -1, batch["_index"])}


def packed(corpus, lose=None):
    return cd.Pipeline(
        source=cd.ArrowSource(corpus, columns=["id", "tokens"]),
        order=cd.Order(shuffle="global", seed=3),
        pack=cd.Pack("tokens", 16, keep=lambda columns: np.asarray(columns["id"]) % 3 != 0),
        transforms=[] if lose is None else [LoseRecord(lose)],
        global_batch_size=4,
        index_column="_index",
    )


def partitioned(corpus, kind="packed", lose=None):
    """An endless packed or filtered pipeline of 4 partitions, each reading its own stream."""
    keep = lambda columns: np.asarray(columns["id"]) % 3 != 0
    if kind == "packed":
        settings = dict(pack=cd.Pack("tokens", 16, keep=keep), transforms=[] if lose is None else [LoseRecord(lose)])
    else:
        settings = dict(keep=keep, transforms=[cd.pad_or_truncate("tokens", 8)])
    return cd.Pipeline(
        source=cd.ArrowSource(corpus, columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=3, window=2),
        global_batch_size=8,
        epochs=None,
        partitions=4,
        index_column="_index",
        **settings,
    )
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("verify")
    (directory / "verify_pipelines.py").write_text(PIPELINES)
    return directory


def config(workdir: Path, function: str, **args: object) -> Path:
    """A new config file naming `verify_pipelines:function` with `args` (JSON values are
    TOML values too)."""
    values = [f"{name} = {json.dumps(value)}" for name, value in args.items()]
    lines = [f'pipeline = "verify_pipelines:{function}"', "[args]", *values]
    path = workdir / f"{function}-{next(_config_numbers)}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def build(workdir: Path, monkeypatch: pytest.MonkeyPatch, function: str, **args: object) -> cd.Pipeline:
    monkeypatch.chdir(workdir)
    return load_config(config(workdir, function, **args)).build()


def colo_data_verify(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it (JAX gets the 4 test CPU devices)."""
    command = [str(COLO_DATA), "verify", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)


def lines(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The output's check lines by check name: `{"exactly once": "PASS  exactly once: ..."}`."""
    return {m.group(2): m.group(0) for m in re.finditer(r"^(PASS|FAIL|SKIP)  ([^:]+):.*$", result.stdout, re.M)}


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def host_1_of_2_rows(pipeline: cd.Pipeline, batch: int) -> tuple[int, int, dict[str, object]]:
    """The first two records that host 1 of 2 serves in `batch` (global rows 6 and 7), and
    the records that tell its pieces from other host counts' to the broken transform: rows 6
    and 11, which host 1 of 2 holds both of (hosts 2 and 3 of 4, one each), and row 5, which
    it does not (one host holds it with row 6)."""
    rows = [int(i) for i in HostPipeline(pipeline).indices_at(np.arange(BATCH) + batch * BATCH)]
    return rows[6], rows[7], {"mates": [rows[6], rows[11]], "other": rows[5]}


def test_cli_passes_on_a_sound_pipeline(workdir: Path, token_corpus: Path) -> None:
    result = colo_data_verify(config(workdir, "tokens", corpus=str(token_corpus)), cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    found = lines(result)
    assert found["identical batches"] == (
        "PASS  identical batches: hosts 1, 2, 4 give the same 10 batches, row for row in every column"
    )
    assert found["exactly once"] == (
        "PASS  exactly once: each record once per epoch over positions 0-119: epoch 0, with hosts 1, 2, 4"
    )
    assert found["seed order"] == (
        "PASS  seed order: every record comes where seed 7 (shuffle=block:2) puts it, with hosts 1, 2, 4"
    )
    assert found["resume"] == (
        "PASS  resume: state after 5 batches with 1 host, restored with 4 hosts: "
        "the remaining 5 batches are identical to the uninterrupted run's"
    )
    assert result.stdout.rstrip().endswith("verify: no check failed (4 passed)")


def test_cli_fails_naming_the_record_a_host_duplicates(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost, copied, tells = host_1_of_2_rows(build(workdir, monkeypatch, "tokens", corpus=str(token_corpus)), batch=3)
    path = config(workdir, "broken", corpus=str(token_corpus), record=lost, **tells)
    result = colo_data_verify(path, "--hosts", "1,2,4", "--resume-hosts", "2", cwd=workdir)
    assert result.returncode == 1, result.stdout + result.stderr
    found = lines(result)
    assert found["identical batches"] == (
        f"FAIL  identical batches: batch 3 row 6 differs in 'id', 'tokens', '_index': "
        f"record {lost} with 1 host, record {copied} with 2 hosts"
    )
    assert found["exactly once"] == (
        f"FAIL  exactly once: 2 hosts: record {copied} appears twice (batch 3 row 6 and batch 3 row 7); "
        f"record {lost} is missing (the order puts it at batch 3 row 6) (in all: 1 record too often, 1 missing)"
    )
    assert found["seed order"] == (
        f"FAIL  seed order: 2 hosts: batch 3 row 6 holds record {copied} where the seed's order has record {lost}"
    )
    # the 2-host run restored from 1 host's state at batch 5 is past the broken batch 3
    assert found["resume"].startswith("PASS  resume: state after 5 batches with 1 host, restored with 2 hosts")
    assert result.stdout.rstrip().endswith("verify: 3 of 4 checks failed")


def test_cli_explains_how_to_add_an_index_column(workdir: Path, token_corpus: Path) -> None:
    result = colo_data_verify(config(workdir, "tokens", corpus=str(token_corpus), index=False), cwd=workdir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the pipeline has no index column" in result.stderr
    assert 'add index_column="_index" to cd.Pipeline(...)' in result.stderr


def test_cli_usage_errors_exit_2(workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (click's runner): these fail before any batch is read."""
    monkeypatch.chdir(workdir)
    path = str(config(workdir, "tokens", corpus=str(token_corpus)))
    bad_hosts = CliRunner().invoke(main, ["verify", path, "--hosts", "1,0"])
    assert bad_hosts.exit_code == 2 and "give positive host counts separated by commas" in bad_hosts.stderr
    late = CliRunner().invoke(main, ["verify", path, "--steps", "4", "--resume-at", "4"])
    assert late.exit_code == 2, late.output
    assert "resume_at=4: the run reads 4 batches; give 0 <= resume_at < 4" in late.stderr


def test_cli_passes_on_the_demo_config(tmp_path: Path) -> None:
    result = colo_data_verify(CONFIGS / "demo.toml", "--steps", "20", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line.split("  ")[0] for line in lines(result).values()] == ["PASS"] * 4, result.stdout
    assert "hosts 1, 2, 4 give the same 20 batches" in result.stdout


def test_a_swap_on_one_host_breaks_the_order_not_exactly_once(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, tells = host_1_of_2_rows(build(workdir, monkeypatch, "tokens", corpus=str(token_corpus)), batch=7)
    pipeline = build(workdir, monkeypatch, "broken", corpus=str(token_corpus), record=first, swap=True, **tells)
    checks = by_name(verify(pipeline, hosts=(2, 1, 4)))
    assert checks["identical batches"].detail == (
        f"batch 7 row 6 differs in 'id', 'tokens', '_index': record {second} with 2 hosts, record {first} with 1 host"
    )
    assert checks["exactly once"].status == "PASS"
    assert checks["seed order"].detail == (
        f"2 hosts: batch 7 row 6 holds record {second} where the seed's order has record {first}"
    )
    assert checks["resume"].detail == (  # 4 hosts, restored after batch 5, do not repeat 2 hosts' swap
        "state after 5 batches with 2 hosts, restored with 4 hosts: batch 7 row 6 differs in 'id', 'tokens', "
        f"'_index': record {second} in the uninterrupted run, record {first} after the restore"
    )


def test_hidden_transform_state_fails_the_resume(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = verify(build(workdir, monkeypatch, "stateful", corpus=str(token_corpus)), hosts=(1,), resume_at=3)
    assert [(c.name, c.status) for c in checks] == [
        ("identical batches", "SKIP"), ("exactly once", "PASS"), ("seed order", "PASS"), ("resume", "FAIL"),
    ]
    assert checks[-1].detail.startswith(
        "state after 3 batches with 1 host, restored with 1 host: batch 3 row 0 differs in 'seen'"
    )


def test_host_counts_that_do_not_divide_the_batch_are_skipped(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 6 on 4 devices: verify's one-device mesh runs 1, 2 and 3 hosts."""
    pipeline = build(workdir, monkeypatch, "tokens", corpus=str(token_corpus), batch=6)
    checks = verify(pipeline, hosts=(1, 4, 2, 3), steps=7)
    assert [str(c).split(":")[0] for c in checks] == [
        "SKIP  4 hosts", "PASS  identical batches", "PASS  exactly once", "PASS  seed order", "PASS  resume",
    ]
    assert checks[1].detail.startswith("hosts 1, 2, 3 give the same 7 batches")
    assert checks[2].detail.startswith("each record once per epoch over positions 0-41: 42 of epoch 0's 120")
    assert checks[-1].detail.startswith("state after 3 batches with 1 host, restored with 3 hosts")
    with pytest.raises(cd.errors.ConfigError, match=r"hosts=\(4, 5\): none divides global_batch_size=6"):
        verify(pipeline, hosts=(4, 5))


def test_packed_pipeline_every_kept_record_once(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = verify(build(workdir, monkeypatch, "packed", corpus=str(token_corpus)))
    assert not any(c.failed for c in checks), checks
    assert "none of the 40 that the pack's keep rejects" in checks[1].detail


def test_packed_pipeline_losing_a_record_fails_naming_it(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = build(workdir, monkeypatch, "packed", corpus=str(token_corpus))
    kept = [int(i) for i in HostPipeline(pipeline).indices_at(np.arange(RECORDS)) if i % 3]
    lost = kept[20]
    checks = by_name(verify(build(workdir, monkeypatch, "packed", corpus=str(token_corpus), lose=lost)))
    assert checks["identical batches"].status == "PASS"  # every host count loses it
    assert re.fullmatch(
        rf"1 host: record {lost} is missing \(the order puts it at position \d+, in batch \d+\) "
        r"\(in all: 0 records too often, 1 missing\) \(fails with hosts 2, 4 too\)",
        checks["exactly once"].detail,
    ), checks["exactly once"].detail
    found = re.fullmatch(
        rf"1 host: batch \d+ row \d+ segment \d+ holds record (\d+) where the seed's order has record {lost} .*",
        checks["seed order"].detail,
    )
    assert found, checks["seed order"].detail
    # In the lost record's place: a record from later in the stream (which one depends on
    # where the packer finds room for it).
    assert int(found[1]) in kept[21:], (found[1], kept[21:])


def test_a_partitioned_pipeline_is_verified_partition_by_partition(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed and a filtered pipeline of 4 partitions (each reads its own stream at its
    own pace, a packing plan placing its records across several batches) pass every check,
    through the command too; one that loses a record fails, naming the partition, the record
    and where the partition's own stream has it (verify refused them all before)."""
    for kind in ("packed", "filtered"):
        result = colo_data_verify(config(workdir, "partitioned", corpus=str(token_corpus), kind=kind), cwd=workdir)
        assert result.returncode == 0, result.stdout + result.stderr
        assert [line.split("  ")[0] for line in lines(result).values()] == ["PASS"] * 4, result.stdout
        assert "each record once per epoch of its partition" in lines(result)["exactly once"], result.stdout
    pipeline = build(workdir, monkeypatch, "partitioned", corpus=str(token_corpus))
    plan = pipeline.plan_batches  # a partition's packing plan places its records across these batches
    checks = by_name(verify(pipeline, steps=plan + 1))  # a plan not yet ended at the end of the run
    assert [c.status for c in checks.values()] == ["PASS"] * 4, checks
    assert checks["exactly once"].detail.endswith("(the last batch, in packing plans not yet ended, not checked), with hosts 1, 2, 4")
    with cd.Loader(pipeline) as loader:
        lost = int(to_numpy(next(loader))["_index"][1, 0])  # batch 0, row 1: partition 0's (2 rows each)
    checks = by_name(verify(build(workdir, monkeypatch, "partitioned", corpus=str(token_corpus), lose=lost)))
    assert checks["identical batches"].status == "PASS"  # every host count loses it
    assert re.fullmatch(
        rf"1 host: partition 0: record {lost} is missing \(the order puts it at its own position \d+\) "
        r"\(in all: 0 records too often, 1 missing\) \(fails with hosts 2, 4 too\)",
        checks["exactly once"].detail,
    ), checks["exactly once"].detail


def test_library_refuses_what_it_cannot_verify(
    workdir: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(cd.errors.ConfigError, match="no index column"):
        verify(build(workdir, monkeypatch, "tokens", corpus=str(token_corpus), index=False))
    pipeline = build(workdir, monkeypatch, "tokens", corpus=str(token_corpus))
    with pytest.raises(cd.errors.ConfigError, match=r"resume_at=10: the run reads 10 batches"):
        verify(pipeline, resume_at=10)
    with pytest.raises(cd.errors.ConfigError, match=r"hosts=\(0,\)"):
        verify(pipeline, hosts=(0,))
