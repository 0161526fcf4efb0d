"""The planner as a Dask scheduler plugin: one central, metadata-only controller per service.

Register with ``client.register_plugin(PlannerPlugin(plan, unit_first_ids, run_id))``. It starts
and composes the scheduler-side parts, each owning its state:

- ``planner_thread.PlannerThread``: the one thread that owns ``planner.PlannerState`` and plans a
  window ahead of hand-out, woken by events (lengths, acks, updates), never polling;
- ``routes.Routes``: the route table (name -> handler), bound to ``scheduler.handlers``;
- ``channels.RankChannels``: built batches' descriptors pushed to the trainers' processes;
- ``held.HeldBatches``: built batches until every rank acknowledged them, and their shadows;
- ``snapshot_loop.SnapshotLoop`` (with a checkpoint URL): snapshots in the background;
- ``watchdog.LoopWatch``: how late the event loop wakes.

This class keeps what is the scheduler's own: the lifecycle, the task events (a constructor task
in memory sends its descriptors out; a failed load or build stops the run, naming it), a lost
worker, and the run's failure. Central work stays per chunk of steps, never per (step, rank):
the design's control-path rule, measured by ``benchmarks/control_plane.py``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys

from distributed.diagnostics.plugin import SchedulerPlugin

from .. import logs
from ..loading.partition import UnitParts
from ..observe import dashboard, prometheus
from ..observe.http import link_from_dask_dashboard
from ..plan.base import resolve_url
from ..protocol import Route, load_prefix
from ..vocab import PAD_ID
from . import heap
from .channels import RankChannels
from .chunks import chunk_steps
from .dropped import DroppedData
from .held import HeldBatches
from .load_signals import LoadSignals
from .planner_thread import PlannerThread
from .rewinder import Rewinder
from .routes import Routes
from .snapshot_loop import SnapshotLoop
from .watchdog import LoopWatch

logger = logging.getLogger(__name__)
GIL_SWITCH_S = 0.001  # how long the planner thread may hold the GIL while the event loop waits for it


class PlannerPlugin(SchedulerPlugin):
    """The planner of one run on this scheduler (``name``: one run at a time)."""

    name = "overlord-planner"
    idempotent = True

    def __init__(
        self,
        plan,
        unit_first_ids: dict[str, list[int]],
        run_id: str,
        *,
        pad_id: int = PAD_ID,
        restore: dict | None = None,
        restore_seq: int = -1,
    ):
        self.plan = plan  # a plan.Plan: handed over once, pickled with the plugin
        self.unit_first_ids = unit_first_ids
        self.run_id = run_id
        self.pad_id = pad_id  # the tokenizer's (the service loads it): constructors pad with it
        ck = plan.checkpoint  # snapshots: where (resolved against the plan's folder) and how
        self.checkpoint_url = resolve_url(ck.url, plan.base_dir) if ck.url else None
        self.restore_state = restore
        self.seq = restore_seq  # last snapshot sequence number written (or restored)
        self.thread: PlannerThread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        plan = self.plan
        self.chunk_steps = chunk_steps(plan.loading, plan.topology)
        self.signals = LoadSignals()  # measured load costs and step rate, for the pool autoscaler
        self.parts = UnitParts()  # lengths of units loaded in parts, until every part arrived
        self.dropped = DroppedData()  # records dropped by prepare steps, units quarantined
        self.progress_history = dashboard.ProgressHistory()  # the page's tokens/s over time
        self.held = HeldBatches(
            scheduler, plan.loading.shadows, plan.loading.shadow_blocks, load_prefix(self.run_id), plan.loading.retries
        )
        self.routes = Routes(self)
        link_from_dask_dashboard(scheduler)  # Dask's own pages link to /overlord
        self.thread = PlannerThread(
            self.run_id,
            self.chunk_steps,
            pad_id=self.pad_id,
            on_tasks=self.held.add,
            observe=self._observe,
            on_failure=self.fail,
            on_decisions=self._decided,
            bins=plan.topology.dp * plan.topology.micro_batches,
        )
        planning = await self.thread.start(plan, self.unit_first_ids, self.restore_state)
        if self.thread.state.final_plan.topology != plan.topology:  # the snapshot's run changed dp
            plan = self.plan = self.thread.state.final_plan
            self.chunk_steps = self.thread.chunk_steps = chunk_steps(plan.loading, plan.topology)
        self.channels = RankChannels(
            plan.topology.dp,
            plan.topology.cp,
            backlog=self.routes.trainers.backlog,
            on_leave=self.routes.trainers.leave,
        )
        self.rewinder = Rewinder(self)  # rewinds: a job restarted from an older checkpoint, a skip
        self.watch = LoopWatch(on_tick=self._tick)
        self._background = [planning, asyncio.create_task(self.watch.run())]
        self.snapshots_loop = None
        if self.checkpoint_url:

            async def capture() -> dict:  # the planner state now (a rewind may have replaced it)
                return await self.thread.run(self.thread.state.get_state)

            async def settled(stored: int | None) -> list:  # what no restore or rewind can need any more
                def find():
                    st = self.thread.state
                    oldest = [s for s in (stored, st.windows.oldest) if s is not None]
                    return st.timeline.settled(min(oldest)) if oldest else []

                return await self.thread.run(find)

            async def drop(decisions: list) -> None:
                await self.thread.run(lambda: self.thread.state.timeline.drop(decisions))

            self.snapshots_loop = SnapshotLoop(
                self.checkpoint_url, plan.checkpoint, capture, self.run_id, seq=self.seq, settled=settled, drop=drop
            )
            self._background.append(asyncio.create_task(self.snapshots_loop.run()))
            self.thread.hold_decisions = True
        scheduler.handlers.update(self.routes.table())
        # never removed: a message for a stream handler that is gone drops the worker's connection
        scheduler.stream_handlers[Route.LENGTHS] = functools.partial(_dispatch_lengths, scheduler)
        logs.install()  # the scheduler's side of the shadow-copy races
        prometheus.install(scheduler)  # overlord_* on Dask's /metrics
        heap.freeze()
        # The planner thread computes while the event loop needs the GIL for a few microseconds
        # at a time; at Python's default 5 ms switch interval every wake-up of the loop could
        # wait that long behind it (control_plane benchmark: loop block max). Restored at stop.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(GIL_SWITCH_S, self._switch_interval))

    async def stop(self) -> None:
        """Detach from the scheduler (it may host another run): the last snapshot is written,
        the routes and queues removed, the planner thread ended."""
        if self.thread is None:
            return
        for t in self._background:
            t.cancel()
        if self.snapshots_loop is not None:
            try:
                await self.snapshots_loop.write()  # the last committed step, before the run goes
            except Exception:
                logger.exception("writing the final planner snapshot to %s failed", self.checkpoint_url)
        for name in self.routes.table():
            self.scheduler.handlers.pop(name, None)
        # consumers learn that the run is gone; with snapshots it may come back (a resubmitted service job)
        await self.channels.close(f"the overlord run {self.run_id} stopped", resumable=self.snapshots_loop is not None)
        self.thread.stop()
        self.thread = None
        sys.setswitchinterval(self._switch_interval)

    async def close(self) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self.thread is not None

    @property
    def observed(self) -> dict | None:
        """The run as the dashboard and the gauges show it (refreshed by the planner thread)."""
        return self.thread.observed if self.thread is not None else None

    def _tick(self) -> None:
        """(event loop, every watchdog tick) An idle run's view refreshed; what a step waits on;
        acknowledgements a restored planner was not ready for."""
        self.thread.idle_tick()
        self.routes.service.refresh_waiting()
        if self.routes.trainers.early:
            self.routes.trainers.catch_up()

    def _observe(self) -> dict:
        """(planner thread) The dashboard's view of the run."""
        return dashboard.snapshot(
            self.thread.state,
            self.signals,
            run_id=self.run_id,
            scaling=self.routes.service.scaling,
            snapshots=self.routes.service.snapshots(),
            loop={"block_max_ms": round(self.watch.block_max * 1e3, 3)},
            history=self.progress_history,
            extra={
                "stop_requested": self.routes.service.stop_requested,
                "snapshot_error": self.snapshots_loop.error if self.snapshots_loop is not None else None,
                "counters": self.routes.service.counters(),
                "rank_wait_share": self.routes.trainers.wait_shares(),
                "timings": self.routes.trainers.timings.snapshot(),
                "dropped": self.dropped.status(),
                "feedback": self.thread.feedback_status(),
                "waiting": self.routes.service.blocked_view,
            },
        )

    def _decided(self, decisions: list) -> None:
        """(event loop) The planner decided from the trainers' reports: log it; with snapshots,
        the steps it governs wait until a snapshot holds it (as a live update's caller does)."""
        for d in decisions:
            logs.event("decision", self.run_id, d.at, kind=d.kind, reason=d.reason)
        if self.snapshots_loop is not None:
            self._background.append(asyncio.create_task(self._snapshot_decisions(self.thread.decided)))
            self._background = [t for t in self._background if not t.done()]

    async def _snapshot_decisions(self, decided: int) -> None:
        try:
            await self.snapshots_loop.write(force=True)
        except Exception:  # the snapshot loop reports it (status snapshot_error); planning must not stall on it
            logger.exception("writing the snapshot that holds the planner's decisions failed")
        self.thread.release_hold(decided)

    # ---- task events (scheduler transitions, on the event loop) --------------------------------
    def transition(self, key, start, finish, *args, **kwargs) -> None:
        t = self.held.tasks.get(key)
        if t is None:
            if self.held.is_load(key):
                if finish == "erred":
                    self.fail(self._error_text(key))
                elif finish == "memory":
                    self.held.block_stored(key)
            return
        if finish == "memory":
            if self.held.stored(key):  # built: its ranks' descriptors go out
                self.channels.deliver(t["lo"], t["hi"], self.channels.descriptor(key, t, self.run_id))
        elif finish == "erred":
            self.fail(self._error_text(key, t))

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        """A worker left (or died): every trainer process hears it at once, so no fetch waits on
        a dead address (a refused connection is retried for Dask's whole connect timeout)."""
        self.channels.broadcast({"op": "worker_lost", "rank": None, "address": worker})
        logs.event("worker_lost", self.run_id, self.thread.state.committed, worker=worker)

    def _error_text(self, key: str, task: dict | None = None) -> str:
        ts = self.scheduler.tasks.get(key)
        blame = (ts.exception_blame or ts) if ts is not None else None
        text = (blame.exception_text if blame is not None else None) or "unknown error"
        if blame is not None and self.held.is_load(blame.key):
            return f"{text} (failed after {self.plan.loading.retries} retries)"
        steps = task["steps"] if task else "?"
        return f"building steps {steps} failed: {text}"

    def fail(self, message: str) -> None:
        """Stop the run: every rank's queue and the submitter hear ``message``."""
        state = self.thread.state
        if state.failure:
            return
        state.failure = message
        logger.error("overlord run %s failed: %s", self.run_id, message)
        self.channels.deliver(0, self.channels.dp, {"error": message})
        self.thread.work_ready.set()


def _dispatch_lengths(scheduler, **msg) -> None:
    """Worker-stream reports go to the planner of their run; late ones (a load that finished
    after its run stopped) are dropped here instead of breaking the worker's connection."""
    plugin = scheduler.plugins.get(PlannerPlugin.name)
    if isinstance(plugin, PlannerPlugin) and plugin.running:
        plugin.routes.service.lengths(**msg)
