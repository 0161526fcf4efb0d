"""Static equal pools against autoscaled pools, same run, same worker budget.

    python benchmarks/autoscale.py                 # table
    python benchmarks/autoscale.py --json

Three sources: ``web`` (text, byte-tokenized), ``chat`` (token ids) and ``photos`` (captions
with encoded JPEGs, decoded, resized and patched on the workers: hundreds of times more CPU per
token than the others, measured and printed). A curriculum moves weight onto ``photos`` halfway
(5% → 60%). dp trainer *processes* compute ``--compute-ms`` per step (sleep) and record how long
each ``next()`` waits. By default the compute time is derived from the photo source's cost
measured at the start, so that from the stage on its loading needs ``--photos-cores`` (1.0) of
CPU: a whole core, which one static worker could give only if nothing else ran, and two
autoscaled workers can on this 2-core machine (the same pressure on a faster or slower machine).

- ``static``: each source has a fixed pool of one worker, plus one shared worker (the budget,
  ``--budget``, split equally: what one would configure without measurements).
- ``autoscaled``: the same budget as ``loading.autoscale.max_workers``, no shared worker; the
  autoscaler sizes the pools from the planner's signals.

Reported per mode (after ``--warmup`` steps): ``wait_share``, ``wait_p99_ms``, ``tokens_per_s``,
``worker_seconds`` (workers alive × time, sampled every 0.25 s) and the workers per pool over
time; top level: ``lead_steps`` (how many steps before the stage change the ``photos`` pool
first grew), ``identical`` (the same pieces per (rank, step) in both modes), ``duplicates`` and
``missing`` (of the autoscaled run, against the static one).

Targets (issue 9): autoscaled wait share ≤ 1% after warm-up with ≤ the static worker count;
static measurably worse in the same run; 0 duplicates, 0 missing; identical streams.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402

PIPELINE = Path(__file__).resolve().parents[1] / "pipelines" / "photos.yaml"


def _plan(data: str, steps: int, mode: str, budget: int):
    import yaml

    from overlord_dask.plan import plan_from_dict

    d = yaml.safe_load(PIPELINE.read_text())
    root = Path(data).resolve()
    for s in d["sources"]:
        s["url"] = str(root / s["name"] / "*.parquet")
        s.pop("pool", None)
        if mode == "static":
            s["pool"] = {"workers": 1}
    d["stages"][1]["start_step"] = steps // 2
    d["stages"][1]["weights"] = {"web": 0.25, "chat": 0.15, "photos": 0.6}
    d["steps"] = steps
    d["loading"]["autoscale"] = {"enabled": mode == "autoscaled", "max_workers": budget}
    return plan_from_dict(d, where=f"{PIPELINE} ({mode})")


def _trainer(address: str, rank: int, steps: int, compute_s: float, out) -> None:
    from overlord_dask import connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record

    stream = connect(address, rank, timeout=300)
    waits, ends, ids, tokens = [], [], {}, 0
    for _ in range(steps):
        t0 = time.perf_counter()
        b = stream.next_batch()
        waits.append(time.perf_counter() - t0)
        ids[b["step"]] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
        tokens += sum(int(mb["num_tokens"]) for mb in b["micro_batches"])
        time.sleep(compute_s)
        ends.append(time.perf_counter())
    stream.commit()
    stream.close()
    out.put((rank, {"waits": waits, "ends": ends, "ids": ids, "tokens": tokens}))


def _workers(service) -> dict[str, int]:
    from overlord_dask.loading.pools import pool_of

    counts: dict[str, int] = {}
    for w in service.client.scheduler_info(n_workers=-1)["workers"].values():
        p = pool_of(w.get("name")) or "shared"
        counts[p] = counts.get(p, 0) + 1
    return counts


def _run(plan, shared: int, steps: int, compute_s: float, warmup: int) -> dict:
    from overlord_dask import Service
    from overlord_dask.service.deploy import local_cluster

    ctx = mp.get_context("spawn")
    dp = plan.topology.dp
    with local_cluster(n_workers=shared) as cluster, Service.start(plan, cluster=cluster) as service:
        samples, done = [], threading.Event()

        def sample():
            while not done.wait(0.25):
                try:
                    samples.append((time.perf_counter(), service.status()["committed"], _workers(service)))
                except Exception:  # the service is closing
                    return

        threading.Thread(target=sample, daemon=True).start()
        q = ctx.Queue()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=_trainer, args=(service.address, r, steps, compute_s, q)) for r in range(dp)]
        for p in procs:
            p.start()
        res = dict(q.get(timeout=900) for _ in range(dp))
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(timeout=60)
        done.set()
        history = service.scaling_history()
    waits = np.concatenate([np.asarray(r["waits"][warmup:]) for r in res.values()])
    share = [sum(r["waits"][warmup:]) / max(r["ends"][-1] - r["ends"][warmup - 1], 1e-9) for r in res.values()]
    stage = steps // 2  # wait share from the stage change on (the heavy source's share is high)
    after = [sum(r["waits"][stage:]) / max(r["ends"][-1] - r["ends"][stage - 1], 1e-9) for r in res.values()]
    ws = [(t, sum(c.values())) for t, _, c in samples]
    worker_seconds = sum(n * (t1 - t0_) for (t0_, n), (t1, _) in zip(ws, ws[1:]))
    timeline = [{"t": round(t - t0, 1), "step": s, **c} for t, s, c in samples[:: max(1, len(samples) // 40)]]
    return {
        "wait_share": round(float(np.mean(share)), 4),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 2),
        "wait_share_after_stage": round(float(np.mean(after)), 4),
        "tokens_per_s": round(sum(r["tokens"] for r in res.values()) / wall),
        "worker_seconds": round(worker_seconds, 1),
        "workers_max": max((n for _, n in ws), default=0),
        "ids": {(r, s): v for r, x in res.items() for s, v in x["ids"].items()},
        "workers_over_time": timeline,
        "history": history,
    }


def _costs(data: str) -> dict:
    """CPU seconds per token of each source's loading, measured here on a few units."""
    from overlord_dask.sources import discover_units, load_unit

    plan = _plan(data, 100, "static", 4)
    out = {}
    for s in plan.sources:
        units = discover_units(s, plan)[:4]
        load_unit(s, plan, units[0])  # first-call imports and caches are not the source's cost
        t0, tokens = time.thread_time(), 0
        for u in units[1:]:
            tokens += len(load_unit(s, plan, u).tokens)
        out[s.name] = (time.thread_time() - t0) / tokens
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="trainer compute per step (default: so that photos need --photos-cores after the stage, "
        "at the measured cost)",
    )
    ap.add_argument(
        "--photos-cores",
        type=float,
        default=1.0,
        help="CPU the photo source's loading needs after the stage (a whole core by default)",
    )
    ap.add_argument("--budget", type=int, default=4, help="workers in all (static: one per source plus one shared)")
    ap.add_argument("--data", default="demo-data")
    args = ap.parse_args(argv)

    from overlord_dask.service.demo import generate_demo_corpus

    generate_demo_corpus(args.data)
    costs = _costs(args.data)
    n_sources = len(costs)
    if args.compute_ms is None:  # the same pressure on any machine: photos need --photos-cores from the stage on
        plan = _plan(args.data, args.steps, "static", args.budget)
        photos_share = plan.stages[1].weights["photos"] / sum(plan.stages[1].weights.values())
        args.compute_ms = round(plan.topology.step_tokens * photos_share * costs["photos"] / args.photos_cores * 1e3, 1)
    static = _run(
        _plan(args.data, args.steps, "static", args.budget),
        max(0, args.budget - n_sources),
        args.steps,
        args.compute_ms / 1e3,
        args.warmup,
    )
    auto = _run(
        _plan(args.data, args.steps, "autoscaled", args.budget), 0, args.steps, args.compute_ms / 1e3, args.warmup
    )
    stage = args.steps // 2
    grew = [h["step"] for h in auto["history"] if h["pool"] == "photos" and h["delta"] > 0 and h["step"] is not None]
    ref, got = static.pop("ids"), auto.pop("ids")
    ref_ids = {i for v in ref.values() for i in v}
    ids = [i for v in got.values() for i in v]
    out = {
        "benchmark": "autoscale",
        "cores": os.cpu_count(),
        "steps": args.steps,
        "stage_step": stage,
        "compute_ms": args.compute_ms,
        "budget": args.budget,
        "seconds_per_token": {k: float(f"{v:.3g}") for k, v in costs.items()},
        "heavy_ratio": round(costs["photos"] / max(costs["web"], costs["chat"]), 1),
        "static": static,
        "autoscaled": auto,
        "lead_steps": (stage - min(grew)) if grew else None,
        "identical": got == ref,
        "duplicates": len(ids) - len(set(ids)),
        "missing": len(ref_ids - set(ids)),
    }
    if args.json:
        import json

        print(json.dumps(out))
    else:
        rows = [
            {"mode": m, **{k: v for k, v in out[m].items() if not isinstance(v, (list, dict))}}
            for m in ("static", "autoscaled")
        ]
        print_rows(
            rows,
            [
                "mode",
                "wait_share",
                "wait_p99_ms",
                "wait_share_after_stage",
                "tokens_per_s",
                "worker_seconds",
                "workers_max",
            ],
        )
        print(
            f"photos: {out['heavy_ratio']}x the CPU per token of the heaviest other source; pool grew "
            f"{out['lead_steps']} steps "
            f"before the stage change at step {stage}"
        )
        print(f"identical {out['identical']}, duplicates {out['duplicates']}, missing {out['missing']}")
        for h in auto["history"]:
            print(f"  step {h['step']}: pool {h['pool']} {h['from']} -> {h['to']} ({h['reason']})")
    return out


if __name__ == "__main__":
    main()
