"""Planner-only balance benchmark: the central planner vs per-rank first-fit loaders, seeded.

    python benchmarks/balance.py            # readable table
    python benchmarks/balance.py --json     # one JSON object, keys per distribution

For each length distribution, in the same run:
- **baseline**: per-rank loaders, as today, over the very documents the planner delivered:
  shuffled, dealt round-robin to ranks (DistributedSampler), each rank packing first-fit into its
  micro-batches up to the same token budget (a piece that does not fit waits for its next step);
- **planner**: ``PlannerState`` exactly as the service runs it (selection + balancing);
- **lower bound** per step: ``max(largest single cost, total cost / dp)``.

Imbalance = max rank cost / mean rank cost per step (DDP), and the same per micro-batch index
(FSDP). ``speedup_vs_baseline`` compares simulated time per token (step time = max rank cost for
DDP; sum over micro-batches of the max bin cost for FSDP), baseline over planner.

The ``large_dp_*`` rows plan for thousands of ranks (one 8k-token micro-batch each, long-tailed
documents up to 64k tokens): ``planner_ms_p99`` / ``planner_ms_p50`` are the planner's time per
step (a window's planning divided by its steps), to hold against the step time of the model the
run trains (e.g. a 1B model on 1,024 GPUs steps every ~83 ms: at most 8 ms of planning).
``planner_ms_per_1m_tokens``: the planner's time over the tokens it planned, every row (what
``docs/design/scaling.md``'s model calls the token term).

    python benchmarks/balance.py --scaling      # planner ms per 1M tokens, dp 256 to 16,384

``--scaling``: the planner alone (this process: its own core, as a planning process would
have), one micro-batch per rank of 1k and 4k tokens (``heavy_tokens`` half of it), documents of
web-, chat- and book-like lengths up to 64k, a window of 16 steps: its CPU per 1M tokens
planned at dp 256, 1,024, 4,096 and 16,384, and per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402
from overlord_dask.observe.figures import step_imbalance  # noqa: E402
from overlord_dask.plan import plan_from_dict  # noqa: E402
from overlord_dask.planner.cost_model import doc_costs  # noqa: E402
from overlord_dask.planner.state import PlannerState  # noqa: E402

MAX_DOC = 131_072


def _lognormal(mu, sigma, lo=16, hi=MAX_DOC):
    return lambda rng, n: np.clip(rng.lognormal(mu, sigma, n), lo, hi).astype(np.int64)


def _pareto(alpha, scale, lo=16, hi=MAX_DOC):
    return lambda rng, n: np.clip((rng.pareto(alpha, n) + 1) * scale, lo, hi).astype(np.int64)


def _uniform(lo, hi):
    return lambda rng, n: rng.integers(lo, hi, n).astype(np.int64)


DISTRIBUTIONS = {
    # dp=8, 4 micro-batches of 128k tokens; documents from 16 tokens to 128k, long-tailed
    "long_tail": {
        "topology": {"dp": 8, "micro_batches": 4, "tokens_per_micro_batch": 131_072},
        "sources": {
            "web": (0.5, _lognormal(6.5, 1.2)),
            "code": (0.3, _lognormal(7.5, 1.4)),
            "books": (0.2, _pareto(0.9, 4096)),
        },
    },
    # short chat-like samples (~10,000 per step), a thin tail
    "chat_short": {
        "topology": {"dp": 8, "micro_batches": 4, "tokens_per_micro_batch": 32_768},
        "sources": {"chat": (0.8, _lognormal(4.4, 0.6, 8, 4096)), "web": (0.2, _lognormal(6.0, 1.0, 16, 32_768))},
    },
    # mostly short documents plus a few 100k+ ones
    "mixed_100k": {
        "topology": {"dp": 8, "micro_batches": 2, "tokens_per_micro_batch": 131_072},
        "sources": {"short": (0.9, _lognormal(6.0, 0.8)), "long": (0.1, _uniform(100_000, MAX_DOC))},
    },
    # thousands of ranks (FSDP at scale): one 8k-token micro-batch per rank, documents from 16
    # tokens to 64k (longer than a micro-batch: split into pieces), long-tailed
    "large_dp_1024": {
        "topology": {"dp": 1024, "micro_batches": 1, "tokens_per_micro_batch": 8192},
        "sources": {
            "web": (0.5, _lognormal(6.5, 1.2, 16, 65_536)),
            "code": (0.3, _lognormal(7.5, 1.4, 16, 65_536)),
            "books": (0.2, _pareto(0.9, 4096, 16, 65_536)),
        },
        "steps": 64,
    },
    "large_dp_4096": {
        "topology": {"dp": 4096, "micro_batches": 1, "tokens_per_micro_batch": 8192},
        "sources": {
            "web": (0.5, _lognormal(6.5, 1.2, 16, 65_536)),
            "code": (0.3, _lognormal(7.5, 1.4, 16, 65_536)),
            "books": (0.2, _pareto(0.9, 4096, 16, 65_536)),
        },
        "steps": 32,
    },
}


def make_plan(dist: dict, **balance):
    sources = [{"name": n, "format": "zarr", "url": f"{n}.zarr", "weight": w} for n, (w, _) in dist["sources"].items()]
    from overlord_dask.plan import Balance

    window = balance.get("window", Balance().window)
    return plan_from_dict(
        {
            "name": "bench",
            "seed": 7,
            "sources": sources,
            "topology": dist["topology"],
            "loading": {"prefetch_steps": 2 * window, "units_ahead": 64},
            "balance": balance,
        }
    )


def run_planner(dist: dict, steps: int, seed: int, **balance) -> dict:
    plan = make_plan(dist, **balance)
    n_units, per_unit = 100_000, 2048
    st = PlannerState(plan, {n: list(range(0, n_units * per_unit, per_unit)) for n in dist["sources"]})
    gens = {n: g for n, (_, g) in dist["sources"].items()}
    rng = np.random.default_rng(seed)
    out, plan_s, cpu_s, samples, lengths = [], 0.0, 0.0, 0, []
    while len(out) < steps:
        for name, epoch, unit in st.wanted():
            st.add_lengths(name, epoch, unit, gens[name](rng, per_unit))
        t0, c0 = time.perf_counter(), time.thread_time()
        planned, _ = st.plan_steps(plan.balance.window)
        plan_s += time.perf_counter() - t0
        cpu_s += time.thread_time() - c0
        for p in planned:
            entry = st.ledger[p["step"]]
            samples += len(entry["pieces"])
            lengths.append(entry["pieces"][:, 5] - entry["pieces"][:, 4])
            out.append(_bins(entry, plan))
            for r in range(plan.topology.dp):
                st.ack(r, p["step"])
    per_step_ms = [1e3 * t / plan.balance.window for t in st.plan_seconds]
    return {
        "bins": out[:steps],
        "samples_per_s": samples / plan_s,
        "ms_per_step": per_step_ms,
        "samples_per_step": samples / len(out),
        "ms_per_1m_tokens": plan_s * 1e3 / max(1e-9, sum(int(x.sum()) for x in lengths) / 1e6),
        "cpu_ms_per_1m_tokens": cpu_s * 1e3 / max(1e-9, sum(int(x.sum()) for x in lengths) / 1e6),
        "lengths": np.concatenate(lengths),
    }


def _bins(entry: dict, plan) -> tuple[np.ndarray, np.ndarray, float]:
    t = plan.topology
    lens = entry["pieces"][:, 5] - entry["pieces"][:, 4]
    cost = doc_costs(lens, plan.cost)
    c = np.zeros((t.dp, t.micro_batches))
    tok = np.zeros((t.dp, t.micro_batches), dtype=np.int64)
    np.add.at(c, (entry["slot"][:, 0], entry["slot"][:, 1]), cost)
    np.add.at(tok, (entry["slot"][:, 0], entry["slot"][:, 1]), lens)
    return c, tok, float(cost.max(initial=0.0))


def run_baseline(dist: dict, lengths: np.ndarray, steps: int, seed: int, fill: float) -> list:
    """Per-rank loaders over the same documents the planner delivered: shuffled, dealt round-robin
    to ranks (as DistributedSampler does), each rank packing first-fit into its micro-batches up
    to the same token budget; a piece that does not fit waits for that rank's next step."""
    plan = make_plan(dist)
    t = plan.topology
    C, M = t.tokens_per_micro_batch, t.micro_batches
    rng = np.random.default_rng(seed)
    shuffled = lengths[rng.permutation(len(lengths))]
    streams = [list(shuffled[r :: t.dp]) for r in range(t.dp)]
    cursor = [0] * t.dp
    budget = int(fill * M * C)
    out = []
    for _ in range(steps):
        c = np.zeros((t.dp, M))
        tok = np.zeros((t.dp, M), dtype=np.int64)
        biggest = 0.0
        for r in range(t.dp):
            while cursor[r] < len(streams[r]):
                p = int(streams[r][cursor[r]])
                fits = np.flatnonzero(C - tok[r] >= p)
                if len(fits) == 0 or (tok[r].sum() + p > budget and tok[r].sum() > 0):
                    # waits for the rank's next step (a piece longer than the budget goes alone into an empty one)
                    break
                b = int(fits[0])  # first fit
                tok[r, b] += p
                cost = float(doc_costs(np.array([p]), plan.cost)[0])
                c[r, b] += cost
                biggest = max(biggest, cost)
                cursor[r] += 1
        out.append((c, tok, biggest))
    return out


