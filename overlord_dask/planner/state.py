"""The planner, free of Dask: the parts it composes, its state and how a snapshot restores it.

The scheduler side (``scheduler/``) runs this class in its planner thread and routes requests to
it, which keeps it testable without a cluster. Everything here is metadata: lengths, ids,
counters. No payload.

Parts, each owning its state (and its share of a snapshot):

- ``timeline`` (``timeline.py``): the plan's versions and the planner's decisions, the weights,
  mix, context and cost model at any step;
- ``streams`` (``streams/``): each source's order, cursor and loaded metadata;
- ``policy`` (``policies/``, chosen by ``balance.policy``): how a window is chosen and laid out
  over ranks, and the counters that carry the mix across windows;
- ``windows`` (``windows.py``): the streams' and the policy's state at each window start kept;
- ``ledger`` (``ledger.py``): planned steps, where their pieces went, their metrics;
- ``progress`` (``progress.py``): acknowledgements, committed and durable steps.

The loop (``loop.py``): ``wanted()`` names units to load, ``add_lengths()`` takes their metadata
in, ``plan_ahead()`` plans whole windows into ``ready``, ``plan_steps()`` hands steps out within
the prefetch bound (into the ledger) and names units no later step needs.

A snapshot (:meth:`PlannerState.get_state`) holds the parts' state at the start of the window
holding the durable step, that window's first step, the durable step, the topology the window
was planned on, the timeline's updates and decisions, and the identity of the sources' code. A
restore re-plans from the window on the snapshot's topology, hands out steps from the durable
one, and switches to the plan's topology there, so a run may resume with another dp and keep
exactly-once.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .. import pieces as P
from ..errors import PlanError
from ..plan import Plan
from ..plan.code import identities
from .ledger import Ledger, unpack_digests
from .loop import PlanningLoop
from .policies import POLICIES
from .progress import Progress
from .streams import StreamSet
from .timeline import Timeline, with_dp
from .windows import WindowStarts

STATE_VERSION = 3  # 2: every policy's counters in every snapshot (still read)


class PlannerState(PlanningLoop):
    def __init__(
        self,
        plan: Plan,
        unit_first_ids: dict[str, list[int]],
        *,
        history_steps: int = 100_000,
        state: dict | None = None,
        updates: list[tuple[int, Plan]] = (),
        decisions: list | None = None,
    ):
        recorded = Timeline.from_state(plan, state)
        self.timeline = Timeline(
            plan, list(updates) or recorded.updates, recorded.decisions if decisions is None else decisions
        )
        dp = self.timeline.dp_at(int(state["committed"]) if state is not None else 0)
        if dp is not None:  # a job came back with another dp (timeline.py)
            plan = with_dp(plan, dp)
        self.final_plan = plan
        if state is not None:  # replay on the topology the snapshot was planned with, switch at `committed`
            plan = plan.model_copy(update={"topology": plan.topology.model_copy(update=state["topology"])})
        first = self.timeline.initial
        evict_after, loading = first.loading.units_ahead + 2, first.loading
        # a run keeps the warm-up it started with: its snapshot's (none in one from before the setting)
        warmup = loading.shuffle_warmup_units if state is None else int(state["window"].get("shuffle_warmup_units", 0))
        self.streams = StreamSet(first.seed, first.topology.piece_tokens, evict_after, loading.shuffle_units, warmup)
        for name in self.timeline.source_names:
            self.streams.add(name, unit_first_ids[name])
        self.balance = plan.balance
        self.policy = POLICIES[plan.balance.policy](len(self.streams))
        self.ledger = Ledger(history_steps)
        self.use_plan(plan)
        self.next_step = 0
        self.failure: str | None = None
        self.starved_on: str | None = None
        self._starved: tuple | None = None  # (source, what planning saw) when a window last starved
        self.ready: deque = (
            deque()
        )  # planned steps not yet handed out: (rows, slot, bin costs, drops or None, loss tokens, units)
        self._units_of: tuple = (None, None)  # (the carried pieces, their units): PlanningLoop._pending_units
        self.plan_seconds: list[float] = []  # wall time of each planning call that produced steps
        self.windows = WindowStarts(lambda: {**self.streams.get_state(), **self.policy.get_state()})
        self.pool_workers: dict[str, int] = {}  # workers per loader pool, as the autoscaler last reported
        self.replay_until = 0  # steps below this were delivered before a restore: re-planned, not handed out
        self.replay_from = 0  # the window step a restore re-plans from
        self.replay_digests: dict[int, int] = {}  # step -> its digest when handed out (checked as re-planned)
        self.replay_accepts_change = False  # the start accepted changed data or code: a differing replay goes on
        self.tokens_committed = 0  # real tokens of the steps every rank consumed, since this planner started
        self.reload: list[list] = []  # units to load again only for their blocks (restore)
        if state is not None:
            self._restore(state)

    def use_plan(self, plan: Plan, acked_through: int = -1) -> None:
        """Adopt a plan's topology and the budgets derived from it; every (rank, cp rank) has
        consumed (and saved) the steps up to ``acked_through``."""
        self.plan = plan
        self.topology = plan.topology
        self.step_budget = int(plan.balance.step_fill * plan.topology.step_tokens)
        self.heavy_tokens = plan.balance.heavy_tokens or max(1, plan.topology.tokens_per_micro_batch // 16)
        self.progress = Progress(plan.checkpoint.commit, plan.topology.dp, plan.topology.cp, acked_through)

    # ---- views --------------------------------------------------------------------------------
    @property
    def source_names(self) -> list[str]:
        return self.streams.names

    @property
    def metrics(self) -> dict[int, dict]:
        """The ledger's figures of each planned step kept."""
        return self.ledger.metrics

    @property
    def pending(self) -> np.ndarray:
        """Pieces selected but waiting for a later window (rows with ``AGE``)."""
        return self.policy.pending

    @property
    def committed(self) -> int:
        return self.progress.committed

    @property
    def planned_until(self) -> int:
        """The first step whose pieces are not chosen yet (where the next window starts)."""
        return self.next_step + len(self.ready)

    @property
    def handed_out(self) -> int:
        """The first step not handed out yet, by this planner or, before a restore, by the one
        it was restored from (a restored planner replays up to ``replay_until``: the steps before
        it reached the trainers already, and their acknowledgements count while it catches up)."""
        return max(self.next_step, self.replay_until)

    @property
    def frontier(self) -> int:
        """The first step not planned yet: the earliest an update can apply from."""
        return max(self.planned_until, self.replay_until)

    @property
    def plan_version(self) -> int:
        return len(self.timeline.versions) - 1

    # ---- live plan updates ----------------------------------------------------------------------
    def update(self, plan: Plan, at_step: int | None, unit_first_ids: dict[str, list[int]]) -> int:
        """Apply ``plan`` from ``at_step`` (default: the first step not planned yet). New sources
        need their units' first ids. Returns the step the update applies from."""
        frontier = self.frontier
        at_step = frontier if at_step is None else int(at_step)
        if at_step < frontier:
            raise PlanError(
                f"plan update at step {at_step}: steps up to {frontier - 1} are already planned; "
                f"the earliest step an update can apply from is {frontier} (or pass at_step=None)"
            )
        missing = [s.name for s in plan.sources if s.name not in self.source_names and s.name not in unit_first_ids]
        if missing:
            raise PlanError(f"plan update at step {at_step}: new sources {missing} were not indexed")
        for name in self.timeline.add(plan, at_step):
            self.streams.add(name, unit_first_ids[name])
        self.policy.grow(len(self.streams))
        return at_step

    # ---- loading ------------------------------------------------------------------------------
    def wanted(self) -> list[list]:
        """Units whose metadata (or, after a restore, blocks) the planner needs next: [source,
        epoch, unit] each."""
        reload, self.reload = self.reload, []
        steps, units_ahead = self._window_steps(), self.plan.loading.units_ahead
        ahead = self.streams.wanted(self._mix_ahead(), self.topology.step_tokens, steps, units_ahead, self.starved_on)
        return reload + ahead

    def _mix_ahead(self) -> np.ndarray:
        """Largest share of each source over the next two windows (so a source that enters at a
        coming step is loaded before it is needed)."""
        t0 = self.planned_until
        return self.timeline.max_mix_over(t0, t0 + 2 * self._window_steps() + 1)

    def add_lengths(
        self,
        source: str,
        epoch: int,
        unit: int,
        lengths: np.ndarray,
        vision: np.ndarray | None = None,
        masked: np.ndarray | None = None,
    ) -> bool:
        """A loaded unit's document lengths (image tokens per document, masked runs); False if not
        needed (a duplicate, or a unit planning has passed). Checks, once a whole pass of the
        source has arrived, that it is not far smaller than what a window takes from it."""
        s = self.streams.by_name(source)
        before = s.loads.tokens_per_pass()
        added = s.add_lengths(epoch, unit, lengths, vision)
        if added or (s.index, epoch, unit) in self.streams.held:  # (a passed unit loaded again for its block)
            self.streams.targets.keep_lengths((s.index, epoch, unit), lengths, masked)
        if before is None and s.loads.tokens_per_pass() is not None:
            share = float(self._mix_ahead()[s.index])
            mb_tokens = self.topology.tokens_per_micro_batch
            self.streams.check_pass(s, share, self.step_budget, self._window_steps(), mb_tokens)
        return added

    # ---- state ----------------------------------------------------------------------------------
    def get_state(self) -> dict:
        """A msgpack-friendly snapshot: the state at the start of the window holding the durable
        step (or the state now, if nothing was planned since), for a restore to re-plan from."""
        durable = self.progress.durable_step
        start = self.windows.at(durable)
        if start is None:
            start = (self.planned_until, self.windows.capture(), self.topology.model_dump())
        return self.state_at(durable, *start)

    def state_at(self, committed: int, window_step: int, window: dict, topology: dict) -> dict:
        """A snapshot of this run that resumes at ``committed`` from the window at ``window_step``."""
        return {
            "version": STATE_VERSION,
            "plan": self.plan.name,
            "sources": list(self.source_names),
            **self.timeline.get_state(),
            "committed": committed,
            "window_step": window_step,
            "window": window,
            "topology": topology,
            "code": identities(self.timeline.sources()),
            "digests": self.ledger.packed_digests(window_step, committed),  # the steps a restore re-plans
        }

    def _restore(self, state: dict) -> None:
        """Put this planner (new, built on the snapshot's topology) where ``state`` was taken."""
        if state.get("version") not in (2, STATE_VERSION):
            raise ValueError(f"snapshot version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
        if list(state["sources"]) != self.source_names:
            raise ValueError(
                f"snapshot sources {list(state['sources'])} differ from the plan's {self.source_names}; "
                "to add or remove sources, resume with the snapshot's plan and apply a plan update"
            )
        self.streams.set_state(state["window"])
        self.policy.set_state(state["window"], len(self.streams))
        self.reload = self.streams.passed_units(self.policy.pending)  # their blocks are gone with the old process
        self.next_step = int(state["window_step"])
        # the window it restores from is a start a rewind can go back to at once, before the
        # window is planned again (its units may take a while to load again)
        self.windows.restored(self.next_step, state["window"], state["topology"])
        self.replay_until = int(state["committed"])
        self.replay_from = self.next_step
        digests = unpack_digests(state.get("digests"))  # (none in a snapshot older than them: unchecked)
        self.replay_digests = {s: d for s, d in digests.items() if self.next_step <= s < self.replay_until}
        self.replay_accepts_change = bool(state.get("accepted_change"))  # (checkpoint.on_*_change: accept)
        self.progress.restart_at(self.replay_until)

    def switch_topology(self) -> None:
        """After replaying the delivered steps on the snapshot's topology, continue on the plan's:
        the pieces planned but not delivered go back to the front of the queue, in order."""
        undelivered = [rows for rows, *_ in self.ready]
        if undelivered:
            self.policy.pending = np.concatenate([self.policy.pending, P.with_age(np.concatenate(undelivered))])
        self.ready.clear()
        self.use_plan(self.final_plan, acked_through=self.replay_until - 1)

    # ---- acknowledgements and status ------------------------------------------------------------
    def ack(
        self, rank: int, step: int, cp_rank: int = 0, durable: bool = False, saved: int = -1, checked: bool = False
    ) -> int:
        """(``rank``, ``cp_rank``) consumed every step up to ``step`` (and, if ``durable``, saved
        them in its trainer checkpoint; else those up to ``saved``, if that is a step);
        idempotent (``checked``: ``Progress.check`` passed already). Returns ``committed``."""
        before = self.progress.committed
        committed = self.progress.ack(
            rank, step, cp_rank, durable, planned=self.handed_out, saved=saved, checked=checked
        )
        for s in range(before, committed):  # a counter since this planner started (rewinds count again)
            m = self.metrics.get(s)
            self.tokens_committed += m["tokens"] if m is not None else 0
        return committed

    def status(self) -> dict:
        return {
            "next_step": self.next_step,
            "committed": self.committed,
            "durable": self.progress.durable_step,
            "tokens_committed": self.tokens_committed,
            "acked": list(self.progress.acked),
            "failure": self.failure,
            "starved_on": self.starved_on,
            "plan_version": self.plan_version,
            "frontier": self.frontier,
            **self.streams.status(),
        }
