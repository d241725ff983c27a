"""The built-in demos, written once into a cache folder and generated on this machine (no
download): a synthetic token corpus (Parquet files of variable-length `int32` token lists,
several row groups each) with the pipeline that `make bench` runs on it, and a text corpus
of three components ("web" prose, "code", "math", each a directory of Parquet files with a
`text` column) with a small BPE tokenizer trained on it, for `cd.tokenize`."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from colo_data.io.arrow_source import ArrowSource
from colo_data.pipeline.mix import Mix
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.order import Order, Shuffle
from colo_data.pipeline.pack import Pack
from colo_data.pipeline.tokenize import tokenize
from colo_data.pipeline.transforms import drop, pad_or_truncate

FILES, ROWS_PER_FILE, ROW_GROUP_SIZE = 8, 5_000, 1_000
MIN_TOKENS, MAX_TOKENS, VOCAB = 64, 2047, 32_000
_VERSION = "demo-v1"

TEXT_COMPONENTS = ("web", "code", "math")
TEXT_FILES, TEXT_ROWS_PER_FILE, TEXT_ROW_GROUP_SIZE = 2, 2_500, 500
TEXT_VOCAB = 8_192
TOKENIZER_FILE = "tokenizer.json"
_TEXT_VERSION = "text-v1"


def cache_dir() -> Path:
    """Where the demo corpus lives: `$COLO_DATA_CACHE`, else `~/.cache/colo-data`."""
    return Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data"))


def write_corpus(
    directory: str | os.PathLike[str],
    files: int = FILES,
    rows_per_file: int = ROWS_PER_FILE,
    row_group_size: int = ROW_GROUP_SIZE,
    min_tokens: int = MIN_TOKENS,
    max_tokens: int = MAX_TOKENS,
    seed: int = 0,
) -> Path:
    """Write `files` Parquet files of `rows_per_file` rows (`id: int64`, `tokens: list<int32>`
    of `min_tokens..max_tokens` items) into `directory`; ids are the global record indices."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in range(files):
        lengths = rng.integers(min_tokens, max_tokens + 1, rows_per_file)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, VOCAB, offsets[-1], dtype=np.int32)))
        ids = pa.array(np.arange(f * rows_per_file, (f + 1) * rows_per_file, dtype=np.int64))
        table = pa.table({"id": ids, "tokens": tokens})
        pq.write_table(table, out / f"part-{f:05d}.parquet", row_group_size=row_group_size)
    return out


def _cached(name: str, write: Callable[[Path], object]) -> Path:
    """`cache_dir()/name`, made by `write(directory)` on first use: written into a staging
    directory and renamed, so concurrent first uses are safe and a crash leaves no half."""
    target = cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write(staging)
        os.replace(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def corpus() -> Path:
    """The demo corpus directory, written on first use."""
    return _cached(_VERSION, write_corpus)


# Word lists of the text demo. Prose has some non-ASCII words so that byte-level BPE
# meets multi-byte characters.
_PROSE = (
    "the a of and to in is was for on that with as by at from it this be are or an have not "
    "people time year day world city river market school music garden letter window morning "
    "story history science water light road village station bridge library museum coffee "
    "walked found wrote opened built said saw made took gave kept moved carried remembered "
    "old new small large quiet bright early late green warm cold long short famous narrow "
    "café naïve Zürich São façade résumé Straße 東京 北京 Москва привет κόσμος 🙂"
).split()
_NAMES = "count total items value result index offset buffer node parent child queue key data row batch".split()
_OPS = ("+", "-", "*", "//", "%")


def _prose(rng: np.random.Generator) -> str:
    sentences = []
    for _ in range(int(rng.integers(1, 12))):
        words = rng.choice(_PROSE, int(rng.integers(4, 24))).tolist()
        sentences.append(" ".join(words).capitalize() + str(rng.choice([".", ".", ".", "!", "?"])))
    return " ".join(sentences)


def _code(rng: np.random.Generator) -> str:
    lines = []
    for f in range(int(rng.integers(1, 5))):
        a, b, c = rng.choice(_NAMES, 3, replace=False).tolist()
        lines += [f"def {a}_{f}({b}, {c}):", f'    """Return the {a} of {b} and {c}."""', f"    {a} = 0"]
        for _ in range(int(rng.integers(1, 6))):
            lines += [f"    for i in range({int(rng.integers(1, 100))}):", f"        {a} += {b}[i] {rng.choice(_OPS)} {c}"]
        lines += [f"    return {a}", ""]
    return "\n".join(lines)


def _math(rng: np.random.Generator) -> str:
    parts = []
    for _ in range(int(rng.integers(1, 8))):
        x, y, n = (int(v) for v in rng.integers(1, 1000, 3))
        parts.append(
            str(rng.choice([
                f"Let x = {x}/{y}. Then 2x + {n} = {2 * x + n * y}/{y}.",
                f"\\sum_{{i=1}}^{{{n}}} i^2 = {n * (n + 1) * (2 * n + 1) // 6}.",
                f"If {x}a + {y} = {n}, then a = ({n} - {y})/{x} ≈ {(n - y) / x:.4f}.",
                f"\\frac{{{x}}}{{{y}}} + \\frac{{{n}}}{{{y}}} = \\frac{{{x + n}}}{{{y}}}, and √{x * x} = {x}.",
            ]))
        )
    return " ".join(parts)


_TEXT_MAKERS: dict[str, Callable[[np.random.Generator], str]] = {"web": _prose, "code": _code, "math": _math}


def write_text_corpus(
    directory: str | os.PathLike[str],
    files: int = TEXT_FILES,
    rows_per_file: int = TEXT_ROWS_PER_FILE,
    row_group_size: int = TEXT_ROW_GROUP_SIZE,
    seed: int = 0,
) -> Path:
    """Write the text demo into `directory`: one sub-directory per component of
    `TEXT_COMPONENTS`, each `files` Parquet files of `rows_per_file` rows of generated text
    (`text: string`), in row groups of `row_group_size`."""
    out = Path(directory)
    for c, component in enumerate(TEXT_COMPONENTS):
        (out / component).mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, c])
        make = _TEXT_MAKERS[component]
        for f in range(files):
            texts = pa.array([make(rng) for _ in range(rows_per_file)], pa.string())
            pq.write_table(pa.table({"text": texts}), out / component / f"part-{f:05d}.parquet", row_group_size=row_group_size)
    return out


