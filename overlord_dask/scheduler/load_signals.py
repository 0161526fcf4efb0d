"""What only the planner knows about loading demand, for the pool autoscaler.

Dask's own adaptive target looks at queued tasks, which for a data loader is the wrong question:
load tasks are requested a little ahead of need, so the queue is always short, and a curriculum
stage that raises a source's weight is invisible until it starts. The planner knows the demand
itself: each source's weight over the schedule ahead, the trainers' step rate, the tokens a step
takes, which source planning is waiting on, and (from each load task's report) how many seconds
a source's loading costs per token. ``LoadSignals`` keeps the measured part; :func:`pool_signals`
reads the rest from the planner state (in the planner thread) and answers ``overlord_pools``.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

DECAY = 0.8  # weight of the past in the per-source cost average (a few units smooth it)
RATE_WINDOW_S = 10.0  # the step rate is measured over about this long
PEAK_WINDOW_S = 120.0  # ... and its peak remembered this long (what the trainers can take when fed)


class LoadSignals:
    def __init__(self) -> None:
        self.cost: dict[str, list[float]] = {}  # source -> decayed [seconds, tokens, bytes, units, documents]
        self.loads: dict[str, int] = {}
        self._progress: deque = deque()  # (time, committed step)
        self._rates: deque = deque()  # (time, measured rate)

    def loaded(self, source: str, seconds: float, tokens: int, nbytes: int, docs: int = 0) -> None:
        """A load task of ``source`` took ``seconds`` of CPU for ``tokens`` tokens (CPU, not wall
        time: on a crowded machine wall time grows with every worker added, and a demand measured
        in it would feed on itself; a source that waits on IO grows by the starvation rule)."""
        c = self.cost.setdefault(source, [0.0, 0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((seconds, tokens, nbytes, 1.0, docs)):
            c[i] = DECAY * c[i] + v
        self.loads[source] = self.loads.get(source, 0) + 1

    def seconds_per_token(self, source: str) -> float | None:
        c = self.cost.get(source)
        return None if c is None or c[1] <= 0 else c[0] / c[1]

    def seconds_per_doc(self, source: str) -> float | None:
        c = self.cost.get(source)
        return None if c is None or c[4] <= 0 else c[0] / c[4]

    def block_bytes(self, source: str) -> float | None:
        c = self.cost.get(source)
        return None if c is None or c[3] <= 0 else c[2] / c[3]

    def steps_per_s(self, committed: int, now: float | None = None) -> float:
        """Steps every rank consumed per second, over the last ``RATE_WINDOW_S``."""
        now = time.monotonic() if now is None else now
        q = self._progress
        if not q or q[-1][1] != committed:
            q.append((now, committed))
        while len(q) > 2 and now - q[1][0] > RATE_WINDOW_S:
            q.popleft()
        if len(q) < 2:
            return 0.0
        (t0, c0), (t1, c1) = q[0], q[-1]
        # time since the last step counts too: a run that stopped consuming has a falling rate
        return (c1 - c0) / max(now - t0, t1 - t0, 1e-3)

    def peak_steps_per_s(self, rate: float, now: float | None = None) -> float:
        """The highest rate of the last ``PEAK_WINDOW_S``: while loading holds the trainers
        back, the measured rate is what loading delivers, not what the trainers would take."""
        now = time.monotonic() if now is None else now
        self._rates.append((now, rate))
        while self._rates and now - self._rates[0][0] > PEAK_WINDOW_S:
            self._rates.popleft()
        return max(r for _, r in self._rates)


def pool_signals(state, signals: LoadSignals, lead_s: float) -> dict:
    """The autoscaler's inputs (runs in the planner thread: it reads ``state``)."""
    plan = state.plan
    committed = state.committed
    rate = signals.steps_per_s(committed)
    peak = signals.peak_steps_per_s(rate)
    window = state.policy.window_steps(plan.balance)
    start = committed + 1
    horizon = max(2 * window + plan.loading.prefetch_steps, int(np.ceil(lead_s * max(rate, peak))))
    now = state.timeline.mix_at(max(start, 0))
    ahead = state.timeline.max_mix_over(max(start, 0), start + horizon + 1)
    sources = {}
    for i, s in enumerate(state.streams):
        src = state.timeline.source(s.name)
        sources[s.name] = {
            "pool": src.pool_name,
            "weight": float(now[i]),
            "weight_ahead": float(ahead[i]),
            "seconds_per_token": signals.seconds_per_token(s.name),
            "block_bytes": signals.block_bytes(s.name),
            "loads": signals.loads.get(s.name, 0),
            "loads_pending": len(s.loads.requested),
            "blocks_held": s.loaded_units()
            + len(s.loads.requested),  # loaded and not yet planned through, or on their way
            "tokens_ready": s.unplanned_tokens(),
        }
    return {
        "committed": committed,
        "next_step": state.next_step,
        "steps_per_s": rate,
        "steps_per_s_peak": peak,
        "horizon_steps": horizon,
        "step_tokens": plan.topology.step_tokens,
        "starved_on": state.starved_on,
        "steps_ready": state.next_step - 1 - committed,
        "prefetch_steps": plan.loading.prefetch_steps,
        "sources": sources,
    }
