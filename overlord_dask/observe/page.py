"""The ``/overlord`` page: a jinja2 template (``templates/overlord.html``) over the dashboard
snapshot (``dashboard.snapshot``), with its charts drawn by matplotlib as inline SVG.

Rendering runs off the scheduler's event loop (``http.py`` hands it to a thread): a chart costs
tens of milliseconds, which the loop must not pay. Without matplotlib (a service installed without
it) the page shows its tables and says what is missing.
"""

from __future__ import annotations

import functools
import io
import json
from importlib import resources

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@functools.lru_cache(maxsize=1)
def _template():
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.globals["table"] = _table
    return env.from_string(resources.files("overlord_dask.observe").joinpath("templates", "overlord.html").read_text())


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return "" if v is None else str(v)


def _table(rows: list[dict]):
    """An HTML table of ``rows`` (their keys as columns), escaped."""
    from markupsafe import Markup, escape

    if not rows:
        return Markup("<p><i>none</i></p>")
    cols = list(rows[0])
    head = "".join(f"<th>{escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return Markup(f"<table><tr>{head}</tr>{body}</table>")


def _chart(xs: list, lines: list[tuple[str, list, str, bool]], ylabel: str) -> str:
    """A line chart as an SVG document: ``lines`` = (label, ys, colour, dashed)."""
    try:
        from matplotlib.backends.backend_svg import FigureCanvasSVG
        from matplotlib.figure import Figure
    except ImportError:
        return "<p><i>charts need matplotlib (pip install matplotlib)</i></p>"
    if not xs:
        return "<p><i>no steps yet</i></p>"
    fig = Figure(figsize=(7.5, 2.4))
    FigureCanvasSVG(fig)
    ax = fig.add_subplot()
    for label, ys, colour, dashed in lines:
        ax.plot(
            xs,
            [float("nan") if y is None else y for y in ys],
            color=colour,
            linestyle="--" if dashed else "-",
            linewidth=1.2,
            label=None if dashed else label,
        )
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg") :]  # inline: no XML prolog


def render(snap: dict) -> str:
    """The page for one snapshot."""
    s = snap["series"]
    names = list(s["share"])
    mix = [(f"{n} delivered", s["share"][n], COLORS[i % len(COLORS)], False) for i, n in enumerate(names)]
    mix += [(f"{n} weight", s["weight"][n], COLORS[i % len(COLORS)], True) for i, n in enumerate(names)]
    imb = [
        ("step (DDP)", s["imbalance"], COLORS[0], False),
        ("micro-batch (FSDP)", s["mb_imbalance"], COLORS[1], False),
    ]
    head = {
        k: snap[k]
        for k in (
            "run_id",
            "name",
            "dp",
            "planned",
            "committed",
            "durable",
            "starved_on",
            "mix_error",
            "imbalance",
            "mb_imbalance",
            "failure",
        )
    }
    waits = snap.get("rank_wait_share", {})
    ranks = [
        {"rank": r, "steps behind the most advanced rank": v, "wait share": waits.get(str(r))}
        for r, v in enumerate(snap["rank_lag"])
    ]
    pools = [
        {"pool": p, "workers": snap["arrived"].get(p), **{k: d.get(k) for k in ("target", "demand_cores", "reason")}}
        for p, d in snap["pools"].items()
    ]
    quarantined = [
        {k: q[k] for k in ("source", "unit", "step", "reason")} for q in snap.get("dropped", {}).get("quarantined", [])
    ]
    control = {
        "last snapshot": snap["last_snapshot"],
        "loop block max ms": snap["loop"].get("block_max_ms"),
        **snap.get("counters", {}),
    }
    plots = {
        "mix": _chart(s["step"], mix, "share of the step"),
        "balance": _chart(s["step"], imb, "max / mean rank cost"),
    }
    fit, decisions = feedback_tables(snap.get("feedback") or {})
    return _template().render(
        snap=snap,
        head=head,
        ranks=ranks,
        pools=pools,
        quarantined=quarantined,
        control=control,
        plots=plots,
        fit=fit,
        decisions=decisions,
    )


def feedback_tables(fb: dict) -> tuple[list[dict], list[dict]]:
    """The learned cost model (declared at its best scale vs fitted, seconds per unit of each
    term) and the planner's decisions, newest first, with their reasons."""
    cf = fb.get("cost_fit") or {}
    fit = [
        {"term": t, "declared (best scale)": cf["declared"][t], "fitted": cf["fitted"][t]} for t in cf.get("fitted", {})
    ]
    if cf:
        fit.append(
            {
                "term": "median error",
                "declared (best scale)": cf.get("error_declared"),
                "fitted": cf.get("error_fitted"),
            }
        )
    decisions = [
        {
            "from step": d["at"],
            "kind": d["kind"],
            "values": {k: round(v, 4) for k, v in d["values"].items()},
            "reason": d["reason"],
        }
        for d in reversed(fb.get("decisions", []))
    ]
    return fit, decisions


def as_json(snap: dict) -> str:
    return json.dumps(snap, default=_fmt)
