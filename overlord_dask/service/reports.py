"""What a plan will do, seen before a run without a cluster: ``overlord plan-report`` (tokens and
epochs of each source up to a step, where stages and schedules change) and ``overlord preview``
(a source's first documents decoded, as a trainer will receive them).

Token counts of a pass over a source come from its index (documents per unit) and the documents
of a few units read here (their mean length): exact where every unit is read, an estimate
otherwise, and marked so. The tokens a step takes from a source are its declared share of the
step's tokens (``dp × micro_batches × tokens_per_micro_batch``, times ``balance.step_fill`` unless
``packing: cut`` fills every micro-batch).
"""

from __future__ import annotations

import numpy as np

from ..plan import Plan
from ..plan.versions import PlanVersions
from ..sources import read_unit
from .indexing import index_sources

CURVE_POINTS = 400  # steps at which cumulative tokens are evaluated for the report's curve


def source_passes(plan: Plan, sample_units: int = 2) -> dict[str, dict]:
    """Per source: documents and tokens in one pass over its files (read from up to
    ``sample_units`` units, spread over the source; ``exact`` when they are all of them)."""
    out = {}
    for name, units in index_sources(plan).items():
        src = plan.source(name)
        picks = sorted({int(i) for i in np.linspace(0, len(units) - 1, min(sample_units, len(units)))})
        blocks = [read_unit(src, plan, units[i]).block for i in picks]
        docs = sum(len(b) for b in blocks)
        tokens = sum(int(b.lengths().sum()) for b in blocks)
        exact = len(picks) == len(units)
        known = [u.n_docs for u in units]
        if exact:
            total_docs, total_tokens = docs, tokens
        elif None not in known:  # documents per unit known from the index: tokens scale with them
            total_docs = int(sum(known))
            total_tokens = int(round(tokens / max(docs, 1) * total_docs))
        else:  # units whose documents are counted only when read (jsonl byte ranges, webdataset shards)
            total_docs = int(round(docs / len(picks) * len(units)))
            total_tokens = int(round(tokens / len(picks) * len(units)))
        out[name] = {
            "units": len(units),
            "documents": total_docs,
            "tokens_per_pass": total_tokens,
            "exact": exact,
            "units_read": len(picks),
        }
    return out


def plan_report(plan: Plan, steps: int, sample_units: int = 2) -> dict:
    """Tokens and epochs per source up to ``steps``, the stage boundaries, and a curve of
    cumulative tokens per source (for a plot)."""
    timeline = PlanVersions(plan)
    names = timeline.source_names
    budget = plan.topology.step_tokens * (1.0 if plan.balance.packing == "cut" else plan.balance.step_fill)
    xs = np.unique(np.linspace(0, steps, min(CURVE_POINTS, steps + 1)).astype(np.int64))
    weights = np.array([timeline.declared_weights(int(s)) for s in xs])  # normalised shares at the sampled steps
    # tokens up to each sampled step: the shares integrated step by step (trapezoids between samples)
    per_step = weights * budget
    cum = np.zeros_like(per_step)
    if len(xs) > 1:
        cum[1:] = np.cumsum((per_step[1:] + per_step[:-1]) / 2 * np.diff(xs)[:, None], axis=0)
    passes = source_passes(plan, sample_units)
    sources = []
    for i, name in enumerate(names):
        p = passes[name]
        total = float(cum[-1, i])
        sources.append(
            {
                "source": name,
                "tokens": int(round(total)),
                "share": round(total / max(float(cum[-1].sum()), 1.0), 4),
                "tokens_per_pass": p["tokens_per_pass"],
                "epochs": round(total / max(p["tokens_per_pass"], 1), 3),
                "documents_per_pass": p["documents"],
                "pass_exact": p["exact"],
            }
        )
    stages = [{"name": st.name, "start_step": st.start_step} for st in plan.stages]
    return {
        "plan": plan.name,
        "steps": steps,
        "step_tokens": int(budget),
        "sources": sources,
        "stages": stages,
        "change_points": [c for c in plan.change_points() if c <= steps],
        "curve": {
            "step": xs.tolist(),
            "tokens": {name: cum[:, i].round().astype(np.int64).tolist() for i, name in enumerate(names)},
        },
    }


def plot_report(report: dict, path: str) -> None:
    """Cumulative tokens per source over the steps (epochs in the legend), stage boundaries dashed."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # a file, whatever backend the session has
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = report["curve"]["step"]
    for s in report["sources"]:
        ax.plot(xs, report["curve"]["tokens"][s["source"]], label=f"{s['source']} ({s['epochs']:g} epochs)")
    for st in report["stages"]:
        ax.axvline(st["start_step"], color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(st["name"], (st["start_step"], ax.get_ylim()[1]), fontsize=8, rotation=90, va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens delivered (cumulative)")
    ax.set_title(f"plan {report['plan']}: {report['steps']} steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def preview(plan: Plan, source: str, n: int = 5) -> list[dict]:
    """The first ``n`` documents of ``source``'s first unit, as the loader makes them: token ids,
    the text they decode to, the part the loss sees (chat sources), and image tokens."""
    from ..sources.tokenizers import load_tokenizer

    src = plan.source(source)
    units = index_sources(plan, [src])[source]
    out = []
    tok = (
        load_tokenizer(plan.tokenizer_of(src), plan.base_dir)
        if (src.text_field or src.messages_field)
        else load_tokenizer(plan.tokenizer, plan.base_dir)
    )
    for unit in units:
        block = read_unit(src, plan, unit).block
        for d in range(len(block)):
            if len(out) >= n:
                return out
            ids = block.doc(d).astype(np.int64)
            doc = {"sample_id": int(block.sample_ids[d]), "tokens": int(len(ids)), "text": tok.decode(ids.tolist())}
            if block.loss_mask is not None:
                m = block.loss_mask[block.offsets[d] : block.offsets[d + 1]].astype(bool)
                doc["trained_tokens"] = int(m.sum())
                doc["trained_text"] = tok.decode(ids[m].tolist())
            vision = block.vision_tokens()
            if vision is not None:
                doc["image_tokens"] = int(vision[d])
            out.append(doc)
    return out
