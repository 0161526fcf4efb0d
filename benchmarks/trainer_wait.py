"""How long trainers wait for data: dp trainer *processes* that compute a fixed time per step.

    python benchmarks/trainer_wait.py                          # 100 ms and 25 ms per step, table
    python benchmarks/trainer_wait.py --json --compute-ms 100 25

Each trainer takes its rank's micro-batches through ``OverlordDataset`` in a
``torch.utils.data.DataLoader`` (as the README's training loop does) and "computes" for
``compute_ms`` per step (``time.sleep``, spread over the step's micro-batches, so the CPU stays
free for the service as a GPU trainer's host would leave it). It records the time spent in
``next()`` per step; after ``--warmup`` steps: ``wait_share`` (waiting ÷ wall time),
``wait_p50_ms``, ``wait_p99_ms``, and ``time_to_first_batch_s`` (from the trainer's start, the
service already running, less the wait at the start barrier). The ranks start their first step
together, as a data-parallel job's ranks do after ``init_process_group`` (a barrier once every
rank has its loader); after that they run unsynchronised.

Baseline, in the same run and with the same compute: each rank runs its own
``torch.utils.data.DataLoader`` (``--baseline-workers`` worker processes, default 2) over the demo
corpus's web parquet files (its share of the row groups), tokenizing with the same byte
tokenizer and packing documents first-fit into the same micro-batches (``input_ids``, ``labels``,
``position_ids``): the per-rank loader users would otherwise pick (no mixing, no balancing).

Targets (issue 13, this 2-core machine, dp 4, 2 × 16k tokens per step): wait share ≤ 1% and
wait p99 ≤ 5 ms at 100 ms per step; wait share ≤ 5% at 25 ms per step.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402
from benchmarks.per_rank import as_batch  # noqa: E402


def _train(batches, micro_batches: int, steps: int, compute_s: float, start) -> dict:
    """The trainer loop both systems run: per micro-batch, take it (timed) and compute.

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
    step_wait, step_tokens = 0.0, 0
    while len(waits) < steps:
        t0 = time.perf_counter()
        mb = next(it)
        step_wait += time.perf_counter() - t0
        if t_first is None:
            t_first = time.perf_counter()
        assert mb["input_ids"].dtype.is_floating_point is False
        step_tokens += int(mb["cu_seqlens"][-1])  # the documents' tokens, padding excluded
        if compute_s:
            time.sleep(compute_s / micro_batches)
        k += 1
        if k % micro_batches == 0:
            waits.append(step_wait)
            ends.append(time.perf_counter())
            tokens.append(step_tokens)
            step_wait, step_tokens = 0.0, 0
    return {"waits": waits, "ends": ends, "tokens": tokens, "t_start": t_start, "t_first": t_first, "barrier_s": barrier_s}


def _overlord_trainer(address: str, rank: int, dp: int, steps: int, compute_s: float, micro_batches: int, start, out) -> None:
    from overlord_dask import OverlordDataset

    t0 = time.perf_counter()
    ds = OverlordDataset(address, rank=rank, dp=dp)
    res = _train(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0), micro_batches, steps, compute_s, start)
    res["t_start"] = t0
    ds.stream.commit()
    ds.close()
    out.put((rank, res))


class PackedWeb(torch.utils.data.IterableDataset):
    """Per-rank baseline dataset: web documents tokenized (the byte tokenizer, or a plan's
    ``tokenizer`` spec resolved against ``base_dir``) and packed first-fit into micro-batches;
    each DataLoader worker reads its own share of the rank's row groups."""

    def __init__(self, files: list[str], capacity: int, rank: int, world: int, tokenizer: str = "byte", base_dir: str | None = None):
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
        ids, pos, cu = np.zeros(cap, np.int64), 0, [0]  # a micro-batch goes on across row groups: no tokens read for nothing
        while True:
            for f, g in mine:
                # one thread per DataLoader worker, as torch sets its own: no Arrow thread pool
                # left running in a worker that the DataLoader shuts down mid-read
                col = pq.ParquetFile(f).read_row_group(g, columns=["text"], use_threads=False).column(0).combine_chunks()
                tokens, offsets = tokenize(col)
                for a, b in zip(offsets[:-1], offsets[1:]):
                    L = min(int(b - a), cap)
                    if pos + L > cap:
                        yield as_batch(ids, cu, cap)
                        ids, pos, cu = np.zeros(cap, np.int64), 0, [0]
                    ids[pos : pos + L] = tokens[a : a + L]
                    pos += L
                    cu.append(pos)


