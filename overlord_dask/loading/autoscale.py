"""Elastic source-loader pools: sizes from the planner's signals, applied by a Dask ``Adaptive``.

Each pool (``pools.py``) gets the workers its sources' demand needs::

    cores(pool) = Σ_sources  steps/s × tokens/step × weight_ahead × seconds/token
    workers     = ceil(headroom × cores / cores_per_worker)

``weight_ahead`` is the source's largest weight over the schedule from now to ``lead_s`` seconds
ahead (at the measured step rate), so a pool grows before a curriculum stage raises its weight
and shrinks only once the stage that needed it is over. ``seconds/token`` is measured from the
source's own load tasks (a tokenizer or image decoder is what it costs, not what a config says).
The step rate is the peak of the last two minutes: while loading holds the trainers back, the
rate now is what loading delivers, not what the trainers would take. Two corrections on top: a
pool whose source the planner is waiting on while few steps are ready grows by one worker per
decision (and never shrinks meanwhile), once its earlier workers have arrived; a pool in the mix
does not shrink while workers it grew by are still starting (a job asked for because the planner
starved was otherwise cancelled two decisions later, before it could show its effect); a pool also gets
enough workers to hold its sources' blocks in flight (loaded or on their way, at the measured
bytes per block) in half their memory; and a pool shrinks only after ``down_after`` decisions
in a row asked for less, so noise does not make pools flap. When the pools together
want more than ``max_workers``, the ones with the most slack over their own demand give way.

:class:`PoolPolicy` is the pure decision (unit-tested on signals); :class:`PoolAdaptive` is the
``distributed.deploy.Adaptive`` that asks the planner (``overlord_pools``), decides, resizes the
cluster's pools and reports each decision, with its reason, back to the planner so that
``Service.pools()`` shows it from any client.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from distributed.deploy import Adaptive

from ..client import PlannerClient
from ..plan import Autoscale
from .pools import PoolSpec, grow, pool_of, pool_sizes, start_workers

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.5  # of a worker's memory limit that its pool's loaded blocks may fill


@dataclass
class ScaleDecision:
    pool: str
    workers: int  # requested now
    target: int  # what the pool should have
    demand_cores: float | None  # measured demand (None: a source of the pool has no cost measured yet)
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


class PoolPolicy:
    """Pool sizes from one ``overlord_pools`` answer; keeps the shrink votes between calls."""

    def __init__(self, pools: dict[str, PoolSpec], config: Autoscale):
        self.pools = pools
        self.config = config
        self.down_votes: dict[str, int] = {}

    def decide(
        self, signals: dict, current: dict[str, int], arrived: dict[str, int], memory: dict[str, float] | None = None
    ) -> dict[str, ScaleDecision]:
        """``memory``: bytes a worker of each pool may use (its memory limit), where known."""
        cfg = self.config
        # the peak of the recent rate: while loading holds trainers back, the rate now is what
        # loading delivers, and sizing to it would shrink the pool that is short
        rate, step_tokens = max(signals["steps_per_s"], signals.get("steps_per_s_peak", 0.0)), signals["step_tokens"]
        starving = signals["starved_on"] if signals["steps_ready"] < max(1, signals["prefetch_steps"] // 2) else None
        out: dict[str, ScaleDecision] = {}
        for name, spec in self.pools.items():
            cur = current.get(name, 0)
            srcs = {s: signals["sources"][s] for s in spec.sources if s in signals["sources"]}
            active = any(v["weight_ahead"] > 0 or v["loads_pending"] for v in srcs.values())
            unknown = [s for s, v in srcs.items() if v["weight_ahead"] > 0 and v["seconds_per_token"] is None]
            demand = sum(
                rate * step_tokens * v["weight_ahead"] * v["seconds_per_token"]
                for v in srcs.values()
                if v["seconds_per_token"] is not None
            )
            target = math.ceil(cfg.headroom * demand / spec.cores - 1e-9)
            why = f"demand {demand:.2f} cores at {rate:.1f} steps/s"
            if unknown:
                target, why = max(target, cur, 1), f"no load cost measured yet for {unknown}"
            held = sum(v.get("blocks_held", 0) * (v.get("block_bytes") or 0) for v in srcs.values())
            limit = (memory or {}).get(name)
            if limit and held > target * MEMORY_SHARE * limit:
                target = math.ceil(held / (MEMORY_SHARE * limit))
                why = f"blocks in flight ({held / 2**20:.0f} MiB) need {target} workers of {limit / 2**30:.1f} GiB"
            if (
                starving in srcs and signals["steps_per_s"] > 0 and arrived.get(name, 0) >= cur
            ):  # (not the start's first loads)
                if target <= cur:
                    target, why = cur + 1, f"planner waits on {starving!r} with {signals['steps_ready']} steps ready"
            if not active:
                target, why = 0, "no weight over the schedule ahead"
            elif target < 1:
                target = 1  # a source in the mix needs a worker to load it at all
            target = spec.clamp(target)
            if target < cur and starving in srcs:
                target, why = cur, f"planner waits on {starving!r}: not shrinking"
            elif target < cur and active and arrived.get(name, 0) < cur:
                target, why = cur, f"{cur - arrived.get(name, 0)} worker(s) still starting: not shrinking"
            if target < cur:
                votes = self.down_votes.get(name, 0) + 1
                if votes < cfg.down_after:
                    self.down_votes[name] = votes
                    why += f"; shrink to {target} after {cfg.down_after - votes} more such decisions"
                    target = cur
                else:
                    self.down_votes[name] = 0
            else:
                self.down_votes[name] = 0
            out[name] = ScaleDecision(name, cur, target, None if unknown else demand, why)
        self._fit_budget(out)
        return out

    def _fit_budget(self, out: dict[str, ScaleDecision]) -> None:
        budget = self.config.max_workers
        if budget is None:
            return
        while sum(d.target for d in out.values()) > budget:

            def slack(d: ScaleDecision) -> tuple:
                need = 0 if d.demand_cores is None else self.config.headroom * d.demand_cores / self.pools[d.pool].cores
                return (d.target - need, d.target)

            shrinkable = [d for d in out.values() if d.target > self.pools[d.pool].clamp(0) and d.target > 0]
            if not shrinkable:
                break
            d = max(shrinkable, key=slack)
            d.target -= 1
            d.reason += f"; capped by max_workers={budget}"


class PoolAdaptive(Adaptive):
    """``cluster``'s pools sized by :class:`PoolPolicy` every ``config.interval_s`` seconds.

    Runs next to the cluster object (the service process); reads the planner through the
    scheduler, resizes pools through the cluster's ``worker_spec`` and retires workers the way
    ``Adaptive`` does (their blocks move to other workers first).
    """

    def __init__(self, cluster, pools: dict[str, PoolSpec], config: Autoscale, run_id: str | None = None, **kwargs):
        self.policy = PoolPolicy(pools, config)
        self.config = config
        self.run_id = run_id
        self.decisions: dict[str, ScaleDecision] = {}
        self.history: deque = deque(maxlen=10_000)  # every change: time, step, pool, from, to, reason
        self.last_signals: dict | None = None
        self.planner = None  # client.PlannerClient over Adaptive.scheduler, made on first use (it exists once started)
        self._idle = threading.Event()  # no decision in flight
        self._idle.set()
        self._in_flight = 0
        super().__init__(cluster, interval=config.interval_s, minimum=0, maximum=math.inf, wait_count=1, **kwargs)

    def wait_idle(self, timeout: float) -> bool:
        """(any thread but the cluster's loop) Wait until no decision is in flight; after
        ``stop()`` none starts, so the planner can then be detached safely."""
        return self._idle.wait(timeout)

    def _planner(self) -> PlannerClient:
        if self.planner is None:
            self.planner = PlannerClient(self.scheduler)
        return self.planner

    def _arrived_names(self) -> set[str]:
        return {str(w.get("name")) for w in self.cluster.scheduler_info.get("workers", {}).values()}

    def _arrived(self) -> dict[str, int]:
        names = self._arrived_names()
        return {p: sum(n in names for n in ws) for p, ws in pool_sizes(self.cluster).items()}

    def _memory(self) -> dict[str, float]:
        """The smallest memory limit among each pool's arrived workers."""
        out: dict[str, float] = {}
        for w in self.cluster.scheduler_info.get("workers", {}).values():
            p, limit = pool_of(w.get("name")), w.get("memory_limit")
            if p is not None and limit:
                out[p] = min(out.get(p, limit), limit)
        return out

    async def target(self) -> int:
        signals = await self._planner().pools(lead_s=self.config.lead_s)
        self.last_signals = signals
        current = {p: len(ws) for p, ws in pool_sizes(self.cluster).items()}
        self.decisions = self.policy.decide(signals, current, self._arrived(), self._memory())
        return sum(d.target for d in self.decisions.values())

    async def recommendations(self, target: int) -> dict:
        up = {p: d.target - d.workers for p, d in self.decisions.items() if d.target > d.workers}
        if up:
            return {"status": "up", "n": up}
        have, arrived = pool_sizes(self.cluster), self._arrived_names()
        down = []
        for p, d in self.decisions.items():
            if d.target < d.workers:  # workers still starting go first, then the newest
                names = have.get(p, [])[::-1]
                order = [n for n in names if n not in arrived] + [n for n in names if n in arrived]
                down += order[: d.workers - d.target]
        return {"status": "down", "workers": down} if down else {"status": "same"}

    async def scale_up(self, n: dict) -> None:
        for p, k in n.items():
            grow(self.cluster, self.policy.pools[p], k)
            self._record(p, +k)
        # started in the background (as SpecCluster.scale does): a job or process can take many
        # seconds to come up, and decisions (and their reports) go on meanwhile
        start_workers(self.cluster)

    async def scale_down(self, workers: list) -> None:
        for w in workers:
            self._record(pool_of(w), -1)
        await super().scale_down(workers)

    def _record(self, pool: str, delta: int) -> None:
        d = self.decisions.get(pool)
        step = (self.last_signals or {}).get("committed")
        entry = {
            "time": time.time(),
            "step": step,
            "pool": pool,
            "delta": delta,
            "from": d.workers if d else None,
            "to": d.target if d else None,
            "reason": d.reason if d else "",
        }
        if (
            self.history
            and self.history[-1]["pool"] == pool
            and self.history[-1]["step"] == step
            and self.history[-1]["to"] == entry["to"]
        ):
            self.history[-1]["delta"] += delta  # one decision that retired several workers
            return
        self.history.append(entry)
        logger.info(
            "pool %s: %s -> %s workers at step %s (%s)", pool, entry["from"], entry["to"], step, entry["reason"]
        )

    async def adapt(self) -> None:
        self._in_flight += 1
        self._idle.clear()
        try:
            await self._adapt()
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _adapt(self) -> None:
        await super().adapt()
        try:  # what was decided, with the reasons, for Service.pools() on any client
            await self._planner().pools(
                lead_s=self.config.lead_s,
                report={
                    "decisions": {p: d.as_dict() for p, d in self.decisions.items()},
                    "history": list(self.history)[-200:],
                    "arrived": self._arrived(),
                },
            )
        except Exception:  # the scheduler is going away; the next round (if any) reports again
            logger.debug("could not report pool decisions", exc_info=True)
