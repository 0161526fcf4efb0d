"""Tables and plots for notebooks: what was and will be delivered, as Arrow tables and matplotlib plots.

Everything here reads the planner's metadata (metrics, ledger, plan versions), which ``Service``
fetches through its routes (``service/views.py``); no batch is fetched. Tables are ``pyarrow.Table`` (``.to_pandas()``
when pandas is
installed); plots need matplotlib (the ``notebook`` extra). In a notebook::

    service = Service.attach("tcp://scheduler:8786")     # or the Service you started
    service.mix_table().to_pandas().pivot(index="step", columns="source", values="share")
    service.plot_mix(window=20)
    service.update_plan(new_plan, at_step=2000)
    service                                              # _repr_html_: status, versions, mix

"Will be delivered" has two parts: steps already planned but not yet committed (in the metrics,
``committed`` false) and the declared schedule of every later step (:func:`schedule_table`).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .. import pieces as P
from ..plan.display import html_table as _table

if TYPE_CHECKING:
    from ..planner.timeline import Timeline


def decisions_table(decisions: list) -> pa.Table:
    """One row per decision (``planner/timeline.py``): from step, kind, values (JSON) and reason."""
    import json

    return pa.table(
        {
            "step": pa.array([d.at for d in decisions], pa.int64()),
            "kind": pa.array([d.kind for d in decisions], pa.string()),
            "values": pa.array(
                [json.dumps({k: round(v, 6) for k, v in d.values.items()}) for d in decisions], pa.string()
            ),
            "reason": pa.array([d.reason for d in decisions], pa.string()),
        }
    )


def mix_table(metrics: list[dict], sources: list[str], committed: int | None = None) -> pa.Table:
    """One row per (planned step, source): tokens, share of the step, declared share (the
    step's weight), the plan version and stage in force, and whether the step is committed."""
    rows = {k: [] for k in ("step", "source", "tokens", "share", "declared", "version", "stage", "committed")}
    for m in metrics:
        toks = list(m["source_tokens"]) + [0] * (len(sources) - len(m["source_tokens"]))
        w = list(m.get("weights", [])) + [0.0] * (len(sources) - len(m.get("weights", [])))
        total = max(sum(toks), 1)
        for i, name in enumerate(sources):
            rows["step"].append(m["step"])
            rows["source"].append(name)
            rows["tokens"].append(int(toks[i]))
            rows["share"].append(toks[i] / total)
            rows["declared"].append(float(w[i]))
            rows["version"].append(int(m.get("version", 0)))
            rows["stage"].append(m.get("stage"))
            rows["committed"].append(committed is None or m["step"] < committed)
    return pa.table(
        rows,
        schema=pa.schema(
            [
                ("step", pa.int64()),
                ("source", pa.string()),
                ("tokens", pa.int64()),
                ("share", pa.float64()),
                ("declared", pa.float64()),
                ("version", pa.int32()),
                ("stage", pa.string()),
                ("committed", pa.bool_()),
            ]
        ),
    )


def schedule_table(timeline: Timeline, start: int, stop: int) -> pa.Table:
    """The declared mix of steps ``start..stop-1`` (normalised weights per source), the plan
    version and stage that will be in force, and the maximum piece length: what the plan says
    will be delivered, before it is planned."""
    rows = {k: [] for k in ("step", "source", "weight", "version", "stage", "piece_tokens")}
    for step in range(start, stop):
        w = timeline.weights_in_force(step)
        ctx = timeline.context_at(step)
        v = timeline.version_at(step)
        for name, x in zip(timeline.source_names, w):
            rows["step"].append(step)
            rows["source"].append(name)
            rows["weight"].append(float(x))
            rows["version"].append(v)
            rows["stage"].append(ctx.stage)
            rows["piece_tokens"].append(ctx.piece_tokens)
    return pa.table(rows)


def imbalance_table(metrics: list[dict]) -> pa.Table:
    """Per planned step: tokens, fill, step- and micro-batch-level imbalance, planner lower-bound gap."""
    cols = ("step", "tokens", "fill", "imbalance", "mb_imbalance", "pending")
    out = {k: [m[k] for m in metrics] for k in cols}
    out["gap_to_lower_bound"] = [m["cost_max"] / m["lower_bound"] - 1 if m.get("lower_bound") else 0.0 for m in metrics]
    return pa.table(out)


def pools_table(pools: list[dict]) -> pa.Table:
    """One row per (loader pool, source): the pool's workers, the autoscaler's target, demand in
    cores and last reason, and the source's measured CPU seconds per token and pending loads."""
    cols = ("pool", "source", "workers", "target", "demand_cores", "seconds_per_token", "loads_pending", "reason")
    rows: dict[str, list] = {k: [] for k in cols}
    for p in pools:
        for src in p["sources"]:
            for k in cols:
                rows[k].append(
                    src if k == "source" else p["seconds_per_token"].get(src) if k == "seconds_per_token" else p.get(k)
                )
    return pa.table(
        {
            k: pa.array(v, type=pa.float64() if k in ("demand_cores", "seconds_per_token") else None)
            for k, v in rows.items()
        }
    )


def scaling_table(history: list[dict]) -> pa.Table:
    """The autoscaler's changes: step, pool, workers from → to, and why."""
    cols = ("step", "pool", "from", "to", "reason")
    return pa.table(
        {k: [h.get(k) for h in history] for k in cols}
        if history
        else {k: pa.array([], pa.string() if k in ("pool", "reason") else pa.int64()) for k in cols}
    )


def pool_workers_table(metrics: list[dict]) -> pa.Table:
    """Per planned step of an autoscaled run: workers of each pool when the step was planned."""
    rows: dict[str, list] = {"step": [], "pool": [], "workers": []}
    for m in metrics:
        for pool, n in (m.get("pool_workers") or {}).items():
            rows["step"].append(m["step"])
            rows["pool"].append(pool)
            rows["workers"].append(int(n))
    return pa.table(
        {
            "step": pa.array(rows["step"], pa.int64()),
            "pool": pa.array(rows["pool"], pa.string()),
            "workers": pa.array(rows["workers"], pa.int64()),
        }
    )


DEFAULT_EDGES = np.array([0, 64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 40])


def length_table(ledger: dict[int, dict], sources: list[str], edges=DEFAULT_EDGES) -> pa.Table:
    """Histogram of delivered piece lengths per source over the given ledger steps: pieces and
    tokens per length bin (a split document counts once per piece)."""
    pieces = np.concatenate([e["pieces"] for e in ledger.values()]) if ledger else P.empty()
    lens = P.lengths(pieces)
    edges = np.asarray(edges)
    rows = {k: [] for k in ("source", "min_tokens", "max_tokens", "pieces", "tokens")}
    for i, name in enumerate(sources):
        mine = lens[pieces[:, P.SOURCE] == i]
        b = np.searchsorted(edges, mine, side="right") - 1
        for k in range(len(edges) - 1):
            sel = b == k
            rows["source"].append(name)
            rows["min_tokens"].append(int(edges[k]))
            rows["max_tokens"].append(int(edges[k + 1]) - 1)
            rows["pieces"].append(int(sel.sum()))
            rows["tokens"].append(int(mine[sel].sum()))
    return pa.table(rows)


def plot_mix(mix: pa.Table, window: int = 20, ax=None, schedule: pa.Table | None = None):
    """Declared (dashed) vs delivered (solid, share over a sliding window of ``window`` steps)
    token share per source; ``schedule`` adds the declared mix of steps not planned yet."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4))
    steps = np.unique(mix.column("step").to_numpy())
    src_col = np.asarray(mix.column("source").to_pylist())
    tok = mix.column("tokens").to_numpy().astype(np.float64)
    dec = mix.column("declared").to_numpy()
    step_col = mix.column("step").to_numpy()
    idx = np.searchsorted(steps, step_col)
    total = np.zeros(len(steps))
    np.add.at(total, idx, tok)
    k = np.ones(min(window, len(steps)))
    window_total = np.maximum(np.convolve(total, k, "valid"), 1)
    for name in dict.fromkeys(src_col):
        sel = src_col == name
        t = np.zeros(len(steps))
        d = np.zeros(len(steps))
        t[idx[sel]] = tok[sel]
        d[idx[sel]] = dec[sel]
        share = np.convolve(t, k, "valid") / window_total
        declared = np.convolve(d * total, k, "valid") / window_total
        x = steps[len(k) - 1 :]
        (line,) = ax.plot(x, share, label=f"{name} delivered")
        ax.plot(x, declared, ls="--", color=line.get_color(), label=f"{name} declared")
        if schedule is not None:
            ssel = np.asarray(schedule.column("source").to_pylist()) == name
            fut = schedule.column("step").to_numpy()[ssel]
            later = fut > steps.max()
            ax.plot(fut[later], schedule.column("weight").to_numpy()[ssel][later], ls=":", color=line.get_color())
    ax.set(xlabel="step", ylabel=f"token share ({window}-step window)", title="declared vs delivered mix")
    ax.legend(fontsize=7, ncol=2)
    return ax


# ---- HTML ---------------------------------------------------------------------------------------
def service_html(
    status: dict, timeline: Timeline, metrics: list[dict], run_id: str | None = None, dashboard: str | None = None
) -> str:
    """A service in a notebook: which run, its progress and page, plan versions, declared vs
    delivered mix over the last 20 planned steps."""
    w = timeline.weights_in_force(status["next_step"])
    recent = metrics[-20:]
    toks = np.zeros(len(timeline.source_names))
    for m in recent:
        toks[: len(m["source_tokens"])] += m["source_tokens"]
    share = toks / max(toks.sum(), 1)
    head = (
        "<b>overlord service</b>"
        + (f" {html.escape(run_id)}" if run_id else "")
        + (f' (<a href="{html.escape(dashboard)}" target="_blank">page</a>)' if dashboard else "")
        + f": committed {status['committed']}, planned {status['next_step']}, "
        f"plan version {status['plan_version']}"
        + (f", <b>failed</b>: {html.escape(status['failure'])}" if status.get("failure") else "")
    )
    versions = _table(
        ["version", "from step", "sources"],
        [[i, at, ", ".join(s.name for s in p.sources)] for i, (at, p) in enumerate(timeline.versions)],
    )
    mix = _table(
        ["source", "declared now", "delivered (last 20 steps)"],
        [[n, f"{a:.3f}", f"{b:.3f}"] for n, a, b in zip(timeline.source_names, w, share)],
    )
    return head + versions + mix
