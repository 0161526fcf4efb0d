"""A fetched batch as the trainer receives it (:func:`for_trainer`): decoded from its wire form,
shaped as the stream's options ask, and, for torch trainers, as tensors in the dtypes a model
expects (int64 ids, labels and positions; int32 boundaries and per-document fields), pinned on
request."""

from __future__ import annotations

import numpy as np

from ..wire import DTYPES, decode_batch
from .batches import shape

TENSOR_FIELDS = {
    "input_ids": "long",
    "labels": "long",
    "position_ids": "long",
    "cu_seqlens": "int",
    "sample_ids": "long",
    "source_ids": "int",
    "chunk_ids": "int",
    "epochs": "int",
    "seg_piece": "int",
    "seg_chunk": "int",
}
TORCH_DTYPES = {**DTYPES, **{k: np.int64 if kind == "long" else np.int32 for k, kind in TENSOR_FIELDS.items()}}
"""What ``wire.decode_batch`` decodes into for a torch trainer: ``to_torch`` then copies nothing."""


def to_torch(mb: dict, pin: bool = False) -> dict:
    import torch

    out = {}
    for k, v in mb.items():
        if isinstance(v, np.ndarray):
            if not v.flags.writeable:
                v = v.copy()
            t = torch.from_numpy(v)
            kind = TENSOR_FIELDS.get(k)  # decoded in these dtypes already: a no-op then
            t = t.long() if kind == "long" else t.int() if kind == "int" else t
            out[k] = t.pin_memory() if pin else t
        else:
            out[k] = v
    return out


def for_trainer(raw: dict, options) -> dict:
    """A fetched step (``wire`` form) decoded, shaped (``batches.shape``: labels, mask, layout)
    and, with ``options.as_torch``, as torch tensors (pinned with ``options.pin_memory``)."""
    b = shape(decode_batch(raw, TORCH_DTYPES if options.as_torch else DTYPES), **options.batch_options)
    if options.as_torch:
        b = {**b, "micro_batches": [to_torch(mb, options.pin_memory) for mb in b["micro_batches"]]}
    return b
