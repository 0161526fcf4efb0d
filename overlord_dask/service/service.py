"""The service: start, attach to, inspect and stop a data-loading run.

Python face for launchers, scripts and notebooks::

    from overlord_dask import Service, load_plan

    with Service.start(load_plan("pipelines/demo.yaml")) as service:   # embedded LocalCluster
        print(service.address)          # give this to the trainers (OverlordDataset(address, rank))
        service.wait_for_step(100)      # or run your own supervision loop
        print(service.metrics()[-1])

``Service.start`` indexes every source first (so a missing file or column fails here, naming it),
then registers the planner plugin on the scheduler and starts the submitter. It owns the
cluster only when it created it. The scheduler lives in the service's process: run it as a
long-lived job, not inside a trainer rank. A notebook or script elsewhere attaches to the running
service with ``Service.attach(address)`` to inspect it or change its plan::

    service.update_plan(load_plan("pipelines/curriculum.yaml"), at_step=5000)
"""

from __future__ import annotations

import logging
import os
import time
import uuid

from distributed import Client

from .. import logs
from ..client import BlockingPlannerClient
from ..errors import PlanError, ServiceError
from ..loading.pools import plan_pools, pool_resource, pool_sizes, set_sizes
from ..plan import Plan
from ..plan.base import resolve_url
from ..plan.code import changed, identities
from ..plan.io import plan_from_dict, plan_to_dict
from ..plan.versions import PlanVersions, decode_updates
from ..planner.timeline import Decision, Timeline
from ..protocol import resolve_address
from ..scheduler.plugin import PlannerPlugin
from ..sources.units import LoadUnit
from ..worker.allocator_setup import AllocatorSetup, tune_service_process
from ..worker.batch_server import BatchServer
from ..worker.log_setup import LogSetup
from . import holdout
from .indexing import index_sources, index_timeline
from .manifest import check_files, with_digests
from .preflight import preflight
from .submitter import Submitter
from .views import ServiceViews


def _embedded_cluster(
    n_workers: int, threads_per_worker: int, port: int, host: str | None, dashboard_port: int, in_process: bool
):
    """The default deployment: a LocalCluster whose scheduler and dashboard listen on ``host``
    (default: loopback only); its workers are threads of this process with ``in_process``."""
    from .deploy import local_cluster

    if in_process:  # the workers' threads are this process's: its allocators before they start
        tune_service_process()
    extra = {"host": host} if host else {}
    return local_cluster(
        n_workers=n_workers,
        threads_per_worker=threads_per_worker,
        processes=not in_process,
        scheduler_port=port,
        dashboard_address=f"{host or '127.0.0.1'}:{dashboard_port}",
        **extra,
    )


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # "<string>", a file gone since
        return False


def _check_main_guard() -> None:
    """Worker processes start by importing the main script again (Dask spawns them): a script
    that starts a service at module level, outside ``if __name__ == "__main__":``, would start
    one in every worker too, and Dask then only says "Nanny failed to start". Say what to do."""
    import ast
    import inspect

    import dask

    import __main__

    path = getattr(__main__, "__file__", None)
    if dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork" or not path:
        return  # forked workers, or an interactive session / notebook: nothing is imported again
    line = next(
        (
            f.lineno
            for f in inspect.stack(context=0)
            if f.function == "<module>"
            and f.frame.f_globals.get("__name__") == "__main__"
            and _same_file(f.filename, path)
        ),  # (a child that multiprocessing spawned runs its own `-c` code as __main__: the script's lines are not it)
        None,
    )
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return
    for stmt in tree.body:
        if line is not None and stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            if _is_main_guard(stmt):
                return
            raise ServiceError(
                f"{path}:{line} starts a service at module level: Dask starts its worker processes by importing "
                'this script again, so put the code that starts the service under `if __name__ == "__main__":` '
                "(as in the README's examples)"
            )


def _is_main_guard(stmt) -> bool:
    import ast

    if not isinstance(stmt, ast.If) or not isinstance(stmt.test, ast.Compare):
        return False
    names = [stmt.test.left, *stmt.test.comparators]
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
        isinstance(n, ast.Constant) and n.value == "__main__" for n in names
    )