def train_tokenizer(directory: str | os.PathLike[str], vocab_size: int = TEXT_VOCAB) -> Path:
    """Train a byte-level BPE tokenizer of `vocab_size` ids on every `text` of the Parquet
    files under `directory` and save it as `directory/tokenizer.json`. Ids 0..2 are `<pad>`,
    `<s>` and `</s>`; every encoding is `<s> ... </s>` (so even an empty text has two ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = Path(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )

    def texts() -> Iterator[list[str]]:
        for path in sorted(root.rglob("*.parquet")):
            for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
                yield [t for t in batch.column(0).to_pylist() if t is not None]

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tokenizer.token_to_id("<s>")), ("</s>", tokenizer.token_to_id("</s>"))]
    )
    path = root / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path


def text_corpus() -> Path:
    """The text demo's directory (`web/`, `code/`, `math/` and `tokenizer.json`), written
    and trained on first use (a few seconds)."""

    def write(directory: Path) -> None:
        write_text_corpus(directory)
        train_tokenizer(directory)

    return _cached(_TEXT_VERSION, write)


def pipeline(
    data_dir: str | os.PathLike[str] | None = None,
    seq_len: int = 1024,
    global_batch_size: int = 32,
    shuffle: Shuffle = "block",
    seed: int = 0,
    epochs: int | None = 1,
) -> Pipeline:
    """The demo pipeline: tokens padded or cut to `seq_len`, batches of `global_batch_size`,
    with the global record index in `_index`."""
    directory = corpus() if data_dir is None else Path(data_dir)
    return Pipeline(
        source=ArrowSource(str(directory), columns=["id", "tokens"]),
        order=Order(shuffle=shuffle, seed=seed),
        transforms=[pad_or_truncate("tokens", seq_len)],
        global_batch_size=global_batch_size,
        epochs=epochs,
        index_column="_index",
    )


def lm_pipeline(
    data_dir: str | os.PathLike[str] | None = None,
    weights: dict[str, float] | None = None,
    seq_len: int = 1024,
    global_batch_size: int = 32,
    shuffle: Shuffle = "block",
    seed: int = 0,
) -> Pipeline:
    """The language-model demo: the text demo's components mixed by `weights` (default
    web 0.6, code 0.3, math 0.1), tokenized with its BPE as they are read and packed into
    rows of `seq_len` tokens; `_index` and `_component` say which record of which component
    each segment holds."""
    directory = text_corpus() if data_dir is None else Path(data_dir)
    chosen = weights if weights is not None else {"web": 0.6, "code": 0.3, "math": 0.1}
    components = {name: ArrowSource(str(directory / name), columns=["text"]) for name in TEXT_COMPONENTS}
    tokens = tokenize("text", str(directory / TOKENIZER_FILE), output="tokens")
    return Pipeline(
        source=Mix(components, chosen),
        order=Order(shuffle=shuffle, seed=seed),
        global_batch_size=global_batch_size,
        epochs=None,
        index_column="_index",
        pack=Pack("tokens", seq_len, prepare=[tokens, drop("text")]),
    )
