"""The trainers' reports as they arrive on the channels (event loop), until the planner thread
takes them (``planner/feedback.py``).

One-way and cheap on the event loop: a report is appended, nothing is computed. The queue is
bounded: if the planner thread fell this far behind, the oldest reports are dropped (and
counted), never the scheduler's memory.
"""

from __future__ import annotations

from collections import deque

from ..protocol import reports_in

MAX_QUEUED = 200_000  # items (a rank's reports of a chunk, or of one step) waiting for the planner thread


class ReportInbox:
    def __init__(self, max_queued: int = MAX_QUEUED):
        self._queue: deque = deque(maxlen=max_queued)
        self.received = 0
        self.dropped = 0

    def put(self, bs=None, rank: int = 0, cp_rank: int = 0, replica: int = 0, items: list | None = None, **_) -> None:
        """(event loop) A channel's ``feedback`` message: its rank's reports since its last one,
        aggregated by the trainer (``trainer/reporting.aggregate``). Only replica 0 of a rank
        counts (tensor- and pipeline-parallel replicas report the same work). ``received`` and
        ``dropped`` count reports: a step's compute time, or one ``report()`` call."""
        if replica != 0 or not items:
            return
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("s"), int):
                n = reports_in(item)
                if len(self._queue) == self._queue.maxlen:
                    self.dropped += reports_in(self._queue[0][2])
                self._queue.append((int(rank), int(cp_rank), item))
                self.received += n

    def drain(self) -> list:
        """(planner thread) Every report queued so far, oldest first."""
        out = []
        q = self._queue
        while q:
            try:
                out.append(q.popleft())
            except IndexError:  # (emptied meanwhile: only this thread pops)
                break
        return out
