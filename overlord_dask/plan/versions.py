"""The declared versions of a running plan: the initial plan, then each live update from the step
it applies.

``service.update_plan(new_plan, at_step=N)`` does not edit the running plan; it appends a version
that governs steps ``N`` onward. What a run declares is then a pure function of (initial plan,
the list of ``(at_step, plan)`` updates), which is what snapshots store and what a replay needs.

Sources keep a stable index in the order they first appear in any version (the ledger and the
batches name sources by this index). A source that a later version leaves out is paused (weight 0),
not forgotten: its position is kept and a version that names it again continues where it stopped.
Schedules in every version count global steps (a ramp ``[[500, 0], [600, 0.3]]`` in an update
applied at step 450 starts moving at step 500).

What the planner decides on its own at run time (a mixing controller's shares, a learned cost
model) is not declared: it lives with the planner (``planner/timeline.py``), on top of these
versions.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import PlanError
from .base import resolve_url
from .io import plan_from_dict, plan_to_dict
from .plan import Plan
from .schedule import Context
from .source import Source

# what an update may change; everything else is fixed for the run
MUTABLE = ("sources", "stages", "steps", "name", "base_dir", "cost")
OVERRIDES = ("weights", "cost")  # what a version may change that a planner's decision also sets


def _data_key(source: Source, base_dir: str | None) -> tuple:
    """A source's data identity with a relative URL resolved against its plan's folder."""
    url = resolve_url(source.url, base_dir)
    if "://" not in url:
        url = os.path.normpath(url)
    return (source.format, url) + source.data_key[2:]


def fixed_changes(current: Plan, new: Plan) -> list[str]:
    """The fields ``new`` changes that an update may not change (empty: ``new`` may replace ``current``)."""
    return [f for f in type(current).model_fields if f not in MUTABLE and getattr(current, f) != getattr(new, f)]


def check_update(current: Plan, new: Plan, at_step: int) -> None:
    """Raise PlanError unless ``new`` may replace ``current`` from ``at_step``."""
    fixed = fixed_changes(current, new)
    if fixed:
        raise PlanError(
            f"plan update at step {at_step}: {fixed[0]!r} differs from the running plan; an update may "
            f"change only {', '.join(MUTABLE)} (start a new run to change {fixed[0]!r})"
        )


class PlanVersions:
    """The run's declared plans by step, and the sources of all of them by stable index."""

    def __init__(self, plan: Plan, updates: list[tuple[int, Plan]] = ()):
        self.versions: list[tuple[int, Plan]] = [(0, plan)]
        self.source_names: list[str] = []
        self._sources: dict[str, Source] = {}
        self._keys: dict[str, tuple] = {}
        self.changes: list[set[str]] = [set(OVERRIDES)]  # per version, which of OVERRIDES it changes
        self._register(plan)
        for at_step, new in updates:  # recorded ones: on this plan's topology (a rewind or a restart may change dp)
            same = new.topology == plan.topology
            self.add(new if same else new.model_copy(update={"topology": plan.topology}), at_step)

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
        self.changes.append(changes | ({"cost"} if plan.cost != last.cost else set()))
        self.versions.append((at_step, plan))
        return new

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

    def sources(self) -> list[Source]:
        """Every source of the run, by stable index (each as the newest version declaring it has it)."""
        return [self._sources[n] for n in self.source_names]

    def declared_weights(self, step: int) -> np.ndarray:
        """The declared weights at ``step``, normalised, over every source of the run (0 for
        sources the version in force does not name)."""
        w = self.plan_at(step).declared_weights(step)
        return np.array([w.get(name, 0.0) for name in self.source_names], dtype=np.float64)

    def context_at(self, step: int) -> Context:
        return self.plan_at(step).context_at(step)

    def declared_jumps_after(self, step: int) -> list[int]:
        """Steps after ``step`` where the declared mix or context changes abruptly: a version
        starts, a stage starts, a source enters or leaves (of the version in force at ``step``)."""
        return [at for at, _ in self.versions[1:] if at > step] + [j for j in self.plan_at(step).jumps() if j > step]

    # ---- state --------------------------------------------------------------------------------------
    def updates_state(self) -> list[list]:
        """The live updates as a snapshot holds them (``[at_step, plan dict]`` each)."""
        return [[at, plan_to_dict(p)] for at, p in self.updates]


def decode_updates(items: list | None) -> list[tuple[int, Plan]]:
    """The live plan updates a snapshot recorded (:meth:`PlanVersions.updates_state`), as ``(at_step, Plan)``."""
    return [(int(at), plan_from_dict(d, where=f"<snapshot plan update at step {at}>")) for at, d in items or []]
