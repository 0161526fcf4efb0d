"""The trainer process's connections to the service: one asyncio loop thread and one connection
pool per process (``comm.Pool``: Dask's wire protocol, spoken without importing ``distributed``),
and one channel per process and run, shared by its ranks.

The channel (``overlord_channel`` on the scheduler) is a batched stream both ways: the scheduler
pushes the descriptors of built batches for the ranks subscribed on it, acks go back one-way,
and messages are routed to each rank's IO side (``prefetch.RankIO``) by (rank, cp rank) and
generation. No Dask client, heartbeat or task bookkeeping per rank: the scheduler handles a
message per process and interval, not requests per rank.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..batched import BatchedWriter
from ..client import PlannerClient, channel_open
from ..errors import ConnectionClosed, ServiceError
from ..protocol import CHANNEL_INTERVAL
from .ack_merge import AckMerge, row_of
from .addressing import named, of_consumer
from .comm import Pool
from .host_fetch import HostFetches

if TYPE_CHECKING:
    from .prefetch import RankIO

CONNECT_TIMEOUT_S = 5.0  # a refused connection (a worker that just died) is retried this long, not Dask's 30 s


class ProcessIO:
    """One asyncio loop thread and one connection pool per process, shared by its streams."""

    _lock = threading.Lock()
    _instance: ProcessIO | None = None

    @classmethod
    def get(cls) -> ProcessIO:
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():  # a forked child gets its own
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self.pid = os.getpid()
        self.channels: dict[tuple[str, str, str, bool], Channel] = {}  # (address, run id, group, relay) -> channel
        self.relays: list = []  # the host relays this process runs (relay.Relay)
        self.lost_workers: dict[str, asyncio.Event] = {}  # address -> set once the scheduler says it is gone
        self.lost_at: dict[str, float] = {}  # address -> when the scheduler said so (monotonic)
        self.inflight: dict[
            tuple, asyncio.Future
        ] = {}  # fetches in flight, shared by identical requests (fetch.fetch_shared)
        self.fetches_shared = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="overlord-consumer-io", daemon=True)
        self.thread.start()
        self.pool = Pool(timeout=CONNECT_TIMEOUT_S)
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """The process ends: stop what still runs on the IO loop (a channel's reader waits on its
        socket for as long as the process lives) and close the connections, so that the loop is
        not torn down at interpreter exit with tasks pending (asyncio logs each as "Task was
        destroyed but it is pending")."""
        if self.pid != os.getpid() or not self.thread.is_alive():
            return

        async def shutdown():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ch in list(self.channels.values()):
                ch.abort()
            for relay in list(self.relays):
                relay.close()
            self.pool.abort_all()

        try:
            self.run(shutdown(), timeout=5)
        except Exception:  # a loop stuck in a callback: the daemon thread dies with the process anyway
            return
        self.loop.call_soon_threadsafe(self.loop.stop)

    def channel(self, address: str, run_id: str, wait: bool = True, group: str = "", relay: bool = False) -> Channel:
        """This process's channel to run ``run_id`` at ``address`` (opened on first use; from
        the IO loop pass ``wait=False`` and await ``opened()``). ``group``: streams that share
        a channel; every stream of the process by default (one connection per process).
        ``relay``: through the host's relay (``relay.py``: one connection per host)."""
        with self._lock:
            key = (address, run_id, group, relay)
            ch = self.channels.get(key)
            if ch is None or ch.closed:
                ch = self.channels[key] = (RelayChannel if relay else Channel)(self, address, run_id, group)
        if wait:
            ch.wait_open()
        return ch

    def lost(self, address: str) -> asyncio.Event:
        """(IO loop) Set when the scheduler reports ``address`` gone (``worker_lost``)."""
        ev = self.lost_workers.get(address)
        if ev is None:
            ev = self.lost_workers[address] = asyncio.Event()
        return ev

    def mark_lost(self, address: str) -> None:
        """(IO loop) The scheduler reports the worker at ``address`` gone (``worker_lost``)."""
        self.lost(address).set()
        self.lost_at[address] = time.monotonic()

    def found(self, addresses, asked_at: float) -> None:
        """(IO loop) The scheduler, asked at ``asked_at``, names ``addresses`` as holding a batch
        now. A loss reported before the question was an earlier worker's at the same address (a
        port used again by a replacement, or by the next service this process connects to): the
        scheduler had removed that worker before it answered. A loss reported after it may be
        of the very worker the answer names, and stays."""
        for address in addresses:
            if self.lost_at.get(address, asked_at) < asked_at:
                self.lost_workers.pop(address, None)
                self.lost_at.pop(address, None)

    def planner(self, address: str) -> PlannerClient:
        """The planner's routes at ``address``, over this process's connection pool."""
        return PlannerClient(self.pool(address))

    def service_info(self, address: str, timeout: float) -> dict:
        """(a trainer thread) The run's ``overlord_info`` at ``address``; ServiceError naming the
        address where no overlord service answers."""
        try:
            self.run(self.pool.prepare(address), timeout=60)
            info = self.run(self.planner(address).info(), timeout=min(timeout, 60))
        except Exception as err:
            raise ServiceError(f"no overlord service at {address}: {err}") from None
        if not isinstance(info, dict):  # the scheduler answers None for an unknown route
            raise ServiceError(f"no overlord service at {address}: the scheduler runs no overlord planner")
        return info

    async def call_worker(
        self, address: str, request: Callable[[object], Awaitable], abort: asyncio.Event | None = None
    ):
        """``request(rpc)`` to a worker, given up the moment the worker is reported gone (or
        ``abort`` is set: the whole service went away): a refused connection is otherwise retried
        for Dask's whole connect timeout (30 s) while the batch waits on a shadow, is rebuilt
        elsewhere, or comes from a restarted service."""
        lost = self.lost(address)
        if lost.is_set() or (abort is not None and abort.is_set()):
            raise OSError(f"worker {address} is gone")
        call = asyncio.ensure_future(request(self.pool(address)))
        stops = [asyncio.ensure_future(ev.wait()) for ev in (lost, abort) if ev is not None]
        try:
            await asyncio.wait({call, *stops}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this call is cancelled (a hedged fetch that gave up)
            for t in stops:
                t.cancel()
            answered = call.done()
            if not answered:
                call.cancel()
        if not answered:
            raise OSError(f"worker {address} is gone")
        return call.result()

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the IO loop and wait for its result (from a trainer thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


class Channel:
    """One batched stream per process and run to the scheduler (``overlord_channel``): the
    scheduler pushes descriptors for the ranks subscribed on it; acks go back one-way. Messages
    are routed to the process's streams by (rank, cp rank)."""

    def __init__(self, io: ProcessIO, address: str, run_id: str, group: str = ""):
        import uuid

        self.io, self.address, self.run_id, self.group = io, address, run_id, group
        self.id = f"overlord-channel-{uuid.uuid4().hex}"
        self.streams: dict[
            tuple[int, int, int], dict[int, RankIO]
        ] = {}  # (rank, cp rank, replica) -> generation -> stream
        self.closed = False
        self._opened = io.spawn(self._open())

    async def opened(self) -> None:
        """(IO loop) Wait until the channel is open; ServiceError if it cannot be."""
        try:
            await asyncio.wrap_future(self._opened)
        except Exception as err:
            raise self._failed(err) from None

    def wait_open(self, timeout: float = 60) -> None:
        try:
            self._opened.result(timeout)
        except Exception as err:
            raise self._failed(err) from None

    def _failed(self, err: Exception) -> ServiceError:
        self.closed = True
        return ServiceError(f"cannot open a channel to the overlord service at {self.address}: {err}")

    async def connect(self):
        """The channel's connection: straight to the scheduler."""
        comm = await self.io.pool.connect(self.address, timeout=60)
        comm.name = "overlord-consumer-channel"
        await comm.write(channel_open(self.id, self.run_id))
        return comm

    async def _open(self) -> None:
        comm = await self.connect()
        self.comm = comm
        self.bs = BatchedWriter(interval=CHANNEL_INTERVAL)
        self.bs.start(comm)
        self.acks = AckMerge(self.bs.send, lambda: sum(len(gens) for gens in self.streams.values()))
        self.host_fetches = HostFetches(self.bs.send) if getattr(comm, "relayed", False) else None
        self._reader = asyncio.ensure_future(self._read())

    def abort(self) -> None:
        """(IO loop) Close the channel's connection now (the process is ending)."""
        self.closed = True
        bs = getattr(self, "bs", None)
        if bs is not None:
            self.acks.drop()
            bs.abort()

    def send(self, msg: dict) -> None:
        """(IO loop) Queue a message for the scheduler; it leaves within a few ms (one-way
        acknowledgements merged per chunk, ``ack_merge.py``)."""
        if msg.get("op") == "ack":
            if self.bs.closed():
                raise ConnectionClosed(f"the channel to {self.address} is closed")
            self.acks.add(row_of(msg))
            return
        self.acks.flush()
        self.bs.send(msg)

    async def _read(self) -> None:
        why = "the scheduler closed the channel"
        try:
            while True:
                msgs = await self.comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    if msg.get("op") == "fetched":  # the host's relay answers a fetch (host_fetch.py)
                        self.host_fetches.answered(msg)
                        continue
                    for stream in self._targets(msg):
                        stream.on_message(msg)
        except Exception as err:  # the scheduler went away: every stream on this channel must hear it
            why = f"lost the connection to the overlord service at {self.address}: {type(err).__name__}: {err}"
        self.closed = True
        self.acks.drop()
        if self.host_fetches is not None:
            self.host_fetches.drop()
        for gens in list(self.streams.values()):
            for stream in list(gens.values()):
                stream.lost(why)

    def _targets(self, msg: dict) -> list:
        """The streams a message is for: those it names (``to``: ``[rank, cp rank, replica,
        generation]`` each), every stream (rank None), or one consumer's, of the message's
        generation (a consumer re-attached in this process has two for a moment)."""
        if msg.get("to") is not None:
            return list(named(self.streams, msg["to"]))
        if msg.get("rank") is None:
            return [s for gens in self.streams.values() for s in gens.values()]
        return of_consumer(self.streams, msg)


class RelayChannel(Channel):
    """A process's channel through its host's relay (``relay.py``), started in this process if
    no process of the host runs one; the same messages both ways. Where the relay's name is
    held by another user, a channel of its own."""

    async def connect(self):
        """The channel's connection: to the host's relay."""
        from .relay import ForeignRelay, join

        try:
            comm = await join(self.io, self.address, self.run_id, self.group)
        except ForeignRelay:
            return await Channel.connect(self)
        comm.relayed = True  # (its relay also hands over payloads its rank's replicas share)
        return comm
