"""Attention that respects document boundaries in a packed micro-batch.

A packed micro-batch holds several documents end to end (``cu_seqlens``); a token must attend to
earlier tokens of its own document only, or the loss of a document depends on what it was packed
with. Flash-attention's varlen kernels take ``cu_seqlens`` and ``max_seqlen`` directly; for
PyTorch's scaled-dot-product attention (and Hugging Face models with ``attn_implementation=
"sdpa"``, which use a 4-D boolean mask as it is) :func:`document_mask` builds the block-diagonal
causal mask. It is ``C × C`` booleans: fine for the short sequences of tests and small models;
long sequences want flash-attention or FlexAttention's block masks instead.
"""

from __future__ import annotations


def document_mask(cu_seqlens, capacity: int):
    """``[1, 1, C, C]`` boolean mask: token ``i`` attends to token ``j <= i`` of the same piece;
    padding (after the last piece) attends only to itself, so no row is empty."""
    import torch

    cu = torch.as_tensor(cu_seqlens).long()
    doc = torch.full((capacity,), -1, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    doc[: int(cu[-1])] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    ar = torch.arange(capacity)
    pad = doc < 0
    doc[pad] = len(lengths) + ar[pad]  # each padding token its own "document"
    causal = ar[:, None] >= ar[None, :]
    return ((doc[:, None] == doc[None, :]) & causal)[None, None]
