"""A last pass over a balanced window: move single pieces off the costliest container.

The placement (heavy groups, then light pieces water-filled by quota) levels the containers'
cost in bulk, but pieces are indivisible, so the costliest rank (sync ``step``) or bin of a
micro-batch row (sync ``micro_batch``) ends up above the mean by up to a piece. A step takes as
long as that container, so a few targeted changes pay: each round takes the costliest
container of a step (or row) and, trying the cheapest ones in turn (``TARGETS``; the cheapest is
often the fullest, holding many cheap tokens), moves the piece whose cost is closest to half
their gap there, if it fits; where the bins are too full for that, it swaps a dearer piece for a
cheaper one. Either always lowers the pair's maximum. At most ``MAX_MOVES`` per step or row, stopping when nothing
helps or the costliest container
is within ``TOLERANCE`` of the mean: the cost
is bounded per step, whatever dp is. Pieces stay inside their step, so the mix over steps and the
exactly-once accounting are untouched; choices are deterministic (ties go to the lowest index).
"""

from __future__ import annotations

import numpy as np

from ... import pieces as P
from . import kernels

MAX_MOVES = 32
TARGETS = 8  # cheapest containers tried for each change of the costliest
TOLERANCE = 0.002  # done once the costliest container is this close to the mean


def polish(
    where: np.ndarray,
    lens: np.ndarray,
    costs: np.ndarray,
    bin_cost: np.ndarray,
    bin_tok: np.ndarray,
    *,
    steps: int,
    dp: int,
    micro_batches: int,
    capacity: int,
    sync: str,
) -> int:
    """Improve the window's placement in place (``where``: flat bin per piece, -1 pending;
    ``bin_cost``/``bin_tok``: ``[steps, dp·micro_batches]``); returns the number of changes.
    Compiled (``kernels.polish_window``) where the kernels are, else the numpy code below:
    the same changes."""
    if kernels.COMPILED:
        return int(
            kernels.polish_window(
                where,
                np.ascontiguousarray(lens, dtype=np.int64),
                np.ascontiguousarray(costs, dtype=np.float64),
                bin_cost,
                bin_tok,
                dp,
                micro_batches,
                capacity,
                sync == "step",
                MAX_MOVES,
                TARGETS,
                TOLERANCE,
            )
        )
    n_bins = dp * micro_batches
    placed = np.flatnonzero(where >= 0)
    placed = placed[P.stable_order(where[placed])]
    bounds = np.searchsorted(where[placed], np.arange(steps + 1) * n_bins)
    moves = 0
    rank_of_bin = np.arange(n_bins) // micro_batches
    for s in range(steps):
        members = placed[bounds[s] : bounds[s + 1]]
        if len(members) == 0:
            continue
        if sync == "step":  # containers are ranks: all their micro-batches
            moves += _polish_group(
                members,
                where,
                lens,
                costs,
                bin_cost[s],
                bin_tok[s],
                s * n_bins,
                capacity,
                rank_of_bin,
                dp,
                lambda k: np.arange(k * micro_batches, (k + 1) * micro_batches),
            )
        else:  # containers are the bins of one micro-batch row
            for m in range(micro_batches):
                owner = np.where(np.arange(n_bins) % micro_batches == m, rank_of_bin, -1)
                moves += _polish_group(
                    members,
                    where,
                    lens,
                    costs,
                    bin_cost[s],
                    bin_tok[s],
                    s * n_bins,
                    capacity,
                    owner,
                    dp,
                    lambda k, m=m: np.array([k * micro_batches + m]),
                )
    return moves


