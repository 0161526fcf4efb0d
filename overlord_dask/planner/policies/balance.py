"""Attention-cost-aware planning: choose a window of steps, then balance it across ranks.

Why not a greedy per step: attention cost grows with L², and a step is nearly full (``balance.step_fill``),
so a rank that holds a long document cannot shed enough short-document tokens to others to even
out; the capacity binds before the cost does, and a central greedy does no better than per-rank
loaders. What works is deciding *which* long documents share a step (``benchmarks/balance.py``
compares the result with per-rank loaders over the same documents):

1. **Select** the next window of ``W`` steps' tokens with weighted fair queuing over the sources
   (:func:`wfq_select`): piece ``k`` of source ``s`` gets the tag ``(surplus_s + tokens before
   it)/w_s`` and the window takes the smallest tags. The surplus carries across windows, so every
   prefix of the run is within one piece per source of the declared mix. Numpy only.
2. **Heavy pieces** (at least ``heavy_tokens`` long) are grouped, oldest first, into groups of
   ``dp`` pieces of similar cost, and each group is placed one piece per rank into the same
   (step, micro-batch) row. The ``< dp`` newest heavy pieces that do not make a whole group wait
   for the next window (WLB-LLM's *outlier delay*); a piece that has already waited
   ``max_delay`` windows is placed alone. Which *step* a group goes to follows the selection
   chronology per source (:func:`_groups_to_steps`), so the mix holds over any stretch of steps,
   not only over whole windows; inside its step a group takes the row with the least cost.
3. **Light pieces** are shared among the window's steps so that each source's cumulative tokens
   stay on its selection chronology (:func:`_light_to_steps`, making up for the coarse heavy
   groups), and are *water-filled* over the step's bins (sync ``micro_batch``) or ranks (sync
   ``step``): the container with less heavy cost gets more light tokens, so all reach the same
   cost ``Q``, without exceeding capacity. A repair pass moves pieces that overflow a bin to the
   emptiest bin with room, or defers them to the next window.

Guarantees (tested): no bin over capacity; every selected piece is planned exactly once (in this
window or a later one); a piece waits at most ``max_delay`` windows; over any run of whole
windows, each source's planned tokens differ from its declared share by at most the pieces still
waiting (fewer than ``dp`` heavy pieces plus the deferred overflow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...pieces import AGE, SOURCE, START, STOP, WIDTH, lengths, slots, stable_order, stream_lengths
from ..streams.stream import SourceStream
from . import kernels
from .base import Starved
from .polish import polish


def wfq_select(
    streams: list[SourceStream], weights: np.ndarray, budget: int, surplus: np.ndarray, cut: bool = False
) -> np.ndarray:
    """The next ``budget`` tokens of pieces across sources, in weighted-fair-queuing order.

    Returns rows ``[source, epoch, unit, doc, start, stop]`` (selection order) and advances each
    stream past what it took. With ``cut`` the rows hold exactly ``budget`` tokens: the first
    piece that does not fit is cut, and its source's cursor stops inside the document. Raises
    ``Starved`` (streams untouched) if metadata is missing.
    """
    active = np.flatnonzero(weights > 0)
    cand: dict[int, np.ndarray] = {}
    need = {int(i): int(weights[i] * budget * 1.25) + streams[i].piece_tokens for i in active}
    while True:
        for i in active:
            i = int(i)
            if i not in cand or len(cand[i]) == 0 or int(stream_lengths(cand[i]).sum()) < need[i]:
                rows, enough = streams[i].pieces_ahead(need[i])
                if not enough:  # (it can go on only once it holds need[i] tokens, the first missing block one)
                    raise Starved(streams[i].name, *streams[i].shortfall(need[i]))
                cand[i] = rows
        src_t, got, taken_tokens = _wfq_merge(
            [stream_lengths(cand[int(i)]) for i in active], active, surplus, weights, budget, cut
        )
        counts = np.zeros(len(streams), np.int64)
        counts[active] = got
        # a source whose every candidate was taken might have had more to give: widen and redo
        short = [int(i) for i in active if counts[i] == len(cand[int(i)])]
        if not short:
            break
        for i in short:
            need[i] *= 2
    # a source's tags rise along its candidates, so what it gives is a prefix of them, which
    # fills its rows of the selection order
    out = np.empty((len(src_t), WIDTH), dtype=np.int64)
    out[:, SOURCE] = src_t
    cut_source = int(src_t[-1]) if len(src_t) > counts.sum() else -1
    given = {}
    for i in active:
        i = int(i)
        k = int(counts[i]) + (i == cut_source)
        if k:
            out[np.flatnonzero(src_t == i), 1:] = given[i] = cand[i][:k]
    if cut_source >= 0:  # the next piece, cut to the tokens left (it is longer)
        out[-1, STOP] = out[-1, START] + budget - taken_tokens
        given[cut_source] = np.concatenate([given[cut_source][:-1], out[-1:, 1:]])
    for i, rows in given.items():  # (after the cut: a cut source's cursor stops inside the document)
        streams[i].take(rows)
    return out


def _wfq_merge(lens: list[np.ndarray], ids: np.ndarray, surplus, weights, budget: int, cut: bool):
    """The pieces weighted fair queuing takes from candidates of ``lens`` tokens (one array per
    source ``ids[k]``): their sources in selection order, the pieces taken per source (without a
    cut one) and their tokens. Compiled (``kernels.wfq_merge``) where numba is at hand, else the
    numpy below: a stable sort of every candidate's tag, the same order."""
    surplus = np.asarray(surplus, dtype=np.float64)[ids]
    weights = np.asarray(weights, dtype=np.float64)[ids]
    if kernels.COMPILED:
        starts = np.zeros(len(lens) + 1, np.int64)
        np.cumsum([len(x) for x in lens], out=starts[1:])
        return kernels.wfq_merge(
            np.concatenate(lens) if lens else np.zeros(0, np.int64),
            starts,
            ids.astype(np.int64),
            surplus,
            weights,
            int(budget),
            bool(cut),
        )
    tags = [(surplus[k] + (np.cumsum(x) - x)) / weights[k] for k, x in enumerate(lens)]
    # (stable: equal tags keep the sources' order, as the candidates are concatenated by source)
    order = np.argsort(np.concatenate(tags), kind="stable")
    cum = np.cumsum(np.concatenate(lens)[order])
    n_take = int(np.searchsorted(cum, budget, side="right"))
    taken_tokens = int(cum[n_take - 1]) if n_take else 0
    if cut and taken_tokens < budget and n_take < len(order):
        order = order[: n_take + 1]  # the next piece, cut to the tokens left
    else:
        order = order[:n_take]
    src = np.concatenate([np.full(len(x), i, np.int64) for i, x in zip(ids, lens)])[order]
    got = np.array([np.count_nonzero(src[:n_take] == i) for i in ids], np.int64)
    return src, got, taken_tokens


