"""Policy ``none``: each global step's samples selected on its own, token shares per source exact
up to one piece, packed into the step's ``dp × micro_batches`` bins within the token capacity.

Rule (a largest-deficit blend over tokens, in the spirit of Megatron's BlendedDataset, which uses
sample counts): with ``T`` tokens already in the step and ``D_s`` of them from source ``s``, the
next piece comes from the source with the largest deficit ``w_s·T − D_s − carry_s``. Each piece goes
into the bin where it fits most tightly (best fit keeps empty bins for long pieces). A piece that
fits nowhere *blocks* its source for the rest of the step; other sources go on only while every
blocked source stays short by no more than the piece it could not place. Then the step closes, and
the blocked piece is the first of its source in the next step. With ``balance.packing: cut``
nothing blocks: a piece that fits no bin fills the emptiest one and its rest comes next, until
every bin is full.

``carry_s`` is the run's cumulative surplus of source ``s`` so far (tokens delivered minus the
sum over past steps of that step's weight times its tokens, so weight schedules are followed),
clipped to a quarter of the previous step's longest piece. Without it the source with the longest
pieces ends steps ahead more often than behind, a bias that grows when a step holds only a few
pieces; a larger carry trades per-step exactness for long-run exactness.

Guarantees (tested): no bin holds more than its capacity; every piece is selected once, in its
source's order; per step, no source ends more than one piece (plus the carry's spread, half the
previous step's longest piece) ahead of its share, so none ends further behind than the other
sources' surpluses together: one piece (plus that spread) per other source, and at least one.
In practice a step is within one piece in almost every step (``benchmarks/mixing.py`` reports
``mix_error_step_max`` and ``_p99``).

All of this is a pure function of the streams' state, their loaded lengths and the carry, so it
depends neither on worker count nor on when loads finish: if a stream runs out of loaded metadata
the step is rolled back and retried later (``Starved``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ... import pieces as P
from ..streams import Piece, SourceStream
from .base import Planned, Policy, Starved, Window, as_floats, grown

CARRY_FRACTION = 0.25


@dataclass(slots=True)
class StepSelection:
    bins: list[list[Piece]]  # dp*micro_batches bins of pieces
    source_tokens: np.ndarray  # int64 [n_sources]
    total_tokens: int
    longest_piece: int  # over placed and blocked pieces: the unit of the per-step mix bound


def select_step(
    streams: list[SourceStream],
    weights: np.ndarray,
    n_bins: int,
    capacity: int,
    carry: np.ndarray | None = None,
    cut: bool = False,
) -> StepSelection:
    """Choose and pack the next step's pieces (``cut``: a piece that fits no bin fills the
    emptiest one and the rest of it comes next). Raises ``Starved`` (with every stream restored)."""
    saved = [s.cursor() for s in streams]
    try:
        return _select(streams, weights, n_bins, capacity, np.zeros(len(streams)) if carry is None else carry, cut)
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


def _select(streams, weights, n_bins, capacity, carry, cut) -> StepSelection:
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
        if len(fits) == 0 and cut:
            b = int(np.argmax(free))  # ties: lowest bin
            if free[b] == 0:
                break  # every bin is full
            L = int(free[b])
            piece = replace(piece, stop=piece.start + L)
        elif len(fits) == 0:
            blocked[i] = L
            continue
        else:
            b = int(fits[np.argmin(slack[fits])])  # best fit; ties: lowest bin
        bins[b].append(piece)
        free[b] -= L
        streams[i].advance(piece)
        D[i] += L
        T += L
    if T == 0:
        raise RuntimeError("step selected no tokens: every active source is blocked on an empty step")
    return StepSelection(bins, D, T, longest)


def assign_bins(bin_costs: np.ndarray, dp: int, micro_batches: int) -> np.ndarray:
    """Return ``slots[rank, mb] = bin index`` for ``dp*micro_batches`` bins.

    Assigning a step's packed bins to (rank, micro-batch) slots.

    This is the simple, correct assignment: bins sorted by cost, each to the rank with the least cost
    so far that still has a free micro-batch slot (LPT with a cardinality constraint), then each rank's
    micro-batches ordered by decreasing cost. Cost-aware re-packing across ranks is the balancer's job
    (a policy that can replace this one); both must leave every bin within capacity.
    """
    n = dp * micro_batches
    if len(bin_costs) != n:
        raise ValueError(f"expected {n} bins for dp={dp} x micro_batches={micro_batches}, got {len(bin_costs)}")
    order = np.argsort(-np.asarray(bin_costs), kind="stable")
    load = np.zeros(dp)
    count = np.zeros(dp, dtype=np.int64)
    slots = np.full((dp, micro_batches), -1, dtype=np.int64)
    for b in order:
        open_ranks = np.flatnonzero(count < micro_batches)
        r = int(open_ranks[np.argmin(load[open_ranks])])
        slots[r, count[r]] = b
        count[r] += 1
        load[r] += bin_costs[b]
    return slots


class ExactStep(Policy):
    """Policy ``none``: every step holds each source's share exactly (up to one piece)."""

    name = "none"

    def __init__(self, n_sources: int):
        super().__init__(n_sources)
        self.cum_tokens = np.zeros(n_sources, np.int64)  # the run's tokens per source
        self.cum_declared = np.zeros(n_sources)  # what each step's weights asked for, summed
        self.carry = np.zeros(n_sources)  # the surplus the next step starts from (next_carry)

    def grow(self, n: int) -> None:
        self.cum_tokens, self.cum_declared, self.carry = (
            grown(a, n) for a in (self.cum_tokens, self.cum_declared, self.carry)
        )

    def plan(self, w: Window) -> list[Planned]:
        topo = w.topology
        weights = w.mix_at(w.start)
        n_bins, cut = topo.dp * topo.micro_batches, w.balance.packing == "cut"
        sel = select_step(w.streams, weights, n_bins, topo.tokens_per_micro_batch, self.carry, cut)
        self.cum_tokens += sel.source_tokens
        self.cum_declared += weights * sel.total_tokens
        self.carry = next_carry(self.cum_tokens, self.cum_declared, sel.longest_piece)
        bins = [np.asarray([p.as_list() for p in b], dtype=np.int64).reshape(-1, P.WIDTH) for b in sel.bins]
        bin_costs = np.array([w.costs(b).sum() for b in bins])
        slots = assign_bins(bin_costs, topo.dp, topo.micro_batches)
        rows, slot = P.flatten([[bins[slots[r, m]] for m in range(topo.micro_batches)] for r in range(topo.dp)])
        return [(rows, slot, bin_costs[slots])]

    def get_state(self) -> dict:
        return {
            "cum_tokens": [int(x) for x in self.cum_tokens],
            "cum_declared": as_floats(self.cum_declared),
            "carry": as_floats(self.carry),
        }

    def set_state(self, state: dict, n_sources: int) -> None:
        self.cum_tokens = grown(np.asarray(state["cum_tokens"], np.int64), n_sources)
        self.cum_declared = grown(np.asarray(state["cum_declared"], np.float64), n_sources)
        self.carry = grown(np.asarray(state["carry"], np.float64), n_sources)
