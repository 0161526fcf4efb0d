"""The planner plugin's read-only routes: what the run looks like, for ``Service``, ``overlord
status``, the notebooks and the autoscaler.

A mixin of ``plugin.PlannerPlugin`` (its routes are its methods, looked up by name from
``protocol.HANDLERS``). Whatever reads the planner's state runs in the planner thread
(``self._run``), so a view is never torn by a planning step.
"""

from __future__ import annotations

from ..plan.loading import plan_to_dict
from . import pieces as P
from .held import held_bytes
from .signals import pool_signals


class InspectionRoutes:
    async def plans(self) -> list:
        return await self._run(lambda: [[at, plan_to_dict(p)] for at, p in self.state.timeline.versions])

    def info(self) -> dict:
        plan = self.state.final_plan
        t = plan.topology
        return {
            "run_id": self.run_id,
            "name": plan.name,
            "dp": t.dp,
            "cp": t.cp,
            "micro_batches": t.micro_batches,
            "tokens_per_micro_batch": t.tokens_per_micro_batch,
            "prefetch_steps": plan.loading.prefetch_steps,
            "chunk_steps": self.chunk_steps,
            "sources": list(self.state.source_names),
            "plan_version": self.state.plan_version,
            "commit": self.state.progress.commit_mode,
        }

    def snapshots(self) -> list[dict]:
        return list(self.snapshots_loop.stats) if self.snapshots_loop is not None else []

    def _counters(self) -> dict:
        """Control-path traffic (tests and benchmarks read it)."""
        return {"descriptors_put": self.channels.put_count, "acks": self.acks, **self.held.counts}

    async def status(self) -> dict:
        st = await self._run(self.state.status)
        return {**st, "loop": self.loop(), "chunk_steps": self.chunk_steps, **self.held.figures(),
                **held_bytes([ts for ts in self.scheduler.tasks.values() if ts.state == "memory" and isinstance(ts.key, str)
                               and ts.key.startswith(self._load_prefix)], "block_bytes", "block_shadow_bytes"),  # loaded blocks
                "channels": len(self.channels.streams), "subscribed": len(self.channels.subs),
                "snapshot_error": self.snapshots_loop.error if self.snapshots_loop is not None else None,
                "stop_requested": self.stop_requested, "rank_wait_share": self._wait_shares(), **self._counters()}

    async def pools(self, lead_s: float = 10.0, report: dict | None = None) -> dict:
        """The autoscaler's inputs: per-source demand over the schedule ahead and measured costs;
        with ``report``, the autoscaler's latest decisions (kept for ``Service.pools()``)."""
        if report is not None:
            self.scaling = report
            self.state.pool_workers = dict(report.get("arrived") or {})  # the planner records it with each step it plans
            return {}
        return {**await self._run(pool_signals, self.state, self.signals, lead_s), "scaling": self.scaling}

    def _wait_shares(self) -> dict:
        """Each rank's share of its wall time spent waiting in ``next()`` (as its acks report it)."""
        return {f"{r}" + (f".{c}" if c else ""): round(w / s, 4) for (r, c), (w, s) in sorted(self.rank_wait.items()) if s > 0}

    async def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return await self._run(lambda: [m for s, m in self.state.metrics.items() if s >= start and (stop is None or s < stop)])

    async def ledger(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return await self._run(self._ledger, start, stop)

    def _ledger(self, start: int, stop: int | None) -> list[dict]:
        out = []
        for s, entry in self.state.ledger.items():
            if s >= start and (stop is None or s < stop):
                p = entry["pieces"]
                out.append({"step": s, "pieces": P.to_bytes(p), "slot": entry["slot"].tobytes(),
                            "sample_ids": self.state.streams.sample_ids(p).tobytes(),
                            "dropped": self.state.streams.dropped_ids(entry["dropped"]).tobytes()})
        return out
