"""The service process: ``Service`` (start, attach, update, inspect, stop), the ``submitter``
that turns the planner's decisions into Dask tasks, cluster factories (``deploy``: the embedded
LocalCluster, Slurm), the ``overlord`` command (``cli``) and the demo corpus (``demo``).

Data flow: plan --> ``Service.start`` (index sources, register the planner plugin and the worker
plugins, start the submitter) --> the submitter's long poll on the planner --> load and
constructor tasks on the workers.
"""

_LAZY = {"Service": ".service"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
