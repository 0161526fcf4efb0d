"""The planner as a Dask scheduler plugin: one central, metadata-only controller per service.

Routes (scheduler handlers, request/response; all idempotent where a retry could repeat them):

- ``overlord_info()``: the topology and names a consumer needs to attach.
- ``overlord_add_lengths(source, epoch, unit, lengths, vision=None)``: a loaded unit's document
  lengths (and image tokens per document, multimodal sources), little-endian int64 bytes; a
  repeat (recomputed load) is ignored.
- ``overlord_ack(rank, step, cp_rank=0, durable=False)``: a (rank, cp rank) consumed every step
  up to ``step`` (``durable``: and saved them in its trainer checkpoint).
- ``overlord_status()``, ``overlord_metrics(start, stop)``, ``overlord_ledger(start, stop)``.
- ``overlord_fail(message)``: the driver reports a fatal error; consumers see it in their status.
- ``overlord_snapshots()``: kind, size and write time of the snapshots written so far.
- ``overlord_tick(max_steps)``: the driver's single call per loop: plan the next steps within
  the prefetch bound, and answer with them, the units whose lengths the planner needs next, and
  the status.
- ``overlord_rewind(rank, cp_rank, step)``: a restarted trainer needs its stream again from a
  step it has not acknowledged; returns the queue's new generation.
- ``overlord_update(plan, at_step, unit_first_ids)``: a live plan update from ``at_step`` (None: the
  first step not planned yet); answers once the update is in a snapshot (with a checkpoint URL).
- ``overlord_plans()``: every plan version as ``[at_step, plan dict]`` (the driver and
  inspection read it).

With a checkpoint URL, every newly committed step is snapshotted asynchronously, never blocking
an ack: a base every ``base_every_steps`` steps or ``base_every_seconds`` (and when the topology
or the plan versions change), else a delta (``snapshots.SnapshotWriter``).

Handlers run on the scheduler's event loop; each is O(step size) metadata work, never I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin

from ..errors import PlanError
from ..plan.loading import plan_from_dict, plan_to_dict
from .state import PlannerState

HANDLERS = (
    "overlord_info",
    "overlord_add_lengths",
    "overlord_ack",
    "overlord_status",
    "overlord_metrics",
    "overlord_ledger",
    "overlord_fail",
    "overlord_snapshots",
    "overlord_rewind",
    "overlord_tick",
    "overlord_update",
    "overlord_plans",
)


class PlannerPlugin(SchedulerPlugin):
    """Register with ``client.register_plugin(PlannerPlugin(plan_dict, unit_first_ids, run_id))``."""

    name = "overlord-planner"
    idempotent = True

    def __init__(self, plan: dict, unit_first_ids: dict[str, list[int]], run_id: str, *,
                 checkpoint_url: str | None = None, storage_options: dict | None = None, keep_bases: int = 2,
                 base_every_steps: int = 1000, base_every_seconds: float = 600.0,
                 restore: dict | None = None, restore_seq: int = -1):
        self.plan_dict = plan
        self.unit_first_ids = unit_first_ids
        self.run_id = run_id
        self.checkpoint_url = checkpoint_url
        self.storage_options = storage_options or {}
        self.keep_bases = keep_bases
        self.base_every = (base_every_steps, base_every_seconds)
        self.restore_state = restore
        self.seq = restore_seq  # last snapshot sequence number written (or restored)
        self.state: PlannerState | None = None
        self.rewinds: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, cp) -> (from step, generation)

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.state = PlannerState(plan_from_dict(self.plan_dict, where="<service plan>"), self.unit_first_ids, state=self.restore_state)
        self.store = None
        self.snapshot_stats: list[dict] = []
        self._written_committed = -1
        self._wake = asyncio.Event()
        self._write_lock = asyncio.Lock()  # the loop and a plan update both write; sequence numbers must not race
        if self.checkpoint_url:
            from ..snapshots import SnapshotStore, SnapshotWriter

            self.store = SnapshotStore(self.checkpoint_url, self.storage_options)
            self.writer = SnapshotWriter(self.store, keep_bases=self.keep_bases, base_every_steps=self.base_every[0],
                                         base_every_seconds=self.base_every[1], seq=self.seq)
            self._writer = asyncio.create_task(self._snapshot_loop())
            self._wake.set()  # a first base right away
        for name in HANDLERS:
            scheduler.handlers[name] = getattr(self, name[len("overlord_") :])

    async def close(self) -> None:
        if self.store is not None:
            self._writer.cancel()
            async with self._write_lock:
                await self._write_snapshot()  # the last committed step, before the scheduler goes
        for name in HANDLERS:
            self.scheduler.handlers.pop(name, None)

    # ---- snapshots: encoded on the event loop (small), written in a thread, never on a trainer's path
    async def _snapshot_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                async with self._write_lock:
                    await self._write_snapshot()
            except Exception:  # storage hiccups must not kill the planner; the next commit retries
                logging.getLogger(__name__).exception("writing a planner snapshot to %s failed", self.checkpoint_url)

    async def _write_snapshot(self, force: bool = False) -> None:
        st = self.state.get_state()
        if st["committed"] == self._written_committed and not force:
            return
        t0 = time.perf_counter()
        kind, n = await asyncio.to_thread(self.writer.write, st)
        self._written_committed = st["committed"]
        self.snapshot_stats.append({"kind": kind, "bytes": n, "seconds": time.perf_counter() - t0, "committed": st["committed"]})
        del self.snapshot_stats[:-1000]

    # ---- routes -------------------------------------------------------------------------------
    async def update(self, plan: dict, at_step: int | None = None, unit_first_ids: dict | None = None) -> dict:
        """Apply a live plan update; with snapshots, answer only once a base holding it is written
        (so an acknowledged update survives a crash)."""
        try:
            new = plan_from_dict(plan, where="<plan update>")
            at = self.state.update(new, at_step, unit_first_ids or {})
        except (PlanError, ValueError) as err:
            return {"error": str(err), "at_step": None, "version": self.state.plan_version}
        if self.store is not None:
            async with self._write_lock:
                await self._write_snapshot(force=True)
        return {"error": None, "at_step": at, "version": self.state.plan_version}

    def plans(self) -> list:
        return [[at, plan_to_dict(p)] for at, p in self.state.timeline.versions]

    def info(self) -> dict:
        t = self.state.final_plan.topology
        return {
            "run_id": self.run_id,
            "name": self.state.plan.name,
            "dp": t.dp,
            "cp": t.cp,
            "micro_batches": t.micro_batches,
            "tokens_per_micro_batch": t.tokens_per_micro_batch,
            "sources": self.state.source_names,
            "weights": [float(w) for w in self.state.weights_at(self.state.next_step)],
            "plan_version": self.state.plan_version,
            "queue_prefix": queue_prefix(self.run_id),
            "first_step": self.state.replay_until,
            "commit": self.state.commit_mode,
        }

    def wanted(self) -> list:
        return self.state.wanted()

    def add_lengths(self, source: str, epoch: int, unit: int, lengths: bytes, vision: bytes | None = None) -> bool:
        v = None if vision is None else np.frombuffer(vision, dtype="<i8")
        return self.state.add_lengths(source, epoch, unit, np.frombuffer(lengths, dtype="<i8"), v)

    def plan(self, max_steps: int = 1) -> dict:
        if self.state.failure:
            return {"steps": [], "finished": [], "failure": self.state.failure}
        steps, finished = self.state.plan_steps(max_steps)
        return {"steps": steps, "finished": finished, "failure": None}

    def ack(self, rank: int, step: int, cp_rank: int = 0, durable: bool = False) -> dict:
        before = self.state.durable_step
        try:
            committed = self.state.ack(rank, step, cp_rank, durable)
        except ValueError as err:
            return {"committed": self.state.committed, "error": str(err)}
        if self.state.durable_step > before and self.store is not None:
            self._wake.set()
        return {"committed": committed, "error": None}

    def snapshots(self) -> list[dict]:
        return list(self.snapshot_stats) if self.store is not None else []

    def tick(self, max_steps: int = 1) -> dict:
        """The driver's one call per loop: plan what it can, then say which units to load next
        and the status (acks, rewinds), in one round trip instead of three."""
        out = self.plan(max_steps)
        out["wanted"] = [] if out.get("failure") else self.wanted()
        out["status"] = self.status()
        return out

    def status(self) -> dict:
        return {**self.state.status(), "rewinds": [[r, c, s, g] for (r, c), (s, g) in self.rewinds.items()]}

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
                        "dropped": self.state.dropped_ids(entry["dropped"]).tobytes(),
                    }
                )
        return out

    def rewind(self, rank: int, cp_rank: int, step: int) -> dict:
        """A restarted trainer (rank, cp rank) needs its stream again from ``step`` (not yet
        acknowledged, so its batch is still held). Returns the new generation of its queue: the
        driver re-sends descriptors from ``step`` tagged with it, and older ones are ignored."""
        if step <= self.state.acked[rank * self.state.topology.cp + cp_rank]:
            return {"error": f"rank {rank} cp rank {cp_rank} already acknowledged step {step}; it cannot be sent again", "generation": None}
        gen = self.rewinds.get((rank, cp_rank), (0, 0))[1] + 1
        self.rewinds[(rank, cp_rank)] = (step, gen)
        return {"error": None, "generation": gen}

    def fail(self, message: str) -> None:
        if not self.state.failure:
            self.state.failure = message


def queue_prefix(run_id: str) -> str:
    return f"overlord-{run_id}"


def rank_queue_name(run_id: str, rank: int, cp_rank: int = 0) -> str:
    return f"{queue_prefix(run_id)}-rank-{rank}" + (f"-cp-{cp_rank}" if cp_rank else "")
