"""The planner: mixing, packing, assignment, ledger and metrics, run inside a scheduler plugin.

Data flow: lengths of loaded units (reported by the load tasks) --> streams (per-source order and
cursor) --> windows planned ahead (``balance``: weighted fair selection, cost balancing; or
``mixing`` + ``assign`` with policy ``none``) --> steps handed out in chunks within the prefetch
bound --> ledger and metrics --> constructor tasks for the driver to submit; built chunks'
descriptors go to the ranks' queues (``plugin``).
"""

from ..protocol import HANDLERS, rank_queue_name
from .plugin import PlannerPlugin
from .state import PlannerState

__all__ = ["HANDLERS", "PlannerPlugin", "PlannerState", "rank_queue_name"]
