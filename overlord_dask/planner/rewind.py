"""Rewinding the planner: a training job restarts from a checkpoint older than what the service
has handed out, while the service runs on, with the same or another number of ranks.

The planner is a pure function of its parts' state at a window start and of the unit lengths,
so the planner at any kept window start (``windows.WindowStarts``, or a snapshot in storage)
re-plans the same steps again: a new ``PlannerState`` is restored from that window, replays
silently up to the job's step, and hands out from there; with another ``dp`` it switches to it
at that step, as a restore with another topology does (``PlannerState.switch_topology``). Per-source
positions are topology-free, so exactly-once holds either way, and with the same ``dp`` the
steps come out token-identical to the first time.
"""

from __future__ import annotations

from .state import PlannerState
from .timeline import Timeline, with_dp


def rebuild_at(st: PlannerState, step: int, source: tuple[int, dict, dict], dp: int | None = None) -> PlannerState:
    """A planner that hands out ``step`` next, restored from ``source`` (``(window step, state,
    topology)`` at or before ``step``) with ``st``'s plan versions, for ``dp`` ranks (default:
    as now). The ledger's history and the window starts before ``step`` carry over, so the
    views stay continuous and a later rewind can go back as far as this one could."""
    window_step, window, topology = source
    if window_step > step:
        raise ValueError(f"cannot rebuild step {step} from the window at step {window_step}")
    dp = dp or st.final_plan.topology.dp
    plan = with_dp(st.final_plan, dp)
    timeline = Timeline(st.final_plan, st.timeline.updates, st.timeline.decisions)
    # the dp change is part of the run's record: a replay and a restarted service switch there too
    # (the window's topology is the one in force at `step`: a rewind starts a new window)
    timeline.set_dp(step, dp, topology["dp"], "a training job restarted from its checkpoint with this dp")
    state = st.state_at(step, window_step, window, topology)
    first_ids = {s.name: s.first_ids for s in st.streams}
    new = PlannerState(
        plan,
        first_ids,
        history_steps=st.ledger.history_steps,
        state=state,
        updates=st.timeline.updates,
        decisions=timeline.decisions,
    )
    new.ledger.keep_before(step, st.ledger)
    new.windows.keep_before(window_step, st.windows)
    new.pool_workers = dict(st.pool_workers)
    return new


def memory_source(st: PlannerState, step: int) -> tuple[int, dict, dict] | None:
    """The newest window start kept in memory at or before ``step``."""
    return st.windows.at(step)
