"""The service as a Slurm job whose loader workers are Slurm jobs too (dask-jobqueue), and which
outlives its own walltime: ``overlord slurm PLAN ...`` (``cluster/slurm.py`` runs the same).

    overlord slurm pipelines/demo.yaml --jobs 4 --cores 8 --memory 32GB --queue cpu --scheduler-file run.json
    overlord slurm pipelines/demo.yaml --print-job-script      # inspect, no Slurm needed

Run it as a long-lived job of its own (the scheduler and the planner live in it); trainers find it
through the scheduler file. ``--jobs`` counts the shared workers; pools the plan declares get jobs
of their own. Worker jobs that end are replaced (``deploy.slurm_cluster``).

**Outliving the walltime.** With ``--service-walltime`` (the job's own ``-t``) and ``--resubmit``
(a command, e.g. ``"sbatch service.sh"``), the service stops cleanly ``--resubmit-before`` its
walltime (its last snapshot written: the plan needs ``checkpoint.url``), then runs the command,
which queues the next service job; that job resumes from the snapshot and writes the scheduler
file again. Trainers keep retrying the scheduler file for ``reconnect_timeout`` seconds (the
``RankStream``/``OverlordDataset`` argument): set it above the queue wait of a service job plus
a minute, and they continue where they were, no step lost or repeated.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from .. import logs
from ..errors import PlanError


def parser() -> argparse.ArgumentParser:
    """``overlord slurm``'s options."""
    ap = argparse.ArgumentParser(
        prog="overlord slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("plan")
    ap.add_argument("--jobs", type=int, default=2, help="shared worker jobs")
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--memory", default="32GB")
    ap.add_argument("--queue", default=None)
    ap.add_argument("--account", default=None)
    ap.add_argument(
        "--walltime", default="04:00:00", help="of each worker job; workers leave (and are replaced) before it"
    )
    ap.add_argument(
        "--lifetime", default=None, help="a worker's lifetime (default: the walltime less a tenth, at least 5 minutes)"
    )
    ap.add_argument("--host", default=None, help="interface/address the scheduler listens on (default: dask's choice)")
    ap.add_argument(
        "--scheduler-file", default=None, help="write the service's address here (trainers take the file as address)"
    )
    ap.add_argument(
        "--service-walltime", default=None, help="this job's own walltime ([days-]hh:mm:ss), for --resubmit"
    )
    ap.add_argument("--resubmit-before", default="10m", help="stop and resubmit this long before --service-walltime")
    ap.add_argument(
        "--resubmit", default=None, help='command that queues the next service job (e.g. "sbatch service.sh")'
    )
    ap.add_argument("--log-format", choices=["logfmt", "json"], default="logfmt")
    ap.add_argument("--print-job-script", action="store_true", help="print a worker job's sbatch script and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..plan import load_plan
    from ..protocol import write_scheduler_file
    from .deploy import _seconds, slurm_cluster
    from .service import Service

    args = parser().parse_args(argv)
    t0 = time.monotonic()
    logs.setup(args.log_format)
    plan = load_plan(args.plan)
    deadline = None
    if args.resubmit:
        if not args.service_walltime:
            raise PlanError("--resubmit needs --service-walltime (this job's own walltime)")
        if not plan.checkpoint.url:
            raise PlanError(
                f"{args.plan}: resubmitting the service needs checkpoint.url, where the next job resumes from"
            )
        from dask.utils import parse_timedelta

        deadline = t0 + _seconds(args.service_walltime) - parse_timedelta(args.resubmit_before)
    extra = {"scheduler_options": {"host": args.host}} if args.host else {}
    cluster = slurm_cluster(
        cores=args.cores,
        memory=args.memory,
        queue=args.queue,
        account=args.account,
        walltime=args.walltime,
        lifetime=args.lifetime,
        **extra,
    )
    if args.print_job_script:
        print(cluster.job_script())
        cluster.close()
        return 0
    resubmit, served_at = False, None
    try:
        cluster.scale(jobs=args.jobs)
        with Service.start(plan, cluster=cluster) as service:
            served_at = service.address
            print(f"overlord service {service.run_id} at {service.address}, page {service.dashboard}", flush=True)
            if args.scheduler_file:
                write_scheduler_file(
                    args.scheduler_file, service.address, service.run_id, plan.topology.dp, service.dashboard
                )
            try:
                while not service.status().get("stop_requested"):  # `overlord stop FILE` ends it cleanly
                    service.check()
                    if deadline is not None and time.monotonic() >= deadline:
                        resubmit = True
                        logs.event("resubmit", service.run_id, service.status()["committed"], command=args.resubmit)
                        break
                    time.sleep(1.0)
            except KeyboardInterrupt:
                pass
        # the service closed: its last snapshot is written, so the next job resumes from it
    finally:
        cluster.close()
        if args.scheduler_file and not resubmit:  # stopped for good: the file must not send trainers to it
            _remove_if_ours(args.scheduler_file, served_at)
    if resubmit:
        subprocess.run(shlex.split(args.resubmit), check=True)
    return 0


def _remove_if_ours(path: str, address: str | None) -> None:
    """Remove the scheduler file if it still names ``address`` (a newer job may have rewritten it)."""
    from ..protocol import resolve_address

    try:
        if address is not None and resolve_address(path) == address:
            os.remove(path)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
