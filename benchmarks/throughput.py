"""Delivered tokens/s and consumer wait per batch for 4 trainer ranks, next to the raw rate of a
single plain pyarrow/zarr read-and-tokenize loop over the same files, measured in the same run.

    python benchmarks/throughput.py            # readable table
    python benchmarks/throughput.py --json     # one JSON object

The raw loop is the floor every loader pays (read + tokenize, no mixing, packing or transfer);
``ratio_to_raw`` says how much of it the whole service (plan, load, pack, ship to 4 processes)
delivers. On a 2-core machine the scheduler, 2 workers and 4 trainers share the same two cores.
The raw rate is the median of ``--raw-repeats`` passes right before the service's run and as many
right after it (``bracketed``; every pass's rate under ``raw_passes``), so that a drift of the
machine's speed moves both sides of the ratio alike.

The service's rate is its steady state (``run_demo``): the tokens of the steps from
``steady_from_step`` on (a quarter into the run, and past the ``prefetch_steps`` the service
built before the trainers attached) over the time they took. Those prefetched steps hand over at
the trainers' pace: with them counted, an 80-step run with 32 prefetched overstated the rate ~1.2x.

The same run then repeats both with a real tokenizer (``--tokenizer both``, the default): a
byte-level BPE (Hugging Face ``tokenizers``, ``--bpe-vocab`` ids) trained in this process on the
demo's web text at the start (no download), saved next to the corpus and named in a copy of the
demo plan as its tokenizer folder (``tokenizer: PATH``) for the ``web`` source; the raw loop tokenizes with it too.
Its figures are under ``"bpe"``.

Baseline, in the same run (``--baseline-workers 2``, 0 to skip): the per-rank loader users would
otherwise run, at full speed on the same machine: each of the ``dp`` trainer processes runs a
``torch.utils.data.DataLoader`` with 2 worker processes over the plan's text source (its share of
the row groups, the same tokenizer, first-fit packing into the same micro-batches; no mixing or
balancing), and the trainers only take the batches. ``baseline.ratio_to_raw`` is its steady rate
over the raw loop's rate on the same files; ``vs_baseline`` is the service's rate over its.

Scaling with workers (``--scaling 1 2 4``, the default): the same service run again with each
number of Dask worker processes, ``--repeats`` times in turn, for each tokenizer measured
(``"by_workers"``: the median tokens/s per worker count, and every run's). Where cores are to
spare, more workers should deliver more; beyond the machine's cores extra workers can only share
them, and must not slow the service down (the issue-13 measurement on 16 cores: 2 → 8 workers
went 3.4M → 2.9M tokens/s).

Shuffle blocks (``--shuffle-units 1 64``): the service run again with each
``loading.shuffle_units``, in turn, on the demo plan and on the demo plan cut into ~1,000 load
units per source (``unit_rows`` 12, ``unit_tokens`` 4,096), byte tokenizer (``"by_shuffle_units"``:
tokens/s, trainer wait, time to the first batch and the most memory the loaded blocks held on the
workers, ``blocks_mb_max``). What a larger setting costs: more units resident and loaded before the
first step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import zarr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from overlord_dask.service.cli import run_demo  # noqa: E402
from overlord_dask.service.demo import demo_plan, generate_demo_corpus  # noqa: E402
from overlord_dask.sources.tokenizers import resolve_tokenizer  # noqa: E402


def raw_read_and_tokenize(plan, max_tokens: int, sources: list | None = None) -> tuple[int, float]:
    """A plain single-process loop: read every source's files (or ``sources``') in order and
    tokenize (with the plan's tokenizer); stop after ``max_tokens`` tokens, shared by weight.
    Returns (tokens, seconds)."""
    sources = plan.sources if sources is None else sources
    weights = plan.declared_weights()
    w = np.array([weights[s.name] for s in sources])
    tokens, t0 = 0, time.perf_counter()
    for src, budget in zip(sources, max_tokens * w / w.sum()):
        tokens += _read_source(plan, src, budget)
    return tokens, time.perf_counter() - t0


def raw_rates(plan, max_tokens: int, repeats: int, sources: list | None = None) -> list[float]:
    """The raw loop's tokens/s in each of ``repeats`` passes (one pass over 76M tokens takes ~0.4 s)."""
    rates = []
    for _ in range(max(1, repeats)):
        tokens, seconds = raw_read_and_tokenize(plan, max_tokens, sources)
        rates.append(tokens / seconds)
    return rates


def bracketed(
    run, plan, max_tokens: int, repeats: int, sources: list | None = None
) -> tuple[object, float, list[float]]:
    """``run()`` between ``repeats`` raw passes before it and ``repeats`` after it; returns its
    result, the median raw rate of all passes, and every pass's rate. A machine whose speed drifts
    moves the raw loop's seconds as much as the run's: passes taken only after a 20-second run
    once measured 105M tokens/s where the same loop gave 108-159M minutes later, and the ratio
    read ~1.2x high. Bracketing puts the raw rate where the run was."""
    before = raw_rates(plan, max_tokens, repeats, sources)
    result = run()
    after = raw_rates(plan, max_tokens, repeats, sources)
    return result, float(np.median(before + after)), [round(r, 1) for r in before + after]


def _read_source(plan, src, budget: float) -> int:
    """Read (and tokenize) one source's files in order until ``budget`` tokens; returns the tokens."""
    got = 0
    url = os.path.join(plan.base_dir, src.url)
    if src.format == "zarr":
        g = zarr.open_group(url, mode="r")
        offs = g[src.offsets_field][:]
        step = 1 << 20
        for a in range(0, int(offs[-1]), step):
            got += len(g[src.token_array][a : a + step])
            if got >= budget:
                break
        return got
    tokenize = resolve_tokenizer(plan.tokenizer_of(src), plan.base_dir) if src.text_field else None
    for path in sorted(glob.glob(url)):
        pf = pq.ParquetFile(path)
        for rg in range(pf.num_row_groups):
            col = pf.read_row_group(rg, columns=[src.text_field or src.tokens_field]).column(0).combine_chunks()
            got += len(tokenize(col)[0]) if tokenize else len(col.values)
            if got >= budget:
                return got
    return got


def bpe_plan(data_dir: str, vocab: int, docs: int) -> tuple[str, float]:
    """Train the BPE on the demo's web text (timed) and write the demo plan with ``web`` tokenized
    by it; returns the plan's path and the training seconds."""
    import yaml

    from overlord_dask.service.demo import PLAN_FILE, demo_texts, train_bpe

    t0 = time.perf_counter()
    tok = train_bpe(demo_texts(data_dir, docs), os.path.join(data_dir, f"bpe-{vocab}"), vocab_size=vocab)
    trained = time.perf_counter() - t0
    data = yaml.safe_load(PLAN_FILE.read_text())
    for src in data["sources"]:
        if src.get("text_field"):
            src["tokenizer"] = tok.name
    path = os.path.join(data_dir, "demo-bpe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path, trained


def by_workers(args, plan_path: str | None, steps: int) -> list[dict]:
    """The service's tokens/s with each worker count of ``--scaling`` (same plan, same steps):
    ``--repeats`` rounds over the counts in turn (so a drift of the machine's speed touches every
    count alike); ``tokens_per_s`` is the median of a count's runs, ``runs`` all of them."""
    runs: dict[int, list[dict]] = {w: [] for w in args.scaling}
    for _ in range(args.repeats):
        for w in args.scaling:
            runs[w].append(
                run_demo(
                    steps=steps,
                    dp=args.dp,
                    workers=w,
                    data=args.data,
                    scale=args.scale,
                    plan_path=plan_path,
                    quiet=True,
                )
            )
    return [
        {
            "workers": w,
            "tokens_per_s": round(float(np.median([r["tokens_per_s"] for r in rs])), 1),
            "runs": [r["tokens_per_s"] for r in rs],
            "duplicates": sum(r["duplicates"] for r in rs),
            "missing": sum(r["missing"] for r in rs),
        }
        for w, rs in runs.items()
    ]


def per_rank_baseline(args, plan, steps: int) -> dict:
    """The per-rank loader users would otherwise run, at full speed on the same machine: each of
    the ``dp`` trainer processes runs a ``torch.utils.data.DataLoader`` with ``--baseline-workers``
    worker processes over the plan's text source (``trainer_wait.PackedWeb``: its share of the
    row groups, the source's tokenizer, first-fit packing into the same micro-batches, int64
    ``input_ids``/``labels``/``position_ids``), the trainers only taking the batches. Its steady
    rate (the steps from ``steady_from(steps, 0)`` on) and the raw loop's rate over the same files
    and tokenizer, measured right after it."""
    import multiprocessing as mp

    from benchmarks.trainer_wait import _baseline_trainer, _run_procs
    from overlord_dask.service.cli import steady_from

    src = next(s for s in plan.sources if s.text_field)
    files = sorted(glob.glob(os.path.join(plan.base_dir, src.url)))
    topo = plan.topology
    res, raw_rate, passes = bracketed(
        lambda: _run_procs(
            mp.get_context("spawn"),
            _baseline_trainer,
            lambda r: (
                files,
                r,
                topo.dp,
                steps,
                0.0,
                topo.micro_batches,
                topo.tokens_per_micro_batch,
                args.baseline_workers,
            ),
            topo.dp,
            tokenizer=plan.tokenizer_of(src),
            base_dir=plan.base_dir,
        ),
        plan,
        steps * topo.step_tokens,
        args.raw_repeats,
        [src],
    )
    s0 = steady_from(steps, 0)
    stream_s = max(r["ends"][-1] for r in res) - min(r["ends"][s0 - 1] for r in res)
    rate = sum(sum(r["tokens"][s0:]) for r in res) / stream_s
    return {
        "source": src.name,
        "workers_per_rank": args.baseline_workers,
        "tokens_per_s": round(rate, 1),
        "raw_tokens_per_s": round(raw_rate, 1),
        "raw_passes": passes,
        "ratio_to_raw": round(rate / raw_rate, 3),
    }


def shuffle_plan(data_dir: str, shuffle_units: int, small_units: bool) -> tuple[str, dict]:
    """The demo plan with ``loading.shuffle_units`` (and, with ``small_units``, ~1,000 load units
    per source) written next to the corpus; returns its path and each source's unit count."""
    import yaml

    from overlord_dask.planner.timeline import Timeline
    from overlord_dask.service.demo import PLAN_FILE
    from overlord_dask.service.indexing import index_timeline

    data = yaml.safe_load(PLAN_FILE.read_text())
    data["loading"]["shuffle_units"] = shuffle_units
    if small_units:
        data["loading"].update(unit_rows=12, unit_tokens=4096)
    path = os.path.join(data_dir, f"demo-shuffle-{shuffle_units}{'-small' if small_units else ''}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    units = {k: len(v) for k, v in index_timeline(Timeline(demo_plan(data_dir, loading=data["loading"]))).items()}
    return path, units


def by_shuffle_units(args) -> list[dict]:
    """The service with each ``--shuffle-units`` setting in turn, on both layouts, same steps."""
    rows = []
    for small in (False, True):
        for k in args.shuffle_units:
            path, units = shuffle_plan(args.data, k, small)
            r = run_demo(
                steps=args.steps, dp=args.dp, workers=args.workers, data=args.data, scale=args.scale,
                plan_path=path, quiet=True,
            )  # fmt: skip
            keys = ("tokens_per_s", "wait_p50_ms", "wait_p99_ms", "time_to_first_batch_s", "blocks_mb_max")
            rows.append(
                {
                    "layout": "demo, ~1,000 units per source" if small else "demo",
                    "units": units,
                    "shuffle_units": k,
                    **{key: r[key] for key in keys},
                    "duplicates": r["duplicates"],
                    "missing": r["missing"],
                }
            )
    return rows


def measure(args, plan_path: str | None, steps: int) -> dict:
    from overlord_dask.plan import load_plan

    plan = demo_plan(args.data, topology={"dp": args.dp}) if plan_path is None else load_plan(plan_path)
    svc, raw_rate, passes = bracketed(
        lambda: run_demo(
            steps=steps,
            dp=args.dp,
            workers=args.workers,
            data=args.data,
            scale=args.scale,
            plan_path=plan_path,
            quiet=True,
        ),
        plan,
        steps * plan.topology.step_tokens,
        args.raw_repeats,
    )
    out = {
        "tokens": svc["tokens"],
        "tokens_per_s": svc["tokens_per_s"],
        "wait_p50_ms": svc["wait_p50_ms"],
        "wait_p99_ms": svc["wait_p99_ms"],
        "time_to_first_batch_s": svc["time_to_first_batch_s"],
        "raw_tokens_per_s": round(raw_rate, 1),
        "raw_passes": passes,
        "ratio_to_raw": round(svc["tokens_per_s"] / raw_rate, 3),
        "imbalance_p50": svc["imbalance_p50"],
        "imbalance_p99": svc["imbalance_p99"],
        "duplicates": svc["duplicates"],
        "missing": svc["missing"],
        "steps": svc["steps"],
        "steady_from_step": svc["steady_from_step"],
        "dp": svc["dp"],
    }
    if args.baseline_workers:
        base = per_rank_baseline(args, plan, steps)
        out.update({"baseline": base, "vs_baseline": round(svc["tokens_per_s"] / base["tokens_per_s"], 2)})
    if args.scaling:
        out["by_workers"] = by_workers(args, plan_path, steps)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=600, help="steps per run (byte tokenizer)")
    ap.add_argument("--bpe-steps", type=int, default=200, help="steps per run with the BPE (~8x slower to tokenize)")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", default="demo-data")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--tokenizer", choices=["byte", "bpe", "both", "none"], default="both")
    ap.add_argument("--bpe-vocab", type=int, default=8192)
    ap.add_argument("--bpe-docs", type=int, default=5000, help="web documents the BPE is trained on")
    ap.add_argument(
        "--scaling",
        type=int,
        nargs="*",
        default=[1, 2, 4],
        help="worker counts to run the service with again (none: skip)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per worker count of --scaling")
    ap.add_argument(
        "--raw-repeats", type=int, default=3, help="raw-loop passes before and after each run (the median of all)"
    )
    ap.add_argument(
        "--baseline-workers",
        type=int,
        default=2,
        help="DataLoader workers per rank of the per-rank baseline (0: skip it)",
    )
    ap.add_argument(
        "--shuffle-units",
        type=int,
        nargs="*",
        default=[],
        help="loading.shuffle_units settings to run the service with, side by side (none: skip)",
    )
    args = ap.parse_args(argv)
    generate_demo_corpus(args.data, scale=args.scale)
    out = {"benchmark": "throughput", "workers": args.workers, "cores": os.cpu_count()}
    if args.shuffle_units:
        out["by_shuffle_units"] = by_shuffle_units(args)
        if args.tokenizer == "none":
            return _print(out, args)
    if args.tokenizer in ("byte", "both"):
        out.update(measure(args, None, args.steps))
    if args.tokenizer in ("bpe", "both"):
        path, trained = bpe_plan(args.data, args.bpe_vocab, args.bpe_docs)
        out["bpe"] = {"vocab": args.bpe_vocab, "train_s": round(trained, 2), **measure(args, path, args.bpe_steps)}
    return _print(out, args)


def _print(out: dict, args) -> dict:
    if args.json:
        print(json.dumps(out))
        return out
    for r in out.get("by_shuffle_units", []):
        print(
            f"{r['layout']:<32} shuffle_units={r['shuffle_units']:<4} {r['tokens_per_s']:>12} tok/s  "
            f"wait p50/p99 {r['wait_p50_ms']}/{r['wait_p99_ms']} ms  first batch {r['time_to_first_batch_s']} s  "
            f"blocks {r['blocks_mb_max']} MB"
        )
    if "tokens" in out or "bpe" in out:
        byte, bpe = ({k: v for k, v in out.items() if k not in ("bpe", "by_shuffle_units")}, dict(out.get("bpe", {})))
        for row in (byte, bpe):
            for r in row.pop("by_workers", []):
                row[f"tokens/s, {r['workers']} workers"] = r["tokens_per_s"]
            for k, v in row.pop("baseline", {}).items():
                row[f"baseline {k}"] = v
        print(f"{'metric':<24}{'byte':>16}{'bpe':>16}")
        for k in dict.fromkeys([*byte, *bpe]):
            print(f"{k:<24}{byte.get(k, '')!s:>16}{bpe.get(k, '')!s:>16}")
    return out


if __name__ == "__main__":
    main()
