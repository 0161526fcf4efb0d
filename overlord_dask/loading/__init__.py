"""Loading capacity: per-source worker pools (``pools``), the pool autoscaler (``autoscale``, a
``distributed`` ``Adaptive``), load tasks cut by measured cost (``partition``) and the demand
signals only the planner knows (``signals``: weights ahead, step rate, CPU seconds per token).

Data flow: load tasks report their cost --> ``signals`` (in the scheduler) --> ``overlord_pools``
--> ``autoscale.PoolAdaptive`` (in the service process) --> ``pools`` resize the cluster's
``worker_spec``; the submitter cuts each wanted unit into tasks with ``partition``.
"""
