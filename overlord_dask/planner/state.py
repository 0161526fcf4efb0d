"""The planner's state machine, free of Dask: streams, step planning, ledger, acks and metrics.

The scheduler plugin (``plugin.py``) is a thin RPC shell around this class, which keeps it
testable without a cluster. Everything here is metadata: lengths, ids, counters. No payload.

Ledger: every planned step keeps its pieces ``[source, epoch, unit, doc, start, stop]`` and the
(rank, micro-batch) it went to until every rank has acknowledged it; a bounded history of
committed steps is kept for inspection (``history_steps``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

import numpy as np

from ..errors import PlanError
from ..plan.loading import plan_from_dict, plan_to_dict
from ..plan.models import Plan
from ..plan.timeline import PlanTimeline
from .assign import assign_bins
from .balance import balance_window, wfq_select
from .cost import doc_costs
from .metrics import step_imbalance
from .mixing import Starved, next_carry, select_step
from .streams import ClassView, SourceStream

def _tokens(rows: np.ndarray) -> int:
    return int((rows[:, 5] - rows[:, 4]).sum())


def _with_age(rows: np.ndarray, age: int = 0) -> np.ndarray:
    """Piece rows ``[n, 6]`` with the balancer's waiting-age column appended."""
    return np.concatenate([rows, np.full((len(rows), 1), age, dtype=np.int64)], axis=1)


