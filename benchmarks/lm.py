"""Tokenization throughput, side by side in one run: `cd.tokenize` through cd.Loader against
the tokenizer's own `encode_batch` + numpy pad in one process (the machine's limit for this
pipeline), on the text demo (`colo_data.demo.text_corpus()`: "web", "code" and "math"
components, 15,000 texts, and the byte-level BPE tokenizer trained on them).

Pipeline: every text of the three components tokenized, ids padded or cut to `SEQ_LEN`,
batches of `BATCH`; each contender reads one whole epoch per round. Rounds are interleaved
and the median is reported, so that a noisy neighbour hits every contender alike. Run:
`make benchmarks` or `.venv/bin/python benchmarks/lm.py [--rounds N] [--quick] [--out DIR]`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from itertools import chain
from pathlib import Path

import harness
import jax
import numpy as np
import psutil
import pyarrow.parquet as pq
from demo_pad import numpy_pad
from harness import AFTER_FIRST, WHOLE
from tokenizers import Tokenizer

import colo_data as cd
from colo_data import demo

SEQ_LEN, BATCH = 512, 32

REFERENCE = "encode_batch + numpy pad, in file order, one process (reference)"
REFERENCE_FAST = "encode_batch_fast + numpy pad, in file order, one process"
LOADER = "colo-data Loader, cd.tokenize, block shuffle, 0 workers"
LOADER_NONE = "colo-data Loader, cd.tokenize, no shuffle, 0 workers"
LOADER_WORKERS = "colo-data Loader, cd.tokenize, block shuffle, 2 workers"
LOADER_SIDECAR = "colo-data Loader, cd.tokenize, block shuffle, sidecar backend"
LM_DEMO = "LM demo end to end (configs/lm.toml: 3-component cd.Mix, cd.tokenize, cd.Pack to 1024), 0 workers"
SP_REFERENCE = "SentencePiece encode (a row group's texts at once) + numpy pad, in file order, one process"
SP_TRANSFORMS = "cd.tokenize(SentencePiece processor) + cd.pad_or_truncate on the same row groups, one process"
SP_LOADER = "colo-data Loader, cd.tokenize(SentencePiece processor), no shuffle, 0 workers"
# (what, numerator, denominator, goal or None), ratios of whole-run records/s
RATIOS = (
    ("Loader (block, 0 workers) / encode_batch + numpy pad", LOADER, REFERENCE, ">= 0.9"),
    # cd.tokenize calls encode_batch_fast (the same ids, no offsets): the like-for-like ratio
    ("Loader (block, 0 workers) / encode_batch_fast + numpy pad", LOADER, REFERENCE_FAST, ">= 0.9"),
    ("Loader (no shuffle, 0 workers) / encode_batch + numpy pad", LOADER_NONE, REFERENCE, None),
    ("encode_batch_fast / encode_batch (both + numpy pad)", REFERENCE_FAST, REFERENCE, None),
    ("Loader (block), 2 workers / 0 workers", LOADER_WORKERS, LOADER, None),
    ("Loader (block), sidecar / in process", LOADER_SIDECAR, LOADER, None),
    ("LM demo end to end (mixture, tokenize, pack) / Loader (block, 0 workers), source records/s", LM_DEMO, LOADER, None),
    ("cd.tokenize(SentencePiece) + pad / SentencePiece's own batch encode + numpy pad", SP_TRANSFORMS, SP_REFERENCE, ">= 0.9"),
    ("Loader, cd.tokenize(SentencePiece) / SentencePiece's own batch encode + numpy pad", SP_LOADER, SP_REFERENCE, None),
)

# the performance page's figures: (the start of a ratio's name, what, peer)
HEADLINES = (
    (
        "Loader (block, 0 workers) / encode_batch_fast",
        "`cd.tokenize` through the Loader, block shuffle, in process",
        "the tokenizer's own `encode_batch_fast` + numpy pad, no shuffle",
    ),
    ("Loader (block), 2 workers / 0 workers", "the same Loader with 2 worker processes", "no workers"),
    ("LM demo end to end", "LM demo (3-component mixture, tokenize, pack to 1024), source records/s", "tokenize and pad alone"),
)


def reference(files: list[str], tokenizer: Tokenizer, fast: bool) -> Iterator[int]:
    """Read each row group in order, encode its texts in one batch call, pad with numpy,
    cut into batches: what a hand-written loop does, with no shuffle and no JAX (and the
    loader's only dropped records, the epoch's last partial batch, counted as read)."""
    encode = tokenizer.encode_batch_fast if fast else tokenizer.encode_batch
    return encoded(files, lambda texts: [e.ids for e in encode(texts)])


def sentencepiece_model(directory: Path) -> Path:
    """A SentencePiece unigram model of the demo's texts (8,000 pieces), trained once."""
    import sentencepiece as spm

    path = directory / "sentencepiece.model"
    if not path.exists():
        texts = pq.read_table(sorted(str(p) for p in directory.rglob("*.parquet"))).column("text").to_pylist()
        prefix = directory / "sentencepiece-tmp"
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=8000, hard_vocab_limit=False, minloglevel=2
        )
        prefix.with_suffix(".vocab").unlink()
        prefix.with_suffix(".model").rename(path)
    return path


def encoded(files: list[str], encode: Callable[[list[str]], list[list[int]]]) -> Iterator[int]:
    """`reference` with any batch encoder."""
    for path in files:
        reader = pq.ParquetFile(path, memory_map=True)
        for g in range(reader.num_row_groups):
            ids = encode(reader.read_row_group(g, columns=["text"]).column("text").to_pylist())
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            padded = numpy_pad(offsets, np.fromiter(chain.from_iterable(ids), np.int32, int(offsets[-1])), SEQ_LEN)
            for s in range(0, len(ids), BATCH):  # a row group's last batch may be short: every text counts
                yield len(padded[s : s + BATCH])


