"""`cd.lineage(pipeline, state, steps=range(a, b))` and `colo-data lineage`: each global
step's rows' source records equal what a real `Loader` yielded (through the index column
and, for a mixture, the component column), for padded, filtered, packed and mixture
pipelines, with and without partitions; each record's file and row hold that record (its
`id` column, written as its index, read back from the Parquet file)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grain_pipelines as gp
import numpy as np
import pyarrow.parquet as pq
import pytest
from test_skip import pipeline_of, read

import colo_data as cd
from colo_data.testing import to_numpy

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

SAVED, AFTER = 3, 4  # batches read before the state, traced after it


@functools.cache
def ids(file: str) -> list[int]:
    """The `id` column of a corpus file: each record's index, written with it."""
    return pq.read_table(file, columns=["id"])["id"].to_pylist()


def loader_rows(pipeline: cd.Pipeline, batch: dict[str, np.ndarray]) -> list[list[tuple[str | None, int]]]:
    """Each row's (component, index) records in order, as the loader's batch names them."""
    size = pipeline.global_batch_size
    indices = batch["_index"].reshape(size, -1)
    column = pipeline.stream.component_column
    components = batch[column].reshape(size, -1) if column else np.zeros_like(indices)
    names = pipeline.stream.names
    return [
        [(names[c] if column else None, int(i)) for c, i in zip(cs, row, strict=True) if i >= 0]
        for cs, row in zip(components, indices, strict=True)
    ]


def traced_rows(step: dict) -> list[list[tuple[str | None, int]]]:
    """Each row's (component, index) records in order, as lineage names them; each record's
    file and row are checked to hold it on the way."""
    for row in step["rows"]:
        for origin in row:
            assert ids(origin["file"])[origin["row"]] == origin["index"], origin
    return [[(origin.get("component"), origin["index"]) for origin in row] for row in step["rows"]]


@pytest.mark.parametrize(
    "kind, partitions",
    [("padded", 1), ("packed", 1), ("packed", 4), ("filtered", 4), ("mixture", 1), ("packed mixture", 4)],
)
def test_lineage_names_the_records_the_loader_yielded(
    token_corpus: Path, mix_corpora: dict[str, Path], kind: str, partitions: int
) -> None:
    """A state saved on 2 hosts after 3 batches; the loader's next 4 batches are the 4 steps
    lineage traces from it, row by row and segment by segment."""
    pipeline = pipeline_of(kind, token_corpus, mix_corpora, partitions)
    with cd.Loader(pipeline, hosts=2) as loader:
        for _ in range(SAVED):
            next(loader)
        state = loader.get_state()
        batches = [to_numpy(next(loader)) for _ in range(AFTER)]
    assert state["step"] == SAVED
    traced = cd.lineage(pipeline, state, steps=range(SAVED, SAVED + AFTER))
    assert [step["step"] for step in traced] == list(range(SAVED, SAVED + AFTER))
    for step, batch in zip(traced, batches, strict=True):
        assert traced_rows(step) == loader_rows(pipeline, batch), f"{kind}, step {step['step']}"
    if "packed" in kind:
        assert max(len(row) for step in traced for row in step["rows"]) > 1, "packed rows of several segments"


