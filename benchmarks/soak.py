"""Workers that come and go: a run through dask-jobqueue's real ``SLURMCluster`` whose jobs end
every few tens of seconds, as shared loader jobs reaching their lifetime do over weeks.

    python benchmarks/soak.py                   # table
    python benchmarks/soak.py --json --seconds 300 --lifetime 30

The Slurm commands are the stand-ins of ``tests/fake_slurm`` (each job script runs as a local
process group). Each worker leaves after ``--lifetime`` seconds (staggered by ``--stagger``),
handing its blocks and built batches to the others as it goes; the service brings the cluster
back to its jobs (``deploy.slurm_cluster``: ended jobs are replaced). ``--dp`` trainer ranks
(threads, ``--compute-ms`` per step) train for ``--seconds``.

Keys: ``workers_replaced`` (jobs submitted beyond the first ``--jobs``), ``stall_max_s`` (the
longest a trainer waited for a step after its first), ``duplicates`` and ``missing`` (the pieces
delivered against the planner's ledger), ``seconds``, ``steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.output import print_rows  # noqa: E402


def soak(
    data: str, slurm_dir: str, *, seconds: float, lifetime: float, stagger: float, jobs: int, dp: int, compute_s: float
) -> dict:
    """One soak run; returns its figures."""
    from overlord_dask import Service, connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record, exactly_once, planned_identities
    from overlord_dask.service.demo import demo_plan, generate_demo_corpus
    from overlord_dask.service.deploy import slurm_cluster

    os.environ["PATH"] = f"{ROOT / 'tests' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}"
    os.environ["FAKE_SLURM_DIR"] = slurm_dir
    corpus = generate_demo_corpus(data, scale=0.1, seed=7)
    plan = demo_plan(
        corpus,
        topology={"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": 4096},
        loading={"prefetch_steps": 8, "shadows": 1, "shadow_blocks": True, "unit_rows": 300, "unit_tokens": 65536},
    )
    cluster = slurm_cluster(
        cores=1,
        memory="2GB",
        walltime="00:30:00",
        lifetime=f"{lifetime:g}s",
        lifetime_stagger=f"{stagger:g}s",
        scheduler_options={"host": "127.0.0.1"},
    )
    got: dict = {}
    waits: list[float] = []
    try:
        cluster.scale(jobs=jobs)
        with Service.start(plan, cluster=cluster) as service:
            streams = {r: connect(service.address, r, timeout=120, prefetch_steps=4) for r in range(dp)}
            t_end = time.monotonic() + seconds
            steps = [0]

            def run(r):
                first = True
                while time.monotonic() < t_end:
                    t0 = time.perf_counter()
                    b = streams[r].next_batch()
                    w = time.perf_counter() - t0
                    if not first:
                        waits.append(w)
                    first = False
                    got[(r, b["step"])] = delivered_identities(delivered_record(b))
                    time.sleep(compute_s)

            threads = [threading.Thread(target=run, args=(r,)) for r in range(dp)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            n = min(max(s for (r, s) in got if r == rank) for rank in range(dp)) + 1  # steps every rank took
            steps[0] = n
            for s in streams.values():
                s.commit()
            ledger = service.ledger(0, n)
            failure = service.status()["failure"]
            for s in streams.values():
                s.close()
    finally:
        cluster.close()
    planned = [planned_identities(ledger[s]) for s in range(n)]
    delivered = [__import__("numpy").concatenate([got[(r, s)] for r in range(dp) for s in range(n)])]
    duplicates, missing = exactly_once(planned, delivered)
    submitted = len(list(Path(slurm_dir).glob("*.sh")))
    return {
        "workers_replaced": submitted - jobs,
        "jobs_submitted": submitted,
        "stall_max_s": round(max(waits, default=0.0), 3),
        "wait_p99_s": round(sorted(waits)[int(0.99 * (len(waits) - 1))] if waits else 0.0, 4),
        "stalls_over_1s": sum(w > 1.0 for w in waits),
        "duplicates": duplicates,
        "missing": missing,
        "seconds": seconds,
        "steps": n,
        "failure": failure,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--lifetime", type=float, default=25.0, help="seconds a worker job lives")
    ap.add_argument("--stagger", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--data", default=None)
    args = ap.parse_args(argv)
    data = args.data or tempfile.mkdtemp(prefix="soak-data-")
    with tempfile.TemporaryDirectory(prefix="fake-slurm-") as slurm:
        res = soak(
            data,
            slurm,
            seconds=args.seconds,
            lifetime=args.lifetime,
            stagger=args.stagger,
            jobs=args.jobs,
            dp=args.dp,
            compute_s=args.compute_ms / 1e3,
        )
    out = {
        "benchmark": "soak",
        "cores": os.cpu_count(),
        "lifetime_s": args.lifetime,
        "jobs": args.jobs,
        "dp": args.dp,
        "compute_ms": args.compute_ms,
        **res,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print_rows([res], list(res))
    return out


if __name__ == "__main__":
    main()