def summarize(bins: list) -> dict:
    imb, mb_imb, lb, step_t, mb_t, tokens = [], [], [], 0.0, 0.0, 0
    for c, tok, biggest in bins:
        i, m = step_imbalance(c)
        imb.append(i)
        mb_imb.append(m)
        rank = c.sum(axis=1)
        lb.append(max(biggest, rank.sum() / len(rank)) / rank.mean() if rank.mean() > 0 else 1.0)
        step_t += rank.max()
        mb_t += c.max(axis=0).sum()
        tokens += int(tok.sum())
    return {
        "imb": np.array(imb),
        "mb": np.array(mb_imb),
        "lb": np.array(lb),
        "time_per_token": step_t / tokens,
        "mb_time_per_token": mb_t / tokens,
        "tokens": tokens,
    }


def bench(name: str, dist: dict, steps: int, seed: int, **balance) -> dict:
    res = run_planner(dist, steps, seed, **balance)
    # the baseline packs whole documents: the budget of packing whole (with cut, ours fills the rest)
    fill = make_plan(dist, **{k: v for k, v in balance.items() if k != "packing"}).balance.step_fill
    p = summarize(res["bins"])
    b = summarize(run_baseline(dist, res["lengths"], steps, seed, fill))
    capacity = make_plan(dist).topology.tokens_per_micro_batch
    violations = sum(int((tok > capacity).sum()) for _, tok, _ in res["bins"])
    q = lambda a, x: round(float(np.percentile(a, x)), 4)  # noqa: E731
    return {
        "imbalance_p50": q(p["imb"], 50),
        "imbalance_p99": q(p["imb"], 99),
        "mb_imbalance_p50": q(p["mb"], 50),
        "mb_imbalance_p99": q(p["mb"], 99),
        "baseline_imbalance_p50": q(b["imb"], 50),
        "baseline_imbalance_p99": q(b["imb"], 99),
        "baseline_mb_imbalance_p50": q(b["mb"], 50),
        "baseline_mb_imbalance_p99": q(b["mb"], 99),
        "lower_bound_p50": q(p["lb"], 50),
        "gap_to_lower_bound_p50": round(q(p["imb"], 50) / q(p["lb"], 50) - 1, 4),
        "speedup_vs_baseline": round(b["time_per_token"] / p["time_per_token"], 3),
        "mb_speedup_vs_baseline": round(b["mb_time_per_token"] / p["mb_time_per_token"], 3),
        "fill": round(p["tokens"] / (steps * make_plan(dist).topology.step_tokens), 4),
        "baseline_fill": round(b["tokens"] / (steps * make_plan(dist).topology.step_tokens), 4),
        "capacity_violations": violations,
        "samples_per_step": round(res["samples_per_step"], 1),
        "planner_samples_per_s": round(res["samples_per_s"], 1),
        "planner_ms_p99": q(res["ms_per_step"], 99),
        "planner_ms_p50": q(res["ms_per_step"], 50),
        "planner_ms_per_1m_tokens": round(res["ms_per_1m_tokens"], 3),
        "dp": make_plan(dist).topology.dp,
    }


