"""Cluster factories: the embedded LocalCluster default and a Slurm cluster via dask-jobqueue.

Workers are separate processes (not threads) so that tokenization and packing run in parallel
outside the scheduler's GIL, exactly as they would on remote nodes. ``worker-ttl`` is lowered
because with Dask's default a hung worker is only removed after 5 minutes.

Two of Dask's housekeeping timers are slowed down (``QUIET_DEFAULTS``), because they wake every
event loop of the service many times a second: the workers' statistical profiler (it walks the
task thread's stack for the dashboard's profile page) and the loop-health tick (in the
scheduler, each nanny and each worker); counted per callback they are a sizeable share of the
CPU of the scheduler's and the workers' event loops. Three per-process monitors are slowed down
as well, because their cost is per worker process and per second, not per batch: each worker and
each nanny checks its memory (a nanny builds a ``psutil.Process`` for every check, on the
scheduler's loop in the embedded cluster), and each process samples its CPU, memory, network and
the host's disk counters for the dashboard. At Dask's intervals they make extra worker processes
cost the service throughput on few cores (``benchmarks/throughput.py --scaling``). Memory
checked less often is safe here: a service's blocks and batches are bounded by its plan
(``prefetch_steps``, ``units_ahead``), not grown by a user's task.

Each is a default only: a value other than Dask's default in Dask's config (YAML, ``DASK_*``
environment variables, ``dask.config.set``) wins, and ``overlord.quiet-dask: false`` (e.g.
``DASK_OVERLORD__QUIET_DASK=false``) keeps all of Dask's defaults, the profiler included.
"""

from __future__ import annotations

import dask
from distributed import Client, LocalCluster

from .priority import WorkerPriority
from .priority import worker_nice as worker_nice_default

WORKER_CONFIG = {"distributed": {"comm": {"timeouts": {"connect": "10s"}}}}
"""Set on every worker (``Nanny(config=...)``, pool workers too): a worker fetching a block from a
peer that just died retries the refused connection this long, not Dask's 30 s."""

QUIET_DEFAULTS = {
    "distributed.worker.profile.enabled": False,  # no 100 Hz stack sampling of every worker
    "distributed.admin.tick.interval": "100ms",  # Dask's loop-health tick (the service measures its own: scheduler/watchdog.py)
    "distributed.admin.system-monitor.interval": "2s",  # the dashboard's per-process time series (psutil reads of /proc)
    "distributed.admin.system-monitor.disk": False,  # host-wide disk I/O counters: nothing in the service reads them
    "distributed.worker.memory.monitor-interval": "500ms",  # spill / pause / terminate checks, in each worker and nanny
}
"""Applied where Dask's config still holds Dask's own default (``quiet_defaults``)."""

SERVICE_CONFIG = {
    # a hung worker (SIGSTOP, a stuck NFS read) is removed after this long and its work rebuilt
    # elsewhere; trainers meanwhile fetch from shadows (trainer/fetch.py, HEDGE_S)
    "distributed.scheduler.worker-ttl": "20s",
    # the active memory manager's ReduceReplicas would delete the shadow copies of built batches
    "distributed.scheduler.active-memory-manager.start": False,
}


def quiet_defaults() -> dict:
    """The ``QUIET_DEFAULTS`` whose keys the user left at Dask's default, as flat config keys
    (none with ``overlord.quiet-dask: false``)."""
    if not dask.config.get("overlord.quiet-dask", True):
        return {}
    dask_defaults = dask.config.merge(*dask.config.defaults)
    return {key: ours for key, ours in QUIET_DEFAULTS.items()
            if dask.config.get(key, None) == dask.config.get(key, None, config=dask_defaults)}


def service_config() -> dict:
    """Config for the service's own process (scheduler, nannies): ``SERVICE_CONFIG`` and the quiet defaults."""
    return {**quiet_defaults(), **SERVICE_CONFIG}


def worker_config() -> dict:
    """The whole config a worker process of the embedded cluster gets (a Nanny's ``config``
    replaces the worker's instead of adding to it): the user's, ``WORKER_CONFIG`` and the quiet defaults."""
    with dask.config.set(quiet_defaults()):
        return dask.config.merge(dask.config.config, WORKER_CONFIG)


def tls_configured() -> bool:
    """Whether Dask's config (``distributed.comm.tls.*``, e.g. from ``DASK_DISTRIBUTED__COMM__TLS__*``
    environment variables) holds certificates: then every connection of the service is TLS."""
    return bool(dask.config.get("distributed.comm.tls.ca-file", None) or dask.config.get("distributed.comm.require-encryption", None))


def local_cluster(n_workers: int = 2, threads_per_worker: int = 1, memory_limit: str | int = "auto", worker_nice: int | None = None,
                  **kwargs) -> LocalCluster:
    """A LocalCluster of worker processes with the service's settings; TLS for every connection
    when Dask's config holds certificates (the scheduler listens on loopback unless ``host`` is
    given). Its workers, new ones included, run at ``worker_nice`` (default ``overlord.worker-nice``,
    5: ``priority.py``) so that they leave the cores to the scheduler and the trainers first."""
    kwargs.setdefault("config", worker_config())
    if tls_configured() and "security" not in kwargs:
        from distributed.security import Security

        kwargs.update(security=Security(), protocol="tls://")
    with dask.config.set(service_config()):
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=kwargs.pop("dashboard_address", ":0"),
            **kwargs,
        )
    nice = worker_nice_default() if worker_nice is None else worker_nice
    if nice > 0:
        try:
            with Client(cluster, set_as_default=False) as client:
                client.register_plugin(WorkerPriority(nice))  # kept by the scheduler for workers that join later
        except BaseException:
            cluster.close()
            raise
    return cluster


def slurm_cluster(
    *,
    cores: int = 8,
    memory: str = "32GB",
    queue: str | None = None,
    account: str | None = None,
    walltime: str = "04:00:00",
    processes: int = 1,
    python: str | None = None,
    **kwargs,
):
    """A dask-jobqueue ``SLURMCluster`` whose jobs start overlord-dask loader workers.

    The scheduler runs in this process (the service); scale with ``cluster.scale(jobs=n)`` or
    ``cluster.adapt(...)``. Workers get ``--lifetime`` staggering so long runs recycle them.
    """
    from dask_jobqueue import SLURMCluster  # optional dependency: pip install overlord-dask[slurm]

    extra = list(kwargs.pop("worker_extra_args", []))
    extra += ["--lifetime", "230m", "--lifetime-stagger", "10m"]
    with dask.config.set(service_config()):
        return SLURMCluster(
            cores=cores,
            processes=processes,
            memory=memory,
            queue=queue,
            account=account,
            walltime=walltime,
            python=python,
            worker_extra_args=extra,
            **kwargs,
        )
