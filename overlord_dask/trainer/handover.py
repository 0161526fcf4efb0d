"""Where a rank's two threads meet: batches fetched ahead of the trainer, and the trainer's progress.

The IO side (``prefetch.RankIO``, on the process's IO loop) puts fetched batches in, bounded in
steps and bytes; the trainer's thread (``stream.RankStream``) takes them out and reports what it
finished. Every method says which side calls it, and each takes the lock itself: no caller
touches the fields.

Batches wait in their wire form (narrow tokens, one label per piece: a fraction of the decoded
arrays, which hold int64 ids, labels and positions per token); the IO side decodes only the next
few steps ahead (:meth:`HandOver.decode_ahead`: ``DECODE_AHEAD`` steps, after each fetch and
whenever the trainer's take leaves fewer than half of them), so a deep buffer costs the
trainer's process little memory and the trainer's thread still finds its next step decoded. A
step it reaches still in wire form it decodes itself.

Decoding ahead pays while the trainer computes. A trainer that takes steps back to back (away
from :meth:`HandOver.take` less than ``AWAY_TO_DECODE_AHEAD_S`` before its last take: an
evaluation pass, a data-only benchmark, a loop that is ahead of its accelerator) decodes each step
itself and the IO side decodes none ahead: both at once would hand the GIL back and forth at
every numpy call (numpy releases it for arrays of this size), which cost the process more CPU
than the decoding itself. A fetch's steps go in under one lock, with one wake-up of a trainer
that waits for them.

Waking the IO thread is the one cost of a hand-over when the batch is ready (the woken thread
takes the GIL from the trainer), so :meth:`HandOver.take` wakes it once per chunk of steps (to
acknowledge it and fetch into the room it leaves) and otherwise only when the trainer would wait
or the buffer ran empty.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DECODE_AHEAD = 8  # steps kept decoded ahead of the trainer
AWAY_TO_DECODE_AHEAD_S = 0.001  # the IO side decodes ahead for a trainer away from take() this long between steps


class HandOver:
    """Batches of steps from ``first_step`` on, at most ``max_steps`` and ``max_bytes`` ahead
    (one step always, however large)."""

    def __init__(
        self,
        first_step: int,
        max_steps: int,
        max_bytes: int,
        decode: Callable[[dict], dict] = lambda b: b,
        away_to_decode_ahead: float = AWAY_TO_DECODE_AHEAD_S,
    ):
        self._cond = threading.Condition()
        self.away_to_decode_ahead = away_to_decode_ahead
        self.max_steps, self.max_bytes = max_steps, max_bytes
        self.decode = decode  # a fetched (wire-form) batch as the trainer receives it
        self._ready: dict[int, dict] = {}  # step -> batch, fetched (and decoded unless in _raw)
        self._raw: set[int] = set()  # steps of _ready still in wire form
        self._want_decode = False  # a take asked the IO side to decode ahead
        self._sizes: dict[int, int] = {}
        self._ready_bytes = 0
        self._step_bytes = 0  # size of the last step fetched (the byte bound's unit)
        self._want_room = False  # the IO side waits for the trainer to take steps
        self._chunk_ends: set[int] = set()  # last step of each descriptor: acknowledged right away
        self.error: str | None = None
        self.floor = first_step  # nothing below this is fetched (skip_to moves it)
        self._past_skip: dict[int, int] = {}  # first step of a skip the service made -> the step after it
        self.consumed = first_step - 1  # the trainer finished every step up to this one
        # the last step handed to the trainer (it may still be on it) or passed by skip_to: >= consumed
        self.taken = first_step - 1
        self.dropped = 0  # times fetched steps were dropped (rewound): a fetch begun before is not put
        self.wait_total = 0.0  # seconds the trainer waited in take()
        self.t_created = time.perf_counter()
        self._left = self.t_created  # when the trainer's last take returned
        self._away = float("inf")  # how long the trainer was away from take() before its last one

    # ---- the trainer's thread ---------------------------------------------------------------------
    def take(
        self,
        step: int,
        timeout: float,
        wake: Callable[[bool, bool], None],
        finished: int | None = None,
    ) -> tuple[dict | None, float]:
        """Step ``step``'s batch, or that of the step after a skip that covers it (the batch says
        its ``step``; None on an error or a timeout: ``error`` says which) and the
        seconds the trainer waited for it, at most ``timeout``. ``finished``: the step the
        trainer finished before, if any (what :meth:`finish` does, under the same lock as the
        take; if it ended a chunk, the IO side acknowledges it now). ``wake(room, ack)`` (called
        holding the lock; it must only schedule) lets the IO side fetch into the room there is,
        decode ahead and, with ``ack``, acknowledge what the trainer finished."""
        t0 = time.perf_counter()
        self._away = t0 - self._left
        deadline = time.monotonic() + timeout
        with self._cond:
            chunk_done = finished is not None and self._finish(finished)
            step = self._past(step)
            if self._ready and min(self._ready) < step:  # skipped by skip_to
                for s in [s for s in self._ready if s < step]:
                    self._pop(s)
            if step not in self._ready:  # about to wait: the service must hear everything first
                self._wake(wake, ack=chunk_done)
                chunk_done = False
            while step not in self._ready and self.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
                step = self._past(step)  # (a skip may have become known meanwhile)
            raw = step in self._raw
            batch = self._pop(step)
            if batch is not None:
                self.taken = max(self.taken, step)
            decode = (
                bool(self._raw)
                and not self._want_decode
                and self._decoded() < DECODE_AHEAD // 2
                and self._away >= self.away_to_decode_ahead
            )
            if chunk_done or (self._want_room and not self._ready) or decode:
                self._want_decode |= decode
                self._wake(wake, ack=chunk_done, decode=decode)
        if raw and batch is not None:
            batch = self.decode(batch)  # (the IO side had not got to it)
        self._left = time.perf_counter()
        waited = self._left - t0
        self.wait_total += waited
        return batch, waited

    def _wake(self, wake: Callable[[bool, bool], None], ack: bool, decode: bool = False) -> None:
        room, self._want_room = self._want_room, False
        if room or ack or decode:
            wake(room, ack)  # (the IO side decodes ahead at every wake)

    def _decoded(self) -> int:
        """Steps ready and decoded (lock held)."""
        return len(self._ready) - len(self._raw)

    def finish(self, step: int) -> bool:
        """The trainer is done with ``step``; True if it ended a chunk (acknowledge it now)."""
        with self._cond:
            return self._finish(step)

    def _finish(self, step: int) -> bool:
        """(lock held) :meth:`finish`. A chunk's end is forgotten once finished: steps only move
        on (a run of a million steps kept every chunk's end)."""
        self.consumed = max(self.consumed, step)
        if step not in self._chunk_ends:
            return False
        self._chunk_ends.discard(step)
        return True

    def skip_to(self, step: int) -> None:
        """The trainer resumes at ``step`` (its checkpoint): earlier steps count as consumed and
        are neither fetched nor handed over."""
        with self._cond:
            self.floor = step
            self.consumed = max(self.consumed, step - 1)
            self.taken = max(self.taken, step - 1)
            self._chunk_ends = {s for s in self._chunk_ends if s >= step}  # (ends of skipped chunks)

    def skipped(self, steps: list[int] | None) -> None:
        """(the IO side) The service skips steps ``first..last`` (a skip decision; None: no
        skip): a take of ``first`` gets step ``last + 1``."""
        if not steps:
            return
        first, last = steps
        with self._cond:
            self._past_skip[first] = last + 1
            self._cond.notify_all()

    def rewound(self, at: int, replayed: bool) -> bool:
        """(the IO side) The service was rewound to step ``at``: whether this trainer goes on (its
        stream attaches again) rather than failing. It goes on where the next step it takes is
        ``at``, or one past it where ``replayed`` (the steps from ``at`` come out as the first
        time: those it took from the ended attachment are the same). Past a skip's start it
        fails: what it took is no longer the run's. At a skip, the steps fetched from ``at`` on
        are dropped, under the lock the trainer takes them with: they may be skipped ones (going
        on, the new attachment's come instead; failing, none is handed out before the error)."""
        with self._cond:
            position = self._past(self.taken + 1)
            if not replayed:
                for s in [s for s in self._ready if s >= at]:
                    self._pop(s)
                self.dropped += 1
            return position == at or (position > at and replayed)

    def past_skips(self, step: int) -> int:
        """``step``, or the first step after the skips that cover it."""
        with self._cond:
            return self._past(step)

    def _past(self, step: int) -> int:
        while step in self._past_skip:
            step = self._past_skip[step]
        return step

    def buffered(self) -> int:
        """Steps fetched ahead and waiting for the trainer."""
        with self._cond:
            return len(self._ready)

    # ---- the IO side ------------------------------------------------------------------------------
    def room(self) -> int:
        """Steps there is room for: the step bound, and the byte bound at the size of the last
        step fetched (one step until it is known); one step always, however large. At none,
        the trainer's next take wakes the IO side."""
        with self._cond:
            room = self.max_steps - len(self._ready)
            room = min(room, (self.max_bytes - self._ready_bytes) // self._step_bytes if self._step_bytes else 1)
            room = max(room, 1) if not self._ready else room
            if room <= 0:
                self._want_room = True
            return room

    def put(self, steps: list[int], batches: list[dict], sizes: list[int]) -> None:
        """Fetched steps, in wire form (``sizes``: bytes of each), under one lock and with one
        wake-up of a waiting trainer (a wake-up per step handed the GIL back and forth)."""
        with self._cond:
            for step, batch, nbytes in zip(steps, batches, sizes):
                self._step_bytes = nbytes
                if step >= self.floor:
                    self._ready[step] = batch
                    self._raw.add(step)
                    self._sizes[step] = nbytes
                    self._ready_bytes += nbytes
            self._cond.notify_all()

    def decode_ahead(self) -> None:
        """Decode the batches of the next ``DECODE_AHEAD`` steps the trainer will take that are
        still in wire form (outside the lock: the trainer takes decoded steps meanwhile)."""
        with self._cond:
            self._want_decode = False
            if self._away < self.away_to_decode_ahead:
                return  # a trainer taking steps back to back decodes each itself (both at once contend for the GIL)
            todo = [s for s in sorted(self._ready)[:DECODE_AHEAD] if s in self._raw]
        for s in todo:
            with self._cond:
                raw = self._ready.get(s) if s in self._raw else None
            if raw is None:
                continue  # taken (and decoded by the trainer) meanwhile
            batch = self.decode(raw)
            with self._cond:
                if s in self._raw and self._ready.get(s) is raw:
                    self._ready[s] = batch
                    self._raw.discard(s)
                    self._cond.notify_all()

    def chunk_ends_at(self, step: int) -> None:
        """A descriptor's steps end at ``step``: the trainer acknowledges as soon as it is done."""
        with self._cond:
            self._chunk_ends.add(step)

    def forget_chunks(self) -> None:
        """The service restarted: its chunks are cut anew."""
        with self._cond:
            self._chunk_ends.clear()

    def fail(self, message: str) -> None:
        """Tell the trainer (its next or current take) why no batch comes; the first error wins."""
        with self._cond:
            if self.error is None:
                self.error = message
            self._cond.notify_all()

    def _pop(self, step: int) -> dict | None:
        self._raw.discard(step)
        batch = self._ready.pop(step, None)
        if batch is not None:
            self._ready_bytes -= self._sizes.pop(step)
        return batch
