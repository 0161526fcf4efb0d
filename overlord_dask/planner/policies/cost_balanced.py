"""Policy ``cost``: a window of steps selected by weighted fair queuing (``balance.wfq_select``)
and balanced over ranks by attention cost (``balance.balance_window``)."""

from __future__ import annotations

import numpy as np

from ... import pieces as P
from ...plan import Balance
from ..streams import ClassView
from .balance import balance_window, wfq_select
from .base import Planned, Policy, Starved, Window, as_floats, grown
from .cut import bin_room, fill_steps


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
        self.selected, self.declared = (
            np.zeros(n_sources, np.int64),
            np.zeros(n_sources),
        )  # tokens selected / asked for per source
        self.cls_selected, self.cls_declared = (
            np.zeros((n_sources, 2), np.int64),
            np.zeros((n_sources, 2)),
        )  # per (source, short/long)

    def grow(self, n: int) -> None:
        self.selected, self.declared, self.cls_selected, self.cls_declared = (
            grown(a, n) for a in (self.selected, self.declared, self.cls_selected, self.cls_declared)
        )

    def plan(self, w: Window) -> list[Planned]:
        topo, bal = w.topology, w.balance
        target = w.steps * w.step_budget
        slack = min(topo.tokens_per_micro_batch, target // 100)
        saved = (
            [s.cursor() for s in w.streams],
            self.selected.copy(),
            self.declared.copy(),
            self.cls_selected.copy(),
            self.cls_declared.copy(),
        )
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
                    rows,
                    w.costs(rows),
                    steps=w.steps,
                    dp=topo.dp,
                    micro_batches=topo.micro_batches,
                    capacity=topo.tokens_per_micro_batch,
                    step_budget=w.step_budget,
                    heavy_tokens=w.heavy_tokens,
                    sync=bal.sync,
                    max_delay=bal.max_delay,
                )
                need = target - (P.tokens(rows) - P.tokens(wp.pending))  # room left by deferred pieces
                if need <= slack:
                    break
            planned = list(zip(wp.steps, wp.bin_costs))
            if bal.packing == "cut":
                planned = self._fill(w, planned)
        except Starved:
            for s, cur in zip(w.streams, saved[0]):
                s.restore(cur)
            self.selected, self.declared, self.cls_selected, self.cls_declared = saved[1:]
            raise
        self.pending = wp.pending
        return [(rows, slot, costs) for (rows, slot), costs in planned]

    def _fill(self, w: Window, planned: list) -> list:
        """Packing ``cut`` (``cut.py``): each step's room selected with its weights and laid
        over its bins; each bin's cost grows by its filler's."""
        rooms = [bin_room(slot, rows, w.topology) for (rows, slot), _ in planned]
        filler = self._select_steps(w, np.array([int(r.sum()) for r in rooms], dtype=np.int64), cut=True)
        steps, flat_bins = fill_steps([s for s, _ in planned], rooms, filler, w.topology)
        out = []
        for (rows, slot), (_, costs), b in zip(steps, planned, flat_bins):
            if len(b):
                added = w.costs(rows[len(rows) - len(b) :])
                costs = costs + np.bincount(b, weights=added, minlength=costs.size).reshape(costs.shape)
            out.append(((rows, slot), costs))
        return out

    def _select_steps(self, w: Window, budgets: np.ndarray, cut: bool = False) -> np.ndarray:
        """Select ``budgets[k]`` tokens with the weights of step ``start + k`` (runs of steps with
        equal weights in one call; ``cut``: exactly that many, the last piece cut)."""
        groups: list[list] = []  # [first step of the run, budget, weights]
        for k, b in enumerate(budgets):
            weights = w.mix_at(w.start + k)
            if groups and np.array_equal(groups[-1][2], weights):
                groups[-1][1] += int(b)
            else:
                groups.append([w.start + k, int(b), weights])
        parts = [self._select(w, b, step, cut) for step, b, _ in groups]
        return np.concatenate(parts) if parts else P.empty()

    def _select(self, w: Window, budget: int, step: int, cut: bool = False) -> np.ndarray:
        if budget <= 0:
            return P.empty()
        weights = w.mix_at(step)
        cw = w.class_weights_at(step)
        if cw is None:
            rows = wfq_select(w.streams, weights, budget, self.selected - self.declared, cut)
        else:  # each (source, length class) is a source of its own, with its own cursor
            views = [ClassView(s, c) for s in w.streams for c in ("short", "long")]
            rows = wfq_select(views, cw.ravel(), budget, (self.cls_selected - self.cls_declared).ravel(), cut)
            got_cls = P.source_tokens(rows, cw.size)
            self.cls_selected += got_cls.reshape(-1, 2)
            self.cls_declared += cw * got_cls.sum()
            rows[:, P.SOURCE] //= 2
        got = P.source_tokens(rows, len(w.streams))
        self.selected += got
        self.declared += weights * got.sum()
        return rows

    def get_state(self) -> dict:
        return {
            "pending": P.to_bytes(self.pending),
            "selected": [int(x) for x in self.selected],
            "declared": as_floats(self.declared),
            "cls_selected": P.to_bytes(self.cls_selected),
            "cls_declared": as_floats(self.cls_declared),
        }

    def set_state(self, state: dict, n_sources: int) -> None:
        self.pending = P.from_bytes(state["pending"], P.WIDTH + 1)
        self.selected = grown(np.asarray(state["selected"], np.int64), n_sources)
        self.declared = grown(np.asarray(state["declared"], np.float64), n_sources)
        self.cls_selected = grown(P.from_bytes(state["cls_selected"], 2), n_sources)
        self.cls_declared = grown(np.asarray(state["cls_declared"], np.float64).reshape(-1, 2), n_sources)
