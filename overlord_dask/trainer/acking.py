"""One rank's acknowledgements to the service: in the background at chunk ends (one-way on the
channel), and as requests for ``commit()``, ``state_dict()`` and ``close()``, which must reach
the service even when it is restarting at that moment.

A mixin of ``prefetch.RankIO`` (it works on the rank's hand-over, channel, planner client and
connection state), kept apart so one file says what an acknowledgement promises.
"""

from __future__ import annotations

import asyncio
import time

from ..errors import ServiceError


class Acknowledging:
    """(mixin of ``RankIO``, IO loop) Sending what the trainer consumed."""

    def wake_acks(self) -> None:
        self._ack_wake.set()

    async def _acker(self) -> None:
        while not self.closed:
            await self._ack_wake.wait()
            self._ack_wake.clear()
            if not self.connected.is_set():
                continue  # acked again after reconnecting
            try:
                await self.send_ack(wait=False)
            except Exception as err:
                self.hand.fail(f"rank {self.rank}: acknowledging failed: {type(err).__name__}: {err}")

    async def send_ack(self, durable: bool | None = None, wait: bool = True) -> None:
        """Acknowledge every consumed step. ``wait``: as a request whose answer says the service
        has it (``commit``, ``state_dict``, ``close``); else one-way on the channel (the
        background acks at chunk ends; a refusal comes back as an error message)."""
        h = self.hand
        async with self._ack_lock:
            step = min(h.consumed, self._max_seen)  # never acknowledge a step not planned yet
            if durable is None:  # with commit 'ack' every consumed step is durable
                durable = self.info.get("commit", "ack") == "ack"
            if step <= self._acked_sent and not (durable and step > self._durable_sent):
                return
            since = time.perf_counter() - h.t_created
            msg = {**self._ident(), "step": step, "durable": durable, "wait_s": round(h.wait_total, 4)}
            msg["since_s"] = round(since, 4)
            if wait:
                resp = await self._ack_request(msg)
                step = msg["step"]
                if resp.get("error"):
                    raise ServiceError(resp["error"])
            else:
                self.channel.send({"op": "ack", **msg})
            self._acked_sent = max(self._acked_sent, step)
            if durable:
                self._durable_sent = max(self._durable_sent, step)

    async def _ack_request(self, msg: dict) -> dict:
        """The acknowledgement ``msg`` as a request, through a service restart: while the channel
        is down, or when the connection breaks under the request (the service was killed just
        then), it waits for the stream to find the service again (``lost``) and sends it anew,
        for this attachment, up to ``reconnect_timeout``."""
        h = self.hand
        deadline = time.monotonic() + self.options.reconnect_timeout + 10
        while True:
            if not self.connected.is_set():  # commit() or state_dict() while the service restarts
                await asyncio.wait_for(self.connected.wait(), max(0.1, deadline - time.monotonic()))
            msg.update(self._ident(), step=min(h.consumed, self._max_seen))
            try:
                return await self.planner.ack(**msg)
            except OSError:  # the connection broke (errors.ConnectionClosed, Dask's CommClosedError)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)  # (the channel's loss clears `connected` meanwhile)
