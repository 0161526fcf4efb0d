"""overlord-dask: a disaggregated, Dask-based data-loading service for foundation-model training.

Roles (the design card's, see README): ``plan`` (declarative data plane) → ``sources`` + ``loaders`` (load units on
workers) → ``planner`` (scheduler plugin: mix, pack, balance, ledger) → ``constructors`` (packed
micro-batches on workers) → ``consumer`` (trainer-side iterator / IterableDataset). ``service``
wires them together; ``cli`` is the ``overlord`` command.
"""

from .errors import OverlordError, PlanError, RankError, ServiceError, SourceError

__version__ = "0.1.0"

# Everything else loads on first use (PEP 562). A trainer that only does
# ``from overlord_dask import OverlordDataset`` then imports the consumer (numpy and Dask's comms),
# not the planner, pyarrow, zarr or pydantic: ~55 MB less in every rank's process.
_LAZY = {
    "RankStream": "consumer", "connect": "consumer", "OverlordDataset": "dataset", "Service": "service",
    "CostModel": "plan", "Loading": "plan", "Plan": "plan", "Source": "plan", "Topology": "plan",
    "load_plan": "plan", "plan_from_dict": "plan",
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
    "CostModel", "Loading", "OverlordDataset", "OverlordError", "Plan", "PlanError", "RankError", "RankStream",
    "Service", "ServiceError", "Source", "SourceError", "Topology", "connect", "load_plan", "plan_from_dict",
]
