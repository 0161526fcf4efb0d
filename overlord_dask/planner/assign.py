"""Assigning a step's packed bins to (rank, micro-batch) slots.

This is the simple, correct assignment: bins sorted by cost, each to the rank with the least cost
so far that still has a free micro-batch slot (LPT with a cardinality constraint), then each rank's
micro-batches ordered by decreasing cost. Cost-aware re-packing across ranks is the balancer's job
(a policy that can replace this one); both must leave every bin within capacity.
"""

from __future__ import annotations

import numpy as np


def assign_bins(bin_costs: np.ndarray, dp: int, micro_batches: int) -> np.ndarray:
    """Return ``slots[rank, mb] = bin index`` for ``dp*micro_batches`` bins."""
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
