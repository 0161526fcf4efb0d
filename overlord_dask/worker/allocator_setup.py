"""The service's allocator settings (``allocator.py``'s docstring says why), on every worker.

A worker plugin of its own module: a worker unpickles it by importing this module, and the
allocator module stays free of Dask and Arrow for the trainers that import it."""

from __future__ import annotations

import pyarrow as pa
from distributed.diagnostics.plugin import WorkerPlugin

from ..allocator import cap_arenas, keep_freed_memory, service_sets

_arrow_pool: bool | None = None


def tune_service_process() -> bool:
    """Keep freed memory, cap the malloc arenas and read through Arrow's system allocator, in
    this process (once; the user's ``MALLOC_ARENA_MAX`` or ``ARROW_DEFAULT_MEMORY_POOL`` kept,
    ``OVERLORD_SERVICE_ALLOCATOR=0`` opts out). True if the arena cap and Arrow's pool are
    ours."""
    global _arrow_pool
    keep_freed_memory()
    capped = cap_arenas()
    if _arrow_pool is None:
        _arrow_pool = False
        if service_sets("ARROW_DEFAULT_MEMORY_POOL"):
            pa.set_memory_pool(pa.system_memory_pool())
            _arrow_pool = True
    return capped and _arrow_pool


class AllocatorSetup(WorkerPlugin):
    """:func:`tune_service_process` on every worker of the service, new ones included (a Slurm
    job's or another pool's worker too)."""

    name = "overlord-allocator-setup"
    idempotent = True

    def setup(self, worker) -> None:
        tune_service_process()
