"""Balance metrics: max over ranks ÷ mean over ranks, per step and per micro-batch."""

from __future__ import annotations

import numpy as np


def imbalance(costs: np.ndarray) -> float:
    """max/mean of a 1-D array of per-rank costs; 1.0 is perfect, and an all-zero step counts as 1."""
    c = np.asarray(costs, dtype=np.float64)
    mean = c.mean() if len(c) else 0.0
    return float(c.max() / mean) if mean > 0 else 1.0


def step_imbalance(mb_costs: np.ndarray) -> tuple[float, float]:
    """From ``mb_costs[rank, mb]``: (step-level imbalance for trainers that sync once per step, as DDP
    does; micro-batch-level imbalance for trainers that sync every micro-batch, as FSDP does: the
    worst micro-batch index)."""
    step = imbalance(mb_costs.sum(axis=1))
    mb = max(imbalance(mb_costs[:, m]) for m in range(mb_costs.shape[1]))
    return step, mb
