"""Cluster factories: the embedded LocalCluster default and a Slurm cluster via dask-jobqueue.

Workers are separate processes (not threads) so that tokenization and packing run in parallel
outside the scheduler's GIL, exactly as they would on remote nodes. ``worker-ttl`` is lowered
because with Dask's default a hung worker is only removed after 5 minutes.
"""

from __future__ import annotations

import dask
from distributed import LocalCluster

WORKER_CONFIG = {"distributed": {"comm": {"timeouts": {"connect": "10s"}}}}
"""Set on every worker (``Nanny(config=...)``, pool workers too): a worker fetching a block from a
peer that just died retries the refused connection this long, not Dask's 30 s."""

SERVICE_CONFIG = {
    # a hung worker (SIGSTOP, a stuck NFS read) is removed after this long and its work rebuilt
    # elsewhere; trainers meanwhile fetch from shadows (rank_io.HEDGE_S)
    "distributed.scheduler.worker-ttl": "20s",
    # the active memory manager's ReduceReplicas would delete the shadow copies of built batches
    "distributed.scheduler.active-memory-manager.start": False,
}


def tls_configured() -> bool:
    """Whether Dask's config (``distributed.comm.tls.*``, e.g. from ``DASK_DISTRIBUTED__COMM__TLS__*``
    environment variables) holds certificates: then every connection of the service is TLS."""
    return bool(dask.config.get("distributed.comm.tls.ca-file", None) or dask.config.get("distributed.comm.require-encryption", None))


def local_cluster(n_workers: int = 2, threads_per_worker: int = 1, memory_limit: str | int = "auto", **kwargs) -> LocalCluster:
    """A LocalCluster of worker processes with the service's settings; TLS for every connection
    when Dask's config holds certificates (the scheduler listens on loopback unless ``host`` is
    given)."""
    kwargs.setdefault("config", dask.config.merge(dask.config.config, WORKER_CONFIG))  # a Nanny's config replaces the whole
    if tls_configured() and "security" not in kwargs:
        from distributed.security import Security

        kwargs.update(security=Security(), protocol="tls://")
    with dask.config.set(SERVICE_CONFIG):
        return LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=kwargs.pop("dashboard_address", ":0"),
            **kwargs,
        )


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
    with dask.config.set(SERVICE_CONFIG):
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
