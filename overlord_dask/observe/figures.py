"""The one definition of each figure the project reports: imbalance, mix error, rank lag,
exactly-once accounting.

The planner's ledger (per-step imbalance), the dashboard and Prometheus, ``overlord status``,
``overlord demo``, the benchmarks and the tests all compute them here, so that "imbalance",
"mix error" and "exactly once" mean the same thing everywhere. Pure numpy: every process role
may import it.
"""

from __future__ import annotations

import numpy as np

from .. import pieces as P

MIX_WINDOW = 20  # steps the dashboard's and the status's mix error is measured over


# ---- balance ------------------------------------------------------------------------------------
def imbalance(costs: np.ndarray) -> float:
    """max/mean of a 1-D array of per-rank costs; 1.0 is perfect, and an all-zero step counts as 1."""
    c = np.asarray(costs, dtype=np.float64)
    mean = c.mean() if len(c) else 0.0
    return float(c.max() / mean) if mean > 0 else 1.0


def step_imbalance(mb_costs: np.ndarray) -> tuple[float, float]:
    """From ``mb_costs[rank, mb]``: (step-level imbalance for trainers that sync once per step, as DDP
    does; micro-batch-level imbalance for trainers that sync every micro-batch, as FSDP does: the
    worst micro-batch index)."""
    step = imbalance(mb_costs.sum(axis=1))
    if mb_costs.shape[1] == 1:  # (one micro-batch: its costs are the ranks')
        return step, step
    mb = max(imbalance(mb_costs[:, m]) for m in range(mb_costs.shape[1]))
    return step, mb


def rank_lag(acked: list[int]) -> list[int]:
    """Per rank: how many steps it is behind the most advanced rank (from each rank's last
    acknowledged step)."""
    top = max(acked) if acked else 0
    return [top - a for a in acked]


# ---- mix ----------------------------------------------------------------------------------------
def per_source(values, n: int) -> np.ndarray:
    """A step's per-source list as ``n`` entries (a step planned before a live update added
    sources has fewer)."""
    out = np.zeros(n)
    out[: len(values)] = values
    return out


def mix_error(delivered, declared):
    """The mix error: the largest gap between a source's share of the ``delivered`` tokens and
    its ``declared`` share, over the last axis (sources). ``declared`` is weights or declared
    tokens (either is normalised here); 0 where nothing was delivered. Every mix error the
    project reports (status, dashboard, demo, benchmarks) is this one."""
    d = np.asarray(delivered, dtype=np.float64)
    w = np.asarray(declared, dtype=np.float64)
    d_total = d.sum(axis=-1, keepdims=True)
    w_total = w.sum(axis=-1, keepdims=True)
    gap = np.abs(d / np.maximum(d_total, 1) - w / np.where(w_total > 0, w_total, 1)).max(axis=-1)
    gap = np.where(d_total[..., 0] > 0, gap, 0.0)
    return float(gap) if gap.ndim == 0 else gap


def window_mix_errors(source_tokens: np.ndarray, weights: np.ndarray, window: int) -> np.ndarray:
    """:func:`mix_error` of every window of ``window`` consecutive steps (sliding), where the
    declared share weighs each step's weights by that step's tokens. ``source_tokens`` and
    ``weights`` are [steps, sources]."""
    t = np.asarray(source_tokens, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64) * t.sum(axis=1, keepdims=True)
    if len(t) < window:
        return np.zeros(0)
    ct = np.concatenate([np.zeros((1, t.shape[1])), np.cumsum(t, axis=0)])
    cw = np.concatenate([np.zeros((1, t.shape[1])), np.cumsum(w, axis=0)])
    return mix_error(ct[window:] - ct[:-window], cw[window:] - cw[:-window])


def mix_grain(metrics: list[dict], dp: int, policy: str) -> float | None:
    """How far one group of long pieces moves the mix of a window of planned-step ``metrics``:
    ``dp`` of the window's longest pieces over its tokens (None for an empty window, and for a
    ``policy`` other than the cost balancer's). The cost balancer places long pieces ``dp`` at a
    time, one per rank in one micro-batch row, so a source's share over the window runs up to
    about this much off the declared one, whatever the window; pieces of at most
    ``topology.max_doc_tokens`` tokens make it smaller. (The balance policy is fixed for a run.)"""
    if policy != "cost" or not metrics:  # (none: a service that stopped meanwhile)
        return None
    tokens = sum(m["tokens"] for m in metrics)
    if not tokens:
        return None
    return dp * max(m.get("longest_piece", 0) for m in metrics) / tokens


def window_figures(metrics: list[dict], n_sources: int) -> dict:
    """Over the planned-step ``metrics`` of a window: delivered and declared token share per
    source, the :func:`mix_error` between them, and the mean step and micro-batch imbalance
    (None each for an empty window)."""
    delivered = (
        np.sum([per_source(m["source_tokens"], n_sources) for m in metrics], axis=0) if metrics else np.zeros(n_sources)
    )
    declared = (
        np.sum([per_source(m["weights"], n_sources) * m["tokens"] for m in metrics], axis=0)
        if metrics
        else np.zeros(n_sources)
    )
    return {
        "delivered_share": delivered / max(float(np.sum(delivered)), 1.0),
        "declared_share": declared / max(float(np.sum(declared)), 1.0),
        "mix_error": mix_error(delivered, declared) if metrics else None,
        "imbalance": float(np.mean([m["imbalance"] for m in metrics])) if metrics else None,
        "mb_imbalance": float(np.mean([m["mb_imbalance"] for m in metrics])) if metrics else None,
    }


# ---- exactly once --------------------------------------------------------------------------------
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


def percentile(values, q: float) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.percentile(v, q)) if len(v) else float("nan")
