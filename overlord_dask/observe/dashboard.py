"""Watching a run without writing Python: the snapshot that the Overlord page on the Dask
dashboard's HTTP server (``/overlord`` and ``/overlord.json``: ``http.py``, ``page.py``) and the
Prometheus metrics (``prometheus.py``) read.

The snapshot (:func:`snapshot`) is refreshed by the planner thread at most every half second,
so neither a page view nor a scrape touches the planner's state from the event loop, and
neither costs the planner anything while nobody looks.
"""

from __future__ import annotations

import time
from collections import deque

from .figures import MIX_WINDOW, mix_grain, per_source, rank_lag, window_figures

HISTORY = 200  # steps the page and the series show
RATE_WINDOW_S = 60.0  # the headline tokens/s and steps/s are over this much wall-clock time


class ProgressHistory:
    """``(time, committed, tokens committed)`` samples, one every ``every_s`` seconds for
    the last ``keep`` samples (30 minutes): the page's throughput over wall-clock time and the
    headline rates. A rewind (committed or tokens going down) starts the rates again."""

    def __init__(self, every_s: float = 2.0, keep: int = 900):
        self.every_s = every_s
        self.samples: deque = deque(maxlen=keep)

    def add(self, now: float, committed: int, tokens: int) -> None:
        if self.samples and now - self.samples[-1][0] < self.every_s:
            return
        if self.samples and (committed < self.samples[-1][1] or tokens < self.samples[-1][2]):
            self.samples.clear()
        self.samples.append((round(now, 3), committed, tokens))

    def rates(self, now: float, window_s: float = RATE_WINDOW_S) -> dict:
        """Tokens and steps per second over the newest ``window_s`` seconds of samples."""
        recent = [s for s in self.samples if s[0] >= now - window_s]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return {"tokens_per_s": None, "steps_per_s": None, "seconds": 0.0}
        (t0, c0, k0), (t1, c1, k1) = recent[0], recent[-1]
        return {"tokens_per_s": (k1 - k0) / (t1 - t0), "steps_per_s": (c1 - c0) / (t1 - t0), "seconds": t1 - t0}


PLUGIN = "overlord-planner"  # the planner plugin's name on the scheduler (scheduler/plugin.py)


def snapshot(
    state,
    signals,
    *,
    run_id: str,
    scaling: dict | None,
    snapshots: list,
    loop: dict,
    extra: dict,
    history: ProgressHistory | None = None,
) -> dict:
    """(planner thread) What the page and the gauges show, as plain data."""
    committed, now = state.committed, time.time()
    if history is not None:
        history.add(now, committed, state.tokens_committed)
    steps = []
    for s in reversed(state.metrics):  # the newest HISTORY steps (the metrics keep up to 100,000)
        if s <= state.next_step - HISTORY:
            break
        steps.append(s)
    steps.reverse()
    series = [state.metrics[s] for s in steps]
    names = list(state.source_names)
    recent = [m for m in series if committed - MIX_WINDOW <= m["step"] < committed]  # committed steps only
    window = window_figures(recent, len(names))
    d_share, w_share = window["delivered_share"], window["declared_share"]
    acked = list(state.progress.acked)
    lost = extra.get("dropped", {})
    records = lost.get("records", {})
    sources = []
    for i, s in enumerate(state.streams):
        sources.append(
            {
                "source": s.name,
                "pool": state.timeline.source(s.name).pool_name,
                "weight": float(state.timeline.mix_at(committed)[i]),  # the next step every rank consumes
                "delivered_share": float(d_share[i]) if i < len(d_share) else 0.0,
                "declared_share": float(w_share[i]) if i < len(w_share) else 0.0,
                "epoch": int(s.epoch),
                "loads_pending": len(s.loads.requested),
                "units_loaded": s.loaded_units(),
                "seconds_per_token": signals.seconds_per_token(s.name),
                "records_read": records.get(s.name, {}).get("read", 0),
                "records_dropped": records.get(s.name, {}).get("dropped", 0),
                "units_quarantined": sum(q["source"] == s.name for q in lost.get("quarantined", [])),
            }
        )
    return {
        "run_id": run_id,
        "time": now,
        "name": state.final_plan.name,
        "dp": state.topology.dp,
        "planned": state.next_step,
        "committed": committed,
        "durable": state.progress.durable_step,
        "tokens_committed": state.tokens_committed,
        "starved_on": state.starved_on,
        "failure": state.failure,
        "rank_lag": rank_lag(acked),
        "mix_error": window["mix_error"],
        "mix_grain": mix_grain(recent, state.topology.dp, state.final_plan.balance.policy),
        "imbalance": window["imbalance"],
        "mb_imbalance": window["mb_imbalance"],
        "series": {
            "step": steps,
            "imbalance": [m["imbalance"] for m in series],
            "mb_imbalance": [m["mb_imbalance"] for m in series],
            "share": {
                name: [float(per_source(m["source_tokens"], len(names))[i]) / max(m["tokens"], 1) for m in series]
                for i, name in enumerate(names)
            },
            "weight": {
                name: [float(per_source(m["weights"], len(names))[i]) for m in series] for i, name in enumerate(names)
            },
        },
        "sources": sources,
        "pools": (scaling or {}).get("decisions", {}),
        "arrived": (scaling or {}).get("arrived", {}),
        "last_snapshot": snapshots[-1] if snapshots else None,
        "loop": loop,
        "history": list(history.samples) if history is not None else [],
        "rates": history.rates(now) if history is not None else {},
        **extra,
    }
