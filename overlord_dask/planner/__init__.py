"""The planner: metadata in, planned steps out, run inside a scheduler plugin.

Data flow: lengths of loaded units (reported by the load tasks) --> ``streams``/``streamset``
(each source's order and cursor) --> a planning policy (``policies``: ``cost`` selects a window by
weighted fair queuing and balances it over ranks by attention cost, ``balance``; ``none`` plans
each step's exact mix, ``mixing`` + ``assign``) --> steps handed out in chunks within the prefetch
bound --> ``ledger`` (pieces and metrics) and ``progress`` (acknowledgements) --> constructor
tasks for the driver to submit; built chunks' descriptors go to the ranks' queues (``plugin``).
``state.PlannerState`` composes the parts; ``pieces`` is the row schema they share.

Names are imported on first use, so that ``from overlord_dask.planner.pieces import ...`` (a
trainer-side helper, say) does not load the scheduler plugin.
"""

_LAZY = {"PlannerPlugin": ".plugin", "PlannerState": ".state"}
__all__ = ["PlannerPlugin", "PlannerState"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
