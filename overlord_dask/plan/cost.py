"""What a document costs a trainer rank (the model the balancer evens out over ranks), declared
or learned from the step times the trainers report."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from .base import Strict, import_callable


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


class CostModel(Strict):
    """Cost of one document of L tokens, V of them image tokens: `attention·L² + linear·L +
    constant + encoder·V` (documents in a packed micro-batch do not attend to each other, so a
    micro-batch costs the sum over its documents; the backbone sees all L tokens, the vision
    encoder only the V patches)."""

    attention: float = Field(default=1.0, ge=0.0)
    """Coefficient of L² (the attention term)."""
    linear: float | None = Field(default=None, ge=0.0)
    """Default 6·hidden."""
    constant: float = Field(default=0.0, ge=0.0)
    """Cost per document, whatever its length."""
    hidden: int = Field(default=4096, ge=1)
    """The model's hidden size: ``linear`` defaults to 6·hidden."""
    encoder: float = Field(default=0.0, ge=0.0)
    """Vision-encoder cost per image token (patch), added to the backbone cost of the tokens;
    e.g. ``6·d_vit·layers_vit / layers`` relative to the backbone's per-token ``linear`` cost."""
    function: str | None = None
    """Optional `module:callable` mapping an int64 array of document lengths to float costs
    (vectorised); replaces the formula. It must be importable on the scheduler."""
    learn: LearnCost | None = None
    """Learn the coefficients from the step times the trainers report (``true``, or the fit's
    settings): the declared ones are used until the fit settles, then the fitted ones from a
    step recorded in the run's timeline (``planner/learn.py``)."""

    @field_validator("learn", mode="before")
    @classmethod
    def _learn(cls, v):
        return ({} if v else None) if isinstance(v, bool) else v

    @field_validator("function")
    @classmethod
    def _importable(cls, spec: str | None) -> str | None:
        if spec is not None:
            import_callable(spec)
        return spec

    @model_validator(mode="after")
    def _learnable(self) -> CostModel:
        if self.learn is not None and self.function:
            raise ValueError("cost.learn fits the formula's coefficients; it cannot be combined with cost.function")
        return self

    @property
    def linear_coef(self) -> float:
        return self.linear if self.linear is not None else 6.0 * self.hidden
