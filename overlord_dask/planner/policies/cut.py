"""Packing ``cut`` for the balancing policy: every micro-batch filled to its capacity.

The balancer (``balance.py``) places whole pieces up to ``balance.step_fill`` of a step's capacity
and leaves the rest of each bin as room: the slack it balances with, and what no piece fitted.
With ``balance.packing: cut`` that room is filled afterwards: the policy selects exactly as
many more tokens as the window's bins have room (weighted fair queuing with each step's
weights, the last piece cut, so the mix holds as it does for whole pieces) and lays them end to
end over the bins in order, cutting a piece where a bin ends; its rest opens the next bin. The
balancer's decisions stand (which long documents share a step and a row, how light tokens are
spread); the fill adds the same tokens to every bin's total (full) and pieces no longer than
each bin's room, whose attention cost is small against the bins' own.

Policy ``none`` cuts while it packs (``exact.select_step``): a piece that fits no bin fills the
emptiest one.
"""

from __future__ import annotations

import numpy as np

from ... import pieces as P
from ...plan import Topology


def bin_room(slot: np.ndarray, rows: np.ndarray, topology: Topology) -> np.ndarray:
    """Free tokens of each of a step's bins, in flat order ``rank * micro_batches + micro_batch``."""
    flat = P.flat_slots(slot, topology.micro_batches)
    used = np.bincount(flat, weights=P.lengths(rows), minlength=topology.dp * topology.micro_batches)
    return np.maximum(topology.tokens_per_micro_batch - used.astype(np.int64), 0)


def lay_end_to_end(rows: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` (in order, holding ``sizes.sum()`` tokens) laid end to end over consecutive
    segments of ``sizes`` tokens, each piece cut where a segment ends: the resulting rows and
    the segment of each. Vectorised: a cut is wherever a piece's end or a segment's end falls."""
    lens = P.lengths(rows)
    ends = np.cumsum(lens)
    bounds = np.cumsum(sizes)
    have, room = int(lens.sum()), int(sizes.sum())
    if have != room:
        raise ValueError(f"{have} tokens to lay over segments of {room} (planner bug)")
    if not have:
        return rows[:0].copy(), np.zeros(0, np.int64)
    cuts = np.union1d(ends, bounds)
    cuts = cuts[cuts > 0]
    lo = np.concatenate([[0], cuts[:-1]])
    piece = np.searchsorted(ends, lo, side="right")
    seg = np.searchsorted(bounds, lo, side="right")
    out = rows[piece].copy()
    out[:, P.START] += lo - (ends[piece] - lens[piece])
    out[:, P.STOP] = out[:, P.START] + (cuts - lo)
    return out, seg


def fill_steps(
    steps: list[tuple[np.ndarray, np.ndarray]], rooms: list[np.ndarray], filler: np.ndarray, topology: Topology
):
    """The window's steps (piece rows and slots) with ``filler`` (selection order, exactly their
    ``rooms``: :func:`bin_room` of each) laid over their bins, step by step and bin by bin.
    Returns the new steps and, per step, each filler row's index in flat bin order (for the
    bins' costs)."""
    n_bins = topology.dp * topology.micro_batches
    cut, seg = lay_end_to_end(filler, np.concatenate(rooms) if rooms else np.zeros(0, np.int64))
    out, flat_bins = [], []
    bounds = np.searchsorted(seg, np.arange(len(steps) + 1) * n_bins)
    for k, (rows, slot) in enumerate(steps):
        mine, b = cut[bounds[k] : bounds[k + 1]], seg[bounds[k] : bounds[k + 1]] - k * n_bins
        out.append((np.concatenate([rows, mine]), np.concatenate([slot, P.slots(b, topology.micro_batches)])))
        flat_bins.append(b)
    return out, flat_bins