def test_a_padded_step_a_million_steps_on_is_the_loaders(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """Padded, endless: the step a million steps after the state, traced without reading
    records, is what a loader made from the skipped state reads there; the skipped state's
    step counts the skipped batches, and lineage from it agrees with lineage from before."""
    pipeline = pipeline_of("padded", token_corpus, mix_corpora)
    _, state = read(pipeline, SAVED)
    far = SAVED + 1_000_000
    skipped = cd.skip(pipeline, state, batches=1_000_000)
    assert skipped["step"] == far
    [batch], _ = read(pipeline, 1, state=skipped)
    [step] = cd.lineage(pipeline, state, steps=range(far, far + 1))
    assert traced_rows(step) == loader_rows(pipeline, batch)
    assert cd.lineage(pipeline, skipped, steps=range(far, far + 1)) == [step]


@pytest.mark.parametrize("shuffle", ["none", "block"])
def test_steps_past_what_a_position_reaches_are_refused_as_skip_refuses_them(token_corpus: Path, shuffle: str) -> None:
    """Batches of 16: a step whose records start past 2**62 is a ConfigError that names the
    steps, as `cd.skip` of that many batches is, where lineage named other records (int64
    wrapped: step 2**60 named step 0's) or raised a raw ValueError; the last step that
    `cd.skip` reaches (starting at record 2**62) is what a loader from its state reads."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus), columns=["id", "tokens"]),
        order=cd.Order(shuffle=shuffle, seed=5, window=2),
        transforms=[cd.pad_or_truncate("tokens", 8)],
        global_batch_size=16,
        epochs=None,
        index_column="_index",
    )
    last = 2**62 // 16
    for step in (last + 1, 2**59, 2**60, 2**62):
        past = rf"{step}: {step:,} global batches of 16 records from position 0 take the stream to .* past the 2\*\*62"
        with pytest.raises(cd.errors.ConfigError, match=rf"steps {step}\.\.{past} .*ask for earlier steps"):
            cd.lineage(pipeline, None, steps=range(step, step + 1))
        with pytest.raises(cd.errors.ConfigError, match=rf"batches={past} .*skip fewer"):
            cd.skip(pipeline, None, batches=step)
    with pytest.raises(cd.errors.ConfigError, match=r"steps 0\.\.2305843009213693952: "):
        cd.lineage(pipeline, None, steps=range(0, 2**62, 2**61))  # refused before any step is named
    [batch], _ = read(pipeline, 1, state=cd.skip(pipeline, None, batches=last))
    [step] = cd.lineage(pipeline, None, steps=range(last, last + 1))
    assert traced_rows(step) == loader_rows(pipeline, batch)


def test_lineage_lists_what_a_packed_skip_left_out(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """The loss-spike recipe on a packed pipeline of 4 partitions: lineage from the
    checkpoint lists the skipped steps; lineage from the skipped state goes on where it
    stopped, with the same step numbers as from the checkpoint; and with a stride."""
    pipeline = pipeline_of("packed", token_corpus, mix_corpora, 4)
    _, state = read(pipeline, SAVED)
    skipped = cd.skip(pipeline, state, batches=2)
    from_checkpoint = cd.lineage(pipeline, state, steps=range(SAVED, SAVED + 4))
    assert cd.lineage(pipeline, skipped, steps=range(SAVED + 2, SAVED + 4)) == from_checkpoint[2:]
    assert cd.lineage(pipeline, state, steps=range(SAVED, SAVED + 4, 2)) == from_checkpoint[::2]
    assert cd.lineage(pipeline, None, steps=range(SAVED, SAVED + 1)) == from_checkpoint[:1]


def test_lineage_errors(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    """A step before the state, past a finite stream's end, steps not a range, a packed
    state saved without a step: named errors; a padded one without a step counts its
    position in batches."""
    packed = pipeline_of("packed", token_corpus, mix_corpora)
    _, state = read(packed, SAVED)
    with pytest.raises(cd.errors.StateError, match=r"step 2 is before this state, saved after step 2"):
        cd.lineage(packed, state, steps=range(2, 5))
    old = {k: v for k, v in state.items() if k != "step"}
    with pytest.raises(cd.errors.StateError, match="records no step"):
        cd.lineage(packed, old, steps=range(5, 6))
    with pytest.raises(cd.errors.ConfigError, match="give a range"):
        cd.lineage(packed, state, steps=[4, 5])  # type: ignore[arg-type]
    padded = pipeline_of("padded", token_corpus, mix_corpora)
    _, padded_state = read(padded, SAVED)
    del padded_state["step"]
    assert cd.lineage(padded, padded_state, steps=range(SAVED, SAVED + 1)) == cd.lineage(
        padded, None, steps=range(SAVED, SAVED + 1)
    )
    padded_finite = cd.Pipeline(source=cd.ArrowSource(str(token_corpus)), global_batch_size=8)  # 120 records
    assert len(cd.lineage(padded_finite, None, steps=range(14, 15))) == 1
    with pytest.raises(cd.errors.ConfigError, match=r"steps 14..15: the stream has 15 global batches \(steps 0..14\)"):
        cd.lineage(padded_finite, None, steps=range(14, 16))
    packed_finite = cd.Pipeline(source=cd.ArrowSource(str(token_corpus)), global_batch_size=8, pack=cd.Pack("tokens", 16))
    with pytest.raises(cd.errors.ConfigError, match=r"the stream has \d+ global batches"):
        cd.lineage(packed_finite, None, steps=range(0, 1000))


def test_a_grain_pipeline_has_no_lineage(tmp_path: Path) -> None:
    """A Grain pipeline's records carry no index colo-data can follow: a ConfigError."""
    paths = gp.write_records(tmp_path)
    pipeline = cd.GrainPipeline(make_dataset=functools.partial(gp.maxtext_like, paths=paths), global_batch_size=gp.BATCH)
    with pytest.raises(cd.errors.ConfigError, match=r"cd.lineage takes a cd.Pipeline, not GrainPipeline"):
        cd.lineage(pipeline, None, steps=range(0, 1))


PIPELINES = """
import colo_data as cd


def padded(corpus, global_batch_size=8):
    return cd.Pipeline(
        source=cd.ArrowSource(corpus, columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=5, window=2),
        transforms=[cd.pad_or_truncate("tokens", 8)],
        global_batch_size=global_batch_size,
        epochs=None,
        index_column="_index",
    )


def packed(corpus, length=16):
    return cd.Pipeline(
        source=cd.ArrowSource(corpus, columns=["id", "tokens"]),
        order=cd.Order(shuffle="block", seed=5, window=2),
        pack=cd.Pack("tokens", length),
        global_batch_size=4,
        epochs=None,
        index_column="_index",
    )
"""


def test_the_command_prints_lineage_and_names_what_does_not_fit(
    token_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`colo-data lineage CONFIG --state FILE --steps 3:5 --json`: cd.lineage's steps as JSON
    lines; a step before the state, steps backwards and a directory with no state: exit 2,
    named; another batch size than the state's: a note saying which."""
    from colo_data.config import load_config

    (tmp_path / "lineage_pipelines.py").write_text(PIPELINES)
    config = tmp_path / "padded.toml"
    config.write_text(f'pipeline = "lineage_pipelines:padded"\n[args]\ncorpus = "{token_corpus}"\n')
    monkeypatch.chdir(tmp_path)
    pipeline = load_config(config).build()
    _, state = read(pipeline, SAVED)  # type: ignore[arg-type]
    (tmp_path / "state.json").write_text(json.dumps(state))
    (tmp_path / "empty").mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "colo_data.cli", "lineage", str(config), *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)

    done = run("--state", "state.json", "--steps", "3:5", "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == cd.lineage(pipeline, state, steps=range(3, 5))
    early = run("--state", "state.json", "--steps", "1:2", "--arg", "global_batch_size=16")
    assert early.returncode == 2 and "step 1 is before this state, saved after step 2" in early.stderr, early.stderr
    assert "the state was saved with global_batch_size=8; " in early.stderr and "has 16" in early.stderr
    backwards = run("--steps", "5:3")
    assert backwards.returncode == 2 and "'5:3': give global steps as A:B" in backwards.stderr, backwards.stderr
    empty = run("--state", "empty", "--steps", "3")
    assert empty.returncode == 2 and "a directory holding 0 loader states" in empty.stderr, empty.stderr
    (tmp_path / "step" / "data").mkdir(parents=True)
    os.mkfifo(tmp_path / "step" / "data" / "loader_state.json")  # nobody writes it: reading would wait forever
    os.mkfifo(tmp_path / "fifo.json")
    for given in ("fifo.json", "step"):
        fifo = run("--state", given, "--steps", "3")
        assert fifo.returncode == 2 and "not a regular file (a FIFO" in fifo.stderr, fifo.stderr


def test_a_long_range_streams_in_bounded_memory(token_corpus: Path, tmp_path: Path) -> None:
    """`colo-data lineage --steps 0:60000 --json` (480,000 records) and its table print as they
    go: the command's resident memory stays under 400 MB (about 180 MB, 120 MB of it its
    start; the whole range built first took 2 GB), and the lines are every step's."""
    import psutil

    (tmp_path / "lineage_pipelines.py").write_text(PIPELINES)
    config = tmp_path / "padded.toml"
    config.write_text(f'pipeline = "lineage_pipelines:padded"\n[args]\ncorpus = "{token_corpus}"\n')
    for args, lines in ((["--json"], 60_000), ([], 480_001)):
        out = tmp_path / "out.txt"
        with out.open("w") as sink:
            command = [sys.executable, "-m", "colo_data.cli", "lineage", str(config), "--steps", "0:60000", *args]
            process = psutil.Popen(command, stdout=sink, stderr=subprocess.PIPE, cwd=tmp_path)
            peak = 0
            while process.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    peak = max(peak, process.memory_info().rss)
                time.sleep(0.02)
            assert process.wait(300) == 0, process.stderr.read().decode()
        assert sum(1 for _ in out.open()) == lines
        assert peak < 400 * 2**20, f"{args}: peak resident memory {peak / 2**20:.0f} MB"


def test_a_state_names_the_packing_its_steps_need(token_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed pipeline's state records its packing; lineage with another row length (a
    config traced without the run's `--arg length=...`) is a StateError naming both, exit 2,
    where it named other records with exit 0; with the run's length it traces the run's rows."""
    (tmp_path / "lineage_pipelines.py").write_text(PIPELINES)
    config = tmp_path / "packed.toml"
    config.write_text(f'pipeline = "lineage_pipelines:packed"\n[args]\ncorpus = "{token_corpus}"\nlength = 32\n')
    from colo_data.config import load_config

    monkeypatch.chdir(tmp_path)
    pipeline = load_config(config).build()
    with cd.Loader(pipeline) as loader:
        next(loader)
        state = loader.get_state()
    assert state["pack"] == "tokens/32/best_fit/64"
    (tmp_path / "state.json").write_text(json.dumps(state))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "colo_data.cli", "lineage", str(config), "--state", "state.json", "--steps", "1:3", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)

    other = run("--arg", "length=16")
    assert other.returncode == 2, other.stdout + other.stderr
    assert "packing 'tokens/32/best_fit/64'" in other.stderr and "this one packs 'tokens/16/best_fit/64'" in other.stderr
    same = run("--json")
    assert same.returncode == 0, same.stderr
    assert [json.loads(line) for line in same.stdout.splitlines()] == cd.lineage(pipeline, state, steps=range(1, 3))

