"""Rank channels: how built batches' descriptors reach the trainers, on the scheduler's loop.

A consumer process (or a host's relay, ``trainer/relay.py``, for every process of its host)
opens one stream per run (``overlord_channel``) and subscribes its consumers on it. When a
constructor task is built, its descriptor (the task's key, its steps, the workers holding it)
goes out once per channel, naming the consumers it is for: the event loop's work per chunk is
a message per channel (per host, with relays), not one per rank and replica. Messages are
batched every few ms (``batched.BatchedWriter``) in both directions; a batch out is written to
its comm at once, without a task (``channel_write.py``).

A consumer is a (rank, cp rank, replica): the tensor- and pipeline-parallel ranks of one
data-parallel rank are replicas that receive the same descriptors, each on its own
subscription (the batch is built once). Only the newest attachment of a consumer is subscribed
(a generation counts attachments), so a consumer that died or closed cannot take what its
successor needs; a subscription starts with every built batch the consumer still needs
(``backlog``, from the tasks the scheduler holds), so nothing built before it subscribed is lost,
and nothing is held per rank while nobody is subscribed.
"""

from __future__ import annotations

from collections.abc import Callable

from ..batched import BatchedWriter
from ..protocol import CHANNEL_INTERVAL
from .channel_transport import take_over
from .channel_write import write_now

Consumer = tuple[int, int, int]  # (rank, cp rank, replica)


def send(bs: BatchedWriter, msg: dict) -> bool:
    """Queue ``msg`` on a consumer channel; False if that process is gone (nothing to tell)."""
    try:
        bs.send(msg)
        return True
    except OSError:  # the stream is closed (errors.ConnectionClosed)
        return False


def tell(bs: BatchedWriter, consumer: Consumer, generation: int | None, message: str, **extra) -> bool:
    """An ``error`` message to one consumer's attachment (``generation``) on its channel, with
    ``extra`` fields (``rewound_to``); False if that process is gone."""
    rank, cp_rank, replica = consumer
    msg = {"op": "error", "rank": rank, "cp_rank": cp_rank, "replica": replica, "generation": generation}
    return send(bs, {**msg, "message": message, **extra})


