"""The declarative data plane: plan models, YAML loading and validation."""

from .loading import load_plan, plan_from_dict, plan_to_dict
from .models import Balance, Checkpoint, CostModel, Loading, Plan, Prepare, Source, Topology
from .schedule import Context, Schedule, Stage

__all__ = [
    "Balance",
    "Checkpoint",
    "Context",
    "CostModel",
    "Loading",
    "Plan",
    "Prepare",
    "Schedule",
    "Source",
    "Stage",
    "Topology",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
]