def transforms_on_row_groups(files: list[str], tokenizer: object) -> Iterator[int]:
    """`cd.tokenize` and `cd.pad_or_truncate` called on each row group's texts as `reference`
    reads them: the transforms alone, without the loader around them."""
    tokens, pad = cd.tokenize("text", tokenizer), cd.pad_or_truncate("text", SEQ_LEN)
    for path in files:
        reader = pq.ParquetFile(path, memory_map=True)
        for g in range(reader.num_row_groups):
            text = reader.read_row_group(g, columns=["text"]).column("text").combine_chunks()
            padded = pad(tokens({"text": text}))["text"]
            for s in range(0, len(padded), BATCH):
                yield len(padded[s : s + BATCH])


def colo_loader(directory: Path, shuffle: str, backend: cd.InProcess | cd.Sidecar, tokenizer: object = None) -> Iterator[int]:
    """cd.tokenize then cd.pad_or_truncate through cd.Loader: global jax.Arrays."""
    pipeline = cd.Pipeline(
        source=cd.ArrowSource(str(directory), columns=["text"]),
        order=cd.Order(shuffle=shuffle, seed=0),
        transforms=[cd.tokenize("text", tokenizer or directory / demo.TOKENIZER_FILE), cd.pad_or_truncate("text", SEQ_LEN)],
        global_batch_size=BATCH,
    )
    with cd.Loader(pipeline, backend=backend) as loader:
        for batch in loader:
            yield len(jax.block_until_ready(batch["text"]))


def lm_demo(directory: Path, records: int) -> Iterator[int]:
    """The LM demo pipeline (`configs/lm.toml`) through cd.Loader, until `records` source
    records are packed; yields the records each packed batch holds."""
    seen = 0
    with cd.Loader(demo.lm_pipeline(directory)) as loader:
        while seen < records:
            batch = jax.block_until_ready(next(loader))
            placed = int((np.asarray(batch["_component"]) >= 0).sum())
            seen += placed
            yield placed


def render(runs: harness.Runs, ratios: list[harness.Ratio], rounds: int, records: int, tokens: int) -> list[str]:
    """The Markdown tables of one run's measurements and ratios."""

    def rate(name: str, key: str = WHOLE) -> float:
        return harness.median(runs[name], key)

    lines = [
        f"Text demo ({records:,} texts, {tokens:,} tokens with the demo's {demo.TEXT_VOCAB:,}-id BPE tokenizer), "
        f"ids padded or cut to {SEQ_LEN}, batch {BATCH}; one epoch a round, median of {rounds} interleaved rounds; "
        f"{psutil.cpu_count()} CPUs. Ratios are of whole-run records/s.",
        "",
        "| pipeline | records/s, whole run | records/s after the first batch | first batch (s) | CPU s per 1k records |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {n} | {rate(n):,.0f} | {rate(n, AFTER_FIRST):,.0f} | {rate(n, 'first_batch_s'):.2f} | {rate(n, 'cpu_s_per_1k'):.3f} |"
        for n in runs
    ]
    return [*lines, "", *harness.ratio_table(ratios)]


def main() -> None:
    """Every contender, round by round; lm.md and lm.json."""
    args = harness.parse(harness.parser(__doc__))
    directory = demo.text_corpus()
    files = sorted(str(p) for p in directory.rglob("*.parquet"))
    tokenizer = Tokenizer.from_file(str(directory / demo.TOKENIZER_FILE))
    texts = pq.read_table(files).column("text").to_pylist()
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts))
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # JAX start-up outside the timings
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_model(directory)))

    contenders: dict[str, Callable[[], Iterator[int]]] = {
        REFERENCE: lambda: reference(files, tokenizer, fast=False),
        REFERENCE_FAST: lambda: reference(files, tokenizer, fast=True),
        LOADER: lambda: colo_loader(directory, "block", cd.InProcess()),
        LOADER_NONE: lambda: colo_loader(directory, "none", cd.InProcess()),
        LOADER_WORKERS: lambda: colo_loader(directory, "block", cd.InProcess(workers=2)),
        LOADER_SIDECAR: lambda: colo_loader(directory, "block", cd.Sidecar()),
        LM_DEMO: lambda: lm_demo(directory, len(texts)),
        SP_REFERENCE: lambda: encoded(files, lambda texts: processor.encode(texts, out_type=int)),
        SP_TRANSFORMS: lambda: transforms_on_row_groups(files, processor),
        SP_LOADER: lambda: colo_loader(directory, "none", cd.InProcess(), processor),
    }
    runs = harness.interleave(
        {name: partial(harness.measure, run, args.batches) for name, run in contenders.items()}, args.rounds
    )
    ratios = [harness.ratio_of_medians(what, runs[a], runs[b], WHOLE, goal) for what, a, b, goal in RATIOS]
    rate = harness.Headline(
        f"text demo tokenized (BPE), padded to {SEQ_LEN}: colo-data Loader, block shuffle, in process",
        harness.median(runs[LOADER], WHOLE),
        "records/s",
    )
    headlines = [rate, *harness.headlines(ratios, HEADLINES)]
    lines = render(runs, ratios, args.rounds, len(texts), tokens)
    harness.write_results("lm", args, lines, runs, ratios, headlines=headlines)


if __name__ == "__main__":
    main()
