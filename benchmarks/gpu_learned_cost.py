"""Learned cost model on a real attention model: step time with the declared vs the learned model.

    python benchmarks/gpu_learned_cost.py --json                 # on a GPU (FlexAttention)
    python benchmarks/gpu_learned_cost.py --tiny --json          # anywhere: a small model, to check it runs

The planner (``PlannerState``, exactly as the service runs it, without Dask) plans ``dp`` ranks'
micro-batches of long-tailed documents (up to the micro-batch, 64k tokens by default); one GPU
runs each rank's micro-batch in turn through a transformer (``--layers`` blocks of width
``--hidden``, attention with document masks: FlexAttention block masks on CUDA, a dense mask on
the CPU; forward and backward in bf16 on CUDA) and its time is the rank's step time
(``balance.sync: micro_batch``, one micro-batch per step: a step takes its slowest rank's time).

Two passes over the same documents (same plan and seed, so the same tokens in the same steps):

1. the declared model (``attention: 1``, ``linear: 6·hidden``): measured step times; the
   trainer's reports feed the cost learner (``planner/feedback.py``) as the service would;
2. the coefficients it fitted, declared from step 0: measured step times again.

Reported: each pass's mean step time (the slowest rank per step), its imbalance (max / mean
over ranks), the speed-up, the declared and fitted coefficients (seconds per unit, the declared
ones at their best scale) and each model's median prediction error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from output import emit  # noqa: E402  (benchmarks/output.py)

from overlord_dask import pieces as P  # noqa: E402
from overlord_dask.plan import plan_from_dict  # noqa: E402
from overlord_dask.planner.feedback import FeedbackLoop  # noqa: E402
from overlord_dask.planner.state import PlannerState  # noqa: E402
from overlord_dask.planner.streams.order import stable_seed  # noqa: E402

SOURCES = {"web": (6.6, 1.0, 0.5), "code": (7.6, 1.2, 0.3), "books": (9.6, 1.0, 0.2)}  # lognormal mu, sigma; weight
UNITS, DOCS = 2000, 64


def lengths(cap: int):
    def of(name, epoch, unit):
        rng = np.random.default_rng(stable_seed("gpu-learned-cost", name, epoch, unit))
        mu, sigma, _ = SOURCES[name]
        return np.clip(rng.lognormal(mu, sigma, DOCS), 16, cap).astype(np.int64)

    return of


def make_plan(dp: int, tokens: int, cost: dict):
    return plan_from_dict(
        {
            "seed": 5,
            "sources": [
                {"name": n, "format": "zarr", "url": f"{n}.zarr", "weight": w} for n, (_, _, w) in SOURCES.items()
            ],
            "topology": {"dp": dp, "micro_batches": 1, "tokens_per_micro_batch": tokens},
            "balance": {"sync": "micro_batch", "window": 8},
            "cost": cost,
            "loading": {"prefetch_steps": 8, "units_ahead": 8},
        }
    )


class Model:
    """``layers`` pre-norm transformer blocks over random embeddings; attention within documents."""

    def __init__(self, hidden: int, layers: int, heads: int, device: str):
        import torch

        torch.manual_seed(0)
        self.torch, self.device, self.heads = torch, device, heads
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.ModuleDict(
                    {
                        "norm1": torch.nn.LayerNorm(hidden),
                        "qkv": torch.nn.Linear(hidden, 3 * hidden, bias=False),
                        "out": torch.nn.Linear(hidden, hidden, bias=False),
                        "norm2": torch.nn.LayerNorm(hidden),
                        "up": torch.nn.Linear(hidden, 4 * hidden, bias=False),
                        "down": torch.nn.Linear(4 * hidden, hidden, bias=False),
                    }
                )
                for _ in range(layers)
            ]
        ).to(device=device, dtype=self.dtype)
        self.hidden = hidden
        self.flex = None
        if device == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            self.flex = torch.compile(flex_attention)
            self.create_block_mask = create_block_mask

    def _attend(self, q, k, v, doc):
        torch = self.torch
        if self.flex is not None:

            def mask_mod(b, h, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)

            bm = self.create_block_mask(mask_mod, B=None, H=None, Q_LEN=len(doc), KV_LEN=len(doc), device=self.device)
            return self.flex(q, k, v, block_mask=bm)
        n = len(doc)
        mask = (doc[:, None] == doc[None, :]) & (torch.arange(n)[:, None] >= torch.arange(n)[None, :])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])

    def step(self, doc_lengths: np.ndarray, capacity: int) -> None:
        """Forward and backward over one packed micro-batch of documents ``doc_lengths``."""
        torch = self.torch
        doc = np.full(capacity, len(doc_lengths), np.int64)  # padding: one more document
        doc[: int(doc_lengths.sum())] = np.repeat(np.arange(len(doc_lengths)), doc_lengths)
        doc = torch.as_tensor(doc, device=self.device)
        x = torch.randn(capacity, self.hidden, device=self.device, dtype=self.dtype, requires_grad=True)
        h, hd = x, self.hidden // self.heads
        for b in self.blocks:
            q, k, v = b["qkv"](b["norm1"](h)).view(capacity, 3, self.heads, hd).permute(1, 2, 0, 3).unsqueeze(1)
            a = self._attend(q, k, v, doc).squeeze(0).permute(1, 0, 2).reshape(capacity, self.hidden)
            h = h + b["out"](a)
            h = h + b["down"](torch.nn.functional.gelu(b["up"](b["norm2"](h))))
        h.float().square().mean().backward()

    def timed(self, doc_lengths: np.ndarray, capacity: int) -> float:
        torch = self.torch
        if self.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.step(doc_lengths, capacity)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def run_pass(plan, model, steps: int, cap: int, learn: bool) -> tuple[np.ndarray, FeedbackLoop]:
    """Measured seconds ``[steps, dp]``; the feedback loop that saw them."""
    st = PlannerState(plan, {n: list(range(0, UNITS * DOCS, DOCS)) for n in SOURCES})
    fb = FeedbackLoop(st)
    of = lengths(cap)
    times = []
    while st.next_step < steps:
        for n, e, u in st.wanted():
            st.add_lengths(n, e, u, of(n, e, u))
        for p in st.plan_steps(1)[0]:
            s, entry = p["step"], st.ledger[p["step"]]
            t = [model.timed(P.lengths(entry["pieces"][entry["slot"][:, 0] == r]), cap) for r in range(st.topology.dp)]
            times.append(t)
            if learn:
                fb.take(st, [(r, 0, {"s": s, "t": t[r], "mb": [t[r]]}) for r in range(st.topology.dp)])
                fb.learner.refit(s)  # fit as the service would; this pass keeps the declared model (no decision)
            for r in range(st.topology.dp):
                st.ack(r, s)
    return np.array(times), fb


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per micro-batch (the longest document)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3, help="steps timed first and dropped (compilation)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="a small model and micro-batch (CPU check)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.heads, args.layers, args.steps, args.warmup = (
            1024,
            32,
            2,
            1,
            min(args.steps, 24),
            1,
        )

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = Model(args.hidden, args.layers, args.heads, device)
    for n in (args.tokens // 4, args.tokens):  # compile for both kinds of micro-batch before timing
        model.timed(np.array([n // 2, n - n // 2]), args.tokens)
    declared = {"hidden": args.hidden}
    learn = {"min_observations": 16, "every": 1, "patience": 2, "window": 100_000}
    t_decl, fb = run_pass(
        make_plan(args.dp, args.tokens, {**declared, "learn": learn}),
        model,
        args.steps + args.warmup,
        args.tokens,
        True,
    )
    fit = fb.learner.status()
    if not fit.get("fitted"):
        raise SystemExit("the fit did not run: give more --steps")
    from overlord_dask.planner.learn import UNIT

    f = fit["fitted"]
    learned = {"attention": f["attention"] * UNIT, "linear": f["linear"] * UNIT, "constant": f["constant"] * UNIT}
    t_learn, _ = run_pass(make_plan(args.dp, args.tokens, learned), model, args.steps + args.warmup, args.tokens, False)
    d, lrn = t_decl[args.warmup :], t_learn[args.warmup :]
    imb = lambda t: float(np.median(t.max(axis=1) / t.mean(axis=1)))  # noqa: E731
    out = {
        "benchmark": "gpu_learned_cost",
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "dp": args.dp,
        "tokens_per_micro_batch": args.tokens,
        "hidden": args.hidden,
        "layers": args.layers,
        "steps": args.steps,
        "attention": "flex" if model.flex is not None else "sdpa dense mask",
        "declared_step_ms": round(float(d.max(axis=1).mean()) * 1e3, 2),
        "learned_step_ms": round(float(lrn.max(axis=1).mean()) * 1e3, 2),
        "declared_mean_rank_ms": round(float(d.mean()) * 1e3, 2),
        "learned_mean_rank_ms": round(float(lrn.mean()) * 1e3, 2),
        "declared_imbalance_p50": round(imb(d), 4),
        "learned_imbalance_p50": round(imb(lrn), 4),
        "speedup": round(float(d.max(axis=1).mean() / lrn.max(axis=1).mean()), 4),
        "settle_steps": fit["settled_at"],
        "fits": fit["fits"],
        "fit_error": round(fit["error_fitted"], 4),
        "declared_fit_error": round(fit["error_declared"], 4),
        "fitted": {k: float(f"{v:.4g}") for k, v in f.items()},
        "declared_scaled": {k: float(f"{v:.4g}") for k, v in fit["declared"].items()},
        "linear_over_attention_fitted": round(f["linear"] / f["attention"], 1) if f["attention"] > 0 else None,
        "linear_over_attention_declared": 6 * args.hidden,
    }
    emit(out, args.json)
    return out


if __name__ == "__main__":
    main()
