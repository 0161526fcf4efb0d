"""The one client of the planner's routes: every caller (trainer, service, submitter, autoscaler,
load tasks) goes through here, so each route is called in one place and named only in
``protocol.Route``.

:class:`PlannerClient` wraps any Dask rpc to the scheduler (``distributed.Client.scheduler``, a
trainer process's ``trainer.comm.Pool``, ``Adaptive.scheduler``); its methods are
coroutines. :class:`BlockingPlannerClient` runs the same calls from a thread that owns a
``distributed.Client`` (the service and its submitter). The handlers behind these calls, and
what each answers, are listed in ``scheduler/routes.py``.
"""

from __future__ import annotations

import functools

from .protocol import Route


class PlannerClient:
    """Coroutines over the planner's routes (``rpc``: any Dask rpc object to the scheduler)."""

    def __init__(self, rpc):
        self.rpc = rpc

    def _route(self, name: str):
        return getattr(self.rpc, name)  # a Dask rpc answers any route name with a request/response call

    # ---- trainers --------------------------------------------------------------------------------
    async def info(self) -> dict | None:
        """Topology and names a consumer needs; None from a scheduler that runs no overlord planner."""
        return await self._route(Route.INFO)()

    async def attach(self, rank: int, cp_rank: int = 0, replica: int = 0) -> dict:
        return await self._route(Route.ATTACH)(rank=rank, cp_rank=cp_rank, replica=replica)

    async def rewind(self, rank: int, step: int, dp: int, cp_rank: int = 0, replica: int = 0) -> dict:
        """The job restarted from its checkpoint at ``step`` with ``dp`` ranks: serve from there."""
        return await self._route(Route.REWIND)(rank=rank, step=step, dp=dp, cp_rank=cp_rank, replica=replica)

    async def ack(
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
        return await self._route(Route.ACK)(
            rank=rank,
            step=step,
            cp_rank=cp_rank,
            durable=durable,
            wait_s=wait_s,
            since_s=since_s,
            replica=replica,
            generation=generation,
        )

    async def where(self, key: str, timeout: float, run_id: str | None = None) -> dict:
        return await self._route(Route.WHERE)(key=key, timeout=timeout, run_id=run_id)

    async def evaluation(self, timeout: float) -> dict:
        return await self._route(Route.EVAL)(timeout=timeout)

    # ---- the service and its submitter -------------------------------------------------------------
    async def work(self, timeout: float = 1.0) -> dict:
        return await self._route(Route.WORK)(timeout=timeout)

    async def fail(self, message: str) -> None:
        return await self._route(Route.FAIL)(message=message)

    async def plans(self, decisions: bool = False) -> list | dict:
        return await self._route(Route.PLANS)(decisions=decisions)

    async def update(self, plan: dict, at_step: int | None, unit_first_ids: dict) -> dict:
        return await self._route(Route.UPDATE)(plan=plan, at_step=at_step, unit_first_ids=unit_first_ids)

    async def request_stop(self) -> dict:
        return await self._route(Route.REQUEST_STOP)()

    async def skip(self, start: int, stop: int, reason: str = "") -> dict:
        return await self._route(Route.SKIP)(start=start, stop=stop, reason=reason)

    # ---- views -----------------------------------------------------------------------------------
    async def status(self) -> dict:
        return await self._route(Route.STATUS)()

    async def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return await self._route(Route.METRICS)(start=start, stop=stop)

    async def ledger(self, start: int = 0, stop: int | None = None) -> list[dict]:
        return await self._route(Route.LEDGER)(start=start, stop=stop)

    async def snapshots(self) -> list[dict]:
        return await self._route(Route.SNAPSHOTS)()

    async def loop(self, reset: bool = False) -> dict:
        return await self._route(Route.LOOP)(reset=reset)

    async def pools(self, lead_s: float = 10.0, report: dict | None = None) -> dict:
        """The autoscaler's inputs; with ``report``, hand the planner the autoscaler's decisions."""
        return await self._route(Route.POOLS)(lead_s=lead_s, report=report)


class BlockingPlannerClient:
    """:class:`PlannerClient`'s calls, blocking, from a thread outside ``client``'s event loop."""

    def __init__(self, client):
        self.client = client
        self.aio = PlannerClient(client.scheduler)

    def __getattr__(self, name: str):
        call = getattr(self.aio, name)  # AttributeError for a name PlannerClient does not have
        return functools.partial(self.client.sync, call)


def channel_open(channel_id: str, run_id: str) -> dict:
    """The first message on a trainer process's channel stream (``Route.CHANNEL``)."""
    return {"op": Route.CHANNEL, "channel_id": channel_id, "run_id": run_id, "reply": False}


def lengths_report(
    run_id: str,
    source: str,
    epoch: int,
    unit: int,
    lengths: bytes,
    vision: bytes | None,
    seconds: float,
    nbytes: int,
    part: list | None,
    dropped: int = 0,
    quarantined: str | None = None,
    masked: bytes | None = None,
) -> dict:
    """A load task's one-way report on its worker's stream (``Route.LENGTHS``); ``masked``: the
    unit's masked runs (``masked_runs.py``), where the loss ignores some of its tokens."""
    return {
        "op": Route.LENGTHS,
        "run_id": run_id,
        "source": source,
        "epoch": epoch,
        "unit": unit,
        "lengths": lengths,
        "vision": vision,
        "seconds": seconds,
        "nbytes": nbytes,
        "part": part,
        "dropped": dropped,
        "quarantined": quarantined,
        "masked": masked,
    }


async def fetch(rpc, key: str, rank: int, steps: list[int], cp_rank: int | None) -> dict:
    """A rank's built batches of ``steps`` from the worker behind ``rpc`` (``Route.FETCH``)."""
    return await getattr(rpc, Route.FETCH)(key=key, rank=rank, steps=steps, cp_rank=cp_rank)
