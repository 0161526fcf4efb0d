"""The planner's routes on the scheduler: one table, name -> handler (:meth:`Routes.table`).

Names come from ``protocol.Route``; callers go through ``client.PlannerClient``. Request/response
unless noted:

- ``overlord_info()``: topology and names a consumer needs to attach.
- ``overlord_attach(rank, cp_rank, replica)``: a consumer joins; answers the first step it gets
  (the one after its last acknowledged step; a new replica starts where its rank is) and its
  new generation. Its subscription then starts with every built batch from that step on, so a
  trainer that restarted (or a second consumer after a first one died) loses and repeats
  nothing. Replicas (tensor- and pipeline-parallel ranks of one data-parallel rank) share the
  rank's stream.
- ``overlord_rewind(rank, cp_rank, replica, step, dp)``: a training job restarted from its
  checkpoint at ``step``, with ``dp`` data-parallel ranks: if the service has handed out past it
  for this rank, or runs another ``dp``, the planner is rebuilt to hand out ``step`` next for
  ``dp`` ranks (``planner/rewind.py``); every attached consumer's stream ends. Idempotent: the
  job's other ranks find it done. Refused, naming the oldest step it can serve, beyond the
  retention (``checkpoint.keep_steps``, ``keep_hours``).
- ``overlord_channel(channel_id, run_id)`` (a stream, one per consumer process and run): the
  consumer sends ``{"op": "subscribe"|"unsubscribe", rank, cp_rank, replica, generation}`` and
  one-way ``{"op": "ack", rank, step, cp_rank, replica, generation, durable, wait_s, since_s}``
  and ``{"op": "feedback", rank, cp_rank, replica, items}`` (step times and metrics: ``planner/feedback.py``);
  the scheduler pushes ``{"op": "descriptors", rank, cp_rank, replica, generation, items}`` as
  batches are built, ``{"op": "worker_lost", address}`` and ``{"op": "error", rank, cp_rank,
  replica, generation, message}`` (``rank`` None: every consumer of the channel). Both ways
  batched every few ms (``channels.py``).
- ``overlord_ack(rank, step, cp_rank, durable, wait_s, since_s, replica, generation)``: consumed
  every step up to ``step`` (and, with ``durable``, saved it in the trainer's checkpoint); the
  request/response form, for ``commit()`` and ``state_dict()``, which wait for it.
  ``wait_s``/``since_s``: the trainer's time in ``next()`` and its time since it attached. An ack
  of an attachment that is no longer the newest is refused.
- ``overlord_where(key, timeout, run_id)``: the workers holding a built batch (waits while it is
  rebuilt); ``other_run`` for a descriptor of a run this scheduler no longer serves.
- ``overlord_work(timeout)``: the submitter's long poll: loads and constructor tasks to submit,
  batches and blocks to release, failure, plan version, measured load costs.
- ``overlord_lengths`` (one-way, on a worker's stream): a load task's unit lengths and cost.
- ``overlord_update(plan, at_step, unit_first_ids)``: a live plan update (durable on return
  where the run snapshots).
- ``overlord_pools(lead_s, report)``: the autoscaler's inputs; with ``report`` its decisions.
- ``overlord_request_stop()``: ask the serving process to stop cleanly.
- ``overlord_fail(message)``: stop the run, telling every rank why.
- ``overlord_status``, ``overlord_metrics(start, stop)``, ``overlord_ledger(start, stop)``,
  ``overlord_plans(decisions)``, ``overlord_snapshots``, ``overlord_loop(reset)``: views.

Whatever reads the planner's state runs in the planner thread (``thread.run``), so a view is never
torn by a planning step; acks (a few list writes) stay on the event loop.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .. import logs
from .. import pieces as P
from ..errors import PlanError
from ..loading.signals import pool_signals
from ..plan.loading import plan_from_dict, plan_to_dict
from ..protocol import Route, eval_key
from .channels import Consumer, send
from .held import holders
from .replicas import ReplicaAcks
from .timings import Timings


class Routes:
    """The handlers, over the plugin's parts (``plugin.PlannerPlugin`` builds one per run)."""

    def __init__(self, plugin):
        self.p = plugin
        self.acks = 0
        self.replicas = ReplicaAcks()
        self.rank_wait: dict[
            tuple[int, int], tuple[float, float]
        ] = {}  # (rank, cp rank) -> (seconds waiting, seconds since it attached)
        self.timings = Timings()  # trainer wait and step time histograms (the metrics)
        self.scaling: dict | None = None  # the autoscaler's last decisions and history, as it reported them
        self.stop_requested = False
        self.first_step: dict[Consumer, int] = {}  # each attached consumer's first step (its backlog starts there)

    def table(self) -> dict:
        """Request/response routes (``scheduler.handlers``)."""
        return {
            Route.INFO: self.info,
            Route.ATTACH: self.attach,
            Route.REWIND: self.rewind,
            Route.CHANNEL: self.channel,
            Route.ACK: self.ack,
            Route.WHERE: self.where,
            Route.WORK: self.work,
            Route.UPDATE: self.update,
            Route.POOLS: self.pools,
            Route.REQUEST_STOP: self.request_stop,
            Route.FAIL: self.fail,
            Route.STATUS: self.status,
            Route.METRICS: self.metrics,
            Route.LEDGER: self.ledger,
            Route.PLANS: self.plans,
            Route.SNAPSHOTS: self.snapshots,
            Route.LOOP: self.loop,
            Route.EVAL: self.evaluation,
        }

    @property
    def state(self):
        return self.p.thread.state

    # ---- trainers ---------------------------------------------------------------------------------
    def info(self) -> dict:
        plan = self.state.final_plan
        t = plan.topology
        return {
            "run_id": self.p.run_id,
            "name": plan.name,
            "dp": t.dp,
            "cp": t.cp,
            "micro_batches": t.micro_batches,
            "tokens_per_micro_batch": t.tokens_per_micro_batch,
            "prefetch_steps": plan.loading.prefetch_steps,
            "chunk_steps": self.p.chunk_steps,
            "sources": list(self.state.source_names),
            "plan_version": self.state.plan_version,
            "commit": self.state.progress.commit_mode,
        }

    def attach(self, rank: int, cp_rank: int = 0, replica: int = 0) -> dict:
        """A consumer joins as (rank, cp rank, replica): it starts after its last acknowledged
        step (a new replica where its rank is), under a new generation."""
        st, topo = self.state, self.state.final_plan.topology
        if not 0 <= rank < topo.dp or not 0 <= cp_rank < topo.cp or replica < 0:
            return {"error": f"rank {rank} cp rank {cp_rank} does not exist: the plan has dp={topo.dp}, cp={topo.cp}"}
        i = rank * st.topology.cp + cp_rank
        rank_acked = st.progress.acked[i] if i < len(st.progress.acked) else -1
        rank_durable = st.progress.durable[i] if i < len(st.progress.durable) else -1
        consumer = (rank, cp_rank, replica)
        first = max(st.replay_until, self.replicas.attach(consumer, rank_acked, rank_durable) + 1)
        self.first_step[consumer] = first
        gen = self.p.channels.reattach(consumer)
        if gen > 1:  # a consumer came back (or another replaced it): it goes on from `first`
            logs.event("rank_rewind", self.p.run_id, first, rank=rank, cp_rank=cp_rank, replica=replica, generation=gen)
        return {"error": None, "first_step": first, "generation": gen}

    def backlog(self, consumer: Consumer) -> list[dict]:
        """What a newly subscribed consumer needs: every built batch of its rank from its first
        step on (and the run's failure, if it failed)."""
        rank, cp_rank, _ = consumer
        first = self.first_step.get(consumer, 0)
        out = [
            self.p.channels.descriptor(key, t)
            for key, t in self.p.held.tasks.items()
            if t["workers"] is not None and t["lo"] <= rank < t["hi"] and t["steps"][-1] >= first
        ]
        if self.state.failure:
            out.append({"error": self.state.failure})
        return out

    def leave(self, consumer: Consumer) -> None:
        """A consumer's process went away: it no longer holds its rank's other replicas back."""
        self.replicas.leave(consumer)

    async def rewind(self, rank: int, step: int, dp: int, cp_rank: int = 0, replica: int = 0) -> dict:
        """A training job restarted from its checkpoint at ``step`` with ``dp`` ranks."""
        return await self.p.rewind(rank, cp_rank, step, dp)

    async def channel(self, comm, channel_id: str, run_id: str, **_) -> None:
        """A consumer process's stream (one per process and run, shared by its ranks)."""
        if run_id != self.p.run_id:
            await comm.write(
                [
                    {
                        "op": "error",
                        "rank": None,
                        "message": f"this scheduler runs overlord run {self.p.run_id}, not {run_id}",
                    }
                ]
            )
            return
        await self.p.channels.serve(comm, channel_id, self._channel_ack, self.p.thread.feedback_in.put)

    def _channel_ack(
        self,
        bs,
        rank: int,
        step: int,
        cp_rank: int = 0,
        durable: bool = False,
        wait_s: float | None = None,
        since_s: float | None = None,
        replica: int = 0,
        generation: int | None = None,
        **_,
    ) -> None:
        resp = self.ack(rank, step, cp_rank, durable, wait_s, since_s, replica, generation)
        if resp["error"]:
            send(
                bs,
                {
                    "op": "error",
                    "rank": rank,
                    "cp_rank": cp_rank,
                    "replica": replica,
                    "generation": generation,
                    "message": resp["error"],
                },
            )

    def ack(
        self,
        rank: int,
        step: int,
        cp_rank: int = 0,
        durable: bool = False,
        wait_s: float | None = None,
        since_s: float | None = None,
        replica: int = 0,
        generation: int | None = None,
    ) -> dict:
        st = self.state
        self.acks += 1
        consumer = (rank, cp_rank, replica)
        if generation is not None and not self.p.channels.current(consumer, generation):
            return {
                "committed": st.committed,
                "error": f"rank {rank}: this consumer's attachment (generation {generation}) was "
                "replaced or the run was rewound; its acknowledgement is ignored",
            }
        if wait_s is not None and since_s:  # the trainer's own count: time in next(), and its time, since it attached
            self.rank_wait[(rank, cp_rank)] = (wait_s, since_s)
        before, before_durable = st.committed, st.progress.durable_step
        try:
            st.progress.check(rank, step, cp_rank, st.next_step)
            acked, saved = self.replicas.ack(consumer, step, durable)
            committed = st.ack(rank, acked, cp_rank)
            if saved >= 0:
                committed = st.ack(rank, saved, cp_rank, durable=True)
        except ValueError as err:
            return {"committed": st.committed, "error": str(err)}
        self.timings.acked(consumer, step, wait_s)
        if st.progress.durable_step > before_durable and self.p.snapshots_loop is not None:
            self.p.snapshots_loop.wake()
        if committed > before:
            self.timings.committed(committed)
            self.p.thread.release(self.p.held.release_before(committed))
        return {"committed": committed, "error": None}

    async def where(self, key: str, timeout: float = 5.0, run_id: str | None = None) -> dict:
        """Workers holding built batch ``key``. A descriptor of another run (a consumer that has
        not noticed the restart yet) gets ``other_run``: it reconnects instead of failing."""
        if run_id is not None and run_id != self.p.run_id:
            return {"error": None, "workers": [], "other_run": True}
        return await self.p.held.where(key, timeout)

    async def evaluation(self, timeout: float = 5.0) -> dict:
        """Where the run's evaluation batches are (waits up to ``timeout`` while they are built)."""
        if not any(self.state.timeline.source(n).holdout is not None for n in self.state.source_names):
            return {"error": "the plan holds out no evaluation data (set a source's holdout)", "workers": []}
        key, deadline = eval_key(self.p.run_id), time.monotonic() + timeout
        while (
            (ts := self.p.scheduler.tasks.get(key)) is None or ts.state not in ("memory", "erred")
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # submitted with the run's first tasks; built once its units are loaded
        if ts is None:
            return {"error": f"the evaluation batches were not submitted within {timeout:g}s", "workers": []}
        if ts.state == "erred":
            blame = ts.exception_blame or ts
            return {"error": f"building the evaluation batches failed: {blame.exception_text}", "workers": []}
        return {"error": None, "key": key, "run_id": self.p.run_id, "workers": holders(ts)}

    # ---- the submitter, the autoscaler, operators ------------------------------------------------------
    async def work(self, timeout: float = 1.0) -> dict:
        out = await self.p.thread.next_work(timeout)
        signals = self.p.signals
        out.update(
            failure=self.state.failure,
            plan_version=self.state.plan_version,
            load_costs={s: signals.seconds_per_doc(s) for s in signals.cost},
        )  # for auto-partitioning
        return out

    async def update(self, plan: dict, at_step: int | None = None, unit_first_ids: dict | None = None) -> dict:
        """Apply a live plan update; with snapshots, answer only once a base holding it is written
        (so an acknowledged update survives a crash)."""
        try:
            new = plan_from_dict(plan, where="<plan update>")
            at = await self.p.thread.run(self.state.update, new, at_step, unit_first_ids or {})
        except (PlanError, ValueError) as err:
            return {"error": str(err), "at_step": None, "version": self.state.plan_version}
        self.p.thread.wake()
        logs.event("plan_update", self.p.run_id, at, version=self.state.plan_version)
        if self.p.snapshots_loop is not None:
            await self.p.snapshots_loop.write(force=True)
        return {"error": None, "at_step": at, "version": self.state.plan_version}

    async def pools(self, lead_s: float = 10.0, report: dict | None = None) -> dict:
        """The autoscaler's inputs: per-source demand over the schedule ahead and measured costs;
        with ``report``, the autoscaler's latest decisions (kept for ``Service.pools()``)."""
        if report is not None:
            self.scaling = report
            self.state.pool_workers = dict(
                report.get("arrived") or {}
            )  # the planner records it with each step it plans
            return {}
        return {**await self.p.thread.run(pool_signals, self.state, self.p.signals, lead_s), "scaling": self.scaling}

    def request_stop(self) -> dict:
        """Ask the process that runs this service (``overlord serve``) to stop cleanly: it sees
        ``stop_requested`` in the status, writes the last snapshot and retires its workers."""
        self.stop_requested = True
        logs.event("stop_requested", self.p.run_id, self.state.committed)
        return {"stop_requested": True}

    def fail(self, message: str) -> None:
        self.p.fail(message)

    # ---- views -----------------------------------------------------------------------------------------
    async def status(self) -> dict:
        thread = self.p.thread
        st = await thread.run(
            lambda: {**self.state.status(), "feedback": thread.feedback_status()}
        )  # one hop to the planner thread
        snaps = self.p.snapshots_loop
        return {
            **st,
            **self.p.losses.status(),
            "loop": self.loop(),
            "chunk_steps": self.p.chunk_steps,
            **self.p.held.figures(),
            **self.p.held.block_figures(),
            "channels": len(self.p.channels.streams),
            "subscribed": sum(len(s) for s in self.p.channels.subs.values()),
            "snapshot_error": snaps.error if snaps is not None else None,
            "stop_requested": self.stop_requested,
            "rank_wait_share": self.wait_shares(),
            **self.counters(),
        }

    async def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return await self.p.thread.run(
            lambda: [m for s, m in self.state.metrics.items() if s >= start and (stop is None or s < stop)]
        )

    async def ledger(self, start: int = 0, stop: int | None = None) -> list[dict]:
        def entries() -> list[dict]:
            st, out = self.state, []
            for s, entry in st.ledger.items():
                if s >= start and (stop is None or s < stop):
                    p = entry["pieces"]
                    out.append(
                        {
                            "step": s,
                            "pieces": P.to_bytes(p),
                            "slot": entry["slot"].tobytes(),
                            "sample_ids": st.streams.sample_ids(p).tobytes(),
                            "dropped": st.streams.dropped_ids(entry["dropped"]).tobytes(),
                        }
                    )
            return out

        return await self.p.thread.run(entries)

    async def plans(self, decisions: bool = False) -> list | dict:
        """The plan versions ``[[at_step, plan], ...]``; with ``decisions``, ``{"versions", "decisions"}``."""

        def view():
            tl = self.state.timeline
            versions = [[at, plan_to_dict(p)] for at, p in tl.versions]
            return {"versions": versions, "decisions": [d.to_dict() for d in tl.decisions]} if decisions else versions

        return await self.p.thread.run(view)

    def snapshots(self) -> list[dict]:
        return list(self.p.snapshots_loop.stats) if self.p.snapshots_loop is not None else []

    def loop(self, reset: bool = False) -> dict:
        """How late the scheduler's event loop woke up (``watchdog.py``)."""
        return self.p.watch.figures(reset)

    def counters(self) -> dict:
        """Control-path traffic (tests and benchmarks read it)."""
        return {"descriptors_put": self.p.channels.put_count, "acks": self.acks, **self.p.held.counts}

    def wait_shares(self) -> dict:
        """Each rank's share of its wall time spent waiting in ``next()`` (as its acks report it)."""
        shares = dict(self.rank_wait)  # one copy (atomic): the planner thread reads it while the loop adds ranks
        return {f"{r}" + (f".{c}" if c else ""): round(w / s, 4) for (r, c), (w, s) in sorted(shares.items()) if s > 0}

    # ---- the workers' stream ----------------------------------------------------------------------------
    def lengths(
        self,
        run_id: str,
        source: str,
        epoch: int,
        unit: int,
        lengths: bytes,
        vision: bytes | None = None,
        seconds: float = 0.0,
        nbytes: int = 0,
        part: list | None = None,
        dropped: int = 0,
        quarantined: str | None = None,
        masked: bytes | None = None,
        **_,
    ) -> None:
        """A load task's unit metadata (one-way, from the worker's stream); repeats are ignored."""
        if run_id != self.p.run_id:
            return
        v = None if vision is None else np.frombuffer(vision, dtype="<i8")
        lens = np.frombuffer(lengths, dtype="<i8")
        m = None if masked is None else np.frombuffer(masked, dtype="<i8")
        self.p.signals.loaded(source, seconds, int(lens.sum()), nbytes, len(lens))
        if quarantined and self.p.losses.quarantine(source, unit, quarantined, self.state.committed):
            logs.event("quarantine", self.p.run_id, self.state.committed, source=source, unit=unit, reason=quarantined)
        if part is not None:  # auto-partitioning: the unit counts once all its parts are in
            whole = self.p.parts.add((source, epoch, unit), part, lens, v, dropped, m)
            if whole is None:
                return
            lens, v, dropped, m = whole
        self.p.losses.loaded(source, unit, len(lens), dropped)
        self.p.thread.add_lengths(source, epoch, unit, lens, v, m)
