"""The planner as a Dask scheduler plugin: one central, metadata-only controller per service.

Routes are listed in ``protocol.py``. How the control path is kept off the scheduler's event loop
and O(1) per step (it was O(dp) RPCs and tasks per step, and a 130-160 ms planning window blocked
every queue get, ack and heartbeat):

- **One planner thread owns the state.** Planning (hand-out of steps, and balancing the next
  windows *ahead* of hand-out), loaded lengths, live updates, snapshots' state capture and the
  inspection routes run there, serialised, through a one-thread executor; handlers on the event
  loop only await it. Acks (a few list writes) stay on the loop.
- **Event-driven.** Load tasks report their lengths on the worker's stream
  (``overlord_lengths``); an ack that moves the committed step, new lengths or an update wake the
  planner; planning results wake the driver's long poll (``overlord_work``); a constructor task
  reaching memory (the ``transition`` hook) puts its descriptors straight into the ranks'
  ``distributed.Queue``s in this process, with the workers that hold it. Nothing polls.
- **Chunks.** Steps are handed out ``chunk_steps`` at a time (``loading.batch_steps``, default
  a quarter of ``prefetch_steps`` raised to ~1M tokens, at most half of it:
  ``chunks.chunk_steps``); one constructor task builds a chunk for a group of ranks (as many
  groups as workers, so construction scales with them) and one queue item per rank names the
  whole chunk, so queue items, queue reads, constructor tasks and acks are per chunk, not per
  (step, rank).
- **Measured.** A watchdog coroutine measures how late the event loop wakes (``overlord_loop``).

With a checkpoint URL, every newly durable step is snapshotted asynchronously
(``snapshot_loop.py``).

The plugin keeps the routes, the planner thread and the scheduler's task events; its parts own
their state: ``state.PlannerState`` (the planner), ``channels.RankChannels`` (descriptors to the
ranks), ``held.HeldBatches`` (built batches until released, and their shadows),
``snapshot_loop.SnapshotLoop`` and ``watchdog.LoopWatch``; the read-only routes are a mixin
(``inspection.InspectionRoutes``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin

from .. import logs
from ..errors import PlanError
from ..plan.loading import plan_from_dict
from ..protocol import HANDLERS, STREAM_HANDLERS, load_prefix
from ..partition import UnitParts
from . import kernels, observe
from .channels import RankChannels, send
from .chunks import chunk_steps, chunk_tasks
from .held import HeldBatches
from .inspection import InspectionRoutes
from .signals import LoadSignals
from .snapshot_loop import SnapshotLoop
from .state import PlannerState
from .watchdog import LoopWatch

logger = logging.getLogger(__name__)
OBSERVE_EVERY_S = 0.5  # the dashboard page's view of the run is at most this old
GIL_SWITCH_S = 0.001  # how long the planner thread may hold the GIL while the event loop waits for it


class PlannerPlugin(InspectionRoutes, SchedulerPlugin):
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

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="overlord-planner")
        self._executor.submit(kernels.warm)  # the balancer's compiled loops, ready (or compiling) while the first units load
        plan = plan_from_dict(self.plan_dict, where="<service plan>")
        self.state = await self._run(PlannerState, plan, self.unit_first_ids, state=self.restore_state)
        topo, loading = plan.topology, plan.loading
        self.chunk_steps = chunk_steps(loading, topo)
        self.retries = loading.retries
        self._load_prefix = load_prefix(self.run_id)
        self.channels = RankChannels(scheduler.extensions["queues"], self.name, self.run_id, topo.dp, topo.cp)
        self.held = HeldBatches(scheduler, plan.loading.shadows, plan.loading.shadow_blocks)
        self.tasks = self.held.tasks  # constructor task key -> {"steps", "lo", "hi", "workers"}; until released
        self.acks = 0
        self._work = _Work()
        self.signals = LoadSignals()  # measured load costs and step rate, for the pool autoscaler
        self.scaling: dict | None = None  # the autoscaler's last decisions and history, as it reported them
        self._parts = UnitParts()  # lengths of units loaded in parts, until every part arrived
        self._stage = None  # the curriculum stage of the last step handed out (for the stage event)
        self.stop_requested = False
        self.observed: dict | None = None  # what /overlord and the Prometheus gauges show (observe.py)
        self.rank_wait: dict[tuple[int, int], tuple[float, float]] = {}  # (rank, cp rank) -> (seconds waiting, seconds since it attached)
        self._observed_at = -1e9
        self._work_event = asyncio.Event()
        self._kick = asyncio.Event()  # something may let the planner make progress
        self._inbox: deque = deque()  # reported lengths, drained by the planner thread
        self.watch = LoopWatch(on_tick=self._idle_tick)
        self.snapshots_loop = None
        self._background = [asyncio.create_task(self._plan_loop()), asyncio.create_task(self.watch.run())]
        if self.checkpoint_url:
            self.snapshots_loop = SnapshotLoop(self.checkpoint_url, self.storage_options, lambda: self._run(self.state.get_state), self.run_id,
                                               keep_bases=self.keep_bases, base_every_steps=self.base_every[0],
                                               base_every_seconds=self.base_every[1], seq=self.seq)
            self._background.append(asyncio.create_task(self.snapshots_loop.run()))
        for name in HANDLERS:
            scheduler.handlers[name] = getattr(self, name[len("overlord_") :])
        for name in STREAM_HANDLERS:  # never removed: a message for a handler that is gone drops the worker
            scheduler.stream_handlers[name] = functools.partial(_dispatch_stream, scheduler, name[len("overlord_") :])
        self._kick.set()
        logs.install()  # the scheduler's side of the shadow-copy races
        observe.install_page(scheduler)  # /overlord on the dashboard's HTTP server
        observe.install_gauges(scheduler)  # overlord_* on Dask's /metrics
        _freeze_heap()
        # The planner thread computes while the event loop needs the GIL for a few microseconds
        # at a time; at Python's default 5 ms switch interval every wake-up of the loop could wait
        # that long behind it (control_plane, dp 256, 3 runs each: loop block max 17-24 ms at
        # 5 ms, 16-19 ms at 1 ms). Restored when the run stops.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(GIL_SWITCH_S, self._switch_interval))

    async def stop(self) -> None:
        """Detach from the scheduler (it may host another run): the last snapshot is written,
        the routes and queues removed, the planner thread ended."""
        if getattr(self, "_executor", None) is None:
            return
        for t in self._background:
            t.cancel()
        if self.snapshots_loop is not None:
            try:
                await self.snapshots_loop.write()  # the last committed step, before the run goes
            except Exception:
                logger.exception("writing the final planner snapshot to %s failed", self.checkpoint_url)
        for name in HANDLERS:
            self.scheduler.handlers.pop(name, None)
        await self.channels.close(f"the overlord run {self.run_id} stopped")  # consumers learn that the run is gone
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None
        sys.setswitchinterval(self._switch_interval)

    async def close(self) -> None:
        await self.stop()

    async def _run(self, fn, *args, **kwargs):
        """Run ``fn`` in the planner thread (the one thread that touches the planner state)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    # ---- the planner thread's loop -------------------------------------------------------------
    async def _plan_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                out = await self._run(self._plan_work)
            except Exception as err:  # a bug or a misbehaving weight function: stop the run, say why
                logger.exception("overlord planner failed")
                self._set_failure(f"planning failed: {type(err).__name__}: {err}")
                return
            self._publish(out)
            if out.get("again"):
                self._kick.set()

    def _plan_work(self) -> dict:
        """(planner thread) Take in loaded lengths, hand out every chunk the prefetch bound
        allows, then plan windows ahead and ask for the units planning will need next."""
        st = self.state
        while self._inbox:
            st.add_lengths(*self._inbox.popleft())
        out = {"tasks": [], "loads": [], "finished": []}
        if st.failure:
            return out
        prefetch = st.plan.loading.prefetch_steps
        while prefetch - (st.next_step - st.committed) >= self.chunk_steps:
            steps, finished = st.plan_steps(self.chunk_steps)
            out["finished"] += finished
            if not steps:
                break
            for sp in steps:
                stage = st.metrics.get(sp["step"], {}).get("stage")
                if stage != self._stage:
                    logs.event("stage", self.run_id, sp["step"], stage=stage, previous=self._stage)
                    self._stage = stage
            out["tasks"] += chunk_tasks(steps, st.ledger, st.final_plan.topology, self.run_id)
        if out["tasks"]:
            # these chunks go to the workers first; the next window is balanced in the next round
            # (balancing one took ~90 ms of a 2-core machine's wall time, on the trainers' path)
            out["again"] = True
        else:
            st.plan_ahead(self.chunk_steps)  # the next chunk is balanced before anyone asks for it
        out["loads"] = st.wanted()
        now = time.monotonic()
        if now - self._observed_at > OBSERVE_EVERY_S:  # the dashboard page's and the gauges' view, refreshed
            self._observed_at = now
            self.observed = observe.snapshot(st, self.signals, run_id=self.run_id, scaling=self.scaling, snapshots=self.snapshots(),
                                             loop={"block_max_ms": round(self.watch.block_max * 1e3, 3)}, extra={"counters": self._counters(), "rank_wait_share": self._wait_shares()})
        return out

    def _publish(self, out: dict) -> None:
        for t in out["tasks"]:
            self.held.add(t["key"], [p["step"] for p in t["steps"]], t["ranks"][0], t["ranks"][1])
        self._work.add(out)
        if self._work:
            self._work_event.set()

    def _idle_tick(self) -> None:
        if time.monotonic() - self._observed_at > 2 * OBSERVE_EVERY_S:  # idle: the page's view still refreshes
            self._kick.set()

    def loop(self, reset: bool = False) -> dict:
        """How late the scheduler's event loop woke up (``watchdog.py``)."""
        return self.watch.figures(reset)

    # ---- worker stream ------------------------------------------------------------------------
    def lengths(self, run_id: str, source: str, epoch: int, unit: int, lengths: bytes, vision: bytes | None = None,
                seconds: float = 0.0, nbytes: int = 0, part: list | None = None, **_) -> None:
        """A load task's unit metadata (one-way, from the worker's stream); repeats are ignored."""
        if run_id != self.run_id:
            return
        v = None if vision is None else np.frombuffer(vision, dtype="<i8")
        lens = np.frombuffer(lengths, dtype="<i8")
        self.signals.loaded(source, seconds, int(lens.sum()), nbytes, len(lens))
        if part is not None:  # auto-partitioning: the unit counts once all its parts are in
            whole = self._parts.add((source, epoch, unit), part, lens, v)
            if whole is None:
                return
            lens, v = whole
        self._inbox.append((source, epoch, unit, lens, v))
        self._kick.set()

    # ---- task events (scheduler transitions, on the event loop) --------------------------------
    def transition(self, key, start, finish, *args, **kwargs) -> None:
        t = self.tasks.get(key)
        if t is None:
            if isinstance(key, str) and key.startswith(self._load_prefix):
                if finish == "erred":
                    self._set_failure(self._error_text(key))
                elif finish == "memory":
                    self.held.block_stored(key)
            return
        if finish == "memory":
            if self.held.stored(key):  # built: its ranks' descriptors go out
                for r in range(t["lo"], t["hi"]):
                    for j in range(self.state.final_plan.topology.cp):
                        self.channels.put(r, j, self.channels.descriptor(key, t, r, j))
        elif finish == "erred":
            self._set_failure(self._error_text(key, t))

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        """A worker left (or died): every trainer process hears it at once, so no fetch waits on
        a dead address (a refused connection is retried for Dask's whole connect timeout)."""
        self.channels.broadcast({"op": "worker_lost", "rank": None, "address": worker})
        logs.event("worker_lost", self.run_id, self.state.committed, worker=worker)

    def _error_text(self, key: str, task: dict | None = None) -> str:
        ts = self.scheduler.tasks.get(key)
        blame = (ts.exception_blame or ts) if ts is not None else None
        text = (blame.exception_text if blame is not None else None) or "unknown error"
        if blame is not None and isinstance(blame.key, str) and blame.key.startswith(self._load_prefix):
            return f"{text} (failed after {self.retries} retries)"
        steps = task["steps"] if task else "?"
        return f"building steps {steps} failed: {text}"

    def _set_failure(self, message: str) -> None:
        if self.state.failure:
            return
        self.state.failure = message
        logger.error("overlord run %s failed: %s", self.run_id, message)
        for (r, j) in self.channels.names:
            self.channels.put(r, j, {"error": message})
        self._work_event.set()

    # ---- routes -------------------------------------------------------------------------------
    async def work(self, timeout: float = 1.0) -> dict:
        """The driver's long poll: answers as soon as there is something to submit or release."""
        if not self._work and not self.state.failure:
            try:
                await asyncio.wait_for(self._work_event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        self._work_event.clear()
        out, self._work = self._work.take(), _Work()
        out.update(failure=self.state.failure, plan_version=self.state.plan_version,
                   load_costs={s: self.signals.seconds_per_doc(s) for s in self.signals.cost})  # for auto-partitioning
        return out

    # ---- consumer channels: descriptors pushed out, acks taken in, per process --------------------
    async def channel(self, comm, channel_id: str, run_id: str, **_) -> None:
        """A consumer process's stream (one per process and run, shared by its ranks): built
        batches' descriptors are pushed to subscribed ranks as the constructor tasks finish, and
        acks come back one-way, batched both ways (``channels.py``)."""
        if run_id != self.run_id:
            await comm.write([{"op": "error", "rank": None, "message": f"this scheduler runs overlord run {self.run_id}, not {run_id}"}])
            return
        await self.channels.serve(comm, channel_id, self._channel_ack)

    def _channel_ack(self, bs, rank: int, step: int, cp_rank: int = 0, durable: bool = False, wait_s: float | None = None,
                     since_s: float | None = None, **_) -> None:
        resp = self.ack(rank, step, cp_rank, durable, wait_s, since_s)
        if resp["error"]:
            send(bs, {"op": "error", "rank": rank, "cp_rank": cp_rank, "message": resp["error"]})

    def attach(self, rank: int, cp_rank: int = 0) -> dict:
        """A consumer joins as (rank, cp rank): it starts after the rank's last acknowledged step;
        descriptors of built batches from there are queued again under a new generation."""
        topo = self.state.final_plan.topology
        if not 0 <= rank < topo.dp or not 0 <= cp_rank < topo.cp:
            return {"error": f"rank {rank} cp rank {cp_rank} does not exist: the plan has dp={topo.dp}, cp={topo.cp}"}
        st = self.state
        i = rank * st.topology.cp + cp_rank
        first = max(st.replay_until, st.progress.acked[i] + 1 if i < len(st.progress.acked) else 0)
        gen = self.channels.reattach(rank, cp_rank)
        for key, t in self.tasks.items():
            if t["workers"] is not None and t["lo"] <= rank < t["hi"] and t["steps"][-1] >= first:
                self.channels.put(rank, cp_rank, self.channels.descriptor(key, t, rank, cp_rank))
        if gen > 1:  # a consumer came back (or another replaced it): its rank goes on from `first`
            logs.event("rank_rewind", self.run_id, first, rank=rank, cp_rank=cp_rank, generation=gen)
        return {"error": None, "first_step": first, "generation": gen}

    def ack(self, rank: int, step: int, cp_rank: int = 0, durable: bool = False, wait_s: float | None = None,
            since_s: float | None = None) -> dict:
        st = self.state
        self.acks += 1
        if wait_s is not None and since_s:  # the trainer's own count: time in next(), and its time, since it attached
            self.rank_wait[(rank, cp_rank)] = (wait_s, since_s)
        before, before_durable = st.committed, st.progress.durable_step
        try:
            committed = st.ack(rank, step, cp_rank, durable)
        except ValueError as err:
            return {"committed": st.committed, "error": str(err)}
        if st.progress.durable_step > before_durable and self.snapshots_loop is not None:
            self.snapshots_loop.wake()
        if committed > before:
            self._work.release += self.held.release_before(committed)
            self._work_event.set()
            self._kick.set()
        return {"committed": committed, "error": None}

    async def where(self, key: str, timeout: float = 5.0, run_id: str | None = None) -> dict:
        """Workers holding built batch ``key`` (waits up to ``timeout`` while it is rebuilt).
        A descriptor of another run (a consumer that has not noticed the restart yet) gets
        ``other_run``: it reconnects instead of failing."""
        if run_id is not None and run_id != self.run_id:
            return {"error": None, "workers": [], "other_run": True}
        return await self.held.where(key, timeout)

    async def update(self, plan: dict, at_step: int | None = None, unit_first_ids: dict | None = None) -> dict:
        """Apply a live plan update; with snapshots, answer only once a base holding it is written
        (so an acknowledged update survives a crash)."""
        try:
            new = plan_from_dict(plan, where="<plan update>")
            at = await self._run(self.state.update, new, at_step, unit_first_ids or {})
        except (PlanError, ValueError) as err:
            return {"error": str(err), "at_step": None, "version": self.state.plan_version}
        self._kick.set()
        logs.event("plan_update", self.run_id, at, version=self.state.plan_version)
        if self.snapshots_loop is not None:
            await self.snapshots_loop.write(force=True)
        return {"error": None, "at_step": at, "version": self.state.plan_version}

    def request_stop(self) -> dict:
        """Ask the process that runs this service (``overlord serve``) to stop cleanly: it sees
        ``stop_requested`` in the status, writes the last snapshot and retires its workers."""
        self.stop_requested = True
        logs.event("stop_requested", self.run_id, self.state.committed)
        return {"stop_requested": True}

    def fail(self, message: str) -> None:
        self._set_failure(message)


def _freeze_heap() -> None:
    """Move every object alive now (imports, Dask's and the plan's state) out of the garbage
    collector's sight. A full collection in the scheduler's process otherwise walks all of them
    and holds the event loop for ~100 ms (measured at dp 256: the loop's longest blocks were
    full collections); afterwards it walks only what was created since. Nothing is lost: frozen
    objects are merely never collected, and they are the process's long-lived ones."""
    gc.collect()
    gc.freeze()


def _dispatch_stream(scheduler, method: str, **msg) -> None:
    """Worker-stream messages go to the planner of their run; late ones (a load that finished
    after its run stopped) are dropped here instead of breaking the worker's connection."""
    plugin = scheduler.plugins.get(PlannerPlugin.name)
    if isinstance(plugin, PlannerPlugin) and getattr(plugin, "_executor", None) is not None:
        getattr(plugin, method)(**msg)


class _Work:
    """What the driver has to do next: loads and constructor tasks to submit, batches to release,
    blocks no later step needs."""

    __slots__ = ("loads", "tasks", "release", "finished")

    def __init__(self):
        self.loads, self.tasks, self.release, self.finished = [], [], [], []

    def add(self, out: dict) -> None:
        self.loads += out["loads"]
        self.tasks += out["tasks"]
        self.finished += out["finished"]

    def __bool__(self) -> bool:
        return bool(self.loads or self.tasks or self.release or self.finished)

    def take(self) -> dict:
        return {"loads": self.loads, "tasks": self.tasks, "release": self.release, "finished": self.finished}
