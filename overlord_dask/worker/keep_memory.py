"""The consumers' allocator setting on every worker of a service (``allocator.keep_freed_memory``).

A worker plugin of its own module: a worker unpickles it by importing this module, and the
allocator module stays free of Dask for the trainers that import it."""

from __future__ import annotations

from distributed.diagnostics.plugin import WorkerPlugin

from ..allocator import keep_freed_memory


class KeepFreedMemory(WorkerPlugin):
    """:func:`~overlord_dask.allocator.keep_freed_memory` on every worker of the service, new ones
    included."""

    name = "overlord-keep-freed-memory"
    idempotent = True

    def setup(self, worker) -> None:
        keep_freed_memory()
