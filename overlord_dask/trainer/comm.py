"""The trainer's connections to the service: Dask's wire protocol over plain TCP, spoken here,
without importing ``distributed``.

Why: a trainer process talks to the scheduler (its channel, a few requests) and to workers (its
batch fetches), nothing else of Dask. ``import distributed`` costs a trainer about 20 MB of
memory and half a second of start-up in *every* rank's process, for a client, a worker and a
scheduler it never runs (``benchmarks/memory.py`` measures the memory per rank). The protocol it
needs is small and stable:

- a connection starts with a handshake, one message each way (``{"compression", "python",
  "pickle-protocol"}``); this side offers no compression, so the peer sends frames as they are;
- a message is frames behind a prelude: ``u64`` bytes of what follows in one piece, ``u64``
  number of frames, one ``u64`` length per frame, then the frames (the ones beyond that first
  piece are read one by one);
- frame 0 is the message in msgpack; an object serialized out of band (a fetch's batches, a
  :class:`~overlord_dask.wire.Payload`) is a ``{"__Serialized__": i}`` map whose sub-header (in
  msgpack) is frame ``i`` and whose frames follow it (sharded where Dask split a large one);
- a request is ``{"op": route, "reply": True, **arguments}`` and its answer one message; an
  error a handler raised answers ``{"status": "uncaught-error", "exception_text": ...}``.

Addresses other than ``tcp://`` (TLS, Dask's in-process transport) go through ``distributed``'s
own comms, imported then: TLS takes its certificates from Dask's configuration, as every process
of the service does. ``tests/test_control_path.py`` runs a trainer against a real service and
checks that ``distributed`` was never imported.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable

import msgpack

from ..errors import ConnectionClosed
from ..wire import Payload

HANDSHAKE = {"compression": None, "python": tuple(sys.version_info)[:3], "pickle-protocol": 5}
IDLE_CLOSE_S = 60.0  # a pooled connection unused this long is closed (its address may be gone for good)
KEEPALIVE = (10, 2, 10)  # idle s, interval s, probes: a peer gone without a word is noticed in 30 s, as Dask's comms do
_U64 = struct.Struct("<Q")


def native(address: str) -> bool:
    """Whether this module speaks to ``address`` itself (plain TCP) rather than through
    ``distributed``."""
    return address.startswith("tcp://")


def _host_port(address: str) -> tuple[str, int]:
    hostport = address.split("://", 1)[1]
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def _pack_default(obj):
    """Numbers numpy hands out (a rank from an array, say) travel as Python numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot send {type(obj).__name__} to the service: {obj!r}")


def _merged(header: dict, frames: list) -> list:
    """A serialized object's frames, with the shards Dask split a large frame into joined."""
    counts, offsets = header.get("split-num-sub-frames"), header.get("split-offsets")
    if counts is None:
        return list(frames)
    return [b"".join(frames[o : o + n]) if n != 1 else frames[o] for n, o in zip(counts, offsets)]


def decode(frames: list):
    """A message from its frames (``frames[0]`` msgpack, out-of-band objects after it)."""

    def hook(obj: dict):
        offset = obj.get("__Serialized__", 0) if len(obj) == 1 else 0
        if offset > 0:
            header = msgpack.unpackb(frames[offset], use_list=False, strict_map_key=False, raw=False)
            subs = _merged(header, frames[offset + 1 : offset + 1 + header["num-sub-frames"]])
            if any(c is not None for c in header.get("compression", ())):
                raise ConnectionClosed(f"the service sent compressed frames ({header['compression']}), none offered")
            if b"Payload" in header.get("type-serialized", b""):
                return Payload(subs)
            return None  # an error's pickled exception: its text comes beside it
        if len(obj) == 1 and "__Pickled__" in obj:
            return None
        if "__Set__" in obj and "as-list" in obj:  # how Dask's msgpack writes a set
            return set(obj["as-list"])
        return obj

    return msgpack.unpackb(frames[0], object_hook=hook, use_list=False, strict_map_key=False, raw=False)


def encode(msg) -> bytes:
    """``msg`` as one message on the wire (prelude and its one msgpack frame)."""
    return frame(msgpack.packb(msg, use_bin_type=True, default=_pack_default))


