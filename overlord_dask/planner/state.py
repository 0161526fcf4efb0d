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

from ..plan.models import Plan
from .assign import assign_bins
from .balance import balance_window, wfq_select
from .cost import doc_costs
from .metrics import step_imbalance
from .mixing import Starved, next_carry, select_step
from .streams import SourceStream

def _tokens(rows: np.ndarray) -> int:
    return int((rows[:, 5] - rows[:, 4]).sum())


def _with_age(rows: np.ndarray, age: int = 0) -> np.ndarray:
    """Piece rows ``[n, 6]`` with the balancer's waiting-age column appended."""
    return np.concatenate([rows, np.full((len(rows), 1), age, dtype=np.int64)], axis=1)


STATE_VERSION = 1


class PlannerState:
    def __init__(self, plan: Plan, unit_first_ids: dict[str, list[int]], *, history_steps: int = 100_000, state: dict | None = None):
        self.final_plan = plan
        if state is not None:  # replay on the topology the snapshot was planned with, switch at `committed`
            plan = plan.model_copy(update={"topology": plan.topology.model_copy(update=state["topology"])})
        self._use_plan(plan)
        self.source_names = [s.name for s in plan.sources]
        w = np.array([s.weight for s in plan.sources], dtype=np.float64)
        self.weights = w / w.sum()
        self.streams = [
            SourceStream(
                name=s.name,
                index=i,
                n_units=len(unit_first_ids[s.name]),
                first_ids=np.asarray(unit_first_ids[s.name], dtype=np.int64),
                seed=plan.seed,
                piece_tokens=plan.topology.piece_tokens,
            )
            for i, s in enumerate(plan.sources)
        ]
        self.next_step = 0
        self.cum_tokens = np.zeros(len(self.streams), dtype=np.int64)
        self.carry = np.zeros(len(self.streams))
        self.commit_mode = plan.checkpoint.commit
        self.ledger: OrderedDict[int, dict] = OrderedDict()  # step -> {"pieces": int64[n,6], "slot": int32[n,2]}
        self.metrics: OrderedDict[int, dict] = OrderedDict()
        self.history_steps = history_steps
        self.failure: str | None = None
        self.starved_on: str | None = None
        # policy "cost": a window of steps is planned at once and handed out one step at a time
        self.balance = plan.balance
        self.ready: deque = deque()  # planned steps not yet handed out: (ranks, bin_costs)
        self.pending = np.zeros((0, 7), dtype=np.int64)  # pieces waiting for the next window
        self.selected = np.zeros(len(self.streams), dtype=np.int64)  # tokens selected per source so far
        self.plan_seconds: list[float] = []  # wall time of each planning call that produced steps
        self.held: set[tuple[int, int, int]] = set()  # passed units still referenced by pending/ready pieces
        self.windows: OrderedDict[int, dict] = OrderedDict()  # first step of a planned window -> state before it
        self.replay_until = 0  # steps below this were delivered before a restore: re-planned, not handed out
        if state is not None:
            self._restore(state)

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
        for s, w in zip(self.streams, self.weights):
            if w <= 0:
                continue
            target = max(1, int(w * step_tokens * (self._window_steps() + 1) * 1.3))
            if s.name == self.starved_on:  # planning needs more of this source than the look-ahead holds
                target = s.unplanned_tokens() + 1
            for epoch, unit in s.want(target, self.plan.loading.units_ahead):
                out.append([s.name, epoch, unit])
        return out

    def _window_steps(self) -> int:
        return self.balance.window if self.balance.policy == "cost" else 1

    def add_lengths(self, source: str, epoch: int, unit: int, lengths: np.ndarray) -> bool:
        return self._stream(source).add_lengths(epoch, unit, lengths)

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
                ranks, mb_costs = self._next_planned()
            except Starved as e:
                self.starved_on = e.source
                break
            self.starved_on = None
            step = self.next_step
            self.next_step += 1
            if step < self.replay_until:
                continue  # delivered before the restore: only the planner state had to catch up
            self._record(step, ranks, mb_costs)
            entry = self.ledger[step]
            steps.append({"step": step, "pieces": entry["pieces"].astype("<i8").tobytes(), "slot": entry["slot"].astype("<i4").tobytes()})
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
        refs = [self.pending[:, :3]] + [rows[:, :3] for ranks, _ in self.ready for mbs in ranks for rows in mbs]
        in_use = {tuple(r) for r in np.unique(np.concatenate(refs), axis=0).tolist()} if refs else set()
        done = [k for k in self.held if k not in in_use]
        self.held.difference_update(done)
        return [[self.source_names[i], e, u] for i, e, u in sorted(done)]

    def _next_planned(self) -> tuple[list[list[np.ndarray]], np.ndarray]:
        """The next step's pieces per (rank, micro-batch) as int64 rows, and their costs."""
        if self.balance.policy == "none" or not self.ready:
            self.windows[self.next_step] = self._capture()
            try:
                if self.balance.policy == "none":
                    return self._exact_step()
                self._plan_window()
            except Starved:
                del self.windows[self.next_step]
                raise
            self._prune_windows()
        return self.ready.popleft()

    def _exact_step(self):
        topo = self.topology
        sel = select_step(self.streams, self.weights, topo.dp * topo.micro_batches, topo.tokens_per_micro_batch, self.carry)
        self.cum_tokens += sel.source_tokens
        self.carry = next_carry(self.cum_tokens, self.weights, sel.longest_piece)
        bins = [np.asarray([p.as_list() for p in b], dtype=np.int64).reshape(-1, 6) for b in sel.bins]
        bin_costs = np.array([doc_costs(b[:, 5] - b[:, 4], self.plan.cost).sum() for b in bins])
        slots = assign_bins(bin_costs, topo.dp, topo.micro_batches)
        ranks = [[bins[slots[r, m]] for m in range(topo.micro_batches)] for r in range(topo.dp)]
        return ranks, bin_costs[slots]

    def _plan_window(self) -> None:
        """Select the next window's pieces (weighted fair queuing) and balance them over ranks.

        Pieces deferred by the balancer (heavy outliers without partners) leave room in the
        window; it is topped up with more selected pieces and balanced again, up to
        ``TOPUP_ROUNDS`` times, so deferral does not cost fill."""
        topo, bal = self.topology, self.balance
        target = bal.window * self.step_budget
        slack = min(topo.tokens_per_micro_batch, target // 100)
        saved = [s.cursor() for s in self.streams], self.selected.copy()
        pieces = self.pending
        need = target - _tokens(pieces)
        try:
            for _ in range(self.TOPUP_ROUNDS):
                if need > 0:
                    rows = self._select(need)
                    pieces = np.concatenate([pieces, _with_age(rows)])
                costs = doc_costs(pieces[:, 5] - pieces[:, 4], self.plan.cost)
                wp = balance_window(
                    pieces, costs, steps=bal.window, dp=topo.dp, micro_batches=topo.micro_batches,
                    capacity=topo.tokens_per_micro_batch, step_budget=self.step_budget, heavy_tokens=self.heavy_tokens,
                    sync=bal.sync, max_delay=bal.max_delay,
                )
                need = target - (_tokens(pieces) - _tokens(wp.pending))  # room left by deferred pieces
                if need <= slack:
                    break
        except Starved:
            for s, cur in zip(self.streams, saved[0]):
                s.restore(cur)
            self.selected = saved[1]
            raise
        self.pending = wp.pending
        for ranks, mb_costs in zip(wp.steps, wp.bin_costs):
            self.ready.append((ranks, mb_costs))

    TOPUP_ROUNDS = 3

    def _select(self, budget: int) -> np.ndarray:
        if budget <= 0:
            return np.zeros((0, 6), np.int64)
        surplus = self.selected - self.weights * self.selected.sum()
        rows = wfq_select(self.streams, self.weights, budget, surplus)
        self.selected += np.bincount(rows[:, 0], weights=rows[:, 5] - rows[:, 4], minlength=len(self.streams)).astype(np.int64)
        return rows

    def _record(self, step: int, ranks: list[list[np.ndarray]], mb_costs: np.ndarray) -> None:
        parts, slots = [], []
        for r, mbs in enumerate(ranks):
            for m, rows in enumerate(mbs):
                parts.append(rows)
                slots.append(np.broadcast_to(np.array([r, m], dtype=np.int32), (len(rows), 2)))
        pieces = np.concatenate(parts) if parts else np.zeros((0, 6), np.int64)
        self.ledger[step] = {"pieces": pieces, "slot": np.concatenate(slots) if slots else np.zeros((0, 2), np.int32)}
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
            "lower_bound": float(max(doc_costs(lens, self.plan.cost).max(initial=0.0), rank_costs.sum() / self.topology.dp)),
            "pending": int(len(self.pending)),
        }
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
            "cum_tokens": [int(x) for x in self.cum_tokens],
            "carry": [float(x) for x in self.carry],
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
            window_step, window = self.next_step, self._capture()
        t = self.topology
        return {
            "version": STATE_VERSION,
            "plan": self.plan.name,
            "sources": list(self.source_names),
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
                             "adding or removing sources on resume is not supported yet")
        w = state["window"]
        for s, cur in zip(self.streams, w["cursors"]):
            s.restore(tuple(cur))
            s.req_epoch, s.req_pos = s.epoch, s.pos
        self.pending = np.frombuffer(w["pending"], dtype="<i8").reshape(-1, 7).copy()
        self.selected = np.asarray(w["selected"], dtype=np.int64)
        self.cum_tokens = np.asarray(w["cum_tokens"], dtype=np.int64)
        self.carry = np.asarray(w["carry"], dtype=np.float64)
        self.next_step = int(state["window_step"])
        self.replay_until = int(state["committed"])
        self.acked = [self.replay_until - 1] * len(self.acked)
        self.durable = list(self.acked)

    def _switch_topology(self) -> None:
        """After replaying the delivered steps on the old topology, continue on the plan's: the
        pieces planned but not delivered go back to the front of the queue, in order."""
        undelivered = [rows for ranks, _ in self.ready for mbs in ranks for rows in mbs]
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
        }
