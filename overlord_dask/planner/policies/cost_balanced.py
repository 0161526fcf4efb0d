"""Policy ``cost``: a window of steps selected by weighted fair queuing (``balance.wfq_select``)
and balanced over ranks by attention cost (``balance.place_window``)."""

from __future__ import annotations

import numpy as np

from ... import pieces as P
from ...plan import Balance
from ..streams import ClassView
from . import balancer_process
from .balance import wfq_select
from .base import Planned, Policy, Starved, Window, as_floats, grown
from .cut import bin_room, fill_steps


class CostBalanced(Policy):
    """Policy ``cost``: a window selected by weighted fair queuing, balanced over ranks by cost.

    Pieces deferred by the balancer (heavy outliers without partners) leave room in the window;
    it is topped up with more selected pieces and balanced again, up to ``TOPUP_ROUNDS`` times,
    so deferral does not cost fill. From ``EARLY_STOP_FROM_BINS`` bins per step, only while that
    pays: a top-up whose placement added less than a hundredth of the window's tokens is the
    last. Each placement places the whole window again, and the pieces a top-up brings mostly
    leave as many deferred (long ones without partners, bins too full for them): the second
    placement adds little fill and a third less still, for a whole placement each, which at
    hundreds of bins is most of the planner's work (``benchmarks/balance.py
    --scaling``). Below, a window is cheap to place and the third round keeps the mix of a few
    dozen documents per step closer over 20 steps (``tests/test_balance.py``'s cut-fill bound).

    With ``packing: cut`` each step's fill is chosen by what the steps delivered, not by what
    was selected: deferred pieces (selected in one window, delivered in a later one) move a
    source's tokens across steps, and over a few steps that is most of the mix error; the fill
    of step ``k`` gives each source what brings its delivered tokens, up to the end of step
    ``k``, closest to its declared share (``delivered`` / ``delivered_declared``)."""

    name = "cost"
    plans_ahead = True
    TOPUP_ROUNDS = 3
    EARLY_STOP_FROM_BINS = 256  # dp × micro-batches from which a top-up that adds little is the last

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
        # tokens per source in planned steps, and each step's weights times its tokens
        self.delivered, self.delivered_declared = np.zeros(n_sources, np.int64), np.zeros(n_sources)

    def grow(self, n: int) -> None:
        self.selected, self.declared, self.cls_selected, self.cls_declared = (
            grown(a, n) for a in (self.selected, self.declared, self.cls_selected, self.cls_declared)
        )
        self.delivered, self.delivered_declared = grown(self.delivered, n), grown(self.delivered_declared, n)

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
        rows, buf = self.pending, None  # (the window's rows lie in buf once topped up: P.appended)
        # pieces still waiting fill the window's first steps; every other step selects with its own weights
        budgets = np.full(w.steps, w.step_budget, dtype=np.int64)
        carried = P.tokens(rows)
        for k in range(w.steps):
            take = min(carried, budgets[k])
            budgets[k] -= take
            carried -= take
        need = target - P.tokens(rows)
        placed_before = None  # tokens the last placement placed
        early_stop = topo.dp * topo.micro_batches >= self.EARLY_STOP_FROM_BINS
        try:
            for rnd in range(self.TOPUP_ROUNDS):
                if need > 0:  # a top-up selects with the weights of the window's last step
                    new = self._select_steps(w, budgets) if rnd == 0 else self._select(w, need, w.start + w.steps - 1)
                    rows, buf = P.appended(rows, new, buf)
                placed = balancer_process.place(
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
                in_steps = P.tokens(rows) - placed.pending_tokens()
                need = target - in_steps  # room left by deferred pieces
                paid = placed_before is None or not early_stop or in_steps - placed_before >= target // 100
                if need <= slack or not paid or rnd == self.TOPUP_ROUNDS - 1:
                    break  # (a placement topped up and placed again is not finished)
                placed_before = in_steps
            wp = placed.finish()
            planned = list(zip(wp.steps, wp.bin_costs))
            if bal.packing == "cut":
                planned = self._fill(w, planned)
            tokens = [P.source_tokens(rows, len(w.streams)) for (rows, _), _ in planned]
            if bal.packing != "cut":
                order = self._mix_order(w, tokens)
                planned, tokens = [planned[i] for i in order], [tokens[i] for i in order]
        except Starved:
            for s, cur in zip(w.streams, saved[0]):
                s.restore(cur)
            self.selected, self.declared, self.cls_selected, self.cls_declared = saved[1:]
            raise
        self.pending = wp.pending
        self.delivered, self.delivered_declared = self._delivered(w, tokens)
        return [(rows, slot, costs) for (rows, slot), costs in planned]

    def _delivered(self, w: Window, tokens: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``delivered`` and ``delivered_declared`` after the window's first ``len(tokens)``
        steps (``tokens``: each step's tokens per source)."""
        done, owed = self.delivered.copy(), self.delivered_declared.copy()
        for k, got in enumerate(tokens):
            done += got
            owed += w.mix_at(w.start + k) * got.sum()
        return done, owed

    def _mix_order(self, w: Window, tokens: list[np.ndarray]) -> list[int]:
        """The order of the window's steps (``tokens``: each one's tokens per source) that keeps
        each source's delivered tokens closest to its declared share, step after step (greedy,
        the first step on a tie). The balancer places long pieces ``dp`` at a time, so one step
        may hold a source's whole group and the next none of it; over a stretch of steps that
        ends inside a window, the order of its steps is most of the mix error. Each step keeps
        its pieces and their ranks (the balance is the same); only steps whose weights are
        equal trade places."""
        surplus = (self.delivered - self.delivered_declared).astype(np.float64)
        out, k = [], 0
        while k < len(tokens):
            mix, classes = w.mix_at(w.start + k), w.class_weights_at(w.start + k)
            end = k + 1
            while (
                end < len(tokens)
                and _same(w.mix_at(w.start + end), mix)
                and _same(w.class_weights_at(w.start + end), classes)
            ):
                end += 1
            got = np.array(tokens[k:end])  # [steps, sources]
            owed = mix * got.sum(axis=1)[:, None]  # (the same operations per step as one at a time)
            left = list(range(k, end))
            while left:
                at = np.array(left) - k
                gaps = surplus + got[at] - owed[at]
                j = int(np.argmin([float(g @ g) for g in gaps]))
                surplus = gaps[j]
                out.append(left.pop(j))
            k = end
        return out

    def _fill(self, w: Window, planned: list) -> list:
        """Packing ``cut`` (``cut.py``): each step's room selected with its weights, the sources
        the steps so far delivered least of (for their share) first, and laid over its bins;
        each bin's cost grows by its filler's."""
        rooms = [bin_room(slot, rows, w.topology) for (rows, slot), _ in planned]
        n = len(w.streams)
        placed = np.array([P.source_tokens(rows, n) for (rows, _), _ in planned]).reshape(-1, n)
        weights = np.array([w.mix_at(w.start + k) for k in range(len(planned))]).reshape(-1, n)
        totals = placed.sum(axis=1) + np.array([int(r.sum()) for r in rooms])
        # what the balancer placed beyond a source's share of each step, which no fill can take back
        excess = placed - weights * totals[:, None]
        parts = []
        done, owed = self.delivered.copy(), self.delivered_declared.copy()  # through the step before
        for k, room in enumerate(rooms):
            step = w.start + k
            if w.class_weights_at(step) is None:
                # a source the window's later steps deliver too much of, whatever their fill, is
                # given less now: half of that excess before it, half after
                ahead = np.cumsum(excess[k + 1 :], axis=0)
                over = np.maximum(ahead.max(axis=0), 0) if len(ahead) else np.zeros(n)
                surplus = done + placed[k] - owed - weights[k] * placed[k].sum() + over / 2
                parts.append(self._select(w, int(room.sum()), step, cut=True, surplus=surplus))
            else:  # (length classes keep their own counters)
                parts.append(self._select(w, int(room.sum()), step, cut=True))
            got = placed[k] + P.source_tokens(parts[-1], n)
            done, owed = done + got, owed + weights[k] * got.sum()
        filler = np.concatenate(parts) if parts else P.empty()
        steps, flat_bins = fill_steps([s for s, _ in planned], rooms, filler, w.topology)
        out = []
        for (rows, slot), (_, costs), b in zip(steps, planned, flat_bins):
            if len(b):
                added = w.costs(rows[len(rows) - len(b) :])
                costs = costs + np.bincount(b, weights=added, minlength=costs.size).reshape(costs.shape)
            out.append(((rows, slot), costs))
        return out

    def _select_steps(self, w: Window, budgets: np.ndarray) -> np.ndarray:
        """Select ``budgets[k]`` tokens with the weights of step ``start + k`` (runs of steps with
        equal weights in one call)."""
        groups: list[list] = []  # [first step of the run, budget, weights]
        for k, b in enumerate(budgets):
            weights = w.mix_at(w.start + k)
            if groups and np.array_equal(groups[-1][2], weights):
                groups[-1][1] += int(b)
            else:
                groups.append([w.start + k, int(b), weights])
        parts = [self._select(w, b, step) for step, b, _ in groups]
        if len(parts) == 1:  # (most windows: no copy of a selection that may hold millions of rows)
            return parts[0]
        return np.concatenate(parts) if parts else P.empty()

    def _select(self, w: Window, budget: int, step: int, cut: bool = False, surplus=None) -> np.ndarray:
        """``budget`` tokens with the weights of ``step``, the sources behind by ``surplus``
        first (default: by what was selected)."""
        if budget <= 0:
            return P.empty()
        weights = w.mix_at(step)
        cw = w.class_weights_at(step)
        if cw is None:
            surplus = self.selected - self.declared if surplus is None else surplus
            rows = wfq_select(w.streams, weights, budget, surplus, cut)
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
            "delivered": [int(x) for x in self.delivered],
            "delivered_declared": as_floats(self.delivered_declared),
        }

    def set_state(self, state: dict, n_sources: int) -> None:
        self.pending = P.from_bytes(state["pending"], P.WIDTH + 1)
        self.selected = grown(np.asarray(state["selected"], np.int64), n_sources)
        self.declared = grown(np.asarray(state["declared"], np.float64), n_sources)
        self.cls_selected = grown(P.from_bytes(state["cls_selected"], 2), n_sources)
        self.cls_declared = grown(np.asarray(state["cls_declared"], np.float64).reshape(-1, 2), n_sources)
        # (a snapshot of an older version holds no delivered counters: the fill starts them afresh)
        self.delivered = grown(np.asarray(state.get("delivered", []), np.int64), n_sources)
        self.delivered_declared = grown(np.asarray(state.get("delivered_declared", []), np.float64), n_sources)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Equal weights (None: no length classes)."""
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