def _baseline_trainer(files: list[str], rank: int, dp: int, steps: int, compute_s: float, micro_batches: int, capacity: int,
                      workers: int, start, out, tokenizer: str = "byte", base_dir: str | None = None) -> None:
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(PackedWeb(files, capacity, rank, dp, tokenizer, base_dir), batch_size=None, num_workers=workers,
                                         prefetch_factor=2 if workers else None, persistent_workers=False)
    res = _train(loader, micro_batches, steps, compute_s, start)
    res["t_start"] = t0
    out.put((rank, res))


def _summarise(results: list[dict], warmup: int) -> dict:
    waits = np.concatenate([np.asarray(r["waits"][warmup:]) for r in results])
    # after the warm-up: time spent in next() over the wall time of the same steps
    share = [sum(r["waits"][warmup:]) / max(r["ends"][-1] - r["ends"][warmup - 1], 1e-9) for r in results]
    return {
        "wait_share": round(float(np.mean(share)), 4),
        "wait_p50_ms": round(float(np.percentile(waits, 50)) * 1e3, 3),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 3),
        "time_to_first_batch_s": round(float(np.mean([r["t_first"] - r["t_start"] - r["barrier_s"] for r in results])), 3),
    }


def _run_procs(ctx, target, args_for_rank, dp: int, **kwargs) -> list[dict]:
    q, start = ctx.Queue(), ctx.Barrier(dp)
    ps = [ctx.Process(target=target, args=(*args_for_rank(r), start, q), kwargs=kwargs) for r in range(dp)]  # not daemonic: DataLoader workers are children
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
    args = ap.parse_args(argv)

    from overlord_dask import Service
    from overlord_dask.demo import demo_plan, generate_demo_corpus
    from overlord_dask.deploy import local_cluster

    if not os.path.exists(os.path.join(args.data, "CORPUS.json")):  # an existing corpus (any scale) is used as it is
        generate_demo_corpus(args.data)
    plan = demo_plan(args.data, topology={"dp": args.dp, "micro_batches": args.micro_batches, "tokens_per_micro_batch": args.tokens})
    ctx = mp.get_context("spawn")
    files = sorted(glob.glob(os.path.join(os.path.abspath(args.data), "web", "*.parquet")))
    rows = []
    with local_cluster(n_workers=args.workers) as cluster:
        for compute_ms in args.compute_ms:
            with Service.start(plan, cluster=cluster) as service:
                res = _run_procs(ctx, _overlord_trainer, lambda r: (service.address, r, args.dp, args.steps, compute_ms / 1e3, args.micro_batches), args.dp)
                loop = service.loop_stats()
            row = {"system": "overlord", "compute_ms": compute_ms, **_summarise(res, args.warmup), "loop_block_max_ms": loop["block_max_ms"]}
            if not args.no_baseline:
                base = _run_procs(ctx, _baseline_trainer, lambda r: (files, r, args.dp, args.steps, compute_ms / 1e3, args.micro_batches, args.tokens,
                                                                     args.baseline_workers), args.dp)
                b = _summarise(base, args.warmup)
                row.update({f"baseline_{k}": v for k, v in b.items()})
            rows.append(row)
    out = {"benchmark": "trainer_wait", "cores": os.cpu_count(), "dp": args.dp, "micro_batches": args.micro_batches,
           "tokens_per_micro_batch": args.tokens, "steps": args.steps, "warmup": args.warmup, "rows": rows}
    if args.json:
        print(json.dumps(out))
    else:
        print_rows(rows, ["compute_ms", "wait_share", "wait_p50_ms", "wait_p99_ms", "time_to_first_batch_s", "loop_block_max_ms",
                          "baseline_wait_share", "baseline_wait_p99_ms"])
    return out


if __name__ == "__main__":
    main()
