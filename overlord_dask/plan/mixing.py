"""A mixing controller: the mix set during training from the losses the trainers report
(``planner/mixing.py`` runs it; decisions are recorded in the run's timeline)."""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from .base import Strict


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


def check_bounds(mixing: Mixing, names) -> None:
    """ValueError where a controller's shares cannot sum to 1 within the bounds (each source's
    ``bounds``, else ``[min_share, 1]``)."""
    lo = sum(mixing.bounds.get(n, (mixing.min_share, 1.0))[0] for n in names)
    hi = sum(mixing.bounds.get(n, (mixing.min_share, 1.0))[1] for n in names)
    if mixing.controller and (lo > 1 + 1e-9 or hi < 1 - 1e-9):
        raise ValueError(
            f"mixing bounds cannot hold: the sources' minimum shares sum to {lo:.3g} and their maximum shares "
            f"to {hi:.3g}; shares summing to 1 need min <= 1 <= max"
        )


CONTROLLERS = ("odm",)  # built-in controllers (planner/mixing.py)
