"""Planning policies, the shared part: how a window of steps is chosen from the streams and laid out over ranks.

One signature for every policy (``POLICIES[plan.balance.policy]``, the way mosaic streaming names
its shuffles): a policy gets a :class:`Window` (the streams, the weights at each step, the cost
of pieces, the topology and budgets; never the planner) and returns the window's steps, each
``([rank][micro_batch] -> piece rows, cost[rank, micro_batch])``. It owns the counters that carry
the mix from one window to the next, with ``get_state()`` / ``set_state()`` (torchdata.nodes
style) so a snapshot holds them and a restore resumes them exactly. On ``Starved`` (a unit's
metadata not loaded yet) a policy leaves its counters and the streams as they were.

- ``none`` (``exact.py``): one step at a time, the exact per-step mix (best-fit packing, bins
  assigned to ranks by cost); counters: the run's cumulative tokens per source and the carry.
- ``cost`` (``cost_balanced.py``): a window of ``balance.window`` steps selected by weighted fair queuing
  and balanced over ranks by attention cost (``balance.py``, its loops compiled in
  ``kernels.py``); counters: tokens selected and asked for per source (and per length class in
  stages with a long share), and the pieces deferred to the next window.

Either policy packs whole pieces (``balance.packing: whole``) or fills every bin to capacity,
cutting the piece at a bin's end (``cut``: ``cut.py``; a stream's cursor may then stop inside a
document, and the rest of it is the source's next piece).

This module holds what every policy shares: the :class:`Window` a policy sees, the
:class:`Policy` interface and :class:`Starved`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ... import pieces as P
from ...plan import Balance, Topology
from ..streams import SourceStream

Planned = tuple  # (piece rows [n, 6], int32 [rank, micro_batch] per row, cost[rank, micro_batch])


class Starved(Exception):
    """The step needs metadata of a unit that has not been loaded yet.

    What must arrive before the same selection can get further, so that the planner does not
    select and roll back a whole window again at every unit that arrives while it waits for
    many: ``short_by`` more tokens of the source's metadata (a lower bound, at least 1), and
    one of the blocks in ``waits_for`` (``(epoch, block)``: where a scan of the source stopped;
    empty: any)."""

    def __init__(self, source: str, short_by: int = 1, waits_for: tuple = ()):
        super().__init__(source)
        self.source = source
        self.short_by = max(1, int(short_by))
        self.waits_for = tuple(waits_for)


@dataclass(slots=True)
class Window:
    """What a policy sees of the planner for one window."""

    start: int  # its first step
    steps: int  # steps in it (cut at the next jump of the mix or context)
    streams: list[SourceStream]
    topology: Topology
    balance: Balance
    step_budget: int  # tokens to plan per step (fill × capacity)
    heavy_tokens: int
    mix_at: Callable[[int], np.ndarray]  # each source's share of a step's tokens
    class_weights_at: Callable[[int], np.ndarray | None]  # [source, (short, long)] shares, or None
    costs: Callable[[np.ndarray], np.ndarray]  # cost of planned piece rows


def as_floats(a: np.ndarray) -> list[float]:
    return [float(x) for x in np.ravel(a)]


def grown(a: np.ndarray, n: int) -> np.ndarray:
    """Per-source counters (one row per source) with zero rows for sources ``len(a)..n-1``: a
    plan update added them, after the run started or after a snapshot's window."""
    return np.concatenate([a, np.zeros((max(0, n - len(a)), *a.shape[1:]), dtype=a.dtype)])


class Policy:
    """The interface, and the one piece of state every policy has: pieces waiting for the next
    window (always empty for a policy that plans a step at a time)."""

    name = ""
    plans_ahead = False  # whole windows are planned before hand-out asks for them (plan_ahead)

    def __init__(self, n_sources: int):
        self.pending = P.empty(P.WIDTH + 1)

    def window_steps(self, balance: Balance) -> int:
        return 1

    def plan(self, w: Window) -> list[Planned]:
        raise NotImplementedError

    def grow(self, n: int) -> None:
        """Counters for ``n`` sources (a plan update added some)."""

    def get_state(self) -> dict:
        return {}

    def set_state(self, state: dict, n_sources: int) -> None:
        """Counters from ``get_state()`` (of a run with at most ``n_sources`` sources)."""
