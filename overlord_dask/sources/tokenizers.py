"""Tokenizers and transforms, resolved by name when a plan is loaded.

The built-in ``byte`` tokenizer maps UTF-8 bytes to ids 3..258 and ends every document with EOS, so
the demo and tests need no model files. It runs on whole Arrow string arrays with numpy (no Python
loop per document).

``hf:PATH`` is a Hugging Face ``tokenizers`` file (``tokenizer.json``: BPE, WordPiece, Unigram; a
local path relative to the plan's folder, or any fsspec URL), loaded once per worker process and run
with its Rust batch encoder; each document ends with the file's end-of-text token if it has one
(``</s>``, ``<|endoftext|>``, ``<eos>`` or ``[SEP]``). Anything else is named as ``module:callable``.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import pyarrow as pa

from ..plan.base import import_callable, resolve_url
from ..vocab import EOS_ID, PAD_ID  # noqa: F401  (re-exported: tokenizers' ids)

BYTE_OFFSET = 3


def byte_tokenize(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize an Arrow (large_)string array: returns (tokens int32, offsets int64 [n+1]).

    Document i becomes ``utf8_bytes(i) + 3`` followed by EOS; a null string counts as empty.
    """
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    if pa.types.is_string(texts.type):
        off_dtype = np.int32
    elif pa.types.is_large_string(texts.type):
        off_dtype = np.int64
    else:
        raise TypeError(f"byte tokenizer needs a string column, got {texts.type}")
    n = len(texts)
    if n == 0:
        return np.zeros(0, np.int32), np.zeros(1, np.int64)
    _, off_buf, data_buf = texts.buffers()
    offs = np.frombuffer(off_buf, dtype=off_dtype)[texts.offset : texts.offset + n + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8)[offs[0] : offs[-1]] if data_buf is not None else np.zeros(0, np.uint8)
    if texts.null_count:  # a null slot may still span bytes in the data buffer: make it empty
        valid = ~np.asarray(texts.is_null())
        lens = np.diff(offs) * valid
        keep = np.repeat(valid, np.diff(offs))
        data = data[keep]
        offs = np.concatenate([[0], np.cumsum(lens)])
    else:
        offs = offs - offs[0]
    out_offsets = offs + np.arange(n + 1, dtype=np.int64)  # one EOS per document
    out = np.empty(int(out_offsets[-1]), dtype=np.int32)
    is_eos = np.zeros(len(out), dtype=bool)
    is_eos[out_offsets[1:] - 1] = True
    out[is_eos] = EOS_ID
    out[~is_eos] = data.astype(np.int32) + BYTE_OFFSET
    return out, out_offsets


def byte_detokenize(tokens: np.ndarray) -> str:
    """Inverse of :func:`byte_tokenize` for one document (drops EOS/PAD/BOS)."""
    t = np.asarray(tokens)
    t = t[t >= BYTE_OFFSET] - BYTE_OFFSET
    return t.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _wrap_python_tokenizer(fn: Callable) -> Callable[[pa.Array], tuple[np.ndarray, np.ndarray]]:
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"

    def tokenize(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        out = fn([t if t is not None else "" for t in texts.to_pylist()])
        docs = [np.asarray(d) for d in out]
        if len(docs) != len(texts):
            raise ValueError(f"tokenizer {name} returned {len(docs)} documents for {len(texts)} texts")
        for i, d in enumerate(docs):
            if d.ndim != 1:
                raise ValueError(f"tokenizer {name} returned a {d.ndim}-D array of shape {d.shape} for document {i}; expected a 1-D sequence of token ids")
            if d.size and not np.issubdtype(d.dtype, np.integer):
                raise ValueError(f"tokenizer {name} returned {d.dtype} values for document {i}; token ids must be integers")
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        return tokens, offsets  # SampleBlock checks the range of the ids

    return tokenize


EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "[SEP]")


@functools.lru_cache(maxsize=16)
def hf_tokenize(url: str) -> Callable[[pa.Array], tuple[np.ndarray, np.ndarray]]:
    """The ``hf:`` tokenizer for the file at ``url``: Arrow strings -> (tokens, offsets); each
    document ends with the file's end-of-text id. Cached: a worker loads each file once."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("hf: tokenizers need the 'tokenizers' package (pip install tokenizers)") from None
    import fsspec

    try:
        with fsspec.open(url, "r", encoding="utf-8") as f:
            tok = Tokenizer.from_str(f.read())
    except FileNotFoundError:
        raise ValueError(f"tokenizer file not found: {url!r}") from None
    except Exception as err:  # a file that is not a tokenizer: say which
        raise ValueError(f"cannot load tokenizer file {url!r}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    eos = [i for i in map(tok.token_to_id, EOS_NAMES) if i is not None][:1]

    def encode(texts: list[str]) -> list[list[int]]:  # the Rust batch encoder, then the one list-of-ids path
        return [e.ids + eos for e in tok.encode_batch(texts, add_special_tokens=False)]

    encode.__module__, encode.__qualname__ = "hf", url  # how errors name it: hf:URL
    return _wrap_python_tokenizer(encode)


TOKENIZERS: dict[str, Callable[[pa.Array], tuple[np.ndarray, np.ndarray]]] = {"byte": byte_tokenize}


def resolve_tokenizer(name: str, base_dir: str | None = None) -> Callable[[pa.Array], tuple[np.ndarray, np.ndarray]]:
    """A tokenizer by name: built-in, ``hf:PATH`` (relative to ``base_dir``, the plan's folder) or
    ``module:callable``."""
    if name in TOKENIZERS:
        return TOKENIZERS[name]
    if name.startswith("hf:"):
        return hf_tokenize(resolve_url(name[3:], base_dir))
    if ":" not in name:
        raise ValueError(f"unknown tokenizer: {name!r} is neither a built-in name nor of the form 'module:callable'; "
                         f"built-in tokenizers: {sorted(TOKENIZERS)}")
    try:
        return _wrap_python_tokenizer(import_callable(name))
    except ValueError as err:
        raise ValueError(f"unknown tokenizer: {err}; built-in tokenizers: {sorted(TOKENIZERS)}") from None