def _recut(rows: np.ndarray, piece_tokens: int) -> np.ndarray:
    """Rows ``[source, epoch, unit, doc, start, stop, age]`` with every piece longer than
    ``piece_tokens`` cut into consecutive pieces of at most that many tokens (same document)."""
    lens = rows[:, 5] - rows[:, 4]
    if not len(rows) or lens.max() <= piece_tokens:
        return rows
    n = -(-lens // piece_tokens)
    out = np.repeat(rows, n, axis=0)
    k = np.arange(len(out)) - np.repeat(np.cumsum(n) - n, n)
    out[:, 4] = np.repeat(rows[:, 4], n) + k * piece_tokens
    out[:, 5] = np.minimum(out[:, 4] + piece_tokens, np.repeat(rows[:, 5], n))
    return out


STATE_VERSION = 2


def decode_updates(state: dict | None) -> list[tuple[int, Plan]]:
    """The live plan updates recorded in a snapshot, as ``(at_step, Plan)``."""
    if not state:
        return []
    return [(int(at), plan_from_dict(d, where=f"<snapshot plan update at step {at}>")) for at, d in state.get("updates", [])]


class PlannerState:
    def __init__(self, plan: Plan, unit_first_ids: dict[str, list[int]], *, history_steps: int = 100_000, state: dict | None = None,
                 updates: list[tuple[int, Plan]] = ()):
        self.final_plan = plan
        self.timeline = PlanTimeline(plan, list(updates) or decode_updates(state))
        if state is not None:  # replay on the topology the snapshot was planned with, switch at `committed`
            plan = plan.model_copy(update={"topology": plan.topology.model_copy(update=state["topology"])})
        self._use_plan(plan)
        self.source_names = list(self.timeline.source_names)
        self.streams = [self._new_stream(name, i, unit_first_ids[name]) for i, name in enumerate(self.source_names)]
        self.next_step = 0
        self.cum_tokens = np.zeros(len(self.streams), dtype=np.int64)
        self.cum_declared = np.zeros(len(self.streams))
        self.carry = np.zeros(len(self.streams))
        self.dropped = np.zeros((len(self.streams), 2), dtype=np.int64)  # documents, tokens skipped by a drop policy
        self.cls_selected = np.zeros((len(self.streams), 2), dtype=np.int64)  # tokens per (source, short/long) in long-share stages
        self.cls_declared = np.zeros((len(self.streams), 2))
        self.commit_mode = plan.checkpoint.commit
        self.ledger: OrderedDict[int, dict] = OrderedDict()  # step -> {"pieces": int64[n,6], "slot": int32[n,2]}
        self.metrics: OrderedDict[int, dict] = OrderedDict()
        self.history_steps = history_steps
        self.failure: str | None = None
        self.starved_on: str | None = None
        # policy "cost": a window of steps is planned at once and handed out one step at a time
        self.balance = plan.balance
        self.ready: deque = deque()  # planned steps not yet handed out: (ranks, bin_costs, drops or None)
        self.pending = np.zeros((0, 7), dtype=np.int64)  # pieces waiting for the next window
        self.selected = np.zeros(len(self.streams), dtype=np.int64)  # tokens selected per source so far
        self.declared = np.zeros(len(self.streams))  # tokens the per-step weights asked for so far
        self.plan_seconds: list[float] = []  # wall time of each planning call that produced steps
        self.held: set[tuple[int, int, int]] = set()  # passed units still referenced by pending/ready pieces
        self.windows: OrderedDict[int, dict] = OrderedDict()  # first step of a planned window -> state before it
        self.pool_workers: dict[str, int] = {}  # workers per loader pool, as the autoscaler last reported (metrics only)
        self.replay_until = 0  # steps below this were delivered before a restore: re-planned, not handed out
        if state is not None:
            self._restore(state)

    def _new_stream(self, name: str, index: int, first_ids) -> SourceStream:
        plan = self.timeline.initial
        return SourceStream(name=name, index=index, n_units=len(first_ids), first_ids=np.asarray(first_ids, dtype=np.int64),
                            seed=plan.seed, piece_tokens=plan.topology.piece_tokens, evict_after=plan.loading.units_ahead + 2)

    def _grow(self, n: int) -> None:
        """Extend the per-source arrays to ``n`` sources (a plan update added some)."""
        k = n - len(self.cum_tokens)
        if k > 0:
            self.cum_tokens = np.concatenate([self.cum_tokens, np.zeros(k, np.int64)])
            self.cum_declared = np.concatenate([self.cum_declared, np.zeros(k)])
            self.carry = np.concatenate([self.carry, np.zeros(k)])
            self.selected = np.concatenate([self.selected, np.zeros(k, np.int64)])
            self.declared = np.concatenate([self.declared, np.zeros(k)])
            self.dropped = np.concatenate([self.dropped, np.zeros((k, 2), np.int64)])
            self.cls_selected = np.concatenate([self.cls_selected, np.zeros((k, 2), np.int64)])
            self.cls_declared = np.concatenate([self.cls_declared, np.zeros((k, 2))])

    # ---- live plan updates ----------------------------------------------------------------------
    @property
    def planned_until(self) -> int:
        """The first step whose pieces are not chosen yet (where the next window starts)."""
        return self.next_step + len(self.ready)

    @property
    def frontier(self) -> int:
        """The first step not planned yet: the earliest an update can apply from."""
        return max(self.planned_until, self.replay_until)

    @property
    def plan_version(self) -> int:
        return len(self.timeline.versions) - 1

    def update(self, plan: Plan, at_step: int | None, unit_first_ids: dict[str, list[int]]) -> int:
        """Apply ``plan`` from ``at_step`` (default: the first step not planned yet). New sources
        need their units' first ids. Returns the step the update applies from."""
        frontier = self.frontier
        at_step = frontier if at_step is None else int(at_step)
        if at_step < frontier:
            raise PlanError(f"plan update at step {at_step}: steps up to {frontier - 1} are already planned; "
                            f"the earliest step an update can apply from is {frontier} (or pass at_step=None)")
        missing = [s.name for s in plan.sources if s.name not in self.source_names and s.name not in unit_first_ids]
        if missing:
            raise PlanError(f"plan update at step {at_step}: new sources {missing} were not indexed")
        for name in self.timeline.add(plan, at_step):
            self.source_names.append(name)
            self.streams.append(self._new_stream(name, len(self.streams), unit_first_ids[name]))
        self._grow(len(self.streams))
        return at_step

    def weights_at(self, step: int) -> np.ndarray:
        """Each source's share of step ``step``'s tokens: its weight, or in a stage with a long
        share, ``(1 - share)·weight + share·long weight``."""
        cw = self.class_weights_at(step)
        return self.timeline.weights_at(step) if cw is None else cw.sum(axis=1)

    def class_weights_at(self, step: int) -> np.ndarray | None:
        """``[source, (short, long)]`` shares of step ``step`` in a stage with a long share, else None."""
        ctx = self.timeline.context_at(step)
        if ctx.long_share is None:
            return None
        w = self.timeline.weights_at(step)
        if ctx.long_sources:
            lw = np.array([ctx.long_sources.get(n, 0.0) for n in self.source_names])
            lw = lw * (w > 0) if (lw * (w > 0)).sum() > 0 else lw
            lw = lw / lw.sum()
        else:
            lw = w
        return np.stack([w * (1 - ctx.long_share), lw * ctx.long_share], axis=1)

    def _apply_context(self, step: int) -> None:
        """Set every stream's piece size and drop policy for the window starting at ``step``."""
        ctx = self.timeline.context_at(step)
        for s in self.streams:
            s.piece_tokens = ctx.piece_tokens
            s.drop_over = ctx.piece_tokens if ctx.long_policy == "drop" else None
            s.set_split(ctx.long_tokens if ctx.long_share is not None else None)
        # pieces still waiting from an earlier stage are cut to this stage's piece size
        self.pending = _recut(self.pending, ctx.piece_tokens)

    def _drain_drops(self) -> np.ndarray:
        """Dropped documents recorded since the last call, as rows [source, epoch, unit, doc, tokens]."""
        rows = []
        for i, s in enumerate(self.streams):
            for (e, u, d), L in s.drops.items():
                rows.append((i, e, u, d, L))
            s.drops.clear()
        out = np.array(sorted(rows), dtype=np.int64).reshape(-1, 5)
        if len(out):
            np.add.at(self.dropped[:, 0], out[:, 0], 1)
            np.add.at(self.dropped[:, 1], out[:, 0], out[:, 4])
        return out

    def _use_plan(self, plan: Plan, acked_through: int = -1) -> None:
        """Adopt a plan's topology and the budgets derived from it; every (rank, cp rank) has
        consumed (and saved) the steps up to ``acked_through``."""
        self.plan = plan
        self.topology = plan.topology
        self.step_budget = int(plan.balance.fill * plan.topology.step_tokens)
        self.heavy_tokens = plan.balance.heavy_tokens or max(1, plan.topology.tokens_per_micro_batch // 16)
        self.acked = [acked_through] * (plan.topology.dp * plan.topology.cp)  # last step each (rank, cp rank) consumed
        self.durable = list(self.acked)  # last step each saved in a trainer checkpoint

    # ---- loading ------------------------------------------------------------------------------
    def wanted(self) -> list[list]:
        """Units whose metadata the planner needs next: [source, epoch, unit] each."""
        out = []
        step_tokens = self.topology.step_tokens
        for s, w in zip(self.streams, self._weights_ahead()):
            if w <= 0:
                continue
            target = max(1, int(w * step_tokens * (self._window_steps() + 1) * 1.3))
            if s.name == self.starved_on:  # planning needs more of this source than the look-ahead holds
                target = s.unplanned_tokens() + 1 if not s.split else 2 * target
            for epoch, unit in s.want(target, self.plan.loading.units_ahead):
                out.append([s.name, epoch, unit])
        return out

    def _window_steps(self) -> int:
        return self.balance.window if self.balance.policy == "cost" else 1

    def _weights_ahead(self) -> np.ndarray:
        """Largest weight of each source over the next two windows (so a source that enters at a
        coming step is loaded before it is needed)."""
        t0 = self.planned_until
        return self.weights_over(t0, t0 + 2 * self._window_steps() + 1)

    def weights_over(self, start: int, stop: int) -> np.ndarray:
        """Largest (normalised) weight of each source over steps ``[start, stop)``: the schedule's
        ends and every jump between them (weights are piecewise linear between jumps)."""
        steps = {start, max(start, stop - 1)}
        j = self.timeline.next_jump(start)
        while j is not None and j < stop:
            steps.add(j)
            j = self.timeline.next_jump(j)
        return np.max([self.weights_at(t) for t in sorted(steps)], axis=0)

    def _window_len(self, start: int) -> int:
        """Steps in the planning window from ``start``: ``balance.window``, cut at the next jump
        of the mix or context (a stage start, a source entering or leaving, a live update)."""
        j = self.timeline.next_jump(start)
        n = self._window_steps()
        return n if j is None else max(1, min(n, j - start))

    def add_lengths(self, source: str, epoch: int, unit: int, lengths: np.ndarray, vision: np.ndarray | None = None) -> bool:
        s = self._stream(source)
        before = s.tokens_per_pass()
        added = s.add_lengths(epoch, unit, lengths, vision)
        if before is None and s.tokens_per_pass() is not None:
            self._check_source_size(s)
        return added

    MAX_PASSES_PER_WINDOW = 4

    def _check_source_size(self, s: SourceStream) -> None:
        """A source whose whole pass over its files is a small part of what one planning window
        takes from it would repeat every document many times per step (all-empty documents, a
        handful of tiny ones, micro-batches far larger than the corpus): fail, saying so, instead
        of loading the same units over and over with no batch in sight."""
        per_pass = s.tokens_per_pass()
        w = float(self._weights_ahead()[s.index])
        need = w * self.step_budget * self._window_steps()
        if w > 0 and need > self.MAX_PASSES_PER_WINDOW * per_pass:
            raise PlanError(
                f"source {s.name!r} holds only {per_pass:,} tokens in a whole pass over its files ({s.n_units} units), but a "
                f"planning window of {self._window_steps()} steps takes about {int(need):,} tokens from it (weight {w:.3g}), "
                f"{need / max(per_pass, 1):.0f} passes: every document would repeat within a few steps. Lower its weight, use "
                f"smaller micro-batches (tokens_per_micro_batch={self.topology.tokens_per_micro_batch:,}), or add data"
            )

    def _costs(self, rows: np.ndarray) -> np.ndarray:
        """Cost of piece rows ``[source, epoch, unit, doc, start, stop, ...]``: the backbone's
        cost of their tokens plus the vision encoder's cost of their image tokens."""
        costs = doc_costs(rows[:, 5] - rows[:, 4], self.plan.cost)
        if self.plan.cost.encoder > 0:
            for i in np.unique(rows[:, 0]):
                sel = rows[:, 0] == i
                costs[sel] += self.plan.cost.encoder * self.streams[int(i)].piece_vision(rows[sel][:, 1:6])
        return costs

    def _stream(self, name: str) -> SourceStream:
        try:
            return self.streams[self.source_names.index(name)]
        except ValueError:
            raise KeyError(f"unknown source {name!r}; sources: {self.source_names}") from None

    # ---- planning -----------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        """Number of steps every rank has acknowledged (steps 0..committed-1 are done)."""
        return min(self.acked) + 1

    @property
    def durable_step(self) -> int:
        """Steps a restart must never deliver again: consumed (commit 'ack') or saved in every
        trainer's checkpoint (commit 'checkpoint')."""
        return self.committed if self.commit_mode == "ack" else min(self.committed, min(self.durable) + 1)

    def can_plan(self) -> bool:
        return self.next_step - self.committed < self.plan.loading.prefetch_steps

    def plan_steps(self, max_steps: int) -> tuple[list[dict], list[list]]:
        """Plan as many steps as the bounds and loaded metadata allow.

        Returns (steps, finished_units): each step is ``{"step", "pieces", "slot"}`` where
        ``pieces`` is little-endian int64 bytes of rows ``[source, epoch, unit, doc, start, stop]``
        and ``slot`` int32 bytes of ``[rank, micro_batch]`` per row (compact for the RPC: no
        Python object per piece); finished units are ``[source, epoch, unit]`` whose blocks no
        later step needs.
        """
        steps = []
        t0 = time.perf_counter()
        while len(steps) < max_steps and self.can_plan():
            if self.next_step == self.replay_until and self.final_plan.topology != self.topology:
                self._switch_topology()
            try:
                ranks, mb_costs, drops = self._next_planned()
            except Starved as e:
                self.starved_on = e.source
                break
            self.starved_on = None
            step = self.next_step
            self.next_step += 1
            if step < self.replay_until:
                continue  # delivered before the restore: only the planner state had to catch up
            self._record(step, ranks, mb_costs, drops)
            entry = self.ledger[step]
            steps.append({"step": step, "pieces": entry["pieces"].astype("<i8").tobytes(), "slot": entry["slot"].astype("<i4").tobytes(),
                          "piece_tokens": self.metrics[step]["piece_tokens"]})
        if steps:
            self.plan_seconds.append(time.perf_counter() - t0)
            del self.plan_seconds[:-10_000]
        return steps, self._finished_units()

    def _finished_units(self) -> list[list]:
        """Units the cursor has passed that no pending piece or not-yet-handed-out step needs."""
        for i, s in enumerate(self.streams):
            self.held.update((i, e, u) for e, u in s.finished_units())
        if not self.held:
            return []
        refs = [self.pending[:, :3]] + [rows[:, :3] for ranks, _, _ in self.ready for mbs in ranks for rows in mbs]
        in_use = {tuple(r) for r in np.unique(np.concatenate(refs), axis=0).tolist()} if refs else set()
        done = [k for k in self.held if k not in in_use]
        self.held.difference_update(done)
        for i, e, u in done:
            self.streams[i].vision.pop((e, u), None)
        return [[self.source_names[i], e, u] for i, e, u in sorted(done)]

    def _next_planned(self) -> tuple[list[list[np.ndarray]], np.ndarray, np.ndarray | None]:
        """The next step's pieces per (rank, micro-batch) as int64 rows, their costs, and (on a
        window's first step) the documents a drop policy skipped while planning the window."""
        if not self.ready:
            self._plan_next_window()
        return self.ready.popleft()

    def _plan_next_window(self) -> None:
        """Plan the window that starts at ``planned_until`` (one step with policy ``none``) into
        ``ready``; its state beforehand is kept for snapshots (``windows``)."""
        start = self.planned_until
        self.windows[start] = self._capture()
        self._apply_context(start)
        try:
            if self.balance.policy == "none":
                self.ready.append((*self._exact_step(start), None))
            else:
                self._plan_window(start)
        except Starved:
            del self.windows[start]
            for s in self.streams:
                s.drops.clear()
            raise
        first = start - self.next_step
        self.ready[first] = (*self.ready[first][:2], self._drain_drops())
        self._prune_windows()

    def plan_ahead(self, steps: int) -> int:
        """Plan whole windows ahead of hand-out until at least ``steps`` planned steps wait in
        ``ready`` (policy ``cost``), so that handing out a step never waits for a window to be
        balanced. Stops quietly when a source's metadata is not loaded yet (``starved_on``), and
        never plans past a pending topology switch (the stream must not depend on how far ahead
        planning ran). Returns the number of windows planned."""
        n = 0
        while self.balance.policy == "cost" and len(self.ready) < steps:
            if self.final_plan.topology != self.topology and self.planned_until >= self.replay_until:
                break
            try:
                self._plan_next_window()
            except Starved as e:
                self.starved_on = e.source  # loading looks further ahead for this source (wanted)
                return n
            n += 1
        if self.ready:
            self.starved_on = None  # planning is ahead: no source holds it back
        return n

    def _exact_step(self, start: int):
        topo = self.topology
        w = self.weights_at(start)
        sel = select_step(self.streams, w, topo.dp * topo.micro_batches, topo.tokens_per_micro_batch, self.carry)
        self.cum_tokens += sel.source_tokens
        self.cum_declared += w * sel.total_tokens
        self.carry = next_carry(self.cum_tokens, self.cum_declared, sel.longest_piece)
        bins = [np.asarray([p.as_list() for p in b], dtype=np.int64).reshape(-1, 6) for b in sel.bins]
        bin_costs = np.array([self._costs(b).sum() for b in bins])
        slots = assign_bins(bin_costs, topo.dp, topo.micro_batches)
        ranks = [[bins[slots[r, m]] for m in range(topo.micro_batches)] for r in range(topo.dp)]
        return ranks, bin_costs[slots]

    def _plan_window(self, start: int) -> None:
        """Select the next window's pieces (weighted fair queuing) and balance them over ranks.

        Pieces deferred by the balancer (heavy outliers without partners) leave room in the
        window; it is topped up with more selected pieces and balanced again, up to
        ``TOPUP_ROUNDS`` times, so deferral does not cost fill."""
        topo, bal = self.topology, self.balance
        n_steps = self._window_len(start)
        target = n_steps * self.step_budget
        slack = min(topo.tokens_per_micro_batch, target // 100)
        saved = [s.cursor() for s in self.streams], self.selected.copy(), self.declared.copy(), self.cls_selected.copy(), self.cls_declared.copy()
        pieces = self.pending
        # pieces still waiting fill the window's first steps; every other step selects with its own weights
        budgets = np.full(n_steps, self.step_budget, dtype=np.int64)
        carried = _tokens(pieces)
        for k in range(n_steps):
            take = min(carried, budgets[k])
            budgets[k] -= take
            carried -= take
        need = target - _tokens(pieces)
        try:
            for rnd in range(self.TOPUP_ROUNDS):
                if need > 0:  # a top-up selects with the weights of the window's last step
                    rows = self._select_steps(start, budgets) if rnd == 0 else self._select(need, start + n_steps - 1)
                    pieces = np.concatenate([pieces, _with_age(rows)])
                costs = self._costs(pieces)
                wp = balance_window(
                    pieces, costs, steps=n_steps, dp=topo.dp, micro_batches=topo.micro_batches,
                    capacity=topo.tokens_per_micro_batch, step_budget=self.step_budget, heavy_tokens=self.heavy_tokens,
                    sync=bal.sync, max_delay=bal.max_delay,
                )
                need = target - (_tokens(pieces) - _tokens(wp.pending))  # room left by deferred pieces
                if need <= slack:
                    break
        except Starved:
            for s, cur in zip(self.streams, saved[0]):
                s.restore(cur)
            self.selected, self.declared, self.cls_selected, self.cls_declared = saved[1:]
            raise
        self.pending = wp.pending
        for ranks, mb_costs in zip(wp.steps, wp.bin_costs):
            self.ready.append((ranks, mb_costs, None))

    TOPUP_ROUNDS = 3

    def _select_steps(self, first: int, budgets: np.ndarray) -> np.ndarray:
        """Select ``budgets[k]`` tokens with the weights of step ``first + k`` (runs of steps with
        equal weights in one call)."""
        groups: list[list] = []  # [first step of the run, budget, weights]
        for k, b in enumerate(budgets):
            w = self.weights_at(first + k)
            if groups and np.array_equal(groups[-1][2], w):
                groups[-1][1] += int(b)
            else:
                groups.append([first + k, int(b), w])
        parts = [self._select(b, step) for step, b, _ in groups]
        return np.concatenate(parts) if parts else np.zeros((0, 6), np.int64)

    def _select(self, budget: int, step: int) -> np.ndarray:
        if budget <= 0:
            return np.zeros((0, 6), np.int64)
        w = self.weights_at(step)
        cw = self.class_weights_at(step)
        if cw is None:
            rows = wfq_select(self.streams, w, budget, self.selected - self.declared)
        else:  # each (source, length class) is a source of its own, with its own cursor
            views = [ClassView(s, c) for s in self.streams for c in ("short", "long")]
            rows = wfq_select(views, cw.ravel(), budget, (self.cls_selected - self.cls_declared).ravel())
            got_cls = np.bincount(rows[:, 0], weights=rows[:, 5] - rows[:, 4], minlength=cw.size).astype(np.int64)
            self.cls_selected += got_cls.reshape(-1, 2)
            self.cls_declared += cw * got_cls.sum()
            rows[:, 0] //= 2
        got = np.bincount(rows[:, 0], weights=rows[:, 5] - rows[:, 4], minlength=len(self.streams)).astype(np.int64)
        self.selected += got
        self.declared += w * got.sum()
        return rows

    def _record(self, step: int, ranks: list[list[np.ndarray]], mb_costs: np.ndarray, drops: np.ndarray | None) -> None:
        parts, slots = [], []
        for r, mbs in enumerate(ranks):
            for m, rows in enumerate(mbs):
                parts.append(rows)
                slots.append(np.broadcast_to(np.array([r, m], dtype=np.int32), (len(rows), 2)))
        pieces = np.concatenate(parts) if parts else np.zeros((0, 6), np.int64)
        drops = drops if drops is not None else np.zeros((0, 5), np.int64)  # a window's drops go with its first step
        self.ledger[step] = {"pieces": pieces, "slot": np.concatenate(slots) if slots else np.zeros((0, 2), np.int32), "dropped": drops}
        ctx = self.timeline.context_at(step)
        lens = pieces[:, 5] - pieces[:, 4]
        tokens = int(lens.sum())
        imb, mb_imb = step_imbalance(mb_costs)
        rank_costs = mb_costs.sum(axis=1)
        self.metrics[step] = {
            "step": step,
            "tokens": tokens,
            "fill": float(tokens / self.topology.step_tokens),
            "imbalance": imb,
            "mb_imbalance": mb_imb,
            "source_tokens": [int(x) for x in np.bincount(pieces[:, 0], weights=lens, minlength=len(self.streams))],
            "longest_piece": int(lens.max()) if len(lens) else 0,
            "cost_max": float(rank_costs.max()),
            "cost_mean": float(rank_costs.mean()),
            "lower_bound": float(max(self._costs(pieces).max(initial=0.0), rank_costs.sum() / self.topology.dp)),
            "pending": int(len(self.pending)),
            "weights": [float(x) for x in self.weights_at(step)],
            "version": self.timeline.version_at(step),
            "stage": ctx.stage,
            "piece_tokens": ctx.piece_tokens,
            "dropped_docs": [int(x) for x in np.bincount(drops[:, 0], minlength=len(self.streams))],
            "dropped_tokens": [int(x) for x in np.bincount(drops[:, 0], weights=drops[:, 4], minlength=len(self.streams))],
        }
        if self.pool_workers:  # autoscaled runs: the pools' workers when this step was planned
            self.metrics[step]["pool_workers"] = dict(self.pool_workers)
        while len(self.metrics) > self.history_steps:
            self.metrics.popitem(last=False)
        while len(self.ledger) > self.history_steps and next(iter(self.ledger)) < self.committed:
            self.ledger.popitem(last=False)

    # ---- state (snapshots) ---------------------------------------------------------------------
    # The planner is a pure function of its state at the start of a window and of the (reloaded)
    # unit lengths, so a snapshot holds only that small state, the step the window starts at and
    # the committed step; a restore re-plans from there and hands out steps from `committed` on.

    def _capture(self) -> dict:
        return {
            "cursors": [list(s.cursor()) for s in self.streams],
            "pending": self.pending.astype("<i8").tobytes(),
            "selected": [int(x) for x in self.selected],
            "declared": [float(x) for x in self.declared],
            "cum_tokens": [int(x) for x in self.cum_tokens],
            "cum_declared": [float(x) for x in self.cum_declared],
            "carry": [float(x) for x in self.carry],
            "dropped": self.dropped.astype("<i8").tobytes(),
            "cls_selected": self.cls_selected.astype("<i8").tobytes(),
            "cls_declared": [float(x) for x in self.cls_declared.ravel()],
        }

    def _prune_windows(self) -> None:
        """Keep the window holding the oldest non-durable step and every later one."""
        keys = list(self.windows)
        for k, nxt in zip(keys, keys[1:]):
            if nxt <= self.durable_step:
                del self.windows[k]

    def get_state(self) -> dict:
        """A msgpack-friendly snapshot: topology-free positions, the window start, committed."""
        durable = self.durable_step
        starts = [k for k in self.windows if k <= durable]
        if starts:
            window_step, window = starts[-1], self.windows[starts[-1]]
        else:
            window_step, window = self.planned_until, self._capture()
        t = self.topology
        return {
            "version": STATE_VERSION,
            "plan": self.plan.name,
            "sources": list(self.source_names),
            "updates": [[at, plan_to_dict(p)] for at, p in self.timeline.updates],
            "committed": durable,
            "window_step": window_step,
            "window": window,
            "topology": {"dp": t.dp, "micro_batches": t.micro_batches, "tokens_per_micro_batch": t.tokens_per_micro_batch,
                         "max_doc_tokens": t.max_doc_tokens, "cp": t.cp, "cp_min_tokens": t.cp_min_tokens},
        }

    def _restore(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"snapshot version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
        if list(state["sources"]) != self.source_names:
            raise ValueError(f"snapshot sources {list(state['sources'])} differ from the plan's {self.source_names}; "
                             "to add or remove sources, resume with the snapshot's plan and apply a plan update")
        w = state["window"]
        n = len(self.streams)
        window_sources = len(w["cursors"])  # sources that existed when the window started
        self._grow(n)
        for s, cur in zip(self.streams, w["cursors"]):
            s.restore(tuple(cur))
            s.req_epoch, s.req_pos = s.epoch, s.pos

        def padded(values, dtype):
            return np.concatenate([np.asarray(values, dtype=dtype), np.zeros(n - window_sources, dtype=dtype)])

        self.pending = np.frombuffer(w["pending"], dtype="<i8").reshape(-1, 7).copy()
        self.selected = padded(w["selected"], np.int64)
        self.declared = padded(w["declared"], np.float64)
        self.cum_tokens = padded(w["cum_tokens"], np.int64)
        self.cum_declared = padded(w["cum_declared"], np.float64)
        self.carry = padded(w["carry"], np.float64)
        self.dropped = np.concatenate([np.frombuffer(w["dropped"], dtype="<i8").reshape(-1, 2), np.zeros((n - window_sources, 2), np.int64)])
        self.cls_selected = np.concatenate([np.frombuffer(w["cls_selected"], dtype="<i8").reshape(-1, 2), np.zeros((n - window_sources, 2), np.int64)])
        self.cls_declared = np.concatenate([np.asarray(w["cls_declared"], dtype=np.float64).reshape(-1, 2), np.zeros((n - window_sources, 2))])
        self.next_step = int(state["window_step"])
        self.replay_until = int(state["committed"])
        self.acked = [self.replay_until - 1] * len(self.acked)
        self.durable = list(self.acked)

    def _switch_topology(self) -> None:
        """After replaying the delivered steps on the old topology, continue on the plan's: the
        pieces planned but not delivered go back to the front of the queue, in order."""
        undelivered = [rows for ranks, _, _ in self.ready for mbs in ranks for rows in mbs]
        if undelivered:
            self.pending = np.concatenate([self.pending, _with_age(np.concatenate(undelivered))])
        self.ready.clear()
        self._use_plan(self.final_plan, acked_through=self.replay_until - 1)
        self.windows.clear()

    # ---- acknowledgements ---------------------------------------------------------------------
    def ack(self, rank: int, step: int, cp_rank: int = 0, durable: bool = False) -> int:
        """(``rank``, ``cp_rank``) consumed every step up to ``step`` (and, if ``durable``, saved
        them in its trainer checkpoint); idempotent. Returns ``committed``."""
        if not 0 <= rank < self.topology.dp:
            raise ValueError(f"rank {rank} does not exist: the plan has dp={self.topology.dp} ranks (0..{self.topology.dp - 1})")
        if not 0 <= cp_rank < self.topology.cp:
            raise ValueError(f"cp rank {cp_rank} does not exist: the plan has cp={self.topology.cp}")
        if step >= self.next_step:
            raise ValueError(f"rank {rank} acknowledged step {step}, but only steps < {self.next_step} were planned")
        i = rank * self.topology.cp + cp_rank
        self.acked[i] = max(self.acked[i], step)
        if durable:
            self.durable[i] = max(self.durable[i], step)
        return self.committed

    # ---- inspection ---------------------------------------------------------------------------
    def sample_ids(self, pieces: np.ndarray) -> np.ndarray:
        """Source-wide sample ids of ledger pieces."""
        out = np.empty(len(pieces), dtype=np.int64)
        for i, s in enumerate(self.streams):
            sel = pieces[:, 0] == i
            out[sel] = s.first_ids[pieces[sel, 2]] + pieces[sel, 3]
        return out

    def dropped_ids(self, drops: np.ndarray) -> np.ndarray:
        """Ledger drop rows ``[source, epoch, unit, doc, tokens]`` as ``[source, epoch, sample id, tokens]``."""
        out = np.empty((len(drops), 4), dtype=np.int64)
        out[:, 0], out[:, 1], out[:, 3] = drops[:, 0], drops[:, 1], drops[:, 4]
        for i, s in enumerate(self.streams):
            sel = drops[:, 0] == i
            out[sel, 2] = s.first_ids[drops[sel, 2]] + drops[sel, 3]
        return out

    def status(self) -> dict:
        return {
            "next_step": self.next_step,
            "committed": self.committed,
            "durable": self.durable_step,
            "acked": list(self.acked),
            "failure": self.failure,
            "starved_on": self.starved_on,
            "cursors": {s.name: list(s.cursor()[:4]) for s in self.streams},
            "loaded_units": {s.name: len(s.lengths) for s in self.streams},
            "plan_version": self.plan_version,
            "frontier": self.frontier,
            "dropped": {s.name: {"docs": int(d), "tokens": int(t)} for s, (d, t) in zip(self.streams, self.dropped)},
        }
