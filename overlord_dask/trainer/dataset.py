"""``OverlordDataset``: one rank's stream as a ``torch.utils.data.IterableDataset``.

In its own module so that importing ``overlord_dask`` (as every Dask worker does to run a load
or constructor task) does not import torch: that cost each worker several seconds at start and
hundreds of MB for nothing. ``overlord_dask.OverlordDataset`` imports it on first use.
"""

from __future__ import annotations

from torch.utils.data import IterableDataset

from .stream import RankStream


class OverlordDataset(IterableDataset):
    """``torch.utils.data.IterableDataset`` of one rank's packed micro-batches (torch tensors).

    Use with ``DataLoader(ds, batch_size=None, num_workers=0)``: batches are already built by the
    service and fetched ahead in the background, so DataLoader workers would only split (and
    break) the rank's ordered stream. ``pin_memory=True`` pins them for CUDA trainers.
    """

    def __init__(self, address: str, rank: int, dp: int | None = None, *, cp_rank: int | None = None, timeout: float = 600.0,
                 prefetch_steps: int | None = None, prefetch_bytes: int = 1 << 30, pin_memory: bool = False, reconnect_timeout: float = 120.0):
        super().__init__()
        self.address, self.rank, self.dp, self.cp_rank, self.timeout = address, rank, dp, cp_rank, timeout
        self.options = {"prefetch_steps": prefetch_steps, "prefetch_bytes": prefetch_bytes, "pin_memory": pin_memory,
                        "reconnect_timeout": reconnect_timeout}
        self._stream: RankStream | None = None

    def __iter__(self):
        import torch.utils.data as tud

        info = tud.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"OverlordDataset(rank={self.rank}) was given to a DataLoader with num_workers={info.num_workers}; "
                "use num_workers=0: the service already builds the batches"
            )
        return iter(self.stream)

    @property
    def stream(self) -> RankStream:
        if self._stream is None:
            self._stream = RankStream(self.address, self.rank, self.dp, cp_rank=self.cp_rank, timeout=self.timeout, as_torch=True, **self.options)
        return self._stream

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
