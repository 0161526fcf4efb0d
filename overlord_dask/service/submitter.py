"""The submitter: turns the planner's decisions into Dask tasks, and holds their futures.

It runs in the service process (next to the cluster object) because task submission needs a
Dask client, and it keeps loaded blocks and built batches alive on the workers by holding their
futures. It is event-driven: one long poll (``overlord_work``) answers as soon as the planner has
something for it, and each answer is acted on at once:

1. submit a load task per wanted unit, pinned to its source's pool when the plan uses pools
   (the block stays on its worker; the task itself reports the unit's lengths to the planner);
2. submit one constructor task per chunk of steps and group of ranks, whose arguments are the
   block futures its pieces live in (the planner puts the chunk's descriptor into each rank's
   queue when the task finishes: the submitter never touches a queue);
3. drop the futures of batches every rank has acknowledged and of blocks no later step needs.

A load or build that fails after its retries stops the run; the planner names the unit and its
file and tells every rank's queue, so no trainer hangs.
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import replace

from distributed import Client, Future

from .. import pieces as P
from ..batch_layout import BatchLayout
from ..client import BlockingPlannerClient
from ..loading.partition import partition
from ..loading.pools import pool_resource, uses_pools
from ..plan.io import plan_from_dict
from ..plan.versions import PlanVersions
from ..protocol import block_key, eval_key, load_key
from ..sources import discover_units
from ..sources.units import LoadUnit
from ..worker.constructors import BlockRefs, build_chunk
from ..worker.evaluation import build_eval
from ..worker.loaders import load_block, load_group
from . import holdout

logger = logging.getLogger(__name__)


class Submitter(threading.Thread):
    """The service's thread that submits and holds the run's tasks (``timeline``: the run's plan
    versions as the service started it; later versions are fetched when the planner has them)."""

    def __init__(
        self, client: Client, timeline: PlanVersions, run_id: str, units: dict[str, list[LoadUnit]], pad_id: int
    ):
        super().__init__(name=f"overlord-submitter-{run_id}", daemon=True)
        self.client = client
        self.planner = BlockingPlannerClient(client)
        self.plan = timeline.latest
        self.run_id = run_id
        self.pad_id = pad_id  # the tokenizer's: evaluation batches are padded with it
        self.units = dict(units)
        self._use_timeline(timeline)
        self.blocks: dict[str, Future] = {}
        self.batches: dict[str, Future] = {}
        self.error: str | None = None
        self._stop_event = threading.Event()
        self.rounds = 0
        self.loads = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.round()
        except Exception as err:  # anything unexpected must reach the trainers, not die silently
            if not self._stop_event.is_set():
                self.fail(f"{type(err).__name__}: {err}", traceback.format_exc())

    def fail(self, message: str, detail: str = "") -> None:
        logger.error("overlord run %s failed: %s\n%s", self.run_id, message, detail)
        self.error = message
        try:
            self.planner.fail(message)  # the planner tells every rank's queue
        except Exception:  # the scheduler may be gone as well
            logger.exception("could not report the failure to the consumers")
        self._stop_event.set()

    def _use_timeline(self, timeline: PlanVersions) -> None:
        """Adopt the run's plan versions: source indices, each source's slice of its newest plan
        (``plan.SourcePlan``: what its load tasks carry), its pool, and the units of sources that
        a live update added (indexed here, from file metadata)."""
        self.timeline = timeline
        self.src_index = {name: i for i, name in enumerate(timeline.source_names)}
        self.source_plan = {}  # source -> its slice of the plan (its load tasks carry it)
        self.resources = {}  # source -> the worker resource its loads need (its pool), or None
        for _, p in timeline.versions:
            for src in p.sources:
                self.source_plan[src.name] = p.source_plan(src.name, self.run_id)
                self.resources[src.name] = {pool_resource(src.pool_name): 1} if uses_pools(p) else None
                if src.name not in self.units:  # a source a live update added: its training units
                    self.units[src.name] = holdout.split(p.seed, src, discover_units(src, p))[0]
        self.plan_version = len(timeline.versions) - 1

    def _fetch_timeline(self) -> None:
        """A live update (from any client) added a plan version: learn it from the planner."""
        plans = [(at, plan_from_dict(d, where=f"<plan version from step {at}>")) for at, d in self.planner.plans()]
        self._use_timeline(PlanVersions(plans[0][1], plans[1:]))

    # ---- one round ----------------------------------------------------------------------------
    def round(self) -> None:
        """Wait for the planner's next decisions (long poll), then act on all of them."""
        self.rounds += 1
        work = self.planner.work(timeout=1.0)
        if work["failure"]:
            self.error = work["failure"]
            self._stop_event.set()
            return
        if work["plan_version"] != self.plan_version:
            self._fetch_timeline()
        self._submit_loads(work["loads"], work.get("load_costs"))
        self._submit_builds(work["tasks"])
        for key in work["release"]:
            self.batches.pop(key, None)
        for source, epoch, unit in work["finished"]:
            self.blocks.pop(block_key(self.src_index[source], epoch, unit), None)

    def _submit_loads(self, wanted: list, costs: dict | None = None) -> None:
        """Submit the wanted units' loads, cut into tasks by measured cost (``partition.py``):
        a block entry is a future, ``("parts", [futures])`` (one unit read in parts) or
        ``("group", i, future)`` (the i-th of several units one task read)."""
        target = self.plan.loading.task_seconds
        for task in partition(wanted, lambda s, u: self.units[s][u].n_docs, costs or {}, target):
            source = task.source
            sp = self.source_plan[source]
            # a unit asked for again (evicted between two cursors, say) may still be held under its
            # old key by a constructor that needs it: a new key makes the load run, and report, again
            self.loads += 1
            epoch, unit = task.units[0]
            key = f"{load_key(self.run_id, source, epoch, unit)}-n{self.loads}"
            opts = {"retries": self.plan.loading.retries, "pure": False, "resources": self.resources[source]}
            u = self.units[source][unit]
            if task.parts:
                futs = [
                    self.client.submit(
                        load_block,
                        sp,
                        u.to_dict(),
                        self.run_id,
                        epoch,
                        part,
                        key=f"{key}-p{part[0]}",
                        **opts,
                    )
                    for part in task.parts
                ]
                self.blocks[block_key(self.src_index[source], epoch, unit)] = ("parts", futs)
            elif len(task.units) > 1:
                fut = self.client.submit(
                    load_group,
                    sp,
                    [self.units[source][un].to_dict() for _, un in task.units],
                    self.run_id,
                    [e for e, _ in task.units],
                    key=f"{key}-g{len(task.units)}",
                    **opts,
                )
                for i, (e, un) in enumerate(task.units):
                    self.blocks[block_key(self.src_index[source], e, un)] = ("group", i, fut)
            else:
                self.blocks[block_key(self.src_index[source], epoch, unit)] = self.client.submit(
                    load_block, sp, u.to_dict(), self.run_id, epoch, key=key, **opts
                )

    def submit_eval(self, held: dict[str, list[LoadUnit]]) -> None:
        """Load the held-out units and build the evaluation batches from them (one task, kept
        for the run; ``worker/evaluation.py``). Their loads report nothing to the planner."""
        if not held:
            return
        plan, ev = self.plan, self.plan.evaluation
        names = sorted(held, key=self.src_index.get)  # the plan's source order
        weights = ev.weights or plan.declared_weights(0)
        total = sum(weights.get(n, 0.0) for n in names) or 1.0
        budgets = {
            self.src_index[n]: None if ev.tokens is None else int(ev.tokens * weights.get(n, 0.0) / total)
            for n in names
        }
        blocks = []
        for n in names:
            for u in held[n]:
                fut = self.client.submit(
                    load_block,
                    self.source_plan[n],
                    u.to_dict(),
                    key=f"overlord-evalload-{self.run_id}-{n}-{u.index}",
                    pure=False,
                )
                blocks.append((self.src_index[n], fut))
        layout = replace(
            BatchLayout.of(plan.topology, pad_id=self.pad_id, sources=self.timeline.sources()),
            micro_batches=ev.micro_batches,
            capacity=ev.tokens_per_micro_batch or plan.topology.tokens_per_micro_batch,
            cp=1,
        )
        self.eval_future = self.client.submit(
            build_eval, blocks, budgets, plan.topology.dp, layout, key=eval_key(self.run_id), pure=False
        )

    def _submit_builds(self, tasks: list) -> None:
        """One constructor task per chunk task of the planner, with the layout the planner gave it.

        Its blocks go as the distinct load futures they live in (a group's units share one) and
        a ``BlockRefs`` naming each unit's place among them: Dask walks, pickles and tracks every
        object of a task's arguments, and a chunk's task draws from hundreds of units."""
        for t in tasks:
            refs, deps = BlockRefs.of(
                {block_key(*u): self.blocks[block_key(*u)] for u in P.from_bytes(t["units"], 3).tolist()}
            )
            layout = BatchLayout.from_dict(t["layout"])
            self.batches[t["key"]] = self.client.submit(
                build_chunk, t["steps"], tuple(t["ranks"]), layout, refs, deps, key=t["key"], pure=False
            )
