"""``OverlordDataset``: one consumer's stream as a ``torch.utils.data.IterableDataset``.

In its own module so that importing ``overlord_dask`` (as every Dask worker does to run a load
or constructor task) does not import torch: that would cost each worker seconds at start and
hundreds of MB for nothing. ``overlord_dask.OverlordDataset`` imports it on first use.
"""

from __future__ import annotations

from torch.utils.data import IterableDataset

from .options import StreamOptions
from .place import place
from .stream import RankStream


class OverlordDataset(IterableDataset):
    """``torch.utils.data.IterableDataset`` of one consumer's packed micro-batches (torch tensors).

    Where the trainer sits: ``rank`` and ``dp`` (its data-parallel rank and the number of them),
    or a ``device_mesh`` (``torch.distributed.DeviceMesh`` with named dimensions: ``dp_dims``
    are data-parallel, default every dimension named like ``dp``/``dp_shard``/``dp_replicate``;
    ``cp_dim`` is context-parallel; every other dimension, tensor or pipeline parallelism, makes
    replicas that receive the same batches), or neither: ``RANK`` and ``WORLD_SIZE`` from the
    launcher (torchrun, srun), every process its own data-parallel rank. ``replica`` numbers a
    tensor- or pipeline-parallel rank by hand.

    ``labels`` (``"shifted"``, or ``"hf"`` for models that shift them themselves),
    ``loss_mask`` and ``batch_dim`` (``[1, C]`` tensors) choose what the model receives
    (``trainer/batches.py``); these and the other options of the stream (``timeout``,
    ``prefetch_steps``, ``prefetch_bytes``, ``pin_memory``, ``reconnect_timeout``) are the fields
    of :class:`~overlord_dask.trainer.options.StreamOptions`, given as keyword arguments or as
    ``options=``. Iterate it directly (it fetches ahead in the background itself), or, where a
    framework wants one, in ``DataLoader(ds, batch_size=None, num_workers=0)``: batches are
    already built by the service, so DataLoader workers would only split (and break) the
    ordered stream. ``pin_memory=True`` pins them for CUDA trainers. ``state_dict()`` /
    ``load_state_dict()`` follow torchdata's ``StatefulDataLoader`` and DCP's ``Stateful``.
    ``split="eval"`` iterates the rank's share of the evaluation stream (the plan's held-out
    units): finite, the same at every pass.
    """

    def __init__(
        self,
        address: str,
        rank: int | None = None,
        dp: int | None = None,
        *,
        device_mesh=None,
        dp_dims: tuple[str, ...] | None = None,
        cp_dim: str = "cp",
        cp_rank: int | None = None,
        replica: int | None = None,
        split: str = "train",
        options: StreamOptions | None = None,
        **option_kwargs,
    ):
        super().__init__()
        p = place(rank, dp, cp_rank=cp_rank, replica=replica, device_mesh=device_mesh, dp_dims=dp_dims, cp_dim=cp_dim)
        self.address, self.rank, self.dp, self.cp_rank, self.replica = address, p.rank, p.dp, p.cp_rank, p.replica
        self.options = StreamOptions.make(options, **option_kwargs, as_torch=True)
        self._stream: RankStream | None = None
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.split = split

    def __iter__(self):
        import torch.utils.data as tud

        info = tud.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"OverlordDataset(rank={self.rank}) was given to a DataLoader with num_workers={info.num_workers}; "
                "use num_workers=0: the service already builds the batches"
            )
        if self.split == "eval":  # not the training stream: the rank's training consumer stays attached
            from .evaluation import EvalStream

            return iter(EvalStream(self.address, self.rank, self.dp, options=self.options))
        return iter(self.stream)

    @property
    def stream(self) -> RankStream:
        if self._stream is None:
            self._stream = RankStream(
                self.address, self.rank, self.dp, cp_rank=self.cp_rank, replica=self.replica, options=self.options
            )
        return self._stream

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def report(self, step: int, loss_by_source: dict | None = None, **extra) -> None:
        """Report metrics of ``step`` to the planner (one-way; ``RankStream.report``): per-source
        losses (``loss_by_source(batch, token_losses)``) drive a plan's mixing controller."""
        self.stream.report(step, loss_by_source, **extra)

    def step_done(self, seconds: float | None = None) -> None:
        """Call after the step's synchronisation point (GPU trainers): its compute time, for a plan
        that learns its cost model (``RankStream.step_done``)."""
        self.stream.step_done(seconds)

    def loss_by_source(self, batch: dict, token_losses) -> dict:
        """Per source ``(sum of token losses, tokens)`` of a micro-batch (``trainer/reporting.py``)."""
        return self.stream.loss_by_source(batch, token_losses)

    def commit(self) -> None:
        """Acknowledge every step yielded so far: a job that ends cleanly calls it after its last
        step, so that the next job (without a checkpoint) starts after that step, not at it."""
        self.stream.commit()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