def frame(body: bytes) -> bytes:
    """One msgpack frame as a message on the wire, as Dask's TCP comms send it: the size of what
    follows, the number of frames, each frame's size, the frame (the scheduler's channel writes
    use it too: ``scheduler/channel_write.py``)."""
    return prelude([body]) + body


def prelude(frames: list) -> bytes:
    """What goes on the wire before ``frames`` (sent right after it, all of them counted in the
    leading size): the size, the number of frames, each frame's size."""
    lengths = [memoryview(f).nbytes for f in frames]
    head = _U64.pack(len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths)
    return _U64.pack(len(head) + sum(lengths)) + head


def frames_of(head) -> tuple[list, list[int]]:
    """A message's frames that lie in ``head`` (the bytes its leading size counts: the frame
    count, the frames' sizes and the frames Dask sends with them), as views of it, and the sizes
    of the frames that follow ``head`` on the wire (Dask sends large buffers after it)."""
    (n,) = _U64.unpack_from(head, 0)
    lengths = struct.unpack_from(f"<{n}Q", head, 8)
    view, at, frames = memoryview(head), 8 * (n + 1), []
    for i, length in enumerate(lengths):
        if at + length > len(head):
            return frames, list(lengths[i:])
        frames.append(view[at : at + length])
        at += length
    return frames, []


class Comm:
    """One TCP connection to a scheduler or a worker: the part of Dask's ``Comm`` interface the
    trainer uses (``read``, ``write``, ``close``, ``abort``, ``closed``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str):
        self.reader, self.writer, self.address = reader, writer, address
        self.name = ""
        self._closed = False

    def closed(self) -> bool:
        return self._closed

    def reusable(self) -> bool:
        """Open at both ends: an idle pooled connection whose server went away (a service
        restarted at the same address) has read its end or is closing, and a request on it would
        fail. (``closed()`` stays "closed here": callers that abort a comm unless it is closed
        must still release one the other end closed.)"""
        return not (self._closed or self.reader.at_eof() or self.writer.is_closing())

    async def read(self):
        try:
            (first,) = _U64.unpack(await self.reader.readexactly(8))
            frames, rest = frames_of(await self.reader.readexactly(first))
            for length in rest:
                frames.append(await self.reader.readexactly(length))
        except (asyncio.IncompleteReadError, OSError) as err:
            self.abort()
            raise ConnectionClosed(f"connection to {self.address} closed: {type(err).__name__}: {err}") from None
        return decode(frames)

    async def write(self, msg, serializers=None, on_error: str = "raise") -> int:
        if self._closed:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        data = encode(msg)
        try:
            self.writer.write(data)
            await self.writer.drain()
        except OSError as err:
            self.abort()
            raise ConnectionClosed(f"connection to {self.address} closed: {type(err).__name__}: {err}") from None
        return len(data)

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.transport.abort()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass


def _tune(sock: socket.socket) -> None:
    """No Nagle delay for small messages, and TCP keepalive: a channel waits on its socket for
    as long as the run lasts, and a scheduler whose host vanished (no reset ever comes) must
    still end it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, probes = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", probes)):
        if hasattr(socket, name):  # Linux (and recent macOS)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


