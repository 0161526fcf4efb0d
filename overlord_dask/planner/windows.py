"""Window starts: the parts' state at the start of each planned window, for snapshots and rewinds.

The planner is a pure function of its parts' state at the start of a window and of the
(reloaded) unit lengths, so a snapshot holds only that small state, the topology the window was
planned on and the step the window starts at; a restore re-plans from there. A window's state is
kept while it holds a step that is not durable yet (``progress.Progress.durable_step``) or that
lies within the retention (``checkpoint.keep_steps``) before it: a training job that restarts
from an older checkpoint while the service runs on is served from the newest start at or before
its step (``rewind.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class WindowStarts:
    def __init__(self, capture: Callable[[], dict]):
        self.capture = capture  # the parts' get_state, composed
        # first step of a planned window -> (state before it, the topology it is planned on)
        self.starts: OrderedDict[int, tuple[dict, dict]] = OrderedDict()
        self._replaced: tuple[dict, dict] | None = None  # what the window begun last replaced

    def begin(self, step: int, topology: dict) -> None:
        """A window starts planning at ``step`` on ``topology``: remember the state it starts from."""
        self._replaced = self.starts.get(step)  # (a restored start: kept if the window starves)
        self.starts[step] = (self.capture(), topology)

    def restored(self, step: int, state: dict, topology: dict) -> None:
        """A planner restored from the window that starts at ``step`` (a snapshot, or a rewind's
        source): that start is kept from now on, as if the window had just begun (planning it
        again records the same state)."""
        self.starts[step] = (state, topology)

    def abandon(self, step: int) -> None:
        """The window at ``step`` could not be planned (it is retried from the same state)."""
        if self._replaced is not None:
            self.starts[step] = self._replaced
        else:
            del self.starts[step]

    def prune(self, keep_from: int) -> None:
        """Keep the window holding step ``keep_from`` and every later one."""
        keys = list(self.starts)
        for k, nxt in zip(keys, keys[1:]):
            if nxt <= keep_from:
                del self.starts[k]

    def at(self, step: int) -> tuple[int, dict, dict] | None:
        """``(window step, state, topology)`` of the newest window start at or before ``step``."""
        starts = [k for k in self.starts if k <= step]
        if not starts:
            return None
        state, topology = self.starts[starts[-1]]
        return starts[-1], state, topology

    @property
    def oldest(self) -> int | None:
        """The first step of the oldest window kept."""
        return next(iter(self.starts), None)

    def keep_before(self, step: int, other: WindowStarts) -> None:
        """Take ``other``'s starts before ``step`` (a rewound planner keeps the older history)."""
        older = [(k, v) for k, v in other.starts.items() if k < step]
        self.starts = OrderedDict(older + [(k, v) for k, v in self.starts.items() if k >= step])
