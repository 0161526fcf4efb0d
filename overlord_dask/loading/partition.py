"""Auto-partitioning: load tasks cut to a target duration from measured cost.

The *unit* (a row-group range, a zarr document range) is the grain of a source's order: the
planner shuffles units and the documents inside each, so the stream is fixed by the plan's
``unit_rows`` / ``unit_tokens`` and the seed. A *load task* is how a unit's documents get read,
and that is free to change at every request: a unit whose loading would take much longer than
``loading.task_seconds`` (a row group of photos to decode) is read as several parts, in
parallel on the pool's workers; units that take under a quarter of it (tiny row groups of
text) are read together by one task, so the per-task overhead does not dominate. The cost
estimate is the source's measured CPU seconds per document (``LoadSignals``) times the unit's
documents; a source not measured yet is read a unit per task.

Parts report their lengths separately and the planner takes the unit in only once every part
arrived (concatenated in document order); constructors concatenate the parts' blocks. Either way
each document is read exactly as in a whole-unit load, so the delivered stream does not depend
on how loading was cut (``tests/test_pools.py`` runs two cuts against each other).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import masked_runs

MAX_PARTS = 16  # a unit is never cut into more parts than this
MAX_GROUP = 8  # nor more units read by one task than this


@dataclass
class LoadTask:
    source: str
    units: list  # [(epoch, unit)]: one, or several read together
    parts: list | None = None  # [(lo, hi)] document ranges of the single unit, each its own task


def partition(wanted: list, n_docs, seconds_per_doc: dict, target: float | None) -> list[LoadTask]:
    """Cut ``wanted`` ([source, epoch, unit] in request order) into load tasks. ``n_docs(source,
    unit)`` gives a unit's documents (None: not known before it is loaded); ``seconds_per_doc`` the measured cost per
    source."""
    out: list[LoadTask] = []
    open_group: dict[str, tuple[LoadTask, float]] = {}  # source -> the group being filled, its estimate
    for source, epoch, unit in wanted:
        spd = seconds_per_doc.get(source)
        if target is None or not spd:
            out.append(LoadTask(source, [(epoch, unit)]))
            continue
        n = n_docs(source, unit)
        if n is None:  # counted only when loaded (a jsonl byte range, a shard): one task
            out.append(LoadTask(source, [(epoch, unit)]))
            continue
        est = n * spd
        if est > 2 * target and n > 1:
            k = min(MAX_PARTS, n, math.ceil(est / target))
            cuts = [round(i * n / k) for i in range(k + 1)]
            out.append(LoadTask(source, [(epoch, unit)], [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]))
            continue
        if est * 4 < target:
            group = open_group.get(source)
            if group is not None and group[1] + est <= target and len(group[0].units) < MAX_GROUP:
                group[0].units.append((epoch, unit))
                open_group[source] = (group[0], group[1] + est)
                continue
            task = LoadTask(source, [(epoch, unit)])
            open_group[source] = (task, est)
            out.append(task)
            continue
        out.append(LoadTask(source, [(epoch, unit)]))
    return out


class UnitParts:
    """Lengths of units loaded in parts (``partition.py``), kept until the parts tile the unit.

    Parts are keyed by their first document; a unit is whole when a chain of parts runs from
    document 0 to its end. Bounded: a part recomputed after its unit was already taken in (a lost
    worker) starts an entry that never completes, and the oldest such entries are dropped."""

    MAX_UNITS = 4096

    def __init__(self) -> None:
        self._units: OrderedDict = OrderedDict()

    def add(
        self,
        key: tuple,
        part,
        lens: np.ndarray,
        vision: np.ndarray | None,
        dropped: int = 0,
        masked: np.ndarray | None = None,
    ):
        """The unit's lengths, image tokens, dropped records and masked runs once ``part``
        completes it, else None."""
        lo, hi, n = part
        parts = self._units.setdefault(key, {})
        parts[lo] = (hi, lens, vision, dropped, masked)
        chain, pos = [], 0
        while pos < n and pos in parts:
            chain.append(parts[pos])
            pos = parts[pos][0]
        if pos != n:
            while len(self._units) > self.MAX_UNITS:
                self._units.popitem(last=False)
            return None
        del self._units[key]
        lens = np.concatenate([c[1] for c in chain])
        vision = None if chain[0][2] is None else np.concatenate([c[2] for c in chain])
        return lens, vision, sum(c[3] for c in chain), masked_runs.concat([(c[4], len(c[1])) for c in chain])
