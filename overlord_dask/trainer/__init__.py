"""The trainer side: what a training process imports to receive its batches.

Data flow: one ``connection.ProcessIO`` per process (an IO thread, a connection pool to the
workers, one channel per run to the scheduler) --> per rank a ``prefetch.RankIO`` on that thread
(descriptors in, batches fetched from the workers and decoded, acks out) --> a
``handover.HandOver`` bounded in steps and bytes --> ``stream.RankStream`` on the trainer's
thread (``next_batch``, ``state_dict``) --> ``dataset.OverlordDataset`` (torch). How a stream
fetches and shapes batches is one ``options.StreamOptions``, passed down through every layer;
``reporting`` sends the trainer's step times and metrics back to the planner.

Imports nothing of the planner, the scheduler side, the workers or the service, and nothing of
Dask where the service listens on TCP (``comm.py`` speaks Dask's wire protocol itself; TLS goes
through ``distributed``): a trainer process needs numpy, msgpack and torch, not pyarrow, zarr or
numba.
"""

_LAZY = {"RankStream": ".stream", "connect": ".stream", "OverlordDataset": ".dataset", "StreamOptions": ".options"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
