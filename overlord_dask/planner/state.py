"""The planner's state machine, free of Dask: streams, step planning, ledger, acks and metrics.

The scheduler plugin (``plugin.py``) is a thin RPC shell around this class, which keeps it
testable without a cluster. Everything here is metadata: lengths, ids, counters. No payload.

Ledger: every planned step keeps its pieces ``[source, epoch, unit, doc, start, stop]`` and the
(rank, micro-batch) it went to until every rank has acknowledged it; a bounded history of
committed steps is kept for inspection (``history_steps``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..plan.models import Plan
from .assign import assign_bins
from .cost import doc_costs
from .metrics import step_imbalance
from .mixing import Starved, next_carry, select_step
from .streams import SourceStream

PIECE_FIELDS = ("source", "epoch", "unit", "doc", "start", "stop")


class PlannerState:
    def __init__(self, plan: Plan, unit_first_ids: dict[str, list[int]], *, history_steps: int = 100_000):
        self.plan = plan
        self.topology = plan.topology
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
        self.acked = [-1] * plan.topology.dp  # last step each rank acknowledged
        self.ledger: OrderedDict[int, dict] = OrderedDict()  # step -> {"pieces": int64[n,6], "slot": int32[n,2]}
        self.metrics: OrderedDict[int, dict] = OrderedDict()
        self.history_steps = history_steps
        self.failure: str | None = None
        self.starved_on: str | None = None

    # ---- loading ------------------------------------------------------------------------------
    def wanted(self) -> list[list]:
        """Units whose metadata the planner needs next: [source, epoch, unit] each."""
        out = []
        step_tokens = self.topology.step_tokens
        for s, w in zip(self.streams, self.weights):
            if w <= 0:
                continue
            target = max(1, int(w * step_tokens * 2))
            for epoch, unit in s.want(target, self.plan.loading.units_ahead):
                out.append([s.name, epoch, unit])
        return out

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

    def can_plan(self) -> bool:
        return self.next_step - self.committed < self.plan.loading.prefetch_steps

    def plan_steps(self, max_steps: int) -> tuple[list[dict], list[list]]:
        """Plan as many steps as the bounds and loaded metadata allow.

        Returns (steps, finished_units): each step is ``{"step", "ranks": [[mb pieces]]}`` with a
        piece as ``[source, epoch, unit, doc, start, stop]``; finished units are ``[source, epoch,
        unit]`` whose blocks no later step needs.
        """
        steps = []
        topo = self.topology
        while len(steps) < max_steps and self.can_plan():
            try:
                sel = select_step(self.streams, self.weights, topo.dp * topo.micro_batches, topo.tokens_per_micro_batch, self.carry)
            except Starved as e:
                self.starved_on = e.source
                break
            self.starved_on = None
            self.cum_tokens += sel.source_tokens
            self.carry = next_carry(self.cum_tokens, self.weights, sel.longest_piece)
            bin_costs = np.array([doc_costs(np.array([p.length for p in b], dtype=np.int64), self.plan.cost).sum() for b in sel.bins])
            slots = assign_bins(bin_costs, topo.dp, topo.micro_batches)
            ranks = [[[p.as_list() for p in sel.bins[slots[r, m]]] for m in range(topo.micro_batches)] for r in range(topo.dp)]
            step = self.next_step
            self.next_step += 1
            self._record(step, ranks, bin_costs[slots], sel)
            steps.append({"step": step, "ranks": ranks})
        finished = []
        for s in self.streams:
            finished.extend([s.name, e, u] for e, u in s.finished_units())
        return steps, finished

    def _record(self, step: int, ranks: list, mb_costs: np.ndarray, sel) -> None:
        rows, slots = [], []
        for r, mbs in enumerate(ranks):
            for m, pieces in enumerate(mbs):
                rows.extend(pieces)
                slots.extend([[r, m]] * len(pieces))
        self.ledger[step] = {"pieces": np.asarray(rows, dtype=np.int64).reshape(-1, 6), "slot": np.asarray(slots, dtype=np.int32).reshape(-1, 2)}
        imb, mb_imb = step_imbalance(mb_costs)
        self.metrics[step] = {
            "step": step,
            "tokens": int(sel.total_tokens),
            "fill": float(sel.total_tokens / self.topology.step_tokens),
            "imbalance": imb,
            "mb_imbalance": mb_imb,
            "source_tokens": [int(x) for x in sel.source_tokens],
            "longest_piece": int(sel.longest_piece),
            "cost_max": float(mb_costs.sum(axis=1).max()),
            "cost_mean": float(mb_costs.sum(axis=1).mean()),
        }
        while len(self.metrics) > self.history_steps:
            self.metrics.popitem(last=False)
        while len(self.ledger) > self.history_steps and next(iter(self.ledger)) < self.committed:
            self.ledger.popitem(last=False)

    # ---- acknowledgements ---------------------------------------------------------------------
    def ack(self, rank: int, step: int) -> int:
        """Rank ``rank`` consumed every step up to ``step``; idempotent. Returns ``committed``."""
        if not 0 <= rank < self.topology.dp:
            raise ValueError(f"rank {rank} does not exist: the plan has dp={self.topology.dp} ranks (0..{self.topology.dp - 1})")
        if step >= self.next_step:
            raise ValueError(f"rank {rank} acknowledged step {step}, but only steps < {self.next_step} were planned")
        self.acked[rank] = max(self.acked[rank], step)
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
            "acked": list(self.acked),
            "failure": self.failure,
            "starved_on": self.starved_on,
            "cursors": {s.name: list(s.cursor()[:4]) for s in self.streams},
            "loaded_units": {s.name: len(s.lengths) for s in self.streams},
        }
