"""What the trainers report, turned into the planner's decisions (planner thread).

Each rank's stream reports per step its compute time (per micro-batch where the trainer iterates
micro-batches) and, when the trainer calls ``report()``, its loss per source and other metrics
(``trainer/reporting.py``). The scheduler queues the reports (bounded) and the planner thread
hands them here each planning round:

- step times become rows of the cost learner's regression (``learn.py``), with the features of
  what the planner put in that micro-batch (from the ledger); the measured imbalance of each step
  whose ranks all reported is kept (max over ranks / mean);
- losses go to the mixing controller (``mixing.py``);
- :meth:`FeedbackLoop.decide` records what either concludes as a timeline decision.

Memory is bounded whatever the trainers send: windows and per-step tables have fixed sizes, and
nothing here grows with the number of steps or ranks beyond ``KEEP_STEPS`` steps of figures.
Without reports nothing is decided: the declared cost model and mix stay in force.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..protocol import reports_in, step_times
from .learn import CostLearner, step_features
from .mixing import Controller, checked_proposal, make_controller, project

if TYPE_CHECKING:
    from .state import PlannerState

KEEP_STEPS = 512  # steps of per-rank times kept to measure imbalance
HISTORY = 1024  # measured imbalances and per-rank compute times kept for the views


class FeedbackLoop:
    def __init__(self, state: PlannerState):
        plan = state.final_plan
        self.learner = CostLearner(plan.cost.learn, plan.cost) if plan.cost.learn is not None else None
        self.mixing = plan.mixing
        self.controller: Controller | None = (
            make_controller(plan.mixing, state.source_names) if plan.mixing.controller else None
        )
        last = state.timeline.in_force("weights", 1 << 62) if self.controller is not None else None
        if last is not None and last.state:  # a resumed run: the controller goes on from its last decision
            self.controller.load_state_dict(last.state)
        self.reports = 0
        self.newest = -1  # newest step any rank reported
        self.decided_at = -1  # newest reported step when the controller last decided
        self._features: OrderedDict[int, tuple[dict, np.ndarray]] = (
            OrderedDict()
        )  # step -> (ledger entry, its features)
        self._times: OrderedDict[int, np.ndarray] = (
            OrderedDict()
        )  # step -> [dp, micro-batches] seconds (nan: not reported yet)
        self.imbalance: deque = deque(maxlen=HISTORY)  # (step, measured max/mean over ranks)
        self.rank_seconds: dict[int, tuple[int, float]] = {}  # rank -> (its newest reported step, its compute time)
        self.metrics: deque = deque(maxlen=HISTORY)  # (step, rank, extra metrics) as reported

    def rewound(self, st: PlannerState) -> None:
        """The run was rewound (a job restarted from a checkpoint, perhaps at another dp) and
        ``st`` plans its steps again: the per-step tables of the replaced plan (times waiting for
        their other ranks, micro-batch features) describe steps that will be planned anew, and a
        table of another dp would not fit this one's ranks."""
        self._times.clear()
        self._features.clear()
        dp = st.topology.dp
        self.rank_seconds = {r: v for r, v in self.rank_seconds.items() if r < dp}

    # ---- reports ------------------------------------------------------------------------------
    def take(self, st: PlannerState, reports: list) -> None:
        """``reports``: ``(rank, cp_rank, item)``, items as the trainers aggregate them
        (``trainer/reporting.aggregate``): a chunk's compute times as columns ``{"s": newest,
        "steps": [...], "t": [seconds], "mb": [[seconds per micro-batch] | None]}``, and merged
        loss reports ``{"s": step, "loss": {source: [sum, tokens]}, "extra": {...}, "n":
        reports}``; a single step's ``{"s": step, "t": seconds, "mb": ...}`` too. Step times are
        handled in arrays (at thousands of ranks, every rank reports every step)."""
        ranks, cps, steps, secs, mbs = [], [], [], [], []
        for rank, cp_rank, item in reports:
            self.newest = max(self.newest, int(item["s"]))
            columns = step_times(item)
            if columns is not None:
                k = len(columns[0])
                ranks += [rank] * k
                cps += [cp_rank] * k
                steps += columns[0]
                secs += columns[1]
                mbs += columns[2]
                self.reports += k
            if "loss" in item or "extra" in item:
                losses = {k: (float(v[0]), float(v[1])) for k, v in (item.get("loss") or {}).items()}
                if self.controller is not None:
                    self._controller("observe", int(item["s"]), losses, item.get("extra") or {})
                if item.get("extra"):
                    self.metrics.append((int(item["s"]), rank, item["extra"]))
                self.reports += reports_in(item)
        if steps:
            self._times_of(st, ranks, cps, steps, secs, mbs)

    def _times_of(self, st: PlannerState, ranks: list, cps: list, steps: list, seconds: list, mbs: list) -> None:
        topo = st.topology
        dp, m = topo.dp, topo.micro_batches
        rank = np.array(ranks, np.int64)
        cp = np.array(cps, np.int64)
        step = np.array(steps, np.int64)
        per_mb = np.array([bool(mb) and len(mb) == m for mb in mbs], bool)
        secs = np.array(
            [mb if ok else [float(t) / m] * m for t, mb, ok in zip(seconds, mbs, per_mb.tolist())], np.float64
        ).reshape(-1, m)
        ok = (rank >= 0) & (rank < dp) & np.isfinite(secs).all(axis=1)
        rank, cp, step, per_mb, secs = rank[ok], cp[ok], step[ok], per_mb[ok], secs[ok]
        first = cp == 0
        for r, s, t in zip(rank[first].tolist(), step[first].tolist(), secs[first].sum(axis=1).tolist()):
            if s >= self.rank_seconds.get(r, (-1, 0.0))[0]:  # the newest step wins, whatever the arrival order
                self.rank_seconds[r] = (s, t)
        by_step = st.plan.balance.sync == "step"
        for s in np.unique(step).tolist():
            sel = step == s
            self._rank_times(s, rank[sel & first], secs[sel & first], dp, by_step)
            if self.learner is not None:
                feats = self._step_features(st, s)
                if feats is not None:
                    f, t, whole = feats[rank[sel]], secs[sel], ~per_mb[sel]
                    if by_step or whole.all():  # per step: a rank's micro-batches together
                        self.learner.observe(f.sum(axis=1), t.sum(axis=1), s)
                    else:
                        self.learner.observe(f[~whole].reshape(-1, f.shape[-1]), t[~whole].reshape(-1), s)

    def _step_features(self, st: PlannerState, step: int) -> np.ndarray | None:
        """``[dp, micro_batches, terms]`` of a handed-out step (None if the ledger no longer has
        it), remembered with the ledger entry they were computed from: a step planned again
        (after a rewind, perhaps at another dp) is another entry."""
        entry = st.ledger.entries.get(step)
        if entry is None:
            return None
        known = self._features.get(step)
        if known is not None and known[0] is entry:
            return known[1]
        pieces = entry["pieces"]
        vision = (
            st.streams.piece_vision(pieces)
            if st.timeline.cost_at(step).encoder > 0 or self.learner.declared.encoder > 0
            else None
        )
        feats = step_features(pieces, entry["slot"], vision, st.topology.dp, st.topology.micro_batches)
        self._features[step] = (entry, feats)
        while len(self._features) > 64:
            self._features.popitem(last=False)
        return feats

    def _rank_times(self, step: int, ranks: np.ndarray, secs: np.ndarray, dp: int, per_step: bool) -> None:
        """Once every rank reported ``step``: its measured imbalance, what the trainers lost to it
        (sync ``step``: the slowest rank's step over the mean; sync ``micro_batch``: the sum over
        micro-batches of the slowest rank's over the mean)."""
        if len(ranks) == 0:
            return
        got = self._times.get(step)
        if got is None or got.shape != (dp, secs.shape[1]):  # (a report of a step planned at another dp)
            got = self._times[step] = np.full((dp, secs.shape[1]), np.nan)
        got[ranks] = secs
        if not np.isnan(got[:, 0]).any():
            t = got.sum(axis=1, keepdims=True) if per_step else got
            self.imbalance.append((step, float(t.max(axis=0).sum() / max(t.mean(axis=0).sum(), 1e-12))))
            del self._times[step]
        while len(self._times) > KEEP_STEPS:
            self._times.popitem(last=False)

    # ---- decisions ----------------------------------------------------------------------------
    def decide(self, st: PlannerState) -> list:
        """Fit and propose; record what changes as timeline decisions (returned)."""
        out = []
        if self.learner is not None and self.learner.refit(self.newest):
            frontier = st.frontier
            values = self.learner.proposal(st.timeline.cost_at(frontier))
            if values is not None:
                s = self.learner.status()
                why = (
                    f"fit settled over {s['observations']} observations: median error {s['error_fitted']:.1%} "
                    f"(declared model at its best scale: {s['error_declared']:.1%})"
                )
                out.append(st.timeline.decide("cost", frontier + self.learner.config.lag, values, why))
        if self.controller is not None and self._mixing_due():
            self.decided_at = self.newest
            at = max(self.newest + self.mixing.lag, st.frontier)
            current = st.timeline.weights_in_force(at)
            got = self._controller("propose", self.newest, dict(zip(st.source_names, map(float, current))))
            if got is not None:
                target, why = checked_proposal(self.mixing.controller, got, st.source_names)
                lo, hi = self._bounds(st.source_names)
                new = project(target / max(target.sum(), 1e-300), current, lo, hi, self.mixing.max_change)
                out.append(
                    st.timeline.decide(
                        "weights", at, dict(zip(st.source_names, map(float, new))), why, self.controller.state_dict()
                    )
                )
        return out

    def _controller(self, method: str, step: int, *args):
        """A call of the controller's ``method``; what it raises fails the run naming the controller,
        the call and the step (not a bare "planning failed: RuntimeError")."""
        try:
            return getattr(self.controller, method)(step, *args)
        except PlanError:
            raise
        except Exception as err:
            raise PlanError(
                f"mixing controller {self.mixing.controller!r} raised in {method}() at step {step}: "
                f"{type(err).__name__}: {err}"
            ) from None

    def _mixing_due(self) -> bool:
        return (
            self.newest >= self.mixing.warmup
            and self.newest - self.decided_at >= self.mixing.interval
            and self.newest >= 0
        )

    def _bounds(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        b = self.mixing.bounds
        lo = np.array([b[n][0] if n in b else self.mixing.min_share for n in names])
        hi = np.array([b[n][1] if n in b else 1.0 for n in names])
        return lo, hi

    # ---- views --------------------------------------------------------------------------------
    def status(self, st: PlannerState) -> dict:
        imb = [x for _, x in self.imbalance]
        out = {
            "reports": self.reports,
            "newest_reported": self.newest,
            "measured_imbalance_p50": float(np.median(imb[-100:])) if imb else None,
            "rank_compute": {
                str(r): {"step": s, "seconds": round(t, 6)} for r, (s, t) in sorted(self.rank_seconds.items())
            },
            "decisions": [d.to_dict() | {"state": None} for d in st.timeline.decisions[-50:]],
            "decision_counts": {k: sum(d.kind == k for d in st.timeline.decisions) for k in ("cost", "weights")},
        }
        if self.learner is not None:
            out["cost_fit"] = self.learner.status()
            in_force = st.timeline.in_force("cost", st.frontier)
            out["cost_fit"]["in_force"] = "learned" if in_force is not None else "declared"
        if self.controller is not None:
            out["controller"] = self.mixing.controller
        return out
