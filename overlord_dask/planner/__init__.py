"""The planner: metadata in, planned steps out. Pure Python and numpy, no Dask: the scheduler
side (``scheduler/``) runs it in a thread of its own, and the tests run it without a cluster.

Data flow: lengths of loaded units (reported by the load tasks) --> ``streams/`` (each source's
order, cursor and lookahead) --> a planning policy (``policies/``: ``cost`` selects a window by
weighted fair queuing and balances it over ranks by attention cost; ``none`` plans each step's
exact mix) --> steps handed out within the prefetch bound --> ``ledger`` (pieces and metrics) and
``progress`` (acknowledgements). ``state.PlannerState`` composes the parts and saves and restores
their state; ``loop`` is its planning loop; ``timeline`` the plan's versions with the planner's own
decisions (``feedback``: what trainers report, turned into decisions by ``learn`` and ``mixing``);
``rewind`` serves a job restarted from an older checkpoint; ``cost_model`` is the cost model; the
row schema they share is ``overlord_dask.pieces``.
"""

_LAZY = {"PlannerState": ".state"}
__all__ = ["PlannerState"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
