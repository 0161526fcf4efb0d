"""Deployments: the embedded LocalCluster uses worker processes; the Slurm job script renders
without Slurm (dask-jobqueue builds it locally)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_local_cluster_uses_worker_processes(cluster):
    import os

    pids = cluster.scheduler_info["workers"]
    from distributed import Client

    with Client(cluster, set_as_default=False) as c:
        worker_pids = set(c.run(os.getpid).values())
    assert len(worker_pids) == len(pids) == 2 and os.getpid() not in worker_pids


def test_slurm_job_script_renders():
    pytest.importorskip("dask_jobqueue")
    from overlord_dask.deploy import slurm_cluster

    cluster = slurm_cluster(cores=4, memory="16GB", queue="cpu", account="proj", walltime="01:00:00", scheduler_options={"host": "127.0.0.1"})
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert "#SBATCH -p cpu" in script and "#SBATCH -A proj" in script and "#SBATCH -t 01:00:00" in script
    assert "distributed.cli.dask_worker tcp://127.0.0.1:" in script
    assert "--lifetime 230m" in script and "--lifetime-stagger 10m" in script


def test_slurm_launcher_prints_job_script(corpus, tmp_path):
    pytest.importorskip("dask_jobqueue")
    plan = ROOT / "pipelines" / "demo.yaml"
    out = subprocess.run(
        [sys.executable, str(ROOT / "cluster" / "slurm.py"), str(plan), "--print-job-script", "--queue", "gpu", "--host", "127.0.0.1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "#SBATCH -p gpu" in out.stdout