@dataclass(slots=True)
class WindowPlan:
    steps: list[tuple[np.ndarray, np.ndarray]]  # per step: piece rows [n, 6] and int32 [rank, micro_batch] per row
    pending: np.ndarray  # rows [n, 7] (with age) carried into the next window
    bin_costs: list[np.ndarray]  # per step: cost[rank, micro_batch]


def balance_window(pieces: np.ndarray, costs: np.ndarray, **kw) -> WindowPlan:
    """Assign a window's pieces (rows ``[source, epoch, unit, doc, start, stop, age]``, oldest
    first) to ``steps × dp × micro_batches`` bins of ``capacity`` tokens (the keywords of
    :func:`place_window`)."""
    return place_window(pieces, costs, **kw).finish()


@dataclass(slots=True)
class Placement:
    """A window's pieces placed in bins (:func:`place_window`), before the last pass: which
    pieces wait for the next window is known here (the last pass moves pieces only between the
    bins of their step), so a planner that tops the window up with more pieces and places it
    again (``cost_balanced.py``) need not finish a placement it discards."""

    pieces: np.ndarray
    lens: np.ndarray
    costs: np.ndarray
    where: np.ndarray  # flat bin per piece, -1: pending
    bin_cost: np.ndarray
    bin_tok: np.ndarray
    dp: int
    micro_batches: int
    capacity: int
    sync: str

    def pending_tokens(self) -> int:
        """Tokens of the pieces that wait for the next window."""
        return int(self.lens[self.where < 0].sum())

    def finish(self) -> WindowPlan:
        """The last pass (``polish.py``), then the window's plan."""
        where, bin_cost, pieces = self.where, self.bin_cost, self.pieces
        steps, n_bins = bin_cost.shape
        dp, micro_batches = self.dp, self.micro_batches
        # --- 4. single pieces off the costliest container of each step (or micro-batch row)
        polish(
            where,
            self.lens,
            self.costs,
            bin_cost,
            self.bin_tok,
            steps=steps,
            dp=dp,
            micro_batches=micro_batches,
            capacity=self.capacity,
            sync=self.sync,
        )
        # --- outputs: per step, its rows by (rank, micro-batch), each bin's in window order (flat:
        # no Python object per rank, so the cost per step does not grow with dp)
        out_steps, out_costs = [], []
        placed = np.flatnonzero(where >= 0)
        placed = placed[stable_order(where[placed])]
        bins = where[placed]
        bounds = np.searchsorted(bins, np.arange(steps + 1) * n_bins)
        # one gather of the window's placed rows and one of their slots, cut into steps (slices)
        rows_out = pieces[:, :WIDTH][placed]
        slot_out = slots(bins % n_bins, micro_batches)
        for s in range(steps):
            out_steps.append((rows_out[bounds[s] : bounds[s + 1]], slot_out[bounds[s] : bounds[s + 1]]))
            out_costs.append(bin_cost[s].reshape(dp, micro_batches).copy())
        pending = pieces[where < 0].copy()
        pending[:, AGE] += 1
        return WindowPlan(out_steps, pending, out_costs)