async def connect(address: str, timeout: float) -> Comm:
    """A connection to ``address`` (``tcp://host:port``), handshake done. A refused connection
    (a worker that just died, a service restarting) is retried until ``timeout``."""
    host, port = _host_port(address)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.01
    while True:
        try:
            left = max(deadline - loop.time(), 0.001)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), left)
            break
        except (OSError, asyncio.TimeoutError) as err:
            if loop.time() + delay >= deadline:
                raise ConnectionClosed(
                    f"timed out connecting to {address} after {timeout}s: {type(err).__name__}: {err}"
                ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        _tune(sock)
    comm = Comm(reader, writer, address)
    await comm.write(HANDSHAKE)
    await asyncio.wait_for(comm.read(), max(deadline - loop.time(), 5.0))  # the peer's handshake
    return comm


class _Requests:
    """``rpc.route(**arguments)``: one request and its answer on a pooled connection to one
    address (what the planner client and the fetches call)."""

    def __init__(self, pool: Pool, address: str):
        self._pool, self._address = pool, address

    def __getattr__(self, route: str) -> Callable[..., Awaitable]:
        if route.startswith("_"):
            raise AttributeError(route)

        async def call(**arguments):
            return await self._pool.request(self._address, route, arguments)

        return call


class Pool:
    """Connections of a trainer process, kept open per address and reused (one request at a time
    on each), the way ``distributed.core.ConnectionPool`` keeps them; non-TCP addresses go to
    such a pool, made on first need."""

    def __init__(self, timeout: float, idle_close_s: float = IDLE_CLOSE_S):
        self.timeout = timeout
        # per address, idle connections and when each went idle (the newest last)
        self._idle: dict[str, list[tuple[Comm, float]]] = {}
        self._dask = None  # distributed's ConnectionPool, for TLS and in-process addresses
        # connections idle longer are closed, and their address forgotten: a long run talks to
        # workers that come and go (autoscaling, replaced jobs), a notebook to service after
        # service, and a socket per address it will never use again would otherwise stay open
        self.idle_close_s = idle_close_s
        self._swept = time.monotonic()

    def __call__(self, address: str):
        return _Requests(self, address) if native(address) else self._dask_pool()(address)

    async def connect(self, address: str, timeout: float):
        """A connection of its own (a channel's stream), not pooled."""
        if native(address):
            return await connect(address, timeout)
        from distributed.comm import connect as dask_connect

        return await dask_connect(address, timeout=timeout, **self._dask_pool().connection_args)

    async def request(self, address: str, route: str, arguments: dict):
        idle = self._idle.get(address)
        comm = None
        while idle and comm is None:
            c, _ = idle.pop()
            if c.reusable():
                comm = c
            else:
                c.abort()  # (its socket's resources)
        if comm is None:
            comm = await connect(address, self.timeout)
        try:
            await comm.write({"op": route, "reply": True, **arguments})
            answer = await comm.read()
        except BaseException:  # a cancelled request leaves the connection mid-message: never reuse it
            comm.abort()
            raise
        now = time.monotonic()
        self._idle.setdefault(address, []).append((comm, now))
        if now - self._swept > self.idle_close_s / 4:
            self.close_idle(now)
        if isinstance(answer, dict) and answer.get("status") == "uncaught-error":
            raise RuntimeError(f"{route} at {address} failed: {answer.get('exception_text')}")
        return answer

    def close_idle(self, now: float | None = None) -> None:
        """Close the connections idle for longer than ``idle_close_s`` and forget addresses left
        with none (asked every quarter of that by :meth:`request`)."""
        now = time.monotonic() if now is None else now
        self._swept = now
        for address in list(self._idle):
            keep = []
            for c, since in self._idle[address]:
                if now - since > self.idle_close_s:
                    c.abort()
                else:
                    keep.append((c, since))
            if keep:
                self._idle[address] = keep
            else:
                del self._idle[address]

    def idle(self) -> dict[str, int]:
        """Idle connections per address."""
        return {a: len(cs) for a, cs in self._idle.items()}

    def abort_all(self) -> None:
        """Close every idle connection (the process is ending)."""
        for comms in self._idle.values():
            for c, _ in comms:
                c.abort()
        self._idle.clear()

    async def prepare(self, address: str) -> None:
        """Ready to reach ``address``: for a non-TCP one, ``distributed``'s pool is made here."""
        if native(address) or self._dask is not None:
            return
        from distributed.core import ConnectionPool
        from distributed.security import Security

        from ..wire import register_payload_with_dask

        register_payload_with_dask()
        # TLS when Dask's config holds certificates (as the service's own processes do)
        pool = ConnectionPool(
            limit=4096, connection_args=Security().get_connection_args("client"), timeout=self.timeout
        )
        await pool.start()
        self._dask = pool

    def _dask_pool(self):
        if self._dask is None:
            raise ConnectionClosed("no connection pool for non-TCP addresses: Pool.prepare(address) first")
        return self._dask
