"""Planning policies: how a window of steps is chosen from the streams and laid out over ranks.

One signature for every policy (``POLICIES[plan.balance.policy]``, the way mosaic streaming names
its shuffles): a policy gets a :class:`Window` (the streams, the weights at each step, the cost
of pieces, the topology and budgets; never the planner) and returns the window's steps, each
``([rank][micro_batch] -> piece rows, cost[rank, micro_batch])``. It owns the counters that carry
the mix from one window to the next, with ``get_state()`` / ``set_state()`` (torchdata.nodes
style) so a snapshot holds them and a restore resumes them exactly. On ``Starved`` (a unit's
metadata not loaded yet) a policy leaves its counters and the streams as they were.

- ``none``: one step at a time, the exact per-step mix (``mixing.select_step``, best-fit packing,
  bins assigned to ranks by cost: ``assign.assign_bins``); counters: the run's cumulative tokens
  per source and the carry.
- ``cost``: a window of ``balance.window`` steps selected by weighted fair queuing and balanced
  over ranks by attention cost (``balance``); counters: tokens selected and asked for per source
  (and per length class in stages with a long share), and the pieces deferred to the next window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..plan.models import Balance, Topology
from . import pieces as P
from .assign import assign_bins
from .balance import balance_window, wfq_select
from .mixing import Starved, next_carry, select_step
from .streams import ClassView, SourceStream

Planned = tuple  # ([rank][micro_batch] -> rows, cost[rank, micro_batch])


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
    weights_at: Callable[[int], np.ndarray]  # each source's share of a step's tokens
    class_weights_at: Callable[[int], np.ndarray | None]  # [source, (short, long)] shares, or None
    costs: Callable[[np.ndarray], np.ndarray]  # cost of planned piece rows


def _floats(a: np.ndarray) -> list[float]:
    return [float(x) for x in np.ravel(a)]


def _grown(a: np.ndarray, n: int) -> np.ndarray:
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


class ExactStep(Policy):
    """Policy ``none``: every step holds each source's share exactly (up to one piece)."""

    name = "none"

    def __init__(self, n_sources: int):
        super().__init__(n_sources)
        self.cum_tokens = np.zeros(n_sources, np.int64)  # the run's tokens per source
        self.cum_declared = np.zeros(n_sources)  # what each step's weights asked for, summed
        self.carry = np.zeros(n_sources)  # the surplus the next step starts from (mixing.next_carry)

    def grow(self, n: int) -> None:
        self.cum_tokens, self.cum_declared, self.carry = (_grown(a, n) for a in (self.cum_tokens, self.cum_declared, self.carry))

    def plan(self, w: Window) -> list[Planned]:
        topo = w.topology
        weights = w.weights_at(w.start)
        sel = select_step(w.streams, weights, topo.dp * topo.micro_batches, topo.tokens_per_micro_batch, self.carry)
        self.cum_tokens += sel.source_tokens
        self.cum_declared += weights * sel.total_tokens
        self.carry = next_carry(self.cum_tokens, self.cum_declared, sel.longest_piece)
        bins = [np.asarray([p.as_list() for p in b], dtype=np.int64).reshape(-1, P.WIDTH) for b in sel.bins]
        bin_costs = np.array([w.costs(b).sum() for b in bins])
        slots = assign_bins(bin_costs, topo.dp, topo.micro_batches)
        ranks = [[bins[slots[r, m]] for m in range(topo.micro_batches)] for r in range(topo.dp)]
        return [(ranks, bin_costs[slots])]

    def get_state(self) -> dict:
        return {"cum_tokens": [int(x) for x in self.cum_tokens], "cum_declared": _floats(self.cum_declared), "carry": _floats(self.carry)}

    def set_state(self, state: dict, n_sources: int) -> None:
        self.cum_tokens = _grown(np.asarray(state["cum_tokens"], np.int64), n_sources)
        self.cum_declared = _grown(np.asarray(state["cum_declared"], np.float64), n_sources)
        self.carry = _grown(np.asarray(state["carry"], np.float64), n_sources)


