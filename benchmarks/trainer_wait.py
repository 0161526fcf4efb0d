"""How long trainers wait for data: dp trainer *processes* that compute a fixed time per step.

    python benchmarks/trainer_wait.py                          # 100 ms and 25 ms per step, table
    python benchmarks/trainer_wait.py --json --compute-ms 100 25

Each trainer takes its rank's micro-batches through ``OverlordDataset`` in a
``torch.utils.data.DataLoader`` (as the README's training loop does) and "computes" for
``compute_ms`` per step (``time.sleep``, spread over the step's micro-batches, so the CPU stays
free for the service as a GPU trainer's host would leave it). It records the time spent in
``next()`` per step; after ``--warmup`` steps: ``wait_share`` (waiting ÷ wall time),
``wait_p50_ms``, ``wait_p99_ms``, ``time_to_first_batch_s`` (from the trainer's start, the
service already running, less the wait at the start barrier) and ``rank_cpu_us_per_step``: the
trainer process's CPU time (every thread of it, user and system; not its DataLoader workers')
per step after the warm-up, over the ranks that sleep. Sleeping costs next to no CPU, so this is
what taking the batches costs the process a GPU trainer's Python runs in: ``--compute-ms 0``
takes them as fast as they come. The ranks start their first step
together, as a data-parallel job's ranks do after ``init_process_group`` (a barrier once every
rank has its loader); after that they run unsynchronised.

Baseline, in the same run and with the same compute: each rank runs its own
``torch.utils.data.DataLoader`` (``--baseline-workers`` worker processes, default 2) over the demo
corpus's web parquet files (its share of the row groups), tokenizing with the same byte
tokenizer and packing documents first-fit into the same micro-batches (``input_ids``, ``labels``,
``position_ids``): the per-rank loader users would otherwise pick (no mixing, no balancing).

Targets (issue 13, this 2-core machine, dp 4, 2 × 16k tokens per step): wait share ≤ 1% and
wait p99 ≤ 5 ms at 100 ms per step; wait share ≤ 5% at 25 ms per step.

A real trainer (``--model``; ``model_trainer.py``): the first ``--model-ranks`` ranks (default 1)
train a small language model on every micro-batch instead of sleeping, on the GPU in bf16 where
torch sees one (``--device``), fed with pinned memory by both systems; the other ranks sleep
``compute_ms`` as before. Both systems feed the same model, seeded alike, in the same run. The
model ranks' figures are under ``model_*`` (and ``baseline_model_*``): ``model_wait_share``,
``model_wait_p99_ms``, the step's compute in the run (``model_compute_ms``: wall time less the
wait) and on synthetic batches before the loader starts (``model_synthetic_ms``), and the loss
at the first and last step. Set ``--compute-ms`` near ``model_compute_ms`` so that the ranks
keep pace, and ``--model-dim``/``--model-layers`` for the step time wanted (issue 13's GPU
trainer: ~45 ms per step)::

    python benchmarks/trainer_wait.py --model --compute-ms 45              # on a CUDA machine
    python benchmarks/trainer_wait.py --model --compute-ms 500             # CPU: one core trains

The stream alone (``--consumer rankstream``): the trainers iterate ``connect()``'s
``RankStream`` (numpy micro-batches) instead of ``OverlordDataset`` in a ``DataLoader``, so that
``rank_cpu_us_per_step`` is what fetching, decoding and handing over cost the trainer's process.

Shuffle blocks (``--shuffle-units 1 64``): the service runs once per ``loading.shuffle_units``
setting, in turn, for each compute time (the baseline once); ``--small-units`` cuts the demo's
sources into ~1,000 load units each (``unit_rows`` 12, ``unit_tokens`` 4,096).
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402
from benchmarks.per_rank import as_batch  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _train(batches, micro_batches: int, steps: int, compute_s: float, start, model=None, warmup: int = 10) -> dict:
    """The trainer loop both systems run: per micro-batch, take it (timed) and compute (sleep
    ``compute_s`` over the step, or train ``model``: a ``model_trainer.ModelTrainer``).

    ``start`` (a barrier of all ranks) is passed once the rank's loader exists, as the ranks of
    a data-parallel job start their first step together after ``init_process_group``: without
    it, the rank whose process came up first ran ``prefetch_steps`` ahead of the last one to
    attach and then waited for it (a startup skew of a few hundred ms counted as waiting for
    data, in a job whose ranks never run apart)."""
    waits, ends, tokens, t_start, t_first, k = [], [], [], time.perf_counter(), None, 0
    it = iter(batches)
    b0 = time.perf_counter()
    start.wait()
    barrier_s = time.perf_counter() - b0  # not the rank's own time to its first batch
    step_wait, step_tokens, cpu0 = 0.0, 0, None
    cpu_from = min(warmup, steps - 1)  # CPU is counted from this step on
    while len(waits) < steps:
        if cpu0 is None and len(waits) == cpu_from:
            cpu0 = _cpu_s()
        t0 = time.perf_counter()
        mb = next(it)
        step_wait += time.perf_counter() - t0
        if t_first is None:
            t_first = time.perf_counter()
        dtype = mb["input_ids"].dtype
        assert not (dtype.is_floating_point if isinstance(dtype, torch.dtype) else np.issubdtype(dtype, np.floating))
        step_tokens += int(mb["cu_seqlens"][-1])  # the documents' tokens, padding excluded
        if model is not None:
            model.micro_batch(mb)
        elif compute_s:
            time.sleep(compute_s / micro_batches)
        k += 1
        if k % micro_batches == 0:
            if model is not None:
                model.end_step(micro_batches)
            waits.append(step_wait)
            ends.append(time.perf_counter())
            tokens.append(step_tokens)
            step_wait, step_tokens = 0.0, 0
    res = {
        "cpu_s": _cpu_s() - cpu0,  # the trainer process's CPU after the warm-up (its loader workers' excluded)
        "cpu_steps": steps - cpu_from,
        "waits": waits,
        "ends": ends,
        "tokens": tokens,
        "t_start": t_start,
        "t_first": t_first,
        "barrier_s": barrier_s,
    }
    if model is not None:
        res["losses"] = model.losses  # marks a model rank (_summarise_model)
    return res


def _model(spec: dict | None, rank: int, capacity: int, micro_batches: int):
    """This rank's ``ModelTrainer`` (ranks below ``spec["ranks"]`` with ``--model``) and its step
    time on synthetic batches, taken before its loader starts; (None, None) for a rank that sleeps."""
    if spec is None or rank >= spec["ranks"]:
        return None, None
    from benchmarks.model_trainer import ModelTrainer, calibrate

    model = ModelTrainer(
        vocab=spec["vocab"], dim=spec["dim"], layers=spec["layers"], capacity=capacity, device=spec["device"], seed=rank
    )
    return model, calibrate(model, capacity, micro_batches)


def _overlord_trainer(
    address: str,
    rank: int,
    dp: int,
    steps: int,
    compute_s: float,
    micro_batches: int,
    start,
    out,
    model_spec: dict | None = None,
    capacity: int = 0,
    warmup: int = 10,
    consumer: str = "dataset",
) -> None:
    from overlord_dask import OverlordDataset, connect

    model, synthetic_s = _model(
        model_spec, rank, capacity, micro_batches
    )  # before the clock: not the loader's time to a first batch
    t0 = time.perf_counter()
    if consumer == "rankstream":  # the stream itself: numpy micro-batches, no DataLoader or tensors
        stream = connect(address, rank=rank, dp=dp)
        res = _train(stream, micro_batches, steps, compute_s, start, model, warmup)
    else:
        ds = OverlordDataset(address, rank=rank, dp=dp, pin_memory=model is not None and model.device == "cuda")
        stream = ds.stream
        res = _train(
            torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0),
            micro_batches,
            steps,
            compute_s,
            start,
            model,
            warmup,
        )
    res["t_start"], res["synthetic_s"] = t0, synthetic_s
    stream.commit()
    stream.close()
    out.put((rank, res))


class PackedWeb(torch.utils.data.IterableDataset):
    """Per-rank baseline dataset: web documents tokenized (the byte tokenizer, or a plan's
    ``tokenizer`` spec resolved against ``base_dir``) and packed first-fit into micro-batches;
    each DataLoader worker reads its own share of the rank's row groups."""

    def __init__(
        self, files: list[str], capacity: int, rank: int, world: int, tokenizer="byte", base_dir: str | None = None
    ):
        super().__init__()
        self.files, self.capacity, self.rank, self.world = files, capacity, rank, world
        self.tokenizer, self.base_dir = tokenizer, base_dir

    def __iter__(self):
        import pyarrow.parquet as pq

        from overlord_dask.sources.tokenizers import resolve_tokenizer

        tokenize = resolve_tokenizer(self.tokenizer, self.base_dir)
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        mine = groups[self.rank * nw + wid :: self.world * nw]
        cap = self.capacity
        ids, pos, cu = (
            np.zeros(cap, np.int64),
            0,
            [0],
        )  # a micro-batch goes on across row groups: no tokens read for nothing
        while True:
            for f, g in mine:
                # one thread per DataLoader worker, as torch sets its own: no Arrow thread pool
                # left running in a worker that the DataLoader shuts down mid-read
                col = (
                    pq.ParquetFile(f).read_row_group(g, columns=["text"], use_threads=False).column(0).combine_chunks()
                )
                tokens, offsets = tokenize(col)
                for a, b in zip(offsets[:-1], offsets[1:]):
                    L = min(int(b - a), cap)
                    if pos + L > cap:
                        yield as_batch(ids, cu, cap)
                        ids, pos, cu = np.zeros(cap, np.int64), 0, [0]
                    ids[pos : pos + L] = tokens[a : a + L]
                    pos += L
                    cu.append(pos)


