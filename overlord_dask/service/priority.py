"""Embedded workers yield the cores to the control path and the trainers on the same host.

On one machine (the embedded ``LocalCluster``: the demo, ``overlord serve --workers N``, a
notebook) the loader workers' bulk work (reading, tokenizing, packing, copying blocks) competes
for the cores with the scheduler's event loop, the planner thread and the trainers. Loading runs
ahead of the trainers by ``prefetch_steps``, so it can wait a few milliseconds for a core; the
event loop hands out every batch and acknowledgement, and the trainers are what the service
exists for. With the workers at a lower priority the scheduler loop's longest blocks shrink at
the same steps/s (``benchmarks/control_plane.py`` reports the loop's longest block).

So the embedded cluster's workers run at ``WORKER_NICE`` (``overlord.worker-nice`` in Dask's
config, e.g. ``DASK_OVERLORD__WORKER_NICE=0`` to keep them at the normal priority). Workers on
hosts of their own (Slurm, ``overlord worker``) are left alone. Linux keeps a nice value per
thread, so :func:`lower_priority` renices every thread of the process; threads started later
inherit it from the thread that starts them.
"""

from __future__ import annotations

import os

import dask
from distributed.diagnostics.plugin import WorkerPlugin

WORKER_NICE = 5


def worker_nice() -> int:
    return int(dask.config.get("overlord.worker-nice", WORKER_NICE))


def lower_priority(nice: int) -> int:
    """Lower every thread of this process to at least ``nice`` (never raise one); returns how
    many threads were changed."""
    changed = 0
    if not hasattr(os, "setpriority"):  # Windows: left as it is
        return changed
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: nice is per process there
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            changed = 1
        return changed
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # the thread ended meanwhile
            pass
    return changed


class WorkerPriority(WorkerPlugin):
    """:func:`lower_priority` on every worker of a cluster, new ones included."""

    name = "overlord-worker-priority"
    idempotent = True

    def __init__(self, nice: int):
        self.nice = nice

    def setup(self, worker) -> None:
        lower_priority(self.nice)
