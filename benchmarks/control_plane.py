"""The central control path at many ranks: sustained steps/s, the service process's CPU per
(step, rank), and the longest block of the scheduler's event loop.

    python benchmarks/control_plane.py                  # dp 8, 64, 256: readable table
    python benchmarks/control_plane.py --json --dp 8 64 256

Each row starts a service (planner plugin, driver and a LocalCluster of worker processes, all
in this process but the workers) with tiny micro-batches (``--tokens`` per rank and step), so
that the control path, not packing or the payload, sets the pace (``heavy_tokens`` is half a
micro-batch: at the default, a sixteenth of 1,024 tokens, nearly every document would be an
outlier to group across ranks, which measures the balancer rather than the control path). ``dp`` lightweight ranks run
as threads in ``--procs`` consumer processes (each rank a ``RankStream``; the process shares one
IO loop and connection pool), taking batches as fast as they come. After a warm-up, for
``--seconds``: steps committed per second, this process's CPU time (user + system: scheduler,
planner thread, driver, nannies) divided by steps × dp, and the scheduler's longest event-loop
block (``overlord_loop``: how late a 10 ms timer on the loop fired).

The same run also measures a baseline row at the smallest ``dp``: the plan with
``loading.batch_steps: 1``, i.e. a queue item, a fetch and an ack per (step, rank) and
constructor tasks per step, as the control path was before chunking.

Targets (issue 13): at dp 256, at most 0.2 ms of service CPU per (step, rank), at least 5
steps/s, no event-loop block over 20 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402


def _ranks_process(address: str, ranks: list[int], stop_at: float, out) -> None:
    """Consume as fast as batches come, one thread per rank, until ``stop_at`` (wall clock)."""
    from overlord_dask import connect

    os.nice(10)  # the ranks stand in for trainers on other hosts: the service's figures must be its own
    counts = {}

    def run(rank: int) -> None:
        n = 0
        with connect(address, rank, timeout=120) as s:
            while time.time() < stop_at:
                s.next_batch()
                n += 1
        counts[rank] = n

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def measure(cluster, data: str, dp: int, tokens: int, procs: int, seconds: float, warmup_steps: int, batch_steps: int | None,
            prefetch: int) -> dict:
    import psutil

    from overlord_dask import Service
    from overlord_dask.service.demo import demo_plan

    plan = demo_plan(data, topology={"dp": dp, "micro_batches": 1, "tokens_per_micro_batch": tokens},
                     loading={"prefetch_steps": prefetch, "batch_steps": batch_steps, "units_ahead": 4},
                     balance={"window": 16, "heavy_tokens": tokens // 2})
    me = psutil.Process()
    ctx = mp.get_context("spawn")
    with Service.start(plan, cluster=cluster) as service:
        q = ctx.Queue()
        groups = [list(range(dp))[i::procs] for i in range(min(procs, dp))]
        ps = [ctx.Process(target=_ranks_process, args=(service.address, g, time.time() + 900, q), daemon=True) for g in groups]
        for p in ps:
            p.start()
        st = service.wait_for_step(warmup_steps, timeout=300)
        service.loop_stats(reset=True)
        c0, cpu0, t0 = st["committed"], sum(me.cpu_times()[:2]), time.perf_counter()
        time.sleep(seconds)
        st = service.status()
        c1, cpu1, t1 = st["committed"], sum(me.cpu_times()[:2]), time.perf_counter()
        loop = service.loop_stats()
        for p in ps:  # the consumers run until stopped: the figures above are taken while they stream
            p.terminate()
        for p in ps:
            p.join(timeout=30)
    steps = c1 - c0
    return {
        "dp": dp,
        "batch_steps": batch_steps,
        "steps": steps,
        "steps_per_s": round(steps / (t1 - t0), 2),
        "cpu_ms_per_step_rank": round((cpu1 - cpu0) * 1e3 / max(1, steps * dp), 4),
        "cpu_ms_per_step": round((cpu1 - cpu0) * 1e3 / max(1, steps), 2),
        "loop_block_max_ms": loop["block_max_ms"],
        "loop_block_p99_ms": loop["block_p99_ms"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank and step (one micro-batch)")
    ap.add_argument("--procs", type=int, default=4, help="consumer processes the ranks are spread over")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=16, help="the plan's prefetch_steps (chunks are half of it)")
    ap.add_argument("--data", default="demo-data")
    ap.add_argument("--no-baseline", action="store_true", help="skip the per-step baseline row")
    args = ap.parse_args(argv)

    from overlord_dask.service.demo import generate_demo_corpus
    from overlord_dask.service.deploy import local_cluster

    if not os.path.exists(os.path.join(args.data, "CORPUS.json")):  # an existing corpus (any scale) is used as it is
        generate_demo_corpus(args.data)
    rows = []
    with local_cluster(n_workers=args.workers) as cluster:
        if not args.no_baseline:
            base = measure(cluster, args.data, min(args.dp), args.tokens, args.procs, args.seconds, args.warmup_steps, 1, args.prefetch)
            rows.append({**base, "row": "baseline: one step per chunk"})
        for dp in args.dp:
            rows.append({**measure(cluster, args.data, dp, args.tokens, args.procs, args.seconds, args.warmup_steps, args.prefetch // 2, args.prefetch),
                         "row": "chunked"})
    out = {"benchmark": "control_plane", "cores": os.cpu_count(), "workers": args.workers, "tokens_per_rank_step": args.tokens, "rows": rows}
    if args.json:
        print(json.dumps(out))
    else:
        print_rows(rows, ["row", "dp", "batch_steps", "steps_per_s", "cpu_ms_per_step_rank", "cpu_ms_per_step", "loop_block_max_ms", "loop_block_p99_ms"])
    return out


if __name__ == "__main__":
    main()
