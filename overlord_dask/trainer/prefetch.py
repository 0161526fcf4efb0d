"""One rank's background side, on its process's IO loop: descriptors in, batches fetched ahead,
acks out, and reconnection when the service restarts.

The trainer's thread (``stream.RankStream``) and this side meet in a ``handover.HandOver``: the
batches fetched (in wire form, the next few decoded), bounded in steps and bytes, and the
trainer's progress that the acks report. Everything else here runs on the IO loop only.
"""

from __future__ import annotations

import asyncio
import threading

from ..errors import ServiceError
from ..wire import nbytes
from .acking import Acknowledging
from .connection import ProcessIO
from .fetch import fetch_batches
from .handover import HandOver
from .options import StreamOptions
from .reconnect import attached_again, find_service
from .stalls import FetchTrouble


class RankIO(Acknowledging):
    """(IO loop) The background side of one rank's stream (its acknowledgements: ``acking.py``)."""

    def __init__(
        self,
        io: ProcessIO,
        hand: HandOver,
        *,
        where: str,
        address: str,
        info: dict,
        consumer: tuple[int, int | None, int],
        generation: int,
        first_step: int,
        options: StreamOptions,
    ):
        self.io, self.hand, self.options = io, hand, options
        self.where, self.address, self.planner = where, address, io.planner(address)
        self.info, self.generation = info, generation
        self.rank, self.cp_rank, self.replica = consumer  # (rank, cp rank or None, replica)
        self.closed = False
        self.fetch_trouble = FetchTrouble()  # what this rank's failing fetches met (a timeout's error says it)
        self._descs: dict[int, dict] = {}  # step -> descriptor naming it
        self._fetch_next = first_step
        self._max_seen = first_step - 1  # highest step named by a descriptor (planned, so ackable)
        self._acked_sent = first_step - 1
        self._durable_sent = first_step - 1
        self.channel = io.channel(address, info["run_id"], group=options.channel_group, relay=options.use_relay)
        self.tasks = io.run(self._start(), timeout=30)

    async def _start(self):
        self._room = asyncio.Event()
        self._ack_wake = asyncio.Event()
        self._ack_lock = asyncio.Lock()
        self._described = asyncio.Event()
        self.connected = asyncio.Event()
        self.connected.set()
        self._disconnected = asyncio.Event()  # the opposite of connected (asyncio has no wait-for-clear)
        self._reconnecting = None
        self._subscribe()
        return [asyncio.ensure_future(self._prefetch()), asyncio.ensure_future(self._acker())]

    @property
    def consumer(self) -> tuple[int, int, int]:
        return self.rank, self.cp_rank or 0, self.replica

    def _ident(self) -> dict:
        """Who this is in a channel message: the consumer and its attachment's generation."""
        return {"rank": self.rank, "cp_rank": self.cp_rank or 0, "replica": self.replica, "generation": self.generation}

    def _subscribe(self) -> None:
        """Receive this consumer's messages on ``self.channel`` (as this generation)."""
        self.channel.streams.setdefault(self.consumer, {})[self.generation] = self
        self.channel.send({"op": "subscribe", **self._ident()})

    def wake(self, room: bool, ack: bool) -> None:
        """The trainer took steps (``room``) or finished a chunk (``ack``): decode the steps it
        takes next."""
        self.hand.decode_ahead()
        if room:
            self._room.set()
        if ack:
            self._ack_wake.set()

    # ---- descriptors and fetches -------------------------------------------------------------
    async def _prefetch(self) -> None:
        h = self.hand
        try:
            while not self.closed:
                self._fetch_next = h.past_skips(max(self._fetch_next, h.floor))
                if self._fetch_next not in self._descs:
                    self._described.clear()
                    await self._described.wait()  # set by on_message when descriptors arrive
                    continue
                room = h.room()
                if room <= 0:  # the trainer's next take wakes us (wake)
                    self._room.clear()
                    await self._room.wait()
                    continue
                desc = self._descs[self._fetch_next]
                steps = [s for s in desc["steps"] if s >= self._fetch_next][:room]
                attachment, dropped = self.generation, h.dropped
                try:
                    where = {"abort": self._disconnected, "address": self.address, "timeout": self.options.timeout}
                    where.update(host=getattr(self.channel, "host_fetches", None), replica=self.replica)
                    where.update(trouble=lambda text, steps=steps: self.fetch_trouble.tell(steps, text))
                    batches = await fetch_batches(
                        self.io, self.planner, desc, steps, rank=self.rank, cp_rank=self.cp_rank, **where
                    )
                except OSError:  # the connection broke (errors.ConnectionClosed, Dask's CommClosedError)
                    if self.options.reconnect_timeout <= 0:
                        raise
                    await asyncio.sleep(0.1)  # the service is away: the channel notices and reconnects
                    await self.connected.wait()
                    continue
                except ServiceError:  # the batch is gone: a rewind this rank goes on from released it?
                    if not await attached_again(
                        lambda: self.generation, attachment, self._disconnected, self.connected
                    ):
                        raise
                    continue
                if h.dropped != dropped:  # a skip at this rank's step dropped what the ended attachment held
                    continue
                h.put(steps, batches, [nbytes(b) for b in batches])  # in wire form: decoded a few steps ahead
                for s in steps:
                    self._descs.pop(s, None)
                self._fetch_next = steps[-1] + 1
                h.decode_ahead()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the trainer must see it, not a silent stall
            h.fail(f"rank {self.rank}: fetching batches failed: {type(err).__name__}: {err}")

    def on_message(self, msg: dict) -> None:
        """A message for this rank from the channel."""
        if self.closed or msg.get("generation", self.generation) != self.generation:
            return  # meant for an earlier consumer of this rank in this process
        if msg["op"] == "worker_lost":
            self.io.mark_lost(msg["address"])
        elif msg["op"] == "error" and msg.get("resumable") and self.options.reconnect_timeout > 0:
            # a restart (or a resubmitted job) is awaited
            self.lost(f"{msg['message']}; it resumes from its snapshots when it is started again")
        elif msg["op"] == "error" and msg.get("rewound_to") is not None:
            self._rewound(msg)
        elif msg["op"] == "error":
            self.hand.fail(f"the overlord service failed: {msg['message']}")
        elif msg["op"] == "descriptors":
            self._take_descriptors(msg["items"])
            self._described.set()

    def _rewound(self, msg: dict) -> None:
        """The service was rewound to step ``msg["rewound_to"]``: where the trainer is at that
        step (another rank of this restarted job rewound it after this one attached), or past
        it where the steps are replayed unchanged (``HandOver.rewound``), attach again and go
        on; else fail, saying why. At a skip, nothing the ended attachment named from its start
        is fetched any more (they may be skipped steps)."""
        at, replayed = msg["rewound_to"], bool(msg.get("replayed"))
        goes_on = self.hand.rewound(at, replayed)
        if not replayed:
            self._descs = {s: d for s, d in self._descs.items() if s < at}
            self._fetch_next = min(self._fetch_next, at)
        if goes_on and self.options.reconnect_timeout > 0:
            self.lost(f"{msg['message']}; this rank is at that step and goes on from it")
        else:
            self.hand.fail(f"the overlord service failed: {msg['message']}")

    def _take_descriptors(self, items: list[dict]) -> None:
        for desc in items:
            if "error" in desc:
                self.hand.fail(f"the overlord service failed: {desc['error']}")
                return
            self.hand.skipped(desc.get("skip"))  # steps the service skips right before these, if any
            for s in desc["steps"]:
                if s >= self._fetch_next:
                    self._descs[s] = desc
            self._max_seen = max(self._max_seen, desc["steps"][-1])
            self.hand.chunk_ends_at(desc["steps"][-1])
            if self.hand.consumed >= min(desc["steps"]):  # steps skipped by load_state_dict: ack them now
                self._ack_wake.set()

    # ---- acknowledgements ---------------------------------------------------------------------
    # ---- losing and finding the service --------------------------------------------------------
    def lost(self, why: str) -> None:
        """The channel to the scheduler broke: reconnect (in the background), or fail."""
        if self.closed or self.hand.error is not None:  # closed, or already told why (the run stopped, say)
            return
        if self.options.reconnect_timeout <= 0:
            self.hand.fail(f"rank {self.rank}: {why}")
        elif self._reconnecting is None or self._reconnecting.done():
            self.connected.clear()
            self._disconnected.set()
            self._reconnecting = asyncio.ensure_future(self._reconnect(why))

    async def _reconnect(self, why: str) -> None:
        """Find the service again at the same address or the one its scheduler file names now
        (restarted from its snapshot), attach, subscribe on a new channel and go on from this
        trainer's position."""
        try:
            found = await find_service(
                self.io, self.where, self.address, self.consumer, self.options, lambda: self.closed, why
            )
        except ServiceError as err:
            self.hand.fail(f"rank {self.rank}: {err}")
            return
        if found is None:
            return  # closed meanwhile
        self.address, self.planner, info, att, channel = found
        # (the step it is on counts: it has that batch)
        first, took = int(att["first_step"]), self.hand.taken
        self.hand.skipped(att.get("skipped"))  # steps the service skips from where this rank was, if any
        if self.hand.past_skips(took + 1) < first:  # another consumer acknowledged further: never skip silently
            self.hand.fail(
                f"rank {self.rank}: the restarted service resumes this rank at step {first}, but its trainer "
                f"took only up to step {took}: steps {took + 1}..{first - 1} would be lost"
            )
            return
        gens = self.channel.streams.get(self.consumer, {})
        if gens.get(self.generation) is self:  # (the same channel when only the attachment ended)
            del gens[self.generation]
        self.info, self.channel, self.generation = info, channel, int(att["generation"])
        self._descs.clear()
        self.hand.forget_chunks()
        self._acked_sent = self._durable_sent = self._max_seen = first - 1  # (acks follow the new descriptors)
        self._subscribe()
        self._disconnected.clear()
        self.connected.set()
        self._described.set()
        self._ack_wake.set()  # what the trainer consumed past the service's restart point

    # ---- the end ----------------------------------------------------------------------------------
    def stop(self, wait: float | None = None) -> None:
        """(any thread) Stop the background tasks and end this rank's subscription. With
        ``wait`` (seconds; not from the IO loop), return once the tasks have ended: a trainer
        that closes its stream and exits must not leave a fetch decoding into torch tensors on
        the IO thread while the interpreter shuts down (seen as a C++ ``terminate`` at exit)."""
        self.closed = True
        tasks = list(getattr(self, "tasks", ()))

        async def _stop():
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._unsubscribe()

        if wait is None or threading.current_thread() is self.io.thread:
            self.io.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_stop()))
            return
        try:
            self.io.run(_stop(), timeout=wait)
        except Exception:  # the loop is stuck or gone: the daemon thread dies with the process
            pass

    def _unsubscribe(self) -> None:
        key = self.consumer
        gens = self.channel.streams.get(key, {})
        if gens.get(self.generation) is self:
            del gens[self.generation]
            if not gens:
                self.channel.streams.pop(key, None)
            if not self.channel.closed:
                try:
                    self.channel.send({"op": "unsubscribe", **self._ident()})
                except Exception:  # the channel is closing: the scheduler drops the subscription anyway
                    pass
