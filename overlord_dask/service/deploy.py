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

Worker processes import the loaders as they start (Dask's worker ``preload``, ``WORKER_PRELOAD``):
a worker's first load task would otherwise import them, and the first batch of a run that has
just started waits for that.

Each is a default only: a value other than Dask's default in Dask's config (YAML, ``DASK_*``
environment variables, ``dask.config.set``) wins, and ``overlord.quiet-dask: false`` (e.g.
``DASK_OVERLORD__QUIET_DASK=false``) keeps all of Dask's defaults, the profiler included.
"""

from __future__ import annotations

import time

import dask
from dask.utils import parse_timedelta
from distributed import Client, LocalCluster

from ..allocator import service_environ
from ..protocol import Route
from .priority import WorkerPriority
from .priority import worker_nice as worker_nice_default

WORKER_CONNECT_TIMEOUT = "10s"
WORKER_PRELOAD = "overlord_dask.worker.loaders"
"""Imported by every worker process as it starts (the loaders, the source readers and the plan
models): before the service hands out its first batch, not while a trainer waits for it."""
WORKER_CONFIG = {"distributed": {"comm": {"timeouts": {"connect": WORKER_CONNECT_TIMEOUT}}}}
"""Set on every worker (``Nanny(config=...)``, pool workers too): a worker fetching a block from a
peer that just died retries the refused connection this long, not Dask's 30 s."""

QUIET_DEFAULTS = {
    "distributed.worker.profile.enabled": False,  # no 100 Hz stack sampling of every worker
    # Dask's loop-health tick (the service measures its own: scheduler/watchdog.py), in the
    # scheduler, each nanny and each worker: each tick wakes an idle loop, whose wake-ups are
    # most of its CPU. Its "unresponsive" log line still comes for a block of over 2.5 s.
    "distributed.admin.tick.interval": "500ms",
    # the dashboard's per-process time series (psutil reads of /proc)
    "distributed.admin.system-monitor.interval": "2s",
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
    return {
        key: ours
        for key, ours in QUIET_DEFAULTS.items()
        if dask.config.get(key, None) == dask.config.get(key, None, config=dask_defaults)
    }


PAGE_ROUTES = "overlord_dask.observe.http"  # /overlord and /overlord.json on the dashboard server


def service_config() -> dict:
    """Config for the service's own process (scheduler, nannies): ``SERVICE_CONFIG``, the quiet
    defaults, and the Overlord page among the scheduler's HTTP routes."""
    routes = list(dask.config.get("distributed.scheduler.http.routes", []))
    return {
        **quiet_defaults(),
        **SERVICE_CONFIG,
        "distributed.scheduler.http.routes": routes + ([PAGE_ROUTES] if PAGE_ROUTES not in routes else []),
    }


def worker_config() -> dict:
    """The whole config a worker process of the embedded cluster gets (a Nanny's ``config``
    replaces the worker's instead of adding to it): the user's, ``WORKER_CONFIG`` and the quiet defaults."""
    with dask.config.set(quiet_defaults()):
        return dask.config.merge(dask.config.config, WORKER_CONFIG)


def tls_configured() -> bool:
    """Whether Dask's config (``distributed.comm.tls.*``, e.g. from ``DASK_DISTRIBUTED__COMM__TLS__*``
    environment variables) holds certificates: then every connection of the service is TLS."""
    return bool(
        dask.config.get("distributed.comm.tls.ca-file", None)
        or dask.config.get("distributed.comm.require-encryption", None)
    )


def local_cluster(
    n_workers: int = 2,
    threads_per_worker: int = 1,
    memory_limit: str | int = "auto",
    worker_nice: int | None = None,
    processes: bool = True,
    **kwargs,
) -> LocalCluster:
    """A LocalCluster of worker processes with the service's settings; TLS for every connection
    when Dask's config holds certificates (the scheduler listens on loopback unless ``host`` is
    given). Its workers, new ones included, run at ``worker_nice`` (default ``overlord.worker-nice``,
    5: ``priority.py``) so that they leave the cores to the scheduler and the trainers first.

    ``processes=False`` runs the loaders as threads of this process (the scheduler's, where the
    planner runs too): one process instead of ``1 + n_workers``, each of which holds its own
    Python, Dask and Arrow (the fixed cost that decides a single node's loading memory). They
    are one worker of ``n_workers × threads_per_worker`` threads, not ``n_workers`` workers:
    workers of one process would copy each block a constructor reads from another, and the
    planner's shadows (copies kept for a worker that dies) would die with the same process.
    Dask's own Bokeh pages are left out unless ``dashboard=True`` (they load Bokeh; the
    ``/overlord`` page and Dask's JSON and Prometheus routes are served either way). The loaders
    share this process's GIL with the scheduler; reading Parquet and Arrow, the byte tokenizer
    and Hugging Face's fast tokenizers release it, a Python tokenizer or ``prepare`` step does
    not. Trainers still connect over TCP, and no priority is lowered (it would lower the
    scheduler's)."""
    if processes:
        kwargs.setdefault("config", worker_config())
        kwargs.setdefault("env", service_environ())  # the workers' allocators from their start (allocator.py)
        kwargs.setdefault("preload", [WORKER_PRELOAD])
    else:
        n_workers, threads_per_worker = min(n_workers, 1), max(1, n_workers * threads_per_worker)
        kwargs["scheduler_kwargs"] = {"dashboard": kwargs.pop("dashboard", False), **kwargs.get("scheduler_kwargs", {})}
    kwargs["scheduler_kwargs"] = {"preload": [__name__], **kwargs.get("scheduler_kwargs", {})}
    if tls_configured() and "security" not in kwargs:
        from distributed.security import Security

        kwargs.update(security=Security(), protocol="tls://")
    # (workers that are threads of this process read this process's config: WORKER_CONFIG's setting)
    in_process = {} if processes else {**quiet_defaults(), "distributed.comm.timeouts.connect": WORKER_CONNECT_TIMEOUT}
    with dask.config.set({**service_config(), **in_process}):  # (worker threads read it as they start)
        if not processes:
            kwargs.setdefault("protocol", "tcp://")  # not Dask's in-process transport: trainers connect from outside
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=processes,
            memory_limit=memory_limit,
            dashboard_address=kwargs.pop("dashboard_address", ":0"),
            **kwargs,
        )
    nice = worker_nice_default() if worker_nice is None else worker_nice
    if nice > 0 and processes:
        try:
            with Client(cluster, set_as_default=False) as client:
                client.register_plugin(WorkerPriority(nice))  # kept by the scheduler for workers that join later
        except BaseException:
            cluster.close()
            raise
    return cluster


def dask_setup(scheduler) -> None:
    """(Dask preload of the embedded scheduler, run as it starts) Trainers that look for a
    service still starting (a restart at the same address) are told "no planner yet" and try
    again, instead of the scheduler logging a KeyError traceback for every try; the plugin's
    routes replace these once the run starts."""
    scheduler.handlers.setdefault(Route.INFO, _no_planner_yet)


def _no_planner_yet(*args, **kwargs) -> None:
    return None


def slurm_cluster(
    *,
    cores: int = 8,
    memory: str = "32GB",
    queue: str | None = None,
    account: str | None = None,
    walltime: str = "04:00:00",
    processes: int = 1,
    python: str | None = None,
    lifetime: str | None = None,
    lifetime_stagger: str | None = None,
    replace_jobs: bool = True,
    **kwargs,
):
    """A dask-jobqueue ``SLURMCluster`` whose jobs start overlord-dask loader workers.

    The scheduler runs in this process (the service); scale with ``cluster.scale(jobs=n)`` (pools
    the plan declares get jobs of their own). A worker leaves before Slurm ends its job: after
    ``lifetime`` (default: the ``walltime`` less a tenth, at least 5 minutes), staggered by up to
    ``lifetime_stagger`` (default a tenth of the lifetime, at most 10 minutes) so that the jobs do
    not all end at once, handing its loaded blocks and built batches to the other workers as it
    goes. With ``replace_jobs`` a job that ended (its lifetime, the walltime, preemption, a
    node failure) is replaced: the cluster is brought back to its jobs every few seconds
    (dask-jobqueue itself replaces ended jobs only in adaptive mode).
    """
    from dask_jobqueue import SLURMCluster  # optional dependency: pip install overlord-dask[slurm]

    wall = _seconds(walltime)
    life = parse_timedelta(lifetime) if lifetime else max(60.0, wall - max(300.0, 0.1 * wall))
    if life >= wall:
        raise ValueError(f"a worker's lifetime ({life:g}s) must end before its job's walltime ({walltime})")
    stagger = parse_timedelta(lifetime_stagger) if lifetime_stagger else min(600.0, 0.1 * life)
    extra = list(kwargs.pop("worker_extra_args", []))
    extra += ["--lifetime", f"{life:g}s", "--lifetime-stagger", f"{stagger:g}s", "--preload", WORKER_PRELOAD]
    with dask.config.set(service_config()):
        cluster = SLURMCluster(
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
    if replace_jobs:
        keep_jobs(cluster, life, stagger)
    return cluster


KEEP_EVERY_S = 1.0


def keep_jobs(cluster, lifetime: float | None = None, stagger: float = 0.0, every_s: float = KEEP_EVERY_S) -> None:
    """Replace the cluster's jobs as their workers leave, checked every ``every_s`` seconds.

    A worker is given a successor job (under a new name, in the same pool) ``lead`` seconds
    before its ``lifetime`` can end at the earliest, so the successor has started by the time the
    old worker drains (hands its data to the others) and leaves: the run never goes without its
    workers. A worker that vanishes without warning (preemption, a node failure) is replaced as
    soon as the scheduler has lost it. Stopped with the cluster."""
    import asyncio
    import copy

    from tornado.ioloop import PeriodicCallback

    from ..loading.pools import start_workers

    lead = min(60.0, max(5.0, 0.02 * lifetime)) if lifetime else 0.0
    due_at = None if lifetime is None else max(0.0, lifetime - stagger - lead)  # age at which a successor starts
    first_seen: dict = {}  # spec name -> when its worker was first up (a job not started yet is not lost)
    succeeded: set = set()

    def keep():
        if cluster.status.name != "running":
            return
        now = time.monotonic()
        live = {w["name"]: w.get("status") for w in cluster.scheduler_info.get("workers", {}).values()}
        for n in live:
            if n in cluster.worker_spec:
                first_seen.setdefault(n, now)
        changed = False
        for name in [n for n in list(cluster.worker_spec) if n in first_seen]:
            status = live.get(name)
            gone = status is None
            leaving = gone or status in ("closing_gracefully", "closing", "closed")
            if name not in succeeded and (leaving or (due_at is not None and now - first_seen[name] >= due_at)):
                cluster.worker_spec[_successor(name)] = copy.deepcopy(cluster.worker_spec[name])
                succeeded.add(name)
                changed = True
            if gone:  # its job ended: the entry goes, and the job object at once
                cluster.worker_spec.pop(name, None)
                first_seen.pop(name, None)
                job = cluster.workers.pop(name, None)
                if job is not None:
                    asyncio.ensure_future(job.close())
                changed = True
        if changed or set(cluster.worker_spec) - set(cluster.workers):
            start_workers(cluster)

    pc = PeriodicCallback(keep, every_s * 1000)
    cluster.periodic_callbacks["overlord-keep-jobs"] = pc
    cluster.loop.add_callback(pc.start)


def _successor(name) -> str:
    """A new worker name for the job replacing ``name``: in its pool for a pool worker."""
    from ..loading.pools import pool_of, worker_name

    pool = pool_of(name)
    if pool is not None:
        return worker_name(pool)
    base, _, n = str(name).rpartition("-r")
    return f"{base}-r{int(n) + 1}" if base and n.isdigit() else f"{name}-r1"


def _seconds(walltime: str) -> float:
    """Slurm's ``[days-]hours:minutes:seconds`` (or minutes, or minutes:seconds) in seconds."""
    days, _, rest = walltime.rpartition("-")
    parts = [float(x) for x in rest.split(":")]
    if len(parts) == 1:
        secs = parts[0] * 60
    elif len(parts) == 2:
        secs = parts[0] * 60 + parts[1]
    else:
        secs = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return secs + (float(days) * 86400 if days else 0.0)