def _baseline_trainer(
    files: list[str],
    rank: int,
    dp: int,
    steps: int,
    compute_s: float,
    micro_batches: int,
    capacity: int,
    workers: int,
    start,
    out,
    tokenizer="byte",
    base_dir: str | None = None,
    model_spec: dict | None = None,
    warmup: int = 10,
) -> None:
    model, synthetic_s = _model(model_spec, rank, capacity, micro_batches)
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        PackedWeb(files, capacity, rank, dp, tokenizer, base_dir),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        persistent_workers=False,
        pin_memory=model is not None and model.device == "cuda",
    )
    res = _train(loader, micro_batches, steps, compute_s, start, model, warmup)
    res["t_start"], res["synthetic_s"] = t0, synthetic_s
    out.put((rank, res))


def _baseline(ctx, files: list[str], args, compute_ms: float, model_spec: dict | None) -> dict:
    """The per-rank DataLoader baseline at ``compute_ms``: its figures, prefixed ``baseline_``."""
    base = _run_procs(
        ctx,
        _baseline_trainer,
        lambda r: (
            files,
            r,
            args.dp,
            args.steps,
            compute_ms / 1e3,
            args.micro_batches,
            args.tokens,
            args.baseline_workers,
        ),
        args.dp,
        model_spec=model_spec,
        warmup=args.warmup,
    )
    b = _summarise(base, args.warmup)
    if model_spec:
        b.update(_summarise_model(base, args.warmup))
    return {f"baseline_{k}": v for k, v in b.items()}


