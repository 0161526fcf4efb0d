"""What loading left out, per source: records the source's prepare steps dropped, and units
quarantined as unreadable (``loading.on_corrupt: quarantine``). Kept on the scheduler from the
load tasks' reports, shown by ``status()`` and the dashboard, so that a filter that drops far
more than intended, or a corrupt file, is seen while the run goes on, never skipped silently.

Each unit counts once whatever how often it is loaded (every epoch, after an eviction, a
recomputation): the figures describe the source's data, one pass over what was read so far.
"""

from __future__ import annotations

import time

MAX_QUARANTINED = 1000  # the most quarantine records kept (the count goes on)


class DroppedData:
    def __init__(self) -> None:
        self.records: dict[str, dict[int, int]] = {}  # source -> unit -> records read
        self.dropped: dict[str, dict[int, int]] = {}  # source -> unit -> records dropped
        self.quarantined: dict[tuple[str, int], dict] = {}  # (source, unit) -> record
        self.quarantine_count = 0

    def loaded(self, source: str, unit: int, records: int, dropped: int) -> None:
        """A unit's report (its parts' added up): ``records`` read, ``dropped`` of them by prepare steps."""
        self.records.setdefault(source, {})[unit] = records
        if dropped:
            self.dropped.setdefault(source, {})[unit] = dropped

    def quarantine(self, source: str, unit: int, reason: str, step: int) -> bool:
        """Record a quarantined unit; False if it was already recorded (a reload)."""
        if (source, unit) in self.quarantined:
            return False
        self.quarantine_count += 1
        if len(self.quarantined) < MAX_QUARANTINED:
            self.quarantined[(source, unit)] = {
                "source": source,
                "unit": unit,
                "reason": reason,
                "step": step,
                "time": time.time(),
            }
        return True

    def status(self) -> dict:
        """``{"records": {source: {"read", "dropped"}}, "quarantined": [...], "quarantined_units": n}``.

        Called on the planner thread (the dashboard's refresh) while the event loop adds sources
        and units: each dict is copied by one C-level call (atomic under the GIL) before Python
        code walks it; walking the live dicts raised "dictionary changed size during iteration"."""
        records, dropped = list(self.records.items()), dict(self.dropped)
        per = {
            s: {"read": sum(r.copy().values()), "dropped": sum(dropped.get(s, {}).copy().values())}
            for s, r in sorted(records)
        }
        return {
            "records": per,
            "quarantined": list(self.quarantined.values()),
            "quarantined_units": self.quarantine_count,
        }
