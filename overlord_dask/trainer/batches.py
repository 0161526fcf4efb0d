"""What a model receives of a decoded step: the label convention, a loss mask, ``max_seqlen``, the
``[1, C]`` layout, and the number of loss tokens of the whole step.

- ``labels="shifted"`` (the default): ``labels[i]`` is the token after ``input_ids[i]`` in the
  same document, ``-100`` at a document's last token and on padding; a piece of a split
  document keeps its true next token. For a loss on ``logits[i]`` vs ``labels[i]`` (Megatron,
  torchtitan, a plain ``cross_entropy``).
- ``labels="hf"``: unshifted, for models that shift themselves (Hugging Face
  ``model(input_ids, labels=...)``): ``labels[i] == input_ids[i]``, ``-100`` at the first token
  of every piece and on padding, so the model's own shift never predicts across documents. A
  split piece's last token then has no target (the next token is in another micro-batch). Not
  for context parallelism, where each rank holds slices of a sequence.

In both conventions a token the loss ignores (a prompt turn of a chat source, a masked label) has
label ``-100``.
- ``loss_mask=True`` adds ``loss_mask`` (float32, 1 where ``labels`` is not ``-100``); the
  default (None) adds it where the plan has sources whose loss ignores some tokens (chat turns,
  masked labels), which the batch says (``loss_masks``).
- ``batch_dim=True`` gives ``input_ids``, ``labels``, ``position_ids`` (and ``loss_mask``) the
  shape ``[1, C]`` that batch-first models take; ``cu_seqlens`` stays flat.

Every micro-batch also carries ``max_seqlen`` (its longest piece, for flash-attn's varlen
kernels) and ``step_loss_tokens``: how many labels are not ``-100`` in the whole step, over all
ranks and micro-batches, in the chosen convention (the planner knows it), so a per-token loss
``loss.sum() / step_loss_tokens`` needs no all-reduce.
"""

from __future__ import annotations

import numpy as np

from ..wire import IGNORE_INDEX, hf_labels

LABELS = ("shifted", "hf")
BATCH_FIELDS = ("input_ids", "labels", "position_ids", "loss_mask")


def check_options(labels: str, cp: int) -> None:
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {labels!r}")
    if labels == "hf" and cp > 1:
        raise ValueError(
            "labels='hf' (unshifted, the model shifts) does not fit context parallelism, where a rank holds "
            "slices of each sequence: use labels='shifted'"
        )


def shape(batch: dict, *, labels: str = "shifted", loss_mask: bool | None = None, batch_dim: bool = False) -> dict:
    """``batch`` (a decoded step, numpy) as the trainer asked for it."""
    if loss_mask is None:
        loss_mask = bool(batch.get("loss_masks"))
    counts = batch.get("loss_tokens")
    step_tokens = None if counts is None else int(counts[LABELS.index(labels)])
    return {
        **batch,
        "micro_batches": [_micro_batch(mb, labels, loss_mask, batch_dim, step_tokens) for mb in batch["micro_batches"]],
    }


def _micro_batch(mb: dict, labels: str, loss_mask: bool, batch_dim: bool, step_tokens: int | None) -> dict:
    out = dict(mb)
    cu = mb["cu_seqlens"]
    out["max_seqlen"] = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0  # (np.diff: twice the calls)
    if step_tokens is not None:
        out["step_loss_tokens"] = step_tokens
    if labels == "hf":
        out["labels"] = hf_labels(mb["labels"], cu, mb["num_tokens"])
    if loss_mask:
        out["loss_mask"] = (out["labels"] != IGNORE_INDEX).astype(np.float32)
    if batch_dim:
        for k in BATCH_FIELDS:
            if k in out:
                out[k] = out[k][None]
    return out