SCALING_SOURCES = {
    "web": (0.5, _lognormal(6.0, 1.0, 16, 8192)),
    "chat": (0.3, _lognormal(5.0, 0.8, 16, 4096)),
    "books": (0.2, _pareto(0.9, 2000, 16, 65_536)),
}


def scaling(
    dps=(256, 1024, 4096, 16_384), tokens=(1024, 4096), seed: int = 0, balancer_process: bool = False
) -> list[dict]:
    """The planner's CPU per 1M tokens and per step as dp grows (``--scaling``); with
    ``balancer_process``, each row again with the windows placed in the balancer's process
    (``planner/policies/balancer_process.py``, as the service places them at large dp): the
    planner's wall time, its thread's CPU (what stays on the scheduler process's GIL) and the
    process's CPU, per 1M tokens."""
    import psutil

    from overlord_dask.planner.policies import balancer_process as B

    rows = []
    for t in tokens:
        for dp in dps:
            dist = {"topology": {"dp": dp, "micro_batches": 1, "tokens_per_micro_batch": t}, "sources": SCALING_SOURCES}
            steps = max(32, min(256, (1 << 26) // (dp * t)))  # enough windows, a bounded run
            for in_process in (False, True) if balancer_process else (False,):
                proc = _started_balancer() if in_process else None
                try:
                    B.use(proc)
                    c0 = time.process_time()
                    b0 = sum(psutil.Process(proc.proc.pid).cpu_times()[:2]) if proc else 0.0
                    res = run_planner(dist, steps, seed, heavy_tokens=t // 2, window=16)
                    b1 = sum(psutil.Process(proc.proc.pid).cpu_times()[:2]) if proc else 0.0
                    assert proc is None or proc.local == 0, "windows placed in the thread: the process failed"
                finally:
                    B.use(None)
                    if proc is not None:
                        proc.close()
                tokens_m = float(res["lengths"].sum()) / 1e6
                rows.append(
                    {
                        "dp": dp,
                        "tokens_per_rank": t,
                        "balancer": "process" if in_process else "thread",
                        "steps": steps,
                        "planner_ms_per_1m_tokens": round(res["ms_per_1m_tokens"], 3),
                        "thread_cpu_ms_per_1m_tokens": round(res["cpu_ms_per_1m_tokens"], 3),
                        "process_cpu_ms_per_1m_tokens": round((b1 - b0) * 1e3 / tokens_m, 3) if proc else None,
                        "planner_ms_per_step_p50": round(float(np.percentile(res["ms_per_step"], 50)), 2),
                        "run_cpu_s": round(time.process_time() - c0, 1),
                    }
                )
    return rows


def _started_balancer():
    """A balancer process that answers (its kernels loaded), warmed on a small window."""
    from overlord_dask.planner.policies import balancer_process as B

    proc = B.BalancerProcess()
    if not proc.wait_ready(120):
        proc.close()
        raise RuntimeError("the balancer process did not start within 120 s")
    return proc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync", default="micro_batch", choices=["step", "micro_batch"])
    ap.add_argument("--window", type=int, default=None, help="steps planned together (default: the plan default)")
    ap.add_argument("--only", default=None, help="one distribution")
    ap.add_argument("--packing", default="whole", choices=["whole", "cut"], help="balance.packing")
    ap.add_argument(
        "--heavy-fraction", type=float, default=None, help="heavy_tokens as a fraction of the micro-batch capacity"
    )
    ap.add_argument("--scaling", action="store_true", help="planner ms per 1M tokens from dp 256 to 16,384")
    ap.add_argument("--scaling-dp", type=int, nargs="+", default=[256, 1024, 4096, 16_384])
    ap.add_argument("--scaling-tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per rank and step")
    ap.add_argument(
        "--balancer-process", action="store_true", help="--scaling: each row also with the balancer in its process"
    )
    args = ap.parse_args(argv)
    from overlord_dask.scheduler.planner_thread import warm
    from overlord_dask.worker.allocator_setup import tune_service_process

    # this process as the service's (``overlord serve`` tunes its allocator), prepared as its
    # planner prepares it at the start (the compiled loops loaded: not planning)
    tune_service_process()
    warm(None)
    if args.scaling:
        rows = scaling(args.scaling_dp, args.scaling_tokens, seed=args.seed, balancer_process=args.balancer_process)
        if args.json:
            print(json.dumps({"benchmark": "balance_scaling", "rows": rows}))
        else:
            print_rows(rows, list(rows[0]))
        return {"rows": rows}
    out = {}
    for name, dist in DISTRIBUTIONS.items():
        if args.only and name != args.only:
            continue
        extra = (
            {"heavy_tokens": int(args.heavy_fraction * dist["topology"]["tokens_per_micro_batch"])}
            if args.heavy_fraction
            else {}
        )
        if args.window:
            extra["window"] = args.window
        if args.packing != "whole":
            extra["packing"] = args.packing
        out[name] = bench(
            name, dist, min(args.steps, dist.get("steps", args.steps)), args.seed, sync=args.sync, **extra
        )
    if args.json:
        print(json.dumps(out))
    else:
        keys = list(next(iter(out.values())))
        print(f"{'':<28}" + "".join(f"{n:>14}" for n in out))
        for k in keys:
            print(f"{k:<28}" + "".join(f"{out[n][k]!s:>14}" for n in out))
    return out


if __name__ == "__main__":
    main()
