"""Learned cost model benchmark: does learning the cost from step times even out real step times?

    python benchmarks/learned_cost.py            # readable table
    python benchmarks/learned_cost.py --json     # one JSON object

Trainer *processes* (one per rank, ``dp`` of them) consume a running service and spend, per
micro-batch, a **true** cost unlike the declared one: the attention term 3x heavier relative to the
linear one than ``attention·L² + 6·hidden·L`` says, a per-document cost the formula lacks, and a
fixed cost per micro-batch (sleeps, scaled so a step takes ``--step-ms`` on average). Documents
come from three generated zarr sources with long-tailed lengths (short chat, medium web, long
books). The trainers sync once per step (``balance.sync: step``, DDP): a step takes as long as
its slowest rank.

Two services, same plan and seed, on the same cluster:

1. the declared model (``cost.learn`` off): ``declared_imbalance_p50``, the median over steps of
   max / mean of the ranks' actual step times (each trainer's own clock);
2. ``cost: {learn: true}`` (defaults): the planner fits the coefficients from the reported times
   and switches at a recorded step. ``settle_steps``: the reported step at which the fit settled;
   ``learned_imbalance_p50``: the same median over the steps after the switch;
   ``coefficient_error``: the largest relative error of the fitted attention and per-document
   coefficients against the true ones (the linear and fixed terms are nearly collinear when
   micro-batches are full: their combined per-micro-batch time is compared instead,
   ``linear_fixed_error``); ``replay_identical``: the run's stream re-planned offline from the plan
   and its recorded decisions (``service/replay.py``) equals what was delivered.

Also reported: ``true_model_imbalance_p50``, the same plan with the true coefficients declared
(what a perfect fit could reach), and ``*_intended_p50``: the same medians over the true costs
the trainers slept (without this machine's timing noise: sleeps overshoot, processes share
two cores).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from output import emit  # noqa: E402  (benchmarks/output.py)

SOURCES = {"web": (6.5, 1.0, 0.4), "books": (8.0, 0.7, 0.3), "chat": (4.5, 0.6, 0.3)}  # lognormal mu, sigma; weight
HIDDEN = 8192
# true cost per term, relative: attention 3x (vs 1 declared), linear 6*hidden (as declared), per document 500 tokens'
# worth
# of linear cost, per micro-batch 1,000 tokens' worth
TRUE_SHAPE = np.array([3.0, 6.0 * HIDDEN, 6.0 * HIDDEN * 500, 6.0 * HIDDEN * 1000])


def write_corpus(root: Path, docs: int, cap: int, seed: int) -> dict[str, np.ndarray]:
    """The three sources' zarr files; returns their document lengths."""
    import zarr

    rng = np.random.default_rng(seed)
    out = {}
    for name, (mu, sigma, _) in SOURCES.items():
        lens = out[name] = np.clip(rng.lognormal(mu, sigma, docs), 16, cap).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        toks = rng.integers(3, 250, int(offsets[-1]), dtype=np.int32)
        g = zarr.open_group(str(root / f"{name}.zarr"), mode="w")
        g.create_array("tokens", shape=toks.shape, chunks=(1 << 18,), dtype="int32")[:] = toks
        g.create_array("offsets", shape=offsets.shape, chunks=(1 << 16,), dtype="int64")[:] = offsets
    return out


def mean_step_cost(lengths: dict[str, np.ndarray], tokens: int) -> float:
    """The true cost (TRUE_SHAPE units) of a rank's step of two micro-batches filled to 97% in the
    declared token shares: per token, each source's attention, linear and per-document share."""
    per_token = 0.0
    for name, (_, _, w) in SOURCES.items():
        L = lengths[name].astype(np.float64)
        per_token += w * (TRUE_SHAPE[0] * (L * L).sum() / L.sum() + TRUE_SHAPE[1] + TRUE_SHAPE[2] * len(L) / L.sum())
    return 2 * (0.97 * tokens * per_token + TRUE_SHAPE[3])


def make_plan(root: Path, dp: int, tokens: int, cost: dict):
    from overlord_dask.plan import plan_from_dict

    return plan_from_dict(
        {
            "name": "learned-cost",
            "seed": 11,
            "sources": [
                {"name": n, "format": "zarr", "url": f"{n}.zarr", "weight": w} for n, (_, _, w) in SOURCES.items()
            ],
            "topology": {"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": tokens},
            "cost": cost,
            "balance": {"sync": "step", "window": 8},
            "loading": {"prefetch_steps": 8, "unit_tokens": 1 << 18},
        },
        base_dir=str(root),
    )


def trainer(address: str, rank: int, dp: int, steps: int, unit_s: float, out) -> None:
    """One rank: sleep each micro-batch's true cost; its own clock of each step."""
    from overlord_dask import connect

    times, intended = [], []
    with connect(address, rank, dp, timeout=300) as s:
        for _ in range(steps):
            batch = s.next_batch()
            t0 = time.perf_counter()  # from the hand-over: the wait is not compute
            true = 0.0
            for mb in batch["micro_batches"]:
                L = np.diff(mb["cu_seqlens"]).astype(np.float64)
                L = L[L > 0]
                t = unit_s * float(TRUE_SHAPE @ [(L * L).sum(), L.sum(), len(L), 1.0])
                time.sleep(t)
                true += t
            times.append(time.perf_counter() - t0)
            intended.append(true)
        s.commit()
    out.put((rank, (times, intended)))