def _start_pools(plan: Plan, cluster):
    """Give each pool its starting workers (a fixed size, or the autoscaler's minimum) on
    ``cluster``; returns the cluster when the service sizes pools on it, else None."""
    pools = plan_pools(plan)
    if not pools:
        return None
    if cluster is None or not hasattr(cluster, "worker_spec"):
        if plan.loading.autoscale.enabled:
            raise ServiceError(
                "loading.autoscale needs a cluster object that can add workers (Service.start(plan, cluster=...), "
                "a LocalCluster or SLURMCluster); with only a scheduler address, start each pool's workers "
                f"yourself: dask worker ADDRESS --resources {pool_resource('<pool>')}=<threads> (pools: "
                f"{sorted(pools)})"
            )
        return None  # fixed pools on someone else's workers: they carry the resources themselves
    set_sizes(cluster, pools, {name: spec.clamp(0) for name, spec in pools.items()})
    return cluster


async def _detach_planner(dask_scheduler) -> None:
    """Stop the planner (last snapshot written) and remove it with its routes and queues, so the
    scheduler can host another run (or none)."""
    plugin = dask_scheduler.plugins.pop(PlannerPlugin.name, None)
    if plugin is not None:
        await plugin.stop()


def _snapshots(plan: Plan) -> tuple[tuple | None, dict]:
    """The snapshot to resume from (``(state, seq)``, if the plan resumes and one exists) and the
    planner plugin's arguments that restore it. An unreachable or read-only location fails here,
    naming it, not later in a log."""
    ck = plan.checkpoint
    if not ck.url:
        return None, {}
    from ..snapshots import SnapshotStore

    url = resolve_url(ck.url, plan.base_dir)
    store = SnapshotStore(url, ck.storage_options)
    store.check_writable()
    loaded = store.load() if ck.resume else None
    snap = {}
    if loaded is not None:
        snap["restore"], snap["restore_seq"] = loaded
    return loaded, snap


def _check_code(plan: Plan, timeline: PlanVersions, state: dict) -> bool:
    """Refuse (or, with ``checkpoint.on_code_change: accept``, log and return True) a resume
    whose prepare or transform functions changed since the snapshot (``plan/code.py``)."""
    now = identities(timeline.source(n) for n in timeline.source_names)
    diff = changed(state.get("code") or {}, now)
    if not diff:
        return False
    step = state.get("committed")
    if plan.checkpoint.on_code_change == "refuse":
        raise PlanError(
            f"the code of {', '.join(diff)} changed since the snapshot of step {step}: resuming would yield other "
            "documents "
            "from there on than the run delivered before. Restore the function, start a new run (a new checkpoint "
            "url), "
            "or set checkpoint.on_code_change: accept"
        )
    logs.event("code_changed", plan.name, step, functions=";".join(diff))
    logging.getLogger(__name__).warning(
        "resuming at step %s with changed code: %s (checkpoint.on_code_change: accept)", step, ", ".join(diff)
    )
    return True


