"""Data constructors: build one rank's packed micro-batches for one step, on a worker.

Input: the planner's slice for (step, rank), a list of micro-batches each listing pieces
``[source, epoch, unit, doc, start, stop]``, and the sample blocks those pieces live in (Dask
resolves the block futures to local or peer-fetched blocks). Output: a dict of numpy arrays per
micro-batch, padded to the token capacity so every micro-batch has the same shape:

- ``input_ids``   int32 [C]  token ids; padding is ``PAD_ID`` after the last piece
- ``labels``      int32 [C]  next token of the same document, ``-100`` at a document's last token
  and on padding (a non-final piece of a split document keeps its true next token)
- ``position_ids`` int32 [C] restart at 0 for every piece; padding counts on from 0 as well
- ``cu_seqlens``  int32 [n+1] piece boundaries over the real tokens (flash-attn varlen layout)
- ``sample_ids``  int64 [n]  source-wide document ids; ``source_ids`` int32 [n] plan source index;
  ``chunk_ids`` int32 [n] piece index inside a split document; ``epochs`` int32 [n]
- ``num_tokens``  int        real (non-padding) tokens

Integer numpy arrays only: they serialize zero-copy, and the trainer converts them to torch.
"""

from __future__ import annotations

import numpy as np

from .sources.blocks import SampleBlock
from .sources.tokenizers import PAD_ID

IGNORE_INDEX = -100


def block_key(source: int, epoch: int, unit: int) -> str:
    return f"s{source}-e{epoch}-u{unit}"


def pack_micro_batch(pieces, blocks: dict[str, SampleBlock], capacity: int, piece_tokens: int) -> dict:
    n = len(pieces)
    input_ids = np.full(capacity, PAD_ID, dtype=np.int32)
    labels = np.full(capacity, IGNORE_INDEX, dtype=np.int32)
    position_ids = np.empty(capacity, dtype=np.int32)
    cu = np.zeros(n + 1, dtype=np.int32)
    sample_ids = np.empty(n, dtype=np.int64)
    source_ids = np.empty(n, dtype=np.int32)
    chunk_ids = np.empty(n, dtype=np.int32)
    epochs = np.empty(n, dtype=np.int32)
    pos = 0
    for k, (src, epoch, unit, doc, start, stop) in enumerate(np.asarray(pieces, dtype=np.int64).reshape(-1, 6).tolist()):
        block = blocks[block_key(src, epoch, unit)]
        toks = block.doc(doc)
        L = stop - start
        if pos + L > capacity:
            raise ValueError(f"micro-batch over capacity: {pos + L} > {capacity} tokens (planner bug)")
        input_ids[pos : pos + L] = toks[start:stop]
        nxt = toks[start + 1 : stop + 1]  # true next tokens inside the document
        labels[pos : pos + len(nxt)] = nxt
        position_ids[pos : pos + L] = np.arange(L, dtype=np.int32)
        pos += L
        cu[k + 1] = pos
        sample_ids[k] = block.sample_ids[doc]
        source_ids[k] = src
        chunk_ids[k] = start // piece_tokens
        epochs[k] = epoch
    position_ids[pos:] = np.arange(capacity - pos, dtype=np.int32)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seqlens": cu,
        "sample_ids": sample_ids,
        "source_ids": source_ids,
        "chunk_ids": chunk_ids,
        "epochs": epochs,
        "num_tokens": pos,
    }


def build_rank_batch(step: int, rank: int, micro_batches: list, blocks: dict[str, SampleBlock], capacity: int, piece_tokens: int) -> dict:
    """One Dask task per (step, rank): every micro-batch of that rank for that step."""
    return {
        "step": step,
        "rank": rank,
        "micro_batches": [pack_micro_batch(mb, blocks, capacity, piece_tokens) for mb in micro_batches],
    }


def batch_nbytes(batch: dict) -> int:
    return sum(v.nbytes for mb in batch["micro_batches"] for v in mb.values() if isinstance(v, np.ndarray))


def check_micro_batch(mb: dict, capacity: int) -> None:
    """Raise ValueError unless a packed micro-batch is self-consistent: ``cu_seqlens`` starts at 0,
    increases and ends at ``num_tokens``; ``position_ids`` restart at 0 exactly at each boundary;
    ``labels`` are the next token inside a piece and -100 on padding; per-piece arrays agree."""
    cu = mb["cu_seqlens"].astype(np.int64)
    n = len(cu) - 1
    if mb["input_ids"].shape != (capacity,) or mb["labels"].shape != (capacity,) or mb["position_ids"].shape != (capacity,):
        raise ValueError(f"token arrays must have shape ({capacity},)")
    if cu[0] != 0 or np.any(np.diff(cu) <= 0) or cu[-1] != mb["num_tokens"] or cu[-1] > capacity:
        raise ValueError(f"bad cu_seqlens {cu.tolist()} for num_tokens={mb['num_tokens']}")
    for k in ("sample_ids", "source_ids", "chunk_ids", "epochs"):
        if len(mb[k]) != n:
            raise ValueError(f"{k} has {len(mb[k])} entries for {n} pieces")
    pos = mb["position_ids"].astype(np.int64)
    expected = np.arange(cu[-1]) - np.repeat(cu[:-1], np.diff(cu))
    if not np.array_equal(pos[: cu[-1]], expected):
        raise ValueError("position_ids do not restart at the cu_seqlens boundaries")
    lab, ids = mb["labels"], mb["input_ids"]
    inner = np.ones(cu[-1], dtype=bool)
    inner[cu[1:] - 1] = False  # a piece's last token may label the next token of its document
    idx = np.flatnonzero(inner)
    if not np.array_equal(lab[idx], ids[idx + 1]):
        raise ValueError("labels are not the next input token inside a piece")
    if np.any(lab[cu[-1] :] != IGNORE_INDEX) or np.any(ids[cu[-1] :] != PAD_ID):
        raise ValueError("padding must have PAD input ids and -100 labels")
