"""What the planner does with what the trainers report: a cost model learned from their step
times (``cost.learn``) and a mixing controller driven by their losses (``mixing``).

Both act only through decisions recorded in the run's timeline (``plan/timeline.py``) for steps
not planned yet, so the stream stays a pure function of the plan, its updates and its decisions:
a resumed run and a replay from the recorded decisions deliver the identical stream. Without
reports nothing changes: the declared cost model and the declared weights stay in force.
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from .base import Strict


class LearnCost(Strict):
    """Fit the cost model's coefficients to the step times the trainers report
    (``planner/learn.py``) and switch the balancer to the fit once it has settled."""

    window: int = Field(default=2000, ge=16, le=1_000_000)
    """Observations (a rank's micro-batch, or its step with ``balance.sync: step``) the fit uses: the newest ones."""
    min_observations: int = Field(default=64, ge=8)
    """Observations needed before the first fit."""
    every: int = Field(default=8, ge=1, le=100_000)
    """Refit after this many new steps reported."""
    tolerance: float = Field(default=0.02, gt=0, lt=1)
    """The fit has settled when, for ``patience`` fits in a row, its predictions over the window
    moved by less than this (relative, median)."""
    patience: int = Field(default=3, ge=1, le=1000)
    """Fits in a row within ``tolerance`` before the fitted model is used."""
    refit_change: float = Field(default=0.01, gt=0, lt=10)
    """A settled fit replaces the model in force only where its median relative error over the
    window is lower than that model's (at its best scale) by more than this: no churn of
    decisions from noise."""
    lag: int = Field(default=0, ge=0, le=100_000)
    """A switch applies this many steps after the first step not planned yet."""


class Mixing(Strict):
    """A controller that sets the mix from the trainers' reported signals (``planner/mixing.py``).

    The controller's shares replace the declared weights from its first decision on (a source
    the declared plan has inactive at a step stays at 0 there); a live plan update that changes
    the sources or stages takes precedence from its step, until the controller's next decision."""

    controller: str | None = None
    """``odm`` (built in: an EXP3 bandit over sources, Albalak et al. 2023, rewarded by each
    source's learning progress), or a class as ``module:Class`` (``planner.mixing.Controller``);
    None: the declared weights are used throughout."""
    interval: int = Field(default=50, ge=1, le=1_000_000)
    """Steps between decisions (counted in reported steps)."""
    lag: int = Field(default=4, ge=0, le=100_000)
    """A decision applies at least this many steps after the newest reported step (and never to a step already
    planned)."""
    warmup: int = Field(default=0, ge=0)
    """Reported steps before the first decision (the declared mix runs until then)."""
    bounds: dict[str, tuple[float, float]] = Field(default_factory=dict)
    """Per source ``[min, max]`` share the controller may set (default ``[0, 1]``)."""
    min_share: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Lower bound for every source not named in ``bounds``."""
    max_change: float = Field(default=0.1, gt=0.0, le=1.0)
    """Largest change of a source's share in one decision."""
    options: dict = Field(default_factory=dict)
    """Keyword arguments of the controller (``odm``: ``eta``, ``smoothing``, ``exploration``, ``reward``)."""

    @field_validator("bounds")
    @classmethod
    def _bounds(cls, b: dict) -> dict:
        for name, (lo, hi) in b.items():
            if not (0.0 <= lo <= hi <= 1.0 and math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(f"mixing bounds of {name!r} must satisfy 0 <= min <= max <= 1, got [{lo}, {hi}]")
        return b

    @model_validator(mode="after")
    def _known(self) -> Mixing:
        if self.controller is not None and self.controller not in CONTROLLERS and ":" not in self.controller:
            raise ValueError(
                f"unknown mixing controller {self.controller!r}: use one of {sorted(CONTROLLERS)} or 'module:Class'"
            )
        return self


CONTROLLERS = ("odm",)  # built-in controllers (planner/mixing.py)
