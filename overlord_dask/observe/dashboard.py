"""Watching a run without writing Python: an Overlord page on the Dask dashboard's HTTP server
(``/overlord``, plus ``/overlord.json``), and the snapshot it and the Prometheus metrics
(``prometheus.py``) read.

The snapshot (:func:`snapshot`) is refreshed by the planner thread at most every half second,
so neither a page view nor a scrape touches the planner's state from the event loop, and
neither costs the planner anything while nobody looks. The page is plain HTML with inline SVG
charts (declared vs delivered mix, step and micro-batch imbalance, per-rank lag): it needs no
bokeh and no JavaScript, so it loads in any browser and in ``curl``.
"""

from __future__ import annotations

import html
import json
import weakref

import numpy as np

from .figures import MIX_WINDOW, per_source, rank_lag, window_figures

HISTORY = 200  # steps the page and the series show

_PAGES: "weakref.WeakSet" = weakref.WeakSet()  # schedulers whose HTTP server serves the page already
PLUGIN = "overlord-planner"  # the planner plugin's name on the scheduler (scheduler/plugin.py)


def snapshot(state, signals, *, run_id: str, scaling: dict | None, snapshots: list, loop: dict, extra: dict) -> dict:
    """(planner thread) What the page and the gauges show, as plain data."""
    committed = state.committed
    steps = []
    for s in reversed(state.metrics):  # the newest HISTORY steps (the metrics keep up to 100,000)
        if s <= state.next_step - HISTORY:
            break
        steps.append(s)
    steps.reverse()
    series = [state.metrics[s] for s in steps]
    names = list(state.source_names)
    recent = [m for m in series if committed - MIX_WINDOW < m["step"] <= committed]
    window = window_figures(recent, len(names))
    d_share, w_share = window["delivered_share"], window["declared_share"]
    acked = list(state.progress.acked)
    lost = extra.get("losses", {})
    records = lost.get("records", {})
    sources = []
    for i, s in enumerate(state.streams):
        sources.append({
            "source": s.name, "pool": state.timeline.source(s.name).pool_name,
            "weight": float(state.weights_at(max(committed + 1, 0))[i]),
            "delivered_share": float(d_share[i]) if i < len(d_share) else 0.0,
            "declared_share": float(w_share[i]) if i < len(w_share) else 0.0,
            "epoch": int(s.epoch), "loads_pending": len(s.loads.requested), "units_loaded": len(s.lengths),
            "seconds_per_token": signals.seconds_per_token(s.name),
            "records_read": records.get(s.name, {}).get("read", 0), "records_dropped": records.get(s.name, {}).get("dropped", 0),
            "units_quarantined": sum(q["source"] == s.name for q in lost.get("quarantined", [])),
        })
    return {
        "run_id": run_id, "name": state.final_plan.name, "dp": state.topology.dp, "planned": state.next_step, "committed": committed,
        "durable": state.progress.durable_step, "starved_on": state.starved_on, "failure": state.failure,
        "rank_lag": rank_lag(acked),
        "mix_error": window["mix_error"], "imbalance": window["imbalance"], "mb_imbalance": window["mb_imbalance"],
        "series": {"step": steps, "imbalance": [m["imbalance"] for m in series], "mb_imbalance": [m["mb_imbalance"] for m in series],
                   "share": {name: [float(per_source(m["source_tokens"], len(names))[i]) / max(m["tokens"], 1) for m in series]
                             for i, name in enumerate(names)},
                   "weight": {name: [float(per_source(m["weights"], len(names))[i]) for m in series] for i, name in enumerate(names)}},
        "sources": sources, "pools": (scaling or {}).get("decisions", {}), "arrived": (scaling or {}).get("arrived", {}),
        "last_snapshot": snapshots[-1] if snapshots else None, "loop": loop, **extra,
    }


