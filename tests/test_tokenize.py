"""`cd.tokenize` (issue 13): a string column becomes a `list<int32>` column whose ids are
exactly the tokenizer's `encode_batch`, row for row, on every backend and for 1, 2 and 3
hosts, for text with nulls (an empty list), empty strings, long and non-ASCII text; the
tokenizer travels to workers and sidecars as a path, a `Tokenizer` or a callable; bad
input is an error that names the column, the path or the count."""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
from collections import Counter
from pathlib import Path

import cloudpickle
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh
from pipelines import IdleHost, backend_of, until_workers_made
from tokenizers import Tokenizer

import colo_data as cd
from colo_data import demo
from colo_data.host.host_pipeline import HostPipeline
from colo_data.testing import read_all

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers and sidecars cannot import this test module

BATCH = 12  # divisible by 1, 2, 3 and 4 hosts
LONG = " ".join(["Der schnelle braune Fuchs springt über den faulen Hund, 東京 🙂 naïve"] * 300)  # about 20,000 characters
SPECIAL = [None, "", LONG, "東京 Zürich привет κόσμος 🙂 e\u0301", " ", None, "\n\t", "", "a" * 5_000, "ﬁ½²"]


@pytest.fixture(scope="session")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small text demo (3 components of 40 texts, with a tokenizer trained on it) and a
    corpus of its 120 texts with nulls, empty strings, long and non-ASCII ones in place of
    some: 3 Parquet files of 40 rows in row groups of 7. Returns (corpus, tokenizer.json)."""
    root = tmp_path_factory.mktemp("text")
    demo.write_text_corpus(root / "demo", files=1, rows_per_file=40, row_group_size=7)
    tokenizer = demo.train_tokenizer(root / "demo", vocab_size=400)
    texts = [t for c in demo.TEXT_COMPONENTS for t in pq.read_table(root / "demo" / c).column("text").to_pylist()]
    for i, special in enumerate(SPECIAL):
        texts[i * 11 + 3] = special
    (root / "corpus").mkdir()
    for f in range(3):
        table = pa.table({"text": pa.array(texts[f * 40 : (f + 1) * 40], pa.string())})
        pq.write_table(table, root / "corpus" / f"{f}.parquet", row_group_size=7)
    return root / "corpus", tokenizer


def expected_ids(corpus: Path, tokenizer: Path) -> list[list[int]]:
    """Every record's ids from `encode_batch` over the whole corpus at once; [] for a null."""
    texts = pq.read_table(corpus).column("text").to_pylist()
    encoded = iter(Tokenizer.from_file(str(tokenizer)).encode_batch([t for t in texts if t is not None]))
    return [[] if t is None else next(encoded).ids for t in texts]


def test_ids_are_encode_batchs_with_nulls_empty_long_and_non_ascii_text(text_data: tuple[Path, Path]) -> None:
    corpus, tokenizer = text_data
    table = pq.read_table(corpus)
    got = cd.tokenize("text", tokenizer)({"text": table.column("text").combine_chunks()})["text"]
    assert isinstance(got, pa.ListArray) and got.type == pa.list_(pa.int32()) and got.null_count == 0
    want = expected_ids(corpus, tokenizer)
    assert got.to_pylist() == want
    lengths = sorted(len(ids) for ids in want)
    assert lengths[:2] == [0, 0] and 2 in lengths and lengths[-1] > 2_000  # nulls, "" (<s> </s>) and the long text
    # the same type as a Parquet list<int32> column, so the list transforms take it alike
    assert got.type == pq.read_table(demo.write_corpus(corpus.parent / "tokens", files=1, rows_per_file=3)).column("tokens").type
    padded = cd.pad_or_truncate("text", 4)({"text": got})["text"]
    assert padded.dtype == np.int32 and padded.tolist() == [(ids + [0] * 4)[:4] for ids in want]


def loader_options(backend: str, hosts: int) -> dict:
    if backend == "colocated":  # one host per CPU device of the mesh
        return {"mesh": Mesh(np.array(jax.devices()[:hosts]), ("data",))}
    return {"hosts": hosts}


