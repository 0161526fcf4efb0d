"""Observing a run: the one definition of each figure (``figures``: imbalance, mix error, rank
lag, exactly-once), the ``/overlord`` page and its snapshot (``dashboard``), the ``overlord_*``
Prometheus metrics (``prometheus``) and the notebook tables and plots (``tables``).

Everything here reads planner metadata (metrics, ledger, plan versions), never a batch.
"""
