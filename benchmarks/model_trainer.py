"""A real trainer for ``trainer_wait.py --model``: a small language model that trains on each
micro-batch it is handed, on a CUDA GPU in bf16 where there is one, else on the CPU in float32.

The issue-13 measurement this stands for: a GPU trainer computing ~45 ms per step between
batches (a few bf16 layers, 2 × 16k tokens per step). Its wait for data depends on what the
host does while the GPU computes: the copy to the device (from pinned memory where the loader
pins), the Python of the training loop, and the loader's own threads competing for the same
cores. A ``time.sleep`` stand-in has none of that.

The model is token-wise: embeddings of the token and its ``position_ids``, ``layers`` residual
MLP blocks (LayerNorm, ``dim`` → 4·``dim`` → ``dim``) and a head over ``vocab`` ids, trained with
cross-entropy on the micro-batch's ``labels`` (``-100`` ignored) and AdamW. Its step time is
that of a transformer's matmuls at the same width, without attention's quadratic term (which the
planner balances and which a dense mask over 16k packed tokens would make a benchmark of its
own). The loss is synchronised once per step (``loss.item()``, as a loop that logs it does), so
the host's step ends when the GPU's does and the wait is not hidden in the CUDA queue.
"""

from __future__ import annotations

import time

import torch
from torch import nn


def pick_device(requested: str = "auto") -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here")
    return requested


class TokenLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, max_positions: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_positions, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class ModelTrainer:
    """Trains ``TokenLM`` on the micro-batches given to :meth:`micro_batch`; :meth:`end_step`
    applies the optimizer once per step and returns the step's mean loss (a host sync)."""

    def __init__(
        self,
        *,
        vocab: int,
        dim: int,
        layers: int,
        capacity: int,
        device: str = "auto",
        lr: float | None = None,
        seed: int = 0,
    ):
        self.device = pick_device(device)
        if self.device == "cpu":
            torch.set_num_threads(1)  # one core, as a GPU trainer's host thread: the loaders keep the rest
        torch.manual_seed(seed)
        self.vocab = vocab
        self.model = TokenLM(vocab, dim, layers, capacity).to(self.device)
        # wider models take smaller steps (0.5 / dim: 2.4e-4 at 2048, 3e-2 at 16 and below)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr if lr is not None else min(3e-2, 0.5 / dim))
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device == "cuda" else None
        self.losses: list[float] = []
        self._step_loss = None
        self._checked = False  # the ids of the first batch handed over are checked against the vocabulary

    def micro_batch(self, mb: dict) -> None:
        dev, nb = self.device, self.device == "cuda"
        ids = mb["input_ids"].to(dev, non_blocking=nb)
        pos = mb["position_ids"].to(dev, non_blocking=nb)
        labels = mb["labels"].to(dev, non_blocking=nb)
        if not self._checked:  # once: an id past the embedding would fail inside a CUDA kernel, unnamed
            top = int(mb["input_ids"].max())
            if top >= self.vocab:
                raise ValueError(f"token id {top} does not fit the model's vocabulary of {self.vocab} (--vocab)")
            self._checked = True
        if self.autocast is not None:
            with self.autocast:
                logits = self.model(ids, pos)
        else:
            logits = self.model(ids, pos)
        loss = nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)
        loss.backward()
        self._step_loss = loss.detach() if self._step_loss is None else self._step_loss + loss.detach()

    def end_step(self, micro_batches: int) -> float:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = float(self._step_loss.item()) / micro_batches  # the host waits for the GPU here
        self._step_loss = None
        self.losses.append(loss)
        return loss

    def forget_batches(self) -> None:
        """Forget the batches trained on so far (``calibrate``'s synthetic ones): their losses, and
        the id check, which then runs on the next batch handed over (a loader's first)."""
        self.losses.clear()
        self._checked = False


def calibrate(trainer: ModelTrainer, capacity: int, micro_batches: int, steps: int = 3) -> float:
    """Seconds per step of ``trainer`` on synthetic micro-batches (the median of ``steps`` after
    one warm-up step): what the model costs with no loader at all."""
    from overlord_dask.sources.tokenizers import BYTE_OFFSET

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(
        BYTE_OFFSET, min(trainer.vocab, BYTE_OFFSET + 256), (capacity,), generator=g
    )  # byte-tokenizer ids
    mb = {"input_ids": ids, "position_ids": torch.arange(capacity), "labels": torch.roll(ids, -1)}
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        for _ in range(micro_batches):
            trainer.micro_batch(mb)
        trainer.end_step(micro_batches)
        times.append(time.perf_counter() - t0)
    trainer.forget_batches()
    return sorted(times[1:])[len(times[1:]) // 2]


def self_check() -> dict:
    """The trainer's guard against a loader's bad batch: a token id past its vocabulary is named
    in the error, on the first batch a loader hands over, also after ``calibrate``'s synthetic
    ones (``python benchmarks/model_trainer.py --self-check``; the tests run it)."""
    out = {}
    for calibrated in (False, True):
        m = ModelTrainer(vocab=8, dim=4, layers=1, capacity=4, device="cpu")
        if calibrated:
            calibrate(m, capacity=4, micro_batches=1, steps=1)
            assert m.losses == [], "calibrate's synthetic batches must not count as training"
        mb = {
            "input_ids": torch.tensor([1, 2, 9, 3]),
            "position_ids": torch.arange(4),
            "labels": torch.tensor([2, 9, 3, -100]),
        }
        try:
            m.micro_batch(mb)
            out["calibrated" if calibrated else "fresh"] = "not caught"
        except ValueError as err:
            out["calibrated" if calibrated else "fresh"] = str(err)
    return out


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] != ["--self-check"]:
        sys.exit(
            "usage: python benchmarks/model_trainer.py --self-check (the trainer itself is used by trainer_wait.py)"
        )
    print(json.dumps(self_check()))
