"""A unit's records as documents of token ids (and a loss mask): the three kinds of record a
source may name, each into the same flat form (``tokens``, ``offsets [n + 1]``, ``mask`` or None).

- text (``text_field``): the tokenizer's ids, then the source's boundaries (BOS, EOS:
  ``tokenizers.add_boundaries``);
- chat (``messages_field``): the rendered conversation and its trained turns (``chat.py``);
- token ids (``tokens_field``), with a ``labels_field`` (-100: ignored) or ``loss_mask_field``.

A record that cannot become a document (a bad conversation, an image count that differs from its
placeholders, an undecodable image) is reported by its row (``Bad``); ``records.py`` stops with it
or keeps it as an empty document, as the source's ``on_bad_record`` says.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from . import arrow_views
from .chat import ChatError, check_messages, encode_rendered, trained_spans
from .tokenizers import ByteTokenizer, LoadedTokenizer, TokenizerError, flatten


class Bad(dict):
    """Row -> why that record cannot become a document."""


def chat_documents(
    source, loaded: LoadedTokenizer, base_dir, column: pa.Array, bad: Bad
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every conversation of ``column`` rendered, tokenized and masked; a bad one is empty."""
    template = loaded.template(base_dir, source.name)
    specials = loaded.specials()
    rendered = []
    for row, messages in enumerate(column.to_pylist()):
        try:
            rendered.append(
                trained_spans(
                    template, check_messages(messages, source.roles, source.train_roles), source.train_roles, specials
                )
            )
        except ChatError as err:
            bad[row] = str(err)
            rendered.append(("", []))
    ids, masks = [], []
    for row, (tok, mask) in enumerate(encode_rendered(loaded.tok, rendered)):
        if row not in bad and not mask.any():
            bad[row] = f"no token to train on once rendered (train_roles {source.train_roles})"
        if row in bad:
            tok, mask = [], np.zeros(0, np.uint8)
        ids.append(tok)
        masks.append(mask)
    tokens, offsets = flatten("chat", ids, len(ids))
    return tokens, offsets, (np.concatenate(masks) if masks else np.zeros(0, np.uint8))


def token_documents(source, table: pa.Table, list_parts) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Pre-tokenized records, with their mask from a labels or mask column."""
    offsets, values = list_parts(table.column(source.tokens_field).combine_chunks())
    tokens = arrow_views.values(values) if len(values) else np.zeros(0, np.int64)
    field = source.labels_field or source.loss_mask_field
    if field is None:
        return tokens, offsets, None
    m_off, m_val = list_parts(table.column(field).combine_chunks())
    if not np.array_equal(m_off, offsets):
        row = int(np.flatnonzero(np.diff(m_off) != np.diff(offsets))[0])
        raise ValueError(
            f"row {row}: {field!r} has {m_off[row + 1] - m_off[row]} entries for {offsets[row + 1] - offsets[row]} "
            "tokens"
        )
    vals = arrow_views.values(m_val) if len(m_val) else np.zeros(0, np.int64)
    if source.labels_field:
        ignored = vals == -100
        wrong = ~ignored & (vals != tokens)
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            row = int(np.searchsorted(offsets, i, side="right") - 1)
            raise ValueError(
                f"row {row}: label {int(vals[i])} at token {i - offsets[row]} is neither -100 nor the token "
                f"({int(tokens[i])}); "
                "labels_field holds unshifted labels (the trainer shifts them)"
            )
        return tokens, offsets, (~ignored).astype(np.uint8)
    return tokens, offsets, (vals != 0).astype(np.uint8)


def placeholder_pattern(loaded: LoadedTokenizer, source: str) -> np.ndarray:
    """The ids an image placeholder string encodes to: its own token, or (byte tokenizer) its bytes."""
    tid = loaded.tok.token_id(loaded.spec.image_token)
    if tid is not None and not isinstance(loaded.tok, ByteTokenizer):
        return np.array([tid], dtype=np.int64)
    if isinstance(loaded.tok, ByteTokenizer):
        return np.asarray(loaded.tok.encode([loaded.spec.image_token])[0], dtype=np.int64)
    raise TokenizerError(
        f"tokenizer {loaded.name!r} has no token {loaded.spec.image_token!r}, so image placeholders "
        "cannot be found after tokenization: add it to the tokenizer or name one it has as tokenizer.image_token"
    )


def take_placeholders(
    tokens, offsets, mask, pattern: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Remove every placeholder from the documents: (tokens, offsets, mask, placeholders per
    document, each one's position in its document without them)."""
    k = len(pattern)
    if len(tokens) < k:
        hits = np.zeros(0, np.int64)
    elif k == 1:
        hits = np.flatnonzero(tokens == pattern[0])
    else:
        win = np.lib.stride_tricks.sliding_window_view(tokens, k)
        hits = np.flatnonzero((win == pattern).all(axis=1))
        if len(hits) > 1:  # non-overlapping, first match wins
            keep, last = [], -k
            for h in hits.tolist():
                if h >= last + k:
                    keep.append(h)
                    last = h
            hits = np.asarray(keep, dtype=np.int64)
        doc_a = np.searchsorted(offsets, hits, side="right") - 1
        doc_b = np.searchsorted(offsets, hits + k - 1, side="right") - 1
        hits = hits[doc_a == doc_b]  # a match never spans two documents
    doc = np.searchsorted(offsets, hits, side="right") - 1
    n = len(offsets) - 1
    per_doc = np.bincount(doc, minlength=n).astype(np.int64)
    drop = np.zeros(len(tokens), dtype=bool)
    for j in range(k):
        drop[hits + j] = True
    before = np.cumsum(drop) - drop  # removed tokens before each token
    positions = hits - offsets[doc] - (before[hits] - before[offsets[doc]]) if len(hits) else hits
    new_offsets = offsets - np.concatenate([[0], np.cumsum(np.bincount(doc, minlength=n) * k)]).astype(np.int64)
    return tokens[~drop], new_offsets, (None if mask is None else mask[~drop]), per_doc, positions.astype(np.int64)


def emptied(tokens, offsets, mask, bad_rows) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The documents of ``bad_rows`` made empty."""
    if not len(bad_rows):
        return tokens, offsets, mask
    n = len(offsets) - 1
    bad = np.zeros(n, dtype=bool)
    bad[list(bad_rows)] = True
    lens = np.diff(offsets)
    keep = ~np.repeat(bad, lens)
    new = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens * ~bad, out=new[1:])
    return tokens[keep], new, (None if mask is None else mask[keep])
