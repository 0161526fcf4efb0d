"""The evaluation batches: the held-out units (``service/holdout.py``) packed once into a finite
stream every rank reads its share of, the same in every run and after every restart.

Documents are taken source by source in the plan's order, each source's held-out units in file
order and their documents in order, each source up to its share of ``evaluation.tokens`` (all of
them without a budget); a document longer than a micro-batch is cut into pieces. Pieces are packed
in that order into micro-batches (a new one when the next piece does not fit), and the
micro-batches dealt out in order: evaluation step ``s`` of rank ``r`` holds micro-batches
``(s·dp + r)·m`` to ``+ m``. Every rank gets the same number of steps (the last ones may hold
empty micro-batches), so ranks that all-reduce their losses stay in step.

The result is one task's ``BuiltChunk`` (``batches[step][rank]`` in wire form, fetched like
training batches); each batch says how many evaluation steps there are (``eval_steps``) and the
labels of its whole step (``loss_tokens``).
"""

from __future__ import annotations

import numpy as np

from .. import wire
from ..batch_layout import BatchLayout
from ..protocol import block_key
from ..sources.blocks import SampleBlock
from .constructors import BuiltChunk, plan_fields, wire_micro_batch


def _pieces(blocks: list[tuple[int, SampleBlock]], budgets: dict[int, int | None], capacity: int) -> list[list[int]]:
    """Rows ``[source, 0, unit, doc, start, stop]`` of the documents taken, in order."""
    rows, taken = [], {}
    for unit, (src, block) in enumerate(blocks):
        lens = block.lengths()
        for d in range(len(block)):
            budget = budgets.get(src)
            if budget is not None and taken.get(src, 0) >= budget:
                break
            n = int(lens[d])
            for a in range(0, n, capacity):
                rows.append([src, 0, unit, d, a, min(n, a + capacity)])
            taken[src] = taken.get(src, 0) + n
    return rows


def _loss_tokens(mbs: list[dict]) -> tuple[int, int]:
    """Labels that are not -100 in micro-batches (wire form), as (shifted, hf) labels count them."""
    shifted = hf = 0
    for w in mbs:
        mb = wire.decode(w)
        shifted += int((mb["labels"] != wire.IGNORE_INDEX).sum())
        hf += int((wire.hf_labels(mb["labels"], mb["cu_seqlens"], mb["num_tokens"]) != wire.IGNORE_INDEX).sum())
    return shifted, hf


def build_eval(
    blocks: list[tuple[int, SampleBlock]], budgets: dict[int, int | None], dp: int, layout: BatchLayout
) -> BuiltChunk:
    """The evaluation batches of the held-out ``blocks`` (``(source index, block)`` in order),
    packed to ``layout`` (the evaluation's micro-batches and capacity)."""
    micro_batches, capacity, multimodal = layout.micro_batches, layout.capacity, layout.multimodal
    rows = _pieces(blocks, budgets, capacity)
    bins: list[list[list[int]]] = []
    used = capacity
    for r in rows:
        n = r[5] - r[4]
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(r)
        used += n
    per_step = dp * micro_batches
    steps = -(-len(bins) // per_step) if bins else 0
    bins += [[]] * (steps * per_step - len(bins))
    keyed = {block_key(src, 0, u): b for u, (src, b) in enumerate(blocks)}
    built = [
        wire_micro_batch(np.asarray(b, dtype=np.int64).reshape(-1, 6), keyed, capacity, capacity, multimodal)
        for b in bins
    ]
    out: dict[int, dict[int, dict]] = {}
    for s in range(max(steps, 1)):
        mine = built[s * per_step : (s + 1) * per_step]
        counts = _loss_tokens(mine)
        out[s] = {
            r: {
                "step": s,
                "rank": r,
                "micro_batches": mine[r * micro_batches : (r + 1) * micro_batches],
                "eval_steps": steps,
                "loss_tokens": counts,
                **plan_fields(layout),
            }
            for r in range(dp)
        }
    return BuiltChunk(True, out)