# ---- the page ----------------------------------------------------------------------------------
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _svg(xs: list, lines: list[tuple[str, list, str, bool]], title: str, width: int = 640, height: int = 180) -> str:
    """A line chart: ``lines`` = (label, ys, colour, dashed)."""
    pad = 30
    ys_all = [y for _, ys, _, _ in lines for y in ys if y is not None]
    if not xs or not ys_all:
        return f"<p><i>{html.escape(title)}: no steps yet</i></p>"
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(0.0, min(ys_all)), max(ys_all) * 1.05 or 1.0
    def pt(x, y):
        return f"{pad + (x - x0) / (x1 - x0) * (width - 2 * pad):.1f},{height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad):.1f}"
    out = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" role="img"><title>{html.escape(title)}</title>',
           f'<text x="{pad}" y="14" font-size="12">{html.escape(title)}</text>',
           f'<text x="2" y="{height - pad}" font-size="10">{y0:g}</text><text x="2" y="{pad}" font-size="10">{y1:.3g}</text>',
           f'<text x="{pad}" y="{height - 8}" font-size="10">step {x0}</text>',
           f'<text x="{width - pad - 60}" y="{height - 8}" font-size="10">step {x1}</text>']
    for k, (label, ys, colour, dashed) in enumerate(lines):
        pts = " ".join(pt(x, y) for x, y in zip(xs, ys) if y is not None)
        dash = ' stroke-dasharray="4 3"' if dashed else ""
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{pts}"/>')
        if not dashed:
            out.append(f'<text x="{width - pad - 120}" y="{pad + 12 * k}" font-size="10" fill="{colour}">{html.escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def _table(rows: list[dict]) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return "" if v is None else str(v)


def render(snap: dict) -> str:
    s = snap["series"]
    names = list(s["share"])
    mix = [(f"{n} delivered", s["share"][n], COLORS[i % len(COLORS)], False) for i, n in enumerate(names)]
    mix += [(f"{n} declared", s["weight"][n], COLORS[i % len(COLORS)], True) for i, n in enumerate(names)]
    imb = [("step (DDP)", s["imbalance"], COLORS[0], False), ("micro-batch (FSDP)", s["mb_imbalance"], COLORS[1], False)]
    head = {k: snap[k] for k in ("run_id", "name", "dp", "planned", "committed", "durable", "starved_on", "mix_error", "imbalance",
                                 "mb_imbalance", "failure")}
    waits = snap.get("rank_wait_share", {})
    lag = [{"rank": r, "steps behind the most advanced rank": v, "wait share": waits.get(str(r))} for r, v in enumerate(snap["rank_lag"])]
    pools = [{"pool": p, "workers": snap["arrived"].get(p), **{k: d.get(k) for k in ("target", "demand_cores", "reason")}}
             for p, d in snap["pools"].items()]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>overlord: {html.escape(str(snap['run_id']))}</title>
<meta http-equiv="refresh" content="5"><style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:right}} h2{{font-size:16px;margin-top:1.2em}}</style></head><body>
<h1>overlord run {html.escape(str(snap['run_id']))}</h1>
{_table([head])}
<h2>Mix: delivered (solid) and declared (dashed) share per step</h2>{_svg(s['step'], mix, 'share of the step per source')}
<h2>Balance: max / mean rank cost per step</h2>{_svg(s['step'], imb, 'imbalance')}
<h2>Sources</h2>{_table(snap['sources'])}
<h2>Ranks</h2>{_table(lag)}
<h2>Loader pools</h2>{_table(pools)}
<h2>Quarantined units</h2>{_table([{k: q[k] for k in ("source", "unit", "step", "reason")} for q in snap.get("losses", {}).get("quarantined", [])])}
<h2>Snapshots, event loop, control path</h2>{_table([{'last snapshot': snap['last_snapshot'], 'loop block max ms': snap['loop'].get('block_max_ms'),
                                              **snap.get('counters', {})}])}
</body></html>"""


def install_page(scheduler) -> None:
    """Add ``/overlord`` and ``/overlord.json`` to the scheduler's HTTP server (once per scheduler)."""
    app = getattr(scheduler, "http_application", None)
    if app is None or scheduler in _PAGES:
        return
    from tornado import web

    class Page(web.RequestHandler):
        def get(self, as_json: str = ""):
            plugin = scheduler.plugins.get(PLUGIN)
            snap = getattr(plugin, "observed", None)
            if snap is None:
                self.set_status(404)
                self.write("no overlord run on this scheduler")
                return
            if as_json:
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps(snap, default=_fmt))
            else:
                self.set_header("Content-Type", "text/html; charset=utf-8")
                self.write(render(snap))

    app.add_handlers(r".*$", [(r"/overlord(\.json)?", Page)])
    _PAGES.add(scheduler)
