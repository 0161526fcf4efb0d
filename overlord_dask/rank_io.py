"""One rank's background side, on its process's IO loop: descriptors in, batches fetched ahead,
acks out, and reconnection when the service restarts.

The trainer's thread (``consumer.RankStream``) and this side meet in a :class:`HandOver`: the
batches fetched and decoded, bounded in steps and bytes, and the trainer's progress that the
acks report. Everything else here runs on the IO loop only.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
from distributed.comm import CommClosedError

from .consumer_io import Channel, ProcessIO
from .errors import ServiceError
from .protocol import WORKER_FETCH, resolve_address
from .wire import DTYPES, decode_batch, nbytes

TENSOR_FIELDS = {
    "input_ids": "long",
    "labels": "long",
    "position_ids": "long",
    "cu_seqlens": "int",
    "sample_ids": "long",
    "source_ids": "int",
    "chunk_ids": "int",
    "epochs": "int",
    "seg_piece": "int",
    "seg_chunk": "int",
}
TORCH_DTYPES = {**DTYPES, **{k: np.int64 if kind == "long" else np.int32 for k, kind in TENSOR_FIELDS.items()}}
HEDGE_S = 2.0  # a worker that has not answered a fetch in this long may be hung: try the batch's other holders (doubles per retry)


def to_torch(mb: dict, pin: bool = False) -> dict:
    import torch

    out = {}
    for k, v in mb.items():
        if isinstance(v, np.ndarray):
            if not v.flags.writeable:
                v = v.copy()
            t = torch.from_numpy(v)
            kind = TENSOR_FIELDS.get(k)  # decoded in these dtypes already: a no-op then
            t = t.long() if kind == "long" else t.int() if kind == "int" else t
            out[k] = t.pin_memory() if pin else t
        else:
            out[k] = v
    return out


class HandOver:
    """Batches fetched ahead of the trainer, and the trainer's progress. Guarded by ``cond``
    where both threads touch a field."""

    def __init__(self, first_step: int, max_steps: int, max_bytes: int):
        self.cond = threading.Condition()
        self.max_steps, self.max_bytes = max_steps, max_bytes
        self.ready: dict[int, dict] = {}  # step -> batch, fetched and decoded
        self.sizes: dict[int, int] = {}
        self.ready_bytes = 0
        self.step_bytes = 0  # size of the last step fetched (the byte bound's unit)
        self.error: str | None = None
        self.want_room = False  # the prefetcher waits for the trainer to take steps
        self.floor = first_step  # nothing below this is fetched (load_state_dict moves it)
        self.consumed = first_step - 1  # the trainer finished every step up to this one
        self.chunk_ends: set[int] = set()  # last step of each descriptor: acked right away
        self.wait_total, self.t_created = 0.0, time.perf_counter()  # reported with acks: the service shows each rank's wait share

    def room(self) -> int:
        """(holding ``cond``) Steps there is room for: the step bound, and the byte bound at the
        size of the last step fetched (one step until it is known); one step always, however large."""
        room = self.max_steps - len(self.ready)
        room = min(room, (self.max_bytes - self.ready_bytes) // self.step_bytes if self.step_bytes else 1)
        return max(room, 1) if not self.ready else room

    def put(self, step: int, batch: dict, n: int) -> None:
        with self.cond:
            if step >= self.floor:
                self.ready[step] = batch
                self.sizes[step] = n
                self.ready_bytes += n
            self.cond.notify_all()

    def pop(self, step: int) -> dict | None:
        """(holding ``cond``)"""
        batch = self.ready.pop(step, None)
        if batch is not None:
            self.ready_bytes -= self.sizes.pop(step)
        return batch

    def fail(self, message: str) -> None:
        with self.cond:
            if self.error is None:
                self.error = message
            self.cond.notify_all()


class RankIO:
    """(IO loop) The background side of one rank's stream."""

    def __init__(self, io: ProcessIO, hand: HandOver, *, where: str, address: str, info: dict, rank: int, cp_rank: int | None,
                 generation: int, first_step: int, timeout: float, reconnect_timeout: float, as_torch: bool, pin_memory: bool):
        self.io, self.hand = io, hand
        self.where, self.address, self.scheduler = where, address, io.pool(address)
        self.info, self.rank, self.cp_rank, self.generation = info, rank, cp_rank, generation
        self.timeout, self.reconnect_timeout, self.as_torch, self.pin_memory = timeout, reconnect_timeout, as_torch, pin_memory
        self.closed = False
        self._descs: dict[int, dict] = {}  # step -> descriptor naming it
        self._fetch_next = first_step
        self._max_seen = first_step - 1  # highest step named by a descriptor (planned, so ackable)
        self._acked_sent = first_step - 1
        self._durable_sent = first_step - 1
        self.channel: Channel = io.channel(address, info["run_id"])
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

    def _subscribe(self) -> None:
        """Receive this rank's messages on ``self.channel`` (as this generation)."""
        key = (self.rank, self.cp_rank or 0)
        self.channel.streams.setdefault(key, {})[self.generation] = self
        self.channel.send({"op": "subscribe", "rank": self.rank, "cp_rank": key[1], "generation": self.generation})

    def wake(self, room: bool, ack: bool) -> None:
        """The trainer took steps (``room``) or finished a chunk (``ack``)."""
        if room:
            self._room.set()
        if ack:
            self._ack_wake.set()

    # ---- descriptors and fetches -------------------------------------------------------------
    async def _prefetch(self) -> None:
        h = self.hand
        try:
            while not self.closed:
                self._fetch_next = max(self._fetch_next, h.floor)
                if self._fetch_next not in self._descs:
                    self._described.clear()
                    await self._described.wait()  # set by on_message when descriptors arrive
                    continue
                with h.cond:
                    room = h.room()
                    full = room <= 0
                    if full:
                        self._room.clear()
                        h.want_room = True  # the trainer wakes us (next_batch)
                if full:
                    await self._room.wait()
                    continue
                desc = self._descs[self._fetch_next]
                steps = [s for s in desc["steps"] if s >= self._fetch_next][:room]
                try:
                    batches = await self._fetch(desc, steps)
                except (OSError, CommClosedError):
                    if self.reconnect_timeout <= 0:
                        raise
                    await asyncio.sleep(0.1)  # the service is away: the channel notices and reconnects
                    await self.connected.wait()
                    continue
                for s, b in zip(steps, batches):
                    b = decode_batch(b, TORCH_DTYPES if self.as_torch else DTYPES)
                    if self.as_torch:
                        b = {**b, "micro_batches": [to_torch(mb, self.pin_memory) for mb in b["micro_batches"]]}
                    n = h.step_bytes = nbytes(b)
                    h.put(s, b, n)
                    self._descs.pop(s, None)
                self._fetch_next = steps[-1] + 1
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the trainer must see it, not a silent stall
            h.fail(f"rank {self.rank}: fetching batches failed: {type(err).__name__}: {err}")

    def on_message(self, msg: dict) -> None:
        """A message for this rank from the channel."""
        if self.closed or msg.get("generation", self.generation) != self.generation:
            return  # meant for an earlier consumer of this rank in this process
        if msg["op"] == "worker_lost":
            self.io.lost(msg["address"]).set()
        elif msg["op"] == "error":
            self.hand.fail(f"the overlord service failed: {msg['message']}")
        elif msg["op"] == "descriptors":
            self._take_descriptors(msg["items"])
            self._described.set()

    def _take_descriptors(self, items: list[dict]) -> None:
        for desc in items:
            if "error" in desc:
                self.hand.fail(f"the overlord service failed: {desc['error']}")
                return
            if desc.get("gen", 0) != self.generation:
                continue  # queued before this consumer attached
            for s in desc["steps"]:
                if s >= self._fetch_next:
                    self._descs[s] = desc
            self._max_seen = max(self._max_seen, desc["steps"][-1])
            self.hand.chunk_ends.add(desc["steps"][-1])
            if self.hand.consumed >= min(desc["steps"]):  # steps skipped by load_state_dict: ack them now
                self._ack_wake.set()

    async def _fetch(self, desc: dict, steps: list[int]) -> list[dict]:
        """This rank's batches of ``steps`` from the worker holding ``desc``'s task; follows the
        task if it moved (a lost worker: the scheduler recomputed it elsewhere)."""
        deadline = time.monotonic() + self.timeout
        addresses = list(desc.get("workers", ()))
        slow: set[str] = set()  # holders that did not answer within the hedge time (hung, say: SIGSTOP)
        hedge = HEDGE_S
        while True:
            for addr in addresses:
                try:
                    resp = await asyncio.wait_for(
                        self.io.call_worker(addr, WORKER_FETCH, abort=self._disconnected, key=desc["key"], rank=self.rank,
                                            steps=steps, cp_rank=self.cp_rank), hedge)
                except asyncio.TimeoutError:
                    slow.add(addr)  # a hung worker is only removed after the worker TTL: use a shadow meanwhile
                    hedge *= 2
                    continue
                except OSError:
                    continue  # the worker went away; ask where the batch lives now (a shadow, or rebuilt)
                if resp.get("status") == "OK":
                    return resp["payload"].batches()
            if time.monotonic() > deadline:
                raise ServiceError(f"batch {desc['key']} could not be fetched within {self.timeout}s (last known workers: {addresses})")
            resp = await self.scheduler.overlord_where(key=desc["key"], timeout=min(5.0, self.timeout), run_id=desc.get("run_id"))
            if not isinstance(resp, dict) or resp.get("other_run"):  # the service was restarted: reconnect first
                raise CommClosedError(f"the overlord service at {self.address} was restarted")
            if resp.get("error"):
                raise ServiceError(resp["error"])
            addresses = [a for a in resp["workers"] if a not in slow] or resp["workers"]  # the slow ones last resort

    # ---- acknowledgements ---------------------------------------------------------------------
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
            msg = {"rank": self.rank, "step": step, "cp_rank": self.cp_rank or 0, "durable": durable, "wait_s": round(h.wait_total, 4),
                   "since_s": round(time.perf_counter() - h.t_created, 4)}
            if wait:
                if not self.connected.is_set():  # commit() or state_dict() while the service restarts
                    await asyncio.wait_for(self.connected.wait(), self.reconnect_timeout + 10)
                    msg["step"] = step = min(h.consumed, self._max_seen)
                resp = await self.scheduler.overlord_ack(**msg)
                if resp.get("error"):
                    raise ServiceError(resp["error"])
            else:
                self.channel.send({"op": "ack", **msg})
            self._acked_sent = max(self._acked_sent, step)
            if durable:
                self._durable_sent = max(self._durable_sent, step)

    # ---- losing and finding the service --------------------------------------------------------
    def lost(self, why: str) -> None:
        """The channel to the scheduler broke: reconnect (in the background), or fail."""
        if self.closed or self.hand.error is not None:  # closed, or already told why (the run stopped, say)
            return
        if self.reconnect_timeout <= 0:
            self.hand.fail(f"rank {self.rank}: {why}")
        elif self._reconnecting is None or self._reconnecting.done():
            self.connected.clear()
            self._disconnected.set()
            self._reconnecting = asyncio.ensure_future(self._reconnect(why))

    async def _reconnect(self, why: str) -> None:
        """Find the service again at the same address or the one its scheduler file names now
        (restarted from its snapshot), attach, subscribe on a new channel and go on from this
        trainer's position."""
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.2
        while not self.closed:
            try:  # each try bounded: connecting to a dead address otherwise retries for Dask's 30 s
                address = resolve_address(self.where)
                if address != self.address:  # restarted elsewhere: its scheduler file says where
                    self.address, self.scheduler = address, self.io.pool(address)
                info = await asyncio.wait_for(self.scheduler.overlord_info(), max(0.5, min(5.0, deadline - time.monotonic())))
                if isinstance(info, dict):
                    att = await self.scheduler.overlord_attach(rank=self.rank, cp_rank=self.cp_rank or 0)
                    if att.get("error"):
                        self.hand.fail(f"rank {self.rank}: reattaching to the restarted service failed: {att['error']}")
                        return
                    channel = self.io.channel(self.address, info["run_id"], wait=False)
                    await channel.opened()
                    break
            except (OSError, CommClosedError, ServiceError, asyncio.TimeoutError, ValueError):  # ValueError: no scheduler file (yet)
                pass
            if time.monotonic() > deadline:
                self.hand.fail(f"rank {self.rank}: lost the overlord service at {self.address} ({why}) and it did not come back "
                               f"within {self.reconnect_timeout:.0f}s")
                return
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
        else:
            return
        first, consumed = int(att["first_step"]), self.hand.consumed
        if first > consumed + 1:  # another consumer of this rank acknowledged further: never skip silently
            self.hand.fail(f"rank {self.rank}: the restarted service resumes this rank at step {first}, but its trainer "
                           f"consumed only up to step {consumed}: steps {consumed + 1}..{first - 1} would be lost")
            return
        self.info, self.channel, self.generation = info, channel, int(att["generation"])
        self._descs.clear()
        self.hand.chunk_ends.clear()
        self._acked_sent = self._durable_sent = first - 1
        self._max_seen = first - 1  # the new service has planned nothing yet: acks follow its descriptors
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
        key = (self.rank, self.cp_rank or 0)
        gens = self.channel.streams.get(key, {})
        if gens.get(self.generation) is self:
            del gens[self.generation]
            if not gens:
                self.channel.streams.pop(key, None)
            if not self.channel.closed:
                try:
                    self.channel.send({"op": "unsubscribe", "rank": self.rank, "cp_rank": key[1], "generation": self.generation})
                except Exception:  # the channel is closing: the scheduler drops the subscription anyway
                    pass
