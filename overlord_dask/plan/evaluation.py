"""Held-out evaluation data: which load units of each source never reach training, and how the
evaluation stream made of them is shaped.

A source's ``holdout`` takes units out of training when the run starts: a fraction of its units
(chosen by a seeded hash of the plan's seed, the source's name and the unit's position, so the
same files give the same held-out units in every run), or the files whose paths match given
patterns. The plan's ``evaluation`` section shapes the finite stream every rank can read at any
time (``RankStream.eval_batches()``, ``OverlordDataset(split="eval")``).
"""

from __future__ import annotations

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
