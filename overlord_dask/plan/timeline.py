"""The versions of a running plan: the initial plan, then each live update from the step it applies.

``service.update_plan(new_plan, at_step=N)`` does not edit the running plan; it appends a version
that governs steps ``N`` onward. The stream is then a pure function of (initial plan, the list of
``(at_step, plan)`` updates), which is what snapshots store and what a replay needs: applying the
same updates at the same steps gives the same stream.

Sources keep a stable index in the order they first appear in any version (the ledger and the
batches name sources by this index). A source that a later version leaves out is paused (weight 0),
not forgotten: its position is kept and a version that names it again continues where it stopped.
Schedules in every version count global steps (a ramp ``[[500, 0], [600, 0.3]]`` in an update
applied at step 450 starts moving at step 500).

The planner's own **decisions** (``plan/feedback.py``: a mixing controller's shares, a learned
cost model) are recorded here the same way, each from the step it applies: the stream is a pure
function of (plan, updates, decisions). A decision stays in force until the next one of its kind,
or until a plan version that changes what it overrides (the sources or stages for the mix, the
cost model for a learned cost) starts after it.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from .base import resolve_url
from .models import CostModel, Plan, Source
from .schedule import Context

# what an update may change; everything else is fixed for the run
MUTABLE = ("sources", "stages", "steps", "name", "base_dir", "cost")


def _data_key(source: Source, base_dir: str | None) -> tuple:
    """A source's data identity with a relative URL resolved against its plan's folder."""
    url = resolve_url(source.url, base_dir)
    if "://" not in url:
        url = os.path.normpath(url)
    return (source.format, url) + source.data_key[2:]


def check_update(current: Plan, new: Plan, at_step: int) -> None:
    """Raise PlanError unless ``new`` may replace ``current`` from ``at_step``."""
    for field in type(current).model_fields:
        if field in MUTABLE:
            continue
        if getattr(current, field) != getattr(new, field):
            raise PlanError(
                f"plan update at step {at_step}: {field!r} differs from the running plan; an update may "
                f"change only {', '.join(MUTABLE)} (start a new run to change {field!r})"
            )


KINDS = ("weights", "cost")  # what a decision sets: the mix (shares by source name), the cost model's coefficients


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


class PlanTimeline:
    def __init__(self, plan: Plan, updates: list[tuple[int, Plan]] = (), decisions: list[Decision] = ()):
        self.versions: list[tuple[int, Plan]] = [(0, plan)]
        self.source_names: list[str] = []
        self._sources: dict[str, Source] = {}
        self._keys: dict[str, tuple] = {}
        self._changes: list[set[str]] = [set(KINDS)]  # per version, the kinds of decision it overrides
        self.decisions: list[Decision] = []
        self._by_kind: dict[str, list[Decision]] = {k: [] for k in KINDS}
        self._costs: dict[tuple, CostModel] = {}
        self._register(plan)
        for at_step, new in updates:
            self.add(new, at_step)
        for d in decisions:
            self._append(d)

    def _register(self, plan: Plan) -> list[str]:
        new = []
        for s in plan.sources:
            old = self._sources.get(s.name)
            key = _data_key(s, plan.base_dir)
            if old is not None and self._keys[s.name] != key:
                raise PlanError(
                    f"plan update: source {s.name!r} changes its data ({old.url!r} -> {s.url!r}, or its fields); "
                    "positions refer to its files, so give changed data a new source name"
                )
            if old is None:
                self.source_names.append(s.name)
                new.append(s.name)
            self._sources[s.name] = s
            self._keys[s.name] = key
        return new

    def add(self, plan: Plan, at_step: int) -> list[str]:
        """Append a version from ``at_step`` (after the last one); returns the names of new sources."""
        last_step, last = self.versions[-1]
        if at_step <= last_step and len(self.versions) > 1 or at_step < last_step:
            raise PlanError(f"plan update at step {at_step}: the last update already applies from step {last_step}")
        check_update(last, plan, at_step)
        mine = {st.long_tokens for st in plan.stages if st.long_tokens is not None}
        ours = {st.long_tokens for _, p in self.versions for st in p.stages if st.long_tokens is not None}
        if mine and ours and mine != ours:
            raise PlanError(
                f"plan update at step {at_step}: long_tokens {sorted(mine)} differs from the run's {sorted(ours)}; "
                "documents are classified once per run"
            )
        try:
            plan.check_weights(start=at_step)
        except ValueError as err:
            raise PlanError(f"plan update at step {at_step}: {err}") from None
        new = self._register(plan)
        changes = {"weights"} if (plan.sources, plan.stages) != (last.sources, last.stages) else set()
        self._changes.append(changes | ({"cost"} if plan.cost != last.cost else set()))
        self.versions.append((at_step, plan))
        return new

    # ---- the planner's decisions --------------------------------------------------------------
    def decide(self, kind: str, at_step: int, values: dict, reason: str, state: dict | None = None) -> Decision:
        """Record a decision of ``kind`` from ``at_step`` (not before the last one of its kind)."""
        if kind not in KINDS:
            raise ValueError(f"decision kind must be one of {KINDS}, got {kind!r}")
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

    def _append(self, d: Decision) -> None:
        self.decisions.append(d)
        self._by_kind[d.kind].append(d)

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
            if at <= step and (at > d.at or (at == d.at and vi >= d.after)) and kind in self._changes[vi]:
                return None
        return d

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

    # ---- queries by step ------------------------------------------------------------------------
    @property
    def initial(self) -> Plan:
        return self.versions[0][1]

    @property
    def latest(self) -> Plan:
        return self.versions[-1][1]

    @property
    def updates(self) -> list[tuple[int, Plan]]:
        return self.versions[1:]

    def version_at(self, step: int) -> int:
        v = 0
        for i, (at, _) in enumerate(self.versions):
            if at <= step:
                v = i
        return v

    def plan_at(self, step: int) -> Plan:
        return self.versions[self.version_at(step)][1]

    def source(self, name: str) -> Source:
        return self._sources[name]

    def weights_at(self, step: int) -> np.ndarray:
        """Normalised weights at ``step`` over every source of the run (0 for sources the version
        in force does not name)."""
        w = self.plan_at(step).weights_at(step)
        out = np.array([w.get(name, 0.0) for name in self.source_names], dtype=np.float64)
        d = self.in_force("weights", step) if self.decisions else None
        if d is not None:  # the controller's shares, over the sources the declared plan has active here
            mine = np.array([d.values.get(name, 0.0) for name in self.source_names]) * (out > 0)
            if mine.sum() > 0:
                out = mine / mine.sum()
        return out

    def context_at(self, step: int) -> Context:
        return self.plan_at(step).context_at(step)

    def next_jump(self, step: int) -> int | None:
        """The first step after ``step`` where the mix or context changes abruptly (a planning
        window ends there), or None."""
        cands = [at for at, _ in self.versions[1:] if at > step]
        cands += [j for j in self.plan_at(step).jumps() if j > step]
        for lst in self._by_kind.values():
            i = bisect_right(lst, step, key=lambda d: d.at)
            if i < len(lst):
                cands.append(lst[i].at)
        return min(cands) if cands else None

    def window_len(self, start: int, steps: int) -> int:
        """Steps in a planning window from ``start``: ``steps``, cut at the next jump of the mix or
        context (a stage start, a source entering or leaving, a live update)."""
        j = self.next_jump(start)
        return steps if j is None else max(1, min(steps, j - start))

    def class_weights_at(self, step: int) -> np.ndarray | None:
        """``[source, (short, long)]`` shares of step ``step`` in a stage with a long share, else None."""
        ctx = self.context_at(step)
        if ctx.long_share is None:
            return None
        w = self.weights_at(step)
        if ctx.long_sources:
            lw = np.array([ctx.long_sources.get(n, 0.0) for n in self.source_names])
            lw = lw * (w > 0) if (lw * (w > 0)).sum() > 0 else lw
            lw = lw / lw.sum()
        else:
            lw = w
        return np.stack([w * (1 - ctx.long_share), lw * ctx.long_share], axis=1)

    def mix_at(self, step: int) -> np.ndarray:
        """Each source's share of step ``step``'s tokens: its weight, or in a stage with a long
        share, ``(1 - share)·weight + share·long weight``."""
        cw = self.class_weights_at(step)
        return self.weights_at(step) if cw is None else cw.sum(axis=1)

    def max_mix_over(self, start: int, stop: int) -> np.ndarray:
        """Largest share of each source over steps ``[start, stop)``: the ends and every jump
        between them (shares are piecewise linear between jumps)."""
        steps = {start, max(start, stop - 1)}
        j = self.next_jump(start)
        while j is not None and j < stop:
            steps.add(j)
            j = self.next_jump(j)
        return np.max([self.mix_at(t) for t in sorted(steps)], axis=0)