class CostBalanced(Policy):
    """Policy ``cost``: a window selected by weighted fair queuing, balanced over ranks by cost.

    Pieces deferred by the balancer (heavy outliers without partners) leave room in the window;
    it is topped up with more selected pieces and balanced again, up to ``TOPUP_ROUNDS`` times,
    so deferral does not cost fill."""

    name = "cost"
    plans_ahead = True
    TOPUP_ROUNDS = 3

    def window_steps(self, balance: Balance) -> int:
        return balance.window

    def __init__(self, n_sources: int):
        super().__init__(n_sources)
        self.selected, self.declared = np.zeros(n_sources, np.int64), np.zeros(n_sources)  # tokens selected / asked for per source
        self.cls_selected, self.cls_declared = np.zeros((n_sources, 2), np.int64), np.zeros((n_sources, 2))  # per (source, short/long)

    def grow(self, n: int) -> None:
        self.selected, self.declared, self.cls_selected, self.cls_declared = (
            _grown(a, n) for a in (self.selected, self.declared, self.cls_selected, self.cls_declared))

    def plan(self, w: Window) -> list[Planned]:
        topo, bal = w.topology, w.balance
        target = w.steps * w.step_budget
        slack = min(topo.tokens_per_micro_batch, target // 100)
        saved = [s.cursor() for s in w.streams], self.selected.copy(), self.declared.copy(), self.cls_selected.copy(), self.cls_declared.copy()
        rows = self.pending
        # pieces still waiting fill the window's first steps; every other step selects with its own weights
        budgets = np.full(w.steps, w.step_budget, dtype=np.int64)
        carried = P.tokens(rows)
        for k in range(w.steps):
            take = min(carried, budgets[k])
            budgets[k] -= take
            carried -= take
        need = target - P.tokens(rows)
        try:
            for rnd in range(self.TOPUP_ROUNDS):
                if need > 0:  # a top-up selects with the weights of the window's last step
                    new = self._select_steps(w, budgets) if rnd == 0 else self._select(w, need, w.start + w.steps - 1)
                    rows = np.concatenate([rows, P.with_age(new)])
                wp = balance_window(
                    rows, w.costs(rows), steps=w.steps, dp=topo.dp, micro_batches=topo.micro_batches,
                    capacity=topo.tokens_per_micro_batch, step_budget=w.step_budget, heavy_tokens=w.heavy_tokens,
                    sync=bal.sync, max_delay=bal.max_delay,
                )
                need = target - (P.tokens(rows) - P.tokens(wp.pending))  # room left by deferred pieces
                if need <= slack:
                    break
        except Starved:
            for s, cur in zip(w.streams, saved[0]):
                s.restore(cur)
            self.selected, self.declared, self.cls_selected, self.cls_declared = saved[1:]
            raise
        self.pending = wp.pending
        return list(zip(wp.steps, wp.bin_costs))

    def _select_steps(self, w: Window, budgets: np.ndarray) -> np.ndarray:
        """Select ``budgets[k]`` tokens with the weights of step ``start + k`` (runs of steps with
        equal weights in one call)."""
        groups: list[list] = []  # [first step of the run, budget, weights]
        for k, b in enumerate(budgets):
            weights = w.weights_at(w.start + k)
            if groups and np.array_equal(groups[-1][2], weights):
                groups[-1][1] += int(b)
            else:
                groups.append([w.start + k, int(b), weights])
        parts = [self._select(w, b, step) for step, b, _ in groups]
        return np.concatenate(parts) if parts else P.empty()

    def _select(self, w: Window, budget: int, step: int) -> np.ndarray:
        if budget <= 0:
            return P.empty()
        weights = w.weights_at(step)
        cw = w.class_weights_at(step)
        if cw is None:
            rows = wfq_select(w.streams, weights, budget, self.selected - self.declared)
        else:  # each (source, length class) is a source of its own, with its own cursor
            views = [ClassView(s, c) for s in w.streams for c in ("short", "long")]
            rows = wfq_select(views, cw.ravel(), budget, (self.cls_selected - self.cls_declared).ravel())
            got_cls = P.source_tokens(rows, cw.size)
            self.cls_selected += got_cls.reshape(-1, 2)
            self.cls_declared += cw * got_cls.sum()
            rows[:, P.SOURCE] //= 2
        got = P.source_tokens(rows, len(w.streams))
        self.selected += got
        self.declared += weights * got.sum()
        return rows

    def get_state(self) -> dict:
        return {"pending": P.to_bytes(self.pending), "selected": [int(x) for x in self.selected], "declared": _floats(self.declared),
                "cls_selected": P.to_bytes(self.cls_selected), "cls_declared": _floats(self.cls_declared)}

    def set_state(self, state: dict, n_sources: int) -> None:
        self.pending = P.from_bytes(state["pending"], P.WIDTH + 1)
        self.selected = _grown(np.asarray(state["selected"], np.int64), n_sources)
        self.declared = _grown(np.asarray(state["declared"], np.float64), n_sources)
        self.cls_selected = _grown(P.from_bytes(state["cls_selected"], 2), n_sources)
        self.cls_declared = _grown(np.asarray(state["cls_declared"], np.float64).reshape(-1, 2), n_sources)


POLICIES: dict[str, type[Policy]] = {"none": ExactStep, "cost": CostBalanced}
