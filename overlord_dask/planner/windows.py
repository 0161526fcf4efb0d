"""Window starts: the parts' state at the start of each planned window, for snapshots.

The planner is a pure function of its parts' state at the start of a window and of the
(reloaded) unit lengths, so a snapshot holds only that small state and the step the window starts
at; a restore re-plans from there. A window's state is kept while it holds a step that is not
durable yet (``progress.Progress.durable_step``): the newest start at or before the durable step
is what a snapshot writes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class WindowStarts:
    def __init__(self, capture: Callable[[], dict]):
        self.capture = capture  # the parts' get_state, composed
        self.starts: OrderedDict[int, dict] = OrderedDict()  # first step of a planned window -> state before it

    def begin(self, step: int) -> None:
        """A window starts planning at ``step``: remember the state it starts from."""
        self.starts[step] = self.capture()

    def abandon(self, step: int) -> None:
        """The window at ``step`` could not be planned (it is retried from the same state)."""
        del self.starts[step]

    def prune(self, durable: int) -> None:
        """Keep the window holding the oldest non-durable step and every later one."""
        keys = list(self.starts)
        for k, nxt in zip(keys, keys[1:]):
            if nxt <= durable:
                del self.starts[k]

    def at(self, durable: int, planned_until: int) -> tuple[int, dict]:
        """``(window step, state)`` for a snapshot at ``durable``: the newest window start at or
        before it, or the current state if nothing was planned since (at ``planned_until``)."""
        starts = [k for k in self.starts if k <= durable]
        if starts:
            return starts[-1], self.starts[starts[-1]]
        return planned_until, self.capture()

    def clear(self) -> None:
        self.starts.clear()
