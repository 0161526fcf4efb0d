"""The run's timeline: its declared plan versions (``plan/versions.py``) and the planner's own
decisions, each from the step it applies.

A decision is what the planner concludes at run time from what the trainers report: a mixing
controller's shares (``mixing.py``), a learned cost model (``learn.py``). It is recorded the way
a live update is, from a step not planned yet, so the stream stays a pure function of (plan,
updates, decisions): a resumed run and a replay deliver the identical stream. A decision stays in
force until the next one of its kind, or until a plan version that changes what it overrides
(the sources or stages for the mix, the cost model for a learned cost) starts after it.

A **dp change** (``kind="dp"``, ``values={"dp": n}``, from step A) records that a training job
came back from its checkpoint at step A with another number of data-parallel ranks
(``rewind.py``): the steps from A on are planned for ``n`` ranks, switching mid-window as the
rewind did (the pieces planned for the old ranks and not delivered go back to the queue). A later
dp change at or before A replaces the ones from its step on (the job went back further).

A **skip** (``kind="skip"``, ``values={"until": B}``, from step A) is a decision of the run's
operator rather than the planner's: steps A..B are planned as they would be (the stream after them
is unchanged) but not handed out, and a rank that reaches A goes on at B + 1 (the remedy PaLM
used for loss spikes: ``Service.skip_steps``). Their documents count as used.

Everything the planner asks of "the plan at a step" goes through here: the weights in force, the
mix (with a stage's long-document share), the cost model in force, where planning windows must
end, which steps are skipped.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..plan import CostModel, Plan
from ..plan.versions import OVERRIDES, PlanVersions, decode_updates

SKIP = "skip"  # steps not handed out: {"until": the last one}
DP = "dp"  # data-parallel ranks from this step on: {"dp": n}
KINDS = (*OVERRIDES, SKIP, DP)  # what a decision sets: the mix (shares by source name), the cost model, a skip, a dp


def with_dp(plan: Plan, dp: int) -> Plan:
    """``plan`` for ``dp`` data-parallel ranks (the rest of the topology as it is)."""
    if plan.topology.dp == dp:
        return plan
    return plan.model_copy(update={"topology": plan.topology.model_copy(update={"dp": dp})})


MEMO_STEPS = 4096  # steps' shares remembered (a few windows' worth)
_UNSET = object()


class Decision(NamedTuple):
    """A decision of the planner's own, in force from step ``at``."""

    at: int
    kind: str
    values: dict
    reason: str
    after: int  # plan versions that existed when it was made (a version at the same step made later overrides it)
    state: dict | None = None  # the deciding controller's state after it (a resumed run continues from it)

    def to_dict(self) -> dict:
        return {
            "at": self.at,
            "kind": self.kind,
            "values": dict(self.values),
            "reason": self.reason,
            "after": self.after,
            "state": self.state,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Decision:
        return cls(int(d["at"]), str(d["kind"]), dict(d["values"]), str(d["reason"]), int(d["after"]), d.get("state"))


class Timeline(PlanVersions):
    """The plan versions and the decisions on top of them."""

    def __init__(self, plan: Plan, updates: list[tuple[int, Plan]] = (), decisions: list[Decision] = ()):
        super().__init__(plan, updates)
        self.decisions: list[Decision] = []
        self._by_kind: dict[str, list[Decision]] = {k: [] for k in KINDS}
        self._costs: dict[tuple, CostModel] = {}
        self._decided = 0  # decisions made or dropped: what the memo of shares by step depends on
        self._shares: dict[tuple, object] = {}
        for d in decisions:
            self._append(d)

    @classmethod
    def from_state(cls, plan: Plan, state: dict | None) -> Timeline:
        """The timeline a snapshot recorded (:meth:`get_state`) on top of ``plan``."""
        state = state or {}
        decisions = [Decision.from_dict(d) for d in state.get("decisions", [])]
        return cls(plan, decode_updates(state.get("updates")), decisions)

    def get_state(self) -> dict:
        return {"updates": self.updates_state(), "decisions": [d.to_dict() for d in self.decisions]}

    # ---- decisions ------------------------------------------------------------------------------
    def decide(self, kind: str, at_step: int, values: dict, reason: str, state: dict | None = None) -> Decision:
        """Record a decision of ``kind`` from ``at_step`` (not before the last one of its kind)."""
        if kind not in KINDS or kind == DP:
            raise ValueError(f"decision kind must be one of {KINDS[:-1]}, got {kind!r} (a dp change: set_dp)")
        if kind == SKIP:
            until = values.get("until")
            if not isinstance(until, int) or isinstance(until, bool) or until < at_step or at_step < 0:
                raise PlanError(f"skip from step {at_step}: 'until' must be a step >= {at_step}, got {until!r}")
            d = Decision(int(at_step), kind, {"until": int(until)}, reason, len(self.versions), state)
            self._append(d)
            return d
        if kind == "weights":
            unknown = sorted(set(values) - set(self.source_names))
            if unknown:
                raise PlanError(f"mixing decision at step {at_step} names unknown sources {unknown}")
            if not all(np.isfinite(v) and v >= 0 for v in values.values()) or sum(values.values()) <= 0:
                raise PlanError(
                    f"mixing decision at step {at_step}: shares must be finite, >= 0 and not all 0 (got {values})"
                )
        prior = self._by_kind[kind]
        if prior and at_step < prior[-1].at:
            raise PlanError(f"{kind} decision at step {at_step}: the last one already applies from step {prior[-1].at}")
        d = Decision(int(at_step), kind, {k: float(v) for k, v in values.items()}, reason, len(self.versions), state)
        self._append(d)
        return d

    def set_dp(self, at_step: int, dp: int, before: int, reason: str) -> None:
        """From ``at_step`` on, ``dp`` ranks (``before``: the ranks there until now). The dp changes
        from ``at_step`` on are dropped first (a job that went back to ``at_step`` re-plans them);
        nothing is recorded when ``dp`` is what is in force there anyway."""
        if dp < 1 or at_step < 0:
            raise ValueError(f"a dp change needs dp >= 1 and a step >= 0, got dp={dp} at step {at_step}")
        self.drop([d for d in self._by_kind[DP] if d.at >= at_step])
        if dp != before:
            self._append(Decision(int(at_step), DP, {"dp": int(dp)}, reason, len(self.versions)))

    def dp_changes(self) -> list[tuple[int, int]]:
        """``(step, dp)`` of each dp change, in step order."""
        return [(d.at, int(d.values["dp"])) for d in self._by_kind[DP]]

    def dp_at(self, step: int) -> int | None:
        """The ranks a dp change set for ``step``, or None (the plan's)."""
        d = self.in_force(DP, step)  # (no plan version changes the dp: the last one at or before)
        return int(d.values["dp"]) if d is not None else None

    def settled(self, step: int) -> list[Decision]:
        """The decisions that govern no step from ``step`` on, in the order they were made: of
        each kind, those before the one in force at ``step`` (only the last one at or before a
        step can be in force there), and the skips that end before it. A planner restored or
        rewound to ``step`` or later never reads them; a replay of the whole run does."""
        out: set[int] = set()
        for kind, lst in self._by_kind.items():
            if kind == SKIP:
                out |= {id(d) for d in lst if d.values["until"] < step}
            else:
                i = bisect_right(lst, step, key=lambda d: d.at) - 1
                out |= {id(d) for d in lst[: max(i, 0)]}
        return [d for d in self.decisions if id(d) in out]

    def drop(self, decisions: list[Decision]) -> None:
        """Forget ``decisions`` (settled ones, archived elsewhere: ``settled``)."""
        gone = {id(d) for d in decisions}
        self.decisions = [d for d in self.decisions if id(d) not in gone]
        self._by_kind = {k: [d for d in lst if id(d) not in gone] for k, lst in self._by_kind.items()}
        self._costs = {}
        self._decided += 1

    def _append(self, d: Decision) -> None:
        self.decisions.append(d)
        self._by_kind[d.kind].append(d)
        self._decided += 1

    def in_force(self, kind: str, step: int) -> Decision | None:
        """The decision of ``kind`` that governs ``step``, if any (a later plan version that
        changes what it overrides ends it)."""
        lst = self._by_kind[kind]
        i = bisect_right(lst, step, key=lambda d: d.at) - 1
        if i < 0:
            return None
        d = lst[i]
        for vi in range(1, len(self.versions)):
            at = self.versions[vi][0]
            if at <= step and (at > d.at or (at == d.at and vi >= d.after)) and kind in self.changes[vi]:
                return None
        return d

    # ---- what governs a step --------------------------------------------------------------------
    def cost_at(self, step: int) -> CostModel:
        """The cost model governing ``step``: the plan's, or a learned one in force."""
        cost = self.plan_at(step).cost
        d = self.in_force("cost", step)
        if d is None:
            return cost
        key = (id(cost), d.at, len(self._by_kind["cost"]))
        if key not in self._costs:
            self._costs = {key: cost.model_copy(update={k: float(v) for k, v in d.values.items()})}
        return self._costs[key]

    def weights_in_force(self, step: int) -> np.ndarray:
        """Each source's weight at ``step`` over every source of the run: the declared weights,
        or a mixing decision's shares over the sources the declared plan has active there."""
        out = self.declared_weights(step)
        d = self.in_force("weights", step) if self.decisions else None
        if d is not None:
            mine = np.array([d.values.get(name, 0.0) for name in self.source_names]) * (out > 0)
            if mine.sum() > 0:
                out = mine / mine.sum()
        return out

    def _memo(self, what: str, step: int, make):
        """``make(step)``, remembered (read-only) for as long as the plan versions and the
        decisions stay as they are: the planner asks for a step's shares several times (per
        selection, top-up and fill, and when it records the step), and each answer walks the
        plan's stages, sources and weight functions."""
        key = (what, step, len(self.versions), self._decided)
        got = self._shares.get(key, _UNSET)
        if got is _UNSET:
            if len(self._shares) >= MEMO_STEPS:
                self._shares = {}
            got = make(step)
            if got is not None:
                got.flags.writeable = False
            self._shares[key] = got
        return got

    def class_weights_at(self, step: int) -> np.ndarray | None:
        """``[source, (short, long)]`` shares of step ``step`` in a stage with a long share, else None."""
        return self._memo("classes", step, self._class_weights_at)

    def _class_weights_at(self, step: int) -> np.ndarray | None:
        ctx = self.context_at(step)
        if ctx.long_share is None:
            return None
        w = self.weights_in_force(step)
        if ctx.long_sources:
            lw = np.array([ctx.long_sources.get(n, 0.0) for n in self.source_names])
            lw = lw * (w > 0) if (lw * (w > 0)).sum() > 0 else lw
            lw = lw / lw.sum()
        else:
            lw = w
        return np.stack([w * (1 - ctx.long_share), lw * ctx.long_share], axis=1)

    def mix_at(self, step: int) -> np.ndarray:
        """Each source's share of step ``step``'s tokens: its weight in force, or in a stage with a
        long share, ``(1 - share)·weight + share·long weight``."""
        return self._memo("mix", step, self._mix_at)

    def _mix_at(self, step: int) -> np.ndarray:
        cw = self.class_weights_at(step)
        return self.weights_in_force(step) if cw is None else cw.sum(axis=1)

    def max_mix_over(self, start: int, stop: int) -> np.ndarray:
        """Largest share of each source over steps ``[start, stop)``: the ends and every jump
        between them (shares are piecewise linear between jumps)."""
        steps = {start, max(start, stop - 1)}
        j = self.next_jump(start)
        while j is not None and j < stop:
            steps.add(j)
            j = self.next_jump(j)
        return np.max([self.mix_at(t) for t in sorted(steps)], axis=0)

    # ---- skipped steps -------------------------------------------------------------------------
    def skip_at(self, step: int) -> Decision | None:
        """The skip that covers ``step``, if any."""
        for d in self._by_kind[SKIP]:
            if d.at <= step <= d.values["until"]:
                return d
        return None

    def first_delivered(self, step: int) -> int:
        """``step``, or the first step after the skips that cover it."""
        while (d := self.skip_at(step)) is not None:
            step = d.values["until"] + 1
        return step

    def skipped_between(self, lo: int, hi: int) -> int:
        """How many steps of ``[lo, hi)`` are skipped."""
        n, end = 0, lo
        for a, b in sorted((d.at, d.values["until"] + 1) for d in self._by_kind[SKIP]):
            a, b = max(a, end), min(b, hi)
            if b > a:
                n, end = n + b - a, b
        return n

    # ---- planning windows -----------------------------------------------------------------------
    def next_jump(self, step: int) -> int | None:
        """The first step after ``step`` where the mix or context changes abruptly (a planning
        window ends there), or None. A skip is no jump: its steps are planned as they would be; nor is a dp change."""
        cands = self.declared_jumps_after(step)
        for kind, lst in self._by_kind.items():
            if kind in (SKIP, DP):  # a dp change switches mid-window, as the rewind that made it did
                continue
            i = bisect_right(lst, step, key=lambda d: d.at)
            if i < len(lst):
                cands.append(lst[i].at)
        return min(cands) if cands else None

    def window_len(self, start: int, steps: int) -> int:
        """Steps in a planning window from ``start``: ``steps``, cut at the next jump of the mix or
        context (a stage start, a source entering or leaving, a live update, a decision)."""
        j = self.next_jump(start)
        return steps if j is None else max(1, min(steps, j - start))
