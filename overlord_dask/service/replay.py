"""A run's stream planned again offline, from its plan and its recorded timeline.

The stream is a pure function of the plan, its live updates and the planner's own decisions (a
learned cost model, a mixing controller's shares: ``planner/timeline.py``), so replaying them gives
the same pieces in the same places, step for step. Use it to check a run (a controller's run is
reproducible without the trainers that drove it), or to look at what a run with the same
decisions would deliver::

    tl = service.timeline()                    # versions and decisions of a running service
    ledger = replay(plan, tl, steps=500)       # {step: {"pieces", "slot"}}, read on this machine

A training job that came back with another dp is in the timeline (a ``dp`` change): the replay
switches there as the service did.

The units are read here, in this process (``read_unit``, as a worker would), so the sources must
be reachable from it; only their lengths are kept.
"""

from __future__ import annotations

from ..plan import Plan
from ..planner.state import STATE_VERSION, PlannerState
from ..planner.timeline import Timeline, with_dp
from ..sources import read_unit
from . import holdout
from .indexing import index_timeline


def replay(
    plan: Plan,
    timeline: Timeline | None = None,
    steps: int = 100,
    *,
    start: tuple[int, dict, dict] | None = None,
    units: dict | None = None,
) -> dict[int, dict]:
    """Plan steps ``[0, steps)`` of ``plan`` with ``timeline``'s updates and decisions (default:
    none); returns ``{step: {"pieces": int64 rows, "slot": int32 [rank, micro_batch],
    "sample_ids": each piece's document id}}``. With ``start`` (``(window step, window state,
    topology)``: a window start a snapshot kept, ``SnapshotStore.window_at``), planning starts
    there, on that window's topology, and the steps from it on are returned. ``units``: the
    sources' training units, if the caller has them indexed already."""
    timeline = timeline or Timeline(plan)
    units = units or training_units(plan, timeline)
    first_ids = {name: [u.first_id for u in us] for name, us in units.items()}
    state, first = None, 0
    if start is not None:
        first, window, topology = start
        plan = plan.model_copy(update={"topology": plan.topology.model_copy(update=topology)})
        state = {
            "version": STATE_VERSION,
            "sources": list(timeline.source_names),
            "committed": first,
            "window_step": first,
            "window": window,
            "topology": topology,
        }
    st = PlannerState(plan, first_ids, state=state, updates=timeline.updates, decisions=timeline.decisions)
    switches = [(at, dp) for at, dp in timeline.dp_changes() if at > first]  # (as the rewinds made them)
    read: dict[tuple[str, int], tuple] = {}
    while st.next_step < steps:
        if switches and st.next_step == switches[0][0]:
            at, dp = switches.pop(0)  # the job came back here with dp ranks: switch mid-window
            st.final_plan, st.replay_until = with_dp(st.final_plan, dp), at
        wanted = st.wanted()  # (asking marks them requested: ask once per round)
        for name, epoch, unit in wanted:
            if (name, unit) not in read:
                u = units[name][unit]
                source = st.timeline.source(name)
                block = read_unit(source, st.timeline.plan_at(st.planned_until), u).block
                read[(name, unit)] = (block.lengths(), block.vision_tokens(), block.masked_runs())
            lens, vision, masked = read[(name, unit)]
            st.add_lengths(name, epoch, unit, lens, vision, masked)
        planned, _ = st.plan_steps(min(steps, switches[0][0] if switches else steps) - st.next_step)
        if not planned and not wanted:
            raise RuntimeError(f"replay stalled at step {st.next_step} (starved on {st.starved_on!r})")
        for p in planned:
            for r in range(st.topology.dp):
                for c in range(st.topology.cp):
                    st.ack(r, p["step"], c)
    return {
        s: {
            "pieces": st.ledger[s]["pieces"],
            "slot": st.ledger[s]["slot"],
            "sample_ids": st.streams.sample_ids(st.ledger[s]["pieces"]),
        }
        for s in range(first, steps)
    }


def training_units(plan: Plan, timeline: Timeline) -> dict:
    """Each source's units that reach training (held-out ones left out), indexed from metadata."""
    return holdout.training(plan.seed, timeline.source, index_timeline(timeline))
