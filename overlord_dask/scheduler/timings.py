"""How long trainers wait and how long their steps take, as histograms the metrics export.

Both are measured from what reaches the scheduler anyway, so they cost nothing extra on the
trainers' path:

- trainer wait per step: each acknowledgement carries the rank's total time in ``next()``; the
  wait since its previous acknowledgement, spread evenly over the steps it acknowledges, is
  observed once per step (a rank acknowledges every few steps, so a single slow step shows as
  the average of its interval);
- step time: the wall time between advances of the committed step (every rank done), spread over
  the steps it advanced by.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from itertools import accumulate

WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative-bucket counts and a sum, as Prometheus histograms keep them. Plain Python: an
    observation is made per acknowledgement row, and numpy's per-call cost was most of it."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        # a value's bucket: the first bound at or above it (NaN: above every bound)
        i = bisect_left(self.bounds, value) if value == value else len(self.bounds)
        self.counts[i] += times
        self.total += value * times

    def as_dict(self) -> dict:
        cum = list(accumulate(self.counts))
        return {
            "buckets": [[b, c] for b, c in zip(list(self.bounds) + ["+Inf"], cum)],
            "sum": self.total,
            "count": cum[-1],
        }


class Timings:
    def __init__(self) -> None:
        self.wait = Histogram(WAIT_BUCKETS)
        self.step = Histogram(STEP_BUCKETS)
        self._rank: dict[
            tuple, tuple[float, int]
        ] = {}  # consumer -> (its wait total, its acknowledged step) at its last ack
        self._commit: tuple[int, float] | None = None

    def acked(self, consumer: tuple, step: int, wait_s: float | None) -> None:
        """A rank acknowledged every step up to ``step``, having waited ``wait_s`` in all."""
        if wait_s is None:
            return
        last = self._rank.get(consumer)
        self._rank[consumer] = (wait_s, step)
        if last is None or step <= last[1] or wait_s < last[0]:  # its first ack, a repeat, or a new attachment
            return
        n = step - last[1]
        self.wait.observe((wait_s - last[0]) / n, n)

    def committed(self, committed: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._commit is not None and committed > self._commit[0]:
            n = committed - self._commit[0]
            self.step.observe((now - self._commit[1]) / n, n)
        self._commit = (committed, now)

    def snapshot(self) -> dict:
        return {"trainer_wait_seconds": self.wait.as_dict(), "step_seconds": self.step.as_dict()}
