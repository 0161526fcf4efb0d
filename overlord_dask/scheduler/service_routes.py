"""The routes of the service's side (``routes.py`` lists them all): the submitter's long poll,
live updates, the autoscaler's inputs, stop and failure, the views, and the workers' stream of
unit lengths."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .. import logs
from .. import pieces as P
from ..errors import PlanError
from ..plan.io import plan_from_dict, plan_to_dict
from .load_signals import pool_signals


def _decision_key(d: dict) -> tuple:
    """What identifies a decision (one archived just before a crash is also in the restored base)."""
    return (d["at"], d["kind"], repr(sorted(d["values"].items())), d["after"], d["reason"])


WAITING_EVERY_S = 0.5  # how often the watchdog looks at what the next step waits on (for the page)


class ServiceRoutes:
    """The service's, the operators' and the workers' handlers, over the plugin's parts (and
    the trainers' routes, for the figures they keep)."""

    def __init__(self, plugin, trainers):
        self.p, self.trainers = plugin, trainers
        self.scaling: dict | None = None  # the autoscaler's last decisions and history, as it reported them
        self.stop_requested = False
        self._blocked: tuple[int, str, float] | None = None  # (step, cause, since): what `waiting` reports
        self.blocked_view: dict | None = None
        self._waiting_at = 0.0

    @property
    def state(self):
        return self.p.thread.state

    # ---- the submitter, the autoscaler, operators ------------------------------------------------------
    async def work(self, timeout: float = 1.0) -> dict:
        out = await self.p.thread.next_work(timeout)
        signals = self.p.signals
        out.update(
            failure=self.state.failure,
            plan_version=self.state.plan_version,
            load_costs={s: signals.seconds_per_doc(s) for s in signals.cost},
        )  # for auto-partitioning
        return out

    async def update(self, plan: dict, at_step: int | None = None, unit_first_ids: dict | None = None) -> dict:
        """Apply a live plan update; with snapshots, answer only once a base holding it is written
        (so an acknowledged update survives a crash)."""
        try:
            new = plan_from_dict(plan, where="<plan update>")
            at = await self.p.thread.run(self.state.update, new, at_step, unit_first_ids or {})
        except (PlanError, ValueError) as err:
            return {"error": str(err), "at_step": None, "version": self.state.plan_version}
        self.p.thread.wake()
        logs.event("plan_update", self.p.run_id, at, version=self.state.plan_version)
        if self.p.snapshots_loop is not None:
            await self.p.snapshots_loop.write(force=True)
        return {"error": None, "at_step": at, "version": self.state.plan_version}

    async def skip(self, start: int, stop: int, reason: str = "") -> dict:
        """Record a skip of steps ``start..stop``; with snapshots, answer once one holds it (the
        planner hands out nothing it governs before: ``PlannerThread.record``). Where the planner
        planned ``start`` already (a job trained past it, or it was handed out ahead), the run
        rewinds to ``start`` as for a job restarting from its checkpoint: the attached streams end,
        and the job goes on from its checkpoint (``load_state_dict``) without the skipped steps."""
        reason = reason or f"skip requested at step {self.state.committed}"
        thread = self.p.thread

        def record():
            return thread.record("skip", start, {"until": stop}, reason), thread.decided

        async with self.p.rewinder.lock:
            source = None
            if isinstance(start, int) and 0 <= start < self.state.next_step:  # planned already: plan it again
                source = await self.p.rewinder.source(start)
                if source is None:
                    why = await self.p.rewinder.too_old(self.state, start)
                    return {"error": f"cannot skip from step {start}: {why}"}
            try:
                d, decided = await thread.run(record)
            except (PlanError, ValueError) as err:
                return {"error": str(err)}
            logs.event("decision", self.p.run_id, d.at, kind=d.kind, until=stop, reason=reason)
            if source is not None:
                dp = self.state.final_plan.topology.dp
                await self.p.rewinder.rebuild(start, source, dp, f"steps {start}..{stop} are skipped")
        if self.p.snapshots_loop is not None:
            await self.p.snapshots_loop.write(force=True)
        thread.release_hold(decided)
        thread.wake()
        return {"error": None, "skip": [d.at, stop]}

    async def pools(self, lead_s: float = 10.0, report: dict | None = None) -> dict:
        """The autoscaler's inputs: per-source demand over the schedule ahead and measured costs;
        with ``report``, the autoscaler's latest decisions (kept for ``Service.pools()``)."""
        if report is not None:
            self.scaling = report
            self.state.pool_workers = dict(
                report.get("arrived") or {}
            )  # the planner records it with each step it plans
            return {}
        return {**await self.p.thread.run(pool_signals, self.state, self.p.signals, lead_s), "scaling": self.scaling}

    def request_stop(self) -> dict:
        """Ask the process that runs this service (``overlord serve``) to stop cleanly: it sees
        ``stop_requested`` in the status, writes the last snapshot and retires its workers."""
        self.stop_requested = True
        logs.event("stop_requested", self.p.run_id, self.state.committed)
        return {"stop_requested": True}

    def fail(self, message: str) -> None:
        self.p.fail(message)

    # ---- views -----------------------------------------------------------------------------------------
    async def status(self) -> dict:
        thread = self.p.thread
        st = await thread.run(
            lambda: {**self.state.status(), "feedback": thread.feedback_status(), "balancer": thread.balancer_status()}
        )  # one hop to the planner thread
        snaps = self.p.snapshots_loop
        return {
            **st,
            "waiting": self.waiting(st["committed"]),
            **self.p.dropped.status(),
            "loop": self.loop(),
            "chunk_steps": self.p.chunk_steps,
            **self.p.held.figures(),
            **self.p.held.block_figures(),
            "channels": len(self.p.channels.streams),
            "subscribed": sum(len(s) for s in self.p.channels.subs.values()),
            "snapshot_error": snaps.error if snaps is not None else None,
            "stop_requested": self.stop_requested,
            "rank_wait_share": self.trainers.wait_shares(),
            **self.counters(),
        }

    def waiting(self, step: int) -> dict | None:
        """(event loop) What ``step`` (the committed step: the one every rank needs next) waits on
        while its batches are not built: the load of a unit (running where, retried how often,
        workers lost under it) or the build itself; while it is not planned because planning
        starved on a source, that source's load in flight; ``since_s``: for how long that same
        cause has been seen. Kept in ``blocked_view`` for the page (the planner thread reads it;
        it never scans the scheduler's tasks itself)."""
        cause = self.p.held.blocker(step)
        starved = self.state.starved_on
        if cause is None and starved is not None and step >= self.state.next_step:
            load = self.p.held.loading(starved)
            if load is not None:
                cause = f"step {step} is not planned yet: planning waits for {load}"
        if cause is None:
            self._blocked = self.blocked_view = None
            return None
        now = time.time()
        if self._blocked is None or self._blocked[:2] != (step, cause):
            self._blocked = (step, cause, now)
        self.blocked_view = {"step": step, "cause": cause, "since_s": round(now - self._blocked[2], 1)}
        return self.blocked_view

    def refresh_waiting(self) -> None:
        """(event loop, every watchdog tick) :meth:`waiting` at most every ``WAITING_EVERY_S``."""
        now = time.monotonic()
        if now - self._waiting_at >= WAITING_EVERY_S:
            self._waiting_at = now
            self.waiting(self.state.committed)

    async def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return await self.p.thread.run(
            lambda: [m for s, m in self.state.metrics.items() if s >= start and (stop is None or s < stop)]
        )

    async def ledger(self, start: int = 0, stop: int | None = None) -> list[dict]:
        def entries() -> list[dict]:
            st, out = self.state, []
            for s, entry in st.ledger.items():
                if s >= start and (stop is None or s < stop):
                    p = entry["pieces"]
                    out.append(
                        {
                            "step": s,
                            "pieces": P.to_bytes(p),
                            "slot": entry["slot"].tobytes(),
                            "sample_ids": st.streams.sample_ids(p).tobytes(),
                            "dropped": st.streams.dropped_ids(entry["dropped"]).tobytes(),
                        }
                    )
            return out

        return await self.p.thread.run(entries)

    async def plans(self, decisions: bool = False) -> list | dict:
        """The plan versions ``[[at_step, plan], ...]``; with ``decisions``, ``{"versions", "decisions"}``."""

        def view():
            tl = self.state.timeline
            versions = [[at, plan_to_dict(p)] for at, p in tl.versions]
            return {"versions": versions, "decisions": [d.to_dict() for d in tl.decisions]} if decisions else versions

        out = await self.p.thread.run(view)
        snaps = self.p.snapshots_loop
        if decisions and snaps is not None:  # the settled ones the planner archived (snapshots.py), first
            archived = await asyncio.to_thread(snaps.store.archived_decisions)
            seen = {_decision_key(d) for d in archived}
            out["decisions"] = archived + [d for d in out["decisions"] if _decision_key(d) not in seen]
        return out

    def snapshots(self) -> list[dict]:
        return list(self.p.snapshots_loop.stats) if self.p.snapshots_loop is not None else []

    def loop(self, reset: bool = False) -> dict:
        """How late the scheduler's event loop woke up (``watchdog.py``)."""
        return self.p.watch.figures(reset)

    def counters(self) -> dict:
        """Control-path traffic (tests and benchmarks read it)."""
        return {"descriptors_put": self.p.channels.put_count, "acks": self.trainers.acks, **self.p.held.counts}

    # ---- the workers' stream ----------------------------------------------------------------------------
    def lengths(
        self,
        run_id: str,
        source: str,
        epoch: int,
        unit: int,
        lengths: bytes,
        vision: bytes | None = None,
        seconds: float = 0.0,
        nbytes: int = 0,
        part: list | None = None,
        dropped: int = 0,
        quarantined: str | None = None,
        masked: bytes | None = None,
        **_,
    ) -> None:
        """A load task's unit metadata (one-way, from the worker's stream); repeats are ignored."""
        if run_id != self.p.run_id:
            return
        v = None if vision is None else np.frombuffer(vision, dtype="<i8")
        lens = np.frombuffer(lengths, dtype="<i8")
        m = None if masked is None else np.frombuffer(masked, dtype="<i8")
        self.p.signals.loaded(source, seconds, int(lens.sum()), nbytes, len(lens))
        if quarantined and self.p.dropped.quarantine(source, unit, quarantined, self.state.committed):
            logs.event("quarantine", self.p.run_id, self.state.committed, source=source, unit=unit, reason=quarantined)
        if part is not None:  # auto-partitioning: the unit counts once all its parts are in
            whole = self.p.parts.add((source, epoch, unit), part, lens, v, dropped, m)
            if whole is None:
                return
            lens, v, dropped, m = whole
        self.p.dropped.loaded(source, unit, len(lens), dropped)
        self.p.thread.add_lengths(source, epoch, unit, lens, v, m)