class RankChannels:
    """``backlog(consumer)``: the descriptors a newly subscribed consumer needs (every built batch
    from its first step on); ``on_leave(consumer)``: a subscribed consumer's process went away."""

    def __init__(
        self,
        dp: int,
        cp: int,
        *,
        backlog: Callable[[Consumer], list[dict]],
        on_leave: Callable[[Consumer], None] = lambda c: None,
    ):
        self.dp, self.cp = dp, cp
        self.backlog, self.on_leave = backlog, on_leave
        self.generation: dict[Consumer, int] = {}  # consumer -> generation of its newest attachment
        self.streams: dict[str, BatchedWriter] = {}  # consumer process channel id -> its stream
        self.subs: dict[tuple[int, int], dict[int, str]] = {}  # (rank, cp rank) -> replica -> channel id
        self.on_channel: dict[str, set[Consumer]] = {}  # channel id -> the consumers subscribed on it (subs, inverted)
        # consumer -> (generation a rewind ended, its step, whether the steps from there are replayed unchanged)
        self.rewound: dict[Consumer, tuple[int, int, bool]] = {}
        self.put_count = 0  # descriptors handed out, one per rank (control-path traffic)

    # ---- descriptors ----------------------------------------------------------------------------
    @staticmethod
    def descriptor(key: str, task: dict, run_id: str) -> dict:
        """What a rank needs to fetch a chunk's steps (and, after skipped steps, which: it goes on past them)."""
        desc = {"key": key, "steps": task["steps"], "workers": task["workers"], "run_id": run_id}
        if task.get("skip"):
            desc["skip"] = task["skip"]
        return desc

    def deliver(self, lo: int, hi: int, item: dict) -> None:
        """``item`` (a descriptor, or ``{"error": ...}``) to the subscribed consumers of ranks
        ``[lo, hi)``, every cp rank: one message per channel, naming its consumers
        (``[rank, cp rank, replica, generation]``)."""
        by_channel: dict[str, list] = {}
        gen = self.generation
        for rank in range(lo, hi):
            for cp_rank in range(self.cp):
                subs = self.subs.get((rank, cp_rank))
                if subs:
                    for replica, channel_id in subs.items():
                        to = by_channel.get(channel_id)
                        if to is None:
                            to = by_channel[channel_id] = []
                        to.append((rank, cp_rank, replica, gen.get((rank, cp_rank, replica), 0)))
        if "error" not in item:
            self.put_count += (hi - lo) * self.cp
        for channel_id, to in by_channel.items():
            bs = self.streams.get(channel_id)
            if bs is None or not send(bs, {"op": "descriptors", "to": to, "items": [item]}):
                for rank, cp_rank, replica, _ in to:  # the process went away; its successor gets them again
                    self._drop((rank, cp_rank, replica), channel_id)

    def _send_items(self, consumer: Consumer, channel_id: str, items: list[dict]) -> None:
        rank, cp_rank, replica = consumer
        bs = self.streams.get(channel_id)
        msg = {"op": "descriptors", "to": [(rank, cp_rank, replica, self.generation.get(consumer, 0))], "items": items}
        if bs is None or not send(bs, msg):
            self._drop(consumer, channel_id)  # the process went away; its successor gets them again

    def broadcast(self, msg: dict) -> None:
        """``msg`` to every consumer process's channel."""
        for bs in list(self.streams.values()):
            send(bs, msg)

    # ---- consumer processes ---------------------------------------------------------------------
    async def serve(self, comm, channel_id: str, on_ack, on_feedback=None, on_acks=None) -> None:
        """A consumer process's stream, until it closes: its consumers' subscriptions, acks
        (``on_ack(stream, **ack)``; merged per chunk, ``on_acks(stream, rows)``: see
        ``trainer/ack_merge.py``) and reports (``on_feedback(stream, **report)``) in,
        descriptors out."""
        bs: BatchedWriter | None = None

        def handle(msgs) -> None:
            for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                op = msg.pop("op", None)
                if op == "acks":
                    if on_acks is not None:
                        on_acks(bs, msg.get("rows") or ())
                elif op == "ack":
                    on_ack(bs, **msg)
                elif op == "feedback":
                    if on_feedback is not None:
                        on_feedback(bs, **msg)
                elif op == "subscribe":
                    self.subscribe(channel_id, **msg)
                elif op == "unsubscribe":
                    self.unsubscribe(channel_id, **msg)

        conn = take_over(comm, handle)  # read as it arrives, without Dask's comm (channel_transport.py)
        bs = self._open(channel_id, conn or comm)
        try:
            if conn is not None:
                await conn.start()
                await conn.ended
            while not comm.closed():
                handle(await comm.read())
        except OSError:  # (Dask's CommClosedError is one)
            pass
        finally:
            self._closed(channel_id, bs)

    def _open(self, channel_id: str, comm) -> BatchedWriter:
        bs = BatchedWriter(interval=CHANNEL_INTERVAL, write_now=write_now)
        bs.start(comm)
        self.streams[channel_id] = bs
        return bs

    def _closed(self, channel_id: str, bs: BatchedWriter) -> None:
        """A consumer process's stream ended: its consumers are unsubscribed (those on this
        channel only: at thousands of ranks, a scan of every subscription per closed channel
        made a whole job's exit quadratic)."""
        self.streams.pop(channel_id, None)
        for consumer in sorted(self.on_channel.pop(channel_id, ())):
            if self._drop(consumer, channel_id):
                self.on_leave(consumer)
        bs.abort()

    def _add(self, consumer: Consumer, channel_id: str) -> None:
        rank, cp_rank, replica = consumer
        self._drop(consumer, self.subs.get((rank, cp_rank), {}).get(replica, ""))
        self.subs.setdefault((rank, cp_rank), {})[replica] = channel_id
        self.on_channel.setdefault(channel_id, set()).add(consumer)

    def _drop(self, consumer: Consumer, channel_id: str) -> bool:
        """End ``consumer``'s subscription if it is on ``channel_id``; True if it was."""
        rank, cp_rank, replica = consumer
        subs = self.subs.get((rank, cp_rank), {})
        if not channel_id or subs.get(replica) != channel_id:
            return False
        del subs[replica]
        on = self.on_channel.get(channel_id)
        if on is not None:
            on.discard(consumer)
        return True

    def subscribe(
        self, channel_id: str, rank: int, cp_rank: int = 0, generation: int = 0, replica: int = 0, **_
    ) -> None:
        """Push the consumer's descriptors to this channel from now on (its newest attachment
        only), starting with every built batch it still needs."""
        consumer = (rank, cp_rank, replica)
        if not self.exists(rank, cp_rank):
            return
        if self.generation.get(consumer, 0) != generation:
            ended = self.rewound.get(consumer)
            bs = self.streams.get(channel_id)
            if ended is not None and ended[0] == generation and bs is not None:
                # a rewind ended this attachment before its subscription came: say so (the
                # consumer at the rewind's step attaches again)
                tell(bs, consumer, generation, "the run was rewound", rewound_to=ended[1], replayed=ended[2])
            return
        self._add(consumer, channel_id)
        self._send_items(consumer, channel_id, self.backlog(consumer))

    def unsubscribe(
        self, channel_id: str, rank: int, cp_rank: int = 0, generation: int = 0, replica: int = 0, **_
    ) -> None:
        if self.generation.get((rank, cp_rank, replica), 0) == generation and self._drop(
            (rank, cp_rank, replica), channel_id
        ):
            self.on_leave((rank, cp_rank, replica))

    def reattach(self, consumer: Consumer) -> int:
        """A consumer attaches: a new generation; its previous attachment's subscription ends,
        and it is told so instead of waiting for batches that now go elsewhere."""
        rank, cp_rank, replica = consumer
        gen = self.generation.get(consumer, 0) + 1
        self.generation[consumer] = gen
        old_id = self.subs.get((rank, cp_rank), {}).get(replica, "")
        self._drop(consumer, old_id)
        old = self.streams.get(old_id)
        if old is not None:
            who = (
                f"rank {rank}" + (f" cp rank {cp_rank}" if cp_rank else "") + (f" replica {replica}" if replica else "")
            )
            tell(
                old,
                consumer,
                gen - 1,
                f"another consumer attached as {who}; this one no longer receives batches (one consumer per rank "
                "and replica)",
            )
        return gen

    def exists(self, rank: int, cp_rank: int) -> bool:
        return 0 <= rank < self.dp and 0 <= cp_rank < self.cp

    def end_all(
        self,
        message: str,
        dp: int | None = None,
        cp: int | None = None,
        rewound_to: int | None = None,
        replayed: bool = False,
    ) -> None:
        """Every subscribed consumer's stream ends with ``message``, and no earlier attachment
        counts any more (their acks are refused); with ``dp``/``cp``, for a new topology (a job
        that came back with another number of ranks). ``rewound_to``: the step the service
        hands out next (a rewind with the same ranks): a consumer whose trainer is at that very
        step attaches again and goes on (a rank of the restarted job that attached before
        another rank's rewind), and with ``replayed`` (the steps from there come out as the
        first time) also one past it (its trainer took them from the ended attachment before
        this message came); any other fails, telling its trainer why."""
        extra = {} if rewound_to is None else {"rewound_to": rewound_to, "replayed": replayed}
        for (rank, cp_rank), subs in self.subs.items():
            for replica, channel_id in subs.items():
                bs = self.streams.get(channel_id)
                if bs is not None:
                    consumer = (rank, cp_rank, replica)
                    tell(bs, consumer, self.generation.get(consumer, 0), message, **extra)
        self.subs.clear()
        self.on_channel.clear()
        for consumer in self.generation:
            if rewound_to is not None:
                self.rewound[consumer] = (self.generation[consumer], rewound_to, replayed)
            self.generation[consumer] += 1
        if dp is not None:
            self.dp, self.cp = dp, cp or 1

    def current(self, consumer: Consumer, generation: int) -> bool:
        """Whether ``generation`` is the consumer's newest attachment."""
        return self.generation.get(consumer, 0) == generation

    async def close(self, message: str, resumable: bool = False) -> None:
        """The run stops: every consumer process hears it and the streams close.
        ``resumable``: its snapshots let a restarted service continue it (consumers wait for it)."""
        self.broadcast({"op": "error", "rank": None, "message": message, "resumable": resumable})
        for bs in list(self.streams.values()):
            try:
                await bs.close(timeout=2)
            except Exception:
                pass