def _summarise(results: list[dict], warmup: int) -> dict:
    waits = np.concatenate([np.asarray(r["waits"][warmup:]) for r in results])
    # after the warm-up: time spent in next() over the wall time of the same steps
    share = [sum(r["waits"][warmup:]) / max(r["ends"][-1] - r["ends"][warmup - 1], 1e-9) for r in results]
    sleeping = [r for r in results if "losses" not in r] or results  # a model rank's CPU is its model's
    return {
        "rank_cpu_us_per_step": round(float(np.mean([r["cpu_s"] / r["cpu_steps"] for r in sleeping])) * 1e6, 1),
        "wait_share": round(float(np.mean(share)), 4),
        "wait_p50_ms": round(float(np.percentile(waits, 50)) * 1e3, 3),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 3),
        "time_to_first_batch_s": round(
            float(np.mean([r["t_first"] - r["t_start"] - r["barrier_s"] for r in results])), 3
        ),
    }


def _summarise_model(results: list[dict], warmup: int) -> dict:
    """The model ranks' own figures: their wait, their step's compute (wall time less the wait)
    in the run and on synthetic batches before it (``model_trainer.calibrate``), and the loss at
    the first and last step (it falls: the model learns from the batches it is handed)."""
    ranks = [r for r in results if "losses" in r]
    out = {f"model_{k}": v for k, v in _summarise(ranks, warmup).items() if k != "time_to_first_batch_s"}
    compute = np.concatenate([np.diff(r["ends"][warmup - 1 :]) - np.asarray(r["waits"][warmup:]) for r in ranks])
    out.update(
        model_compute_ms=round(float(np.median(compute)) * 1e3, 3),
        model_synthetic_ms=round(float(np.median([r["synthetic_s"] for r in ranks])) * 1e3, 3),
        model_loss_first=round(float(np.mean([r["losses"][0] for r in ranks])), 4),
        model_loss_last=round(float(np.mean([r["losses"][-1] for r in ranks])), 4),
    )
    return out


