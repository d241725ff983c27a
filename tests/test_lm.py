"""The whole language-model path (issue 13): a `cd.Mix` of text components, tokenized as
the records are read (`cd.Pack(prepare=[cd.tokenize(...)])`) and packed into rows. Every
segment of every packed row holds exactly the tokenizer's `encode_batch` ids of the record
that the index and component columns name, cut to the row length, in the mixture's order;
in process and through the sidecar. Real Parquet text, a BPE trained here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data import demo
from colo_data.testing import to_numpy

LENGTH, BATCH = 512, 4


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small text demo (3 components of 60 texts) and its tokenizer."""
    root = demo.write_text_corpus(tmp_path_factory.mktemp("lm"), files=1, rows_per_file=60, row_group_size=20)
    demo.train_tokenizer(root, vocab_size=600)
    return root


def expected_ids(root: Path) -> dict[tuple[int, int], list[int]]:
    """(component, record index) -> the tokenizer's encode_batch ids of that record."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(root / demo.TOKENIZER_FILE))
    out = {}
    for c, name in enumerate(demo.TEXT_COMPONENTS):
        texts = [t for f in sorted((root / name).glob("*.parquet")) for t in pq.read_table(f).column("text").to_pylist()]
        for i, encoding in enumerate(tokenizer.encode_batch(texts)):
            out[(c, i)] = encoding.ids
    return out


@pytest.mark.parametrize("backend", ["inprocess", "sidecar"])
def test_every_packed_segment_is_the_tokenizers_ids_of_the_record_it_names(text: Path, tmp_path: Path, backend: str) -> None:
    """The LM pipeline as it is (it chooses partitions: each reads, tokenizes and packs its own
    records) and with one partition (one stream: each batch holds the mixture's next records)."""
    chosen = demo.lm_pipeline(text, seq_len=LENGTH, global_batch_size=BATCH, shuffle="global")
    assert chosen.partitioned
    want = expected_ids(text)
    segments, _ = _segments(chosen, want, tmp_path, backend)
    assert len(segments) > BATCH * 12, "rows hold several records each"
    segments, per_batch = _segments(dataclasses.replace(chosen, partitions=1), want, tmp_path, backend)
    plain = demo.lm_pipeline(text, seq_len=LENGTH, global_batch_size=BATCH, shuffle="global")
    order = plain.source.bind(plain.order)
    components, own = order.components_at(np.arange(len(segments)))
    in_order = [(int(c), int(order.orders[c].indices_at(np.array([q]))[0])) for c, q in zip(components, own, strict=True)]
    for b, (start, stop) in enumerate(zip(per_batch, [*per_batch[1:], len(segments)], strict=True)):
        # a batch holds the mixture's next records (in its rows by fit, not in stream order)
        assert sorted(segments[start:stop]) == sorted(in_order[start:stop]), f"batch {b}: not the mixture's next records"


def _segments(
    pipeline: cd.Pipeline, want: dict, tmp_path: Path, backend: str
) -> tuple[list[tuple[int, int]], list[int]]:
    """The (component, record) of every segment of 12 batches, each checked against the
    tokenizer's ids of that record, and where each batch's segments start."""
    with cd.Loader(pipeline, backend=cd.Sidecar(shm_dir=str(tmp_path)) if backend == "sidecar" else backend) as loader:
        batches = [to_numpy(next(loader)) for _ in range(12)]
    segments, per_batch = [], []
    for batch in batches:
        per_batch.append(len(segments))
        for row in range(BATCH):
            for seg, (c, i) in enumerate(zip(batch["_component"][row], batch["_index"][row], strict=True)):
                if c < 0:
                    assert i < 0
                    continue
                place = batch["segment_ids"][row] == seg + 1
                got = batch["tokens"][row][place].tolist()
                assert got == want[(int(c), int(i))][:LENGTH], f"row {row} segment {seg}: component {c} record {i}"
                segments.append((int(c), int(i)))
    return segments, per_batch


def test_a_prepare_transform_must_keep_one_row_per_record(text: Path) -> None:
    def halve(batch: dict) -> dict:
        return {name: column[: len(column) // 2] for name, column in batch.items()}

    components = {n: cd.ArrowSource(str(text / n), columns=["text"]) for n in demo.TEXT_COMPONENTS}
    tokens = cd.tokenize("text", str(text / demo.TOKENIZER_FILE), output="tokens")
    pipeline = cd.Pipeline(
        source=cd.Mix(components, {n: 1 for n in components}), global_batch_size=BATCH, epochs=None,
        pack=cd.Pack("tokens", LENGTH, prepare=[tokens, halve]),
    )
    with pytest.raises(cd.errors.TransformError, match="keeps one row per record"), cd.Loader(pipeline) as loader:
        next(loader)
