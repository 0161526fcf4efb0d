"""Run reports: what was delivered against what was planned and declared.

Used by ``overlord demo``, the benchmarks and the tests, so that "exactly once" and "mix error"
mean the same thing everywhere.
"""

from __future__ import annotations

import numpy as np

from .planner import pieces as P


def delivered_record(batch: dict) -> dict[str, np.ndarray]:
    """Per piece of a rank's step batch: identity and length (for exactly-once accounting)."""
    cols = {k: [] for k in ("micro_batch", "source", "epoch", "sample", "start", "length")}
    for m, mb in enumerate(batch["micro_batches"]):
        n = len(mb["sample_ids"])
        cols["micro_batch"].append(np.full(n, m))
        cols["source"].append(mb["source_ids"])
        cols["epoch"].append(mb["epochs"])
        cols["sample"].append(mb["sample_ids"])
        cols["start"].append(mb["piece_starts"])
        cols["length"].append(np.diff(mb["cu_seqlens"]))
    return {k: np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for k, v in cols.items()}


def _identity(source, epoch, sample, start) -> np.ndarray:
    return np.stack([source, epoch, sample, start], axis=1).astype(np.int64)


def exactly_once(planned: list[np.ndarray], delivered: list[np.ndarray]) -> tuple[int, int]:
    """(duplicates, missing) between planned and delivered piece identities ``[source, epoch,
    sample, start token]`` (each a list of [n, 4] arrays). Duplicates count every extra delivery of a
    piece; missing counts planned pieces never delivered."""
    p = np.concatenate(planned) if planned else np.zeros((0, 4), np.int64)
    d = np.concatenate(delivered) if delivered else np.zeros((0, 4), np.int64)
    d_unique, d_counts = P.unique_rows(d, return_counts=True)
    duplicates = int((d_counts - 1).sum())
    p_unique = P.unique_rows(p)
    duplicates += len(p) - len(p_unique)  # the planner itself must never plan a piece twice
    if len(p_unique) == 0:
        return duplicates, 0
    merged = np.concatenate([p_unique, d_unique])
    _, counts = P.unique_rows(merged, return_counts=True)
    missing = len(p_unique) - int((counts == 2).sum())
    return duplicates, missing


def planned_identities(ledger_entry: dict) -> np.ndarray:
    p = ledger_entry["pieces"]
    return _identity(p[:, P.SOURCE], p[:, P.EPOCH], ledger_entry["sample_ids"], p[:, P.START])


def delivered_identities(rec: dict) -> np.ndarray:
    return _identity(rec["source"], rec["epoch"], rec["sample"], rec["start"])


def window_mix_errors(source_tokens: np.ndarray, weights: np.ndarray, window: int) -> np.ndarray:
    """Per window of ``window`` consecutive steps (sliding): the largest gap between a source's
    delivered token share and its declared share, where the declared share weighs each step's
    weights by that step's tokens. ``source_tokens`` and ``weights`` are [steps, sources]."""
    t = np.asarray(source_tokens, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64) * t.sum(axis=1, keepdims=True)
    if len(t) < window:
        return np.zeros(0)
    ct = np.concatenate([np.zeros((1, t.shape[1])), np.cumsum(t, axis=0)])
    cw = np.concatenate([np.zeros((1, t.shape[1])), np.cumsum(w, axis=0)])
    got, want = ct[window:] - ct[:-window], cw[window:] - cw[:-window]
    total = got.sum(axis=1, keepdims=True)
    return np.abs(got - want).max(axis=1) / np.maximum(total[:, 0], 1)


def mix_error(source_tokens: np.ndarray, weights: np.ndarray) -> float:
    """Largest gap between a source's delivered token share and its declared share."""
    t = np.asarray(source_tokens, dtype=np.float64)
    return float(np.abs(t / t.sum() - np.asarray(weights)).max()) if t.sum() > 0 else 0.0


def percentile(values, q: float) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.percentile(v, q)) if len(v) else float("nan")
