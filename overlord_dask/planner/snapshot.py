"""The planner's snapshot: what ``PlannerState`` saves, and how a restore resumes from it.

The planner is a pure function of its parts' state at the start of a window and of the
(reloaded) unit lengths, so a snapshot holds only that small state (``windows.WindowStarts``),
the step the window starts at, the durable step, the topology it was planned on and the live
plan updates. A restore re-plans from the window on the snapshot's topology, hands out steps
from the durable one, and switches to the plan's topology there (``switch_topology``), so a run
may resume with another dp and keep exactly-once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import pieces as P
from ..plan.code import identities
from ..plan.loading import plan_from_dict, plan_to_dict
from ..plan.models import Plan
from ..plan.timeline import Decision

if TYPE_CHECKING:
    from .state import PlannerState

STATE_VERSION = 3  # 2: every policy's counters in every snapshot (still read)


def decode_updates(state: dict | None) -> list[tuple[int, Plan]]:
    """The live plan updates recorded in a snapshot, as ``(at_step, Plan)``."""
    if not state:
        return []
    return [
        (int(at), plan_from_dict(d, where=f"<snapshot plan update at step {at}>")) for at, d in state.get("updates", [])
    ]


def decode_decisions(state: dict | None) -> list[Decision]:
    """The planner's own decisions recorded in a snapshot (``plan/timeline.py``)."""
    return [Decision.from_dict(d) for d in (state or {}).get("decisions", [])]


def topology_dict(t) -> dict:
    """A topology as a snapshot holds it."""
    return {
        "dp": t.dp,
        "micro_batches": t.micro_batches,
        "tokens_per_micro_batch": t.tokens_per_micro_batch,
        "max_doc_tokens": t.max_doc_tokens,
        "cp": t.cp,
        "cp_min_tokens": t.cp_min_tokens,
    }


def capture(st: PlannerState) -> dict:
    """A msgpack-friendly snapshot: the parts' state at the start of the window holding the
    durable step (or the state now, if nothing was planned since), that window's first step,
    the durable step (a restore re-plans from the window and hands out steps from there), and the
    topology the window was planned on."""
    durable = st.progress.durable_step
    start = st.windows.at(durable)
    if start is None:
        start = (st.planned_until, st.windows.capture(), topology_dict(st.topology))
    return state_at(st, durable, *start)


def state_at(st: PlannerState, committed: int, window_step: int, window: dict, topology: dict) -> dict:
    """A snapshot of ``st``'s run that resumes at ``committed`` from the window at ``window_step``."""
    return {
        "version": STATE_VERSION,
        "plan": st.plan.name,
        "sources": list(st.source_names),
        "updates": [[at, plan_to_dict(p)] for at, p in st.timeline.updates],
        "decisions": [d.to_dict() for d in st.timeline.decisions],
        "committed": committed,
        "window_step": window_step,
        "window": window,
        "topology": topology,
        "code": identities(st.timeline.source(n) for n in st.source_names),
    }


def restore(st: PlannerState, state: dict) -> None:
    """Put ``st`` (new, built on the snapshot's topology) where ``state`` was taken."""
    if state.get("version") not in (2, STATE_VERSION):
        raise ValueError(f"snapshot version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
    if list(state["sources"]) != st.source_names:
        raise ValueError(
            f"snapshot sources {list(state['sources'])} differ from the plan's {st.source_names}; "
            "to add or remove sources, resume with the snapshot's plan and apply a plan update"
        )
    st.streams.set_state(state["window"])
    st.policy.set_state(state["window"], len(st.streams))
    st.reload = st.streams.passed_units(st.policy.pending)  # their blocks are gone with the process that held them
    st.next_step = int(state["window_step"])
    st.replay_until = int(state["committed"])
    st.progress.restart_at(st.replay_until)


def switch_topology(st: PlannerState) -> None:
    """After replaying the delivered steps on the snapshot's topology, continue on the plan's:
    the pieces planned but not delivered go back to the front of the queue, in order."""
    undelivered = [rows for rows, *_ in st.ready]
    if undelivered:
        st.policy.pending = np.concatenate([st.policy.pending, P.with_age(np.concatenate(undelivered))])
    st.ready.clear()
    st.use_plan(st.final_plan, acked_through=st.replay_until - 1)
