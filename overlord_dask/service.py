"""The service: start, attach to, inspect and stop a data-loading run.

Python face for launchers, scripts and notebooks::

    from overlord_dask import Service, load_plan

    with Service.start(load_plan("pipelines/demo.yaml")) as service:   # embedded LocalCluster
        print(service.address)          # give this to the trainers (OverlordDataset(address, rank))
        service.wait_for_step(100)      # or run your own supervision loop
        print(service.metrics()[-1])

``Service.start`` indexes every source first (so a missing file or column fails here, naming it),
then registers the planner plugin on the scheduler and starts the driver loop. It owns the
cluster only when it created it. The scheduler lives in the service's process: run it as a
long-lived job, not inside a trainer rank.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from distributed import Client

from .batch_server import BatchServer
from .driver import Driver
from .errors import ServiceError
from .plan.loading import plan_to_dict
from .plan.models import Plan
from .planner.plugin import HANDLERS, PlannerPlugin
from .sources import discover_units
from .sources.fs import resolve_url
from .sources.units import LoadUnit


def index_sources(plan: Plan) -> dict[str, list[LoadUnit]]:
    """Discover every source's load units (metadata only), in parallel; errors name the source."""
    with ThreadPoolExecutor(max_workers=min(8, len(plan.sources))) as pool:
        futs = {s.name: pool.submit(discover_units, s, plan) for s in plan.sources}
        return {name: f.result() for name, f in futs.items()}


def _detach_planner(dask_scheduler) -> None:
    """Remove the planner and its routes, so the scheduler can host another run (or none)."""
    dask_scheduler.plugins.pop(PlannerPlugin.name, None)
    for name in HANDLERS:
        dask_scheduler.handlers.pop(name, None)


class Service:
    def __init__(self, plan: Plan, client: Client, driver: Driver, run_id: str, units: dict[str, list[LoadUnit]], cluster=None):
        self.plan = plan
        self.client = client
        self.driver = driver
        self.run_id = run_id
        self.units = units
        self.cluster = cluster
        self.started_at = time.time()

    # ---- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        plan: Plan,
        *,
        cluster=None,
        address: str | None = None,
        n_workers: int = 2,
        threads_per_worker: int = 1,
        run_id: str | None = None,
    ) -> "Service":
        """Start a run on ``cluster`` (any Dask cluster object), on a running scheduler at
        ``address``, or (default) on a new LocalCluster of ``n_workers`` worker processes."""
        units = index_sources(plan)
        owned = None
        if cluster is None and address is None:
            from .deploy import local_cluster  # the embedded default deployment

            cluster = owned = local_cluster(n_workers=n_workers, threads_per_worker=threads_per_worker)
        client = Client(cluster if address is None else address, set_as_default=False)
        run_id = run_id or f"{plan.name}-{uuid.uuid4().hex[:8]}"
        plan_dict = plan_to_dict(plan)
        first_ids = {name: [u.first_id for u in us] for name, us in units.items()}
        snap = {}
        ck = plan.checkpoint
        if ck.url:
            from .snapshots import SnapshotStore

            url = resolve_url(ck.url, plan.base_dir)
            snap = {"checkpoint_url": url, "storage_options": ck.storage_options, "keep_bases": ck.keep_bases}
            loaded = SnapshotStore(url, ck.storage_options).load() if ck.resume else None
            if loaded is not None:
                snap["restore"], snap["restore_seq"] = loaded
        try:
            client.register_plugin(BatchServer())
            client.register_plugin(PlannerPlugin(plan_dict, first_ids, run_id, **snap))
            driver = Driver(client, plan, plan_dict, run_id, units)
            driver.start()
        except BaseException:
            client.close()
            if owned is not None:
                owned.close()
            raise
        return cls(plan, client, driver, run_id, units, cluster=owned)

    def close(self) -> None:
        self.driver.stop()
        self.driver.join(timeout=10)
        try:
            self.client.run_on_scheduler(_detach_planner)
        except Exception:  # the scheduler may already be gone
            pass
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inspection ---------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Scheduler address for trainers: ``OverlordDataset(service.address, rank=r)``."""
        return self.client.scheduler.address

    def _rpc(self, name: str, **kwargs):
        return self.client.sync(getattr(self.client.scheduler, name), **kwargs)

    def status(self) -> dict:
        st = self._rpc("overlord_status")
        if self.driver.error and not st.get("failure"):
            st["failure"] = self.driver.error
        return st

    def check(self) -> None:
        """Raise ServiceError if the run has failed."""
        failure = self.status().get("failure")
        if failure:
            raise ServiceError(failure)

    def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        """Per planned step: tokens, fill, imbalance (step and micro-batch level), tokens per source."""
        return self._rpc("overlord_metrics", start=start, stop=stop)

    def ledger(self, start: int = 0, stop: int | None = None) -> dict[int, dict[str, np.ndarray]]:
        """What was planned per step: pieces ``[source, epoch, unit, doc, start, stop]``, their
        ``(rank, micro_batch)`` slots and source-wide sample ids, and the documents a ``drop``
        policy skipped while planning it (``[source, epoch, sample id, tokens]``)."""
        out = {}
        for e in self._rpc("overlord_ledger", start=start, stop=stop):
            out[e["step"]] = {
                "pieces": np.frombuffer(e["pieces"], dtype=np.int64).reshape(-1, 6),
                "slot": np.frombuffer(e["slot"], dtype=np.int32).reshape(-1, 2),
                "sample_ids": np.frombuffer(e["sample_ids"], dtype=np.int64),
                "dropped": np.frombuffer(e["dropped"], dtype=np.int64).reshape(-1, 4),
            }
        return out

    def snapshots(self) -> list[dict]:
        """Snapshots written by this service: kind (base/delta), bytes, seconds, committed step."""
        return self._rpc("overlord_snapshots")

    def wait_for_step(self, committed: int, timeout: float = 600.0, poll: float = 0.05) -> dict:
        """Block until ``committed`` steps are acknowledged by every rank (or the run fails)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st.get("failure"):
                raise ServiceError(st["failure"])
            if st["committed"] >= committed:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {st['committed']} of {committed} steps committed after {timeout}s: {st}")
            time.sleep(poll)
