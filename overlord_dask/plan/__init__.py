"""The declarative data plane: plan models, YAML loading and validation."""

from .loading import load_plan, plan_from_dict, plan_to_dict
from .models import Balance, Checkpoint, CostModel, Loading, Plan, Source, Topology

__all__ = ["Balance", "Checkpoint", "CostModel", "Loading", "Plan", "Source", "Topology", "load_plan", "plan_from_dict", "plan_to_dict"]
