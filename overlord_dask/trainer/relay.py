"""One connection per host: a relay holds the channel to the service for every trainer process
of its host.

Why: torchrun starts a process per GPU, and each process would hold a channel of its own. The
service's work per chunk is per channel (a descriptor goes out once per channel, naming the
consumers it is for; see ``scheduler/channels.py``), so with eight GPUs per host and tensor- or
pipeline-parallel replicas, a channel per process multiplies it. Through a relay the service
handles one connection and one message per chunk for the whole host, whatever its processes
and replicas.

How: the first process of a host that needs a channel to a run binds a Unix socket in Linux's
abstract namespace, named after the user, the service's address, the run and the channel group.
The kernel frees the name when that process ends, so the name is the election: every other
process connects to it, and only processes of the same user are accepted (peer credentials,
both ways). The relay runs on that process's IO loop: it opens the one channel upstream,
forwards what its local processes send (subscriptions, acknowledgements, reports) in its
batches, the acknowledgements merged into one message per chunk for the host
(``ack_merge.py``), and hands each message that comes down to the processes whose consumers it
names. Requests (attach, a ``commit()``'s acknowledgement, ``where``) do not pass through it:
each process makes them itself. Payloads come straight from the workers, once per host for a
rank whose replicas run in several of the host's processes (``host_fetch.py``: the relay
fetches the rank's chunk and hands it over in shared memory).

When the relay's process ends, the others' connections to it break: each process takes it as a
lost channel, as when the service restarts (``prefetch.RankIO.lost``). It attaches again, one
of them binds the name and relays, and each rank goes on from what its trainer consumed: the
service's acknowledgements decide, so no step is lost or repeated. A process whose local
connection breaks is unsubscribed upstream by the relay, as the service would on a closed
channel. Where abstract sockets do not exist (not Linux), or the name is held by another user,
a process opens a channel of its own instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import struct
import sys
import uuid

from ..batched import BatchedWriter
from ..client import channel_open
from ..errors import ConnectionClosed
from ..protocol import CHANNEL_INTERVAL
from .ack_merge import AckMerge, row_of
from .addressing import named, of_consumer
from .comm import Comm
from .host_fetch import SharedPayloads, sweep_dead

logger = logging.getLogger(__name__)

READY = "relay_ready"  # the relay's first message to a local process: its channel upstream is open
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def available() -> bool:
    """Whether relays work here (Linux's abstract Unix sockets)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


def wanted(option: bool | None) -> bool:
    """A stream's ``relay`` option: explicit, or by default where torchrun started several
    processes on this host (``LOCAL_WORLD_SIZE`` > 1)."""
    if option is None:
        try:
            option = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
        except ValueError:
            option = False
    return bool(option) and available()


def name(address: str, run_id: str, group: str) -> str:
    """The relay's socket name for a channel (abstract namespace: a leading NUL)."""
    digest = hashlib.sha1(f"{address}|{run_id}|{group}".encode()).hexdigest()[:20]
    return f"\0overlord-relay-{os.getuid()}-{digest}"


class ForeignRelay(ConnectionClosed):
    """The host's relay name is held by a process of another user: not to be trusted."""


def _same_user(sock: socket.socket | None) -> bool:
    if sock is None:
        return False
    _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid == os.getuid()


def _messages(msgs) -> tuple:
    return msgs if isinstance(msgs, (list, tuple)) else (msgs,)


class _Local:
    """One local process's connection to the relay."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.bs = BatchedWriter(interval=0.0)  # down: as it comes (the service batched it already)
        self.bs.start(comm)

    def send(self, msg: dict) -> None:
        try:
            self.bs.send(msg)
        except OSError:  # it went away; its reader notices
            pass


class Relay:
    """The host's relay for one channel (service address, run, group), on this process's IO
    loop. ``start()`` binds the name (``OSError`` if another process holds it)."""

    def __init__(self, io, address: str, run_id: str, group: str):
        self.io, self.address, self.run_id = io, address, run_id
        self.name = name(address, run_id, group)
        self.id = f"overlord-relay-{uuid.uuid4().hex}"
        self.where: dict[tuple[int, int, int], dict[int, _Local]] = {}  # consumer -> generation -> process
        self.locals: set[_Local] = set()
        self.closed = False
        self.relayed = 0  # messages forwarded upstream (a figure for tests and benchmarks)
        self.payloads = SharedPayloads(io, self._consumers_of)

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path=self.name)
        sweep_dead()  # (once it holds the name: not at every process's try)
        self._up = asyncio.ensure_future(self._open_upstream())

    async def _open_upstream(self) -> None:
        try:
            comm = await self.io.pool.connect(self.address, timeout=60)
            comm.name = "overlord-relay-channel"
            await comm.write(channel_open(self.id, self.run_id))
        except BaseException:  # no service there: free the name, the next process to need it tries anew
            self.close()
            raise
        self.up = comm
        self.bs = BatchedWriter(interval=CHANNEL_INTERVAL)
        self.bs.start(comm)
        self.acks = AckMerge(self.bs.send, lambda: sum(len(gens) for gens in self.where.values()))
        self._reader = asyncio.ensure_future(self._read_upstream())

    # ---- local processes --------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        comm = Comm(reader, writer, "relay-local")
        if not _same_user(writer.get_extra_info("socket")):
            comm.abort()
            return
        try:
            await asyncio.shield(self._up)
        except Exception as err:
            await self._refuse(comm, f"the relay cannot reach the overlord service at {self.address}: {err}")
            return
        if self.closed:
            await self._refuse(comm, "the relay closed")
            return
        try:  # written before the process can be sent anything else: it reads this first, alone
            await comm.write([{"op": READY}])
        except OSError:
            comm.abort()
            return
        local = _Local(comm)
        self.locals.add(local)
        try:
            while True:
                for msg in _messages(await comm.read()):
                    self._up_msg(local, msg)
        except (OSError, asyncio.CancelledError):  # (errors.ConnectionClosed is one)
            pass
        finally:
            self._left(local)

    @staticmethod
    async def _refuse(comm: Comm, why: str) -> None:
        try:
            await comm.write([{"op": "error", "rank": None, "message": why}])
        except OSError:
            pass
        comm.abort()

    def _up_msg(self, local: _Local, msg: dict) -> None:
        op = msg.get("op")
        if op in ("subscribe", "unsubscribe"):
            consumer = (msg["rank"], msg.get("cp_rank", 0), msg.get("replica", 0))
            gens, gen = self.where.setdefault(consumer, {}), msg.get("generation", 0)
            if op == "subscribe":
                gens[gen] = local
            elif gens.get(gen) is local:
                del gens[gen]
            if not gens:
                del self.where[consumer]
        if self.closed:
            return
        if op == "fetch":  # a rank's payload for the host's processes (host_fetch.py)
            self.payloads.serve(local, msg)
            return
        if op == "fetch_done":
            self.payloads.done(local, msg)
            return
        try:
            if op == "acks":  # one message per chunk for the host: held until all its consumers acknowledged
                for row in msg["rows"]:
                    self.acks.add(row)
            elif op == "ack":
                self.acks.add(row_of(msg))
            else:
                self.acks.flush()
                self.bs.send(msg)
            self.relayed += 1
        except OSError:  # upstream is gone: _read_upstream closes the relay
            pass

    def _left(self, local: _Local) -> None:
        """A local process went away: its consumers are unsubscribed upstream (the service
        would have done it when a channel of its own closed)."""
        self.locals.discard(local)
        local.bs.abort()
        self.payloads.left(local)
        for consumer, gens in list(self.where.items()):
            for gen, at in list(gens.items()):
                if at is local:
                    del gens[gen]
                    rank, cp_rank, replica = consumer
                    self._up_msg(
                        local,
                        {"op": "unsubscribe", "rank": rank, "cp_rank": cp_rank, "replica": replica, "generation": gen},
                    )

    def _consumers_of(self, rank_cp: tuple[int, int]) -> int:
        """Consumers (replicas' attachments) of a (rank, cp rank) the relay holds."""
        return sum(len(gens) for (r, c, _), gens in self.where.items() if (r, c) == rank_cp)

    # ---- the service --------------------------------------------------------------------------
    async def _read_upstream(self) -> None:
        why = "the overlord service closed the relay's channel"
        try:
            while True:
                for msg in _messages(await self.up.read()):
                    self._down_msg(msg)
        except Exception as err:
            why = f"lost the connection to the overlord service at {self.address}: {type(err).__name__}: {err}"
        logger.info("host relay %s ends: %s", self.id, why)
        self.close()

    def _down_msg(self, msg: dict) -> None:
        """A message from the service to the local processes it concerns: a descriptor's named
        consumers split by process, a message for every stream to all, a consumer's own to the
        process holding that attachment."""
        if msg.get("to") is not None:
            for local, mine in named(self.where, msg["to"]).items():
                local.send({**msg, "to": mine})
            return
        for local in list(self.locals) if msg.get("rank") is None else of_consumer(self.where, msg):
            local.send(msg)

    def close(self) -> None:
        """(IO loop) Stop relaying: the name is freed and every local process loses its channel
        (and finds the service again, through a new relay)."""
        if self.closed:
            return
        self.closed = True
        if self in self.io.relays:  # (a process that starts relay after relay keeps none it closed)
            self.io.relays.remove(self)
        self.server.close()
        self.payloads.close()
        bs = getattr(self, "bs", None)
        if bs is not None:
            self.acks.drop()
            bs.abort()
        for local in list(self.locals):
            local.bs.abort()
        self.locals.clear()


async def join(io, address: str, run_id: str, group: str, timeout: float = 60) -> Comm:
    """A connection to this host's relay for the channel (started here if no process of the
    host runs one), once the relay's channel to the service is open. ``ConnectionClosed`` if
    the service cannot be reached, or the name is held by another user."""
    where = name(address, run_id, group)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            reader, writer = await asyncio.open_unix_connection(where, limit=1 << 20)
        except (ConnectionRefusedError, FileNotFoundError):
            relay = Relay(io, address, run_id, group)
            try:
                await relay.start()
            except OSError:  # another process of the host bound it first: connect to theirs
                if loop.time() > deadline:
                    raise ConnectionClosed(f"no relay for {address} on this host within {timeout}s") from None
                await asyncio.sleep(0.01)
                continue
            io.relays.append(relay)
            continue
        comm = Comm(reader, writer, "relay")
        if not _same_user(writer.get_extra_info("socket")):
            comm.abort()
            raise ForeignRelay("the host's relay socket is held by another user")
        try:
            first = await asyncio.wait_for(comm.read(), max(1.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            comm.abort()
            raise ConnectionClosed(f"the host's relay did not reach the overlord service at {address}") from None
        msg = _messages(first)[0] if _messages(first) else {}
        if msg.get("op") != READY:
            comm.abort()
            raise ConnectionClosed(msg.get("message") or f"the host's relay refused the connection: {msg}")
        return comm