def place_window(
    pieces: np.ndarray,
    costs: np.ndarray,
    *,
    steps: int,
    dp: int,
    micro_batches: int,
    capacity: int,
    step_budget: int,
    heavy_tokens: int,
    sync: str = "micro_batch",
    max_delay: int = 2,
) -> Placement:
    """Steps 2 and 3 of the module docstring: heavy groups and light pieces placed in the
    window's bins (:meth:`Placement.finish` does the rest)."""
    lens = lengths(pieces)
    n_bins = dp * micro_batches
    bin_cost = np.zeros((steps, n_bins))
    bin_tok = np.zeros((steps, n_bins), dtype=np.int64)
    where = np.full(len(pieces), -1, dtype=np.int64)  # flat bin index step*n_bins + bin, -1 = pending

    heavy = np.flatnonzero(lens >= heavy_tokens)
    light = np.flatnonzero(lens < heavy_tokens)

    # --- 2. heavy groups of dp similar pieces; outliers without partners wait (bounded)
    # a bin's effective cost: its heavy piece plus the light tokens that will fill the rest of it
    rho = (
        float(costs[light].sum() / max(lens[light].sum(), 1)) if len(light) else float(costs.sum() / max(lens.sum(), 1))
    )
    eff = costs[heavy] + rho * (capacity - lens[heavy])
    groups = group_heavy(eff, pieces[heavy, AGE] >= max_delay, dp, age=pieces[heavy, AGE], empty=rho * capacity)
    # the step each piece was selected for: its position in selection order against the step budgets
    intended = np.minimum(((np.cumsum(lens) - lens / 2) // max(step_budget, 1)).astype(np.int64), steps - 1)
    if groups:
        step_of_group = _groups_to_steps(groups, heavy, pieces, lens, intended, steps)
        _place_groups(groups, heavy, costs, lens, step_of_group, where, bin_cost, bin_tok, dp, capacity)

    # --- 3. light pieces: per step, from each source what keeps its cumulative tokens on the
    # selection chronology (making up for the coarse heavy groups), then water-filled over bins
    step_room = np.maximum(step_budget - bin_tok.sum(axis=1), 0).astype(np.float64)
    light_total = float(lens[light].sum())
    if step_room.sum() > light_total > 0:  # fewer light tokens than room: share the shortfall evenly
        step_room *= light_total / step_room.sum()
    step_of = _light_to_steps(light, heavy, where, pieces, lens, intended, step_room, n_bins)
    mine = [light[step_of == s] for s in range(steps)]
    quotas = (_rank_quotas if sync == "step" else _row_quotas)(
        mine, lens, costs, bin_cost, bin_tok, capacity, dp, micro_batches
    )
    _water_fill_steps(mine, quotas, lens, costs, where, bin_cost, bin_tok, capacity)
    return Placement(pieces, lens, costs, where, bin_cost, bin_tok, dp, micro_batches, capacity, sync)


def _groups_in_order(groups, heavy, costs, step_of_group, steps: int):
    """Heavy groups in placement order (biggest cost first), each as its pieces by falling cost
    and the steps to try: its own step first, then the nearest ones (keeps the per-step mix)."""
    near = [sorted(range(steps), key=lambda t: (abs(t - t0), t)) for t0 in range(steps)]
    for g in np.argsort([-costs[heavy[g]].sum() for g in groups], kind="stable").tolist():
        members = heavy[groups[g]]
        yield members[np.argsort(-costs[members], kind="stable")], near[int(step_of_group[g])]


def _place_groups(groups, heavy, costs, lens, step_of_group, where, bin_cost, bin_tok, dp: int, capacity: int) -> None:
    """Place each heavy group, biggest first, one piece per rank into one (step, micro-batch)
    row: its own step first, then the nearest ones (keeps the per-step mix), rows by least cost,
    its largest piece on the rank whose bin costs least. A group that fits no row stays pending
    (``where`` -1). Writes ``where``, ``bin_cost`` and ``bin_tok`` (``[steps, dp·mb]``).
    Compiled (``kernels.place_groups``) where numba is at hand, else :func:`_place_groups_numpy`:
    the same choices."""
    if not kernels.COMPILED:
        return _place_groups_numpy(groups, heavy, costs, lens, step_of_group, where, bin_cost, bin_tok, dp, capacity)
    steps, n_bins = bin_cost.shape
    starts = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([len(g) for g in groups], out=starts[1:])
    flat_cost, flat_tok = bin_cost.ravel(), bin_tok.ravel()  # views, written in place
    kernels.place_groups(
        heavy[np.concatenate(groups)],
        starts,
        np.ascontiguousarray(step_of_group, dtype=np.int64),
        lens,
        costs.astype(np.float64, copy=False),
        where,
        flat_cost,
        flat_tok,
        steps,
        n_bins,
        dp,
        capacity,
    )


def _place_groups_numpy(
    groups, heavy, costs, lens, step_of_group, where, bin_cost, bin_tok, dp: int, capacity: int
) -> None:
    """:func:`_place_groups` in numpy, for rows of many bins (large dp): the same choices."""
    steps, n_bins = bin_cost.shape
    micro_batches = n_bins // dp
    row_cost = np.zeros((steps, micro_batches))
    flat_cost, flat_tok = bin_cost.ravel(), bin_tok.ravel()  # views
    rank_bins = np.arange(dp) * micro_batches
    for members, candidate_steps in _groups_in_order(groups, heavy, costs, step_of_group, steps):
        m_lens, m_costs = lens[members], costs[members]
        for s in candidate_steps:
            placed = False
            for m in np.argsort(row_cost[s], kind="stable"):
                bins = rank_bins + (s * n_bins + int(m))
                bins = bins[np.argsort(flat_cost[bins], kind="stable")[: len(members)]]
                if np.all(capacity - flat_tok[bins] >= m_lens):
                    where[members] = bins
                    flat_tok[bins] += m_lens  # distinct bins: the same as np.add.at
                    flat_cost[bins] += m_costs
                    row_cost[s, m] += m_costs.sum()
                    placed = True
                    break
            if placed:
                break


def _groups_to_steps(groups, heavy, pieces, lens, intended, steps: int) -> np.ndarray:
    """The step each heavy group goes to, so that every source's tokens follow the selection
    chronology: a piece selected for (or carried into) step ``t`` belongs there, and groups are
    chosen greedily, step by step, to keep each source's cumulative tokens closest to the
    cumulative tokens selected for it up to that step. Without this, similar-cost grouping
    would put all of a long-document source into a few steps, and the mix over any stretch of
    steps shorter than a window would be off by many points."""
    n_src = int(pieces[:, SOURCE].max()) + 1
    members = heavy[np.concatenate(groups)]
    group_of = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    src = pieces[members, SOURCE]
    # token counts: whole numbers, so these float sums are exact in any order
    vec = np.bincount(group_of * n_src + src, weights=lens[members], minlength=len(groups) * n_src)
    vec = vec.reshape(len(groups), n_src)
    target = np.bincount(intended[members] * n_src + src, weights=lens[members], minlength=steps * n_src)
    target = target.reshape(steps, n_src)
    cum_target = np.cumsum(target, axis=0)
    return (kernels.groups_to_steps if kernels.COMPILED else _groups_loop_numpy)(vec, cum_target, steps)


def _groups_loop_numpy(vec, cum_target, steps: int) -> np.ndarray:
    """:func:`_groups_to_steps`' greedy loop where numba is missing (``kernels.groups_to_steps``)."""
    n_src = vec.shape[1]
    out = np.full(len(vec), steps - 1, dtype=np.int64)
    left = len(vec)
    placed = np.zeros(len(vec))  # +inf once a group is placed: never the least error, nor the smallest group, again
    group_tokens = vec.sum(axis=1)
    have, have_tokens = np.zeros(n_src), 0.0
    for t in range(steps):
        goal = cum_target[t]
        goal_tokens = goal.sum()
        while left and have_tokens < goal_tokens - 0.5 * (group_tokens + placed).min():
            k = int(np.argmin(np.abs(vec + (have - goal)).sum(axis=1) + placed))  # ties: the lowest index
            out[k], placed[k], left = t, np.inf, left - 1
            have += vec[k]
            have_tokens += group_tokens[k]
    return out


def _light_to_steps(light, heavy, where, pieces, lens, intended, step_room, n_bins) -> np.ndarray:
    """The step of every light piece. Each step takes ``step_room`` light tokens, shared among
    the sources by how far each one's cumulative tokens (heavy pieces placed so far plus light
    ones) are behind the cumulative tokens selected for it; each source's light pieces keep
    their selection order. The last step takes whatever is left."""
    steps = len(step_room)
    if len(light) == 0:
        return np.zeros(0, dtype=np.int64)
    n_src = int(pieces[:, SOURCE].max()) + 1
    src = pieces[:, SOURCE]
    placed_heavy = heavy[where[heavy] >= 0]
    # tokens per (step, source), added in piece order as np.add.at would (bincount is far faster)
    cells = steps * n_src
    at = (where[placed_heavy] // n_bins) * n_src + src[placed_heavy]
    heavy_at = np.bincount(at, weights=lens[placed_heavy], minlength=cells).reshape(steps, n_src)
    counted = np.concatenate([placed_heavy, light])  # heavy pieces left pending are nobody's target
    at = intended[counted] * n_src + src[counted]
    target = np.bincount(at, weights=lens[counted], minlength=cells).reshape(steps, n_src)
    cum_target, cum_heavy = np.cumsum(target, axis=0), np.cumsum(heavy_at, axis=0)
    order = stable_order(src[light])  # light pieces grouped by source, selection order kept
    bounds = np.searchsorted(src[light][order], np.arange(n_src + 1))
    lq = lens[light][order].astype(np.float64)
    cq = np.concatenate([[0.0], np.cumsum(lq)])  # cumulative tokens along each source's queue
    mid = cq[1:] - lq / 2  # a piece is taken when its midpoint fits the quota
    loop = kernels.light_to_steps if kernels.COMPILED else _light_loop_numpy
    out = np.empty(len(light), dtype=np.int64)
    out[order] = loop(cq, mid, bounds, cum_target, cum_heavy, np.ascontiguousarray(step_room, dtype=np.float64))
    return out


def _light_loop_numpy(cq, mid, bounds, cum_target, cum_heavy, step_room) -> np.ndarray:
    """:func:`_light_to_steps`' loop over steps where numba is missing (``kernels.light_to_steps``):
    each queued light piece's step."""
    steps, n_src = cum_target.shape
    head = bounds[:-1].copy()
    light_have = np.zeros(n_src)
    step_sorted = np.full(len(mid), steps - 1, dtype=np.int64)
    for t in range(steps - 1):
        avail = cq[bounds[1:]] - cq[head]
        behind = np.minimum(np.maximum(cum_target[t] - cum_heavy[t] - light_have, 0.0), avail)
        room = step_room[t]
        if behind.sum() <= 0 or room <= 0:
            continue
        quota = behind * min(1.0, room / behind.sum())
        extra = room - quota.sum()  # room beyond what the sources are behind: in proportion to what is left
        if extra > 0 and (avail - quota).sum() > 0:
            quota += extra * (avail - quota) / (avail - quota).sum()
        for k in np.flatnonzero(quota > 0):
            a, b = head[k], bounds[k + 1]
            n = int(np.searchsorted(mid[a:b] - cq[a], quota[k], side="right"))
            step_sorted[a : a + n] = t
            light_have[k] += cq[a + n] - cq[a]
            head[k] = a + n
    return step_sorted


SKIP_STATES = 256  # the programme's skip counts at most: finer than this, skips go in blocks of pieces


def group_heavy(
    costs: np.ndarray,
    must: np.ndarray,
    dp: int,
    max_skip: int | None = None,
    age: np.ndarray | None = None,
    empty: float = 0.0,
) -> list[np.ndarray]:
    """Partition heavy pieces into groups of ``dp`` of similar cost; return index arrays.

    ``costs`` are *effective* bin costs (the piece plus the light tokens that will fill the rest of
    its bin); ``empty`` is the effective cost of a bin with no heavy piece. Pieces are sorted by
    cost; a dynamic programme over (position, pieces skipped) chooses contiguous groups
    minimising the sum over groups of ``log(max/mean)²`` (the imbalance the group leaves in its
    row) and may skip (defer) up to ``max_skip`` pieces, never one marked ``must`` (it waited long
    enough). Deferring costs more the older a piece is, so old pieces are grouped while partners
    are at hand. The last pieces may form a smaller group, priced as a full one whose missing
    members are ``empty`` bins: cheap for pieces near the threshold, dear for long ones.

    The programme's work is pieces × skip states; both grow with ``dp`` (``max_skip`` is
    ``4·dp``), so beyond ``SKIP_STATES`` states pieces are skipped in blocks of
    ``ceil(max_skip / SKIP_STATES)`` neighbours (similar costs, as the order is by cost): the
    same choices as before up to dp 64, and work per piece that stays flat at any dp. Only the
    positions and skip counts a plan can reach are computed (``kernels.programme``): where the
    block divides ``dp`` (any power of two from dp 64 on), one position in a block.
    """
    n = len(costs)
    if n == 0:
        return []
    max_skip = 4 * dp if max_skip is None else max_skip
    block = max(1, -(-max_skip // SKIP_STATES))
    K = max_skip // block
    order = np.argsort(-costs, kind="stable")
    c = np.maximum(costs[order], 1e-300)
    skip_cost = 0.0024 * (
        1 + 3 * (age[order] if age is not None else np.zeros(n))
    )  # ~(log 1.05)^2, more for older pieces
    skip_cost[must[order]] = np.inf  # waited long enough: never deferred
    d = math.gcd(dp, block)  # a plan stands only on multiples of d (it moves by dp or by block)
    if block == 1:
        skip = skip_cost
    else:  # a block's cost: its pieces' (inf if one of them may not wait, or it runs past the end),
        # where a plan can stand
        skip = np.full(n, np.inf)
        if n >= block:
            skip[: n - block + 1 : d] = np.lib.stride_tricks.sliding_window_view(skip_cost, block)[::d].sum(axis=1)
    csum = np.concatenate([[0.0], np.cumsum(c)])
    spread = np.full(n, np.inf)
    if n >= dp:  # squared log of max/mean of the group starting at i
        mean = (csum[dp:] - csum[:-dp]) / dp
        spread[: n - dp + 1] = np.log(c[: n - dp + 1] / mean) ** 2
    size = n - np.arange(n)  # a tail group from i has n - i members, padded with empty bins
    tail_mean = (csum[n] - csum[:-1] + np.maximum(dp - size, 0) * empty) / dp
    tail = np.log(np.maximum(c, empty) / np.maximum(tail_mean, 1e-300)) ** 2 + 0.01  # never free
    choice = (kernels.programme if kernels.COMPILED else _programme_numpy)(n, dp, K, block, spread, skip, tail, d)
    groups, i, k = [], 0, 0
    while i < n:
        ch = choice[i // d, k]
        if ch == 1:
            groups.append(order[i : i + dp])
            i += dp
        elif ch == 2:
            i, k = i + block, k + 1
        else:  # 3: the rest as one smaller group
            groups.append(order[i:n])
            i = n
    return groups


def _programme_numpy(n, dp, K, g, spread, skip, tail, d) -> np.ndarray:
    """:func:`group_heavy`'s programme vectorised over the skip count, where numba is missing
    (``kernels.programme`` makes the same choices, over the same reachable positions and states,
    with the same ring of rows)."""
    m = (n - 1) // d + 1
    choice = np.zeros((m, K + 1), dtype=np.int8)  # 1 = group, 2 = skip a block, 3 = smaller tail group
    R = max(dp, g) // d + 1
    ring = np.full((R, K + 1), np.inf)
    if n % d == 0:
        ring[(n // d) % R] = 0.0
    sk_row = np.full(K + 1, np.inf)  # scratch rows, written in place: this loop runs once per position
    better_row = np.zeros(K + 1, dtype=bool)
    for j in range(m - 1, -1, -1):
        i = j * d
        kb = min(K, i // g) + 1  # the states reachable at i (k blocks skipped before it)
        v, ch, sk, better = ring[j % R][:kb], choice[j][:kb], sk_row[:kb], better_row[:kb]
        v.fill(np.inf)
        if i + dp <= n:
            np.add(ring[((i + dp) // d) % R][:kb], spread[i], out=v)
            ch.fill(1)
        if skip[i] < np.inf:
            mk = min(kb, K)  # (sk[K] stays inf: no block is skipped past K)
            np.add(ring[((i + g) // d) % R][1 : mk + 1], skip[i], out=sk[:mk])
            np.less(sk, v, out=better)
            np.copyto(v, sk, where=better)
            ch[better] = 2
        if i + dp > n and tail[i] < np.inf:
            np.less(tail[i], v, out=better)
            v[better] = tail[i]
            ch[better] = 3
    return choice


def _row_quotas(mine, lens, costs, bin_cost, bin_tok, capacity, dp, micro_batches) -> dict[int, np.ndarray]:
    """Sync ``micro_batch``: every step's light-token quota per bin (``[dp·mb]``, for
    :func:`_water_fill`). Each micro-batch index (a row across ranks) is balanced on its own
    (FSDP waits per row), with one :func:`_level` call for the whole window: each step's
    micro-batch rows are independent columns, so the window's steps are more columns of the same
    problem. The same IEEE operations per column as one call per step (the plans are bit for bit
    the same), and one call per window instead of one per step."""
    active = [s for s, idx in enumerate(mine) if len(idx)]
    if not active:
        return {}
    totals = np.array([int(lens[mine[s]].sum()) for s in active], dtype=np.int64)
    rho = np.array(
        [float(costs[mine[s]].sum()) / max(int(t), 1) for s, t in zip(active, totals)]
    )  # light cost per token, per step
    bin_room = (capacity - bin_tok[active]).reshape(len(active), dp, micro_batches).astype(np.float64)
    row_room = bin_room.sum(axis=1)  # [steps, mb]
    row_tok = np.stack([int(t) * rr / max(rr.sum(), 1.0) for t, rr in zip(totals, row_room)])
    h = bin_cost[active].reshape(len(active), dp, micro_batches).transpose(1, 0, 2).reshape(dp, -1)
    q = _level(h, bin_room.transpose(1, 0, 2).reshape(dp, -1), row_tok.ravel(), np.repeat(rho, micro_batches))
    q = q.reshape(dp, len(active), micro_batches).transpose(1, 0, 2)
    return {s: q[a].ravel() for a, s in enumerate(active)}


def _water_fill_steps(mine, quotas, lens, costs, where, bin_cost, bin_tok, capacity: int) -> None:
    """:func:`_water_fill` of each step with quotas (``{step: quota}``; a step's quotas read only
    its own bins, so all are known before any fill), its light pieces ``mine[step]``. Compiled
    (``kernels.water_fill_steps``), the window's steps in one call, where numba is at hand: a
    dozen numpy calls per step were much of a window's planning at a few hundred ranks."""
    n_bins = bin_cost.shape[1]
    if not kernels.COMPILED:
        for s, quota in quotas.items():
            _water_fill(mine[s], lens, costs, where, bin_cost[s], bin_tok[s], s * n_bins, capacity, quota)
        return
    if not quotas:
        return
    steps = list(quotas)
    starts = np.zeros(len(steps) + 1, dtype=np.int64)
    np.cumsum([len(mine[s]) for s in steps], out=starts[1:])
    kernels.water_fill_steps(
        np.concatenate([mine[s] for s in steps]).astype(np.int64, copy=False),
        starts,
        np.array(steps, dtype=np.int64),
        np.stack([quotas[s] for s in steps]).astype(np.float64, copy=False),
        lens,
        costs.astype(np.float64, copy=False),
        where,
        bin_cost.reshape(-1),  # (views: written in place)
        bin_tok.reshape(-1),
        n_bins,
        capacity,
    )


def _water_fill(idx, lens, costs, where, bin_cost, bin_tok, base, capacity, quota) -> None:
    """Spread light pieces ``idx`` over one step's bins by ``quota`` (light tokens per bin, from
    :func:`_row_quotas` or :func:`_rank_quotas`, which level the containers' cost), within
    capacity. Vectorised; modifies the arrays in place."""
    # cut the pieces' cost sequence where the quotas' cost ends (each bin's light tokens at the
    # step's light cost per token, as leveled): pieces dearer per token than the average (short
    # documents under a per-document cost) then take fewer tokens, so every bin gets the cost it
    # was leveled for; a piece goes where it starts
    c = costs[idx].astype(np.float64)
    ends = np.cumsum(c)
    rho = ends[-1] / max(float(lens[idx].sum()), 1.0) if len(idx) else 0.0
    b = np.minimum(np.searchsorted(np.cumsum(quota) * rho, ends - c, side="right"), len(quota) - 1)
    add_at = kernels.add_at if kernels.COMPILED else np.add.at
    add_at(bin_tok, b, lens[idx])
    add_at(bin_cost, b, costs[idx].astype(np.float64, copy=False))
    where[idx] = base + b
    # repair: move the last pieces out of any bin over capacity (compiled where numba is at hand:
    # at thousands of ranks many bins overflow, and this loop was much of a window's planning)
    if kernels.COMPILED:
        kernels.repair_bins(
            np.ascontiguousarray(idx, dtype=np.int64),
            np.ascontiguousarray(b, dtype=np.int64),
            lens,
            costs.astype(np.float64, copy=False),
            where,
            bin_tok,
            bin_cost,
            base,
            capacity,
        )
    else:
        _repair_numpy(idx, b, lens, costs, where, bin_tok, bin_cost, base, capacity)


def _repair_numpy(idx, b, lens, costs, where, bin_tok, bin_cost, base, capacity) -> None:
    """:func:`_water_fill`'s repair where numba is missing (``kernels.repair_bins``): the last
    pieces of every bin over capacity go to the bin with room of least cost, or wait."""
    for bi in np.flatnonzero(bin_tok > capacity):
        members = idx[b == bi][::-1]
        for p in members:
            if bin_tok[bi] <= capacity:
                break
            bin_tok[bi] -= lens[p]
            bin_cost[bi] -= costs[p]
            fits = np.flatnonzero(capacity - bin_tok >= lens[p])
            if len(fits):
                t = int(fits[np.argmin(bin_cost[fits])])
                bin_tok[t] += lens[p]
                bin_cost[t] += costs[p]
                where[p] = base + t
            else:
                where[p] = -1  # deferred to the next window


def _rank_quotas(mine, lens, costs, bin_cost, bin_tok, capacity, dp, micro_batches) -> dict[int, np.ndarray]:
    """Sync ``step``: every step's light-token quota per bin (``[dp·mb]``) that levels its ranks'
    cost (the ranks are the containers); a rank's quota goes to its micro-batches in order of room."""
    quotas = {}
    for s, idx in enumerate(mine):
        if not len(idx):
            continue
        total_tok = int(lens[idx].sum())
        rho = float(costs[idx].sum()) / max(total_tok, 1)  # light cost per token
        bin_room = (capacity - bin_tok[s]).reshape(dp, micro_batches).astype(np.float64)
        rank_quota = _level(bin_cost[s].reshape(dp, micro_batches).sum(axis=1), bin_room.sum(axis=1), total_tok, rho)
        quota = np.zeros((dp, micro_batches))
        for r in range(dp):
            left = rank_quota[r]
            for m in np.argsort(-bin_room[r], kind="stable"):
                quota[r, m] = min(left, bin_room[r, m])
                left -= quota[r, m]
        quotas[s] = quota.ravel()
    return quotas


def _level(h: np.ndarray, room: np.ndarray, tokens, rho) -> np.ndarray:
    """Light tokens per container so that ``h + rho·tokens`` is level, within ``room``: per
    column (independent problems along axis 1, containers along axis 0) the lowest level ``Q``
    with ``f(Q) = sum(clip((Q - h)/rho, 0, room)) >= tokens`` (every container full if the room
    is short). ``f`` is piecewise linear with kinks where a container starts (``h``) and stops
    (``h + rho·room``) filling: sort the kinks, count the containers filling between each two
    (a running sum of +1 at starts, -1 at stops), integrate ``f`` along them, find the segment
    that reaches ``tokens`` and interpolate. ``rho``: one light cost per token, or one per
    column. Exact, ``O(n log n)`` per column (evaluating ``f`` at every kink directly is
    ``O(n²)``: at thousands of ranks, most of a window's planning), and vectorised over columns."""
    h2 = h.reshape(len(h), -1).astype(np.float64)
    n, cols = h2.shape
    room2 = np.broadcast_to(room.reshape(len(room), -1), h2.shape).astype(np.float64)
    tok = np.broadcast_to(np.asarray(tokens, dtype=np.float64), (cols,))
    pos = np.concatenate([h2, h2 + rho * room2])  # [2n, cols]: starts, then stops
    order = np.argsort(pos, axis=0, kind="stable")
    kinks = np.take_along_axis(pos, order, axis=0)
    step = np.where(order < n, 1.0, -1.0)  # a start adds a filling container, a stop removes one
    filling = np.cumsum(step, axis=0)[:-1]  # containers filling between kink j and j + 1
    fill = np.zeros_like(kinks)  # f at each kink (f is 0 at the lowest: no container fills below it)
    np.cumsum(filling * np.diff(kinks, axis=0) / rho, axis=0, out=fill[1:])
    j = (fill < tok).sum(axis=0)  # f is non-decreasing: the first kink where it reaches tokens
    cols_i = np.arange(cols)
    full = j >= len(kinks)  # not enough room: every container full
    jj = np.minimum(j, len(kinks) - 1)
    jp = np.maximum(jj - 1, 0)
    k0, k1, f0, f1 = kinks[jp, cols_i], kinks[jj, cols_i], fill[jp, cols_i], fill[jj, cols_i]
    slope = np.where(f1 > f0, (k1 - k0) / np.where(f1 > f0, f1 - f0, 1.0), 0.0)
    q = np.where(j == 0, kinks[0], k0 + (tok - f0) * slope)
    q = np.where(full, np.inf, q)
    return np.clip((q - h2) / rho, 0, room2).reshape(h.shape)
