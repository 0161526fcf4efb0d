"""What the workers hold for the run: built batches (constructor tasks) until every rank has
acknowledged their steps, and their shadow copies.

Each constructor task is tracked from hand-out to release: the steps and ranks it builds and the
workers that hold its result once it is in memory (what a descriptor names). With ``shadows``,
a built batch (and with ``shadow_blocks`` a loaded block) is copied to more workers in the
background, so a lost worker costs a fetch from the copy rather than a rebuild or a reload.
"""

from __future__ import annotations

import asyncio
import logging
import re

logger = logging.getLogger(__name__)

LOAD_KEY = re.compile(r"^(?P<source>.+)-e(?P<epoch>\d+)-u(?P<unit>\d+)-n\d+")  # after the run's load prefix


def holders(ts) -> list[str]:
    """Addresses of the workers holding a task's result (none unless it is in memory)."""
    return [ws.address for ws in ts.who_has] if ts is not None and ts.state == "memory" else []


def held_bytes(tasks: list, name: str, shadow_name: str) -> dict:
    """Bytes of ``tasks`` (in memory) on their first holders, and what their other copies add."""
    return {
        name: sum(ts.nbytes for ts in tasks),
        shadow_name: sum(ts.nbytes * max(0, len(ts.who_has) - 1) for ts in tasks),
    }


