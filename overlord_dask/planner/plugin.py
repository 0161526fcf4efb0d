"""The planner as a Dask scheduler plugin: one central, metadata-only controller per service.

Routes (scheduler handlers, request/response; all idempotent where a retry could repeat them):

- ``overlord_info()``: the topology and names a consumer needs to attach.
- ``overlord_wanted()``: units whose lengths the planner needs next (the driver loads them).
- ``overlord_add_lengths(source, epoch, unit, lengths)``: a loaded unit's document lengths
  (little-endian int64 bytes); a repeat (recomputed load) is ignored.
- ``overlord_plan(max_steps)``: plan the next steps within the prefetch bound.
- ``overlord_ack(rank, step, cp_rank=0)``: a (rank, cp rank) consumed every step up to ``step``.
- ``overlord_status()``, ``overlord_metrics(start, stop)``, ``overlord_ledger(start, stop)``.
- ``overlord_fail(message)``: the driver reports a fatal error; consumers see it in their status.

Handlers run on the scheduler's event loop; each is O(step size) metadata work, never I/O.
"""

from __future__ import annotations

import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin

from ..plan.loading import plan_from_dict
from .state import PlannerState

HANDLERS = (
    "overlord_info",
    "overlord_wanted",
    "overlord_add_lengths",
    "overlord_plan",
    "overlord_ack",
    "overlord_status",
    "overlord_metrics",
    "overlord_ledger",
    "overlord_fail",
)


class PlannerPlugin(SchedulerPlugin):
    """Register with ``client.register_plugin(PlannerPlugin(plan_dict, unit_first_ids, run_id))``."""

    name = "overlord-planner"
    idempotent = True

    def __init__(self, plan: dict, unit_first_ids: dict[str, list[int]], run_id: str):
        self.plan_dict = plan
        self.unit_first_ids = unit_first_ids
        self.run_id = run_id
        self.state: PlannerState | None = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.state = PlannerState(plan_from_dict(self.plan_dict, where="<service plan>"), self.unit_first_ids)
        for name in HANDLERS:
            scheduler.handlers[name] = getattr(self, name[len("overlord_") :])

    async def close(self) -> None:
        for name in HANDLERS:
            self.scheduler.handlers.pop(name, None)

    # ---- routes -------------------------------------------------------------------------------
    def info(self) -> dict:
        t = self.state.topology
        return {
            "run_id": self.run_id,
            "name": self.state.plan.name,
            "dp": t.dp,
            "cp": t.cp,
            "micro_batches": t.micro_batches,
            "tokens_per_micro_batch": t.tokens_per_micro_batch,
            "sources": self.state.source_names,
            "weights": [float(w) for w in self.state.weights],
            "queue_prefix": queue_prefix(self.run_id),
        }

    def wanted(self) -> list:
        return self.state.wanted()

    def add_lengths(self, source: str, epoch: int, unit: int, lengths: bytes) -> bool:
        return self.state.add_lengths(source, epoch, unit, np.frombuffer(lengths, dtype="<i8"))

    def plan(self, max_steps: int = 1) -> dict:
        if self.state.failure:
            return {"steps": [], "finished": [], "failure": self.state.failure}
        steps, finished = self.state.plan_steps(max_steps)
        return {"steps": steps, "finished": finished, "failure": None}

    def ack(self, rank: int, step: int, cp_rank: int = 0) -> dict:
        try:
            return {"committed": self.state.ack(rank, step, cp_rank), "error": None}
        except ValueError as err:
            return {"committed": self.state.committed, "error": str(err)}

    def status(self) -> dict:
        return self.state.status()

    def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return [m for s, m in self.state.metrics.items() if s >= start and (stop is None or s < stop)]

    def ledger(self, start: int = 0, stop: int | None = None) -> list[dict]:
        out = []
        for s, entry in self.state.ledger.items():
            if s >= start and (stop is None or s < stop):
                p = entry["pieces"]
                out.append(
                    {
                        "step": s,
                        "pieces": p.tobytes(),
                        "slot": entry["slot"].tobytes(),
                        "sample_ids": self.state.sample_ids(p).tobytes(),
                    }
                )
        return out

    def fail(self, message: str) -> None:
        if not self.state.failure:
            self.state.failure = message


def queue_prefix(run_id: str) -> str:
    return f"overlord-{run_id}"


def rank_queue_name(run_id: str, rank: int, cp_rank: int = 0) -> str:
    return f"{queue_prefix(run_id)}-rank-{rank}" + (f"-cp-{cp_rank}" if cp_rank else "")
