"""The layout of a rank's micro-batches: everything a constructor needs beside the pieces.

The planner decides it (from the topology it plans on and the run's sources) and it travels with
each constructor task (``scheduler/chunks.py`` -> the submitter -> ``worker/constructors.py``),
so a constructor never reads a plan of its own: the capacity it packs to is the one the planner
budgeted, even after a restore onto another topology. A frozen dataclass of scalars, sent as a
dict over the scheduler's routes (:meth:`to_dict`, :meth:`from_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .vocab import PAD_ID


@dataclass(frozen=True, slots=True)
class BatchLayout:
    micro_batches: int
    """Micro-batches per rank per step."""
    capacity: int
    """Token capacity of a micro-batch (``topology.tokens_per_micro_batch``)."""
    cp: int = 1
    """Context-parallel group size: above 1, every micro-batch also carries its CP slices."""
    cp_split_tokens: int = 2
    """With ``cp > 1``: pieces at least this long are split across the group (zigzag)."""
    pad_id: int = PAD_ID
    """The tokenizer's padding id."""
    multimodal: bool = False
    """Some source of the run has images: batches carry the patch fields."""
    loss_masks: bool = False
    """Some source's loss ignores some tokens: batches carry the mask."""

    @classmethod
    def of(cls, topology, *, pad_id: int, sources) -> BatchLayout:
        """The layout of ``topology`` (a ``plan.Topology``) for a run of ``sources`` (every
        ``plan.Source`` of its plan versions) padded with ``pad_id``."""
        sources = list(sources)
        return cls(
            micro_batches=topology.micro_batches,
            capacity=topology.tokens_per_micro_batch,
            cp=topology.cp,
            cp_split_tokens=topology.cp_split_tokens,
            pad_id=pad_id,
            multimodal=any(s.images_field for s in sources),
            loss_masks=any(s.masks_loss for s in sources),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BatchLayout:
        return cls(**d)
