"""What every tokenizer backend is: a :class:`TextTokenizer` that encodes texts without adding
special tokens, and the helpers that turn its output into a unit's documents (``flatten``,
``add_boundaries``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SPECIALS = ("bos", "eos", "pad")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks what the plan needs; the message names both."""


class TextTokenizer:
    """A loaded tokenizer: ``encode`` adds no special tokens (documents get theirs from the
    source's boundary policy, chats from their template) but reads special-token strings in the
    text as the special tokens. Subclasses fill the ids they know."""

    name: str = "?"
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    adds_bos: bool = False  # what the tokenizer itself does when asked to add special tokens
    chat_template: str | None = None

    @classmethod
    def from_spec(cls, spec, base_dir: str | None) -> TextTokenizer:
        """The backend built from the plan's :class:`~overlord_dask.plan.Tokenizer` (paths relative to ``base_dir``)."""
        raise NotImplementedError

    def encode(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_offsets(self, text: str) -> tuple[list[int], np.ndarray] | None:
        """Ids of ``text`` and each token's ``[start, end)`` character span (``[n, 2]``), or None
        when the backend cannot say (then chats are encoded segment by segment)."""
        return None

    def encode_offsets_batch(self, texts: list[str]) -> list | None:
        """:meth:`encode_offsets` of each text (None where the backend cannot say)."""
        return [self.encode_offsets(t) for t in texts]

    def token_id(self, token: str) -> int | None:
        return None

    def special_strings(self) -> dict[str, str]:
        """What chat templates see as ``bos_token``, ``eos_token``, ... (strings)."""
        return {}

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens written out (what ``overlord preview`` shows)."""
        return " ".join(map(str, ids))

    def encode_array(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Arrow strings -> (token ids, offsets [n + 1]), no special tokens added."""
        docs = self.encode([t if t is not None else "" for t in texts.to_pylist()])
        return flatten(self.name, docs, len(texts))


def flatten(name: str, docs, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` documents' id sequences (a tokenizer's output, named ``name`` in errors) as
    (token ids, offsets [n + 1]); a wrong count, a 2-D or a non-integer document is an error."""
    docs = [np.asarray(d) for d in docs]
    if len(docs) != n:
        raise ValueError(f"tokenizer {name} returned {len(docs)} documents for {n} texts")
    for i, d in enumerate(docs):
        if d.ndim != 1:
            raise ValueError(
                f"tokenizer {name} returned a {d.ndim}-D array of shape {d.shape} for document {i}; expected a 1-D "
                "sequence of token ids"
            )
        if d.size and not np.issubdtype(d.dtype, np.integer):
            raise ValueError(f"tokenizer {name} returned {d.dtype} values for document {i}; token ids must be integers")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    tokens = np.concatenate(docs).astype(np.int64, copy=False) if docs else np.zeros(0, np.int64)
    return tokens, offsets  # SampleBlock checks the range of the ids


def add_boundaries(
    tokens: np.ndarray,
    offsets: np.ndarray,
    bos: int | None,
    eos: int | None,
    mask: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Documents with ``bos`` before and ``eos`` after each one (None: not that one): (tokens,
    offsets, loss mask, image positions). A BOS is never a loss target, an EOS is (the model
    learns to end a document); image positions shift past the BOS.

    One pass over the tokens, in their own integer dtype where the boundary ids fit it: a load
    task's tokens are millions of ids, and a cast to int64 followed by one insertion per side
    was three copies of them (``benchmarks/formats.py``'s ``read_tokens_per_s`` measures a load)."""
    n = len(offsets) - 1
    if bos is None and eos is None:
        return tokens, offsets, mask, positions
    # each document's BOS at its start and EOS at its end, with its loss mask bit (a BOS is never
    # a target, an EOS is); inserted in document order: np.insert keeps the given order among
    # equal positions (an EOS, then the next document's BOS)
    sides = [(at, v, trained) for at, v, trained in ((offsets[:-1], bos, 0), (offsets[1:], eos, 1)) if v is not None]
    ids = [v for _, v, _ in sides]
    tokens = np.asarray(tokens)
    if tokens.dtype.kind not in "iu" or not all(np.can_cast(np.min_scalar_type(v), tokens.dtype) for v in ids):
        tokens = tokens.astype(np.int64)
    at = np.stack([a for a, _, _ in sides], axis=1).reshape(-1)
    tokens = np.insert(tokens, at, np.tile(np.asarray(ids, tokens.dtype), n))
    if mask is not None:
        mask = np.insert(mask, at, np.tile(np.asarray([t for _, _, t in sides], np.uint8), n))
    offsets = offsets + len(sides) * np.arange(n + 1)
    if positions is not None and bos is not None:
        positions = positions + 1
    return tokens, offsets, mask, positions
