"""Start an overlord-dask service whose loader workers are Slurm jobs (dask-jobqueue).

    python cluster/slurm.py pipelines/demo.yaml --jobs 4 --cores 8 --memory 32GB --queue cpu
    python cluster/slurm.py pipelines/demo.yaml --print-job-script      # inspect, no Slurm needed

Run it as a long-lived job of its own (the scheduler and the planner live in this process), then
start the trainers with the printed address. ``--jobs`` counts the shared workers; pools the plan
declares (``sources[].pool``, ``loading.autoscale``) get jobs of their own, one per pool worker,
with ``--resources overlord-pool-<name>=<cores>`` on the worker command line.
"""

from __future__ import annotations

import argparse
import sys
import time

from overlord_dask import Service, load_plan
from overlord_dask.service.deploy import slurm_cluster
from overlord_dask.protocol import write_scheduler_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--memory", default="32GB")
    ap.add_argument("--queue", default=None)
    ap.add_argument("--account", default=None)
    ap.add_argument("--walltime", default="04:00:00")
    ap.add_argument("--host", default=None, help="interface/address the scheduler listens on (default: dask's choice)")
    ap.add_argument("--scheduler-file", default=None, help="write the service's address here (trainers take the file as address)")
    ap.add_argument("--print-job-script", action="store_true", help="print the sbatch script and exit")
    args = ap.parse_args(argv)
    plan = load_plan(args.plan)
    extra = {"scheduler_options": {"host": args.host}} if args.host else {}
    cluster = slurm_cluster(cores=args.cores, memory=args.memory, queue=args.queue, account=args.account, walltime=args.walltime, **extra)
    if args.print_job_script:
        print(cluster.job_script())
        cluster.close()
        return 0
    cluster.scale(jobs=args.jobs)
    with Service.start(plan, cluster=cluster) as service:
        print(f"overlord service {service.run_id} at {service.address}", flush=True)
        if args.scheduler_file:
            write_scheduler_file(args.scheduler_file, service.address, service.run_id, plan.topology.dp)
        try:
            while not service.status().get("stop_requested"):  # `overlord stop FILE` ends it cleanly
                service.check()
                time.sleep(5)
        except KeyboardInterrupt:
            pass
    cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
