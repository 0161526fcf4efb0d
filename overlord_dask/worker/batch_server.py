"""The payload path: trainers fetch finished batches straight from the worker that holds them.

A ``WorkerPlugin`` adds one request/response handler to every worker (new workers included):
``overlord_fetch(key, rank, steps, cp_rank)`` returns that rank's batches of those steps from the
constructor task stored under ``key``, in wire form (``wire.py``: narrow dtypes, each batch one
buffer that the constructor task packed, sent as a frame of its own: ``wire.Payload``),
or ``{"status": "missing"}`` if this worker does not hold the key (it died and the task
was recomputed elsewhere, say: the consumer then asks the planner where it lives now). One call
carries as many steps as the consumer has room for. The scheduler only ever routes the
descriptor; it never sees a batch.
"""

from __future__ import annotations

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from .. import logs
from ..protocol import Route
from ..wire import Payload, register_payload_with_dask


class BatchServer(WorkerPlugin):
    name = "overlord-batch-server"
    idempotent = True

    def setup(self, worker) -> None:
        logs.install()  # the expected races of shadow copies are not errors
        register_payload_with_dask()
        self.served = 0  # fetches answered with batches (a figure for tests and benchmarks)

        async def overlord_fetch(key: str, rank: int, steps: list[int], cp_rank: int | None = None) -> dict:
            if key not in worker.data:
                return {"status": "missing"}
            chunk = worker.data[key]
            self.served += 1
            return {"status": "OK", "payload": to_serialize(Payload([chunk.packed(s, rank, cp_rank) for s in steps]))}

        worker.handlers[Route.FETCH] = overlord_fetch

    def teardown(self, worker) -> None:
        worker.handlers.pop(Route.FETCH, None)
