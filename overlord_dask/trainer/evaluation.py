"""A rank's evaluation stream: its share of the run's held-out batches (``worker/evaluation.py``),
finite and the same every time it is read, in the same form as its training micro-batches.

Reading it takes nothing from training: the batches are built once per run and held until the
run ends, so every evaluation pass (every N training steps, say) reads the same batches again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from ..errors import RankError, ServiceError
from ..protocol import resolve_address
from ..wire import DTYPES, decode_batch
from . import batches
from .batches import shape
from .connection import ProcessIO
from .fetch import fetch_batches
from .tensors import TORCH_DTYPES, to_torch

FETCH_STEPS = 8  # evaluation steps asked for per fetch


class EvalStream:
    """Rank ``rank``'s evaluation micro-batches (numpy, or torch with ``as_torch``), iterated as
    often as wanted. It does not attach to the training stream: a training stream and an
    evaluation stream of the same rank live side by side. ``labels``, ``loss_mask`` and
    ``batch_dim`` as for :class:`~overlord_dask.trainer.stream.RankStream`."""

    def __init__(
        self,
        address: str,
        rank: int,
        dp: int | None = None,
        *,
        timeout: float = 600.0,
        as_torch: bool = False,
        labels: str = "shifted",
        loss_mask: bool | None = None,
        batch_dim: bool = False,
    ):
        self.io = ProcessIO.get()
        self.address = resolve_address(address)
        self.rank, self.timeout, self.as_torch = int(rank), timeout, as_torch
        info = self.io.service_info(self.address, timeout)
        if dp is not None and dp != info["dp"]:
            raise RankError(f"consumer asked for dp={dp}, but the service at {self.address} runs dp={info['dp']}")
        if not 0 <= self.rank < info["dp"]:
            raise RankError(f"rank {self.rank} does not exist: the service at {self.address} runs dp={info['dp']}")
        batches.check_options(labels, info.get("cp", 1))
        self.batch_options = {"labels": labels, "loss_mask": loss_mask, "batch_dim": batch_dim}

    def steps(self) -> Iterator[dict]:
        return eval_steps(self)

    def __iter__(self) -> Iterator[dict]:
        return eval_micro_batches(self)


def eval_steps(stream) -> Iterator[dict]:
    """Rank ``stream.rank``'s evaluation steps (``stream``: an :class:`EvalStream` or a ``RankStream``): ``{"step",
    "rank", "micro_batches", "eval_steps"}``."""
    io, rank, timeout = stream.io, stream.rank, stream.timeout
    planner = io.planner(stream.address)
    step, total, deadline, desc = 0, None, time.monotonic() + timeout, None
    while total is None or step < total:
        if desc is None:  # where the batches are: asked once, and again only after a failed fetch
            desc = io.run(planner.evaluation(timeout=min(timeout, 30.0)), timeout=min(timeout, 30.0) + 10)
            if desc.get("error"):
                raise ServiceError(f"rank {rank}: {desc['error']}")
        want = [step] if total is None else list(range(step, min(total, step + FETCH_STEPS)))
        try:
            got = io.run(
                fetch_batches(
                    io,
                    planner,
                    desc,
                    want,
                    rank=rank,
                    cp_rank=None,
                    timeout=min(timeout, 30.0),
                    abort=asyncio.Event(),
                    address=stream.address,
                ),
                timeout=min(timeout, 30.0) + 10,
            )
        except ServiceError:  # its worker left: the batches are rebuilt, ask where they are now
            if time.monotonic() > deadline:
                raise
            desc = None
            continue
        for b in got:
            total = b["eval_steps"]
            if step >= total:
                return
            b = shape(decode_batch(b, TORCH_DTYPES if stream.as_torch else DTYPES), **stream.batch_options)
            if stream.as_torch:
                b = {**b, "micro_batches": [to_torch(mb) for mb in b["micro_batches"]]}
            yield b
            step += 1


def eval_micro_batches(stream) -> Iterator[dict]:
    """The evaluation micro-batches of ``stream``'s rank, one at a time (as ``iter(stream)`` yields training ones)."""
    for batch in eval_steps(stream):
        n = len(batch["micro_batches"])
        for m, mb in enumerate(batch["micro_batches"]):
            yield {
                **mb,
                "step": batch["step"],
                "rank": stream.rank,
                "micro_batch": m,
                "last_in_step": m == n - 1,
                "eval": True,
            }
