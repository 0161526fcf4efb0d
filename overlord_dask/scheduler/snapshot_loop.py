"""Writing planner snapshots in the background, on the scheduler's loop.

Every newly durable step wakes the loop; it captures the planner's state in the planner thread
and writes it in another thread (``snapshots.SnapshotWriter``: a base every ``base_every_steps``
steps or ``base_every_seconds`` and when the topology or the plan versions change, else a
delta), so neither the event loop nor planning waits on storage. A failed write is reported in
the status and retried at the next commit; a live update waits for a base that holds it.

Every ``ARCHIVE_AT`` decisions the planner made, the settled ones (``snapshots.py``: the rule)
are archived and dropped from the planner before the state is captured, so bases stay bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from .. import logs

logger = logging.getLogger(__name__)
ARCHIVE_AT = 256  # decisions held before the settled ones are archived (then again this many later)


class SnapshotLoop:
    def __init__(
        self,
        url: str,
        checkpoint,
        capture: Callable[[], Awaitable[dict]],
        run_id: str,
        *,
        seq: int,
        settled: Callable[[int | None], Awaitable[list]] | None = None,
        drop: Callable[[list], Awaitable[None]] | None = None,
    ):
        """Snapshots to ``url`` (the plan's ``checkpoint.url``, resolved) with the plan's
        ``checkpoint`` settings (``plan.Checkpoint``); ``capture()`` takes the planner's state;
        ``settled(oldest stored window step)`` the planner's settled decisions, ``drop(them)``
        forgets them once archived."""
        from ..snapshots import SnapshotStore, SnapshotWriter

        ck = checkpoint
        self.url, self.capture, self.run_id = url, capture, run_id
        self.store = SnapshotStore(url, ck.storage_options)
        self.writer = SnapshotWriter(
            self.store,
            keep_bases=ck.keep_bases,
            base_every_steps=ck.base_every_steps,
            base_every_seconds=ck.base_every_seconds,
            seq=seq,
            keep_steps=ck.keep_steps,
            keep_hours=ck.keep_hours,
        )
        self.error: str | None = None  # the last write failed (status shows it until one succeeds)
        self.stats: list[dict] = []
        self._written = -1  # the committed step of the last snapshot written
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # the loop and a plan update both write; sequence numbers must not race
        self._wake.set()  # a first base right away
        self.settled, self.drop = settled, drop
        self._archive_at = ARCHIVE_AT
        self.archived = 0  # decisions archived by this loop

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.write()
            except Exception as err:  # storage hiccups must not kill the planner; the next commit retries
                error = f"writing a snapshot to {self.url} failed: {type(err).__name__}: {err}"
                if error != self.error:  # once per cause, not once per committed step while it lasts
                    logger.exception("writing a planner snapshot to %s failed (retried at every commit)", self.url)
                self.error = error
            else:
                if self.error is not None:
                    logger.warning("writing planner snapshots to %s works again", self.url)
                self.error = None

    async def write(self, force: bool = False) -> None:
        """A snapshot of the durable step now (unless it was written already and not ``force``)."""
        async with self._lock:
            st = await self.capture()
            if st["committed"] == self._written and not force:
                return
            if self.settled is not None and len(st.get("decisions", ())) >= self._archive_at:
                if await self._archive():
                    st = await self.capture()
                self._archive_at = len(st.get("decisions", ())) + ARCHIVE_AT
            t0 = time.perf_counter()
            kind, n = await asyncio.to_thread(self.writer.write, st)
            self._written = st["committed"]
            self.stats.append(
                {
                    "kind": kind,
                    "bytes": n,
                    "seconds": time.perf_counter() - t0,
                    "committed": st["committed"],
                    "time": time.time(),  # when it was written (its age on `overlord status`)
                }
            )
            del self.stats[:-1000]
            if kind == "base":
                logs.event("snapshot_base", self.run_id, st["committed"], bytes=n)

    async def _archive(self) -> bool:
        """Archive the settled decisions (written before they are dropped: a crash in between
        leaves them in both places, which a reader dedupes); True if some were."""
        stored = await asyncio.to_thread(self.store.oldest_window_step)
        decisions = await self.settled(stored)
        if not decisions:
            return False
        await asyncio.to_thread(self.store.write_archive, self.writer.seq + 1, [d.to_dict() for d in decisions])
        await self.drop(decisions)
        self.archived += len(decisions)
        logs.event("decisions_archived", self.run_id, decisions[-1].at, count=len(decisions))
        return True
