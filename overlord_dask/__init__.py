"""overlord-dask: a disaggregated, Dask-based data-loading service for foundation-model training.

Roles (DESIGN.md): ``plan`` (declarative data plane) → ``sources`` + ``loaders`` (load units on
workers) → ``planner`` (scheduler plugin: mix, pack, balance, ledger) → ``constructors`` (packed
micro-batches on workers) → ``consumer`` (trainer-side iterator / IterableDataset). ``service``
wires them together; ``cli`` is the ``overlord`` command.
"""

from .consumer import RankStream, connect
from .errors import OverlordError, PlanError, RankError, ServiceError, SourceError
from .plan import CostModel, Loading, Plan, Source, Topology, load_plan, plan_from_dict
from .service import Service

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "OverlordDataset":  # imports torch: only when a trainer asks for it (workers never do)
        from .dataset import OverlordDataset

        return OverlordDataset
    raise AttributeError(f"module 'overlord_dask' has no attribute {name!r}")

__all__ = [
    "CostModel", "Loading", "OverlordDataset", "OverlordError", "Plan", "PlanError", "RankError", "RankStream",
    "Service", "ServiceError", "Source", "SourceError", "Topology", "connect", "load_plan", "plan_from_dict",
]
