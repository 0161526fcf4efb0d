"""overlord-dask: a disaggregated, Dask-based data-loading service for foundation-model training.

Roles (DESIGN.md): ``plan`` (declarative data plane) → ``sources`` + ``loaders`` (load units on
workers) → ``planner`` (scheduler plugin: mix, pack, balance, ledger) → ``constructors`` (packed
micro-batches on workers) → ``consumer`` (trainer-side iterator / IterableDataset). ``service``
wires them together; ``cli`` is the ``overlord`` command.
"""

from .consumer import OverlordDataset, RankStream, connect
from .errors import OverlordError, PlanError, RankError, ServiceError, SourceError
from .plan import CostModel, Loading, Plan, Source, Topology, load_plan, plan_from_dict
from .service import Service

__version__ = "0.1.0"

__all__ = [
    "CostModel", "Loading", "OverlordDataset", "OverlordError", "Plan", "PlanError", "RankError", "RankStream",
    "Service", "ServiceError", "Source", "SourceError", "Topology", "connect", "load_plan", "plan_from_dict",
]
