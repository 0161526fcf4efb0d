"""Finding the service again after the connection to it broke: a restarted service (from its
snapshot) at the same address, or at the one its scheduler file names now; the rank attaches
again and opens a new channel. Tried with backoff until the stream's ``reconnect_timeout``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..errors import ServiceError
from ..protocol import resolve_address
from .options import StreamOptions


async def find_service(
    io, where: str, address: str, consumer: tuple, options: StreamOptions, closed: Callable[[], bool], why: str
):
    """``(address, planner, info, attachment, channel)`` of the service ``where`` names (an
    address, or a scheduler file read again at every try), with ``consumer`` (rank, cp rank,
    replica) attached; None if ``closed()`` became true meanwhile. A ``ServiceError`` says why it
    was not found in time (``why``: what broke, named in it), or why attaching was refused."""
    rank, cp_rank, replica = consumer
    planner = io.planner(address)
    deadline = time.monotonic() + options.reconnect_timeout
    delay = 0.2
    while not closed():
        found = None
        try:  # each try bounded: connecting to a dead address otherwise retries for Dask's 30 s
            now = resolve_address(where)
            if now != address:  # restarted elsewhere: its scheduler file says where
                address, planner = now, io.planner(now)
            info = await asyncio.wait_for(planner.info(), max(0.5, min(5.0, deadline - time.monotonic())))
            if isinstance(info, dict):
                att = await planner.attach(rank, cp_rank or 0, replica)
                if not att.get("error"):
                    channel = io.channel(
                        address, info["run_id"], wait=False, group=options.channel_group, relay=options.use_relay
                    )
                    await channel.opened()
                found = info, att
        except (OSError, ServiceError, asyncio.TimeoutError, ValueError):  # ValueError: no file (yet)
            pass
        if found is not None:
            info, att = found
            if att.get("error"):
                raise ServiceError(f"reattaching to the restarted service failed: {att['error']}")
            return address, planner, info, att, channel
        if time.monotonic() > deadline:
            wait = f"{options.reconnect_timeout:.0f}s"
            raise ServiceError(f"lost the overlord service at {address} ({why}) and it did not come back within {wait}")
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 2)
    return None


async def attached_again(
    generation: Callable[[], int],
    attachment: int,
    disconnected: asyncio.Event,
    connected: asyncio.Event,
    within: float = 2.0,
) -> bool:
    """Whether a rank's attachment ``attachment`` ended meanwhile and it attached again or is
    attaching (a rewind to the step it is at released the batch it was fetching): waits until
    it is attached (``generation()``: its current attachment; ``disconnected`` is set while it
    finds the service again, ``connected`` once it has). The rewind's message may come after
    the fetch's refusal, so it is waited for ``within`` s; and the whole reattach may happen
    while the wait begins (the events set and cleared before it looks), so the attachment is
    looked at again after it."""
    if generation() == attachment and not disconnected.is_set():
        try:
            await asyncio.wait_for(disconnected.wait(), within)
        except asyncio.TimeoutError:
            pass
    if generation() == attachment:
        if not disconnected.is_set():
            return False
        await connected.wait()
    return True
