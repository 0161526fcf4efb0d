"""Held-out evaluation data: which load units of each source never reach training, and how the
evaluation stream made of them is shaped.

A source's ``holdout`` takes units out of training when the run starts: a fraction of its units
(chosen by a seeded hash of the plan's seed, the source's name and the unit's position, so the
same files give the same held-out units in every run), or the files whose paths match given
patterns. The plan's ``evaluation`` section shapes the finite stream every rank can read at any
time (``RankStream.eval_batches()``, ``OverlordDataset(split="eval")``).
"""

from __future__ import annotations

import math

from pydantic import Field

from .base import Strict


class Evaluation(Strict):
    """The evaluation stream of the held-out units (of the sources with a ``holdout``)."""

    tokens: int | None = Field(default=None, ge=1)
    """Tokens of the stream in all, shared between sources by ``weights`` (each source gives at
    most what it holds out); None: every held-out document."""
    weights: dict[str, float] | None = None
    """Each source's share of ``tokens`` (normalised; only sources with a ``holdout``, finite and
    >= 0, one of them > 0); default: the sources' weights at step 0."""
    micro_batches: int = Field(default=1, ge=1, le=4096)
    """Micro-batches per rank per evaluation step."""
    tokens_per_micro_batch: int | None = Field(default=None, ge=16, le=1 << 24)
    """Capacity of an evaluation micro-batch; default: the training topology's."""


def check_evaluation(ev: Evaluation, sources) -> None:
    """ValueError for evaluation settings that cannot take effect: set with no source holding
    anything out; weights naming an unknown source or one without a holdout; weights that are not
    finite, negative, or all zero (each was ignored, or failed only when the run started)."""
    names = {s.name for s in sources}
    held = sorted(s.name for s in sources if s.holdout)
    if ev != Evaluation() and not held:
        raise ValueError(
            "evaluation is set, but no source has a holdout: the evaluation stream is made of held-out units "
            "(give a source `holdout: 0.01` or file patterns)"
        )
    if ev.weights is None:
        return
    unknown = sorted(set(ev.weights) - names)
    if unknown:
        raise ValueError(f"evaluation weights name unknown sources {unknown}; sources: {sorted(names)}")
    without = sorted(set(ev.weights) - set(held))
    if without:
        raise ValueError(
            f"evaluation weights name sources without a holdout {without}: they give the evaluation stream "
            f"nothing; sources with a holdout: {held}"
        )
    if any(not (math.isfinite(v) and v >= 0) for v in ev.weights.values()) or not any(
        v > 0 for v in ev.weights.values()
    ):
        raise ValueError(f"evaluation weights must be finite, >= 0, and one of them > 0 (got {dict(ev.weights)})")