class Service(ServiceViews):
    """A running overlord service: start, attach, update, inspect (``views.ServiceViews``), stop."""

    def __init__(
        self,
        plan: Plan,
        client: Client,
        submitter: Submitter | None,
        run_id: str,
        units: dict[str, list[LoadUnit]],
        cluster=None,
        pooled=None,
        adaptive=None,
    ):
        self.plan = plan
        self.client = client
        self.planner = BlockingPlannerClient(client)
        self.submitter = submitter
        self.run_id = run_id
        self.units = units
        self.cluster = cluster  # owned (created here): closed with the service
        self.pooled = pooled  # the cluster object whose pools this service sizes (owned or not), if any
        self.adaptive = adaptive
        self.started_at = time.time()
        self._explainer = None  # (explain: the run's units, indexed on first use)

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
        scheduler_port: int = 0,
        host: str | None = None,
        dashboard_port: int = 0,
        in_process: bool = False,
    ) -> Service:
        """Start a run on ``cluster`` (any Dask cluster object), on a running scheduler at
        ``address``, or (default) on a new LocalCluster of ``n_workers`` worker processes (threads
        of this process with ``in_process``: ``deploy.local_cluster``), its scheduler on ``host``
        (default: loopback only) and ``scheduler_port``: fixed, a restarted service is found again
        by trainers; its dashboard, with the ``/overlord`` page, on ``dashboard_port``: 0 picks a
        free one, :attr:`dashboard` says which."""
        if (embedded := cluster is None and address is None) and not in_process:
            _check_main_guard()  # before anything else: the worker processes would run this script again
        loaded, snap = _snapshots(plan)
        # every plan version in the snapshot (live updates before a restart), and their sources
        timeline = PlanVersions(plan, decode_updates(loaded[0].get("updates")) if loaded else [])
        accepted = bool(loaded) and _check_code(plan, timeline, loaded[0])
        indexed = index_timeline(timeline)  # a resume: the files the run first indexed (cheap identity)
        if check_files(timeline, indexed, bool(loaded)) or accepted:  # (changes accepted: a differing replay goes on)
            loaded[0]["accepted_change"] = True
        indexed = with_digests(timeline, indexed)  # loading.integrity: each unit's digest
        # held-out units never reach the planner; every micro-batch is padded with the tokenizer's pad id
        units, pad_id = preflight(plan, timeline, indexed)
        owned = None
        if embedded:
            cluster = owned = _embedded_cluster(
                n_workers, threads_per_worker, scheduler_port, host, dashboard_port, in_process
            )
        client = Client(cluster if address is None else address, set_as_default=False)
        run_id = run_id or f"{plan.name}-{uuid.uuid4().hex[:8]}"
        first_ids = {name: [u.first_id for u in us] for name, us in units.items()}
        adaptive, registered = None, False
        try:
            pooled = _start_pools(plan, cluster if address is None else None)
            upload_plan_code(client, plan)
            if logs.settings() is not None and not (embedded and in_process):  # workers log their events the same way
                client.register_plugin(LogSetup(**logs.settings()))
            client.register_plugin(AllocatorSetup())
            client.register_plugin(BatchServer())
            client.register_plugin(PlannerPlugin(plan, first_ids, run_id, pad_id=pad_id, **snap))
            registered = True
            if pooled is not None and plan.loading.autoscale.enabled:
                from ..loading.autoscale import PoolAdaptive

                adaptive = PoolAdaptive(pooled, plan_pools(plan), plan.loading.autoscale, run_id)
            submitter = Submitter(client, timeline, run_id, units, pad_id)
            submitter.submit_eval(
                holdout.held_out(plan.seed, timeline.source, indexed)
            )  # the evaluation batches, built once
            submitter.start()
        except BaseException:
            if adaptive is not None:
                adaptive.stop()
            if registered:  # the scheduler must not keep a planner nobody drives
                try:
                    client.run_on_scheduler(_detach_planner)
                except Exception:
                    pass
            client.close()
            if owned is not None:
                owned.close()
            raise
        return cls(plan, client, submitter, run_id, units, cluster=owned, pooled=pooled, adaptive=adaptive)

    @classmethod
    def attach(cls, address: str, timeout: float = 30.0) -> Service:
        """A handle on a service running elsewhere (another process or machine), by address or
        scheduler file: inspect it, update its plan, ask it to stop; ``close()`` only disconnects.
        Waits up to ``timeout`` seconds for the scheduler to answer."""
        try:
            address = resolve_address(address)
        except ValueError as err:
            raise ServiceError(str(err)) from None
        try:
            client = Client(address, set_as_default=False, timeout=timeout)
        except (OSError, TimeoutError) as err:
            raise ServiceError(
                f"no overlord service at {address}: nothing answered within {timeout:g}s (is the service running? a "
                f"scheduler file names the address of the last start) [{type(err).__name__}]"
            ) from None
        planner = BlockingPlannerClient(client)
        try:
            info = planner.info()
            plans = planner.plans() if isinstance(info, dict) else None
        except Exception as err:
            client.close()
            raise ServiceError(f"no overlord service at {address}: {err}") from None
        if not isinstance(info, dict) or not plans:  # a plain Dask scheduler answers None to unknown routes
            client.close()
            raise ServiceError(f"no overlord service at {address}: the scheduler there runs no overlord planner")
        plan = plan_from_dict(plans[0][1], where="<running plan>")
        return cls(plan, client, None, info["run_id"], {})

    def close(self) -> None:
        if self.submitter is None:  # attached: the service keeps running
            self.client.close()
            return
        if self.adaptive is not None:
            self.adaptive.stop()
            self.adaptive.wait_idle(timeout=5)  # a decision in flight still talks to the planner
        self.submitter.stop()
        self.submitter.join(timeout=10)
        try:
            self.client.run_on_scheduler(_detach_planner)
        except Exception:  # the scheduler may already be gone
            pass
        if (
            self.pooled is not None and self.cluster is None
        ):  # a cluster we were lent: give back the pool workers we added
            try:
                set_sizes(self.pooled, {}, dict.fromkeys(pool_sizes(self.pooled), 0))
            except Exception:  # the cluster is closing itself
                pass
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def address(self) -> str:
        """Scheduler address for trainers: ``OverlordDataset(service.address, rank=r)``."""
        return self.client.scheduler.address

    # ---- the plan ---------------------------------------------------------------------------------
    def timeline(self) -> Timeline:
        """Every plan version of the run, with the step each applies from, and the planner's own
        decisions (a learned cost model, a mixing controller's shares): with the plan, what a
        replay needs to deliver the identical stream (``PlannerState(plan, ..., updates=tl.updates,
        decisions=tl.decisions)``)."""
        got = self.planner.plans(decisions=True)
        plans = [(at, plan_from_dict(d, where=f"<plan version from step {at}>")) for at, d in got["versions"]]
        return Timeline(plans[0][1], plans[1:], [Decision.from_dict(d) for d in got["decisions"]])

    def update_plan(self, plan: Plan, at_step: int | None = None) -> int:
        """Run ``plan`` from ``at_step`` on (default: the first step not planned yet); returns that
        step. An update may change the sources (weights, schedules, new sources, sources left
        out, which pause and keep their position), the stages and the cost model; every other field must stay.
        Steps before ``at_step`` are not affected, and no sample of any source is repeated or
        skipped. With snapshots, the update is durable when this returns."""
        known = set(self.timeline().source_names)
        new = [s for s in plan.sources if s.name not in known]
        first_ids = {
            name: [u.first_id for u in us]
            for name, us in holdout.training(plan.seed, plan.source, index_sources(plan, new)).items()
        }
        resp = self.planner.update(plan_to_dict(plan), at_step, first_ids)
        if resp["error"]:
            raise PlanError(resp["error"])
        return resp["at_step"]

    def skip_steps(self, start: int, stop: int, reason: str = "") -> tuple[int, int]:
        """Do not hand out steps ``start..stop`` (inclusive), the remedy for a loss spike: the run goes back to
        ``start`` if it planned it already (attached streams end), the job restarts from its checkpoint at or
        before ``start`` and goes on at ``stop + 1`` with what that step would have carried. Recorded in the
        timeline (``timeline()``, snapshots, replays, ``explain``); durable on return where the run snapshots."""
        resp = self.planner.skip(int(start), int(stop), reason)
        if resp["error"]:
            raise PlanError(resp["error"])
        return tuple(resp["skip"])

    def explain(self, step: int, rank: int | None = None, *, preview: int = 160, tokens: bool = False) -> dict:
        """Which documents step ``step`` carried (``service/explain.py``): per piece its rank and
        micro-batch, source, file and where in it, sample id, token range, tokens and a text
        preview of ``preview`` characters; a skipped step says so. From the service's ledger while
        it keeps the step, else planned again from the plan, the timeline and the snapshots."""
        from .explain import Explainer, replayed_entry, window_start

        timeline = self.timeline()
        if self._explainer is None or self._explainer.timeline.versions != timeline.versions:
            known = self.units if self.units and set(self.units) >= set(timeline.source_names) else None
            self._explainer = Explainer(timeline.initial, timeline, known)
        self._explainer.timeline = timeline  # (decisions made since)
        entry = self.ledger(step, step + 1).get(step)
        if entry is None:
            entry = replayed_entry(self.plan, timeline, step, window_start(self.plan, step), self._explainer.units)
        return self._explainer.entry(step, entry, rank=rank, preview=preview, tokens=tokens)

    def status(self) -> dict:
        st = self.planner.status()
        if st is None:  # the scheduler answers, but its planner is gone (the run stopped)
            raise ServiceError(f"the overlord run {self.run_id} is no longer served at {self.address}: it stopped")
        if self.submitter is not None and self.submitter.error and not st.get("failure"):
            st["failure"] = self.submitter.error
        return st

    def request_stop(self) -> None:
        """Ask the process serving this run to stop cleanly (final snapshot, workers retired):
        ``overlord stop``. The serving process sees it in ``status()["stop_requested"]``."""
        self.planner.request_stop()

    def check(self) -> None:
        """Raise ServiceError if the run has failed."""
        failure = self.status().get("failure")
        if failure:
            raise ServiceError(failure)

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


def upload_plan_code(client, plan) -> None:
    """Send the plan's local code (``plan.code.local_code``) to the scheduler and every worker,
    present and future (Dask's ``upload_file``: a worker that joins later gets it too)."""
    import shutil
    import tempfile

    from ..plan.code import local_code

    for path in local_code(plan_to_dict(plan), plan.base_dir):
        if os.path.isdir(path):  # a package: as a zip of its folder, importable from the workers' sys.path
            staging = tempfile.mkdtemp(prefix="overlord-code-")
            path = shutil.make_archive(
                os.path.join(staging, os.path.basename(path)), "zip", os.path.dirname(path), os.path.basename(path)
            )
        client.upload_file(
            path, load=True
        )  # a zip goes onto sys.path only when loaded; a module is imported once, here
