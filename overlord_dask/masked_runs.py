"""Masked runs: how the loss mask of a unit's documents reaches the planner.

The planner sees metadata only, yet it counts each step's loss tokens (``step_loss_tokens``, so a
trainer's per-token loss needs no all-reduce). Where the loss ignores some tokens (a chat's prompt
turns, masked labels), the per-token mask stays with the block on its worker; the planner gets
the ignored tokens as runs, a few numbers per document (a chat has two runs per turn), and counts
the masked targets of any piece from them, wherever the planner cut the document.

Layout of one unit's runs (int64, little-endian on the wire): ``[n_docs + 1]`` offsets of each
document's runs in the run list, then ``(start, stop)`` per run in the document's own positions.
"""

from __future__ import annotations

import numpy as np


def encode(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The runs of ``mask == 0`` of documents ``offsets`` (a run never spans two documents)."""
    off = np.asarray(mask) == 0
    edges = np.diff(np.concatenate([[False], off, [False]]).astype(np.int8))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    cut = np.unique(np.concatenate([starts, stops, offsets[1:-1]]))  # cut runs at every document start inside them
    a, b = cut[:-1], cut[1:]
    inside = (b > a) & (off[np.minimum(a, len(off) - 1)] if len(off) else np.zeros(len(a), bool))
    a, b = a[inside], b[inside]
    doc = np.searchsorted(offsets, a, side="right") - 1
    n = len(offsets) - 1
    run_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(doc, minlength=n), out=run_off[1:])
    return np.concatenate([run_off, np.stack([a - offsets[doc], b - offsets[doc]], axis=1).reshape(-1)]).astype(
        np.int64
    )


def split(runs: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """(run offsets per document ``[n_docs + 1]``, runs ``[n_runs, 2]``)."""
    return runs[: n_docs + 1], runs[n_docs + 1 :].reshape(-1, 2)


def concat(parts: list[tuple[np.ndarray | None, int]]) -> np.ndarray | None:
    """One unit's runs from its consecutive parts' ``(runs or None, n_docs)``; None if none masks."""
    if all(r is None for r, _ in parts):
        return None
    offs, lists, shift = [np.zeros(1, np.int64)], [], 0
    for r, n in parts:
        off, rr = split(r, n) if r is not None else (np.zeros(n + 1, np.int64), np.zeros((0, 2), np.int64))
        offs.append(off[1:] + shift)
        lists.append(rr)
        shift += len(rr)
    return np.concatenate([np.concatenate(offs), np.concatenate(lists).reshape(-1)]).astype(np.int64)


def masked_in(runs: np.ndarray, n_docs: int, docs: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per query, how many positions of ``[lo, hi)`` of document ``docs`` are masked."""
    off, rr = split(runs, n_docs)
    out = np.zeros(len(docs), dtype=np.int64)
    counts = off[docs + 1] - off[docs]
    for k in np.flatnonzero(counts).tolist():
        r = rr[off[docs[k]] : off[docs[k] + 1]]
        out[k] = int(np.clip(np.minimum(r[:, 1], hi[k]) - np.maximum(r[:, 0], lo[k]), 0, None).sum())
    return out
