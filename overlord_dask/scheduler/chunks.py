"""Chunks: how consecutive handed-out steps become constructor tasks.

One constructor task builds a chunk of steps for a group of ranks, and a chunk is split into
groups only to keep each task within ``TASK_TOKENS`` tokens and ``TASK_RANKS`` ranks. Splitting
a chunk over workers does not buy parallel construction: the chunks in flight (at least two, as
a chunk holds at most half of ``prefetch_steps``) already build side by side, and building is
fast next to loading. It costs instead: every group draws pieces from nearly every block, so
each group's worker fetches a peer copy of each block, and a chunk split over ``G`` workers
copies its blocks up to ``G`` times (``benchmarks/throughput.py --scaling`` compares worker
counts). One queue item per rank then names the whole chunk, so queue items, constructor tasks
and acks are per chunk, not per (step, rank). A task carries only its ranks' pieces
(``pieces.pack``: each column narrowed, since a task's arguments cross the scheduler), the units
whose blocks it needs and the layout its micro-batches are packed to
(``batch_layout.BatchLayout``: the one the planner budgeted).

How many steps a chunk holds (:func:`chunk_steps`, unless the plan sets ``loading.batch_steps``):
a quarter of the prefetch bound, raised until a chunk holds ``CHUNK_TOKENS`` tokens, but never
more than half the bound (one chunk is built while the trainers take another). Every task,
queue item, fetch and ack has a fixed cost in Dask and in the service, so small steps in small
chunks spend the machine on the control path (``benchmarks/control_plane.py`` compares chunked
hand-out with a chunk per step).
"""

from __future__ import annotations

import math

import numpy as np

from .. import pieces as P
from ..batch_layout import BatchLayout
from ..plan import Topology
from ..protocol import batch_key

TASK_TOKENS = 1 << 24  # at most this many tokens per constructor task (~32 MB of uint16 ids)
"""The cap bounds a task's result. Each task depends on the load task of nearly every block of
its chunk, so the scheduler's bookkeeping per chunk grows with tasks × blocks: a lower cap makes
more tasks and costs the event loop more at large steps (``benchmarks/control_plane.py``)."""
TASK_RANKS = 2048
"""Nor more ranks than this per constructor task: a task builds a batch per (step, rank), and its
completion tells each of its ranks' channels in one event-loop callback, so many small ranks in
one task make a long build and a long block of the loop (``benchmarks/control_plane.py`` at dp
16,384 with small steps)."""
CHUNK_TOKENS = 1 << 20  # a default chunk holds at least this many tokens (within half the prefetch bound)


def chunk_steps(loading, topology: Topology) -> int:
    """Steps handed out together: ``loading.batch_steps`` if the plan sets it, else a quarter
    of ``prefetch_steps`` raised to ``CHUNK_TOKENS`` tokens, at most half of ``prefetch_steps``;
    never more than ``prefetch_steps`` and at least 1."""
    prefetch = loading.prefetch_steps
    if loading.batch_steps:
        return min(loading.batch_steps, prefetch)
    enough = math.ceil(CHUNK_TOKENS / max(1, topology.step_tokens))
    return max(1, min(max(prefetch // 4, enough), prefetch // 2))


def chunk_tasks(
    steps: list[dict], ledger, topology: Topology, layout: BatchLayout, run_id: str, rewinds: int = 0
) -> list[dict]:
    """Constructor tasks for consecutive ``steps`` (``PlannerState.plan_steps`` output, their
    pieces in ``ledger``): ``{"key", "steps", "ranks": [lo, hi], "layout", "units"}``, the
    layout as a dict (``batch_layout.py``), the units ``[source, epoch, unit]`` rows as bytes
    (``pieces.to_bytes``: one object, where a list of lists is a few hundred to encode and decode
    on the way to the submitter); as few groups of ranks as keep each within ``TASK_TOKENS`` and ``TASK_RANKS``."""
    dp = topology.dp
    tokens = len(steps) * topology.step_tokens
    groups = max(1, math.ceil(tokens / TASK_TOKENS), math.ceil(dp / TASK_RANKS))
    per = math.ceil(dp / min(groups, dp))
    starts = np.arange(0, dp, per)
    planned = []
    for sp in steps:  # each step's pieces by rank (stable: a bin's pieces keep their order), cut per group
        entry = ledger[sp["step"]]
        by_rank = P.stable_order(entry["slot"][:, 0])
        cuts = np.searchsorted(entry["slot"][by_rank, 0], np.append(starts, dp))
        planned.append((sp, entry, by_rank, cuts))
    tasks = []
    for g, lo in enumerate(starts.tolist()):
        hi = min(dp, lo + per)
        parts, units = [], []
        for sp, entry, by_rank, cuts in planned:
            mine = by_rank[cuts[g] : cuts[g + 1]]
            pieces = entry["pieces"][mine]
            parts.append(
                {
                    "step": sp["step"],
                    "pieces": P.pack(pieces),
                    "slot": P.slot_bytes(entry["slot"][mine]),
                    "piece_tokens": sp["piece_tokens"],
                    "loss_tokens": sp.get("loss_tokens"),
                }
            )
            units.append(P.units(pieces))
        used = P.unique_rows(np.concatenate(units)) if units else np.zeros((0, 3), np.int64)
        tasks.append(
            {
                "key": batch_key(run_id, steps[0]["step"], lo, hi, rewinds),
                "steps": parts,
                "ranks": [lo, hi],
                "layout": layout.to_dict(),
                "units": P.to_bytes(used),
                "skip": steps[0].get("after_skip"),  # [first, last] skipped right before these steps
            }
        )
    return tasks
