"""Acknowledgements merged per channel: one message per chunk for every consumer on it.

Why: each consumer acknowledges at the end of each chunk, and consumers of one process or host
(a relay, ``relay.py``) end a chunk within moments of each other. Sent as they come, the
scheduler reads a message per consumer and chunk; held until every consumer on the channel has
acknowledged (or ``HOLD_S`` passed), it reads one per channel and chunk, whose rows it takes in
one pass (``scheduler/trainer_routes.py``): ``{"op": "acks", "rows": [[rank, cp_rank, replica,
generation, step, durable_step, wait_s, since_s], ...]}`` (``durable_step`` -1: none saved).

Acknowledgements are one-way and in the background (``commit()``, ``state_dict()`` and
``close()`` send theirs as requests, not through here), so holding them costs the trainers
nothing. Any other message flushes what is held first: the scheduler sees them in the order
they were sent (an acknowledgement after its consumer's unsubscription would count a replica
that left).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

HOLD_S = 0.05  # longest an acknowledgement waits for the channel's other consumers

Key = tuple[int, int, int, int]  # (rank, cp rank, replica, generation)


def row_of(ack: dict) -> list:
    """A one-way ``{"op": "ack", ...}`` message as a row."""
    step = int(ack["step"])
    return [
        int(ack["rank"]),
        int(ack.get("cp_rank", 0)),
        int(ack.get("replica", 0)),
        int(ack.get("generation") or 0),
        step,
        step if ack.get("durable") else -1,
        ack.get("wait_s"),
        ack.get("since_s"),
    ]


class AckMerge:
    """(IO loop) Rows held per consumer, merged (the newest step, the newest durable step), sent
    by ``send(message)`` once ``consumers()`` of them are held or ``HOLD_S`` after the first."""

    def __init__(self, send: Callable[[dict], None], consumers: Callable[[], int]):
        self._send, self._consumers = send, consumers
        self._rows: dict[Key, list] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, row: list) -> None:
        key = (row[0], row[1], row[2], row[3])
        held = self._rows.get(key)
        if held is None:
            self._rows[key] = list(row)
        else:
            held[4] = max(held[4], row[4])
            held[5] = max(held[5], row[5])
            held[6], held[7] = row[6], row[7]
        if len(self._rows) >= self._consumers():
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(HOLD_S, self.flush)

    def flush(self) -> None:
        """Send what is held now (also before any other message on the channel)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._rows:
            rows, self._rows = list(self._rows.values()), {}
            try:
                self._send({"op": "acks", "rows": rows})
            except OSError:  # the channel closed meanwhile: its consumers acknowledge again on the next
                pass

    def drop(self) -> None:
        """The channel is gone: nothing held is sent (each consumer acknowledges again on its new one)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._rows = {}