def run_service(plan, cluster, dp: int, steps: int, unit_s: float, ctx) -> tuple[np.ndarray, dict, object, dict]:
    """Steps' per-rank times ``[2, steps, dp]`` (measured, and the true cost slept: without the
    machine's timing noise), the feedback status, the timeline and the ledger."""
    from overlord_dask import Service

    with Service.start(plan, cluster=cluster) as service:
        q = ctx.Queue()
        ps = [ctx.Process(target=trainer, args=(service.address, r, dp, steps, unit_s, q)) for r in range(dp)]
        for p in ps:
            p.start()
        got = dict(q.get(timeout=1800) for _ in range(dp))
        for p in ps:
            p.join(timeout=60)
        deadline = time.monotonic() + 10
        while (fb := service.status()["feedback"])["newest_reported"] < steps - 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return (
            np.array([got[r] for r in range(dp)]).transpose(1, 2, 0),
            fb,
            service.timeline(),
            service.ledger(0, steps),
        )


def imbalance(t: np.ndarray) -> np.ndarray:
    """Per step: the slowest rank's time over the mean (``t``: ``[steps, dp]``)."""
    return t.max(axis=1) / t.mean(axis=1)


def p50(t: np.ndarray, lo: int, hi: int | None = None) -> float:
    return round(float(np.median(imbalance(t[lo:hi]))), 4)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the figures")
    ap.add_argument("--step-ms", type=float, default=100.0, help="mean true step time of a rank")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--docs", type=int, default=40_000, help="documents per source")
    ap.add_argument("--no-true-model", action="store_true", help="skip the run with the true coefficients declared")
    args = ap.parse_args(argv)

    from overlord_dask.planner.learn import TERMS
    from overlord_dask.service.deploy import local_cluster
    from overlord_dask.service.replay import replay

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lengths = write_corpus(root, args.docs, args.tokens, seed=5)
        declared = {"hidden": HIDDEN}
        unit_s = (
            args.step_ms / 1e3 / mean_step_cost(lengths, args.tokens)
        )  # seconds per TRUE_SHAPE unit: a mean step takes --step-ms
        true = np.append(TRUE_SHAPE[:3], 0.0) * unit_s  # seconds per unit of attention, linear, constant, encoder
        true_fixed = TRUE_SHAPE[3] * unit_s
        out = {
            "benchmark": "learned_cost",
            "cores": os.cpu_count(),
            "dp": args.dp,
            "micro_batches": 2,
            "tokens_per_micro_batch": args.tokens,
            "steps": args.steps,
            "step_ms": args.step_ms,
        }
        with local_cluster(n_workers=args.workers) as cluster:
            t_decl, _, _, _ = run_service(
                make_plan(root, args.dp, args.tokens, declared), cluster, args.dp, args.steps, unit_s, ctx
            )
            plan = make_plan(root, args.dp, args.tokens, {**declared, "learn": True})
            t_learn, fb, tl, ledger = run_service(plan, cluster, args.dp, args.steps, unit_s, ctx)
            if not args.no_true_model:
                oracle = {"attention": TRUE_SHAPE[0], "linear": TRUE_SHAPE[1], "constant": TRUE_SHAPE[2]}
                t_true, _, _, _ = run_service(
                    make_plan(root, args.dp, args.tokens, oracle), cluster, args.dp, args.steps, unit_s, ctx
                )
                out["true_model_imbalance_p50"] = p50(t_true[0], args.warmup)
                out["true_model_intended_p50"] = p50(t_true[1], args.warmup)
        switches = [d for d in tl.decisions if d.kind == "cost"]
        fit = fb.get("cost_fit", {})
        out["declared_imbalance_p50"] = p50(t_decl[0], args.warmup)
        out["declared_intended_p50"] = p50(t_decl[1], args.warmup)
        first = switches[0].at if switches else None
        out["switch_step"] = first
        out["learned_imbalance_p50"] = p50(t_learn[0], first) if first is not None else None
        out["learned_intended_p50"] = p50(t_learn[1], first) if first is not None else None
        out["settle_steps"] = fit.get("settled_at")
        out["cost_switches"] = len(switches)
        if fit.get("fitted"):
            f = fit["fitted"]
            errs = {t: abs(f[t] - true[i]) / true[i] for i, t in enumerate(TERMS[:3])}
            out["coefficient_error"] = round(max(errs["attention"], errs["constant"]), 4)
            out["coefficient_errors"] = {t: round(e, 4) for t, e in errs.items()}
            full = args.tokens * 0.97  # a full micro-batch's linear plus fixed time
            out["linear_fixed_error"] = round(
                abs(f["linear"] * full + f["fixed"] - (true[1] * full + true_fixed)) / (true[1] * full + true_fixed), 4
            )
            out["fit_error"] = round(fit["error_fitted"], 4)
            out["declared_fit_error"] = round(fit["error_declared"], 4)
        again = replay(plan, tl, args.steps)
        out["replay_identical"] = all(
            np.array_equal(again[s]["pieces"], ledger[s]["pieces"])
            and np.array_equal(again[s]["slot"], ledger[s]["slot"])
            for s in range(args.steps)
        )
        out["decisions"] = len(tl.decisions)
    emit(out, args.json)
    return out


if __name__ == "__main__":
    main()
