"""How late the scheduler's event loop wakes up: a block of the loop shows as lag.

A coroutine sleeps ``LOOP_TICK_S`` over and over and records by how much each sleep overran.
Every handler, transition and heartbeat of the scheduler runs on that loop, so its lag is the
wait the control path adds to a queue get, an ack or a descriptor (``overlord_loop``; the
control-plane benchmark reports its maximum).

Why a tick of tens of milliseconds, not a few: every tick wakes the loop, and a wake-up of an
idle loop costs it more than the tick's work (its caches are cold), so a fast tick would be a
large share of an idle service's CPU (``benchmarks/control_plane.py``: ``idle_cpu_ms_per_s``). A
block of the loop still shows in full where it spans a tick's due time (every block longer than
a tick does); a shorter one shows where it overlaps one, by the part of it after that time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import numpy as np

LOOP_TICK_S = 0.05  # the watchdog's sleep (module docstring: why not shorter)


class LoopWatch:
    def __init__(self, on_tick: Callable[[], None] = lambda: None):
        self.on_tick = on_tick  # called every tick (the planner refreshes an idle run's view)
        self.lags: deque = deque(maxlen=20_000)
        self.block_max = 0.0

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LOOP_TICK_S)
            lag = time.perf_counter() - t0 - LOOP_TICK_S
            self.lags.append(lag)
            self.block_max = max(self.block_max, lag)
            self.on_tick()

    def figures(self, reset: bool = False) -> dict:
        """The longest lag and the 99th percentile, in ms, over the samples kept (then forgotten, with ``reset``)."""
        lags = np.asarray(self.lags) * 1e3
        out = {
            "block_max_ms": round(self.block_max * 1e3, 3),
            "samples": len(lags),
            "block_p99_ms": round(float(np.percentile(lags, 99)), 3) if len(lags) else 0.0,
        }
        if reset:
            self.lags.clear()
            self.block_max = 0.0
        return out