def _polish_group(
    members, where, lens, costs, bin_cost, bin_tok, base: int, capacity: int, owner: np.ndarray, n: int, bins_of
) -> int:
    """Moves and swaps among ``n`` containers (``owner[bin]``: a bin's container, -1 none;
    ``bins_of(k)``: container ``k``'s bins) of the pieces ``members`` (one step's)."""
    mine = np.sort(members[owner[where[members] - base] >= 0])  # by piece (searchsorted below)
    if len(mine) == 0:
        return 0
    valid = owner >= 0
    cont_cost = np.bincount(owner[valid], weights=bin_cost[valid], minlength=n)
    at = owner[where[mine] - base]
    moves = 0
    target = cont_cost.mean() * (1 + TOLERANCE)
    k = min(TARGETS, n - 1)
    for _ in range(MAX_MOVES):
        hi = int(np.argmax(cont_cost))
        if cont_cost[hi] <= target or k < 1:
            break
        in_hi = mine[at == hi]
        for lo in _cheapest(cont_cost, k + 1):
            lo = int(lo)
            gap = cont_cost[hi] - cont_cost[lo]
            if lo == hi or gap <= 0:
                continue
            got = _change(
                in_hi, mine[at == lo], gap, bins_of(lo), where, lens, costs, bin_cost, bin_tok, base, capacity
            )
            if got is not None:
                delta, changed = got
                cont_cost[hi] -= delta
                cont_cost[lo] += delta
                pos = np.searchsorted(mine, changed)
                at[pos] = owner[where[changed] - base]
                moves += 1
                break
        else:
            break
    return moves


def _cheapest(cont_cost: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` cheapest containers, cheapest first, ties to the lowest index (a partition,
    then only the tied boundary in index order: the compiled kernel picks the very same)."""
    n = len(cont_cost)
    if n <= k:
        cand = np.arange(n)
    else:
        v = np.partition(cont_cost, k - 1)[k - 1]
        below = np.flatnonzero(cont_cost < v)
        cand = np.concatenate([below, np.flatnonzero(cont_cost == v)[: k - len(below)]])
    return cand[np.lexsort((cand, cont_cost[cand]))]


def _change(
    in_hi, in_lo, gap: float, lo_bins, where, lens, costs, bin_cost, bin_tok, base: int, capacity: int
) -> tuple | None:
    """Move a piece of the costlier container to the cheaper one, or swap a pair; (the cost
    moved, the pieces changed), or None where nothing fits that lowers the pair's maximum."""
    c = costs[in_hi]
    room = capacity - bin_tok[lo_bins]
    ok = (c > 0) & (c < gap) & (lens[in_hi] <= room.max())
    if ok.any():  # a move: the piece closest to half the gap, into the bin with most room
        cand = in_hi[ok]
        p = int(cand[np.argmin(np.abs(costs[cand] - gap / 2))])
        _move(p, int(lo_bins[np.argmax(room)]), where, lens, costs, bin_cost, bin_tok, base)
        return float(costs[p]), np.array([p])
    pair = _best_swap(in_hi, in_lo, gap, where, lens, costs, bin_tok, base, capacity)
    if pair is None:
        return None
    a, b = pair
    x, y = int(where[a] - base), int(where[b] - base)
    _move(a, y, where, lens, costs, bin_cost, bin_tok, base)
    _move(b, x, where, lens, costs, bin_cost, bin_tok, base)
    return float(costs[a] - costs[b]), np.array(sorted((a, b)))


def _move(p: int, dst: int, where, lens, costs, bin_cost, bin_tok, base: int) -> None:
    src = int(where[p] - base)
    bin_cost[src] -= costs[p]
    bin_tok[src] -= lens[p]
    bin_cost[dst] += costs[p]
    bin_tok[dst] += lens[p]
    where[p] = base + dst


def _best_swap(A, B, gap: float, where, lens, costs, bin_tok, base: int, capacity: int):
    """Pieces ``a`` of ``A`` and ``b`` of ``B`` with ``0 < cost_a - cost_b < gap``, closest to
    half the gap, that fit each other's bin; None if there is none. For each ``a``, the two
    pieces of ``B`` around the ideal cost (a sorted search, not all pairs)."""
    if len(A) == 0 or len(B) == 0:
        return None
    Bs = B[np.argsort(costs[B], kind="stable")]
    cb, ca = costs[Bs], costs[A]
    at = np.searchsorted(cb, ca - gap / 2)
    best, best_err = None, np.inf
    for shift in (-1, 0):
        b = Bs[np.clip(at + shift, 0, len(Bs) - 1)]
        d = ca - costs[b]
        xa, yb = where[A] - base, where[b] - base
        fits = (bin_tok[yb] - lens[b] + lens[A] <= capacity) & (bin_tok[xa] - lens[A] + lens[b] <= capacity)
        err = np.where((d > 0) & (d < gap) & fits, np.abs(d - gap / 2), np.inf)
        k = int(np.argmin(err))
        if err[k] < best_err:
            best, best_err = (int(A[k]), int(b[k])), err[k]
    return best
