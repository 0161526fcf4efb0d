"""One rank's stream of packed micro-batches, fetched ahead in the background (the trainer's thread).

    from torch.utils.data import DataLoader
    from overlord_dask import OverlordDataset

    ds = OverlordDataset(address, rank=rank, dp=world_size)
    for mb in DataLoader(ds, batch_size=None):       # one packed micro-batch at a time
        loss = model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"], labels=mb["labels"])
        ...
        if mb["last_in_step"]:
            optimizer.step()

Why it is shaped this way (a trainer that paid a queue get, a worker fetch, an ack and the
decoding on its own thread every step waited a large share of its time; ``benchmarks/trainer_wait.py``
measures the wait share):

- **Fetch ahead.** A background task (one asyncio loop thread per process, shared by every stream
  in it) receives the rank's batch descriptors, each naming several steps, as the scheduler
  drains them from the rank's ``distributed.Queue`` (pushed on the process's channel the moment
  a batch is built: no polling), fetches the batches straight from the worker that built them
  (several steps per call), decodes them (``wire.decode``: narrow dtypes
  back to what a model expects), converts to torch and pins memory if asked, and parks them in a
  buffer bounded in steps *and* bytes (``prefetch_steps``, ``prefetch_bytes``). ``next()`` is then
  a local hand-over.
- **Acks off the trainer's path.** A step is consumed when the trainer asks for the next one;
  the acknowledgement is sent in the background, once per descriptor (its last step) and
  whenever :meth:`RankStream.commit` or :meth:`RankStream.state_dict` asks (those two wait for
  it, so a checkpoint is exact). A slow rank holds back the service's planning (bounded by the
  plan's ``prefetch_steps``), never anyone's memory.
- **Survives a service restart.** If the connection to the scheduler is lost (the service was
  killed and is restarted from its snapshot, at the same address), the stream reconnects with
  backoff for up to ``reconnect_timeout`` seconds, attaches again and continues where its
  trainer is: steps it already holds or consumed are not fetched again, nothing is skipped.
- **One channel per process, no Dask client per trainer.** Descriptors in and acks out travel
  on one batched stream per process (``overlord_channel``, shared by every rank in the process),
  so the scheduler handles a message per process every few ms, not requests per rank; fetches
  use a shared connection pool (``comm.py``: Dask's wire protocol, without importing Dask). No
  client registration, heartbeats or task bookkeeping for each of thousands of ranks.

Parts: ``connection.py`` (the process's IO loop, connection pool and channels), ``prefetch.py``
(a rank's background side), ``handover.py`` (where the two threads meet); this module is the
trainer's side.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import replace

from ..allocator import keep_freed_memory
from ..errors import RankError, ServiceError
from ..protocol import resolve_address
from . import batches, place
from .checkpointing import Checkpointing
from .connection import ProcessIO
from .handover import HandOver
from .options import StreamOptions
from .prefetch import RankIO
from .reporting import Reporting
from .stalls import why_waiting
from .tensors import for_trainer


class RankStream(Reporting, Checkpointing):
    """Iterator over one rank's micro-batches (numpy by default, torch with ``as_torch=True``).

    A consumer is a data-parallel ``rank`` (of ``dp``; default: the service's), a ``cp_rank``
    where the run uses context parallelism, and a ``replica``: tensor- and pipeline-parallel
    ranks of one data-parallel rank each open a stream with their own replica number and receive
    the identical batches (the service builds them once). The stream attaches to the service
    and starts fetching ahead when it is made; a job restarted from an older checkpoint, or with
    another number of ranks, is served from its checkpoint by ``load_state_dict``.

    How it fetches and shapes batches (prefetch bounds, pinning, the label convention, layout,
    timeouts) is a :class:`~overlord_dask.trainer.options.StreamOptions`, given as ``options=``
    or as its fields' keyword arguments."""

    def __init__(
        self,
        address: str,
        rank: int,
        dp: int | None = None,
        *,
        cp_rank: int | None = None,
        replica: int = 0,
        options: StreamOptions | None = None,
        **option_kwargs,
    ):
        self._where = address  # an address, or a scheduler file read again on every reconnect
        self._address = resolve_address(address)
        self.rank, self.dp, self.cp_rank, self.replica = int(rank), dp, cp_rank, int(replica)
        opts = StreamOptions.make(options, **option_kwargs)
        keep_freed_memory()  # decoded batches reuse freed memory instead of faulting in fresh pages (allocator.py)
        self.io = ProcessIO.get()
        self._closed = False
        self._info = self.io.service_info(self._address, opts.timeout)
        self.cp_rank = place.check(self._info, self._address, place.Place(self.rank, dp, cp_rank, self.replica))
        batches.check_options(opts.labels, self._info.get("cp", 1))
        self.options = replace(opts, pin_memory=opts.pin_memory and _can_pin())
        self.micro_batches = self._info["micro_batches"]
        self.next_step: int | None = None  # first step not yet handed to the trainer (known once attached)
        self._unacked: int | None = None  # last step handed over, not yet finished by the trainer
        self.wait_s: list[float] = []  # seconds next_batch waited for each step
        self.hand: HandOver | None = None
        self.rio: RankIO | None = None
        self._init_reports()  # reporting.py: compute times and reported metrics, sent with the acks
        if self.dp is None or self.dp == self._info["dp"]:
            self._attach()  # batches are fetched ahead from now on; another dp waits for the job's checkpoint

    def _ensure_attached(self) -> None:
        if self.rio is not None:
            return
        if self._closed:
            raise ServiceError(f"rank {self.rank}: the stream is closed")
        world = self._info["dp"]
        if self.dp is not None and self.dp != world:
            raise RankError(
                f"consumer asked for dp={self.dp}, but the service at {self._address} runs dp={world} (a job that "
                "comes back with another number of ranks calls load_state_dict with its checkpoint first: the "
                "service then re-plans from that step for its dp)"
            )
        self._attach()

    def _attach(self) -> None:
        """Join the service as this consumer: it starts after the consumer's last acknowledged step."""
        planner = self.io.planner(self._address)
        att = self.io.run(planner.attach(self.rank, self.cp_rank or 0, self.replica), timeout=60)
        if att.get("error"):
            raise ServiceError(att["error"])
        self.next_step = int(att["first_step"])
        prefetch = max(1, self.options.prefetch_steps or self._info.get("prefetch_steps", 4))
        self.hand = HandOver(
            self.next_step, prefetch, self.options.prefetch_bytes, decode=lambda b: for_trainer(b, self.options)
        )
        self.rio = RankIO(
            self.io,
            self.hand,
            where=self._where,
            address=self._address,
            info=self._info,
            consumer=(self.rank, self.cp_rank, self.replica),
            generation=int(att["generation"]),
            first_step=self.next_step,
            options=self.options,
        )

    @property
    def address(self) -> str:
        """The service's address (a restarted service may be found at another one)."""
        return self.rio.address if self.rio is not None else self._address

    @property
    def info(self) -> dict:
        """The service's ``overlord_info`` (of the run it is attached to now)."""
        return self.rio.info if self.rio is not None else self._info

    @property
    def channel(self):
        """The process's channel to the service that this rank receives on (``connection.Channel``)."""
        return self.rio.channel if self.rio is not None else None

    # ---- iteration (trainer thread) ------------------------------------------------------------
    def steps(self) -> Iterator[dict]:
        """Yield whole steps: ``{"step", "rank", "micro_batches": [...]}``."""
        while True:
            yield self.next_batch()

    def __iter__(self) -> Iterator[dict]:
        for batch in self.steps():
            n = len(batch["micro_batches"])
            times = []  # each micro-batch's compute: from its hand-over to the trainer's next request
            for m, mb in enumerate(batch["micro_batches"]):
                item = dict(mb)
                item.update(step=batch["step"], rank=self.rank, micro_batch=m, last_in_step=m == n - 1)
                t0 = time.perf_counter()
                yield item
                times.append(time.perf_counter() - t0)
            self._iterated(times)

    def eval_batches(self) -> Iterator[dict]:
        """This rank's evaluation micro-batches (the plan's held-out units): a finite stream, the
        same at every call, that leaves the training stream where it is (``evaluation.py``)."""
        from .evaluation import eval_micro_batches

        return eval_micro_batches(self)

    @property
    def timeout(self) -> float:
        return self.options.timeout

    def next_batch(self) -> dict:
        """The next step's batch for this rank; the previous step counts as consumed."""
        self._ensure_attached()
        self._requested()
        finished, self._unacked = self._unacked, None  # (consumed now: finished in the take's lock)
        batch, waited = self.hand.take(self.next_step, self.timeout, self._wake_io, finished=finished)
        if batch is None:
            raise ServiceError(self.hand.error or _why_stalled(self))
        step = batch["step"]  # the next step, or the one after steps the service skips
        self._handed(step)
        self.wait_s.append(waited)
        self._unacked = step
        self.next_step = step + 1
        return batch

    def buffered(self) -> int:
        """Steps fetched ahead and waiting for the trainer."""
        return self.hand.buffered() if self.hand is not None else 0

    def _wake_io(self, room: bool, ack: bool) -> None:
        """Let the prefetcher fetch into the room there is (``room``) and with ``ack`` send the
        acknowledgement of what the trainer finished and its reports (scheduled on the IO loop)."""
        self.io.loop.call_soon_threadsafe(self._io_wake, self.rio, room, ack)

    def _io_wake(self, rio: RankIO, room: bool, ack: bool) -> None:
        if ack:
            self._drain_reports(rio)  # before the ack: both leave in the channel's next batch
        rio.wake(room, ack)

    def _finish_previous(self) -> bool:
        """The step handed out last is consumed; True if it ended a chunk (so the service may
        free its task once acknowledged)."""
        if self._unacked is None:
            return False
        step, self._unacked = self._unacked, None
        return self.hand.finish(step)

    def commit(self) -> None:
        """Acknowledge every step yielded so far (the trainer is done with them); returns once
        the service has the acknowledgement."""
        self._ensure_attached()
        self._finish_previous()
        self._flush()

    def _send_ack(self, durable: bool | None, timeout: float) -> None:
        """Acknowledge what the trainer finished and wait for the answer (its reports go first)."""
        self.io.loop.call_soon_threadsafe(self._drain_reports, self.rio)
        self.io.run(self.rio.send_ack(durable), timeout=timeout)

    def _flush(self, durable: bool | None = None) -> None:
        t0 = time.perf_counter()
        try:
            self._send_ack(durable, min(self.timeout, 120))
        except ServiceError:
            raise
        except Exception as err:
            raise ServiceError(
                f"rank {self.rank}: the service at {self.rio.address} did not take the acknowledgement: {err}"
            ) from None
        finally:
            self._excluding(t0)

    def close(self) -> None:
        if self._closed:
            return
        if self.rio is not None and self.hand.error is None and self.rio.connected.is_set():
            try:  # steps the trainer finished are consumed; the one it holds now is not (it may have died with it)
                self._send_ack(None, 10)
            except Exception:  # the service may be gone; nothing to keep
                pass
        self._stop_background(wait=10)  # nothing of this stream runs on the IO thread once closed

    def _stop_background(self, wait: float | None = None) -> None:
        self._closed = True
        rio = getattr(self, "rio", None)
        if rio is not None:
            rio.stop(wait)

    def __enter__(self) -> RankStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self._stop_background()
        except Exception:  # interpreter shutdown: the loop may be gone
            pass


def _can_pin() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=3)
    return False


def _why_stalled(s: RankStream) -> str:
    try:
        st = s.io.run(s.rio.planner.status(), timeout=10)
    except Exception as err:
        return (
            f"rank {s.rank}: no batch for step {s.next_step} within {s.timeout}s and the service does not answer: {err}"
        )
    why = why_waiting(st, s.rank, s.next_step, s.timeout)
    trouble = s.rio.fetch_trouble.text() if s.rio is not None else None
    return why if trouble is None else f"{why}; {trouble}"


def connect(address: str, rank: int, dp: int | None = None, **kwargs) -> RankStream:
    """A stream of a running service for trainer ``rank`` (a plain iterator of numpy
    micro-batches; ``RankStream``'s keyword arguments)."""
    return RankStream(address, rank, dp, **kwargs)
