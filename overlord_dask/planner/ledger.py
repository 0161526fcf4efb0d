"""The ledger: every planned step's pieces and where they went, and its metrics.

A step's entry is ``{"pieces": int64 rows (pieces.py), "slot": int32 [rank, micro_batch] per
row, "dropped": rows [source, epoch, unit, doc, tokens] a drop policy skipped}``. Entries stay
until every rank has acknowledged the step, then a bounded history (``history_steps``) is kept
for inspection (``overlord status``, the notebooks, exactly-once checks); metrics are kept for
the same history. Read it as a mapping ``step -> entry``.

Metrics hold numbers and tuples of numbers, never lists: a tuple of plain numbers, and then the
dict holding it, drop out of the garbage collector's sight once they survive a collection. As
lists, a long run's history would be hundreds of thousands of tracked objects that every full
collection in the scheduler's process walks with the event loop blocked (tested with
``gc.is_tracked``; ``benchmarks/control_plane.py`` reports the loop's longest block).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from .. import pieces as P
from ..observe.figures import step_imbalance


def step_digest(pieces: np.ndarray, slot: np.ndarray) -> int:
    """A CRC-32 of a step's piece rows and their ``[rank, micro_batch]`` slots (``metrics["digest"]``):
    snapshots keep it for the steps a restored planner re-plans without handing them out, and the
    planner checks each such step against it (``PlanningLoop``), so a replay that went another way
    (other data, other code) stops the run instead of losing or repeating documents unseen."""
    rows = np.ascontiguousarray(pieces, dtype=np.int64).reshape(-1).view(np.uint8)
    return zlib.crc32(np.ascontiguousarray(slot, dtype=np.int32).reshape(-1).view(np.uint8), zlib.crc32(rows))


def pack_digests(digests: dict[int, int]) -> list:
    """``{step: digest}`` of consecutive steps as ``[[first step, uint32 bytes]]`` (a snapshot's
    ``digests``: 4 bytes a step); a gap starts another chunk."""
    chunks: list = []
    for step in sorted(digests):
        if not chunks or step != chunks[-1][0] + len(chunks[-1][1]):
            chunks.append([step, []])
        chunks[-1][1].append(digests[step])
    return [[first, np.asarray(ds, dtype="<u4").tobytes()] for first, ds in chunks]


def digests_after(chunks, step: int) -> list:
    """The parts of :func:`pack_digests`' chunks after ``step`` (what a delta adds to its base)."""
    out = []
    for first, blob in chunks:
        skip = max(step + 1 - int(first), 0) * 4
        if skip < len(blob):
            out.append([int(first) + skip // 4, blob[skip:]])
    return out


def unpack_digests(chunks) -> dict[int, int]:
    """:func:`pack_digests`' chunks (from a base and its deltas, in order) as ``{step: digest}``."""
    out: dict[int, int] = {}
    for first, blob in chunks or ():
        for k, d in enumerate(np.frombuffer(blob, dtype="<u4").tolist()):
            out[int(first) + k] = d
    return out


class Ledger(Mapping):
    def __init__(self, history_steps: int = 100_000):
        self.history_steps = history_steps
        self.entries: OrderedDict[int, dict] = OrderedDict()
        self.metrics: OrderedDict[int, dict] = OrderedDict()

    def __getitem__(self, step: int) -> dict:
        return self.entries[step]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def record(
        self, step: int, pieces: np.ndarray, slot: np.ndarray, drops: np.ndarray, metrics: dict, committed: int
    ) -> dict:
        """Enter step ``step`` (its piece rows, ordered by rank and micro-batch, with their int32
        ``[rank, micro_batch]``) with its ``metrics``; forget what the history no longer holds (never an uncommitted
        step)."""
        entry = self.entries[step] = {"pieces": pieces, "slot": slot, "dropped": drops}
        self.metrics[step] = metrics
        while len(self.metrics) > self.history_steps:
            self.metrics.popitem(last=False)
        while len(self.entries) > self.history_steps and next(iter(self.entries)) < committed:
            self.entries.popitem(last=False)
        return entry

    def packed_digests(self, first: int, last: int) -> list:
        """The digests of steps ``first..last`` (those the metrics still hold), packed
        (:func:`pack_digests`): what a snapshot keeps for the steps a restore re-plans."""
        return pack_digests(
            {s: m["digest"] for s in range(first, last + 1) if (m := self.metrics.get(s)) is not None and "digest" in m}
        )

    def keep_before(self, step: int, other: Ledger) -> None:
        """Take ``other``'s entries and metrics of the steps before ``step`` (a rewound planner
        keeps the history of what was handed out before the step it goes back to)."""
        self.entries = OrderedDict([(k, v) for k, v in other.entries.items() if k < step] + list(self.entries.items()))
        self.metrics = OrderedDict([(k, v) for k, v in other.metrics.items() if k < step] + list(self.metrics.items()))


def step_metrics(
    step: int,
    pieces: np.ndarray,
    drops: np.ndarray,
    mb_costs: np.ndarray,
    piece_costs: np.ndarray,
    *,
    n_sources: int,
    step_tokens: int,
    dp: int,
    context: dict,
) -> dict:
    """A planned step's figures: tokens and fill, cost imbalance across ranks and micro-batches,
    tokens per source, the cost lower bound, drops; ``context`` (pending, weights, version,
    stage, piece size) is passed through in order."""
    lens = P.lengths(pieces)
    tokens = int(lens.sum())
    imb, mb_imb = step_imbalance(mb_costs)
    rank_costs = mb_costs.sum(axis=1)
    out = {
        "step": step,
        "tokens": tokens,
        "fill": float(tokens / step_tokens),
        "imbalance": imb,
        "mb_imbalance": mb_imb,
        "source_tokens": tuple(P.source_tokens(pieces, n_sources).tolist()),
        "longest_piece": int(lens.max()) if len(lens) else 0,
        "cost_max": float(rank_costs.max()),
        "cost_mean": float(rank_costs.mean()),
        "lower_bound": float(max(piece_costs.max(initial=0.0), rank_costs.sum() / dp)),
    }
    out.update(context)
    if len(drops):
        out["dropped_docs"] = tuple(int(x) for x in np.bincount(drops[:, 0], minlength=n_sources))
        out["dropped_tokens"] = tuple(
            int(x) for x in np.bincount(drops[:, 0], weights=drops[:, 4], minlength=n_sources)
        )
    else:  # (most steps)
        out["dropped_docs"] = out["dropped_tokens"] = (0,) * n_sources
    return out
