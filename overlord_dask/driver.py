"""The driver: the loop that turns the planner's decisions into Dask tasks and queue entries.

It runs in the service process (next to the cluster object), talks to the planner only through its
scheduler handlers, and holds the futures that keep blocks and batches alive on the workers:

1. forward finished lengths to ``overlord_add_lengths``;
2. call ``overlord_tick`` once: it plans what it can and answers with the new steps, the units
   to load next and the status (acks, rewinds);
3. submit a load task (block stays on its worker) plus a tiny lengths task per wanted unit, and
   one constructor task per (step, rank) of each new step, whose arguments are the block futures
   its pieces live in; drop the block futures of units no later step needs;
4. put each rank's finished batches, in step order, into its ``distributed.Queue`` as a descriptor
   of a few hundred bytes (batch key and the worker holding it); the consumer fetches the batch
   from that worker directly (``batch_server``);
5. release a rank's batch future once that rank has acknowledged the step.

A task that fails after its retries stops the run: the error names the unit's source and file, is
recorded in the planner (``overlord_fail``) and is put into every rank's queue so no trainer hangs.
"""

from __future__ import annotations

import logging
import threading
import traceback

import numpy as np
from distributed import Client, Future, Queue

from .constructors import block_key, build_rank_batch
from .loaders import batch_key, block_lengths, lengths_key, load_block, load_key
from .plan.loading import plan_from_dict
from .plan.models import Plan
from .plan.timeline import PlanTimeline
from .planner.plugin import rank_queue_name
from .sources import discover_units
from .sources.units import LoadUnit

logger = logging.getLogger(__name__)


