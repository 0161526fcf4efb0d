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
  use Dask's comms through a shared connection pool. No client registration, heartbeats or task
  bookkeeping for each of thousands of ranks.

Parts: ``connection.py`` (the process's IO loop, connection pool and channels), ``prefetch.py``
(a rank's background side), ``handover.py`` (where the two threads meet); this module is the
trainer's side.
"""

from __future__ import annotations

import time
import warnings
from typing import Iterator

from ..allocator import keep_freed_memory
from ..errors import RankError, ServiceError
from ..protocol import resolve_address
from .connection import ProcessIO
from .handover import HandOver
from .prefetch import RankIO

STATE_VERSION = 1


class RankStream:
    """Iterator over one rank's micro-batches (numpy by default, torch with ``as_torch=True``).

    ``prefetch_steps`` (default: the plan's ``loading.prefetch_steps``) and ``prefetch_bytes``
    bound the batches held here ahead of the trainer (at least one step is always allowed, so a
    step larger than the byte bound cannot stall). ``pin_memory`` pins torch tensors for fast
    host-to-GPU copies (ignored with a warning where no accelerator is present, as
    ``torch.utils.data.DataLoader`` does)."""

    def __init__(self, address: str, rank: int, dp: int | None = None, *, cp_rank: int | None = None, timeout: float = 600.0,
                 as_torch: bool = False, prefetch_steps: int | None = None, prefetch_bytes: int = 1 << 30, pin_memory: bool = False,
                 reconnect_timeout: float = 120.0):
        where = address  # an address, or a scheduler file read again on every reconnect
        address = resolve_address(address)
        self.rank = int(rank)
        self.cp_rank = cp_rank
        self.timeout = timeout
        self.as_torch = as_torch
        keep_freed_memory()  # decoded batches reuse freed memory instead of faulting in fresh pages (allocator.py)
        self.io = ProcessIO.get()
        self._closed = False
        try:
            info = self.io.run(self.io.planner(address).info(), timeout=min(timeout, 60))
        except Exception as err:
            raise ServiceError(f"no overlord service at {address}: {err}") from None
        if not isinstance(info, dict):  # the scheduler answers None for an unknown route
            raise ServiceError(f"no overlord service at {address}: the scheduler runs no overlord planner")
        world = info["dp"]
        if dp is not None and dp != world:
            raise RankError(f"consumer asked for dp={dp}, but the service at {address} runs dp={world}")
        if not 0 <= self.rank < world:
            raise RankError(f"rank {self.rank} does not exist: the service at {address} has dp={world} ranks (0..{world - 1})")
        cp = info.get("cp", 1)
        if cp > 1 and self.cp_rank is None:
            raise RankError(f"the service at {address} runs context parallelism cp={cp}: pass cp_rank (0..{cp - 1})")
        if self.cp_rank is not None and not 0 <= self.cp_rank < cp:
            raise RankError(f"cp rank {self.cp_rank} does not exist: the service at {address} has cp={cp} (0..{cp - 1})")
        if cp == 1:
            self.cp_rank = None
        self.micro_batches = info["micro_batches"]
        att = self.io.run(self.io.planner(address).attach(self.rank, self.cp_rank or 0), timeout=60)
        if att.get("error"):
            raise ServiceError(att["error"])
        self.next_step = int(att["first_step"])  # first step not yet handed to the trainer
        self._attached_at = self.next_step
        self._unacked: int | None = None  # last step handed over, not yet finished by the trainer
        self.wait_s: list[float] = []  # seconds next_batch waited for each step
        self.hand = HandOver(self.next_step, max(1, prefetch_steps or info.get("prefetch_steps", 4)), prefetch_bytes)
        self.rio = RankIO(self.io, self.hand, where=where, address=address, info=info, rank=self.rank, cp_rank=self.cp_rank,
                          generation=int(att["generation"]), first_step=self.next_step, timeout=timeout,
                          reconnect_timeout=reconnect_timeout, as_torch=as_torch, pin_memory=pin_memory and self._can_pin())

    @property
    def address(self) -> str:
        """The service's address (a restarted service may be found at another one)."""
        return self.rio.address

    @property
    def info(self) -> dict:
        """The service's ``overlord_info`` (of the run it is attached to now)."""
        return self.rio.info

    @property
    def channel(self):
        """The process's channel to the service that this rank receives on (``connection.Channel``)."""
        return self.rio.channel

    @staticmethod
    def _can_pin() -> bool:
        import torch

        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=3)
        return False

    # ---- iteration (trainer thread) ------------------------------------------------------------
    def steps(self) -> Iterator[dict]:
        """Yield whole steps: ``{"step", "rank", "micro_batches": [...]}``."""
        while True:
            yield self.next_batch()

    def __iter__(self) -> Iterator[dict]:
        for batch in self.steps():
            n = len(batch["micro_batches"])
            for m, mb in enumerate(batch["micro_batches"]):
                item = dict(mb)
                item.update(step=batch["step"], rank=self.rank, micro_batch=m, last_in_step=m == n - 1)
                yield item

    def next_batch(self) -> dict:
        """The next step's batch for this rank; the previous step counts as consumed."""
        chunk_done = self._finish_previous()
        batch, waited = self.hand.take(self.next_step, self.timeout, chunk_done, self._wake_io)
        if batch is None:
            raise ServiceError(self.hand.error or self._why_stalled())
        self.wait_s.append(waited)
        self._unacked = self.next_step
        self.next_step += 1
        return batch

    def buffered(self) -> int:
        """Steps fetched ahead and waiting for the trainer."""
        return self.hand.buffered()

    def _wake_io(self, room: bool, ack: bool) -> None:
        """Let the prefetcher fetch into the room there is (``room``) and with ``ack`` send the
        acknowledgement of what the trainer finished (scheduled on the IO loop)."""
        self.io.loop.call_soon_threadsafe(self.rio.wake, room, ack)

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
        self._finish_previous()
        self._flush()

    def _flush(self, durable: bool | None = None) -> None:
        try:
            self.io.run(self.rio.send_ack(durable), timeout=min(self.timeout, 120))
        except ServiceError:
            raise
        except Exception as err:
            raise ServiceError(f"rank {self.rank}: the service at {self.rio.address} did not take the acknowledgement: {err}") from None

    def _why_stalled(self) -> str:
        try:
            st = self.io.run(self.rio.planner.status(), timeout=10)
        except Exception as err:
            return f"rank {self.rank}: no batch for step {self.next_step} within {self.timeout}s and the service does not answer: {err}"
        if st.get("failure"):
            return f"the overlord service failed: {st['failure']}"
        return f"rank {self.rank}: no batch for step {self.next_step} within {self.timeout}s (service status: {st})"

    # ---- state (torchdata StatefulDataLoader style) -------------------------------------------
    def state_dict(self) -> dict:
        """Small and topology-free: the next step this trainer needs. Save it with the trainer's
        own checkpoint; ``load_state_dict`` on a new stream (even after the service restarted from
        its snapshot) skips the steps the trainer had already consumed. With the plan's
        ``checkpoint.commit: checkpoint`` this call also makes those steps durable in the
        service's snapshots, so a whole-system restart resumes exactly at this checkpoint."""
        self._finish_previous()
        self._flush(durable=True)
        return {"version": STATE_VERSION, "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a trainer checkpoint: steps before ``next_step`` are skipped (and
        acknowledged). A trainer that restarted alone while the service kept running gets its
        unacknowledged steps again: attaching already rewound its queue."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"consumer state version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
        target = int(state["next_step"])
        if target < self._attached_at:
            raise ServiceError(
                f"rank {self.rank}: the checkpoint resumes at step {target}, but the service already has every step up to "
                f"{self._attached_at - 1} acknowledged by this rank and cannot send them again; resume from a newer trainer "
                "checkpoint, or run the plan with checkpoint.commit: checkpoint so steps become final only when trainers save"
            )
        if target > self.next_step:
            self.next_step = target
            self.hand.skip_to(target)
            self.io.loop.call_soon_threadsafe(self.rio.wake_acks)

    def close(self) -> None:
        if self._closed:
            return
        if self.hand.error is None and self.rio.connected.is_set():
            try:  # steps the trainer finished are consumed; the one it holds now is not (it may have died with it)
                self.io.run(self.rio.send_ack(), timeout=10)
            except Exception:  # the service may be gone; nothing to keep
                pass
        self._stop_background(wait=10)  # nothing of this stream runs on the IO thread once closed

    def _stop_background(self, wait: float | None = None) -> None:
        self._closed = True
        rio = getattr(self, "rio", None)
        if rio is not None:
            rio.stop(wait)

    def __enter__(self) -> "RankStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self._stop_background()
        except Exception:  # interpreter shutdown: the loop may be gone
            pass


def connect(address: str, rank: int, dp: int | None = None, **kwargs) -> RankStream:
    """Attach to a running service as trainer ``rank`` (plain iterator of numpy micro-batches)."""
    return RankStream(address, rank, dp, **kwargs)
