"""Rewinding a running service: the planner goes back to an older step and hands out from there.

A training job that restarts from a checkpoint older than what the service handed out (with the
same or another number of ranks), or a skip of steps the planner has planned already
(``ServiceRoutes.skip``), rebuilds the planner from the newest window start kept at or before
the step, in memory or in the snapshots (``planner/rewind.py``); every attached consumer's
stream ends (telling it why) and the batches built past the step are released. One rewind at a
time (``lock``).
"""

from __future__ import annotations

import asyncio

from .. import logs
from ..planner.rewind import memory_source as rewind_memory_source
from ..planner.rewind import rebuild_at
from .chunks import chunk_steps


class Rewinder:
    """The rewinds of one run's plugin."""

    def __init__(self, plugin):
        self.p = plugin
        self.lock = asyncio.Lock()

    async def rewind(self, rank: int, cp_rank: int, step: int, dp: int) -> dict:
        """Serve step ``step`` next for ``dp`` ranks if the service has handed out past it for
        this rank (or runs another dp): the planner is rebuilt from the newest window state kept
        at or before it, in memory or in the snapshots (``planner/rewind.py``), every attached
        consumer's stream ends, and the batches built past it are released. Idempotent: the job's
        other ranks, asking for the same step, find it done."""
        if step < 0 or dp < 1:
            return {"error": f"cannot resume at step {step} with dp={dp}: the step must be >= 0 and dp >= 1"}
        async with self.lock:
            st = self.p.thread.state
            topo = st.final_plan.topology
            if not 0 <= cp_rank < topo.cp or not 0 <= rank < dp:
                return {"error": f"rank {rank} cp rank {cp_rank} does not exist for dp={dp}, cp={topo.cp}"}
            i = rank * topo.cp + cp_rank
            # (until the planner reaches a switch to another dp a rewind set up, its progress counts
            # the old ranks: a rank the switch adds has acknowledged nothing)
            acked, _ = st.progress.last(i)
            if dp == topo.dp and step >= max(st.replay_until, acked + 1):
                return {"error": None, "rewound": False}
            source = await self.source(step)
            if source is None:
                return {"error": await self.too_old(st, step)}
            why = "a training job restarted from its checkpoint"
            await self.rebuild(step, source, dp, why, replayed=True)
            return {"error": None, "rewound": True}

    async def source(self, step: int) -> tuple | None:
        """The newest window start kept at or before ``step``, in memory or in the snapshots."""
        source = await self.p.thread.run(rewind_memory_source, self.p.thread.state, step)
        if source is None and self.p.snapshots_loop is not None:
            source = await asyncio.to_thread(self.p.snapshots_loop.store.window_at, step)
        return source

    async def rebuild(self, step: int, source: tuple, dp: int, why: str, replayed: bool = False) -> None:
        """(holding ``lock``) Hand out ``step`` next for ``dp`` ranks, the
        planner rebuilt from window start ``source``; every attached consumer's stream ends,
        telling it ``why``. ``replayed``: the steps from ``step`` on come out token-identical
        to the first time (a job restarted from its checkpoint with the same ranks; not a skip,
        which changes them), so a consumer whose trainer took some of them from its ended
        attachment goes on from where it is."""
        st = self.p.thread.state
        topo = st.final_plan.topology
        new = await self.p.thread.run(rebuild_at, st, step, source, dp)
        cps = chunk_steps(new.final_plan.loading, new.final_plan.topology)
        dropped = await self.p.thread.run(self.p.thread.replace_state, new, cps)
        self.p.plan, self.p.chunk_steps = new.final_plan, cps
        release = list(self.p.held.tasks) + dropped
        self.p.held.tasks.clear()
        self.p.routes.trainers.replicas.clear()
        self.p.routes.trainers.first_step.clear()
        message = f"the run was rewound to step {step} ({why}); this consumer's stream ended"
        if dp != topo.dp:
            self.p.channels.end_all(message, dp, topo.cp)
        else:
            self.p.channels.end_all(message, rewound_to=step, replayed=replayed)
        self.p.thread.restart_work(release)
        logs.event("rewind", self.p.run_id, step, dp=dp, previous_dp=topo.dp, window=source[0])
        if self.p.snapshots_loop is not None:
            await self.p.snapshots_loop.write(force=True)  # a base at the new durable step

    async def too_old(self, st, step: int) -> str:
        """Why no window start at or before ``step`` is kept (what to raise to keep more)."""
        oldest = [s for s in (st.windows.oldest, st.replay_until) if s is not None]
        if self.p.snapshots_loop is not None:
            stored = await asyncio.to_thread(self.p.snapshots_loop.store.oldest_window_step)
            oldest += [stored] if stored is not None else []
        keep = st.plan.checkpoint
        where = "checkpoint.keep_steps" + (
            " or checkpoint.keep_hours (bases in the snapshot location)" if self.p.snapshots_loop is not None else ""
        )
        return (
            f"cannot resume at step {step}: the service can serve steps from {min(oldest)} on, not earlier "
            f"(it keeps {keep.keep_steps} steps back); raise {where} to keep more"
        )