class Driver(threading.Thread):
    def __init__(self, client: Client, plan: Plan, run_id: str, units: dict[str, list[LoadUnit]]):
        super().__init__(name=f"overlord-driver-{run_id}", daemon=True)
        self.client = client
        self.plan = plan
        self.run_id = run_id
        self.units = dict(units)
        self.plan_version = -1
        self._sync_plans()
        self.dp = plan.topology.dp
        self.blocks: dict[str, Future] = {}
        self.pending_lengths: dict[tuple[str, int, int], Future] = {}
        self.batches: dict[tuple[int, int], Future] = {}
        first = self._rpc("overlord_info")["first_step"]  # > 0 after a restore from a snapshot
        self.next_put = [first] * self.dp
        self.generation: dict[tuple[int, int], int] = {}  # (rank, cp) -> generation of its queue
        self.cp = plan.topology.cp
        self.queues = [[Queue(rank_queue_name(run_id, r, j), client=client) for j in range(self.cp)] for r in range(self.dp)]
        self.error: str | None = None
        self._stop_event = threading.Event()
        self.ticks = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                if not self.tick():
                    self._stop_event.wait(0.005)
        except Exception as err:  # anything unexpected must reach the trainers, not die silently
            if not self._stop_event.is_set():
                self.fail(f"{type(err).__name__}: {err}", traceback.format_exc())

    def fail(self, message: str, detail: str = "") -> None:
        logger.error("overlord run %s failed: %s\n%s", self.run_id, message, detail)
        self.error = message
        try:
            self._rpc("overlord_fail", message=message)
            for qs in self.queues:
                for q in qs:
                    q.put({"error": message})
        except Exception:  # the scheduler may be gone as well
            logger.exception("could not report the failure to the consumers")
        self._stop_event.set()

    def _rpc(self, name: str, **kwargs):
        return self.client.sync(getattr(self.client.scheduler, name), **kwargs)

    def _sync_plans(self) -> None:
        """Learn the run's plan versions from the planner: source indices, and the units of
        sources that a live update added (indexed here, from file metadata)."""
        versions = self._rpc("overlord_plans")
        plans = [(at, plan_from_dict(d, where=f"<plan version from step {at}>")) for at, d in versions]
        timeline = PlanTimeline(plans[0][1], plans[1:])
        self.src_index = {name: i for i, name in enumerate(timeline.source_names)}
        self.source_plan = {}  # source -> (cache key, plan dict) its load tasks use
        for v, (_, p) in enumerate(plans):
            for src in p.sources:
                self.source_plan[src.name] = (f"{self.run_id}-v{v}", versions[v][1])
                if src.name not in self.units:
                    self.units[src.name] = discover_units(src, p)
        self.plan_version = len(plans) - 1
        self.multimodal = any(timeline.source(n).images_field for n in timeline.source_names)  # batches carry image fields

    # ---- one iteration ------------------------------------------------------------------------
    def tick(self) -> bool:
        """One round trip to the planner (``overlord_tick``: plan, then wanted units and status),
        then the work it implies."""
        self.ticks += 1
        busy = self._forward_lengths()
        resp = self._rpc("overlord_tick", max_steps=self.plan.loading.prefetch_steps)
        if resp["status"]["plan_version"] != self.plan_version:
            self._sync_plans()
        busy |= self._submit_loads(resp["wanted"])
        busy |= self._plan_and_build(resp)
        busy |= self._enqueue_ready()
        busy |= self._release_acked(resp["status"])
        return busy

    def _submit_loads(self, wanted: list) -> bool:
        for source, epoch, unit in wanted:
            u = self.units[source][unit]
            cache_key, plan_dict = self.source_plan[source]
            fut = self.client.submit(
                load_block, plan_dict, cache_key, u.to_dict(),
                key=load_key(self.run_id, source, epoch, unit), retries=self.plan.loading.retries, pure=False,
            )
            self.blocks[block_key(self.src_index[source], epoch, unit)] = fut
            self.pending_lengths[(source, epoch, unit)] = self.client.submit(
                block_lengths, fut, key=lengths_key(self.run_id, source, epoch, unit), pure=False
            )
        return bool(wanted)

    def _forward_lengths(self) -> bool:
        done = [(k, f) for k, f in self.pending_lengths.items() if f.status in ("finished", "error", "cancelled")]
        for (source, epoch, unit), fut in done:
            del self.pending_lengths[(source, epoch, unit)]
            if fut.status != "finished":
                u = self.units[source][unit]
                exc = fut.exception() if fut.status == "error" else "cancelled"
                raise LoadFailed(f"loading {u.describe()} failed after {self.plan.loading.retries} retries: {exc}")
            meta = fut.result()
            self._rpc("overlord_add_lengths", source=source, epoch=epoch, unit=unit, lengths=meta["lengths"], vision=meta["vision"])
        return bool(done)

    def _plan_and_build(self, resp: dict) -> bool:
        if resp.get("failure"):
            raise LoadFailed(resp["failure"])
        topo = self.plan.topology
        for step_plan in resp["steps"]:
            step = step_plan["step"]
            for rank, mbs in enumerate(split_step(step_plan, topo.dp, topo.micro_batches)):
                units = np.unique(np.concatenate(mbs)[:, :3], axis=0)
                blocks = {block_key(*map(int, u)): self.blocks[block_key(*map(int, u))] for u in units}
                self.batches[(step, rank)] = self.client.submit(
                    build_rank_batch, step, rank, mbs, blocks,
                    topo.tokens_per_micro_batch, step_plan.get("piece_tokens", topo.piece_tokens), topo.cp, topo.cp_split_tokens, self.multimodal,
                    key=batch_key(self.run_id, step, rank), pure=False,
                )
        for source, epoch, unit in resp["finished"]:
            self.blocks.pop(block_key(self.src_index[source], epoch, unit), None)
        return bool(resp["steps"])

    def _enqueue_ready(self) -> bool:
        ready: list[tuple[int, Future]] = []
        for rank in range(self.dp):
            step = self.next_put[rank]
            while True:
                fut = self.batches.get((step, rank))
                if fut is None or fut.status == "pending":
                    break
                if fut.status != "finished":
                    raise LoadFailed(f"building step {step} for rank {rank} failed: {fut.exception()}")
                ready.append((rank, fut))
                step += 1
        if not ready:
            return False
        where = self.client.who_has([f for _, f in ready])  # one scheduler call for all of them
        for rank, fut in ready:
            step = self.next_put[rank]
            for j, q in enumerate(self.queues[rank]):
                q.put(self._descriptor(step, rank, fut, where, self.generation.get((rank, j), 0)))
            self.next_put[rank] += 1
        return True

    def _release_acked(self, status: dict) -> bool:
        self._rewind(status["rewinds"])
        per_cp = status["acked"]
        acked = [min(per_cp[r * self.cp : (r + 1) * self.cp]) for r in range(self.dp)]  # every CP rank is done
        gone = [k for k in self.batches if k[0] <= acked[k[1]] and k[0] < self.next_put[k[1]]]
        for k in gone:
            del self.batches[k]
        return bool(gone)

    def _rewind(self, rewinds: list) -> None:
        """Re-send a restarted trainer's descriptors from the step it asked for, new generation."""
        for rank, j, step, gen in rewinds:
            if self.generation.get((rank, j), 0) >= gen:
                continue
            self.generation[(rank, j)] = gen
            futs = [(s, self.batches[(s, rank)]) for s in range(step, self.next_put[rank]) if (s, rank) in self.batches]
            where = self.client.who_has([f for _, f in futs]) if futs else {}
            for s, fut in futs:
                self.queues[rank][j].put(self._descriptor(s, rank, fut, where, gen))

    def _descriptor(self, step: int, rank: int, fut: Future, where: dict, gen: int) -> dict:
        """A queue item: a few hundred bytes naming the batch and the workers that hold it."""
        return {"step": step, "rank": rank, "key": fut.key, "workers": list(where.get(fut.key, ())), "run_id": self.run_id, "gen": gen}



class LoadFailed(Exception):
    pass


def split_step(step_plan: dict, dp: int, micro_batches: int) -> list[list[np.ndarray]]:
    """Decode a planned step into ``[rank][micro_batch] -> int64 rows [n, 6]``."""
    pieces = np.frombuffer(step_plan["pieces"], dtype="<i8").reshape(-1, 6)
    slot = np.frombuffer(step_plan["slot"], dtype="<i4").reshape(-1, 2)
    flat = slot[:, 0].astype(np.int64) * micro_batches + slot[:, 1]
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(dp * micro_batches + 1))
    return [[pieces[order[bounds[r * micro_batches + m] : bounds[r * micro_batches + m + 1]]] for m in range(micro_batches)] for r in range(dp)]
