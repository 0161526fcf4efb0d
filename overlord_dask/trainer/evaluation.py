"""A rank's evaluation stream: its share of the run's held-out batches (``worker/evaluation.py``),
finite and the same every time it is read, in the same form as its training micro-batches.

Reading it takes nothing from training: the batches are built once per run and held until the
run ends, so every evaluation pass (every N training steps, say) reads the same batches again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace

from ..errors import RankError, ServiceError
from ..protocol import resolve_address
from . import batches
from .connection import ProcessIO
from .fetch import fetch_batches
from .options import StreamOptions
from .tensors import for_trainer

FETCH_STEPS = 8  # evaluation steps asked for per fetch


class EvalStream:
    """Rank ``rank``'s evaluation micro-batches (numpy, or torch with ``as_torch``), iterated as
    often as wanted. It does not attach to the training stream: a training stream and an
    evaluation stream of the same rank live side by side. Options (``timeout``, ``as_torch``,
    ``labels``, ``loss_mask``, ``batch_dim``) as for :class:`~overlord_dask.trainer.stream.RankStream`."""

    def __init__(
        self,
        address: str,
        rank: int,
        dp: int | None = None,
        *,
        options: StreamOptions | None = None,
        **option_kwargs,
    ):
        self.io = ProcessIO.get()
        self.address = resolve_address(address)
        self.rank, self.options = int(rank), StreamOptions.make(options, **option_kwargs)
        info = self.io.service_info(self.address, self.timeout)
        if dp is not None and dp != info["dp"]:
            raise RankError(f"consumer asked for dp={dp}, but the service at {self.address} runs dp={info['dp']}")
        if not 0 <= self.rank < info["dp"]:
            raise RankError(f"rank {self.rank} does not exist: the service at {self.address} runs dp={info['dp']}")
        batches.check_options(self.options.labels, info.get("cp", 1))

    @property
    def timeout(self) -> float:
        return self.options.timeout

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
            yield for_trainer(b, replace(stream.options, pin_memory=False))
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
