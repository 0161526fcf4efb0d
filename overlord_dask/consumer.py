"""The trainer side: one rank's stream of packed micro-batches.

    from torch.utils.data import DataLoader
    from overlord_dask import OverlordDataset

    ds = OverlordDataset(address, rank=rank, dp=world_size)
    for mb in DataLoader(ds, batch_size=None):       # one packed micro-batch at a time
        loss = model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"], labels=mb["labels"])
        ...
        if mb["last_in_step"]:
            optimizer.step()

Each rank attaches to the service's scheduler with its own Dask client: the rank's queue yields a
small descriptor (step, batch key, worker address) and the batch itself is fetched from the worker
that built it (``batch_server``), never through the scheduler. A step is acknowledged when the
trainer asks for the first micro-batch of the next step (it has finished the previous one), or
explicitly with :meth:`RankStream.commit`.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
from distributed import Client, Queue

from .batch_server import fetch_batch

from .errors import RankError, ServiceError
from .planner.plugin import rank_queue_name

TENSOR_FIELDS = {
    "input_ids": "long",
    "labels": "long",
    "position_ids": "long",
    "cu_seqlens": "int",
    "sample_ids": "long",
    "source_ids": "int",
    "chunk_ids": "int",
    "epochs": "int",
    "seg_piece": "int",
    "seg_chunk": "int",
}
STATE_VERSION = 1


def _to_torch(mb: dict) -> dict:
    import torch

    out = {}
    for k, v in mb.items():
        if isinstance(v, np.ndarray):
            t = torch.from_numpy(v)
            out[k] = t.long() if TENSOR_FIELDS.get(k) == "long" else t.int()
        else:
            out[k] = v
    return out


class RankStream:
    """Iterator over one rank's micro-batches (numpy by default, torch with ``as_torch=True``)."""

    def __init__(self, address: str, rank: int, dp: int | None = None, *, cp_rank: int | None = None, timeout: float = 600.0,
                 as_torch: bool = False, client: Client | None = None):
        self.address = address
        self.rank = int(rank)
        self.cp_rank = cp_rank
        self.timeout = timeout
        self.as_torch = as_torch
        self._own_client = client is None
        self.client = client or Client(address, direct_to_workers=True, set_as_default=False, timeout=min(timeout, 60))
        try:
            try:
                self.info = self.client.sync(self.client.scheduler.overlord_info)
            except Exception as err:
                raise ServiceError(f"no overlord service at {address}: {err}") from None
            if not isinstance(self.info, dict):  # the scheduler answers None for an unknown route
                raise ServiceError(f"no overlord service at {address}: the scheduler runs no overlord planner")
            world = self.info["dp"]
            if dp is not None and dp != world:
                raise RankError(f"consumer asked for dp={dp}, but the service at {address} runs dp={world}")
            if not 0 <= self.rank < world:
                raise RankError(f"rank {self.rank} does not exist: the service at {address} has dp={world} ranks (0..{world - 1})")
            cp = self.info.get("cp", 1)
            if cp > 1 and self.cp_rank is None:
                raise RankError(f"the service at {address} runs context parallelism cp={cp}: pass cp_rank (0..{cp - 1})")
            if self.cp_rank is not None and not 0 <= self.cp_rank < cp:
                raise RankError(f"cp rank {self.cp_rank} does not exist: the service at {address} has cp={cp} (0..{cp - 1})")
            if cp == 1:
                self.cp_rank = None
            self.micro_batches = self.info["micro_batches"]
            self.queue = Queue(rank_queue_name(self.info["run_id"], self.rank, self.cp_rank or 0), client=self.client)
        except BaseException:
            self.close()
            raise
        self.next_step = int(self.info.get("first_step", 0))  # first step not yet fully yielded
        self.generation = 0  # descriptors of an older generation (before a rewind) are ignored
        self._positioned = False  # True once a state was loaded or a batch received
        self._unacked: int | None = None  # last step fully yielded but not yet acknowledged
        self.wait_s: list[float] = []  # seconds waited for each step's batch

    # ---- iteration ----------------------------------------------------------------------------
    def steps(self) -> Iterator[dict]:
        """Yield whole steps: ``{"step", "rank", "micro_batches": [...]}``."""
        while True:
            yield self.next_batch()

    def __iter__(self) -> Iterator[dict]:
        for batch in self.steps():
            n = len(batch["micro_batches"])
            for m, mb in enumerate(batch["micro_batches"]):
                item = _to_torch(mb) if self.as_torch else dict(mb)
                item.update(step=batch["step"], rank=self.rank, micro_batch=m, last_in_step=m == n - 1)
                yield item

    def next_batch(self) -> dict:
        """The next step's batch for this rank; acknowledges the previous step first."""
        self.commit()
        t0 = time.perf_counter()
        while True:
            try:
                desc = self.queue.get(timeout=self.timeout)
            except TimeoutError:
                raise ServiceError(self._why_stalled()) from None
            if "error" in desc:
                raise ServiceError(f"the overlord service failed: {desc['error']}")
            if desc.get("gen", 0) != self.generation:
                continue  # sent before this trainer's rewind
            if desc["step"] < self.next_step:  # consumed before a restart (see load_state_dict)
                self._ack(desc["step"])
                continue
            if not self._positioned:  # attached mid-run without a state: start where the queue is
                self.next_step = desc["step"]
            break
        self._positioned = True
        if desc["step"] != self.next_step:
            raise ServiceError(f"rank {self.rank} expected step {self.next_step} but the service sent step {desc['step']}")
        batch = fetch_batch(self.client, desc["key"], desc.get("workers", []), self.timeout, self.cp_rank)
        self.wait_s.append(time.perf_counter() - t0)
        self._unacked = self.next_step
        self.next_step += 1
        return batch

    def commit(self) -> None:
        """Acknowledge every step yielded so far (the trainer is done with them)."""
        if self._unacked is None:
            return
        self._ack(self._unacked)
        self._unacked = None

    def _ack(self, step: int, durable: bool | None = None) -> None:
        if durable is None:  # with commit 'ack' every consumed step is durable
            durable = self.info.get("commit", "ack") == "ack"
        resp = self.client.sync(self.client.scheduler.overlord_ack, rank=self.rank, step=step, cp_rank=self.cp_rank or 0, durable=durable)
        if resp.get("error"):
            raise ServiceError(resp["error"])

    def _why_stalled(self) -> str:
        try:
            st = self.client.sync(self.client.scheduler.overlord_status)
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
        self.commit()
        if self.next_step > int(self.info.get("first_step", 0)):
            self._ack(self.next_step - 1, durable=True)
        return {"version": STATE_VERSION, "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a trainer checkpoint: steps before ``next_step`` are skipped; if this
        trainer restarted alone while the service kept running, its unacknowledged steps are
        sent again (a rewind of its queue)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"consumer state version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
        self.next_step = max(self.next_step, int(state["next_step"]))
        self._positioned = True
        resp = self.client.sync(self.client.scheduler.overlord_rewind, rank=self.rank, cp_rank=self.cp_rank or 0, step=self.next_step)
        if resp.get("error") is None:
            self.generation = resp["generation"]

    def close(self) -> None:
        if self._own_client and getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None

    def __enter__(self) -> "RankStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str, rank: int, dp: int | None = None, **kwargs) -> RankStream:
    """Attach to a running service as trainer ``rank`` (plain iterator of numpy micro-batches)."""
    return RankStream(address, rank, dp, **kwargs)


try:
    from torch.utils.data import IterableDataset as _IterableDataset
except ImportError:  # torch is optional for the service side
    _IterableDataset = object


class OverlordDataset(_IterableDataset):
    """``torch.utils.data.IterableDataset`` of one rank's packed micro-batches (torch tensors).

    Use with ``DataLoader(ds, batch_size=None, num_workers=0)``: batches are already built by the
    service, so extra DataLoader workers would only split (and break) the rank's ordered stream.
    """

    def __init__(self, address: str, rank: int, dp: int | None = None, *, cp_rank: int | None = None, timeout: float = 600.0):
        super().__init__()
        self.address, self.rank, self.dp, self.cp_rank, self.timeout = address, rank, dp, cp_rank, timeout
        self._stream: RankStream | None = None

    def __iter__(self):
        import torch.utils.data as tud

        info = tud.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"OverlordDataset(rank={self.rank}) was given to a DataLoader with num_workers={info.num_workers}; "
                "use num_workers=0: the service already builds the batches"
            )
        if self._stream is None:
            self._stream = RankStream(self.address, self.rank, self.dp, cp_rank=self.cp_rank, timeout=self.timeout, as_torch=True)
        return iter(self._stream)

    @property
    def stream(self) -> RankStream:
        if self._stream is None:
            self._stream = RankStream(self.address, self.rank, self.dp, cp_rank=self.cp_rank, timeout=self.timeout, as_torch=True)
        return self._stream

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
