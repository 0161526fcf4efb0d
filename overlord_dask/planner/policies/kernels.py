"""The balancer's inner loops, compiled (numba), with the GIL released.

Why: balancing a window (``balance.py``) walks its heavy groups, the programme that forms them
and its steps one at a time; in Python those loops are most of balancing, and the planner thread
would hold the GIL meanwhile, so the scheduler's event loop (queue gets, acks, task transitions)
would wait on it. Compiled they are a small part of it, and ``nogil`` lets the event loop run
beside them (``benchmarks/balance.py`` reports the planner's time per step).

Each kernel makes exactly the choices of the numpy code in ``balance.py`` that it stands for
(the same IEEE operations in the same order, the same tie-breaks; sums over a few values are
:func:`np_sum`, numpy's own pairwise order), so a plan is the same bit for bit with or without
numba: a run resumed where numba is missing re-plans what the first run planned (tested with both
paths). Compiling is worth it for large steps only (at a few ranks the loops are short, and the
numpy code costs little more per step), while numba and its compiled
kernels cost the planner's process about 100 MB: so the kernels are plain Python functions
until :func:`warm` compiles them, which the planner does where a step has at least
``COMPILE_FROM_BINS`` micro-batches. ``COMPILED`` is False until then, and stays False where
numba cannot be imported (a Python it has no wheel for yet) or cannot compile; ``balance.py``
then runs its numpy code. Compiled once per install: ``cache=True`` keeps the machine code next
to this file (or in numba's cache directory); compiling takes seconds, so
``scripts/install.sh`` does it once, and a process that compiles only loads it.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

COMPILE_FROM_BINS = 64  # dp × micro_batches from which the planner compiles the kernels
COMPILED = False
_KERNELS: dict = {}  # name -> the Python function


def _jit(f):
    """A kernel: the Python function until :func:`warm` swaps in its compiled form (``f.py_func``
    is then the Python original)."""
    _KERNELS[f.__name__] = f
    return f


def _compile() -> None:
    """Rebind every kernel to its numba dispatcher (calls between kernels go through these
    globals, so a compiled kernel calls compiled ones). Where no cache location is writable (a
    read-only install and home: numba refuses ``cache=True``), they compile in every process
    that plans instead (seconds, at the planner's start)."""
    from numba import njit

    try:
        compiled = {name: njit(cache=True, nogil=True)(f) for name, f in _KERNELS.items()}
    except RuntimeError:
        logger.warning("no writable cache for the planner's compiled kernels: compiling them in this process")
        compiled = {name: njit(nogil=True)(f) for name, f in _KERNELS.items()}
    globals().update(compiled)


@_jit
def np_sum(a):
    """``float(a.sum())`` of a contiguous float64 vector, in numpy's own order: pairwise
    summation (blocks of up to 128 values with 8 accumulators, halves above; tested against
    numpy). Without recursion: numba cannot cache a recursive function."""
    n = len(a)
    if n <= 128:
        return _block(a, 0, n) if n else 0.0
    los, ns, split = np.empty(128, np.int64), np.empty(128, np.int64), np.zeros(128, np.bool_)
    vals = np.empty(128)
    top, nv = 0, 0
    los[0], ns[0] = 0, n
    while top >= 0:  # post-order walk of numpy's halving tree; a + b == b + a, so the order of the halves is free
        lo, m = los[top], ns[top]
        if m <= 128:
            vals[nv] = _block(a, lo, m)
            nv += 1
            top -= 1
        elif not split[top]:
            split[top] = True
            h = m // 2
            h -= h % 8
            los[top + 1], ns[top + 1], split[top + 1] = lo, h, False
            los[top + 2], ns[top + 2], split[top + 2] = lo + h, m - h, False
            top += 2
        else:
            vals[nv - 2] = vals[nv - 2] + vals[nv - 1]
            nv -= 1
            top -= 1
    return vals[0]


@_jit
def _block(a, lo, n):
    """numpy's pairwise sum of ``a[lo:lo+n]`` for ``n <= 128``."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3, r4, r5, r6, r7 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3], a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - (n % 8):
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_jit
def _argsort(keys):
    """``np.argsort(keys, kind="stable")``: indices by rising key, equal keys in index order (the
    only such order, so numpy's). A bottom-up merge sort, insertion sort for short runs: numba's
    own mergesort takes far longer to compile."""
    n = len(keys)
    idx = np.arange(n)
    run = 16
    for lo in range(0, n, run):  # insertion-sort runs of 16
        for i in range(lo + 1, min(lo + run, n)):
            j, v = i, idx[i]
            while j > lo and keys[idx[j - 1]] > keys[v]:
                idx[j] = idx[j - 1]
                j -= 1
            idx[j] = v
    tmp = np.empty(n, np.int64)
    while run < n:  # merge neighbouring runs; on ties the left run first
        for lo in range(0, n, 2 * run):
            mid, hi = min(lo + run, n), min(lo + 2 * run, n)
            a, b, k = lo, mid, lo
            while a < mid and b < hi:
                if keys[idx[b]] < keys[idx[a]]:
                    tmp[k] = idx[b]
                    b += 1
                else:
                    tmp[k] = idx[a]
                    a += 1
                k += 1
            while a < mid:
                tmp[k] = idx[a]
                a += 1
                k += 1
            while b < hi:
                tmp[k] = idx[b]
                b += 1
                k += 1
        idx, tmp = tmp, idx
        run *= 2
    return idx


@_jit
def wfq_merge(lens, starts, ids, surplus, weights, budget, cut):
    """Weighted fair queuing's choice (``balance.wfq_select``): the candidates of source ``k``
    are ``lens[starts[k]:starts[k + 1]]`` (tokens per piece, in stream order), piece ``j`` of
    them tagged ``(surplus[k] + tokens before it) / weights[k]``; the pieces go by rising tag,
    equal tags to the lower ``k`` (numpy's stable argsort of the sources' tags concatenated:
    a source's own tags never fall), while they fit ``budget``, then with ``cut`` the next one
    if tokens are left. Returns the source id (``ids[k]``) of each piece taken, in that order,
    the pieces taken per source (without the cut one) and their tokens. A merge of the
    sources' runs: it stops at the budget, where sorting every candidate's tag (a quarter more
    than the budget asks for) and gathering the rows in that order walked memory several times
    the window's size."""
    k = len(starts) - 1
    nxt = starts[:k].copy()
    before = np.zeros(k, np.int64)
    tag = np.empty(k)
    for i in range(k):
        tag[i] = (surplus[i] + before[i]) / weights[i]
    src = np.empty(starts[k], np.int64)
    acc, n, after = 0, 0, -1
    while True:
        best = -1
        for i in range(k):
            if nxt[i] < starts[i + 1] and (best < 0 or tag[i] < tag[best]):
                best = i
        if best < 0:
            break
        size = lens[nxt[best]]
        if acc + size > budget:
            after = best
            break
        acc += size
        src[n] = ids[best]
        n += 1
        before[best] += size
        nxt[best] += 1
        tag[best] = (surplus[best] + before[best]) / weights[best]
    if cut and acc < budget and after >= 0:
        src[n] = ids[after]
        n += 1
    return src[:n], nxt - starts[:k], acc


@_jit
def programme(n, dp, K, g, spread, skip, tail, d):
    """``balance.group_heavy``'s dynamic programme: ``choice[i // d, k]`` (1 = a group of ``dp``
    from ``i``, 2 = skip the block of ``g`` pieces from ``i`` (``skip[i]``: its cost, inf where
    it may not be skipped), 3 = the rest as one smaller group) with ``k`` blocks skipped so far.

    Only the states a plan can reach are computed: a plan moves from piece 0 by ``dp`` or ``g``,
    so it stands only at multiples of ``d = gcd(dp, g)`` (at thousands of ranks ``g`` divides
    ``dp``: one position in ``g``), and at piece ``i`` at most ``i // g`` blocks were skipped.
    The costs to go live in a ring of ``max(dp, g) / d + 1`` rows: a row reads only the rows
    ``g`` and ``dp`` after it, so memory is ``O(dp·K / d)``, not ``O(n·K)``."""
    m = (n - 1) // d + 1  # positions 0, d, .., (m - 1)·d: every one before n
    choice = np.zeros((m, K + 1), dtype=np.int8)
    R = max(dp, g) // d + 1
    ring = np.full((R, K + 1), np.inf)
    if n % d == 0:  # the end, where a plan can stand on it
        ring[(n // d) % R, :] = 0.0
    for j in range(m - 1, -1, -1):
        i = j * d
        kb = min(K, i // g)
        row = ring[j % R]
        row[: kb + 1] = np.inf
        if i + dp <= n:
            sp = spread[i]
            nxt = ring[((i + dp) // d) % R]
            for k in range(kb + 1):
                row[k] = nxt[k] + sp
                choice[j, k] = 1
        sc = skip[i]
        if sc < np.inf:
            nxt = ring[((i + g) // d) % R]
            for k in range(min(kb + 1, K)):
                x = nxt[k + 1] + sc
                if x < row[k]:
                    row[k] = x
                    choice[j, k] = 2
        if i + dp > n and tail[i] < np.inf:
            t = tail[i]
            for k in range(kb + 1):
                if t < row[k]:
                    row[k] = t
                    choice[j, k] = 3
    return choice


@_jit
def add_at(target, index, values):
    """``np.add.at(target, index, values)`` for a 1-D ``target``: the same additions in the same
    order (so float sums round alike), without numpy's general buffered path."""
    for j in range(len(index)):
        target[index[j]] += values[j]


@_jit
def place_groups(members, starts, step_of_group, lens, costs, where, flat_cost, flat_tok, steps, n_bins, dp, capacity):
    """``balance._place_groups_numpy``: each heavy group (``members[starts[g]:starts[g+1]]``, as
    ``group_heavy`` made it), biggest cost first, into one (step, micro-batch) row: its own step
    first, then the nearest ones (the earlier on ties), rows by least cost, its pieces by falling
    cost onto the row's bins by rising cost (stable orders throughout). A group that fits no row
    stays pending. Writes ``where``, ``flat_cost`` and ``flat_tok`` (``[steps · n_bins]``)."""
    micro_batches = n_bins // dp
    n_groups = len(starts) - 1
    key = np.empty(n_groups)
    for g in range(n_groups):
        key[g] = -np_sum(costs[members[starts[g] : starts[g + 1]]])
    row_cost = np.zeros((steps, micro_batches))
    rank_bins = np.arange(dp) * micro_batches
    for g in _argsort(key):
        m = members[starts[g] : starts[g + 1]]
        m = m[_argsort(-costs[m])]
        size = len(m)
        m_lens, m_costs = lens[m], costs[m]
        total = np_sum(m_costs)
        t0 = step_of_group[g]
        for d in range(2 * steps):  # t0, t0 - 1, t0 + 1, t0 - 2, ...
            s = t0 - (d + 1) // 2 if d % 2 == 1 else t0 + d // 2
            if s < 0 or s >= steps:
                continue
            placed = False
            for mb in _argsort(row_cost[s]):
                bins = rank_bins + (s * n_bins + mb)
                bins = bins[_argsort(flat_cost[bins])[:size]]
                fits = True
                for j in range(size):
                    if capacity - flat_tok[bins[j]] < m_lens[j]:
                        fits = False
                        break
                if fits:
                    for j in range(size):
                        where[m[j]] = bins[j]
                        flat_tok[bins[j]] += m_lens[j]
                        flat_cost[bins[j]] += m_costs[j]
                    row_cost[s, mb] += total
                    placed = True
                    break
            if placed:
                break


@_jit
def groups_to_steps(vec, cum_target, steps):
    """``balance._groups_to_steps``' greedy loop (token counts: whole numbers, exact in any
    order): step by step, the group that keeps each source's cumulative tokens closest to the
    selection's, lowest index on ties."""
    n_groups, n_src = vec.shape
    out = np.full(n_groups, steps - 1, dtype=np.int64)
    placed = np.zeros(n_groups)
    group_tokens = np.zeros(n_groups)
    for g in range(n_groups):
        for j in range(n_src):
            group_tokens[g] += vec[g, j]
    have = np.zeros(n_src)
    have_tokens = 0.0
    left = n_groups
    for t in range(steps):
        goal_tokens = 0.0
        for j in range(n_src):
            goal_tokens += cum_target[t, j]
        while left:
            smallest = np.inf
            for g in range(n_groups):
                smallest = min(smallest, group_tokens[g] + placed[g])
            if not have_tokens < goal_tokens - 0.5 * smallest:
                break
            best, k = np.inf, 0
            for g in range(n_groups):
                err = 0.0
                for j in range(n_src):
                    err += abs(vec[g, j] + (have[j] - cum_target[t, j]))
                err += placed[g]
                if err < best:
                    best, k = err, g
            out[k] = t
            placed[k] = np.inf
            left -= 1
            for j in range(n_src):
                have[j] += vec[k, j]
            have_tokens += group_tokens[k]
    return out


@_jit
def light_to_steps(cq, mid, bounds, cum_target, cum_heavy, step_room):
    """``balance._light_to_steps``' loop over steps: each step's light tokens shared among the
    sources by how far each is behind its selection, each source's queue (``cq``: cumulative
    tokens along it, ``mid``: its pieces' midpoints) taken in order. Returns each queued
    piece's step."""
    steps, n_src = cum_target.shape
    head = bounds[:-1].copy()
    light_have = np.zeros(n_src)
    step_sorted = np.full(len(mid), steps - 1, dtype=np.int64)
    avail, behind, quota, spare = np.empty(n_src), np.empty(n_src), np.empty(n_src), np.empty(n_src)
    for t in range(steps - 1):
        for j in range(n_src):
            avail[j] = cq[bounds[j + 1]] - cq[head[j]]
            behind[j] = min(max(cum_target[t, j] - cum_heavy[t, j] - light_have[j], 0.0), avail[j])
        room = step_room[t]
        total_behind = np_sum(behind)
        if total_behind <= 0 or room <= 0:
            continue
        f = min(1.0, room / total_behind)
        for j in range(n_src):
            quota[j] = behind[j] * f
        extra = room - np_sum(quota)
        for j in range(n_src):
            spare[j] = avail[j] - quota[j]
        spare_total = np_sum(spare)
        if extra > 0 and spare_total > 0:
            for j in range(n_src):
                quota[j] += extra * spare[j] / spare_total
        for j in range(n_src):
            if quota[j] > 0:
                a, b = head[j], bounds[j + 1]
                base = cq[a]
                n = 0
                while a + n < b and mid[a + n] - base <= quota[j]:
                    n += 1
                step_sorted[a : a + n] = t
                light_have[j] += cq[a + n] - cq[a]
                head[j] = a + n
    return step_sorted


@_jit
def water_fill_steps(idx, starts, steps, quotas, lens, costs, where, bin_cost, bin_tok, n_bins, capacity):
    """``balance._water_fill`` for each step ``steps[k]`` of a window: its light pieces
    ``idx[starts[k]:starts[k + 1]]`` spread over its bins (``bin_cost`` and ``bin_tok`` flat,
    ``[steps · n_bins]``) by ``quotas[k]``, then :func:`repair_bins`. The numpy code's operations
    in its order (running sums, the binary search of ``np.searchsorted(side="right")``,
    ``np.add.at``'s order), one call per window instead of a dozen numpy calls per step."""
    for k in range(len(steps)):
        a, z = starts[k], starts[k + 1]
        if z == a:
            continue
        base = steps[k] * n_bins
        seg = idx[a:z]
        ends = np.empty(z - a)
        acc, tok = 0.0, 0
        for i in range(z - a):
            acc += costs[seg[i]]
            ends[i] = acc
            tok += lens[seg[i]]
        rho = ends[z - a - 1] / max(float(tok), 1.0)
        quota = quotas[k]
        cq = np.empty(n_bins)
        run = 0.0
        for t in range(n_bins):
            run += quota[t]
            cq[t] = run * rho
        b = np.empty(z - a, np.int64)
        for i in range(z - a):
            x = ends[i] - costs[seg[i]]
            lo, hi = 0, n_bins  # the first bin whose cumulative quota cost is above x
            while lo < hi:
                mid = (lo + hi) // 2
                if cq[mid] <= x:
                    lo = mid + 1
                else:
                    hi = mid
            b[i] = min(lo, n_bins - 1)
        tok_s, cost_s = bin_tok[base : base + n_bins], bin_cost[base : base + n_bins]
        for i in range(z - a):
            tok_s[b[i]] += lens[seg[i]]
        for i in range(z - a):
            cost_s[b[i]] += costs[seg[i]]
        for i in range(z - a):
            where[seg[i]] = base + b[i]
        repair_bins(seg, b, lens, costs, where, tok_s, cost_s, base, capacity)


@_jit
def repair_bins(idx, b, lens, costs, where, bin_tok, bin_cost, base, capacity):
    """``balance._repair_numpy``: every bin over ``capacity`` (ascending) sheds its last pieces
    (``idx`` order, ``b`` their bins) until it fits, each to the bin with room of least cost
    (the lowest such index), or deferred (``where`` -1). Members per bin by a stable counting
    sort, not a scan of every piece per bin; the bin for a piece from a tree over the bins (most
    room and least cost per subtree), not a scan of every bin per piece: at thousands of ranks
    both scans made the repair grow with dp squared."""
    n_bins = len(bin_tok)
    over = np.zeros(n_bins, dtype=np.bool_)
    for t in range(n_bins):
        over[t] = bin_tok[t] > capacity
    start = np.zeros(n_bins + 1, dtype=np.int64)
    for k in range(len(b)):
        start[b[k] + 1] += 1
    for t in range(n_bins):
        start[t + 1] += start[t]
    fill = start[:-1].copy()
    members = np.empty(len(b), dtype=np.int64)
    for k in range(len(b)):
        members[fill[b[k]]] = idx[k]
        fill[b[k]] += 1
    size = 1
    while size < n_bins:
        size *= 2
    room = np.full(2 * size, -(1 << 62), dtype=np.int64)  # a tree over the bins: most room below a node
    least = np.full(2 * size, np.inf)  # and least cost below it
    for t in range(n_bins):
        room[size + t] = capacity - bin_tok[t]
        least[size + t] = bin_cost[t]
    for i in range(size - 1, 0, -1):
        room[i] = max(room[2 * i], room[2 * i + 1])
        least[i] = min(least[2 * i], least[2 * i + 1])
    stack = np.empty(2 * 64, dtype=np.int64)
    for bi in range(n_bins):
        if not over[bi]:
            continue
        for j in range(start[bi + 1] - 1, start[bi] - 1, -1):
            if bin_tok[bi] <= capacity:
                break
            p = members[j]
            bin_tok[bi] -= lens[p]
            bin_cost[bi] -= costs[p]
            _set_bin(room, least, size, bi, capacity - bin_tok[bi], bin_cost[bi])
            best = _least_with_room(room, least, size, lens[p], stack)
            if best >= 0:
                bin_tok[best] += lens[p]
                bin_cost[best] += costs[p]
                _set_bin(room, least, size, best, capacity - bin_tok[best], bin_cost[best])
                where[p] = base + best
            else:
                where[p] = -1


@_jit
def _set_bin(room, least, size, t, r, c):
    i = size + t
    room[i], least[i] = r, c
    i //= 2
    while i >= 1:
        room[i] = max(room[2 * i], room[2 * i + 1])
        least[i] = min(least[2 * i], least[2 * i + 1])
        i //= 2


@_jit
def _least_with_room(room, least, size, need, stack):
    """The bin of least cost among those with ``need`` tokens of room, the lowest index among
    equals (what a scan of every bin finds), or -1: a walk of the tree in bin order that skips
    every subtree without the room, or without a cost below the best found so far."""
    best, best_cost = -1, np.inf
    top = 0
    stack[0] = 1
    while top >= 0:
        node = stack[top]
        top -= 1
        if room[node] < need or (best >= 0 and least[node] >= best_cost):
            continue
        if node >= size:
            best, best_cost = node - size, least[node]
            continue
        stack[top + 1] = 2 * node + 1  # right below left: the left subtree (lower bins) first
        stack[top + 2] = 2 * node
        top += 2
    return best


@_jit
def polish_window(where, lens, costs, bin_cost, bin_tok, dp, mb, capacity, by_rank, max_moves, targets, tolerance):
    """``polish.polish`` for a window (``bin_cost``/``bin_tok``: ``[steps, dp·mb]``): per step
    (``by_rank``: containers are ranks, all their micro-batches) or per step and micro-batch
    row, the same moves and swaps in the same order; returns the number of changes."""
    steps, n_bins = bin_cost.shape
    count = np.zeros(steps + 1, dtype=np.int64)  # pieces per step, bucketed in piece order
    for p in range(len(where)):
        if where[p] >= 0:
            count[where[p] // n_bins + 1] += 1
    for s in range(steps):
        count[s + 1] += count[s]
    fill = count[:-1].copy()
    by_step = np.empty(count[steps], dtype=np.int64)
    for p in range(len(where)):
        if where[p] >= 0:
            s = where[p] // n_bins
            by_step[fill[s]] = p
            fill[s] += 1
    owner = np.empty(n_bins, dtype=np.int64)
    moves = 0
    rows = 1 if by_rank else mb
    for s in range(steps):
        members = by_step[count[s] : count[s + 1]]
        if len(members) == 0:
            continue
        base = s * n_bins
        for m in range(rows):
            for b in range(n_bins):
                owner[b] = b // mb if by_rank or b % mb == m else -1
            moves += _polish_group(
                members,
                where,
                lens,
                costs,
                bin_cost[s],
                bin_tok[s],
                base,
                capacity,
                owner,
                dp,
                mb if by_rank else 1,
                0 if by_rank else m,
                mb,
                max_moves,
                targets,
                tolerance,
            )
    return moves


@_jit
def _polish_group(
    members,
    where,
    lens,
    costs,
    bin_cost,
    bin_tok,
    base,
    capacity,
    owner,
    n,
    per,
    off,
    mb,
    max_moves,
    targets,
    tolerance,
):
    """``polish._polish_group``: container ``k``'s bins are ``k·mb + off + j`` for ``j <
    per``."""
    cnt = 0
    for p in members:
        if owner[where[p] - base] >= 0:
            cnt += 1
    if cnt == 0:
        return 0
    mine = np.empty(cnt, dtype=np.int64)  # (members are in piece order)
    at = np.empty(cnt, dtype=np.int64)
    i = 0
    for p in members:
        o = owner[where[p] - base]
        if o >= 0:
            mine[i] = p
            at[i] = o
            i += 1
    cont = np.zeros(n)
    for b in range(len(owner)):
        if owner[b] >= 0:
            cont[owner[b]] += bin_cost[b]
    target = np_sum(cont) / n * (1 + tolerance)
    k = min(targets, n - 1)
    kk = min(k + 1, n)
    cheap = np.empty(kk, dtype=np.int64)
    moves = 0
    for _ in range(max_moves):
        hi = 0
        for c in range(1, n):
            if cont[c] > cont[hi]:
                hi = c
        if cont[hi] <= target or k < 1:
            break
        filled = 0  # the kk cheapest containers by (cost, index), in that order
        for c in range(n):
            if filled == kk and not cont[c] < cont[cheap[kk - 1]]:
                continue
            j = filled if filled < kk else kk - 1
            while j > 0 and cont[cheap[j - 1]] > cont[c]:
                cheap[j] = cheap[j - 1]
                j -= 1
            cheap[j] = c
            if filled < kk:
                filled += 1
        changed = False
        for t in range(kk):
            lo = cheap[t]
            gap = cont[hi] - cont[lo]
            if lo == hi or gap <= 0:
                continue
            delta, a, b = _change(
                mine, at, hi, lo, gap, per, off, mb, where, lens, costs, bin_cost, bin_tok, base, capacity
            )
            if a >= 0:
                cont[hi] -= delta
                cont[lo] += delta
                for q in (a, b):
                    if q >= 0:
                        pos = np.searchsorted(mine, q)
                        at[pos] = owner[where[q] - base]
                moves += 1
                changed = True
                break
        if not changed:
            break
    return moves


@_jit
def _change(mine, at, hi, lo, gap, per, off, mb, where, lens, costs, bin_cost, bin_tok, base, capacity):
    """``polish._change``: ``(cost moved, piece, swapped piece or -1)``, piece -1 where nothing
    fits that lowers the pair's maximum."""
    first = lo * mb + off
    best_room, dst = capacity - bin_tok[first], first
    for j in range(1, per):
        r = capacity - bin_tok[first + j]
        if r > best_room:
            best_room, dst = r, first + j
    half = gap / 2
    p, err = -1, np.inf
    n_hi, n_lo = 0, 0
    for i in range(len(mine)):
        if at[i] == lo:
            n_lo += 1
        if at[i] != hi:
            continue
        n_hi += 1
        q = mine[i]
        c = costs[q]
        if c > 0 and c < gap and lens[q] <= best_room:
            e = np.abs(c - half)
            if e < err:
                p, err = q, e
    if p >= 0:  # a move: the piece closest to half the gap, into the bin with most room
        _move(p, dst, where, lens, costs, bin_cost, bin_tok, base)
        return costs[p], p, -1
    if n_hi == 0 or n_lo == 0:
        return 0.0, -1, -1
    A = np.empty(n_hi, dtype=np.int64)
    B = np.empty(n_lo, dtype=np.int64)
    ia, ib = 0, 0
    for i in range(len(mine)):
        if at[i] == hi:
            A[ia] = mine[i]
            ia += 1
        elif at[i] == lo:
            B[ib] = mine[i]
            ib += 1
    cb_raw = np.empty(n_lo)
    for j in range(n_lo):
        cb_raw[j] = costs[B[j]]
    order = _argsort(cb_raw)
    Bs = B[order]
    cb = cb_raw[order]
    best_a, best_b, best_err = -1, -1, np.inf
    for shift in (-1, 0):
        ka, kb, kerr = -1, -1, np.inf
        for i in range(n_hi):
            a = A[i]
            j = np.searchsorted(cb, costs[a] - half) + shift
            j = min(max(j, 0), n_lo - 1)
            b = Bs[j]
            d = costs[a] - costs[b]
            xa, yb = where[a] - base, where[b] - base
            fits = (bin_tok[yb] - lens[b] + lens[a] <= capacity) and (bin_tok[xa] - lens[a] + lens[b] <= capacity)
            e = np.abs(d - half) if (d > 0 and d < gap and fits) else np.inf
            if e < kerr:
                ka, kb, kerr = a, b, e
        if kerr < best_err:
            best_a, best_b, best_err = ka, kb, kerr
    if best_a < 0:
        return 0.0, -1, -1
    x, y = where[best_a] - base, where[best_b] - base
    _move(best_a, y, where, lens, costs, bin_cost, bin_tok, base)
    _move(best_b, x, where, lens, costs, bin_cost, bin_tok, base)
    return costs[best_a] - costs[best_b], best_a, best_b


@_jit
def _move(p, dst, where, lens, costs, bin_cost, bin_tok, base):
    src = where[p] - base
    bin_cost[src] -= costs[p]
    bin_tok[src] -= lens[p]
    bin_cost[dst] += costs[p]
    bin_tok[dst] += lens[p]
    where[p] = base + dst


def worth_compiling(bins: int | None) -> bool:
    """Whether steps of ``bins`` (dp × micro-batches; None: any size) are large enough for the
    compiled kernels (and for the planner's other preparations for large steps)."""
    return bins is None or bins >= COMPILE_FROM_BINS


def warm(bins: int | None = None) -> bool:
    """Compile (or load from the cache) every kernel and run it once for the argument types the
    balancer passes, on a toy window, where a step has ``bins`` (dp × micro-batches) of at least
    ``COMPILE_FROM_BINS``, or always when ``bins`` is None; True if the kernels are compiled.
    The planner calls this first thing on its thread, so that compiling overlaps the first
    loads; ``scripts/install.sh`` calls it to fill the cache."""
    global COMPILED
    if COMPILED or not worth_compiling(bins):
        return COMPILED
    try:
        _compile()
        _warm()
        COMPILED = True
    except ImportError:  # pragma: no cover - the install has numba; a Python without its wheels plans with numpy
        logger.info("numba is not importable: the planner balances with its numpy code (the same plans, slower)")
    except Exception:  # a platform where numba imports but cannot compile: plan with numpy (the same plans)
        logger.warning("compiling the planner's kernels failed: balancing with numpy instead", exc_info=True)
    if not COMPILED:
        globals().update(_KERNELS)
    return COMPILED


def _warm() -> None:
    f8, i8 = np.float64, np.int64
    programme(8, 2, 8, 1, np.ones(8), np.ones(8), np.ones(8), 1)
    add_at(np.zeros(4), np.arange(4, dtype=i8), np.ones(4))
    add_at(np.zeros(4, i8), np.arange(4, dtype=i8), np.ones(4, i8))
    place_groups(
        np.arange(4, dtype=i8),
        np.array([0, 2, 4], dtype=i8),
        np.array([0, 1], dtype=i8),
        np.ones(4, i8),
        np.ones(4),
        np.full(4, -1, i8),
        np.zeros(8),
        np.zeros(8, i8),
        2,
        4,
        2,
        10,
    )
    groups_to_steps(np.ones((2, 3)), np.ones((2, 3)), 2)
    wfq_merge(np.ones(4, i8), np.array([0, 2, 4], dtype=i8), np.arange(2, dtype=i8), np.zeros(2), np.ones(2), 3, True)
    repair_bins(
        np.arange(3, dtype=i8),
        np.zeros(3, dtype=i8),
        np.full(3, 4, dtype=i8),
        np.ones(3),
        np.full(3, -1, dtype=i8),
        np.array([12, 0], dtype=i8),
        np.array([3.0, 0.0]),
        0,
        10,
    )
    water_fill_steps(
        np.arange(3, dtype=i8),
        np.array([0, 3], dtype=i8),
        np.zeros(1, dtype=i8),
        np.ones((1, 2)),
        np.full(3, 4, dtype=i8),
        np.ones(3),
        np.full(3, -1, dtype=i8),
        np.zeros(2),
        np.zeros(2, dtype=i8),
        2,
        10,
    )
    polish_window(
        np.array([0, 0, 1, 2], dtype=i8),
        np.array([3, 2, 4, 1], dtype=i8),
        np.array([9.0, 4.0, 16.0, 1.0]),
        np.array([[13.0, 16.0, 1.0, 0.0]]),
        np.array([[5, 4, 1, 0]], dtype=i8),
        2,
        2,
        8,
        True,
        32,
        8,
        0.002,
    )
    light_to_steps(
        np.arange(5, dtype=f8),
        np.arange(4, dtype=f8) + 0.5,
        np.array([0, 2, 4], dtype=i8),
        np.ones((2, 2)),
        np.zeros((2, 2)),
        np.ones(2),
    )
