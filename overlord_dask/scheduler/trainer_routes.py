"""The routes trainers use (``routes.py`` lists them all): attach, acknowledge, find their
batches, rewind to their checkpoint, and the per-process channel their descriptors and acks
travel on."""

from __future__ import annotations

import asyncio
import time

from .. import logs
from ..protocol import eval_key
from .channels import Consumer, tell
from .held import holders
from .replicas import ReplicaAcks
from .timings import Timings


class TrainerRoutes:
    """The trainers' handlers, over the plugin's parts."""

    def __init__(self, plugin):
        self.p = plugin
        self.acks = 0
        self.replicas = ReplicaAcks()
        # (rank, cp rank) -> (seconds waiting, seconds since it attached), as the trainer counts them
        self.rank_wait: dict[tuple[int, int], tuple[float, float]] = {}
        self.timings = Timings()  # trainer wait and step time histograms (the metrics)
        self.first_step: dict[Consumer, int] = {}  # each attached consumer's first step (its backlog starts there)
        # acknowledgements of steps a restored planner has not planned again yet: consumer ->
        # (step, durable, generation); applied as planning catches up (catch_up)
        self.early: dict[Consumer, tuple[int, bool, int | None]] = {}
        self._early_at = -1  # the planner's next step when they were last applied

    @property
    def state(self):
        return self.p.thread.state

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

    async def attach(self, rank: int, cp_rank: int = 0, replica: int = 0) -> dict:
        """A consumer joins as (rank, cp rank, replica): it starts after its last acknowledged
        step (a new replica where its rank is), under a new generation. Not while a rewind
        rebuilds the planner (``rewinder.lock``): the rebuilt state is in place before the
        rewind ends every attachment, so a stream made in between (a rank of the restarted
        job, which finds the new dp and attaches at once) would be ended as one of the old
        job's, and its trainer fail."""
        async with self.p.rewinder.lock:
            return self._attach(rank, cp_rank, replica)

    def _attach(self, rank: int, cp_rank: int, replica: int) -> dict:
        st, topo = self.state, self.state.final_plan.topology
        if not 0 <= rank < topo.dp or not 0 <= cp_rank < topo.cp or replica < 0:
            return {"error": f"rank {rank} cp rank {cp_rank} does not exist: the plan has dp={topo.dp}, cp={topo.cp}"}
        i = rank * st.topology.cp + cp_rank
        rank_acked, rank_durable = st.progress.last(i)
        consumer = (rank, cp_rank, replica)
        first = max(st.replay_until, self.replicas.attach(consumer, rank_acked, rank_durable) + 1)
        planned_first, first = first, st.timeline.first_delivered(first)  # a skipped step is never handed out
        self.first_step[consumer] = first
        gen = self.p.channels.reattach(consumer)
        if gen > 1:  # a consumer came back (or another replaced it): it goes on from `first`
            logs.event("rank_rewind", self.p.run_id, first, rank=rank, cp_rank=cp_rank, replica=replica, generation=gen)
        skipped = [planned_first, first - 1] if first > planned_first else None
        return {"error": None, "first_step": first, "generation": gen, "skipped": skipped}

    def backlog(self, consumer: Consumer) -> list[dict]:
        """What a newly subscribed consumer needs: every built batch of its rank from its first
        step on (and the run's failure, if it failed)."""
        rank, cp_rank, _ = consumer
        first = self.first_step.get(consumer, 0)
        out = [
            self.p.channels.descriptor(key, t, self.p.run_id)
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
        return await self.p.rewinder.rewind(rank, cp_rank, step, dp)

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
        await self.p.channels.serve(
            comm, channel_id, self._channel_ack, self.p.thread.feedback_in.put, self._channel_acks
        )

    def _channel_acks(self, bs, rows) -> None:
        """A channel's acknowledgements of a chunk, one row per consumer (``trainer/ack_merge.py``):
        ``[rank, cp_rank, replica, generation, step, durable_step, wait_s, since_s]``, taken in
        together: what follows from the steps committed and saved (timings, releasing batches,
        waking the snapshot writer) is done once for the message, not once per row."""
        st = self.state
        before, before_durable, planned = st.committed, st.progress.durable_step, st.handed_out
        for row in rows:
            try:
                rank, cp_rank, replica, generation, step, durable_step, wait_s, since_s = row
            except (TypeError, ValueError):
                continue  # a malformed row is not the service's failure
            consumer = (rank, cp_rank, replica)
            if 0 <= durable_step < step:  # saved up to durable_step, consumed further
                error = self._take(consumer, durable_step, True, None, None, generation, planned)
                if error:
                    tell(bs, consumer, generation, error)
            error = self._take(consumer, step, durable_step >= step, wait_s, since_s, generation, planned)
            if error:
                tell(bs, consumer, generation, error)
        self._moved_on(before, before_durable)

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
            tell(bs, (rank, cp_rank, replica), generation, resp["error"])

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
        before, before_durable = st.committed, st.progress.durable_step
        error = self._take((rank, cp_rank, replica), step, durable, wait_s, since_s, generation, st.handed_out)
        return {"committed": self._moved_on(before, before_durable), "error": error}

    def _take(
        self,
        consumer: tuple[int, int, int],
        step: int,
        durable: bool,
        wait_s: float | None,
        since_s: float | None,
        generation: int | None,
        planned: int,
    ) -> str | None:
        """One consumer's acknowledgement into the rank's progress (``planned``: the steps
        handed out); what is wrong with it, or None."""
        st = self.state
        self.acks += 1
        rank, cp_rank, _ = consumer
        if generation is not None and not self.p.channels.current(consumer, generation):
            return (
                f"rank {rank}: this consumer's attachment (generation {generation}) was "
                "replaced or the run was rewound; its acknowledgement is ignored"
            )
        if wait_s is not None and since_s:  # the trainer's own count: time in next(), and its time, since it attached
            self.rank_wait[(rank, cp_rank)] = (wait_s, since_s)
        if step >= planned and st.replay_until > 0:
            # A consumer that reconnected to a service restarted from its snapshot took steps the
            # restored planner has not planned again yet: they count as far as it has planned, the
            # rest as it catches up (it plans ahead of what every rank has acknowledged).
            old = self.early.get(consumer)
            self.early[consumer] = (max(step, old[0] if old else -1), durable or bool(old and old[1]), generation)
            step = planned - 1  # (>= 0: planned >= replay_until > 0)
        try:
            st.progress.check(rank, step, cp_rank, planned)
            # the rank's least over its replicas (saved <= acked: a replica saves what it consumed)
            acked, saved = self.replicas.ack(consumer, step, durable)
            st.ack(rank, acked, cp_rank, saved=saved, checked=True)
        except ValueError as err:
            return str(err)
        self.timings.acked(consumer, step, wait_s)
        return None

    def _moved_on(self, before: int, before_durable: int) -> int:
        """Acknowledgements were taken in since the committed step was ``before`` and the durable
        one ``before_durable``: wake the snapshot writer, time and release what they moved past.
        Returns the committed step."""
        st = self.state
        if st.progress.durable_step > before_durable and self.p.snapshots_loop is not None:
            self.p.snapshots_loop.wake()
        committed = st.committed
        if committed > before:
            self.timings.committed(committed)
            self.p.thread.release(self.p.held.release_before(committed))
        return committed

    def catch_up(self) -> None:
        """(event loop) Apply the early acknowledgements as far as the planner has planned."""
        st = self.state
        if st.next_step == self._early_at:
            return  # nothing planned since the last look
        self._early_at = st.next_step
        for consumer, (step, durable, generation) in list(self.early.items()):
            if generation is not None and not self.p.channels.current(consumer, generation):
                del self.early[consumer]  # the consumer reattached (or the run was rewound) since
                continue
            del self.early[consumer]
            rank, cp_rank, replica = consumer
            self.ack(rank, step, cp_rank, durable, replica=replica, generation=generation)  # (clipped again if need be)

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

    def wait_shares(self) -> dict:
        """Each rank's share of its wall time spent waiting in ``next()`` (as its acks report it)."""
        shares = dict(self.rank_wait)  # one copy (atomic): the planner thread reads it while the loop adds ranks
        return {f"{r}" + (f".{c}" if c else ""): round(w / s, 4) for (r, c), (w, s) in sorted(shares.items()) if s > 0}
