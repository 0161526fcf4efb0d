"""Adapters for training frameworks that own the data loop: Hugging Face ``Trainer`` (and
``accelerate``), and torchtitan's data-loader shape. Each keeps the contract every rank's stream
relies on: a rank iterates its own stream, whole, in order.

- **Hugging Face ``Trainer`` / ``accelerate``.** ``accelerator.prepare(dataloader)`` shards an
  ``IterableDataset`` over the processes (every process keeps every n-th batch) or, with
  ``dispatch_batches=True`` (the Trainer's default for iterable datasets), reads on rank 0 only and
  splits its batches: either breaks a per-rank stream. :class:`HFBatches` yields a rank's
  micro-batches as the keyword arguments of a causal LM (``[1, C]`` tensors, unshifted labels, a
  document mask), and :class:`PerRankTrainerMixin` gives ``Trainer`` a plain ``DataLoader`` over
  it instead of a prepared one. Set ``gradient_accumulation_steps`` to the plan's
  ``micro_batches`` so that an optimizer step is a planned step. With ``accelerate`` alone,
  prepare the model and the optimizer, not the data loader.
- **torchtitan.** Its loop takes a ``BaseDataLoader``: an iterator of ``(input_dict, labels)``
  with ``state_dict()`` / ``load_state_dict()`` (DCP ``Stateful``). :class:`TitanDataLoader` has that
  shape without importing torchtitan (which needs a CUDA build of its kernels to import), and its
  state is topology-free: a job may resume with another number of data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

from .dataset import OverlordDataset
from .masks import document_mask

MODEL_INPUTS = ("input_ids", "position_ids", "labels")


class HFBatches:
    """A rank's stream as Hugging Face causal-LM keyword arguments, one micro-batch at a time:
    ``input_ids``, ``position_ids``, ``labels`` (unshifted: the model shifts) as ``[1, C]`` and
    ``attention_mask`` as the ``[1, 1, C, C]`` document mask (for ``attn_implementation="sdpa"``;
    ``document_mask=False`` leaves it out, for flash-attention's varlen path on ``position_ids``).
    Takes ``OverlordDataset``'s arguments."""

    def __init__(self, address: str, *, document_mask: bool = True, **kwargs):
        self.dataset = OverlordDataset(address, labels="hf", batch_dim=True, **kwargs)
        self.document_mask = document_mask

    def __iter__(self) -> Iterator[dict]:
        for mb in self.dataset:
            out = {k: mb[k] for k in MODEL_INPUTS}
            if self.document_mask:
                out["attention_mask"] = document_mask(mb["cu_seqlens"], mb["input_ids"].shape[-1])
            yield out

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


def per_rank_dataloader(batches: HFBatches):
    """A plain ``DataLoader`` over a rank's batches: no batching (they are built), no workers, no
    sharding."""
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(batches)

    return DataLoader(Stream(), batch_size=None, num_workers=0)


class PerRankTrainerMixin:
    """Mix into ``transformers.Trainer`` (``class MyTrainer(PerRankTrainerMixin, Trainer)``) with
    ``train_dataset=HFBatches(...)``: its train data loader is the rank's own stream, not one that
    ``accelerate`` shards or dispatches from rank 0."""

    def get_train_dataloader(self):
        return per_rank_dataloader(self.train_dataset)


class TitanDataLoader:
    """torchtitan's ``BaseDataLoader`` shape over a rank's stream: iterates ``({"input": ids},
    labels)`` per micro-batch (shifted labels, as torchtitan's loss takes them; with
    ``extra_inputs``, ``position_ids`` and ``cu_seqlens`` ride along in the input dict), and is
    DCP-``Stateful``. ``dp_rank``/``dp_world_size`` as torchtitan's ``ParallelAwareDataloader``
    takes them; other ``OverlordDataset`` arguments pass through."""

    def __init__(self, address: str, dp_rank: int, dp_world_size: int, *, extra_inputs: bool = True, **kwargs):
        self.dataset = OverlordDataset(address, dp_rank, dp_world_size, **kwargs)
        self.dp_rank, self.dp_world_size, self.extra_inputs = dp_rank, dp_world_size, extra_inputs

    def __iter__(self):
        for mb in self.dataset:
            inputs = {"input": mb["input_ids"]}
            if self.extra_inputs:
                inputs.update(position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"], max_seqlen=mb["max_seqlen"])
            yield inputs, mb["labels"]

    def state_dict(self) -> dict:
        return {"overlord": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state:  # an empty state (a fresh run) is valid, as in torchtitan
            self.dataset.load_state_dict(state["overlord"])
