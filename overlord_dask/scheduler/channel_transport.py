"""A consumer channel's connection taken over from Dask's comm: read and written by an asyncio
protocol on the scheduler's event loop, in the frames Dask's TCP comms use.

Why: a channel's messages in (acknowledgements, subscriptions, reports) each went through
Dask's ``TCP.read``: a coroutine resumed by Tornado's stream, two stream reads with their
futures, a buffer allocated per message and Dask's deserialization walk: more of the event
loop than parsing the same bytes as they arrive (``benchmarks/RESULTS.md``, the control plane's
transport table). At thousands of hosts a message per host and chunk each way is most of the
control path's cost per host. Here ``data_received`` cuts the frames out of what arrived
and hands each message to the channel's handler at once: no task, no future, one call per
read. Messages out go to the transport as the channel's ``BatchedWriter`` writes them
(``channel_write.write_now`` appends to ``stream.write``, which is the transport's here).

The peer is a consumer process speaking Dask's wire protocol (``trainer/comm.py``, a relay):
it reads and writes the same bytes as before, and learns nothing of the change. Only a plain
TCP comm of Dask's is taken over (``take_over`` declines TLS, Dask's in-process comms, and a
stream with a read or write in flight): those channels stay on Dask's comm
(``channels.RankChannels.serve`` reads them as before).

Taking over, with the public interfaces of Dask's comm and Tornado's stream only: the
stream's socket is duplicated, the bytes the stream had read but nobody consumed are taken from
it (partial reads, until one would wait) and handed to the protocol first, and the Dask comm is
aborted, which closes the stream's own descriptor without shutting the connection down (it
stays open on the duplicate); Dask's server, whose handler this runs in, then neither reads nor
writes the comm again when the handler returns (once the connection ends). Dask aborting the
comm (a scheduler that closes) aborts the connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

from distributed.protocol import dumps
from tornado.iostream import StreamClosedError

from ..errors import ConnectionClosed
from ..trainer.comm import decode, frames_of, prelude

logger = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")


def take_over(comm, on_messages: Callable[[list], None]) -> ChannelConnection | None:
    """``comm``'s connection as a :class:`ChannelConnection` whose messages go to
    ``on_messages(msgs)`` (each message's list, as Dask's ``read`` returns it); None where it is
    left to Dask (not a plain TCP comm, or its stream busy). Call
    :meth:`ChannelConnection.start` (on the event loop) to begin reading."""
    from distributed.comm.tcp import TCP

    stream = getattr(comm, "stream", None)
    if type(comm) is not TCP or stream is None or stream.closed() or stream.reading() or stream.writing():
        return None  # (TLS is a subclass: declined)
    try:
        sock = stream.socket.dup()
    except OSError:
        return None
    # what the stream read and nobody consumed yet, then what the socket holds now: a partial read
    # returns at once while there is any; the first that would wait is where the stream stops
    leftover = bytearray()
    while True:
        try:
            pending = stream.read_bytes(1 << 20, partial=True)
        except StreamClosedError:
            break
        if not pending.done():
            pending.add_done_callback(_failed_as_expected)  # (it fails when the stream closes below)
            break
        if pending.exception() is not None:
            break
        leftover += pending.result()
    # Dask's comm lets go: its stream's descriptor is closed (the duplicate keeps the connection:
    # nothing is shut down), and it reads and writes no more
    comm.abort()
    conn = ChannelConnection(sock, bytes(leftover), on_messages, repr(comm))
    comm.abort = conn.abort  # (Dask's server aborts its comms when it closes: this one's connection goes too)
    return conn


def _failed_as_expected(future) -> None:
    future.exception()  # retrieved: no "exception was never retrieved" when it is collected


class _Stream:
    """What ``channel_write.write_now`` writes to: the transport."""

    __slots__ = ("conn",)

    def __init__(self, conn: ChannelConnection):
        self.conn = conn

    def write(self, data: bytes) -> None:
        self.conn.write_bytes(data)


class ChannelConnection(asyncio.Protocol):
    """The channel's connection: the part of Dask's comm interface a ``BatchedWriter`` uses
    (``stream``, ``write``, ``closed``, ``abort``, ``close``), and ``ended``: a future done
    when the connection is lost."""

    def __init__(self, sock: socket.socket, leftover: bytes, on_messages: Callable[[list], None], name: str):
        self._sock, self._buffer = sock, bytearray(leftover)
        self.on_messages = on_messages
        self.name = name
        self.stream = _Stream(self)
        self.transport: asyncio.Transport | None = None
        self.ended: asyncio.Future | None = None
        self._closed = False
        self._early: list[bytes] = []  # written before the transport exists (the start's moment)

    def __repr__(self) -> str:
        return f"<channel connection {self.name}>"

    async def start(self) -> None:
        """Read from now on (first what Tornado's stream had read)."""
        loop = asyncio.get_running_loop()
        self.ended = loop.create_future()
        await loop.connect_accepted_socket(lambda: self, sock=self._sock)

    # ---- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        early, self._early = self._early, []
        for data in early:
            transport.write(data)
        if self._buffer:
            self.data_received(b"")

    def data_received(self, data) -> None:
        buf = self._buffer
        buf += data
        at, end, msgs = 0, len(buf), []
        try:
            while end - at >= 8:
                (size,) = _U64.unpack_from(buf, at)
                if end - at - 8 < size:
                    break
                frames, rest = frames_of(bytes(buf[at + 8 : at + 8 + size]))  # (a copy: buf moves on)
                stop = at + 8 + size + sum(rest)
                if stop > end:
                    break  # frames Dask sends after the first part are still on their way
                offset = at + 8 + size
                for length in rest:
                    frames.append(bytes(buf[offset : offset + length]))
                    offset += length
                at = stop
                msgs.append(decode(frames))
        except Exception:
            logger.exception("a channel message could not be read; the channel closes: %s", self.name)
            self.abort()
            return
        finally:
            if at:
                del buf[:at]
        if msgs and not self._closed:
            try:
                for m in msgs:
                    self.on_messages(m)
            except Exception:  # a bug in a handler: the channel goes (as the comm's handler would end)
                logger.exception("handling a channel's message failed; the channel closes: %s", self.name)
                self.abort()

    def connection_lost(self, exc) -> None:
        self._closed = True
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(None)

    # ---- the comm interface ------------------------------------------------------------------
    def closed(self) -> bool:
        return self._closed or (self.transport is not None and self.transport.is_closing())

    def write_bytes(self, data: bytes) -> None:
        if self.closed():
            raise ConnectionClosed(f"{self!r} is closed")
        if self.transport is None:
            self._early.append(bytes(data))
        else:
            self.transport.write(data)

    async def write(self, msg, serializers=None, on_error: str = "message") -> int:
        """``msg`` serialized by Dask (a batch ``channel_write.write_now`` declined), framed as
        Dask's ``TCP.write`` frames it."""
        frames = dumps(msg, on_error=on_error)
        self.write_bytes(prelude(frames))
        for f in frames:
            self.write_bytes(f)
        return sum(memoryview(f).nbytes for f in frames)

    def abort(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.abort()
        else:
            self._sock.close()
            if self.ended is not None and not self.ended.done():
                self.ended.set_result(None)

    async def close(self) -> None:
        """Send what is buffered, then close (a FIN, as Dask's close shuts the socket down)."""
        self._closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        if self.ended is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.ended), 5)
            except asyncio.TimeoutError:
                self.abort()
