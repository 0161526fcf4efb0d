"""Fetching a rank's built batches from the workers, following them when a worker is lost or hangs.

A descriptor names the constructor task and the workers holding it. A fetch asks those workers in
turn; a worker reported gone is skipped at once (until the planner, asked after the report,
names its address as a holder again: a new worker listens there), and one that does not answer within
``HEDGE_S`` (hung, say) is set aside while the batch's other holders (shadows) are tried. When no
holder has it, the planner says where it lives now (rebuilt elsewhere, or a shadow), and the
fetch goes on there until ``timeout``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..client import PlannerClient, fetch
from ..errors import ConnectionClosed, ServiceError

# a worker that has not answered a fetch in this long may be hung: try the batch's other holders (doubles per retry)
HEDGE_S = 2.0
# after the second round of holders that all failed, wait this long before asking the planner again (doubling)
ROUND_PAUSE_S, ROUND_PAUSE_MAX_S = 0.01, 0.5


async def fetch_shared(io, address: str, request: tuple, call, abort: asyncio.Event | None = None):
    """``call(rpc)`` to the worker at ``address``, once for every identical ``request`` in flight in
    this process: the replicas of a rank (its tensor- and pipeline-parallel ranks) in one process
    ask for the same batches at about the same time, and share one transfer."""
    key = (address, *request)
    shared = io.inflight.get(key)
    if shared is None:
        shared = io.inflight[key] = asyncio.ensure_future(io.call_worker(address, call, abort=abort))
        shared.add_done_callback(lambda f: _settled(f, io.inflight, key))
    else:
        io.fetches_shared += 1
    return await asyncio.shield(shared)  # one waiter giving up (a hedge) leaves the others theirs


def _settled(fut: asyncio.Future, inflight: dict, key: tuple) -> None:
    """A shared fetch ended: forget it, and take its error (every waiter may have gone to a
    shadow meanwhile: asyncio would otherwise log "Task exception was never retrieved" with a
    traceback in the trainer's output for a worker that was merely unreachable)."""
    inflight.pop(key, None)
    if not fut.cancelled():
        fut.exception()


async def fetch_batches(
    io,
    planner: PlannerClient,
    desc: dict,
    steps: list[int],
    *,
    rank: int,
    cp_rank: int | None,
    timeout: float,
    abort: asyncio.Event,
    address: str,
    host=None,
    replica: int = 0,
    trouble: Callable[[str | None], None] = lambda text: None,
) -> list[dict]:
    """Rank ``rank``'s batches of ``steps`` (wire form) from the task ``desc`` names. ``io`` is the
    process's ``connection.ProcessIO``; ``abort`` is set when the service itself went away;
    ``host``: the channel's ``host_fetch.HostFetches`` (through a relay: the host's replicas of
    the rank share one transfer). ``trouble(text)`` hears each holder that failed to answer, and
    ``trouble(None)`` the fetch's success (a rank that times out says what its fetches met).
    Raises ``ConnectionClosed`` when the service restarted (reconnect first), ``ServiceError``
    when the batch is gone for good or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    addresses = list(desc.get("workers", ()))
    slow: set[str] = set()  # holders that did not answer within the hedge time (hung, say: SIGSTOP)
    hedge = HEDGE_S
    pause = 0.0  # before asking the planner again (the first time at once: a lost worker's shadow takes over)

    async def from_worker(addr: str):
        if host is not None:
            resp = await host.fetch(addr, desc, (rank, cp_rank, replica), steps)
            if resp is not None:
                return resp
        request = (desc["key"], rank, cp_rank, tuple(steps))
        return await fetch_shared(io, addr, request, lambda rpc: fetch(rpc, desc["key"], rank, steps, cp_rank), abort)

    while True:
        for addr in addresses:
            try:
                resp = await asyncio.wait_for(from_worker(addr), hedge)
            except asyncio.TimeoutError:
                slow.add(addr)  # a hung worker is only removed after the worker TTL: use a shadow meanwhile
                trouble(f"worker {addr} did not answer within {hedge:g} s")
                hedge *= 2
                continue
            except OSError as err:  # the worker went away; ask where the batch lives now (a shadow, or rebuilt)
                trouble(f"worker {addr}: {type(err).__name__}: {err}")
                continue
            if resp.get("status") == "OK":
                trouble(None)
                return resp["payload"].batches()
            trouble(f"worker {addr} answered {resp.get('status')!r}")
        if time.monotonic() > deadline:
            raise ServiceError(
                f"batch {desc['key']} could not be fetched within {timeout}s (last known workers: {addresses})"
            )
        if pause:  # no holder answered again: a rank stuck on a batch must not ask the scheduler 1,000 times a second
            await asyncio.sleep(pause)
        pause = min(ROUND_PAUSE_MAX_S, pause * 2) if pause else ROUND_PAUSE_S
        asked_at = time.monotonic()
        resp = await planner.where(desc["key"], timeout=min(5.0, timeout), run_id=desc.get("run_id"))
        if not isinstance(resp, dict) or resp.get("other_run"):  # the service was restarted: reconnect first
            raise ConnectionClosed(f"the overlord service at {address} was restarted")
        if resp.get("error"):
            raise ServiceError(resp["error"])
        io.found(resp["workers"], asked_at)  # alive now, whatever an earlier worker at the same address did
        addresses = [a for a in resp["workers"] if a not in slow] or resp["workers"]  # the slow ones last resort
