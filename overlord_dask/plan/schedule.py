"""Weights and context strategy as functions of the global step: the curriculum.

A source's ``weight`` is a number (constant) or a :class:`Schedule`::

    weight: 0.5                                   # constant
    weight: {stages: [[0, 0.5], [400, 0.2]]}      # piecewise constant: 0.5 from step 0, 0.2 from 400
    weight: {ramp: [[0, 0.1], [500, 0.4]]}        # linear from 0.1 at step 0 to 0.4 at 500, flat outside
    weight: {function: "my_mix:web_weight"}       # any callable step -> weight

A plan may also declare :class:`Stage` s, each from a step on: the whole mix for that stage
(``weights``, optionally ramped in from the previous stage over ``ramp_steps``) and its context
strategy (maximum document length, what happens to longer documents, and the share of tokens
that comes from long documents).

Why steps and not tokens or samples: steps are what a trainer's LR schedule, checkpoints and
evaluation use, and a step boundary is where the planner can switch without splitting a batch.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from .base import Strict, import_callable


def _points(points: list[tuple[int, float]], what: str) -> list[tuple[int, float]]:
    if not points:
        raise ValueError(f"{what} needs at least one [step, weight] point")
    steps = [p[0] for p in points]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"{what} steps must increase strictly (got {steps})")
    for step, w in points:
        if step < 0:
            raise ValueError(f"{what}: step {step} is negative")
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"{what}: weight at step {step} must be a finite number >= 0 (got {w})")
    return points


class Schedule(Strict):
    """A weight that changes with the step: exactly one of ``stages``, ``ramp`` or ``function``."""

    stages: list[tuple[int, float]] | None = None
    """Piecewise constant: ``[step, weight]`` points; the weight holds from its step to the next
    point's step. Before the first point the first weight applies."""
    ramp: list[tuple[int, float]] | None = None
    """Piecewise linear between ``[step, weight]`` points; flat before the first and after the last."""
    function: str | None = None
    """``module:callable`` mapping a step (int) to a weight (float >= 0); must be importable
    wherever the planner runs (the scheduler)."""

    @model_validator(mode="after")
    def _one_kind(self) -> Schedule:
        kinds = [k for k in ("stages", "ramp", "function") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a weight schedule needs exactly one of stages, ramp or function (got {kinds or 'none'})")
        if self.stages is not None:
            _points(self.stages, "stages")
        if self.ramp is not None:
            _points(self.ramp, "ramp")
        if self.function is not None:
            import_callable(self.function)
        return self

    def at(self, step: int) -> float:
        if self.stages is not None:
            w = self.stages[0][1]
            for s, v in self.stages:
                if s > step:
                    break
                w = v
            return float(w)
        if self.ramp is not None:
            pts = self.ramp
            if step <= pts[0][0]:
                return float(pts[0][1])
            for (s0, w0), (s1, w1) in zip(pts, pts[1:]):
                if step < s1:
                    return float(w0 + (w1 - w0) * (step - s0) / (s1 - s0))
            return float(pts[-1][1])
        return float(_callable(self.function)(step))

    def jumps(self) -> list[int]:
        """Steps where the weight may change discontinuously (the planner starts a window there)."""
        return [s for s, _ in self.stages] if self.stages is not None else []

    def knots(self) -> list[int]:
        """Steps at which checking the weight covers every step (linear pieces in between)."""
        if self.stages is not None:
            return [s for s, _ in self.stages]
        if self.ramp is not None:
            return [s for s, _ in self.ramp]
        return []

    @property
    def is_function(self) -> bool:
        return self.function is not None


_CALLABLES: dict[str, object] = {}


def _callable(spec: str):
    fn = _CALLABLES.get(spec)
    if fn is None:
        fn = _CALLABLES[spec] = import_callable(spec)
    return fn


Weight = float | Schedule


def weight_at(weight: Weight, step: int) -> float:
    return float(weight) if not isinstance(weight, Schedule) else weight.at(step)


class Stage(Strict):
    """One phase of the run, from ``start_step`` until the next stage starts.

    Example: a long-context extension as the last 10% of a run::

        stages:
          - {name: base, start_step: 0, max_doc_tokens: 4096}
          - name: long
            start_step: 9000
            max_doc_tokens: 65536        # longer context: documents up to 64k stay whole
            long_tokens: 32768           # a document over 32k is "long"
            long_share: 0.3              # 30% of the stage's tokens from long documents
            long_sources: {books: 0.8, web: 0.2}   # where the long tokens come from
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    """The stage's name (logs, ``event=stage`` lines, reports)."""
    start_step: int = Field(ge=0)
    """The first step of the stage (it lasts until the next stage's ``start_step``)."""
    weights: dict[str, float] | None = None
    """The stage's whole mix by source name (unlisted sources get 0); None keeps each source's own
    ``weight`` (schedules included)."""
    ramp_steps: int = Field(default=0, ge=0)
    """Move linearly from the previous stage's weights to this stage's over this many steps."""
    max_doc_tokens: int | None = Field(default=None, ge=1)
    """Longest piece delivered in this stage (default: the topology's); longer documents are
    handled by ``long_policy``."""
    long_policy: Literal["split", "drop"] = "split"
    """``split``: cut longer documents into consecutive pieces (same sample id, increasing chunk
    index); ``drop``: skip them, counted per source in the metrics and listed in the ledger."""
    long_tokens: int | None = Field(default=None, ge=1)
    """Documents longer than this count as long (for ``long_share``). One value per run: a
    source's documents are classified once, so that each class keeps its own exact position."""
    long_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of the stage's tokens from long documents; the rest comes from the other
    documents. Each source then reads its long and its short documents with two cursors (both
    in the source's own order, each document exactly once); a source rich in short documents
    whose long ones are rare runs through its files faster in the long class. None: the natural
    mix of lengths. Needs ``balance.policy: cost``."""
    long_sources: dict[str, float] | None = None
    """Where the long tokens come from, by source (normalised); default: the stage's weights."""

    @model_validator(mode="after")
    def _check(self) -> Stage:
        for what, mix in (("weight", self.weights), ("long_sources weight", self.long_sources)):
            for name, w in (mix or {}).items():
                if not (math.isfinite(w) and w >= 0):
                    raise ValueError(f"stage {self.name!r}: {what} of {name!r} must be a finite number >= 0 (got {w})")
        if (self.long_share is None) != (self.long_tokens is None):
            raise ValueError(
                f"stage {self.name!r}: long_share and long_tokens go together "
                f"(got long_share={self.long_share}, long_tokens={self.long_tokens})"
            )
        if self.long_sources is not None and self.long_share is None:
            raise ValueError(f"stage {self.name!r}: long_sources needs long_share and long_tokens")
        if self.long_sources is not None and not sum(self.long_sources.values()) > 0:
            raise ValueError(f"stage {self.name!r}: long_sources needs a positive weight")
        if (
            self.long_tokens is not None
            and self.max_doc_tokens is not None
            and self.long_policy == "drop"
            and self.long_tokens >= self.max_doc_tokens
        ):
            raise ValueError(
                f"stage {self.name!r}: with long_policy 'drop' no document over max_doc_tokens={self.max_doc_tokens} "
                f"is kept, so none is over long_tokens={self.long_tokens}"
            )
        return self


class Context(Strict):
    """The context strategy in force at one step (resolved from the stages and the topology)."""

    stage: str | None
    piece_tokens: int
    long_policy: Literal["split", "drop"] = "split"
    long_tokens: int | None = None
    long_share: float | None = None
    long_sources: dict[str, float] | None = None
