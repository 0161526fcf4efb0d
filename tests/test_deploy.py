"""Deployments: the embedded LocalCluster uses worker processes; the Slurm job script renders
without Slurm (dask-jobqueue builds it locally); loader pools scale as Slurm jobs through the real
SLURMCluster with stand-in Slurm commands."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_local_cluster_uses_worker_processes(cluster):
    import os

    pids = cluster.scheduler_info["workers"]
    from distributed import Client

    with Client(cluster, set_as_default=False) as c:
        worker_pids = set(c.run(os.getpid).values())
    assert len(worker_pids) == len(pids) == 2 and os.getpid() not in worker_pids


def _imported(name: str) -> bool:
    return name in sys.modules


@pytest.mark.integration
def test_worker_processes_import_the_loaders_as_they_start():
    """A new run's first batch does not wait for a worker's first load task to import the
    loaders: every worker process imports them as it starts (``deploy.WORKER_PRELOAD``, Dask's
    worker preload; Slurm jobs get it on their command line: ``test_slurm_job_script_renders``)."""
    from distributed import Client

    from overlord_dask.service.deploy import WORKER_PRELOAD, local_cluster

    with local_cluster(n_workers=1) as lc, Client(lc, set_as_default=False) as c:
        assert list(c.run(_imported, WORKER_PRELOAD).values()) == [True]  # no task has run on it


@pytest.mark.integration
def test_the_embedded_cluster_quiets_dasks_housekeeping_timers(cluster):
    """Workers run without Dask's 100 Hz statistical profiler and with the slower loop-health tick,
    system monitor and memory checks; the scheduler and the nannies with the slower tick, system
    monitor and memory checks (``deploy.QUIET_DEFAULTS``)."""
    from distributed import Client

    def settings(dask_worker=None):
        import dask

        pcs = dask_worker.periodic_callbacks
        return (
            dask.config.get("distributed.worker.profile.enabled"),
            sorted(pcs),
            pcs["monitor"].callback_time,
            dask_worker.memory_manager.memory_monitor_interval,
            dask_worker.monitor.monitor_disk_io,
        )

    with Client(cluster, set_as_default=False) as c:
        per_worker = c.run(settings)
    assert len(per_worker) == 2
    for enabled, callbacks, monitor_ms, memory_s, disk in per_worker.values():
        assert enabled is False and "profile" not in callbacks
        assert monitor_ms == 2000 and memory_s == pytest.approx(0.5) and disk is False
    assert cluster.scheduler._tick_interval == pytest.approx(0.5)
    assert cluster.scheduler.periodic_callbacks["monitor"].callback_time == 2000
    for nanny in cluster.workers.values():
        assert nanny.memory_manager.memory_monitor_interval == pytest.approx(0.5)


def _thread_priorities():
    import os

    return sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values")
def test_embedded_workers_yield_the_cores_to_the_scheduler_and_the_trainers(cluster):
    """Every thread of every embedded worker runs at ``priority.WORKER_NICE`` (also threads a task
    starts later); this process (scheduler, planner, a trainer's side) stays at its own."""
    import os

    from distributed import Client

    from overlord_dask.service.priority import WORKER_NICE, worker_nice

    with Client(cluster, set_as_default=False) as c:
        c.submit(_thread_priorities, pure=False).result()  # a task: the worker's task thread exists now
        per_worker = c.run(_thread_priorities)
    own = os.getpriority(os.PRIO_PROCESS, 0)  # never changed here
    assert len(per_worker) == 2 and all(p and min(p) >= max(WORKER_NICE, own) for p in per_worker.values()), per_worker
    import dask

    with dask.config.set({"overlord.worker-nice": 0}):
        assert worker_nice() == 0


def test_a_trainer_probing_a_service_still_starting_is_told_not_yet_without_a_logged_traceback(caplog):
    """While a restarted service indexes its sources, reconnecting trainers ask its scheduler for
    the planner: the answer is "none yet" (they try again), not a KeyError traceback in the
    service's log per try."""
    import logging

    from overlord_dask import Service
    from overlord_dask.errors import ServiceError
    from overlord_dask.service.deploy import local_cluster

    with local_cluster(n_workers=0) as c, caplog.at_level(logging.WARNING, logger="distributed.core"):
        with pytest.raises(ServiceError, match="runs no overlord planner"):
            Service.attach(c.scheduler_address)
    assert not [r for r in caplog.records if "No handler" in r.getMessage()], caplog.text


def test_a_users_dask_settings_win_over_the_quiet_defaults():
    import dask

    from overlord_dask.service.deploy import QUIET_DEFAULTS, quiet_defaults, worker_config

    assert quiet_defaults() == QUIET_DEFAULTS
    with dask.config.set({"distributed.admin.tick.interval": "50ms"}):
        assert quiet_defaults() == {k: v for k, v in QUIET_DEFAULTS.items() if k != "distributed.admin.tick.interval"}
        cfg = worker_config()
        assert dask.config.get("distributed.admin.tick.interval", config=cfg) == "50ms"
        assert dask.config.get("distributed.worker.profile.enabled", config=cfg) is False
        assert dask.config.get("distributed.comm.timeouts.connect", config=cfg) == "10s"
    with dask.config.set({"overlord.quiet-dask": False}):
        assert quiet_defaults() == {}
        assert dask.config.get("distributed.worker.profile.enabled", config=worker_config()) is True
    assert dask.config.get("distributed.worker.profile.enabled") is True  # the caller's own config is untouched


@pytest.mark.integration
def test_slurm_job_script_renders():
    pytest.importorskip("dask_jobqueue")
    from overlord_dask.service.deploy import slurm_cluster

    cluster = slurm_cluster(
        cores=4,
        memory="16GB",
        queue="cpu",
        account="proj",
        walltime="01:00:00",
        scheduler_options={"host": "127.0.0.1"},
    )
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert "#SBATCH -p cpu" in script and "#SBATCH -A proj" in script and "#SBATCH -t 01:00:00" in script
    assert "distributed.cli.dask_worker tcp://127.0.0.1:" in script
    assert "--lifetime 3240s --lifetime-stagger 324s" in script  # before the 1 h walltime (a tenth less), staggered
    assert "--preload overlord_dask.worker.loaders" in script  # (deploy.WORKER_PRELOAD)


@pytest.mark.integration
def test_slurm_launcher_prints_job_script(corpus, tmp_path):
    pytest.importorskip("dask_jobqueue")
    plan = ROOT / "pipelines" / "demo.yaml"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "cluster" / "slurm.py"),
            str(plan),
            "--print-job-script",
            "--queue",
            "gpu",
            "--host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "#SBATCH -p gpu" in out.stdout


