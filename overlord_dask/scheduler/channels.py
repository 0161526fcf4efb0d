"""Rank channels: how built batches' descriptors reach the trainers, on the scheduler's loop.

Each (rank, cp rank) has a ``distributed.Queue`` (named in ``protocol.py``) that holds the
descriptors of its built batches (a constructor task's key, its steps, the workers holding it).
A consumer process opens one stream per run (``overlord_channel``), shared by its ranks, and
subscribes each of its ranks; descriptors are then pushed to it as constructor tasks finish,
batched every few ms (``BatchedSend``) in both directions, so the event loop handles a message
per process and interval, not a request per rank. Only the newest attachment of a rank is
subscribed (a generation counts attachments): a consumer that died or closed cannot take what
its successor needs.
"""

from __future__ import annotations

from distributed.batched import BatchedSend
from distributed.comm import CommClosedError

from ..protocol import CHANNEL_INTERVAL, rank_queue_name


def send(bs: BatchedSend, msg: dict) -> bool:
    """Queue ``msg`` on a consumer channel; False if that process is gone (nothing to tell)."""
    try:
        bs.send(msg)
        return True
    except CommClosedError:
        return False


class RankChannels:
    def __init__(self, queues, owner: str, run_id: str, dp: int, cp: int):
        self.queues, self.owner, self.run_id = queues, owner, run_id  # the scheduler's queue extension
        self.names = {(r, j): rank_queue_name(run_id, r, j) for r in range(dp) for j in range(cp)}
        for name in self.names.values():
            queues.create(name=name, client=owner)
        self.generation: dict[tuple[int, int], int] = {}  # (rank, cp rank) -> generation of its queue
        self.streams: dict[str, BatchedSend] = {}  # consumer process channel id -> its stream
        self.subs: dict[tuple[int, int], str] = {}  # (rank, cp rank) -> channel id its descriptors go to
        self.put_count = 0  # descriptors put (control-path traffic)

    # ---- descriptors ----------------------------------------------------------------------------
    def descriptor(self, key: str, task: dict, rank: int, cp_rank: int) -> dict:
        return {"key": key, "steps": task["steps"], "workers": task["workers"], "gen": self.generation.get((rank, cp_rank), 0),
                "run_id": self.run_id}

    def put(self, rank: int, cp_rank: int, item: dict) -> None:
        """``item`` (a descriptor, or ``{"error": ...}``) into the rank's queue, and on to its subscriber."""
        q = self.queues.queues.get(self.names[(rank, cp_rank)])
        if q is not None:
            q.put_nowait({"type": "msgpack", "value": item})
            self.put_count += "error" not in item
            self.drain((rank, cp_rank))

    def drain(self, key: tuple[int, int]) -> None:
        """Move everything waiting in the rank's queue to its subscriber, if it has one."""
        bs = self.streams.get(self.subs.get(key, ""))
        q = self.queues.queues.get(self.names[key])
        if bs is None or q is None or q.empty():
            return
        items = []
        while not q.empty():
            items.append(q.get_nowait()["value"])
        if not send(bs, {"op": "descriptors", "rank": key[0], "cp_rank": key[1], "generation": self.generation.get(key, 0), "items": items}):
            self.subs.pop(key, None)  # the process went away; whoever attaches next gets them again

    def broadcast(self, msg: dict) -> None:
        """``msg`` to every consumer process's channel."""
        for bs in list(self.streams.values()):
            send(bs, msg)

    # ---- consumer processes ---------------------------------------------------------------------
    async def serve(self, comm, channel_id: str, on_ack) -> None:
        """A consumer process's stream, until it closes: its ranks' subscriptions and acks in
        (``on_ack(stream, **ack)``), descriptors out. Batching both ways every few ms means the
        event loop handles a message per process and interval, not a request per rank (at dp 256
        that was two RPCs per (chunk, rank), in bursts of hundreds of handler calls in one loop
        iteration)."""
        bs = self._open(channel_id, comm)
        try:
            while not comm.closed():
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    op = msg.pop("op", None)
                    if op == "ack":
                        on_ack(bs, **msg)
                    elif op == "subscribe":
                        self.subscribe(channel_id, **msg)
                    elif op == "unsubscribe":
                        self.unsubscribe(channel_id, **msg)
        except (CommClosedError, OSError):
            pass
        finally:
            self._closed(channel_id, bs)

    def _open(self, channel_id: str, comm) -> BatchedSend:
        bs = BatchedSend(interval=CHANNEL_INTERVAL)
        bs.start(comm)
        self.streams[channel_id] = bs
        return bs

    def _closed(self, channel_id: str, bs: BatchedSend) -> None:
        """A consumer process's stream ended: its ranks are unsubscribed."""
        self.streams.pop(channel_id, None)
        for key in [k for k, cid in self.subs.items() if cid == channel_id]:
            del self.subs[key]
        bs.abort()

    def subscribe(self, channel_id: str, rank: int, cp_rank: int = 0, generation: int = 0, **_) -> None:
        """Push (rank, cp rank)'s descriptors to this channel from now on (its newest attachment only)."""
        key = (rank, cp_rank)
        if key in self.names and self.generation.get(key, 0) == generation:
            self.subs[key] = channel_id
            self.drain(key)

    def unsubscribe(self, channel_id: str, rank: int, cp_rank: int = 0, generation: int = 0, **_) -> None:
        key = (rank, cp_rank)
        if self.subs.get(key) == channel_id and self.generation.get(key, 0) == generation:
            del self.subs[key]

    def reattach(self, rank: int, cp_rank: int) -> int:
        """A consumer attaches as (rank, cp rank): a new generation; the previous consumer's
        subscription ends, and it is told so instead of waiting for batches that now go elsewhere."""
        gen = self.generation.get((rank, cp_rank), 0) + 1
        self.generation[(rank, cp_rank)] = gen
        old = self.streams.get(self.subs.pop((rank, cp_rank), ""))
        if old is not None:
            send(old, {"op": "error", "rank": rank, "cp_rank": cp_rank, "generation": gen - 1,
                       "message": f"another consumer attached as rank {rank}" + (f" cp rank {cp_rank}" if cp_rank else "")
                       + "; this one no longer receives batches (one consumer per rank)"})
        return gen

    async def close(self, message: str) -> None:
        """The run stops: every consumer process hears it, the streams close, the queues go."""
        self.broadcast({"op": "error", "rank": None, "message": message})
        for bs in list(self.streams.values()):
            try:
                await bs.close(timeout=2)
            except Exception:
                pass
        for name in self.names.values():
            self.queues.release(name=name, client=self.owner)
