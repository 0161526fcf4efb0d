"""Per-source worker pools on a Dask cluster: naming, pinning and resizing.

A pool is a set of workers that carry the Dask resource ``overlord-pool-<name>`` (one unit per
thread). A source's load tasks ask for one unit of its pool's resource, so they run only there,
and a worker that replaces a lost one joins the pool by its resource, not its address. Constructor
tasks ask for nothing: Dask runs them where their blocks are (any pool, or the shared workers).

Resizing works on any ``SpecCluster`` (``LocalCluster``, dask-jobqueue's ``SLURMCluster``): a
pool's workers are ``worker_spec`` entries named ``overlord-pool-<name>-<k>`` built from the
cluster's own template (``new_spec``) with the pool's cores, memory and resource; the cluster's
other entries (the shared workers) are left alone. On Slurm each pool worker is a job of its own
(``--resources`` on the worker command line), so pools scale by jobs.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass

from distributed.deploy import SpecCluster

from ..plan import Plan, Pool

PREFIX = "overlord-pool-"


def pool_resource(pool: str) -> str:
    """The Dask worker resource that pins a pool's load tasks."""
    return f"{PREFIX}{pool}"


def uses_pools(plan: Plan) -> bool:
    """Whether load tasks are pinned to pools: any source declares one, or autoscaling is on."""
    return plan.loading.autoscale.enabled or any(s.pool is not None for s in plan.sources)


@dataclass(frozen=True)
class PoolSpec:
    """What a pool is made of and its bounds, merged over the sources that name it."""

    name: str
    sources: tuple[str, ...]
    cores: int = 1
    memory: str = "auto"
    fixed: int | None = None  # a declared size (no autoscaling)
    min_workers: int = 1
    max_workers: int | None = None

    def clamp(self, n: int) -> int:
        if self.fixed is not None:
            return self.fixed
        n = max(self.min_workers, n)
        return n if self.max_workers is None else min(self.max_workers, n)


def plan_pools(plan: Plan) -> dict[str, PoolSpec]:
    """The pools a plan's sources load on (empty when the plan does not pin loads to pools)."""
    if not uses_pools(plan):
        return {}
    members: dict[str, list[str]] = {}
    decl: dict[str, Pool] = {}
    for s in plan.sources:
        members.setdefault(s.pool_name, []).append(s.name)
        if s.pool is not None:
            decl[s.pool_name] = s.pool
    out = {}
    for name, sources in members.items():
        p = decl.get(name) or Pool()
        out[name] = PoolSpec(name, tuple(sources), p.cores, p.memory, p.workers, p.min_workers, p.max_workers)
    return out


def pool_of(worker_name) -> str | None:
    """The pool a worker (spec) name belongs to, or None for a shared worker."""
    name = str(worker_name)
    if not name.startswith(PREFIX):
        return None
    return name[len(PREFIX) :].rsplit("-", 1)[0]


def pool_sizes(cluster) -> dict[str, list[str]]:
    """Worker spec names per pool, as the cluster has them now (requested, arrived or not)."""
    out: dict[str, list[str]] = {}
    for name in cluster.worker_spec:
        p = pool_of(name)
        if p is not None:
            out.setdefault(p, []).append(name)
    return out


def worker_spec(cluster, pool: PoolSpec) -> dict:
    """A ``worker_spec`` entry for one worker of ``pool``, from the cluster's own template."""
    template = copy.deepcopy(cluster.new_spec)
    opts = template.setdefault("options", {})
    res = f"{pool_resource(pool.name)}={pool.cores}"
    if "nthreads" in opts or "resources" in opts or "worker_extra_args" not in opts:  # a Nanny/Worker (LocalCluster)
        opts["nthreads"] = pool.cores
        opts["resources"] = {**(opts.get("resources") or {}), pool_resource(pool.name): pool.cores}
        if pool.memory != "auto":
            opts["memory_limit"] = pool.memory
    else:  # a dask-jobqueue Job: one job per pool worker, the resource on the worker command line
        opts["cores"] = pool.cores
        opts["processes"] = 1
        if pool.memory != "auto":
            opts["memory"] = pool.memory
        opts["worker_extra_args"] = [*opts.get("worker_extra_args", []), "--resources", res]
    return template


_counter = itertools.count()


def worker_name(pool: str) -> str:
    """A new worker (spec) name in ``pool`` (:func:`pool_of` reads the pool back from it)."""
    return f"{PREFIX}{pool}-{next(_counter)}"


def grow(cluster, pool: PoolSpec, n: int) -> list[str]:
    """Add ``n`` workers to ``pool``; returns their names (they start when the cluster corrects
    its state, see :func:`apply`)."""
    names = []
    for _ in range(n):
        name = worker_name(pool.name)
        cluster.worker_spec[name] = worker_spec(cluster, pool)
        names.append(name)
    return names


def start_workers(cluster) -> None:
    """Start and stop workers until the cluster matches its ``worker_spec``, in the background:
    ``SpecCluster.scale`` to the spec's own size changes no entry and does just that (called
    on the base class, so a dask-jobqueue cluster's ``scale`` counts jobs as we do)."""
    SpecCluster.scale(cluster, len(cluster.worker_spec))


def apply(cluster, timeout: float = 120.0) -> None:
    """The same, waiting until every worker in the spec is started (processes, or jobs
    submitted) and every worker removed from it is gone."""
    start_workers(cluster)
    deadline = time.monotonic() + timeout
    while set(cluster.workers) != set(cluster.worker_spec):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the cluster did not reach its worker spec within {timeout:.0f}s: "
                f"started {sorted(cluster.workers)}, wanted {sorted(cluster.worker_spec)}"
            )
        time.sleep(0.05)


def set_sizes(cluster, pools: dict[str, PoolSpec], sizes: dict[str, int]) -> None:
    """Resize pools to ``sizes`` now (the service's start: fixed pools and the autoscaler's
    minimums); shrinking drops the newest workers first."""
    have = pool_sizes(cluster)
    for name, n in sizes.items():
        cur = have.get(name, [])
        if n > len(cur):
            grow(cluster, pools[name], n - len(cur))
        for w in cur[n:] if n < len(cur) else []:
            del cluster.worker_spec[w]
    apply(cluster)