@pytest.mark.parametrize("hosts", [1, 2, 3])
@pytest.mark.parametrize("backend, workers", [("inprocess", 0), ("inprocess", 2), ("sidecar", 0), ("colocated", 0)])
def test_loader_batches_hold_encode_batchs_ids_on_every_backend_and_host_count(
    text_data: tuple[Path, Path], tmp_path: Path, backend: str, workers: int, hosts: int
) -> None:
    corpus, tokenizer = text_data
    want = expected_ids(corpus, tokenizer)
    length = max(map(len, want))  # wide enough for every id of the longest text
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(corpus), columns=["text"]),
        order=cd.Order(shuffle="block", seed=7, window=2),
        transforms=[cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", length)],
        global_batch_size=BATCH,
        index_column="_index",
    )
    if workers:  # more batches than the host's first chunk, so that the workers make some
        chunk = HostPipeline(pipeline, 0, hosts).chunk
        pipeline = dataclasses.replace(pipeline, epochs=chunk * BATCH // 120 + 2)
    batches = read_all(cd.Loader(pipeline, backend=backend_of(backend, workers, tmp_path), **loader_options(backend, hosts)))
    assert len(batches) == pipeline.epochs * 120 // BATCH
    seen: Counter[int] = Counter()
    for step, batch in enumerate(batches):
        assert batch["text"].shape == (BATCH, length) and batch["text"].dtype == np.int32
        for row, index in enumerate(batch["_index"].tolist()):
            padded = want[index] + [0] * (length - len(want[index]))
            np.testing.assert_array_equal(batch["text"][row], padded, err_msg=f"batch {step}, record {index}")
            seen[index] += 1
    assert seen == dict.fromkeys(range(120), pipeline.epochs)


class EncodeBatch:
    """A callable tokenizer, as a SentencePiece processor's `encode` is: texts -> id lists."""

    def __init__(self, tokenizer: Path, drop_last: bool = False) -> None:
        self.tokenizer, self.drop_last = Tokenizer.from_file(str(tokenizer)), drop_last

    def __call__(self, texts: list[str]) -> list[list[int]]:
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]
        return ids[:-1] if self.drop_last else ids


@pytest.mark.parametrize("kind", ["Tokenizer", "callable"])
@pytest.mark.usefixtures("own_cpu_budget")
def test_a_tokenizer_object_or_callable_travels_to_worker_processes(text_data: tuple[Path, Path], kind: str) -> None:
    corpus, path = text_data
    tokenizer = Tokenizer.from_file(str(path)) if kind == "Tokenizer" else EncodeBatch(path)
    want = expected_ids(corpus, path)
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(corpus), columns=["text"]),
        transforms=[IdleHost(0.3), cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", 16)],  # workers get work
        global_batch_size=BATCH,
        epochs=None,
        index_column="_index",
    )
    with cd.Loader(pipeline, backend=cd.InProcess(workers=2)) as loader:
        batches = until_workers_made(loader)
        batches += [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(len(want) // BATCH)]
    rows = {index: row.tolist() for b in batches for index, row in zip(b["_index"].tolist(), b["text"], strict=True)}
    assert rows == {i: (ids + [0] * 16)[:16] for i, ids in enumerate(want)}


def test_a_path_is_loaded_once_per_process_and_not_pickled(text_data: tuple[Path, Path], tmp_path: Path) -> None:
    """A tokenizer given by its path is loaded when the transform is made, and once more by
    the first batch of a copy unpickled elsewhere, never per batch: with the file moved
    away, every later batch still comes (a load would be a ConfigError)."""
    path, away = tmp_path / "tokenizer.json", tmp_path / "moved.json"
    shutil.copy(text_data[1], path)
    transform = cd.tokenize("text", str(path), output="ids")
    texts = pa.array(["a b", None, "c"])
    path.rename(away)
    first = transform({"text": texts})
    assert transform({"text": texts})["ids"].equals(first["ids"])
    payload = cloudpickle.dumps(transform)
    assert len(payload) < 1_000  # the path, not the tokenizer
    copy = cloudpickle.loads(payload)
    assert copy.tokenizer == str(path)
    with pytest.raises(cd.errors.ConfigError, match="no tokenizer file"):
        copy({"text": texts})  # the copy loads the file itself
    away.rename(path)
    again = copy({"text": texts})
    path.rename(away)
    assert copy({"text": texts})["ids"].equals(again["ids"])
    assert again["ids"].equals(first["ids"]) and again["text"] is texts  # output= keeps the text column
    assert first["ids"].to_pylist()[1] == []


def test_bad_input_is_a_named_error(text_data: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = text_data
    transform = cd.tokenize("text", path)
    with pytest.raises(cd.errors.TransformError, match=r"cd.tokenize\('text'\): column 'text' is int64, expected a string column"):
        transform({"text": pa.array([1, 2])})
    with pytest.raises(cd.errors.TransformError, match="column 'text' is a numpy array of dtype int32"):
        transform({"text": np.zeros(2, np.int32)})
    with pytest.raises(cd.errors.TransformError, match=r"no column 'text' in the batch; it has \['body'\]"):
        transform({"body": pa.array(["x"])})
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(cd.errors.ConfigError, match=f"no tokenizer file at '{missing}'"):
        cd.tokenize("text", missing)
    not_json = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"x": [1]}), not_json)
    with pytest.raises(cd.errors.ConfigError, match=f"'{not_json}' is not a Hugging Face tokenizer.json"):
        cd.tokenize("text", not_json)
    with pytest.raises(cd.errors.ConfigError, match="tokenizer=42 is not a tokenizers.Tokenizer"):
        cd.tokenize("text", 42)
    short = cd.tokenize("text", EncodeBatch(path, drop_last=True))
    with pytest.raises(cd.errors.TransformError, match="returned 1 id lists for 2 texts"):
        short({"text": pa.array(["a", "b"])})


