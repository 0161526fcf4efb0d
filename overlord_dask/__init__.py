"""overlord-dask: a disaggregated, Dask-based data-loading service for foundation-model training.

One folder per process role: ``plan`` (the declarative data plane) → ``sources`` (formats and
tokenizers, read on workers) → ``planner`` (the algorithm: mix, pack, balance, ledger; no Dask) run
by ``scheduler`` (its Dask side, a scheduler plugin) → ``worker`` (load and constructor tasks, the
batch server) → ``trainer`` (the rank's stream, ``OverlordDataset``). ``loading`` sizes the
loader pools, ``observe`` holds the figures and views, ``service`` starts and drives a run and is
the ``overlord`` command. ``pieces``, ``batch_layout``, ``protocol``, ``client``, ``wire``, ``masked_runs`` and
``snapshots`` are shared by several processes.
"""

from .errors import OverlordError, PlanError, RankError, ReplayError, ServiceError, SourceError

__version__ = "0.1.0"

# Everything else loads on first use (PEP 562). A trainer that only does
# ``from overlord_dask import OverlordDataset`` then imports the trainer side (numpy and Dask's
# comms), not the planner, pyarrow, zarr or pydantic (benchmarks/memory.py: memory per rank).
_LAZY = {
    "RankStream": "trainer.stream",
    "connect": "trainer.stream",
    "OverlordDataset": "trainer.dataset",
    "Service": "service.service",
    "CostModel": "plan",
    "Loading": "plan",
    "Plan": "plan",
    "Source": "plan",
    "Topology": "plan",
    "load_plan": "plan",
    "plan_from_dict": "plan",
    "loss_by_source": "trainer.reporting",
    "StreamOptions": "trainer.options",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'overlord_dask' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CostModel",
    "Loading",
    "OverlordDataset",
    "OverlordError",
    "Plan",
    "PlanError",
    "RankError",
    "RankStream",
    "ReplayError",
    "Service",
    "ServiceError",
    "Source",
    "SourceError",
    "StreamOptions",
    "Topology",
    "connect",
    "load_plan",
    "loss_by_source",
    "plan_from_dict",
]
