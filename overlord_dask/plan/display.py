"""HTML views of a plan for Jupyter (``Plan._repr_html_``): sources, weights, stages, topology."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from .schedule import Schedule

if TYPE_CHECKING:
    from .plan import Plan


def _weight_text(w) -> str:
    if not isinstance(w, Schedule):
        return f"{w:g}"
    if w.stages is not None:
        return "stages " + ", ".join(f"{v:g}@{s}" for s, v in w.stages)
    if w.ramp is not None:
        return "ramp " + " → ".join(f"{v:g}@{s}" for s, v in w.ramp)
    return f"function {w.function}"


def html_table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def plan_html(plan: Plan) -> str:
    t = plan.topology
    parts = [
        f"<b>plan {html.escape(plan.name)}</b> (seed {plan.seed}): dp {t.dp} × {t.micro_batches} micro-batches × "
        f"{t.tokens_per_micro_batch:,} tokens"
        + (f", cp {t.cp}" if t.cp > 1 else "")
        + f", balance {plan.balance.policy}"
    ]
    parts.append(
        html_table(
            ["source", "format", "url", "weight", "active"],
            [
                [
                    s.name,
                    s.format,
                    s.url,
                    _weight_text(s.weight),
                    f"{s.start_step}…{s.stop_step if s.stop_step is not None else ''}",
                ]
                for s in plan.sources
            ],
        )
    )
    if plan.stages:
        parts.append(
            html_table(
                ["stage", "from step", "weights", "ramp", "max piece", "long docs"],
                [
                    [
                        st.name,
                        st.start_step,
                        ", ".join(f"{k} {v:g}" for k, v in (st.weights or {}).items()) or "(sources' own)",
                        st.ramp_steps or "",
                        st.max_doc_tokens or "",
                        st.long_policy
                        + (f", {st.long_share:.0%} over {st.long_tokens:,}" if st.long_share is not None else ""),
                    ]
                    for st in plan.stages
                ],
            )
        )
    return "".join(parts)
