"""A batched message stream for the consumer channels, both ways: a message queued after a
quiet spell leaves at once, and the ones queued within ``interval`` seconds of a batch leave
together with the next, one write at a time.

Why not ``distributed.batched.BatchedSend``: its sender waits for the next batch with a
timeout, and every batch it sends ends in a ``TimeoutError`` raised and caught, whose traceback
and frames form a reference cycle. With a channel per trainer process (hundreds of them on the
scheduler at thousands of ranks) that is hundreds of cycles a second; the cyclic garbage
collector then runs full collections often, each holding the scheduler's event loop for a
long time. Here a batch is a timer callback (``call_later``) and a write task, and nothing is
raised when nothing is wrong.

The interface is the part of ``BatchedSend`` that the channels use: ``start(comm)``,
``send(msg)`` (``errors.ConnectionClosed``, an ``OSError``, once the stream is gone), ``abort()``
and ``close()``. It writes to Dask's comms (the scheduler's side) and to the trainer's own
(``trainer/comm.py``), so it imports nothing of Dask.

A comm's ``write`` is a coroutine, so each batch costs a task. Given ``write_now(comm, batch)``
(the scheduler's channels: ``scheduler/channel_write.py``), a batch that function can write
synchronously leaves without one: at thousands of channels, making a task per batch was a
large share of the scheduler's event loop per chunk. A batch it declines (False) goes the
comm's way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .errors import ConnectionClosed

logger = logging.getLogger(__name__)


class BatchedWriter:
    def __init__(self, interval: float, write_now: Callable[[object, list], bool] | None = None):
        self.interval = float(interval)  # seconds
        self._write_now = write_now  # writes a batch at once (True), or declines it (False)
        self.comm = None
        self.buffer: list = []
        self.batch_count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_ok = 0.0  # loop time before which no batch leaves (a batch left less than interval ago)

    def start(self, comm) -> None:
        self.comm = comm
        self._loop = asyncio.get_running_loop()

    def closed(self) -> bool:
        return self._closed or self.comm is None or self.comm.closed()

    def send(self, *msgs) -> None:
        """Queue ``msgs``; they leave with the next batch (at once after a quiet spell)."""
        if self.closed():
            raise ConnectionClosed(f"{self.comm!r} is closed")
        self.buffer.extend(msgs)
        if self._timer is None and self._writing is None:
            self._schedule()

    def _schedule(self) -> None:
        self._timer = self._loop.call_at(max(self._next_ok, self._loop.time()), self._flush)

    def _flush(self) -> None:
        self._timer = None
        if not self.buffer or self._closed:
            return
        payload, self.buffer = self.buffer, []
        self.batch_count += 1
        self._next_ok = self._loop.time() + self.interval
        if self._write_now is not None:
            try:
                if self._write_now(self.comm, payload):
                    return
            except OSError:  # closed (errors.ConnectionClosed)
                self._closed = True
                return
        self._writing = asyncio.ensure_future(self._write(payload))

    async def _write(self, payload: list) -> None:
        try:
            await self.comm.write(payload, on_error="raise")
        except OSError:  # closed (Dask's CommClosedError is one)
            self._closed = True
        except Exception:  # an unserialisable message: the stream cannot go on
            logger.exception("a batched channel write failed; the channel closes")
            self.abort()
        finally:
            self._writing = None
        if self.buffer and not self._closed and self._timer is None:
            self._schedule()

    async def _drain(self) -> None:
        while self._timer is not None or self._writing is not None:
            if self._timer is not None:
                self._timer.cancel()
                self._flush()
            if self._writing is not None:
                await asyncio.shield(self._writing)

    def abort(self) -> None:
        """Stop now: queued messages are dropped and the comm is aborted."""
        self._closed = True
        self.buffer = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.comm is not None and not self.comm.closed():
            self.comm.abort()

    async def close(self, timeout: float | None = None) -> None:
        """Send what is queued (also what was queued while a write was in flight: the run's
        last message to its consumers, say), then close the comm."""
        try:
            await asyncio.wait_for(self._drain(), timeout)
        except (asyncio.TimeoutError, OSError):
            pass
        self._closed = True
        if self.comm is not None and not self.comm.closed():
            await self.comm.close()