def test_each_worker_gets_its_share_of_the_cpus_for_the_tokenizers_threads(
    text_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RAYON_NUM_THREADS` (the size of `tokenizers`' thread pool) is the CPU budget over the
    worker count in each worker process, unless the user set it."""
    from colo_data.runtime.budget import cpu_budget
    from colo_data.runtime.lifecycle import Lifecycle
    from colo_data.workers.processes import WorkerPool

    def worker_setting(env: str | None) -> set[str]:
        if env is None:
            monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("RAYON_NUM_THREADS", env)
        owner = Lifecycle("test workers")
        try:
            pool = WorkerPool(2, owner)
            corpus, tokenizer = text_data
            pipeline = cd.Pipeline(
                source=cd.ArrowSource(str(corpus), columns=["text"]), global_batch_size=4,
                transforms=[cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", 8)],
            )
            pool.feed(cloudpickle.dumps(pipeline), 0, 1, 0).ready(2)  # the workers start when a feed asks for them
            environs = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in pool.pids]
        finally:
            owner.close()
        return {v.decode().partition("=")[2] for e in environs for v in e if v.startswith(b"RAYON_NUM_THREADS=")}

    assert worker_setting(None) == {str(max(1, math.ceil(cpu_budget().cpus) // 2))}
    assert worker_setting("3") == {"3"}


@pytest.fixture(scope="session")
def sentencepiece_model(text_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece unigram model trained on the corpus' texts (under a second)."""
    import sentencepiece as spm

    corpus, _ = text_data
    texts = [t for t in pq.read_table(corpus).column("text").to_pylist() if t]
    prefix = tmp_path_factory.mktemp("spm") / "text"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=300, hard_vocab_limit=False, minloglevel=2
    )
    return prefix.with_suffix(".model")


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_sentencepiece_ids_are_the_processors_own(text_data: tuple[Path, Path], sentencepiece_model: Path, backend: str) -> None:
    """A SentencePiece processor, or the path of its .model, gives the ids of the processor's
    own batch encode of the same texts, through the loader (the processor pickled into the
    sidecar, the path loaded there)."""
    import sentencepiece as spm

    corpus, _ = text_data
    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    texts = pq.read_table(corpus).column("text").to_pylist()
    encoded = iter(processor.encode([t for t in texts if t is not None]))
    want = [[] if t is None else next(encoded) for t in texts]
    length = max(map(len, want))
    for tokenizer in (processor, sentencepiece_model):
        pipeline = cd.Pipeline(
            source=cd.ArrowSource(str(corpus), columns=["text"]),
            transforms=[cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", length)],
            global_batch_size=BATCH, index_column="_index",
        )
        for batch in read_all(cd.Loader(pipeline, backend=backend, hosts=2)):
            for row, index in enumerate(batch["_index"].tolist()):
                np.testing.assert_array_equal(batch["text"][row][: len(want[index])], want[index], err_msg=f"{tokenizer!r}")
    broken = sentencepiece_model.with_name("broken.model")
    broken.write_bytes(b"not a model")
    with pytest.raises(cd.errors.ConfigError, match=r"broken.model' is not a SentencePiece model"):
        cd.tokenize("text", broken)