@pytest.mark.integration
def test_pools_scale_as_slurm_jobs_through_the_real_slurmcluster(corpus, tmp_path, monkeypatch):
    """dask-jobqueue's own SLURMCluster, with sbatch/scancel/squeue stand-ins on PATH that run
    each job script as a local process group (tests/fake_slurm): every pool worker is a job of
    its own with its pool's resource on the worker command line, the photo pool grows by jobs,
    and a pool whose stage ended is shrunk by cancelling a job."""
    import os

    pytest.importorskip("dask_jobqueue")
    from overlord_dask import Service
    from overlord_dask.plan import plan_from_dict
    from overlord_dask.service.deploy import slurm_cluster

    from .test_pools import _consume, _photos_plan

    slurm = tmp_path / "slurm"
    monkeypatch.setenv("PATH", f"{ROOT / 'tests' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(slurm))
    d = _photos_plan(corpus, autoscale=True, steps=40).model_dump(mode="json")
    d["stages"].append({"name": "text-again", "start_step": 45, "weights": {"web": 0.7, "chat": 0.3, "photos": 0.0}})
    d["loading"]["autoscale"].update(down_after=2)
    plan = plan_from_dict(d)
    cluster = slurm_cluster(cores=1, memory="2GB", walltime="00:30:00", scheduler_options={"host": "127.0.0.1"})
    try:
        with Service.start(plan, cluster=cluster) as service:
            _consume(service, 2, 80, compute_s=0.05)
            deadline = time.monotonic() + 30  # the photo stage is over: its pool shrinks after `down_after` decisions
            while time.monotonic() < deadline and not any(
                h["pool"] == "photos" and h["delta"] < 0 and h["step"] >= 45 - 1 for h in service.scaling_history()
            ):
                time.sleep(0.2)
            history = service.scaling_history()
            names = {w["name"] for w in service.client.scheduler_info(n_workers=-1)["workers"].values()}
    finally:
        cluster.close()
    scripts = {p.stem: p.read_text() for p in slurm.glob("*.sh")}
    by_pool = {
        pool: [s for s in scripts.values() if f"--resources overlord-pool-{pool}=1" in s]
        for pool in ("web", "chat", "photos")
    }
    assert all(by_pool.values()), by_pool  # one job per pool worker, pinned by resource
    assert all("#SBATCH" in s and "--name overlord-pool-" in s for s in scripts.values())
    grew = [h for h in history if h["pool"] == "photos" and h["delta"] > 0]
    shrank = [h for h in history if h["pool"] == "photos" and h["delta"] < 0]
    assert grew and len(by_pool["photos"]) >= 2, history  # (lead time: test_pools; jobs here take seconds to start)
    # a pool that grew past its demand (the starving planner's extra workers) may give some back
    # during its stage, never its last worker; once the stage is over it is cancelled down
    assert any(h["step"] >= 45 - 1 for h in shrank), history
    assert all(h["to"] >= 1 for h in shrank if h["step"] < 45 - 1), history
    assert {n.rsplit("-", 1)[0] for n in names} <= {"overlord-pool-web", "overlord-pool-chat", "overlord-pool-photos"}
    cancelled = (slurm / "cancelled").read_text().split()
    assert len(cancelled) == len(scripts)  # every job ended by scancel: the shrink, then the close


@pytest.mark.integration
def test_shared_jobs_that_end_are_replaced_without_a_stall_or_a_lost_step(tmp_path):
    """A soak through the real SLURMCluster (stand-in Slurm commands): worker jobs live 15 s,
    the run lasts 45 s, every job is replaced several times; each successor starts before its
    predecessor drains, so trainers never wait long, and nothing is delivered twice or lost."""
    pytest.importorskip("dask_jobqueue")
    import json
    import subprocess
    import sys

    args = ["--seconds", "45", "--lifetime", "15", "--stagger", "3", "--jobs", "2", "--dp", "2", "--compute-ms", "50"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), *args, "--data", str(tmp_path / "data"), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["failure"] is None
    assert res["workers_replaced"] >= 4, res
    assert res["duplicates"] == 0 and res["missing"] == 0 and res["steps"] > 100, res
    # a successor that did not take over in time would stall both ranks at each of the 4+
    # replacements; one pause of a busy 2-core machine, seen by both ranks, is not that
    assert res["stalls_over_1s"] <= 2 and res["stall_max_s"] < 5, res


@pytest.mark.integration
def test_worker_lifetimes_follow_the_walltime():
    pytest.importorskip("dask_jobqueue")
    from overlord_dask.service.deploy import slurm_cluster

    cluster = slurm_cluster(cores=1, memory="1GB", walltime="02:00:00", replace_jobs=False)
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert (
        "--lifetime 6480s --lifetime-stagger 600s" in script and "#SBATCH -t 02:00:00" in script
    )  # 2 h less 12 min, staggered
    with pytest.raises(
        ValueError, match=r"a worker's lifetime \(7200s\) must end before its job's walltime \(01:00:00\)"
    ):
        slurm_cluster(walltime="01:00:00", lifetime="2h")


@pytest.mark.integration
def test_the_service_outlives_its_own_job_through_the_scheduler_file(cluster, corpus, tmp_path, monkeypatch):
    """`overlord slurm` as a (stand-in) Slurm job with a 15 s walltime: it stops cleanly before
    it, writing its last snapshot, and resubmits itself; the next job resumes from the snapshot
    and writes the scheduler file again; trainers reading the file continue through the gap, and
    their steps are those of an uninterrupted run, none lost or repeated."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.harness import run_ranks

    pytest.importorskip("dask_jobqueue")
    from overlord_dask import Service, connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record
    from overlord_dask.service.demo import demo_plan

    slurm = tmp_path / "slurm"
    monkeypatch.setenv("PATH", f"{ROOT / 'tests' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(slurm))
    plan = demo_plan(
        corpus,
        topology={"dp": 2, "micro_batches": 1, "tokens_per_micro_batch": 4096},
        loading={"prefetch_steps": 4, "unit_rows": 300, "unit_tokens": 65536},
        checkpoint={"url": str(tmp_path / "ck"), "base_every_steps": 20, "base_every_seconds": 2},
    )
    d = plan.model_dump(mode="json")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(d))
    run_file, job = tmp_path / "run.json", tmp_path / "service.sh"
    job.write_text(
        "#!/bin/bash\n"
        f"if [ -e {tmp_path}/second ]; then WALL=00:10:00; else touch {tmp_path}/second; WALL=00:00:15; fi\n"
        f"exec {sys.executable} -m overlord_dask slurm {tmp_path / 'plan.yaml'} --jobs 1 --cores 1 --memory 2GB "
        "--walltime 00:30:00 "
        f"--host 127.0.0.1 --scheduler-file {run_file} --service-walltime $WALL --resubmit-before 0s --resubmit "
        f"'sbatch {job}'\n"
    )
    subprocess.run(["sbatch", str(job)], check=True, capture_output=True)
    deadline = time.monotonic() + 120
    while not run_file.exists():
        assert time.monotonic() < deadline, "the first service job never wrote its scheduler file"
        time.sleep(0.2)
    steps = 100

    def consume(where: str, pause: float, reconnect: float) -> dict:
        """Both ranks' delivered pieces per (rank, step)."""
        out = {}

        def rank(r):
            with connect(where, r, 2, timeout=180, reconnect_timeout=reconnect) as s:
                for _ in range(steps):
                    b = s.next_batch()
                    out[(r, b["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
                    time.sleep(pause)
                s.commit()

        run_ranks(rank, [0, 1])
        return out

    got = consume(str(run_file), 0.25, 120)  # 25 s of training: past the first job's walltime
    assert (
        subprocess.run(
            [sys.executable, "-m", "overlord_dask", "stop", str(run_file)], capture_output=True, timeout=120
        ).returncode
        == 0
    )
    logs = sorted(slurm.glob("*.log"))
    assert sum("event=resubmit" in p.read_text() for p in logs) == 1, [p.read_text()[-2000:] for p in logs]
    with Service.start(demo_plan(corpus, topology=d["topology"], loading=d["loading"]), cluster=cluster) as service:
        reference = consume(service.address, 0.0, 10)  # the same plan, uninterrupted
    assert sorted(got) == sorted(reference) == [(r, s) for r in range(2) for s in range(steps)]
    assert got == reference
