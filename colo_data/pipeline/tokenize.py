"""`tokenize`: a batch transform that turns a string column into a `list<int32>` column of
token ids with a tokenizer's batch API: one call per batch, which a Hugging Face tokenizer
runs on its Rust threads and a SentencePiece processor in C++, never a Python call per
record."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from colo_data.errors import ConfigError, TransformError
from colo_data.io.columns import Column, Columns

Encode = Callable[[list[str]], Sequence[Sequence[int]]]


def _load(path: str) -> Any:
    """The tokenizer saved at `path`: a SentencePiece model (`.model`) or a Hugging Face
    `tokenizer.json`; a ConfigError naming the path when there is no file or it is neither."""
    if not Path(path).is_file():
        raise ConfigError(
            f"cd.tokenize: no tokenizer file at {path!r}: give the path of a Hugging Face tokenizer.json or of a "
            "SentencePiece .model"
        )
    if path.endswith(".model"):
        try:
            import sentencepiece
        except ImportError as error:
            raise ConfigError(f"cd.tokenize: {path!r} is a SentencePiece model: pip install sentencepiece") from error
        try:
            return sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as error:  # sentencepiece raises OSError or RuntimeError for a file it cannot read
            raise ConfigError(f"cd.tokenize: {path!r} is not a SentencePiece model: {error}") from error
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
        raise ConfigError(f"cd.tokenize: {path!r} is not a Hugging Face tokenizer.json: {error}") from error


def _sentencepiece(tokenizer: Any) -> bool:
    """Whether `tokenizer` is a `sentencepiece.SentencePieceProcessor`."""
    return type(tokenizer).__module__.split(".")[0] == "sentencepiece" and callable(getattr(tokenizer, "encode", None))


def _encoder(tokenizer: Any) -> Encode:
    """A function from texts to their ids: a Hugging Face tokenizer's `encode_batch_fast`
    (the ids of `encode_batch`, without computing character offsets) or `encode_batch`, a
    SentencePiece processor's `encode` of the whole list (its C++ batch call), or the
    callable itself."""
    if _sentencepiece(tokenizer):
        return lambda texts: tokenizer.encode(texts, out_type=int)
    batch = getattr(tokenizer, "encode_batch_fast", None) or getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return lambda texts: [encoding.ids for encoding in batch(texts)]
    return tokenizer


def _string_column(column: Column, name: str) -> Any:
    """`column` as one Arrow string array; a TransformError naming its type otherwise."""
    if isinstance(column, np.ndarray):
        raise TransformError(
            f"cd.tokenize({name!r}): column {name!r} is a numpy array of dtype {column.dtype}, expected a string column"
        )
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = array.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise TransformError(f"cd.tokenize({name!r}): column {name!r} is {kind}, expected a string column")
    return array


@dataclass(frozen=True)
class tokenize:  # noqa: N801 - used like a function: cd.tokenize("text", "tokenizer.json")
    """Tokenize a string column into a `list<int32>` column, as a Parquet column of token
    lists arrives (so `cd.pad_or_truncate` works on it). A null text gives an empty list; an
    empty string gives what the tokenizer makes of it. The ids are exactly those of the
    tokenizer's `encode_batch`, row for row.

    Args:
        column: the string column to tokenize.
        tokenizer: a Hugging Face `tokenizers.Tokenizer` or a
            `sentencepiece.SentencePieceProcessor` (sent to workers and sidecars inside the
            pipeline), the path of a `tokenizer.json` or of a SentencePiece `.model` (loaded
            once per process that runs the pipeline, so it must be readable there too), or
            any callable from a list of texts to a list of id lists. A SentencePiece
            processor encodes the whole list in one call (`encode(texts)`).
        output: the column that receives the ids; None replaces `column`.
    """

    column: str
    tokenizer: Any
    output: str | None = None
    _encode: Encode | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not (self.output is None or isinstance(self.output, str)):
            raise ConfigError(f"cd.tokenize({self.column!r}, output={self.output!r}): column names must be strings")
        if isinstance(self.tokenizer, (str, os.PathLike)):
            path = os.fspath(self.tokenizer)
            object.__setattr__(self, "tokenizer", path)
            object.__setattr__(self, "_encode", _encoder(_load(path)))  # a bad path fails here, not in a worker
        elif not (
            callable(getattr(self.tokenizer, "encode_batch", None)) or _sentencepiece(self.tokenizer) or callable(self.tokenizer)
        ):
            raise ConfigError(
                f"cd.tokenize({self.column!r}): tokenizer={self.tokenizer!r} is not a tokenizers.Tokenizer, a "
                "sentencepiece.SentencePieceProcessor, the path of a tokenizer.json or a SentencePiece .model, or a "
                "callable from a list of texts to a list of id lists"
            )

    def __getstate__(self) -> dict[str, Any]:
        """The transform without its loaded tokenizer: a path is loaded again, once, in the
        worker or sidecar that unpickles it."""
        return {**self.__dict__, "_encode": None}

    def encode(self, texts: list[str]) -> Sequence[Sequence[int]]:
        """The ids of `texts`, one list per text, from the tokenizer's batch call."""
        encode = self._encode
        if encode is None:
            encode = _encoder(_load(self.tokenizer) if isinstance(self.tokenizer, str) else self.tokenizer)
            object.__setattr__(self, "_encode", encode)
        ids = encode(texts)
        if len(ids) != len(texts):
            raise TransformError(
                f"cd.tokenize({self.column!r}): the tokenizer returned {len(ids)} id lists for {len(texts)} texts; "
                "it must return one list per text"
            )
        return ids

    def __call__(self, batch: Columns) -> Columns:
        """The batch with the ids of `column` in `output` (or in `column`)."""
        if self.column not in batch:
            raise TransformError(f"cd.tokenize: no column {self.column!r} in the batch; it has {sorted(batch)}")
        column = _string_column(batch[self.column], self.column)
        texts: list[Any] = column.to_pylist()
        present = np.ones(len(texts), dtype=bool) if not column.null_count else column.is_valid().to_numpy(zero_copy_only=False)
        ids = self.encode(texts if not column.null_count else [t for t in texts if t is not None])
        lengths = np.zeros(len(texts), dtype=np.int64)
        lengths[present] = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        return {**batch, self.output or self.column: tokens}