class HeldBatches:
    def __init__(self, scheduler, shadows: int, shadow_blocks: bool, load_prefix: str, retries: int | None = None):
        self.scheduler = scheduler
        self.retries = retries  # loading.retries: what a task's remaining retries are counted from
        self.load_prefix = load_prefix  # the run's load tasks' keys start with it
        self.shadows = shadows  # extra copies of each built batch
        self.shadow_blocks = shadows if shadow_blocks else 0  # ... and of each loaded block
        self.tasks: dict[str, dict] = {}  # constructor task key -> {"steps", "lo", "hi", "workers"}; until released
        self.counts = {"shadowed": 0, "blocks_shadowed": 0}
        self._built: dict[str, asyncio.Event] = {}  # keys someone waits on (where)
        self._copies: set = set()

    def add(self, key: str, steps: list[int], lo: int, hi: int, skip: list | None = None) -> None:
        """A constructor task of ``steps`` for ranks ``[lo, hi)`` (``skip``: the steps skipped right before them)."""
        self.tasks[key] = {"steps": steps, "lo": lo, "hi": hi, "workers": None, "skip": skip}

    def stored(self, key: str) -> bool:
        """A constructor task reached memory (again, after a rebuild): its holders are updated;
        True the first time (its descriptors go out then), when it is also shadowed."""
        t = self.tasks[key]
        first = t["workers"] is None
        t["workers"] = holders(self.scheduler.tasks.get(key))
        if first and self.shadows and self._elsewhere():
            self.shadow(key)
        ev = self._built.pop(key, None)
        if ev is not None:
            ev.set()
        return first

    def block_stored(self, key: str) -> None:
        """A load task reached memory: shadow the block if the plan asks for it."""
        if self.shadow_blocks and self._elsewhere():
            self.shadow(key)  # a lost worker's blocks are then read from their shadows, not reloaded

    def _elsewhere(self) -> bool:
        """Whether a shadow can outlive its original: some worker runs in another process (the
        workers of an in-process service are threads of one process, which dies as a whole)."""
        pids = (ws.pid for ws in self.scheduler.workers.values())
        first = next(pids, None)
        return any(pid != first for pid in pids)

    def release_before(self, committed: int) -> list[str]:
        """Forget (and return) the tasks whose steps every rank has acknowledged."""
        done = [k for k, t in self.tasks.items() if t["steps"][-1] < committed]
        for k in done:
            del self.tasks[k]
        return done

    def shadow(self, key: str) -> None:
        """Copy a built batch or a loaded block to ``shadows`` more workers, in the background
        (a batch's descriptors go out at once; a trainer that finds the first holder gone asks
        ``where`` and gets a shadow; a constructor reads a lost worker's block from its shadow)."""

        async def copy():
            try:
                await self.scheduler.replicate(keys=[key], n=1 + self.shadows, delete=False)
                self.counts["shadowed" if key in self.tasks else "blocks_shadowed"] += 1
                t = self.tasks.get(key)
                if t is not None:
                    t["workers"] = holders(self.scheduler.tasks.get(key))
            except Exception:  # a worker left meanwhile: the batch is rebuilt if it is lost
                logger.debug("shadowing %s failed", key, exc_info=True)

        self._copies.add(task := asyncio.ensure_future(copy()))
        task.add_done_callback(self._copies.discard)

    async def where(self, key: str, timeout: float) -> dict:
        """Workers holding built batch ``key`` (waits up to ``timeout`` while it is rebuilt)."""
        if key not in self.tasks:
            return {"error": f"batch {key} is no longer held: every rank acknowledged its steps", "workers": []}
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state != "memory":
            ev = self._built.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            ts = self.scheduler.tasks.get(key)
        return {"error": None, "workers": holders(ts)}

    def blocker(self, step: int) -> str | None:
        """Why the batches of ``step`` are not built (what a rank that needs it waits on): the
        load of a unit they read, or their own build, with where it runs, its retries and the
        workers that died running it; None when they are built or not handed out yet."""
        for key, t in self.tasks.items():
            if not t["steps"][0] <= step <= t["steps"][-1]:
                continue
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.state == "memory":
                continue
            ranks = f"ranks {t['lo']}-{t['hi'] - 1}" if t["hi"] - t["lo"] > 1 else f"rank {t['lo']}"
            if ts is None:
                return f"the batches of step {step} ({ranks}) are being submitted again"
            loads = [d for d in ts.dependencies if d.state != "memory" and self.is_load(d.key)]
            if loads:
                return f"the batches of step {step} ({ranks}) wait for {self._load_text(loads[0])}"
            return f"the batches of step {step} ({ranks}) are {self._state_text(ts)}"
        return None

    def loading(self, source: str) -> str | None:
        """The first load of ``source`` not finished (the unit planning waits for), in words."""
        prefix = f"{self.load_prefix}{source}-e"
        for key, ts in list(self.scheduler.tasks.items()):
            if isinstance(key, str) and key.startswith(prefix) and ts.state != "memory":
                return self._load_text(ts)
        return None

    def _load_text(self, ts) -> str:
        return f"{self._unit(ts)}, {self._state_text(ts, self.retries)}"

    def _unit(self, ts) -> str:
        """A load task's unit and source, in words."""
        m = LOAD_KEY.match(ts.key[len(self.load_prefix) :])
        return f"unit {m['unit']} of source {m['source']!r} (epoch {m['epoch']})" if m else f"load {ts.key}"

    def _state_text(self, ts, retries_of: int | None = None) -> str:
        """A task's state in words: running where, or why not; the retries used of ``retries_of``
        (a load's), the workers that died running it."""
        if ts.state == "processing" and ts.processing_on is not None:
            ws = ts.processing_on  # (assigned there: running, or queued behind the worker's other tasks)
            # the load it waits behind: one running there (task -> seconds, from heartbeats), the longest
            # (the text must not change while the wait lasts: `since_s` counts how long it has held)
            running = dict(getattr(ws, "executing", None) or {})
            ahead = sorted((t for t in running if t is not ts and self.is_load(t.key)), key=lambda t: -running[t])
            text = f"on {ws.address}"
            if ahead:
                text += f", behind the load of {self._unit(ahead[0])} running there"
        elif ts.state == "no-worker":
            text = "waiting for a worker that can run it (none has its resources)"
        elif ts.state == "erred":
            text = f"failed: {str(getattr(ts, 'exception_text', '') or 'unknown error')[:300]}"
        else:
            text = f"{ts.state} (not started)"
        extra = []
        left = getattr(ts, "retries", 0) or 0
        if retries_of is not None and left < retries_of:
            extra.append(f"retried {retries_of - left} of {retries_of} times after errors")
        if getattr(ts, "suspicious", 0):
            extra.append(f"{ts.suspicious} worker{'s' if ts.suspicious > 1 else ''} died running it")
        return text + (f"; {', '.join(extra)}" if extra else "")

    def is_load(self, key) -> bool:
        return isinstance(key, str) and key.startswith(self.load_prefix)

    def figures(self) -> dict:
        """Built batches in flight, and the bytes they and their shadows hold."""
        held = [ts for ts in map(self.scheduler.tasks.get, self.tasks) if ts is not None and ts.state == "memory"]
        return {"tasks_held": len(self.tasks), **held_bytes(held, "batch_bytes", "shadow_bytes")}

    def block_figures(self) -> dict:
        """Loaded blocks held on the workers, and the bytes their shadows add (scans the
        scheduler's tasks: for a status call, not for a step)."""
        blocks = [ts for ts in self.scheduler.tasks.values() if ts.state == "memory" and self.is_load(ts.key)]
        return held_bytes(blocks, "block_bytes", "block_shadow_bytes")
