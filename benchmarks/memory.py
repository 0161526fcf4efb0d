"""Memory of the loading path: the service against per-rank DataLoaders, R ranks × S sources.

    python benchmarks/memory.py                                   # readable table
    python benchmarks/memory.py --json --ranks 2 4 8 16 --sources 4 8 16

Both systems stream the same mix (S generated text parquet sources, equal weights, byte
tokenizer) to R trainer *processes* that compute ``--compute-ms`` per step (sleep), one
micro-batch of ``--tokens`` per rank and step:

- **baseline**: every rank runs ``benchmarks/per_rank.py``'s textbook multi-source
  ``DataLoader`` (``--baseline-workers`` forked workers, each opening every source with its
  read-ahead and a 1,000-document shuffle buffer);
- **ours**: ``overlord serve`` (scheduler, planner, ``--workers`` worker processes) in its own
  process tree, and ``OverlordDataset`` (iterated directly) in each trainer.

Memory is PSS (``/proc/PID/smaps_rollup``: a page shared by N processes counts 1/N in each, so
forked workers and shared libraries are not counted twice), summed over every process of the
system (trainers, their DataLoader workers, the service tree), sampled every ``--interval``
seconds for ``--seconds`` once every rank has its first batch. The loader's share is that sum
minus the sum over R *bare* trainers (processes that import torch and wait) measured the same way:
what the loading path adds to a training job. Reported per size: the median and the peak.

From the sizes, least-squares fits: ours = fixed + per_rank·R + per_source·S; baseline =
fixed + per_rank·R + per_rank_source·R·S (every rank holds every source). ``projected_ratio``
evaluates both at ``--project`` (default 1,024 ranks × 100 sources).

Targets (issue 14): ours no larger than the baseline from 8 × 16 up; ``projected_ratio`` ≥ 13.5.

Shuffle blocks (``--shuffle-units 1 64``): ours is measured once per ``loading.shuffle_units``
setting at every size (``ours_mb_kK``, ``ours_peak_mb_kK``, ``ours_tokens_per_s_kK``,
``ours_first_batch_s_kK``); the other ``ours_*`` figures and the fits are the first setting's.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import emit_rows  # noqa: E402


# ---- trainer processes (spawned: this module's top level stays light) ------------------------
def _trainer(kind: str, rank: int, dp: int, cfg: dict, ready, stop, out) -> None:
    import torch  # noqa: F401 - every trainer has torch loaded, the bare ones too: what is subtracted

    if kind == "bare":
        ready.put(os.getpid())
        stop.wait()
        return
    if kind == "ours":
        from overlord_dask import OverlordDataset

        ds = OverlordDataset(cfg["address"], rank=rank, dp=dp)
        batches = ds  # iterated directly, as docs/guide/training.md shows
    else:
        from benchmarks.per_rank import loader

        ds = None
        batches = loader(cfg["files"], cfg["weights"], cfg["tokens"], rank, dp, workers=cfg["workers"])
    steps = tokens = 0
    t0 = None
    for mb in batches:
        if t0 is None:
            t0 = time.perf_counter()
            ready.put(os.getpid())
        steps += 1
        tokens += int(mb["cu_seqlens"][-1])
        time.sleep(cfg["compute_s"])
        if stop.is_set():
            break
    out.put({"rank": rank, "steps": steps, "tokens": tokens, "seconds": time.perf_counter() - t0})
    if ds is not None:
        ds.close()


def _pss(pids: list[int]) -> float:
    """Summed PSS (MB) of ``pids`` and all their descendants."""
    import psutil

    seen, total = set(), 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            if q.pid in seen:
                continue
            seen.add(q.pid)
            try:
                total += q.memory_full_info().pss
            except psutil.NoSuchProcess:
                pass
    return total / 2**20


def _run(kind: str, dp: int, cfg: dict, seconds: float, interval: float, extra_pids: list[int] = ()) -> dict:
    """Start ``dp`` trainers of ``kind``, wait for every first batch, sample PSS, stop them."""
    ctx = mp.get_context("spawn")
    ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_trainer, args=(kind, r, dp, cfg, ready, stop, out)) for r in range(dp)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    pids = [ready.get(timeout=600) for _ in range(dp)]
    first = time.perf_counter() - t0
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        samples.append(_pss(pids + list(extra_pids)))
        time.sleep(interval)
    stop.set()
    res = [out.get(timeout=120) for _ in range(dp)] if kind != "bare" else []
    for p in ps:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    tokens = sum(r["tokens"] for r in res)
    secs = max((r["seconds"] for r in res), default=0)
    return {"pss_mb": samples, "first_batch_s": first, "tokens_per_s": tokens / secs if secs else 0.0}


def _serve(
    root: str,
    names: list[str],
    dp: int,
    tokens: int,
    workers: int,
    weights: list[float] | None = None,
    seed: int | None = None,
    loading: dict | None = None,
    in_process: bool = False,
    balance: dict | None = None,
) -> tuple[subprocess.Popen, str]:
    """``overlord serve`` over the generated sources under ``root``, in its own process tree
    (``--in-process``: its workers are threads of the service's process)."""
    import yaml

    from overlord_dask.service.demo import text_sources_plan

    plan = text_sources_plan(names, weights, topology={"dp": dp, "micro_batches": 1, "tokens_per_micro_batch": tokens})
    if seed is not None:
        plan["seed"] = seed
    if loading:
        plan["loading"] = {**plan.get("loading", {}), **loading}
    if balance:
        plan["balance"] = {**plan.get("balance", {}), **balance}
    path = os.path.join(root, f"plan-{len(names)}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(plan, f)
    exe = os.path.join(os.path.dirname(sys.executable), "overlord")
    cmd = [exe, "serve", path, "--workers", str(workers)] + (["--in-process"] if in_process else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"overlord serve exited with {proc.wait()}")
    return proc, json.loads(line)["address"]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(root: str, dp: int, n_sources: int, args) -> dict:
    from overlord_dask.service.demo import generate_text_sources

    names = generate_text_sources(os.path.join(root, f"s{n_sources}"), n_sources)
    data = os.path.join(root, f"s{n_sources}")
    cfg = {
        "tokens": args.tokens,
        "compute_s": args.compute_ms / 1e3,
        "workers": args.baseline_workers,
        "files": {n: sorted(glob.glob(os.path.join(data, n, "*.parquet"))) for n in names},
        "weights": dict.fromkeys(names, 1.0),
    }
    bare = _run("bare", dp, cfg, min(args.seconds, 3.0), args.interval)
    base = _run("baseline", dp, cfg, args.seconds, args.interval)
    by_k = {}
    for k in args.shuffle_units or [None]:
        loading = {"shuffle_units": k} if k else None
        proc, address = _serve(data, names, dp, args.tokens, args.workers, loading=loading, in_process=args.in_process)
        try:
            by_k[k] = _run("ours", dp, {**cfg, "address": address}, args.seconds, args.interval, extra_pids=[proc.pid])
        finally:
            _stop(proc)
    ours = next(iter(by_k.values()))
    bare_mb = float(np.median(bare["pss_mb"]))

    def share(r: dict) -> tuple[float, float]:
        s = np.asarray(r["pss_mb"]) - bare_mb
        return round(float(np.median(s)), 1), round(float(s.max()), 1)

    (b_med, b_peak), (o_med, o_peak) = share(base), share(ours)
    return {
        "ranks": dp,
        "sources": n_sources,
        "bare_trainers_mb": round(bare_mb, 1),
        "baseline_mb": b_med,
        "baseline_peak_mb": b_peak,
        "ours_mb": o_med,
        "ours_peak_mb": o_peak,
        "memory_ratio": round(b_med / o_med, 2) if o_med > 0 else None,
        "baseline_tokens_per_s": round(base["tokens_per_s"]),
        "ours_tokens_per_s": round(ours["tokens_per_s"]),
        "baseline_first_batch_s": round(base["first_batch_s"], 2),
        "ours_first_batch_s": round(ours["first_batch_s"], 2),
        **{f"ours_mb_k{k}": share(r)[0] for k, r in by_k.items() if args.shuffle_units},
        **{f"ours_peak_mb_k{k}": share(r)[1] for k, r in by_k.items() if args.shuffle_units},
        **{f"ours_tokens_per_s_k{k}": round(r["tokens_per_s"]) for k, r in by_k.items() if args.shuffle_units},
        **{f"ours_first_batch_s_k{k}": round(r["first_batch_s"], 2) for k, r in by_k.items() if args.shuffle_units},
    }


def fit(rows: list[dict], project: tuple[int, int]) -> dict:
    """Least-squares fixed cost and slopes of both systems, and both projected to ``project``."""
    R = np.array([r["ranks"] for r in rows], float)
    S = np.array([r["sources"] for r in rows], float)
    one = np.ones_like(R)
    ours, *_ = np.linalg.lstsq(np.stack([one, R, S], 1), np.array([r["ours_mb"] for r in rows]), rcond=None)
    base, *_ = np.linalg.lstsq(np.stack([one, R, R * S], 1), np.array([r["baseline_mb"] for r in rows]), rcond=None)
    pr, ps = project
    ours_at = ours[0] + ours[1] * pr + ours[2] * ps
    base_at = base[0] + base[1] * pr + base[2] * pr * ps
    return {
        "ours_fixed_mb": round(float(ours[0]), 1),
        "ours_per_rank_mb": round(float(ours[1]), 2),
        "ours_per_source_mb": round(float(ours[2]), 2),
        "baseline_fixed_mb": round(float(base[0]), 1),
        "baseline_per_rank_mb": round(float(base[1]), 2),
        "baseline_per_rank_source_mb": round(float(base[2]), 3),
        "projected_at": {"ranks": pr, "sources": ps},
        "projected_ours_gb": round(float(ours_at) / 1024, 1),
        "projected_baseline_gb": round(float(base_at) / 1024, 1),
        "projected_ratio": round(float(base_at / ours_at), 1),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4, 8, 16], help="ranks measured at the default source count"
    )
    ap.add_argument(
        "--sources", type=int, nargs="+", default=[4, 8, 16], help="source counts measured at the default rank count"
    )
    ap.add_argument(
        "--at", type=int, nargs=2, default=[8, 16], metavar=("RANKS", "SOURCES"), help="the default size (memory_ratio)"
    )
    ap.add_argument("--project", type=int, nargs=2, default=[1024, 100], metavar=("RANKS", "SOURCES"))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank and step")
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=8.0, help="sampling time per size and system")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=2, help="the service's worker processes")
    ap.add_argument(
        "--in-process", action="store_true", help="the service's workers as threads of its process (serve --in-process)"
    )
    ap.add_argument("--baseline-workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--data", default=None, help="folder for the generated sources (default: a temporary one)")
    ap.add_argument("--shuffle-units", type=int, nargs="*", default=[], help="loading.shuffle_units settings, in turn")
    args = ap.parse_args(argv)

    R0, S0 = args.at
    sizes = sorted({(r, S0) for r in args.ranks} | {(R0, s) for s in args.sources} | {(R0, S0)})
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or tmp
        rows = [measure(root, r, s, args) for r, s in sizes]
    at = next(r for r in rows if (r["ranks"], r["sources"]) == (R0, S0))
    out = {
        "benchmark": "memory",
        "cores": os.cpu_count(),
        "workers": args.workers,
        "in_process": args.in_process,
        "baseline_workers": args.baseline_workers,
        "tokens_per_rank_step": args.tokens,
        "compute_ms": args.compute_ms,
        "at": {"ranks": R0, "sources": S0},
        "memory_ratio": at["memory_ratio"],
        **fit(rows, tuple(args.project)),
        "rows": rows,
    }
    emit_rows(
        out,
        args.json,
        [
            "ranks",
            "sources",
            "baseline_mb",
            "baseline_peak_mb",
            "ours_mb",
            "ours_peak_mb",
            "memory_ratio",
            "baseline_tokens_per_s",
            "ours_tokens_per_s",
            *[f"ours_{m}_k{k}" for k in args.shuffle_units for m in ("mb", "peak_mb", "tokens_per_s")],
        ],
    )
    return out


if __name__ == "__main__":
    main()
