"""The one thread that owns the planner state, and the loop on the scheduler's event loop that
feeds it.

Planning (handing out steps, balancing the next windows ahead of hand-out), loaded lengths, live
updates, snapshot capture and the read-only views run here, serialised through a one-thread
executor, so no handler on the event loop waits on a planning step and no view is torn by one.
The loop is event-driven: reported lengths, acks that move the committed step and updates
:meth:`PlannerThread.wake` it; what a round produces (loads and constructor tasks to submit,
batches and blocks to release) waits in :class:`Work` for the submitter's long poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .. import logs
from ..allocator import keep_large_arrays
from ..batch_layout import BatchLayout
from ..planner.feedback import FeedbackLoop
from ..planner.policies import balancer_process, kernels
from ..planner.state import PlannerState
from . import heap
from .chunks import chunk_tasks
from .inbox import ReportInbox

logger = logging.getLogger(__name__)
OBSERVE_EVERY_S = 0.5  # the dashboard page's view of the run is at most this old


class Work:
    """What the submitter has to do next: loads and constructor tasks to submit, batches to
    release, blocks no later step needs."""

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


def warm(bins: int | None) -> None:
    """Prepare this process for planning steps of ``bins`` (dp × micro-batches): where they are
    large, load (or compile) the balancer's kernels (``kernels.warm``) and let its large arrays
    come from the heap (``allocator.keep_large_arrays``); then freeze the objects that brought
    (``heap.py``): numba's registries are most of a full collection's walk otherwise."""
    kernels.warm(bins)
    if kernels.worth_compiling(bins):
        keep_large_arrays()
    heap.freeze()


def _start_balancer(bins: int | None) -> balancer_process.BalancerProcess | None:
    """The balancer's process for steps of ``bins`` bins, in use (``balancer_process.wanted``),
    or None: the planner thread balances itself (also where the process cannot start)."""
    if not balancer_process.wanted(bins):
        return None
    try:
        process = balancer_process.BalancerProcess()
    except OSError:
        logger.warning("the balancer process did not start: the planner thread balances", exc_info=True)
        return None
    balancer_process.use(process)
    return process


class PlannerThread:
    """Runs the planner state's work in its own thread; ``on_tasks(key, steps, lo, hi, skip)`` learns
    each constructor task handed out, ``observe()`` (called in the thread every
    ``OBSERVE_EVERY_S``) refreshes the dashboard's view, ``on_failure(message)`` stops the run,
    ``on_decisions(decisions)`` learns the planner's own decisions (``planner/feedback.py``:
    from the trainers' reports, which ``feedback_in`` queues). ``bins`` (dp × micro-batches)
    decides whether the balancer's kernels are compiled (``kernels.warm``)."""

    def __init__(
        self,
        run_id: str,
        chunk_steps: int,
        *,
        pad_id: int,
        on_tasks: Callable,
        observe: Callable[[], dict],
        on_failure: Callable[[str], None],
        on_decisions: Callable[[list], None] = lambda d: None,
        bins: int | None = None,
    ):
        self.run_id, self.chunk_steps, self.pad_id = run_id, chunk_steps, pad_id
        self.on_tasks, self.observe, self.on_failure, self.on_decisions = on_tasks, observe, on_failure, on_decisions
        self.feedback_in = ReportInbox()
        self.feedback: FeedbackLoop | None = None
        self.hold_decisions = False  # (with snapshots) no step a decision governs goes out before a snapshot holds it
        self.held_from: int | None = None  # the earliest step of decisions no snapshot holds yet
        self.decided = 0  # decisions made so far (what a snapshot written since holds)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="overlord-planner")
        self.balancer = _start_balancer(bins)  # large steps: windows placed on a core of their own
        # the balancer's compiled loops (where worth it), ready (or compiling) while the first units load
        self.executor.submit(warm, bins)
        self.state: PlannerState | None = None
        self.rewinds = 0  # times the run was rewound (a new planner state each time)
        self.observed: dict | None = None  # what /overlord and the Prometheus gauges show (observe.dashboard)
        self.work = Work()
        self.work_ready = asyncio.Event()
        self._kick = asyncio.Event()  # something may let the planner make progress
        self._inbox: deque = deque()  # reported lengths, drained by the planner thread
        self._stage = None  # the curriculum stage of the last step handed out (for the stage event)
        self._observed_at = -1e9

    async def start(self, plan, unit_first_ids: dict, restore: dict | None) -> asyncio.Task:
        self.state = await self.run(PlannerState, plan, unit_first_ids, state=restore)
        self.feedback = FeedbackLoop(self.state)
        self._kick.set()
        return asyncio.create_task(self._loop())

    def stop(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.balancer is not None:
            balancer_process.stop_using(self.balancer)
            self.balancer.close()

    async def run(self, fn, *args, **kwargs):
        """Run ``fn`` in the planner thread (the one thread that touches the planner state)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    def wake(self) -> None:
        self._kick.set()

    def replace_state(self, state: PlannerState, chunk_steps: int) -> list[str]:
        """(planner thread) Plan with ``state`` from now on (a rewind); the work not taken yet
        is dropped, and the keys of its constructor tasks returned."""
        self.state, self.chunk_steps = state, chunk_steps
        self.rewinds += 1
        if self.feedback is not None:
            self.feedback.rewound(state)
        return [t["key"] for t in self.work.tasks]

    def restart_work(self, release: list[str]) -> None:
        """(event loop, after :meth:`replace_state`) Start the submitter's work afresh: it only
        drops the batches in ``release``."""
        self.work = Work()
        self.work.release += release
        self.work_ready.set()
        self._kick.set()

    def add_lengths(self, source: str, epoch: int, unit: int, lengths, vision, masked=None) -> None:
        """(event loop) A loaded unit's metadata, taken in by the next planning round."""
        self._inbox.append((source, epoch, unit, lengths, vision, masked))
        self._kick.set()

    def release(self, keys: list[str]) -> None:
        """(event loop) Built batches every rank acknowledged: the submitter drops them."""
        self.work.release += keys
        self.work_ready.set()
        self._kick.set()

    def idle_tick(self) -> None:
        if time.monotonic() - self._observed_at > 2 * OBSERVE_EVERY_S:  # idle: the page's view still refreshes
            self._kick.set()

    async def next_work(self, timeout: float) -> dict:
        """The submitter's long poll: answers as soon as there is something to submit or release."""
        if not self.work and not self.state.failure:
            try:
                await asyncio.wait_for(self.work_ready.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        self.work_ready.clear()
        out, self.work = self.work.take(), Work()
        return out

    async def _loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                out = await self.run(self._plan_work)
            except Exception as err:  # a bug or a misbehaving weight function: stop the run, say why
                logger.exception("overlord planner failed")
                self.on_failure(f"planning failed: {type(err).__name__}: {err}")
                return
            if out["rewinds"] != self.rewinds:
                continue  # planned by a state a rewind has replaced since (the rewind kicks a new round)
            for t in out["tasks"]:
                self.on_tasks(t["key"], [p["step"] for p in t["steps"]], t["ranks"][0], t["ranks"][1], t.get("skip"))
            self.work.add(out)
            if out.get("decisions"):
                self.on_decisions(out["decisions"])
            if self.work:
                self.work_ready.set()
            if out.get("again"):
                self._kick.set()

    def _plan_work(self) -> dict:
        """(planner thread) Take in loaded lengths, hand out every chunk the prefetch bound
        allows, then plan windows ahead and ask for the units planning will need next."""
        st = self.state
        while self._inbox:
            st.add_lengths(*self._inbox.popleft())
        out = {"tasks": [], "loads": [], "finished": [], "rewinds": self.rewinds}
        if st.failure:
            return out
        reports = self.feedback_in.drain()
        if reports:
            self.feedback.take(st, reports)
            out["decisions"] = decided = self.feedback.decide(st)
            for d in decided:
                self._hold(d)
        prefetch = st.plan.loading.prefetch_steps
        while prefetch - st.steps_ahead() >= self.chunk_steps:
            if self.held_from is not None and st.next_step + self.chunk_steps > self.held_from:
                break  # until the snapshot holding the decision is written (release_hold)
            steps, finished = st.plan_steps(self.chunk_steps)
            out["finished"] += finished
            if not steps:
                break
            self._log_stages(steps)
            layout = BatchLayout.of(st.final_plan.topology, pad_id=self.pad_id, sources=st.timeline.sources())
            out["tasks"] += chunk_tasks(steps, st.ledger, st.final_plan.topology, layout, self.run_id, self.rewinds)
        if out["tasks"]:
            # these chunks go to the workers first; the next window is balanced in the next
            # round, off the trainers' path
            out["again"] = True
        else:
            st.plan_ahead(self.chunk_steps)  # the next chunk is balanced before anyone asks for it
        out["loads"] = st.wanted()
        now = time.monotonic()
        if now - self._observed_at > OBSERVE_EVERY_S:  # the dashboard page's and the gauges' view, refreshed
            self._observed_at = now
            try:
                self.observed = self.observe()
            except RuntimeError:  # a view walked a dict the event loop grows: a bug (copy it first), not a stop
                logger.warning("refreshing the dashboard's view failed; it is refreshed again shortly", exc_info=True)
        return out

    def record(self, kind: str, at: int, values: dict, reason: str):
        """(planner thread) Record a decision of the run's operator (a skip) in the timeline, held
        like the planner's own until a snapshot holds it."""
        d = self.state.timeline.decide(kind, at, values, reason)
        self._hold(d)
        return d

    def _hold(self, d) -> None:
        """A decision was recorded: with snapshots, no step it governs goes out before a snapshot
        holds it (a crash before would otherwise lose what those steps were planned by)."""
        self.decided += 1
        if self.hold_decisions:
            self.held_from = d.at if self.held_from is None else min(self.held_from, d.at)

    def release_hold(self, decided: int) -> None:
        """(event loop) A snapshot holding the first ``decided`` decisions is written: the steps
        they govern may go out (unless newer ones wait for their own snapshot)."""
        if decided >= self.decided:
            self.held_from = None
        self._kick.set()

    def balancer_status(self) -> dict | None:
        """(planner thread) The balancer's process (``balancer_process.py``), None where the
        thread balances."""
        b = self.balancer
        if b is None:
            return None
        return {
            "pid": b.proc.pid,
            "ready": b.available(),  # (False while it starts, and once it is gone)
            "windows_in_process": b.remote,
            "windows_here": b.local,
        }

    def feedback_status(self) -> dict:
        """(planner thread) What the trainers reported and what the planner made of it."""
        return {
            **self.feedback.status(self.state),
            "received": self.feedback_in.received,
            "dropped": self.feedback_in.dropped,
        }

    def _log_stages(self, steps: list[dict]) -> None:
        for sp in steps:
            stage = self.state.metrics.get(sp["step"], {}).get("stage")
            if stage != self._stage:
                logs.event("stage", self.run_id, sp["step"], stage=stage, previous=self._stage)
                self._stage = stage