def _run_procs(ctx, target, args_for_rank, dp: int, **kwargs) -> list[dict]:
    q, start = ctx.Queue(), ctx.Barrier(dp)
    ps = [
        ctx.Process(target=target, args=(*args_for_rank(r), start, q), kwargs=kwargs) for r in range(dp)
    ]  # not daemonic: DataLoader workers are children
    for p in ps:
        p.start()
    out = dict(q.get(timeout=900) for _ in range(dp))
    for p in ps:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    return [out[r] for r in range(dp)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[100.0, 25.0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=120, help="steps per trainer, warm-up included")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2, help="Dask worker processes of the service")
    ap.add_argument("--baseline-workers", type=int, default=2, help="DataLoader workers per rank in the baseline")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--data", default="demo-data")
    ap.add_argument(
        "--model",
        action="store_true",
        help="the first --model-ranks ranks train a real model (model_trainer.py) instead of sleeping",
    )
    ap.add_argument("--model-ranks", type=int, default=1)
    ap.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="the model's device (auto: cuda where torch sees one)",
    )
    ap.add_argument("--model-dim", type=int, default=None, help="model width (default 2048 on cuda, 64 on cpu)")
    ap.add_argument("--model-layers", type=int, default=None, help="MLP blocks (default 4 on cuda, 1 on cpu)")
    ap.add_argument("--vocab", type=int, default=512, help="the model's vocabulary (the demo's byte ids are below 260)")
    ap.add_argument("--shuffle-units", type=int, nargs="*", default=[], help="loading.shuffle_units settings, in turn")
    ap.add_argument("--small-units", action="store_true", help="~1,000 load units per source")
    ap.add_argument(
        "--consumer",
        default="dataset",
        choices=["dataset", "rankstream"],
        help="OverlordDataset in a DataLoader (torch tensors), or the RankStream itself (numpy)",
    )
    args = ap.parse_args(argv)
    model_spec = None
    if args.model:
        from benchmarks.model_trainer import pick_device

        device = pick_device(args.device)
        gpu = device == "cuda"
        model_spec = {
            "ranks": min(args.model_ranks, args.dp),
            "device": device,
            "vocab": args.vocab,
            "dim": args.model_dim or (2048 if gpu else 64),
            "layers": args.model_layers or (4 if gpu else 1),
        }

    from overlord_dask import Service
    from overlord_dask.service.demo import demo_plan, generate_demo_corpus
    from overlord_dask.service.deploy import local_cluster

    if not os.path.exists(os.path.join(args.data, "CORPUS.json")):  # an existing corpus (any scale) is used as it is
        generate_demo_corpus(args.data)
    topology = {"dp": args.dp, "micro_batches": args.micro_batches, "tokens_per_micro_batch": args.tokens}
    units = {"unit_rows": 12, "unit_tokens": 4096} if args.small_units else {}
    plans = [
        demo_plan(args.data, topology=topology, loading={**units, **({"shuffle_units": k} if k else {})})
        for k in (args.shuffle_units or [None])
    ]
    ctx = mp.get_context("spawn")
    files = sorted(glob.glob(os.path.join(os.path.abspath(args.data), "web", "*.parquet")))
    rows = []
    with local_cluster(n_workers=args.workers) as cluster:
        for compute_ms in args.compute_ms:
            for n, plan in enumerate(plans):
                with Service.start(plan, cluster=cluster) as service:
                    res = _run_procs(
                        ctx,
                        _overlord_trainer,
                        lambda r: (service.address, r, args.dp, args.steps, compute_ms / 1e3, args.micro_batches),
                        args.dp,
                        model_spec=model_spec,
                        capacity=args.tokens,
                        warmup=args.warmup,
                        consumer=args.consumer,
                    )
                    loop = service.loop_stats()
                row = {
                    "system": "overlord",
                    "consumer": args.consumer,
                    "compute_ms": compute_ms,
                    "shuffle_units": plan.loading.shuffle_units,
                    **_summarise(res, args.warmup),
                    "loop_block_max_ms": loop["block_max_ms"],
                }
                if model_spec:
                    row.update(_summarise_model(res, args.warmup))
                if not args.no_baseline and n == 0:
                    row.update(_baseline(ctx, files, args, compute_ms, model_spec))
                rows.append(row)
    out = {
        "benchmark": "trainer_wait",
        "cores": os.cpu_count(),
        "dp": args.dp,
        "micro_batches": args.micro_batches,
        "tokens_per_micro_batch": args.tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
    }
    if model_spec:
        out["model"] = {**model_spec, "gpu": torch.cuda.get_device_name(0) if model_spec["device"] == "cuda" else None}
    if args.json:
        print(json.dumps(out))
    elif model_spec:
        print(
            f"model on {model_spec['device']} for rank(s) < {model_spec['ranks']} (dim {model_spec['dim']}, "
            f"{model_spec['layers']} layers); "
            f"the other ranks sleep compute_ms"
        )
        print_rows(
            rows,
            [
                "compute_ms",
                "model_synthetic_ms",
                "model_compute_ms",
                "model_wait_share",
                "model_wait_p99_ms",
                "baseline_model_compute_ms",
                "baseline_model_wait_share",
                "baseline_model_wait_p99_ms",
                "model_loss_first",
                "model_loss_last",
            ],
        )
    else:
        print_rows(
            rows,
            [
                "compute_ms",
                "shuffle_units",
                "wait_share",
                "wait_p50_ms",
                "wait_p99_ms",
                "time_to_first_batch_s",
                "loop_block_max_ms",
                "rank_cpu_us_per_step",
                "baseline_wait_share",
                "baseline_wait_p99_ms",
                "baseline_rank_cpu_us_per_step",
            ],
        )
    return out


if __name__ == "__main__":
    main()
