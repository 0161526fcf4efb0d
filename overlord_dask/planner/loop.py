"""The planning loop of :class:`~overlord_dask.planner.state.PlannerState`: windows planned ahead,
steps handed out within the prefetch bound, each recorded in the ledger.

A mixin of ``PlannerState`` (it works on the parts that class composes: ``timeline``, ``streams``,
``policy``, ``ledger``, ``progress``, ``windows``), kept apart so that one file says how steps are
planned and the other what the planner holds and how it is saved and restored.

``plan_ahead()`` plans whole windows into ``ready``; ``plan_steps()`` hands steps out of it into
the ledger and names the units no later step needs. A window that needs a unit's metadata not
loaded yet raises :class:`~overlord_dask.planner.policies.Starved` inside, leaves every part as it
was, and is tried again once that source's next unit arrives.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import pieces as P
from ..errors import ReplayError
from .ledger import step_digest, step_metrics
from .policies import Starved, Window

logger = logging.getLogger(__name__)

RETRY_UNITS = 64  # a starved window is tried again at least every this many units of its source (a safety net)


class PlanningLoop:
    """(mixin of ``PlannerState``) How windows are planned and steps handed out."""

    def costs(self, rows: np.ndarray, step: int) -> np.ndarray:
        """Cost of planned piece rows at ``step`` (backbone tokens and, with an encoder cost, image
        tokens), by the cost model in force there (declared, or learned: ``timeline.cost_at``)."""
        return self.streams.costs(rows, self.timeline.cost_at(step))

    def steps_ahead(self) -> int:
        """Steps handed out and not committed (skipped ones do not count: no rank acknowledges them)."""
        return self.next_step - self.committed - self.timeline.skipped_between(self.committed, self.next_step)

    def can_plan(self) -> bool:
        """Within the prefetch bound (``loading.prefetch_steps`` ahead of the committed step)."""
        return self.steps_ahead() < self.plan.loading.prefetch_steps

    def plan_steps(self, max_steps: int) -> tuple[list[dict], list[list]]:
        """Plan as many steps as the bounds and loaded metadata allow.

        Returns (steps, finished_units): each step is ``{"step", "pieces", "slot", "piece_tokens",
        "loss_tokens"}`` with ``pieces`` the step's int64 piece rows (``pieces.py``) and ``slot``
        their int32 ``[rank, micro_batch]`` (both as the ledger holds them); finished units are
        ``[source, epoch, unit]`` whose blocks no later step needs. A skipped step
        (``timeline.skip_at``) is planned and recorded but not handed out; the steps returned are
        consecutive (a skip ends them), and the first after a skip says so (``"after_skip"``).
        """
        steps = []
        t0 = time.perf_counter()
        while len(steps) < max_steps and self.can_plan():
            skip = self.timeline.skip_at(self.next_step) if self.timeline.decisions else None
            if skip is not None and steps:
                break  # the steps handed out together are consecutive: the skip ends this chunk
            if self.next_step == self.replay_until and self.final_plan.topology != self.topology:
                self.switch_topology()
            try:
                rows, slot, mb_costs, drops, loss_tokens = self._next_planned()
            except Starved as e:
                self.starved_on = e.source
                break
            self.starved_on = None
            step = self.next_step
            self.next_step += 1
            if step < self.replay_until:
                self._check_replayed(step, rows, slot)
                continue  # delivered before the restore: only the planner state had to catch up
            entry = self._record(step, rows, slot, mb_costs, drops, loss_tokens)
            m = self.ledger.metrics[step]
            if skip is not None:
                m["skipped"] = True  # planned (its documents count as used), never handed out
                continue
            out = {"step": step, "pieces": entry["pieces"], "slot": entry["slot"], "piece_tokens": m["piece_tokens"]}
            out["loss_tokens"] = m["loss_tokens"]
            before = self.timeline.skip_at(step - 1) if step and self.timeline.decisions else None
            if before is not None:
                out["after_skip"] = [before.at, before.values["until"]]
            steps.append(out)
        if steps:
            self.plan_seconds.append(time.perf_counter() - t0)
            del self.plan_seconds[:-10_000]
        in_use = [self._pending_units()] + [units for *_, units in self.ready]
        return steps, self.streams.finished_units(in_use)

    def _pending_units(self) -> np.ndarray:
        """The units the pieces carried to the next window come from, found once per window (this
        is asked at every call of :meth:`plan_steps`, and at thousands of ranks the carried
        pieces number ~100k)."""
        pending = self.policy.pending
        if self._units_of[0] is not pending:
            self._units_of = (pending, P.unique_rows(P.units(pending)))
        return self._units_of[1]

    def _next_planned(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, tuple]:
        """The next step's pieces as int64 rows with their int32 ``[rank, micro_batch]``, the
        bins' costs, (on a window's first step) the documents a drop policy skipped while
        planning the window, and the step's loss tokens (``LossTargets.loss_tokens``)."""
        if not self.ready:
            self._plan_next_window()
        rows, slot, mb_costs, drops, loss_tokens, _ = self.ready.popleft()
        return rows, slot, mb_costs, drops, loss_tokens

    def _plan_next_window(self) -> None:
        """Plan the window that starts at ``planned_until`` into ``ready``; its state beforehand
        is kept for snapshots (``windows``)."""
        start = self.planned_until
        if self._starved is not None and self._starves_again(*self._starved):
            raise Starved(self._starved[0])
        self.windows.begin(start, self.topology.model_dump())
        ctx = self.timeline.context_at(start)
        self.streams.apply_context(ctx)
        # pieces still waiting take this stage's piece size
        self.policy.pending = P.recut(self.policy.pending, ctx.piece_tokens)
        window = Window(
            start=start,
            steps=self.timeline.window_len(start, self._window_steps()),
            streams=self.streams.streams,
            topology=self.topology,
            balance=self.balance,
            step_budget=self.step_budget,
            heavy_tokens=self.heavy_tokens,
            mix_at=self.timeline.mix_at,
            class_weights_at=self.timeline.class_weights_at,
            costs=lambda rows: self.costs(rows, start),
        )
        try:
            planned = self.policy.plan(window)
        except Starved as e:
            self.windows.abandon(start)
            self.streams.forget_drops()
            loads = self.streams.by_name(e.source).loads
            self._starved = (
                e.source,
                self._inputs(),
                loads.loaded_tokens + e.short_by,
                e.waits_for,
                loads.loaded_units,
            )
            raise
        drops = self.streams.drain_drops()
        # each step with the units its pieces come from (which units are still in use is asked
        # after every hand-out, and at thousands of ranks a window holds ~1M pieces) and its loss
        # tokens, found for the whole window at once (per step they cost more than the finding)
        steps = [rows for rows, _, _ in planned]
        try:
            losses = self.streams.targets.loss_tokens_of(steps) if steps else []
        except KeyError:
            # pieces restored from a snapshot whose units are loaded again and have not arrived
            # yet: counted as their steps go out (replayed ones never are), as one step alone is
            losses = [None] * len(steps)
        per_step = zip(P.units_of_each(steps), losses) if steps else ()
        for k, ((rows, slot, mb_costs), (units, loss_tokens)) in enumerate(zip(planned, per_step)):
            self.ready.append((rows, slot, mb_costs, drops if k == 0 else None, loss_tokens, units))
        self.windows.prune(self.progress.durable_step - self.plan.checkpoint.keep_steps)

    def _starves_again(self, source: str, inputs: tuple, tokens: int, waits_for: tuple, units: int) -> bool:
        """Whether the window that starved on ``source`` would starve again, after selecting and
        rolling back its pieces: nothing else changed and too little of the source arrived
        since (fewer than ``tokens`` loaded in all, or none of the blocks its scans stopped at).
        Asked at every ack and every unit that arrives: trying at each was quadratic in the
        units a large window waits for. Every ``RETRY_UNITS`` units it is tried anyway."""
        if inputs != self._inputs():
            return False
        s = self.streams.by_name(source)
        if s.loads.loaded_units - units >= RETRY_UNITS:
            return False
        arrived = not waits_for or any(k in s.lengths for k in waits_for)
        return s.loads.loaded_tokens < tokens or not arrived

    def _inputs(self) -> tuple:
        """What, besides the starved source's metadata, decides whether the next window starves
        (its selection stops at the first source whose metadata is missing, so other sources'
        units cannot help)."""
        return (self.planned_until, self.plan_version, self.topology, len(self.timeline.decisions))

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

    def _check_replayed(self, step: int, rows: np.ndarray, slot: np.ndarray) -> None:
        """Step ``step``, re-planned after a restore or a rewind, is the one handed out before
        (its digest, where the snapshot or the ledger kept it), else :class:`ReplayError`; where
        the start accepted changed data or code (``checkpoint.on_data_change`` or
        ``on_code_change: accept``), a warning, once."""
        want = self.replay_digests.pop(step, None)
        if want is None or step_digest(rows, slot) == want:
            return
        if self.replay_accepts_change:
            self.replay_digests.clear()
            logger.warning(
                "step %s came out differently when re-planned than when it was handed out; going on, as the "
                "plan accepts the changed data or code (documents near the resume point may be lost or repeated)",
                step,
            )
            return
        raise ReplayError(
            f"step {step} came out differently when re-planned from the window at step "
            f"{self.replay_from} than when it was handed out: the documents after it would not be "
            "the ones the run owes its trainers (some lost, some repeated). The sources' files, the "
            "plan's code (a tokenizer, a transform, a cost function) or the overlord-dask version "
            "changed since the run planned it (loading.integrity: true names a changed file as it is "
            "read). Resume with the data, code and version it ran with, or start a new run (another "
            "checkpoint.url, or checkpoint.resume: false)."
        )

    def _record(
        self, step: int, pieces: np.ndarray, slot: np.ndarray, mb_costs: np.ndarray, drops, loss_tokens: tuple | None
    ) -> dict:
        """Step ``step`` into the ledger with its metrics (a window's drops go with its first step)."""
        drops = drops if drops is not None else np.zeros((0, 5), np.int64)
        ctx = self.timeline.context_at(step)
        context = {
            "pending": int(len(self.policy.pending)),
            "weights": tuple(float(x) for x in self.timeline.mix_at(step)),
            "version": self.timeline.version_at(step),
            "stage": ctx.stage,
            "piece_tokens": ctx.piece_tokens,
        }
        topo = self.topology
        costs = self.costs(pieces, step)
        metrics = step_metrics(
            step,
            pieces,
            drops,
            mb_costs,
            costs,
            n_sources=len(self.streams),
            step_tokens=topo.step_tokens,
            dp=topo.dp,
            context=context,
        )
        metrics["loss_tokens"] = loss_tokens if loss_tokens is not None else self.streams.targets.loss_tokens(pieces)
        metrics["digest"] = step_digest(pieces, slot)
        if self.pool_workers:  # autoscaled runs: the pools' workers when this step was planned
            metrics["pool_workers"] = dict(self.pool_workers)
        return self.ledger.record(step, pieces, slot, drops, metrics, self.committed)

    def _window_steps(self) -> int:
        return self.policy.window_steps(self.balance)
