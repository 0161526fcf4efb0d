"""How the planner lays a window of steps out over ranks (policy, what the trainers synchronise
on, the window, the fill)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict

WHOLE_FILL = 0.97
CUT_FILL = 0.93


class Balance(Strict):
    """How the planner spreads attention cost over ranks (issue: stragglers from long documents)."""

    policy: Literal["cost", "none"] = "cost"
    """`cost`: plan `window` steps at once, spread long documents so every rank gets an equal
    share, water-fill short ones (`planner/policies/balance.py`). `none`: exact per-step mixing with
    best-fit packing and no look-ahead (`planner/policies/exact.py`)."""
    sync: Literal["step", "micro_batch"] = "micro_batch"
    """What the trainer waits on: `step` (DDP: ranks sync once per step) or `micro_batch` (FSDP:
    every micro-batch); the imbalance of that one is minimised."""
    window: int = Field(default=16, ge=1, le=256)
    """Steps planned together; long documents move between these steps, and the steps go out in
    the order that keeps the mix closest to the declared one (the mix over a window is exact up
    to the pieces deferred to the next)."""
    fill: float | None = Field(default=None, gt=0.0, le=1.0)
    """Token budget of a step as a fraction of its capacity (slack for balancing); with
    `packing: cut` the slack the balancer leaves is filled with cut pieces afterwards. Default
    (`step_fill`): 0.97; 0.93 with `policy: cost` and `packing: cut`, whose fill is chosen by
    the mix each step delivered so far: the larger slack lets it even out what long pieces moved
    between steps (`planner/policies/cost_balanced.py`), while micro-batches are full either way."""
    packing: Literal["whole", "cut"] = "whole"
    """`whole`: pieces go into micro-batches whole (documents over `max_doc_tokens` are still
    split), and the room no piece fits stays padding. `cut`: every micro-batch is filled to its
    capacity, and the piece that does not fit is cut at its end, the rest of the document coming
    next (the way Megatron's and MosaicML Streaming's concatenated samples are cut). A cut piece
    keeps its sample id, its offset in the document (`piece_starts`), its loss mask and its true
    next token as the last label; attention does not cross the cut."""
    heavy_tokens: int | None = Field(default=None, ge=1)
    """Pieces at least this long are balanced as outliers; default tokens_per_micro_batch // 16."""
    max_delay: int = Field(default=2, ge=0, le=64)
    """Windows a long piece may wait for similar ones before it is placed alone."""

    @property
    def step_fill(self) -> float:
        """`fill`, or its default for this policy and packing."""
        if self.fill is not None:
            return self.fill
        return CUT_FILL if self.policy == "cost" and self.packing == "cut" else WHOLE_FILL
