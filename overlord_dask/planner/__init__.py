"""The planner: mixing, packing, assignment, ledger and metrics, run inside a scheduler plugin.

Data flow: lengths of loaded units --> streams (per-source order and cursor) --> select_step
(mix + pack into dp×micro_batches bins) --> assign_bins (bins → (rank, micro-batch)) --> ledger
and metrics --> step plans to the driver, which builds the batches on workers.
"""

from .plugin import HANDLERS, PlannerPlugin, rank_queue_name
from .state import PlannerState

__all__ = ["HANDLERS", "PlannerPlugin", "PlannerState", "rank_queue_name"]
