"""The planner, free of Dask: it composes the parts and runs the planning loop.

The scheduler side (``scheduler/``) runs this class in its planner thread and routes requests to
it, which keeps it testable without a cluster. Everything here is metadata: lengths, ids,
counters. No payload.

Parts, each owning its state (and its share of a snapshot):

- ``timeline`` (``plan/timeline.py``): the plan's versions, weights and context at any step;
- ``streams`` (``streams/``): each source's order, cursor and loaded metadata;
- ``policy`` (``policies/``, chosen by ``balance.policy``): how a window is chosen and laid out
  over ranks, and the counters that carry the mix across windows;
- ``ledger`` (``ledger.py``): planned steps, where their pieces went, their metrics;
- ``progress`` (``progress.py``): acknowledgements, committed and durable steps.

The loop: ``wanted()`` names units to load, ``add_lengths()`` takes their metadata in,
``plan_ahead()`` plans whole windows into ``ready``, ``plan_steps()`` hands steps out within the
prefetch bound (into the ledger) and names units no later step needs. ``snapshot.py`` captures
and restores its state.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

import numpy as np

from .. import pieces as P
from ..errors import PlanError
from ..plan.models import Plan
from ..plan.timeline import PlanTimeline
from . import snapshot
from .ledger import Ledger, step_metrics
from .policies import POLICIES, Starved, Window
from .progress import Progress
from .snapshot import decode_decisions, decode_updates
from .streams import StreamSet
from .windows import WindowStarts


class PlannerState:
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
        self.final_plan = plan
        self.timeline = PlanTimeline(
            plan, list(updates) or decode_updates(state), decode_decisions(state) if decisions is None else decisions
        )
        if state is not None:  # replay on the topology the snapshot was planned with, switch at `committed`
            plan = plan.model_copy(update={"topology": plan.topology.model_copy(update=state["topology"])})
        first = self.timeline.initial
        self.streams = StreamSet(first.seed, first.topology.piece_tokens, evict_after=first.loading.units_ahead + 2)
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
        self.ready: deque = deque()  # planned steps not yet handed out: (ranks, bin_costs, drops or None)
        self.plan_seconds: list[float] = []  # wall time of each planning call that produced steps
        self.windows = WindowStarts(lambda: {**self.streams.get_state(), **self.policy.get_state()})
        self.pool_workers: dict[
            str, int
        ] = {}  # workers per loader pool, as the autoscaler last reported (metrics only)
        self.replay_until = 0  # steps below this were delivered before a restore: re-planned, not handed out
        self.reload: list[list] = []  # units to load again only for their blocks (snapshot.restore)
        if state is not None:
            snapshot.restore(self, state)

    def use_plan(self, plan: Plan, acked_through: int = -1) -> None:
        """Adopt a plan's topology and the budgets derived from it; every (rank, cp rank) has
        consumed (and saved) the steps up to ``acked_through``."""
        self.plan = plan
        self.topology = plan.topology
        self.step_budget = int(plan.balance.fill * plan.topology.step_tokens)
        self.heavy_tokens = plan.balance.heavy_tokens or max(1, plan.topology.tokens_per_micro_batch // 16)
        self.progress = Progress(plan.checkpoint.commit, plan.topology.dp, plan.topology.cp, acked_through)

    # ---- views --------------------------------------------------------------------------------
    @property
    def source_names(self) -> list[str]:
        return self.streams.names

    @property
    def metrics(self) -> OrderedDict:
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
    def frontier(self) -> int:
        """The first step not planned yet: the earliest an update can apply from."""
        return max(self.planned_until, self.replay_until)

    @property
    def plan_version(self) -> int:
        return len(self.timeline.versions) - 1

    def weights_at(self, step: int) -> np.ndarray:
        return self.timeline.mix_at(step)

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
        return reload + self.streams.wanted(
            self._weights_ahead(),
            self.topology.step_tokens,
            self._window_steps(),
            self.plan.loading.units_ahead,
            self.starved_on,
        )

    def _window_steps(self) -> int:
        return self.policy.window_steps(self.balance)

    def _weights_ahead(self) -> np.ndarray:
        """Largest weight of each source over the next two windows (so a source that enters at a
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
        """A loaded unit's document lengths (image tokens per document, masked runs); False if not needed
        (a duplicate, or a unit planning has passed). Checks, once a whole pass of the source has
        arrived, that it is not far smaller than what a window takes from it."""
        s = self.streams.by_name(source)
        before = s.loads.tokens_per_pass()
        added = s.add_lengths(epoch, unit, lengths, vision)
        if added or (s.index, epoch, unit) in self.streams.held:  # (a passed unit loaded again for its block)
            self.streams.keep_lengths((s.index, epoch, unit), lengths, masked)
        if before is None and s.loads.tokens_per_pass() is not None:
            self.streams.check_pass(
                s,
                float(self._weights_ahead()[s.index]),
                self.step_budget,
                self._window_steps(),
                self.topology.tokens_per_micro_batch,
            )
        return added

    def costs(self, rows: np.ndarray, step: int) -> np.ndarray:
        """Cost of planned piece rows at ``step`` (backbone tokens and, with an encoder cost, image
        tokens), by the cost model in force there (declared, or learned: ``timeline.cost_at``)."""
        return self.streams.costs(rows, self.timeline.cost_at(step))

    # ---- planning -----------------------------------------------------------------------------
    def can_plan(self) -> bool:
        return self.next_step - self.committed < self.plan.loading.prefetch_steps

    def plan_steps(self, max_steps: int) -> tuple[list[dict], list[list]]:
        """Plan as many steps as the bounds and loaded metadata allow.

        Returns (steps, finished_units): each step is ``{"step", "pieces", "slot"}`` where
        ``pieces`` is little-endian int64 bytes of piece rows (``pieces.py``) and ``slot`` int32
        bytes of ``[rank, micro_batch]`` per row (compact for the RPC: no Python object per
        piece); finished units are ``[source, epoch, unit]`` whose blocks no later step needs.
        """
        steps = []
        t0 = time.perf_counter()
        while len(steps) < max_steps and self.can_plan():
            if self.next_step == self.replay_until and self.final_plan.topology != self.topology:
                snapshot.switch_topology(self)
            try:
                rows, slot, mb_costs, drops = self._next_planned()
            except Starved as e:
                self.starved_on = e.source
                break
            self.starved_on = None
            step = self.next_step
            self.next_step += 1
            if step < self.replay_until:
                continue  # delivered before the restore: only the planner state had to catch up
            entry = self._record(step, rows, slot, mb_costs, drops)
            steps.append(
                {
                    "step": step,
                    "pieces": P.to_bytes(entry["pieces"]),
                    "slot": P.to_bytes(entry["slot"], "<i4"),
                    "piece_tokens": self.metrics[step]["piece_tokens"],
                    "loss_tokens": self.metrics[step]["loss_tokens"],
                }
            )
        if steps:
            self.plan_seconds.append(time.perf_counter() - t0)
            del self.plan_seconds[:-10_000]
        in_use = [self.pending] + [rows for rows, *_ in self.ready]
        return steps, self.streams.finished_units(in_use)

    def _next_planned(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The next step's pieces as int64 rows with their int32 ``[rank, micro_batch]``, the
        bins' costs, and (on a window's first step) the documents a drop policy skipped while
        planning the window."""
        if not self.ready:
            self._plan_next_window()
        return self.ready.popleft()

    def _plan_next_window(self) -> None:
        """Plan the window that starts at ``planned_until`` into ``ready``; its state beforehand
        is kept for snapshots (``windows``)."""
        start = self.planned_until
        if self._starved is not None and self._starved[1] == self._inputs(self._starved[0]):
            # No unit of the source this window starved on arrived since: it would starve again,
            # after selecting and rolling back its pieces, at every ack and every other source's unit.
            raise Starved(self._starved[0])
        self.windows.begin(start, snapshot.topology_dict(self.topology))
        ctx = self.timeline.context_at(start)
        self.streams.apply_context(ctx)
        self.policy.pending = P.recut(
            self.policy.pending, ctx.piece_tokens
        )  # waiting pieces take this stage's piece size
        window = Window(
            start=start,
            steps=self.timeline.window_len(start, self._window_steps()),
            streams=self.streams.streams,
            topology=self.topology,
            balance=self.balance,
            step_budget=self.step_budget,
            heavy_tokens=self.heavy_tokens,
            weights_at=self.weights_at,
            class_weights_at=self.timeline.class_weights_at,
            costs=lambda rows: self.costs(rows, start),
        )
        try:
            planned = self.policy.plan(window)
        except Starved as e:
            self.windows.abandon(start)
            self.streams.forget_drops()
            self._starved = (e.source, self._inputs(e.source))
            raise
        drops = self.streams.drain_drops()
        for k, (rows, slot, mb_costs) in enumerate(planned):
            self.ready.append((rows, slot, mb_costs, drops if k == 0 else None))
        self.windows.prune(self.progress.durable_step - self.plan.checkpoint.keep_steps)

    def _inputs(self, source: str) -> tuple:
        """What decides whether the next window starves on ``source`` (its selection stops at
        the first source whose metadata is missing, so other sources' units cannot help)."""
        return (self.planned_until, self.streams.by_name(source).loads.loaded_units, self.plan_version, self.topology)

    def plan_ahead(self, steps: int) -> int:
        """Plan whole windows ahead of hand-out until at least ``steps`` planned steps wait in
        ``ready`` (policies that plan windows), so that handing out a step never waits for a
        window to be balanced. Stops quietly when a source's metadata is not loaded yet
        (``starved_on``), and never plans past a pending topology switch (the stream must not
        depend on how far ahead planning ran). Returns the number of windows planned."""
        n = 0
        while self.policy.plans_ahead and len(self.ready) < steps:
            if self.final_plan.topology != self.topology and self.planned_until >= self.replay_until:
                break
            try:
                self._plan_next_window()
            except Starved as e:
                self.starved_on = e.source  # loading looks further ahead for this source (wanted)
                return n
            n += 1
        if self.ready:
            self.starved_on = None  # planning is ahead: no source holds it back
        return n

    def _record(
        self, step: int, pieces: np.ndarray, slot: np.ndarray, mb_costs: np.ndarray, drops: np.ndarray | None
    ) -> dict:
        drops = drops if drops is not None else np.zeros((0, 5), np.int64)  # a window's drops go with its first step
        ctx = self.timeline.context_at(step)
        metrics = step_metrics(
            step,
            pieces,
            drops,
            mb_costs,
            self.costs(pieces, step),
            n_sources=len(self.streams),
            step_tokens=self.topology.step_tokens,
            dp=self.topology.dp,
            context={
                "pending": int(len(self.pending)),
                "weights": tuple(float(x) for x in self.weights_at(step)),
                "version": self.timeline.version_at(step),
                "stage": ctx.stage,
                "piece_tokens": ctx.piece_tokens,
            },
        )
        metrics["loss_tokens"] = self.streams.loss_tokens(pieces)
        if self.pool_workers:  # autoscaled runs: the pools' workers when this step was planned
            metrics["pool_workers"] = dict(self.pool_workers)
        return self.ledger.record(step, pieces, slot, drops, metrics, self.committed)

    # ---- state (snapshot.py) ------------------------------------------------------------------------
    def get_state(self) -> dict:
        """A msgpack-friendly snapshot of the planner (``snapshot.capture``)."""
        return snapshot.capture(self)

    # ---- acknowledgements and status ------------------------------------------------------------
    def ack(self, rank: int, step: int, cp_rank: int = 0, durable: bool = False) -> int:
        """(``rank``, ``cp_rank``) consumed every step up to ``step`` (and, if ``durable``, saved
        them in its trainer checkpoint); idempotent. Returns ``committed``."""
        return self.progress.ack(rank, step, cp_rank, durable, planned=self.next_step)

    def status(self) -> dict:
        return {
            "next_step": self.next_step,
            "committed": self.committed,
            "durable": self.progress.durable_step,
            "acked": list(self.progress.acked),
            "failure": self.failure,
            "starved_on": self.starved_on,
            "plan_version": self.plan_version,
            "frontier": self.frontier,
            **self.streams.status(),
        }
