"""Planning policies behind ``balance.policy``: how a window of steps is chosen from the sources
and laid out over ranks (``base.py`` says what every policy gets and returns)."""

from .base import Policy, Starved, Window
from .cost_balanced import CostBalanced
from .exact import ExactStep

POLICIES: dict[str, type[Policy]] = {"none": ExactStep, "cost": CostBalanced}

__all__ = ["POLICIES", "CostBalanced", "ExactStep", "Policy", "Starved", "Window"]
